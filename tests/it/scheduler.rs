//! The scheduler against a real PostgreSQL: catch-up policies after an
//! outage (injected clock), overlap, backfill and gaps, and split brain.

use std::collections::HashMap;
use std::time::Duration;

use almanac::scheduler::backfill;
use almanac::scheduler::spec::{load_sources, Schedule};
use almanac::scheduler::ticker::Ticker;
use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::harness::{self, count};

fn schedules(text: &str) -> Vec<Schedule> {
    load_sources(&[("test.toml".into(), text.to_string())]).unwrap()
}

async fn db_now(pool: &PgPool) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT now()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// schedule -> [(logical_run, source, outcome, has job)]
async fn ledger(pool: &PgPool) -> HashMap<String, Vec<(String, String, String, bool)>> {
    let rows: Vec<(String, String, String, String, bool)> = sqlx::query_as(
        "SELECT schedule, logical_run, source, outcome, job_id IS NOT NULL FROM almanac.schedule_runs ORDER BY schedule, fire_at",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut out: HashMap<String, Vec<_>> = HashMap::new();
    for (s, run, source, outcome, job) in rows {
        out.entry(s).or_default().push((run, source, outcome, job));
    }
    out
}

fn day(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d").to_string()
}

const GRACE: Duration = Duration::from_secs(60);

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn after_an_outage_each_catchup_policy_accounts_for_every_missed_run(pool: PgPool) {
    let text = r#"
[all]
cron = "0 3 * * *"
catchup = "all"
catchup_window = "3d"
[latest]
cron = "0 3 * * *"
catchup = "latest"
[none]
cron = "0 3 * * *"
catchup = "none"
"#;
    let mut conn = pool.acquire().await.unwrap();
    let mut ticker = Ticker::load(&mut conn, schedules(text), GRACE)
        .await
        .unwrap();
    // The first run after the schedules were synced, seen on time.
    let first = ticker.next_wake().unwrap();
    assert!(first > db_now(&pool).await);
    let on_time = ticker
        .tick(&mut conn, first + chrono::Duration::seconds(1))
        .await
        .unwrap();
    assert_eq!(on_time.emitted, 3);

    // Down for six days; back 30 seconds after a run.
    let back = first + chrono::Duration::days(6) + chrono::Duration::seconds(30);
    let report = ticker.tick(&mut conn, back).await.unwrap();
    let ledger = ledger(&pool).await;
    let d = |n: i64| day(first + chrono::Duration::days(n));
    let row = |n: i64, source: &str, outcome: &str| {
        (
            d(n),
            source.to_string(),
            outcome.to_string(),
            outcome == "emitted",
        )
    };
    assert_eq!(
        ledger["all"],
        vec![
            row(0, "tick", "emitted"),
            row(1, "catchup", "skipped_catchup"), // missed by more than the 3-day window
            row(2, "catchup", "skipped_catchup"),
            row(3, "catchup", "skipped_catchup"), // 3 days and 30 seconds ago
            row(4, "catchup", "emitted"),
            row(5, "catchup", "emitted"),
            row(6, "tick", "emitted"),
        ]
    );
    assert_eq!(
        ledger["latest"],
        vec![
            row(0, "tick", "emitted"),
            row(1, "catchup", "skipped_catchup"),
            row(2, "catchup", "skipped_catchup"),
            row(3, "catchup", "skipped_catchup"),
            row(4, "catchup", "skipped_catchup"),
            row(5, "catchup", "skipped_catchup"),
            row(6, "tick", "emitted"),
        ]
    );
    assert_eq!(ledger["none"], ledger["latest"]);
    assert_eq!(
        (report.emitted, report.skipped_catchup),
        (3 + 1 + 1, 3 + 5 + 5)
    );

    // Down again, waking up between runs: `latest` emits the most recent missed run.
    let back = first + chrono::Duration::days(9) + chrono::Duration::hours(5);
    ticker.tick(&mut conn, back).await.unwrap();
    let ledger = self::ledger(&pool).await;
    assert_eq!(
        ledger["latest"][7..],
        [
            row(7, "catchup", "skipped_catchup"),
            row(8, "catchup", "skipped_catchup"),
            row(9, "catchup", "emitted")
        ]
    );
    assert_eq!(
        ledger["none"][7..],
        [
            row(7, "catchup", "skipped_catchup"),
            row(8, "catchup", "skipped_catchup"),
            row(9, "catchup", "skipped_catchup")
        ]
    );

    // Jobs: one per emitted run, keyed by logical run, due at the fire time.
    let jobs: Vec<(String, String, String, DateTime<Utc>)> = sqlx::query_as(
        "SELECT j.idempotency_key, j.schedule, j.logical_run, j.run_at FROM almanac.jobs j ORDER BY j.id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let emitted = count(
        &pool,
        "SELECT count(*) FROM almanac.schedule_runs WHERE outcome = 'emitted'",
    )
    .await;
    assert_eq!(jobs.len() as i64, emitted);
    assert!(jobs
        .iter()
        .any(|(key, _, _, at)| key == &format!("schedule:all:{}", d(4))
            && *at == first + chrono::Duration::days(4)));
    assert!(jobs
        .iter()
        .all(|(key, s, run, _)| key == &format!("schedule:{s}:{run}")));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn overlap_skip_records_runs_while_the_previous_job_is_unfinished(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let mut ticker = Ticker::load(
        &mut conn,
        schedules("[sync]\ncron = \"*/5 * * * *\"\noverlap = \"skip\"\n"),
        GRACE,
    )
    .await
    .unwrap();
    let first = ticker.next_wake().unwrap();
    let at =
        |minutes: i64| first + chrono::Duration::minutes(minutes) + chrono::Duration::seconds(1);
    assert_eq!(ticker.tick(&mut conn, at(0)).await.unwrap().emitted, 1);
    assert_eq!(
        ticker.tick(&mut conn, at(5)).await.unwrap().skipped_overlap,
        1
    );
    sqlx::query("UPDATE almanac.jobs SET status = 'dead', finished_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(ticker.tick(&mut conn, at(10)).await.unwrap().emitted, 1);
    let outcomes: Vec<String> = ledger(&pool).await["sync"]
        .iter()
        .map(|r| r.2.clone())
        .collect();
    assert_eq!(outcomes, vec!["emitted", "skipped_overlap", "emitted"]);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn two_leaders_ticking_the_same_runs_emit_each_once(pool: PgPool) {
    let text = "[every-minute]\ncron = \"* * * * *\"\n";
    let (mut a, mut b) = (pool.acquire().await.unwrap(), pool.acquire().await.unwrap());
    let mut one = Ticker::load(&mut a, schedules(text), GRACE).await.unwrap();
    let mut two = Ticker::load(&mut b, schedules(text), GRACE).await.unwrap();
    let start = one.next_wake().unwrap();
    for minute in 0..30 {
        let now = start + chrono::Duration::minutes(minute) + chrono::Duration::seconds(2);
        let (x, y) = tokio::join!(one.tick(&mut a, now), two.tick(&mut b, now));
        let (x, y) = (x.unwrap(), y.unwrap());
        assert_eq!(
            x.emitted + y.emitted,
            1,
            "minute {minute}: emitted by both or neither"
        );
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 30);
    assert_eq!(
        count(
            &pool,
            "SELECT count(DISTINCT logical_run) FROM almanac.jobs"
        )
        .await,
        30
    );
}

fn daily() -> Schedule {
    schedules(
        "[report]\ncron = \"30 2 * * *\"\ntimezone = \"America/New_York\"\nkind = \"nightly\"\n",
    )
    .remove(0)
}

/// A backfill range in the past.
fn past(from: DateTime<Utc>, to: DateTime<Utc>, dry_run: bool) -> backfill::Range {
    backfill::Range {
        from,
        to,
        dry_run,
        allow_future: false,
    }
}

fn at(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn backfill_twice_gives_the_same_ledger_and_no_duplicate_job(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let s = daily();
    let (from, to) = (at("2026-03-01T05:00:00Z"), at("2026-04-01T04:00:00Z"));
    let dry = backfill::backfill(&mut conn, &s, past(from, to, true), |_, _| {})
        .await
        .unwrap();
    assert_eq!((dry.in_range, dry.emitted), (31, 31));
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.schedule_runs").await,
        0,
        "a dry run writes nothing"
    );

    let first = backfill::backfill(&mut conn, &s, past(from, to, false), |_, _| {})
        .await
        .unwrap();
    assert_eq!((first.emitted, first.already_emitted), (31, 0));
    let before = ledger(&pool).await;
    let again = backfill::backfill(&mut conn, &s, past(from, to, false), |_, _| {})
        .await
        .unwrap();
    assert_eq!(
        (
            again.emitted,
            again.emitted_after_skip,
            again.already_emitted
        ),
        (0, 0, 31)
    );
    assert_eq!(ledger(&pool).await, before);
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 31);
    // The spring-forward day is there once, at 03:30 EDT.
    let (run_at,): (DateTime<Utc>,) =
        sqlx::query_as("SELECT run_at FROM almanac.jobs WHERE logical_run = '2026-03-08'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(run_at, at("2026-03-08T07:30:00Z"));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_backfill_after_retention_deleted_the_jobs_emits_nothing_new(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let s = daily();
    let (from, to) = (at("2026-01-01T05:00:00Z"), at("2026-01-11T05:00:00Z"));
    backfill::backfill(&mut conn, &s, past(from, to, false), |_, _| {})
        .await
        .unwrap();
    // Retention: the finished jobs are deleted; the ledger keeps the runs.
    sqlx::query("UPDATE almanac.jobs SET status = 'done', finished_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM almanac.jobs")
        .execute(&pool)
        .await
        .unwrap();
    let again = backfill::backfill(&mut conn, &s, past(from, to, false), |_, _| {})
        .await
        .unwrap();
    assert_eq!((again.emitted, again.already_emitted), (0, 10));
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 0);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.schedule_runs WHERE job_id IS NULL"
        )
        .await,
        10
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn gaps_finds_holes_and_backfill_fills_them_including_skipped_runs(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let s = daily();
    let (from, to) = (at("2026-02-01T05:00:00Z"), at("2026-02-11T05:00:00Z"));
    backfill::backfill(&mut conn, &s, past(from, to, false), |_, _| {})
        .await
        .unwrap();
    sqlx::query(
        "DELETE FROM almanac.schedule_runs WHERE logical_run IN ('2026-02-03', '2026-02-07')",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("DELETE FROM almanac.jobs WHERE logical_run IN ('2026-02-03', '2026-02-07')")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE almanac.schedule_runs SET outcome = 'skipped_catchup', job_id = NULL WHERE logical_run = '2026-02-05'").execute(&pool).await.unwrap();
    sqlx::query("DELETE FROM almanac.jobs WHERE logical_run = '2026-02-05'")
        .execute(&pool)
        .await
        .unwrap();

    let holes: Vec<String> = backfill::gaps(&mut conn, &s, from, to)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.logical_run)
        .collect();
    assert_eq!(
        holes,
        vec!["2026-02-03", "2026-02-07"],
        "a skipped run is accounted for, not a gap"
    );

    let filled = backfill::backfill(&mut conn, &s, past(from, to, false), |_, _| {})
        .await
        .unwrap();
    assert_eq!(
        (
            filled.emitted,
            filled.emitted_after_skip,
            filled.already_emitted
        ),
        (2, 1, 7)
    );
    assert!(backfill::gaps(&mut conn, &s, from, to)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.schedule_runs WHERE outcome = 'emitted' AND job_id IS NOT NULL").await, 10);
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 10);
}

/// Down Monday to Friday, Wednesday backfilled, back on Friday: the
/// scheduler's cursor is its own last planned run (Sunday), so Monday,
/// Tuesday and Thursday go through the catch-up policy; none is left a gap.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_partial_backfill_does_not_hide_the_runs_missed_around_it(pool: PgPool) {
    let text = "[all]\ncron = \"0 3 * * *\"\ncatchup = \"all\"\n[none]\ncron = \"0 3 * * *\"\ncatchup = \"none\"\n";
    let mut conn = pool.acquire().await.unwrap();
    Ticker::load(&mut conn, schedules(text), GRACE)
        .await
        .unwrap();
    // The schedules have existed since Saturday night (all in the past, by
    // the database's clock, so backfill accepts them).
    sqlx::query("UPDATE almanac.schedules SET created_at = '2026-10-31T23:00:00Z'")
        .execute(&pool)
        .await
        .unwrap();
    let mut leader = Ticker::load(&mut conn, schedules(text), GRACE)
        .await
        .unwrap();
    // Sunday 2026-11-01, on time. Then the scheduler is down.
    let sunday = leader
        .tick(&mut conn, at("2026-11-01T03:00:05Z"))
        .await
        .unwrap();
    assert_eq!(sunday.emitted, 2);
    drop(leader);

    // The operator backfills Wednesday only.
    for s in schedules(text) {
        let wednesday = backfill::backfill(
            &mut conn,
            &s,
            past(
                at("2026-11-04T00:00:00Z"),
                at("2026-11-05T00:00:00Z"),
                false,
            ),
            |_, _| {},
        )
        .await
        .unwrap();
        assert_eq!(wednesday.emitted, 1);
    }

    // Back on Friday, a new leader.
    let mut leader = Ticker::load(&mut conn, schedules(text), GRACE)
        .await
        .unwrap();
    leader
        .tick(&mut conn, at("2026-11-06T03:00:05Z"))
        .await
        .unwrap();
    let ledger = ledger(&pool).await;
    let row = |d: &str, source: &str, outcome: &str| {
        (
            format!("2026-11-{d}"),
            source.to_string(),
            outcome.to_string(),
            outcome == "emitted",
        )
    };
    assert_eq!(
        ledger["all"],
        vec![
            row("01", "tick", "emitted"),
            row("02", "catchup", "emitted"),
            row("03", "catchup", "emitted"),
            row("04", "backfill", "emitted"),
            row("05", "catchup", "emitted"),
            row("06", "tick", "emitted"),
        ]
    );
    assert_eq!(
        ledger["none"],
        vec![
            row("01", "tick", "emitted"),
            row("02", "catchup", "skipped_catchup"),
            row("03", "catchup", "skipped_catchup"),
            row("04", "backfill", "emitted"),
            row("05", "catchup", "skipped_catchup"),
            row("06", "tick", "emitted"),
        ]
    );
    for s in schedules(text) {
        let holes = backfill::gaps(
            &mut conn,
            &s,
            at("2026-11-01T00:00:00Z"),
            at("2026-11-07T00:00:00Z"),
        )
        .await
        .unwrap();
        assert!(holes.is_empty(), "{}: gaps {holes:?}", s.name);
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.jobs").await,
        count(
            &pool,
            "SELECT count(*) FROM almanac.schedule_runs WHERE outcome = 'emitted'"
        )
        .await
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(DISTINCT idempotency_key) FROM almanac.jobs"
        )
        .await,
        6 + 3
    );
}

/// Backfill is for the past: a range reaching runs not due yet (by the
/// database's clock) is refused and writes nothing, unless the future is
/// allowed; a run backfilled early is found already there when it comes due,
/// and it does not move the scheduler's cursor past the runs before it.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_backfill_into_the_future_is_refused_unless_allowed_and_hides_nothing(pool: PgPool) {
    let text = "[hourly]\ncron = \"0 * * * *\"\n";
    let mut conn = pool.acquire().await.unwrap();
    let mut leader = Ticker::load(&mut conn, schedules(text), GRACE)
        .await
        .unwrap();
    let s = schedules(text).remove(0);
    let now = db_now(&pool).await;
    let ahead = now + chrono::Duration::hours(5);
    let refused = backfill::backfill(
        &mut conn,
        &s,
        past(now - chrono::Duration::hours(1), ahead, false),
        |_, _| {},
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        refused.contains("that are not due yet") && refused.contains("--allow-future"),
        "{refused}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.schedule_runs").await,
        0
    );

    // Allowed: runs 3 and 4 hours ahead are emitted now.
    let (from, to) = (
        now + chrono::Duration::hours(3) - chrono::Duration::minutes(59),
        ahead - chrono::Duration::minutes(59),
    );
    let early = backfill::backfill(
        &mut conn,
        &s,
        backfill::Range {
            from,
            to,
            dry_run: false,
            allow_future: true,
        },
        |_, _| {},
    )
    .await
    .unwrap();
    assert_eq!(early.emitted, 2);
    // The leader, ticking through the next five hours, plans every run once.
    let first = leader.next_wake().unwrap();
    for hour in 0..5 {
        leader
            .tick(
                &mut conn,
                first + chrono::Duration::hours(hour) + chrono::Duration::seconds(1),
            )
            .await
            .unwrap();
    }
    let rows = &ledger(&pool).await["hourly"];
    assert_eq!(rows.len(), 5, "{rows:?}");
    assert_eq!(
        rows.iter().filter(|r| r.1 == "backfill").count(),
        2,
        "{rows:?}"
    );
    assert!(rows.iter().all(|r| r.2 == "emitted"), "{rows:?}");
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 5);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_backfill_command_refuses_a_future_range_with_the_flag_to_use(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = std::env::temp_dir().join(format!("almanac-backfill-future-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("d.toml"), "[daily]\ncron = \"0 3 * * *\"\n").unwrap();
    let today = db_now(&pool).await.date_naive();
    let backfill = |extra: &[&str]| {
        harness::almanac()
            .args(["backfill", "daily", "--from"])
            .arg((today - chrono::Days::new(3)).to_string())
            .arg("--to")
            .arg((today + chrono::Days::new(2)).to_string())
            .arg("--schedules")
            .arg(&dir)
            .args(extra)
            .env("DATABASE_URL", &url)
            .output()
            .unwrap()
    };
    let out = backfill(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("runs of `daily` that are not due yet") && err.contains("pass --allow-future"),
        "{err}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.schedule_runs").await,
        0
    );
    let out = backfill(&["--allow-future"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.schedule_runs").await,
        6
    );
}
