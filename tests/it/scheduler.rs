//! The scheduler against a real PostgreSQL: catch-up policies after an
//! outage (injected clock), overlap, backfill and gaps, and split brain.

use std::collections::HashMap;
use std::time::Duration;

use almanac::scheduler::spec::{load_sources, Schedule};
use almanac::scheduler::ticker::Ticker;
use almanac::scheduler::{backfill, history};
use almanac::telemetry::Tracer;
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

const FIVE_MINUTES: &str = r#"
[every5]
cron = "*/5 * * * *"
catchup = "all"
catchup_window = "1d"
"#;

fn every5(enabled: bool) -> Vec<Schedule> {
    schedules(&format!("{FIVE_MINUTES}enabled = {enabled}\n"))
}

/// Disabled is not missed. A five-minute schedule emits its first run on
/// time; the scheduler is then down across two runs (enabled: missed), the
/// schedule is disabled across ten more (a leader runs meanwhile and plans
/// nothing for it), and it is enabled again. The two missed runs are caught
/// up; the ten are recorded `skipped_disabled` with no job; the next run is
/// emitted on time; nothing is doubled. Until the re-enable, neither `gaps`
/// nor the calendar calls the disabled runs missing; afterwards the calendar
/// shows them skipped; a backfill over them emits each once.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn runs_due_while_disabled_are_recorded_skipped_not_caught_up(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let ticker = Ticker::load_at(&mut conn, every5(true), GRACE, None)
        .await
        .unwrap();
    let f = ticker.next_wake().unwrap();
    let min = |m: i64| f + chrono::Duration::minutes(m);
    let sec = chrono::Duration::seconds(1);
    let mut ticker = ticker;
    assert_eq!(ticker.tick(&mut conn, f + sec).await.unwrap().emitted, 1);

    // Down from here; at +12m the schedule is disabled (a leader syncs it).
    let mut ticker = Ticker::load_at(&mut conn, every5(false), GRACE, Some(min(12)))
        .await
        .unwrap();
    for m in [13, 30, 61] {
        let r = ticker.tick(&mut conn, min(m)).await.unwrap();
        assert_eq!(r, Default::default(), "a disabled schedule plans nothing");
    }
    let s = &every5(true)[0];
    let names = |runs: Vec<almanac::scheduler::timeline::Run>| {
        runs.into_iter().map(|r| r.fire_at).collect::<Vec<_>>()
    };
    // While disabled: the two runs missed while enabled are gaps, the rest not.
    let gaps = backfill::gaps_at(&mut conn, s, f, min(62), min(61))
        .await
        .unwrap();
    assert_eq!(names(gaps), vec![min(5), min(10)]);
    let calendar = history::calendar_at(&mut conn, s, min(61)).await.unwrap();
    let disabled: Vec<_> = calendar
        .cells
        .iter()
        .filter(|c| c.state == history::CellState::Disabled)
        .map(|c| c.run.fire_at)
        .collect();
    assert_eq!(disabled, (3..=12).map(|k| min(5 * k)).collect::<Vec<_>>());

    // Enabled again at +62m.
    let mut ticker = Ticker::load_at(&mut conn, every5(true), GRACE, Some(min(62)))
        .await
        .unwrap();
    let back = ticker.tick(&mut conn, min(62)).await.unwrap();
    assert_eq!(
        (back.emitted, back.skipped_disabled, back.skipped_catchup),
        (2, 10, 0)
    );
    assert_eq!(ticker.next_wake(), Some(min(65)));
    let on_time = ticker.tick(&mut conn, min(65) + sec).await.unwrap();
    assert_eq!((on_time.emitted, on_time.skipped_disabled), (1, 0));

    let ledger = ledger(&pool).await;
    let run = |m: i64| {
        let run = s
            .next_after(min(m) - chrono::Duration::microseconds(1))
            .unwrap();
        assert_eq!(run.fire_at, min(m));
        run.logical_run
    };
    let row = |m: i64, source: &str, outcome: &str| {
        (
            run(m),
            source.to_string(),
            outcome.to_string(),
            outcome == "emitted",
        )
    };
    let mut want = vec![
        row(0, "tick", "emitted"),
        row(5, "catchup", "emitted"),
        row(10, "catchup", "emitted"),
    ];
    want.extend((3..=12).map(|k| row(5 * k, "catchup", "skipped_disabled")));
    want.push(row(65, "tick", "emitted"));
    assert_eq!(ledger["every5"], want);
    let jobs = "SELECT count(*) FROM almanac.jobs";
    assert_eq!(count(&pool, jobs).await, 4);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.schedule_disabled WHERE enabled_at IS NOT NULL"
        )
        .await,
        1
    );

    // Not gaps; on the calendar, skipped (disabled).
    assert!(backfill::gaps_at(&mut conn, s, f, min(66), min(66) + sec)
        .await
        .unwrap()
        .is_empty());
    let calendar = history::calendar_at(&mut conn, s, min(66)).await.unwrap();
    let skipped = calendar
        .cells
        .iter()
        .filter(|c| {
            c.state
                == history::CellState::Skipped {
                    reason: "disabled".into(),
                }
        })
        .count();
    assert_eq!(skipped, 10);

    // A backfill over them emits each once (the injected clock is ahead of
    // the database's, so the range is "future" to it).
    let range = backfill::Range {
        from: min(15),
        to: min(61),
        dry_run: false,
        allow_future: true,
    };
    let filled = backfill::backfill(&mut conn, s, range, |_, _| {})
        .await
        .unwrap();
    assert_eq!(
        (
            filled.emitted,
            filled.emitted_after_skip,
            filled.already_emitted
        ),
        (0, 10, 0)
    );
    let again = backfill::backfill(&mut conn, s, range, |_, _| {})
        .await
        .unwrap();
    assert_eq!((again.emitted_after_skip, again.already_emitted), (0, 10));
    assert_eq!(count(&pool, jobs).await, 14);
    assert_eq!(
        count(
            &pool,
            "SELECT count(DISTINCT idempotency_key) FROM almanac.jobs"
        )
        .await,
        14
    );
    // The scheduler's cursor is unmoved: the next tick emits the next run only.
    let next = ticker.tick(&mut conn, min(70) + sec).await.unwrap();
    assert_eq!((next.emitted, next.existed), (1, 0));
}

