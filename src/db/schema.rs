//! The schema's state, judged one way for start-up, `almanac migrate`, the
//! CLI's read commands and `/readyz`.
//!
//! Migrations are one frozen baseline (`migrations/0100_baseline.sql`) plus
//! forward-only migrations after it (0101 and up); versions below 100
//! belong to pre-release builds. `schema.sql` is the schema the migrations
//! produce and a test keeps the two equal. A migration that has landed never
//! changes (a test compares each against its frozen checksum), so a database
//! that applied it never meets a modified copy.
//!
//! [`state`] reads `_sqlx_migrations` and compares it with the migrations
//! embedded in this binary:
//! - `Current`: every embedded migration applied. Ready.
//! - `Ahead`: every embedded migration applied, and newer ones (numbered
//!   above this build's newest) a later release applied. Ready, with a
//!   warning: a release's migrations keep the previous release working (they
//!   add, they do not remove or rename), so a fleet upgrades one process at
//!   a time and can roll back one release. (Builds before this one refused
//!   a newer migration: this holds from this release on.)
//! - `Pending`: migrations to apply; `almanac migrate` (or `run`, `work`,
//!   `consume`) applies them. Not ready.
//! - `PreBaseline`: set up by the last pre-release build (exactly the
//!   squashed 1, 2, 3, 4, 6, 7, 9, 13, 14, 15 and 16, kept in
//!   `tests/fixtures/pre_baseline`). Its schema is the baseline's, so
//!   [`adopt`] records the baseline beside the old rows in one short
//!   transaction, and the later migrations apply as usual. Not ready until
//!   then. Pre-release processes already running keep working (they count
//!   only their own migrations), but a pre-release build refuses to start
//!   on an adopted database (it does not know 100): upgrade every process
//!   before restarting any. The way back, while nothing after the baseline
//!   is applied: `DELETE FROM _sqlx_migrations WHERE version = 100` (the
//!   schema is the same). Once the baseline is recorded, rows below 100 are
//!   history and no longer judged.
//! - `Foreign`: anything else this build cannot stand on: a migration
//!   (run outside a transaction) that stopped part-way, one whose text
//!   differs from this build's (an unreleased branch), an unknown one below
//!   this build's newest (another branch), another pre-release history, an
//!   almanac schema with no record of its migrations, or a record with no
//!   schema. Nothing is applied; the sentence says what to do. Not ready.
//!
//! Every state but `Current` and `Ahead` carries the sentence a person
//! reads, the same in a refused start and in `/readyz`.

use sqlx::migrate::Migrator;
use sqlx::{Connection, PgConnection, PgPool};

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

/// The baseline's version; every version below it is pre-release.
pub const BASELINE: i64 = 100;

const START_OVER: &str = "to start over, use a new database or run \
`DROP SCHEMA IF EXISTS almanac CASCADE; DROP TABLE IF EXISTS _sqlx_migrations;` on this one \
(this deletes every job)";

/// The pre-release versions, as a person reads them.
const PRE_RELEASE: &str = "1, 2, 3, 4, 6, 7, 9, 13, 14, 15, 16";

/// Where a database stands against this binary's migrations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchemaState {
    /// Every embedded migration applied, nothing newer.
    Current,
    /// Every embedded migration applied, and these newer ones too.
    Ahead { versions: Vec<i64> },
    /// These embedded migrations are not applied yet.
    Pending { versions: Vec<i64> },
    /// Set up by the last pre-release build; [`adopt`] records the
    /// baseline (and the migrations after it are then pending).
    PreBaseline,
    /// Applied migrations this build cannot stand on; `reason` says which
    /// and what to do.
    Foreign { reason: String },
}

