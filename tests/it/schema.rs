//! The schema a release stands on: `schema.sql` is what the migrations
//! produce, landed migrations never change, a pre-release database is
//! adopted with its data, an upgrade from the baseline keeps data, and
//! `/readyz` says what start-up says about every migration state.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use almanac::db::{self, SchemaState, MIGRATOR};
use almanac::http::HttpServer;
use almanac::queue::{self, Claim, NewJob};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness;
use crate::harness::http::get;

const SCHEMA_SQL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/schema.sql");

/// `pg_dump --schema-only` of the `almanac` schema, without the lines that
/// differ between dumps of one schema (server version, the random
/// `\restrict` key of newer pg_dump builds).
fn dump(pool: &PgPool) -> String {
    let options = pool.connect_options();
    let out = Command::new("pg_dump")
        .args([
            "--schema-only",
            "--no-owner",
            "--no-privileges",
            "-n",
            "almanac",
        ])
        .args(["-h", options.get_host()])
        .args(["-p", &options.get_port().to_string()])
        .args(["-U", options.get_username()])
        .arg(options.get_database().expect("test database"))
        .output()
        .expect("pg_dump (Debian: postgresql-client) runs");
    assert!(
        out.status.success(),
        "pg_dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| {
            !l.starts_with("\\restrict")
                && !l.starts_with("\\unrestrict")
                && !l.starts_with("-- Dumped from")
                && !l.starts_with("-- Dumped by")
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

fn assert_schema_sql(pool: &PgPool) {
    let actual = dump(pool);
    if std::env::var_os("ALMANAC_BLESS_SCHEMA").is_some() {
        std::fs::write(SCHEMA_SQL, &actual).unwrap();
    }
    let expected = std::fs::read_to_string(SCHEMA_SQL).unwrap_or_default();
    if actual != expected {
        let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("schema.sql.actual");
        std::fs::write(&path, &actual).unwrap();
        panic!(
            "schema.sql differs from the schema the migrations produce (written to {}); \
             after a new migration, run `ALMANAC_BLESS_SCHEMA=1 cargo test --test it schema::` and commit schema.sql",
            path.display()
        );
    }
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn schema_sql_is_what_the_migrations_produce(pool: PgPool) {
    assert_schema_sql(&pool);
}

#[test]
fn landed_migrations_never_change() {
    let frozen = include_str!("../fixtures/frozen_migrations.txt");
    let mut listed = 0;
    for line in frozen
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let (version, sum) = line.split_once(' ').expect("`VERSION SHA384` per line");
        let version: i64 = version.parse().unwrap();
        let migration = MIGRATOR.iter().find(|m| m.version == version);
        let migration = migration.unwrap_or_else(|| {
            panic!("migration {version} landed and is frozen, but it is gone from migrations/: restore it")
        });
        let actual: String = migration
            .checksum
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            actual, sum,
            "migration {version} ({}) changed after it landed: databases that applied it refuse to start; \
             restore it and put the change in a new migration",
            migration.description
        );
        listed += 1;
    }
    assert!(listed >= 1, "the baseline is frozen");
    // Migrations after the frozen ones are new on this branch; they are
    // frozen when they land.
    for m in MIGRATOR
        .iter()
        .filter(|m| !frozen.contains(&format!("{:04} ", m.version)))
    {
        let sum: String = m.checksum.iter().map(|b| format!("{b:02x}")).collect();
        eprintln!("not frozen yet (add when it lands): {:04} {sum}", m.version);
    }
}

/// Jobs in every status, a schedule with its ledger, a route: what an
/// upgrade must keep.
async fn write_data(pool: &PgPool) {
    sqlx::raw_sql(
        "INSERT INTO almanac.jobs (kind, payload, status, attempts, finished_at, idempotency_key)
         VALUES ('mail', '{\"to\":\"ada\"}', 'ready', 0, NULL, 'k1'),
                ('mail', '{}', 'done', 1, now(), 'k2'),
                ('mail', '{}', 'dead', 5, now(), 'k3');
         INSERT INTO almanac.schedules (name, cron, timezone, kind, payload, catchup, catchup_window,
                                        overlap, max_attempts, enabled, definition_hash)
         VALUES ('nightly', '0 2 * * *', 'UTC', 'mail', '{}', 'all', '7 days', 'allow', 5, true, 'h');
         INSERT INTO almanac.schedule_runs (schedule, logical_run, fire_at, job_id, source, outcome)
         SELECT 'nightly', '2026-01-01', now(), id, 'tick', 'emitted' FROM almanac.jobs WHERE idempotency_key = 'k2';
         INSERT INTO almanac.routes (kind, mode) VALUES ('mail', 'db');",
    )
    .execute(pool)
    .await
    .unwrap();
}

async fn check_data(pool: &PgPool) {
    let jobs: Vec<(String, String)> =
        sqlx::query_as("SELECT idempotency_key, status FROM almanac.jobs ORDER BY id")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(
        jobs,
        [("k1", "ready"), ("k2", "done"), ("k3", "dead")]
            .map(|(k, s)| (k.to_string(), s.to_string()))
    );
    let ledger: (String, Option<i64>) =
        sqlx::query_as("SELECT logical_run, job_id FROM almanac.schedule_runs")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(ledger.0, "2026-01-01");
    assert!(ledger.1.is_some());
    // The old rows still work: the ready job is claimed and completed, and a
    // new job is enqueued behind it.
    let kinds = vec!["mail".to_string()];
    let claimed = queue::claim(
        pool,
        &Claim {
            kinds: &kinds,
            limit: 10,
            lease: Duration::from_secs(30),
        },
    )
    .await
    .unwrap();
    assert_eq!(claimed.len(), 1);
    let (id, token) = claimed[0].lease().unwrap();
    assert!(queue::complete(pool, id, token).await.unwrap().is_held());
    let mut conn = pool.acquire().await.unwrap();
    queue::enqueue(&mut conn, &NewJob::new("mail").idempotency_key("k4"))
        .await
        .unwrap();
    assert_eq!(db::schema::state(pool).await.unwrap(), SchemaState::Current);
}

/// A database the last pre-release build set up (migrations 1-16, kept in
/// `tests/fixtures/pre_baseline`) starts under this build: it is recorded
/// as the baseline, its data is whole, and its schema is `schema.sql`.
#[sqlx::test(migrations = false)]
async fn a_pre_release_database_is_adopted_with_its_data(pool: PgPool) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pre_baseline");
    let old = sqlx::migrate::Migrator::new(Path::new(dir)).await.unwrap();
    old.run(&pool).await.unwrap();
    write_data(&pool).await;
    assert_eq!(
        db::schema::state(&pool).await.unwrap(),
        SchemaState::PreBaseline
    );
    let (status, body) = readyz(&pool).await;
    assert_eq!(status, 503);
    assert!(body.contains("pre-release almanac schema"), "{body}");

    // Two processes starting at once: both start, the baseline is recorded once.
    let (a, b) = tokio::join!(db::migrate(&pool), db::migrate(&pool));
    a.unwrap();
    b.unwrap();
    // The baseline is recorded beside the old rows, which stay: a
    // pre-release process still running keeps seeing its whole history.
    let versions: Vec<i64> = sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY 1")
        .fetch_all(&pool)
        .await
        .unwrap();
    let mut expected: Vec<i64> = old.iter().map(|m| m.version).collect();
    expected.extend(MIGRATOR.iter().map(|m| m.version));
    assert_eq!(versions, expected);
    check_data(&pool).await;
    assert_schema_sql(&pool);
    // A second start finds nothing to do.
    db::migrate(&pool).await.unwrap();
}

