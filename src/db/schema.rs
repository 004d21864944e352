//! The schema's state, judged one way for start-up, `almanac migrate`, the
//! CLI's read commands and `/readyz`.
//!
//! Migrations are one frozen baseline (`migrations/0001_baseline.sql`) plus
//! forward-only migrations after it; `schema.sql` is the schema they produce
//! and a test keeps the two equal. A migration that has landed never changes
//! (a test compares each against its frozen checksum), so a database that
//! applied it never meets a modified copy.
//!
//! [`state`] reads `_sqlx_migrations` and compares it with the migrations
//! embedded in this binary. Only [`SchemaState::Current`] is ready; every
//! other state carries the sentence a person reads, the same in a refused
//! start and in `/readyz`:
//! - `Pending`: migrations to apply; `almanac migrate` (or `run`, `work`,
//!   `consume`) applies them.
//! - `PreBaseline`: set up by a pre-release build that applied exactly the
//!   squashed migrations 1-16 (the ones kept in `tests/fixtures/pre_baseline`).
//!   Its schema is the baseline's, so [`adopt`] records it as the baseline in
//!   one short transaction, and the later migrations apply as usual.
//! - `Foreign`: anything else this build cannot stand on: a migration
//!   applied by a newer build, one that failed half-way, one whose text
//!   differs from this build's, or an other pre-release history. Nothing is
//!   applied; the sentence says what to do.

use sqlx::{PgConnection, PgPool};

use super::MIGRATOR;

/// The pre-release migrations the baseline squashed, with the SHA-384 of
/// each file as the last pre-release build shipped it.
const PRE_BASELINE: [(i64, &str); 11] = [
    (1, "69e2bfbbc84ae2f9684da19e2dd384872517f1655f04bd211b86596165d9b07bc51ea28375661aa34a709c5ab63d6345"),
    (2, "5987741a0d26abb1980d33841534af3e8547526bc52612867ec945920045efec888df92b7dc02d2b310222c38916e171"),
    (3, "c7ae4e6dae6528015045825bcb4241a0ff22ff68996ab1fd42ab89a54331a381e7874db488eb1b9bb1ed03e315c232f5"),
    (4, "6421e3a116945418f2ec9d951d5ab2b8033aa2593a724b754619e909c383efb9b9c31d5129593c71fae6ebcb74ec6a50"),
    (6, "f92f3a34a0e83c601fec9ed99076a136c9d4ac40d4c3f5db4b27c93fee232df00b08d449341277e69b35a7076693ba64"),
    (7, "6ca15af9732773851f2ce0827f80a3af8e4e30987c73eab503f645fd6991e73c91d7ddfb8f75abeed7fe5ea18464b55a"),
    (9, "20ac58e168c764861921102d58118b31307a30cdb12a42e47e4eba4f345a4b5070eaf73ab8df61b8f8f6cd52bd81f68f"),
    (13, "2392102a2e13bea0f92aa65e00be837770c1b2cbe31ccb37165a2e82b03e28ec7d58c1bfa1b3e6208d0234883e2ca024"),
    (14, "af13bd1a8d4cb5fab5db797659560bdb28c1672df033e8047699c668cf12fbbd5e3869fb15985a3900b06115fd4cee84"),
    (15, "5c11f622a9c9c9865aac6f0a6968ac4b7b822ea04de09f33dcf43de7788bcbf2a45157833ba29a42e4a396117e4b71e4"),
    (16, "6ab4aa925f16a4a78124b8188aa7f972b5d7038370c41545537883e3ea7f842fb654fc666bd0f2bcb4698002842cf58d"),
];

/// The baseline's version.
pub const BASELINE: i64 = 1;

const FIX: &str = "to start over, use a new database or run \
`DROP SCHEMA almanac CASCADE; DROP TABLE _sqlx_migrations;` on this one (this deletes every job)";

/// Where a database stands against this binary's migrations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchemaState {
    /// Every embedded migration applied, nothing else.
    Current,
    /// These embedded migrations are not applied yet.
    Pending { versions: Vec<i64> },
    /// Set up by the pre-release migrations 1-16; [`adopt`] records it as
    /// the baseline (and the migrations after it are then pending).
    PreBaseline,
    /// Applied migrations this build cannot stand on; `reason` says which
    /// and what to do.
    Foreign { reason: String },
}

impl SchemaState {
    /// `None` when ready; else the sentence a person reads.
    pub fn problem(&self) -> Option<String> {
        match self {
            SchemaState::Current => None,
            SchemaState::Pending { versions } => Some(format!(
                "the database lacks {} almanac migration{}; run `almanac migrate`",
                versions.len(),
                if versions.len() == 1 { "" } else { "s" }
            )),
            SchemaState::PreBaseline => Some(
                "the database has the pre-release almanac schema; `almanac migrate` \
                 records it as the baseline (nothing in it changes)"
                    .to_string(),
            ),
            SchemaState::Foreign { reason } => Some(reason.clone()),
        }
    }
}

/// One applied migration as `_sqlx_migrations` records it.
struct Applied {
    version: i64,
    success: bool,
    checksum: Vec<u8>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn applied(conn: &mut PgConnection) -> Result<Vec<Applied>, sqlx::Error> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        return Ok(Vec::new());
    }
    let rows: Vec<(i64, bool, Vec<u8>)> =
        sqlx::query_as("SELECT version, success, checksum FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&mut *conn)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(version, success, checksum)| Applied {
            version,
            success,
            checksum,
        })
        .collect())
}