/// The calendar agrees with `gaps`, as a property: for random ledgers over
/// a schedule (history starting before or after the first sync, holes of
/// single runs and of days, every outcome, disabled spells, with and without
/// `start`), the calendar's missing cells are exactly what `gaps` reports for
/// the calendar's window at the same instant. Each ledger is written in one
/// statement from arrays.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_calendars_missing_cells_are_gaps_for_random_ledgers(pool: PgPool) {
    use almanac::scheduler::ledger;
    use almanac::scheduler::plan;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    let mut conn = pool.acquire().await.unwrap();
    let now = db_now(&pool).await;
    let start = day(now - chrono::Duration::days(6));
    let all = schedules(&format!(
        r#"
[hourly]
cron = "0 * * * *"
[hourly-start]
cron = "30 */2 * * *"
timezone = "America/New_York"
start = "{start}"
[daily]
cron = "0 2 * * *"
timezone = "Asia/Seoul"
start = "{start}"
"#
    ));
    ledger::sync(&mut conn, &all, false).await.unwrap();
    let mut rng = StdRng::seed_from_u64(21);
    let (mut missing_total, mut missing_before_sync, mut disabled_seen) = (0, 0, 0);
    for case in 0..60 {
        let s = &all[rng.gen_range(0..all.len())];
        let span = if s.timeline.is_daily() { 100 } else { 14 };
        let days = |rng: &mut StdRng| chrono::Duration::minutes(rng.gen_range(0..span * 24 * 60));
        let first_sync = now - days(&mut rng);
        let history_from = now - days(&mut rng);
        let runs = plan::runs_in(s, history_from, now, 100_000);
        // Holes: single runs, and a stretch of a few days.
        let hole_from = now - days(&mut rng);
        let hole_to = hole_from + chrono::Duration::hours(rng.gen_range(0..72));
        let p_hole = rng.gen_range(0.0..0.4);
        let (mut names, mut fires, mut sources, mut outcomes) = (vec![], vec![], vec![], vec![]);
        for run in runs {
            if rng.gen_bool(p_hole) || (hole_from <= run.fire_at && run.fire_at < hole_to) {
                continue;
            }
            names.push(run.logical_run);
            fires.push(run.fire_at);
            sources.push(["tick", "catchup", "backfill"][rng.gen_range(0..3)]);
            outcomes.push(
                [
                    "emitted",
                    "skipped_catchup",
                    "skipped_overlap",
                    "skipped_disabled",
                ][rng.gen_range(0..4)],
            );
        }
        let spells: Vec<(DateTime<Utc>, Option<DateTime<Utc>>)> = (0..rng.gen_range(0..3))
            .map(|i| {
                let from = now - days(&mut rng) + chrono::Duration::seconds(i);
                let until = rng
                    .gen_bool(0.7)
                    .then(|| from + chrono::Duration::hours(rng.gen_range(1..48)));
                (from, until)
            })
            .collect();
        let open = spells.iter().filter(|s| s.1.is_none()).count();
        let spells = if open > 1 { &spells[..1] } else { &spells[..] };
        sqlx::query(
            r#"
            WITH gone AS (DELETE FROM almanac.schedule_runs WHERE schedule = $1),
                 unspelled AS (DELETE FROM almanac.schedule_disabled WHERE schedule = $1),
                 synced AS (UPDATE almanac.schedules SET created_at = $2 WHERE name = $1)
            SELECT 1
            "#,
        )
        .bind(&s.name)
        .bind(first_sync)
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(
            r#"
            INSERT INTO almanac.schedule_runs (schedule, logical_run, fire_at, source, outcome)
            SELECT $1, r, f, s, o FROM unnest($2::text[], $3::timestamptz[], $4::text[], $5::text[])
                AS u(r, f, s, o);
            "#,
        )
        .bind(&s.name)
        .bind(&names)
        .bind(&fires)
        .bind(&sources)
        .bind(&outcomes)
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(
            r#"
            INSERT INTO almanac.schedule_disabled (schedule, disabled_at, enabled_at)
            SELECT $1, d, e FROM unnest($2::timestamptz[], $3::timestamptz[]) AS u(d, e)
            "#,
        )
        .bind(&s.name)
        .bind(spells.iter().map(|s| s.0).collect::<Vec<_>>())
        .bind(spells.iter().map(|s| s.1).collect::<Vec<_>>())
        .execute(&pool)
        .await
        .unwrap();

        let calendar = history::calendar_at(&mut conn, s, now).await.unwrap();
        let cells: Vec<DateTime<Utc>> = calendar
            .cells
            .iter()
            .filter(|c| c.state == history::CellState::Missing)
            .map(|c| c.run.fire_at)
            .collect();
        let gaps: Vec<DateTime<Utc>> =
            backfill::gaps_at(&mut conn, s, calendar.from, calendar.to, now)
                .await
                .unwrap()
                .into_iter()
                .map(|r| r.fire_at)
                .collect();
        assert_eq!(
            cells, gaps,
            "case {case}: `{}` first synced {first_sync}, history from {history_from}, \
             hole {hole_from}..{hole_to}, spells {spells:?}",
            s.name
        );
        missing_total += gaps.len();
        missing_before_sync += gaps.iter().filter(|f| **f < first_sync).count();
        disabled_seen += calendar
            .cells
            .iter()
            .filter(|c| c.state == history::CellState::Disabled)
            .count();
    }
    // The property was not vacuous: holes were found, some before the first
    // sync inside a backfilled history (the case the issue saw), and some
    // unrecorded runs were due while disabled.
    assert!(missing_total > 100, "{missing_total}");
    assert!(missing_before_sync > 10, "{missing_before_sync}");
    assert!(disabled_seen > 10, "{disabled_seen}");
}