/// The baseline alone, data written, then the head applied: the data is
/// whole. (With the baseline as the only migration the head is the
/// baseline; each later migration runs here over the baseline's data.)
#[sqlx::test(migrations = false)]
async fn an_upgrade_from_the_baseline_keeps_the_data(pool: PgPool) {
    let dir = tempdir();
    for m in MIGRATOR
        .iter()
        .filter(|m| m.version == db::schema::BASELINE)
    {
        let name = format!("{:04}_{}.sql", m.version, m.description.replace(' ', "_"));
        std::fs::write(Path::new(&dir).join(name), &*m.sql).unwrap();
    }
    let baseline = sqlx::migrate::Migrator::new(Path::new(&dir)).await.unwrap();
    baseline.run(&pool).await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    write_data(&pool).await;
    db::migrate(&pool).await.unwrap();
    check_data(&pool).await;
}

fn tempdir() -> String {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("baseline-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.to_string_lossy().into_owned()
}

async fn readyz(pool: &PgPool) -> (u16, String) {
    let server = HttpServer::bind(
        "127.0.0.1:0".parse().unwrap(),
        None,
        &pool.connect_options(),
    )
    .await
    .unwrap();
    let addr = server.local_addr().to_string();
    let stop = CancellationToken::new();
    let serving = tokio::spawn(server.run(stop.clone()));
    let reply = get(&addr, "/readyz").await.unwrap();
    stop.cancel();
    serving.await.unwrap().unwrap();
    (reply.status, reply.body.trim().to_string())
}

fn almanac_migrate(pool: &PgPool) -> (bool, String) {
    let out = harness::almanac()
        .arg("migrate")
        .env("DATABASE_URL", harness::database_url(pool))
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// An empty database is not ready, with the count of what it lacks, until
/// the migrations are applied.
#[sqlx::test(migrations = false)]
async fn readyz_is_503_naming_missing_migrations_until_they_are_applied(pool: PgPool) {
    let n = MIGRATOR.iter().count();
    let plural = if n == 1 { "" } else { "s" };
    assert_eq!(
        readyz(&pool).await,
        (
            503,
            format!("the database lacks {n} almanac migration{plural}; run `almanac migrate`")
        )
    );
    db::migrate(&pool).await.unwrap();
    assert_eq!(readyz(&pool).await, (200, "ready".to_string()));
}

/// A database a newer release migrated (a version this build does not know
/// after all of its own) is used as it is by `almanac migrate` and ready at
/// `/readyz`, so a fleet can upgrade one process at a time; both warn.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn readyz_and_start_up_both_accept_a_database_from_a_newer_release(pool: PgPool) {
    let newer = db::schema::BASELINE + 50;
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES ($1, 'from the future', true, '\\x00', 0)",
    )
    .bind(newer)
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(readyz(&pool).await, (200, "ready".to_string()));
    let (ok, stderr) = almanac_migrate(&pool);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains(&format!("almanac migration {newer} from a newer release")),
        "{stderr}"
    );
}