impl SchemaState {
    /// `None` when ready; else the sentence a person reads.
    pub fn problem(&self) -> Option<String> {
        match self {
            SchemaState::Current | SchemaState::Ahead { .. } => None,
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

    /// What a ready database still deserves a warning for.
    pub fn warning(&self) -> Option<String> {
        match self {
            SchemaState::Ahead { versions } => Some(format!(
                "the database has almanac migration{} {} from a newer release; this build runs \
                 on it, but upgrade it soon",
                if versions.len() == 1 { "" } else { "s" },
                list(versions)
            )),
            _ => None,
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

fn list(versions: &[i64]) -> String {
    versions
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The applied migrations, and whether the `almanac` schema has its tables.
async fn read(conn: &mut PgConnection) -> Result<(Vec<Applied>, bool), sqlx::Error> {
    let (recorded, has_schema): (bool, bool) = sqlx::query_as(
        "SELECT to_regclass('_sqlx_migrations') IS NOT NULL, to_regclass('almanac.jobs') IS NOT NULL",
    )
    .fetch_one(&mut *conn)
    .await?;
    if !recorded {
        return Ok((Vec::new(), has_schema));
    }
    let rows: Vec<(i64, bool, Vec<u8>)> =
        sqlx::query_as("SELECT version, success, checksum FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&mut *conn)
            .await?;
    let applied = rows
        .into_iter()
        .map(|(version, success, checksum)| Applied {
            version,
            success,
            checksum,
        })
        .collect();
    Ok((applied, has_schema))
}

/// Judges the applied migrations against the embedded ones.
fn judge(applied: &[Applied], has_schema: bool) -> SchemaState {
    let embedded: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
    if applied.is_empty() {
        if has_schema {
            return SchemaState::Foreign {
                reason: "the database has an almanac schema but no record of its migrations \
                         (_sqlx_migrations is missing or empty: restored from a dump of the schema \
                         alone?); restore _sqlx_migrations with it, or, "
                    .to_string()
                    + START_OVER,
            };
        }
        return SchemaState::Pending { versions: embedded };
    }
    if !has_schema {
        return SchemaState::Foreign {
            reason: "_sqlx_migrations records almanac migrations but the almanac schema is gone \
                     (dropped, or not restored with it); restore the schema, or, "
                .to_string()
                + START_OVER,
        };
    }
    if let Some(failed) = applied.iter().find(|a| !a.success) {
        // sqlx records success in the migration's own transaction, so this
        // is a migration that ran outside one and stopped part-way.
        return SchemaState::Foreign {
            reason: format!(
                "almanac migration {v} failed half-way on this database; repair it by hand: if \
                 you finish what it does, mark it done (`UPDATE _sqlx_migrations SET success = true \
                 WHERE version = {v}`); if you undo it, delete its row, and start again",
                v = failed.version
            ),
        };
    }
    let (old, new): (Vec<&Applied>, Vec<&Applied>) =
        applied.iter().partition(|a| a.version < BASELINE);
    let adoptable = old.len() == PRE_BASELINE.len()
        && old
            .iter()
            .zip(PRE_BASELINE)
            .all(|(a, (version, sum))| a.version == version && hex(&a.checksum) == sum);
    // Once the baseline is recorded, the rows below it are history.
    let baseline_recorded = new.iter().any(|a| {
        a.version == BASELINE
            && MIGRATOR
                .iter()
                .any(|m| m.version == BASELINE && *m.checksum == *a.checksum)
    });
    if !old.is_empty() && !adoptable && !baseline_recorded {
        let versions: Vec<i64> = old.iter().map(|a| a.version).collect();
        return SchemaState::Foreign {
            reason: format!(
                "the database was set up by a pre-release almanac build (migrations {}) that \
                 this build cannot adopt: only the last pre-release history (migrations \
                 {PRE_RELEASE}, each as that build shipped it) is adopted; if _sqlx_migrations \
                 belongs to another application, give almanac its own database; else {START_OVER}",
                list(&versions)
            ),
        };
    }
    if new.is_empty() {
        return if adoptable {
            SchemaState::PreBaseline
        } else {
            SchemaState::Pending { versions: embedded }
        };
    }
    released(&new, embedded)
}

/// Judges the baseline and later migrations applied (`new`) against the
/// embedded ones.
fn released(new: &[&Applied], embedded: Vec<i64>) -> SchemaState {
    let newest = embedded.iter().copied().max().unwrap_or(BASELINE);
    let mut ahead = Vec::new();
    for a in new {
        match MIGRATOR.iter().find(|m| m.version == a.version) {
            Some(m) if *m.checksum != *a.checksum => {
                return SchemaState::Foreign {
                    reason: format!(
                        "almanac migration {} on this database differs from this build's copy \
                         (released migrations never change: this build or that database came \
                         from an unreleased branch); use the build that migrated it, or {START_OVER}",
                        a.version
                    ),
                }
            }
            Some(_) => {}
            None => ahead.push(a.version),
        }
    }
    let pending: Vec<i64> = embedded
        .into_iter()
        .filter(|v| !new.iter().any(|a| a.version == *v))
        .collect();
    // Numbers only grow: an unknown migration below this build's newest is
    // from another branch, not from a newer release.
    if let Some(stray) = ahead.iter().find(|v| **v < newest) {
        return SchemaState::Foreign {
            reason: format!(
                "the database has almanac migration {stray}, which this build does not know though \
                 it has newer ones: it was migrated by a build from another branch; use that build"
            ),
        };
    }
    match (pending.is_empty(), ahead.is_empty()) {
        (true, true) => SchemaState::Current,
        (true, false) => SchemaState::Ahead { versions: ahead },
        (false, true) => SchemaState::Pending { versions: pending },
        (false, false) => SchemaState::Foreign {
            reason: format!(
                "the database has almanac migration{} {} that this build does not know but lacks \
                 {} that it has: it was migrated by a build from another branch; use that build",
                if ahead.len() == 1 { "" } else { "s" },
                list(&ahead),
                list(&pending)
            ),
        },
    }
}

/// Where the database stands.
pub async fn state(pool: &PgPool) -> Result<SchemaState, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let (applied, has_schema) = read(&mut conn).await?;
    Ok(judge(&applied, has_schema))
}

/// The embedded migrations, run over a history [`state`] has judged: the
/// pre-release rows kept beside the baseline, and a newer release's rows,
/// are not this build's to refuse.
pub fn migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.set_ignore_missing(true);
    migrator
}

/// Records a pre-release database's schema as the baseline, beside its old
/// rows, in one READ COMMITTED transaction under an exclusive lock on
/// `_sqlx_migrations` (waiting at most 10 s for it): a second process
/// starting at the same time waits, then finds it adopted. Does nothing
/// unless the database is [`SchemaState::PreBaseline`].
pub async fn adopt(pool: &PgPool) -> Result<bool, sqlx::Error> {
    // The usual case takes no lock: only a pre-release database is adopted.
    if state(pool).await? != SchemaState::PreBaseline {
        return Ok(false);
    }
    let mut conn = pool.acquire().await?;
    let mut tx = conn
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await?;
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *tx)
        .await?;
    if !exists {
        return Ok(false);
    }
    sqlx::query("SET LOCAL lock_timeout = '10s'")
        .execute(&mut *tx)
        .await?;
    sqlx::query("LOCK TABLE _sqlx_migrations IN EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await?;
    let (applied, has_schema) = read(&mut tx).await?;
    if judge(&applied, has_schema) != SchemaState::PreBaseline {
        tx.rollback().await?;
        return Ok(false);
    }
    let baseline = MIGRATOR
        .iter()
        .find(|m| m.version == BASELINE)
        .expect("the baseline is embedded");
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
    tracing::info!(
        "recorded the pre-release schema (migrations {PRE_RELEASE}) as the baseline (migration {BASELINE})"
    );
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

    fn pre_release() -> Vec<(i64, Vec<u8>)> {
        PRE_BASELINE.iter().map(|(v, s)| (*v, unhex(s))).collect()
    }

    fn this_build() -> Vec<(i64, Vec<u8>)> {
        MIGRATOR
            .iter()
            .map(|m| (m.version, m.checksum.to_vec()))
            .collect()
    }

    fn judged(list: &[(i64, Vec<u8>)]) -> SchemaState {
        let list: Vec<(i64, &[u8])> = list.iter().map(|(v, s)| (*v, s.as_slice())).collect();
        judge(&applied(&list), true)
    }

    #[test]
    fn an_empty_database_lacks_every_migration() {
        let all: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
        assert_eq!(judge(&[], false), SchemaState::Pending { versions: all });
    }

    #[test]
    fn a_schema_without_its_record_is_not_taken_for_an_empty_database() {
        let problem = judge(&[], true).problem().unwrap();
        assert!(problem.contains("no record of its migrations"), "{problem}");
    }

    #[test]
    fn the_exact_pre_release_history_is_adoptable_and_a_partial_one_is_not() {
        assert_eq!(judged(&pre_release()), SchemaState::PreBaseline);
        let partial = &pre_release()[..PRE_BASELINE.len() - 1];
        let problem = judged(partial).problem().unwrap();
        assert!(
            problem.contains("pre-release") && problem.contains("DROP SCHEMA"),
            "{problem}"
        );
    }

    #[test]
    fn an_adopted_database_is_current_with_its_old_rows_kept() {
        let mut list = pre_release();
        list.extend(this_build());
        assert_eq!(judged(&list), SchemaState::Current);
    }

    fn newest() -> i64 {
        MIGRATOR.iter().map(|m| m.version).max().unwrap()
    }

    #[test]
    fn a_newer_releases_migration_is_ready_with_a_warning() {
        // One version past this build's latest.
        let newer = newest() + 1;
        let mut list = this_build();
        list.push((newer, b"newer".to_vec()));
        let state = judged(&list);
        assert_eq!(state.problem(), None);
        let warning = state.warning().unwrap();
        assert!(
            warning.contains(&format!("migration {newer}")) && warning.contains("newer"),
            "{warning}"
        );
    }

    #[test]
    fn an_unknown_migration_while_this_builds_own_are_missing_is_another_branch() {
        let list = [(newest() + 50, b"other".to_vec())];
        let problem = judged(&list).problem().unwrap();
        assert!(problem.contains("another branch"), "{problem}");
    }

    #[test]
    fn a_record_without_its_schema_is_not_ready() {
        let problem = judge(&applied(&[(BASELINE, b"")]), false)
            .problem()
            .unwrap();
        assert!(problem.contains("schema is gone"), "{problem}");
    }

    #[test]
    fn once_the_baseline_is_recorded_older_rows_are_history() {
        // Even a pre-release history this build would not adopt.
        let mut list = pre_release()[..3].to_vec();
        list.extend(this_build());
        assert_eq!(judged(&list), SchemaState::Current);
    }

    #[test]
    fn a_modified_migration_is_named_and_refused() {
        let list = [(BASELINE, b"other text".to_vec())];
        let problem = judged(&list).problem().unwrap();
        assert!(
            problem.contains(&format!("migration {BASELINE} on this database differs")),
            "{problem}"
        );
    }

    #[test]
    fn a_failed_migration_is_named_without_advice_to_drop_everything() {
        let mut list = applied(&[(BASELINE, b"")]);
        list[0].success = false;
        let problem = judge(&list, true).problem().unwrap();
        assert!(
            problem.contains(&format!("migration {BASELINE} failed")),
            "{problem}"
        );
        assert!(!problem.contains("DROP SCHEMA"), "{problem}");
    }
}