/// The issue's case through the commands: a schedule whose `start` precedes
/// its first sync, a backfilled history with a two-day hole. `almanac gaps`
/// lists the hole and the unrecorded days after the history began, and the
/// calendar marks exactly those missing. Before any sync, `gaps` says why it
/// lists nothing.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn gaps_and_the_calendar_agree_on_a_backfilled_history_before_the_first_sync(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = std::env::temp_dir().join(format!("almanac-gaps-history-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let today = db_now(&pool).await.date_naive();
    let ago = |n: u64| (today - chrono::Days::new(n)).to_string();
    std::fs::write(
        dir.join("d.toml"),
        format!("[daily]\ncron = \"0 3 * * *\"\nstart = \"{}\"\n", ago(20)),
    )
    .unwrap();
    let run = |command: &str, from: u64, to: u64| {
        let out = harness::almanac()
            .args([command, "daily", "--from", &ago(from), "--to", &ago(to)])
            .arg("--schedules")
            .arg(&dir)
            .env("DATABASE_URL", &url)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (out, err) = run("gaps", 20, 1);
    assert_eq!(out, "");
    assert!(err.contains("never synced"), "{err}");

    run("backfill", 20, 10);
    let hole = vec![ago(15), ago(14)];
    sqlx::query(
        "WITH gone AS (DELETE FROM almanac.schedule_runs WHERE logical_run = ANY($1)) \
         DELETE FROM almanac.jobs WHERE logical_run = ANY($1)",
    )
    .bind(&hole)
    .execute(&pool)
    .await
    .unwrap();
    let (out, err) = run("gaps", 20, 1);
    let mut want = hole;
    want.extend((1..=9).rev().map(ago));
    let listed: Vec<&str> = out.lines().collect();
    assert_eq!(listed.len(), want.len(), "{out}");
    for (line, day) in listed.iter().zip(&want) {
        assert!(line.contains(day.as_str()), "{line} is not {day}");
    }
    assert!(err.contains("11 missing runs"), "{err}");

    let mut conn = pool.acquire().await.unwrap();
    let s = &schedules(&format!(
        "[daily]\ncron = \"0 3 * * *\"\nstart = \"{}\"\n",
        ago(20)
    ))[0];
    let calendar = history::calendar(&mut conn, s).await.unwrap();
    // Over the days `gaps` was asked about (through yesterday): today's
    // 03:00 run is missing too once the wall clock is past it.
    let last = ago(1);
    let missing: Vec<String> = calendar
        .cells
        .iter()
        .filter(|c| c.state == history::CellState::Missing && c.run.logical_run <= last)
        .map(|c| c.run.logical_run.clone())
        .collect();
    assert_eq!(missing, want);
}