/// A database this build cannot stand on (here: the baseline's text differs
/// from this build's, as after an unreleased branch) is refused by `almanac
/// migrate` and by `/readyz` with the same sentence, and nothing is applied.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn readyz_and_start_up_refuse_a_modified_migration_with_one_sentence(pool: PgPool) {
    sqlx::query("UPDATE _sqlx_migrations SET checksum = '\\x00' WHERE version = $1")
        .bind(db::schema::BASELINE)
        .execute(&pool)
        .await
        .unwrap();
    let expected = format!(
        "almanac migration {} on this database differs from this build's copy",
        db::schema::BASELINE
    );
    let (status, body) = readyz(&pool).await;
    assert_eq!(status, 503);
    assert!(body.starts_with(&expected), "{body}");
    let (ok, stderr) = almanac_migrate(&pool);
    assert!(!ok);
    assert!(stderr.contains(&body), "{stderr}");
}

/// A half-applied migration is named the same way by both.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_failed_migration_is_not_ready_and_not_started(pool: PgPool) {
    sqlx::query("UPDATE _sqlx_migrations SET success = false WHERE version = $1")
        .bind(db::schema::BASELINE)
        .execute(&pool)
        .await
        .unwrap();
    let state = db::schema::state(&pool).await.unwrap();
    let problem = state.problem().expect("not ready");
    assert!(
        problem.contains(&format!(
            "migration {} failed half-way",
            db::schema::BASELINE
        )),
        "{problem}"
    );
    let err = db::migrate(&pool).await.unwrap_err().to_string();
    assert!(err.ends_with(&problem), "{err}");
}