/// Judges the applied migrations against the embedded ones.
fn judge(applied: &[Applied]) -> SchemaState {
    let is_pre_baseline = applied.len() == PRE_BASELINE.len()
        && applied.iter().zip(PRE_BASELINE).all(|(a, (version, sum))| {
            a.success && a.version == version && hex(&a.checksum) == sum
        });
    if is_pre_baseline {
        return SchemaState::PreBaseline;
    }
    if let Some(failed) = applied.iter().find(|a| !a.success) {
        return SchemaState::Foreign {
            reason: format!(
                "almanac migration {} failed half-way on this database and must be repaired by hand; {FIX}",
                failed.version
            ),
        };
    }
    for a in applied {
        match MIGRATOR.iter().find(|m| m.version == a.version) {
            None if a.version <= PRE_BASELINE[PRE_BASELINE.len() - 1].0 => {
                return SchemaState::Foreign {
                    reason: format!(
                        "the database was set up by a pre-release almanac build whose migrations \
                         (versions {}) this build cannot adopt; {FIX}",
                        applied
                            .iter()
                            .map(|a| a.version.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                }
            }
            None => {
                return SchemaState::Foreign {
                    reason: format!(
                        "the database has almanac migration {}, which this build does not know: \
                         it was migrated by a newer almanac; run that version",
                        a.version
                    ),
                }
            }
            Some(m) if *m.checksum != *a.checksum => {
                return SchemaState::Foreign {
                    reason: if a.version == BASELINE {
                        format!(
                            "the database was set up by a pre-release almanac build whose migrations \
                             this build cannot adopt; {FIX}"
                        )
                    } else {
                        format!(
                            "almanac migration {} on this database differs from this build's copy \
                             (migrations are frozen once released: this build or that database \
                             came from an unreleased branch); {FIX}",
                            a.version
                        )
                    },
                }
            }
            Some(_) => {}
        }
    }
    let versions: Vec<i64> = MIGRATOR
        .iter()
        .map(|m| m.version)
        .filter(|v| !applied.iter().any(|a| a.version == *v))
        .collect();
    if versions.is_empty() {
        SchemaState::Current
    } else {
        SchemaState::Pending { versions }
    }
}

/// Where the database stands.
pub async fn state(pool: &PgPool) -> Result<SchemaState, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    Ok(judge(&applied(&mut conn).await?))
}

/// Records a pre-release database as the baseline, in one transaction under
/// an exclusive lock on `_sqlx_migrations` (a second process starting at
/// the same time waits, then finds it adopted). Does nothing unless the
/// database is [`SchemaState::PreBaseline`].
pub async fn adopt(pool: &PgPool) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *tx)
        .await?;
    if !exists {
        return Ok(false);
    }
    sqlx::query("LOCK TABLE _sqlx_migrations IN EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await?;
    if judge(&applied(&mut tx).await?) != SchemaState::PreBaseline {
        return Ok(false);
    }
    let baseline = MIGRATOR
        .iter()
        .find(|m| m.version == BASELINE)
        .expect("the baseline is embedded");
    sqlx::query("DELETE FROM _sqlx_migrations")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES ($1, $2, true, $3, 0)",
    )
    .bind(baseline.version)
    .bind(&*baseline.description)
    .bind(&*baseline.checksum)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    tracing::info!("recorded the pre-release schema (migrations 1-16) as the baseline");
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(list: &[(i64, &[u8])]) -> Vec<Applied> {
        list.iter()
            .map(|(version, checksum)| Applied {
                version: *version,
                success: true,
                checksum: checksum.to_vec(),
            })
            .collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn an_empty_database_lacks_every_migration() {
        let all: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
        assert_eq!(judge(&[]), SchemaState::Pending { versions: all });
    }

    #[test]
    fn the_exact_pre_release_history_is_adoptable_and_a_partial_one_is_not() {
        let full: Vec<(i64, Vec<u8>)> = PRE_BASELINE.iter().map(|(v, s)| (*v, unhex(s))).collect();
        let list: Vec<(i64, &[u8])> = full.iter().map(|(v, s)| (*v, s.as_slice())).collect();
        assert_eq!(judge(&applied(&list)), SchemaState::PreBaseline);
        let partial = &list[..list.len() - 1];
        let state = judge(&applied(partial));
        let SchemaState::Foreign { reason } = state else {
            panic!("{state:?}")
        };
        assert!(
            reason.contains("pre-release") && reason.contains("DROP SCHEMA"),
            "{reason}"
        );
    }

    #[test]
    fn a_migration_from_a_newer_build_says_so() {
        let mut list: Vec<(i64, &[u8])> =
            MIGRATOR.iter().map(|m| (m.version, &*m.checksum)).collect();
        list.push((9999, b"x"));
        let problem = judge(&applied(&list)).problem().unwrap();
        assert!(
            problem.contains("migration 9999") && problem.contains("newer almanac"),
            "{problem}"
        );
    }

    #[test]
    fn a_modified_baseline_is_not_taken_for_the_current_schema() {
        let list = [(BASELINE, b"other text".as_slice())];
        assert!(matches!(
            judge(&applied(&list)),
            SchemaState::Foreign { .. }
        ));
    }

    #[test]
    fn a_failed_migration_is_named() {
        let mut list = applied(&[(BASELINE, b"")]);
        list[0].success = false;
        let problem = judge(&list).problem().unwrap();
        assert!(problem.contains("migration 1 failed"), "{problem}");
    }
}