/// Paused is not missed, and a pause lives in the database. A five-minute
/// schedule emits on time; it is paused (with a note, by someone) before its
/// next run: that run, due at the very next tick, is recorded
/// `skipped_paused` with no job. A second leader loaded after the pause sees
/// it; runs missed while no leader ran and the schedule was paused are
/// recorded `skipped_paused`, not caught up. After the resume the next run
/// is emitted on time; `gaps` lists none of the paused runs; `backfill` fills
/// them once; nothing is doubled.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn runs_due_while_paused_are_recorded_skipped_and_resume_is_on_time(pool: PgPool) {
    use almanac::scheduler::controls;
    let mut conn = pool.acquire().await.unwrap();
    let mut ticker = Ticker::load_at(&mut conn, every5(true), GRACE, None)
        .await
        .unwrap();
    let s = &every5(true)[0];
    let f = ticker.next_wake().unwrap();
    let min = |m: i64| f + chrono::Duration::minutes(m);
    let sec = chrono::Duration::seconds(1);
    assert_eq!(ticker.tick(&mut conn, f + sec).await.unwrap().emitted, 1);

    let paused = controls::pause(&mut conn, s, "deploy freeze", "alice", Some(min(3)))
        .await
        .unwrap();
    assert!(
        matches!(paused, controls::Paused::Now(ref p) if p.note == "deploy freeze" && p.by == "alice")
    );
    let again = controls::pause(&mut conn, s, "other", "bob", Some(min(4)))
        .await
        .unwrap();
    assert!(matches!(again, controls::Paused::Already(ref p) if p.by == "alice"));
    // Effective at the next tick, with no reload.
    for m in [5, 10] {
        let r = ticker.tick(&mut conn, min(m) + sec).await.unwrap();
        assert_eq!((r.emitted, r.skipped_paused), (0, 1), "at +{m}m");
    }
    // A leader change: the new leader reads the pause from the database.
    drop(ticker);
    let mut ticker = Ticker::load_at(&mut conn, every5(true), GRACE, None)
        .await
        .unwrap();
    let r = ticker.tick(&mut conn, min(15) + sec).await.unwrap();
    assert_eq!((r.emitted, r.skipped_paused), (0, 1));
    // No leader from +16m to +30m30s: paused runs are not caught up.
    let r = ticker
        .tick(&mut conn, min(30) + chrono::Duration::seconds(30))
        .await
        .unwrap();
    assert_eq!((r.emitted, r.skipped_paused, r.skipped_catchup), (0, 3, 0));

    let resumed = controls::resume(&mut conn, &s.name, "carol", Some(min(32)))
        .await
        .unwrap();
    assert_eq!(resumed.map(|p| p.since), Some(min(3)));
    assert_eq!(
        controls::resume(&mut conn, &s.name, "carol", Some(min(33)))
            .await
            .unwrap(),
        None
    );
    assert_eq!(ticker.next_wake(), Some(min(35)));
    let r = ticker.tick(&mut conn, min(35) + sec).await.unwrap();
    assert_eq!(
        (r.emitted, r.skipped_paused),
        (1, 0),
        "on time after resume"
    );

    let run = |m: i64| {
        let run = s
            .next_after(min(m) - chrono::Duration::microseconds(1))
            .unwrap();
        assert_eq!(run.fire_at, min(m));
        run.logical_run
    };
    let row = |m: i64, source: &str, outcome: &str| {
        (
            run(m),
            source.to_string(),
            outcome.to_string(),
            outcome == "emitted",
        )
    };
    let mut want = vec![row(0, "tick", "emitted")];
    want.extend([5, 10, 15].map(|m| row(m, "tick", "skipped_paused")));
    want.extend([20, 25].map(|m| row(m, "catchup", "skipped_paused")));
    want.push(row(30, "tick", "skipped_paused"));
    want.push(row(35, "tick", "emitted"));
    assert_eq!(ledger(&pool).await["every5"], want);
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 2);

    // Paused runs are not gaps; backfill fills them, once.
    let gaps = backfill::gaps_at(&mut conn, s, f, min(36), min(36))
        .await
        .unwrap();
    assert!(gaps.is_empty(), "{gaps:?}");
    let range = backfill::Range {
        from: min(5),
        to: min(10) + sec,
        dry_run: false,
        allow_future: true,
    };
    for emitted_after_skip in [2, 0] {
        let report = backfill::backfill(&mut conn, s, range, |_, _| {})
            .await
            .unwrap();
        assert_eq!(report.emitted_after_skip, emitted_after_skip);
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 4);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM (SELECT logical_run FROM almanac.jobs GROUP BY logical_run HAVING count(*) > 1) d"
        )
        .await,
        0
    );
}

/// Trigger goes through the ledger: the same logical run triggered twice,
/// or by two callers at once, is one job; the tick that later reaches it
/// emits nothing more, and a triggered run does not move the scheduler's
/// cursor. Without a name, the most recent due run is triggered, once. A
/// name that is not a logical run of the schedule is refused with an example.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn trigger_emits_one_job_per_logical_run_however_often_it_is_called(pool: PgPool) {
    use almanac::scheduler::controls::{self, Triggered};
    let mut conn = pool.acquire().await.unwrap();
    let mut ticker = Ticker::load_at(&mut conn, every5(true), GRACE, None)
        .await
        .unwrap();
    let s = &every5(true)[0];
    let f = ticker.next_wake().unwrap();
    let min = |m: i64| f + chrono::Duration::minutes(m);
    let name_at = |m: i64| s.next_after(min(m) - chrono::Duration::seconds(1)).unwrap();
    let five = name_at(5).logical_run;

    let first = controls::trigger(&mut conn, s, Some(&five), &Tracer::off())
        .await
        .unwrap();
    assert!(matches!(first, Triggered::Emitted { ref run, .. } if run.logical_run == five));
    let second = controls::trigger(&mut conn, s, Some(&five), &Tracer::off())
        .await
        .unwrap();
    assert!(
        matches!(second, Triggered::Existed { ref source, job_id: Some(_), .. } if source == "trigger")
    );

    // Two callers at once.
    let ten = name_at(10).logical_run;
    let (mut a, mut b) = (pool.acquire().await.unwrap(), pool.acquire().await.unwrap());
    let off = Tracer::off();
    let (x, y) = tokio::join!(
        controls::trigger(&mut a, s, Some(&ten), &off),
        controls::trigger(&mut b, s, Some(&ten), &off)
    );
    let emitted = [x.unwrap(), y.unwrap()]
        .iter()
        .filter(|t| matches!(t, Triggered::Emitted { .. }))
        .count();
    assert_eq!(emitted, 1);

    // The cursor is the scheduler's own: a new leader still plans from f.
    let mut fresh = Ticker::load_at(&mut conn, every5(true), GRACE, None)
        .await
        .unwrap();
    assert_eq!(fresh.next_wake(), Some(f));
    drop(fresh.tick(&mut conn, f).await.unwrap());
    // The first leader reaches f (emitted by the second), +5m and +10m.
    for (m, existed) in [(5, 2), (10, 1)] {
        let r = ticker
            .tick(&mut conn, min(m) + chrono::Duration::seconds(1))
            .await
            .unwrap();
        assert_eq!((r.emitted, r.existed), (0, existed), "at +{m}m");
    }

    // Without a name: the most recent due run, once.
    let latest = controls::trigger(&mut conn, s, None, &Tracer::off())
        .await
        .unwrap();
    let Triggered::Emitted { run, .. } = latest else {
        panic!("{latest:?}")
    };
    assert!(run.fire_at < f);
    let again = controls::trigger(&mut conn, s, None, &Tracer::off())
        .await
        .unwrap();
    assert!(matches!(again, Triggered::Existed { run: ref r, .. } if *r == run));

    // Jobs: f (tick), +5m, +10m, the latest due: each once, each due now.
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 4);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE run_at > now()"
        )
        .await,
        1,
        "only the tick's own run at f waits for its time"
    );
    let bad = controls::trigger(&mut conn, s, Some("2026-03-08"), &Tracer::off())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        bad.contains("`2026-03-08` is not a logical run of `every5`"),
        "{bad}"
    );
    assert!(bad.contains("named like `"), "{bad}");
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 4);
}
