//! Deadlines and alerting: the shipped Prometheus rules pass `promtool`
//! (never skipped: `scripts/services.sh` installs it), every metric they use
//! is exposed by a running `almanac run`, and a run whose job goes dead shows
//! as overdue once its deadline passes and clears after `almanac jobs retry`
//! succeeds; the figures per schedule (overdue, missing, last success,
//! success late, skipped) on an injected clock, with missing equal to `gaps`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use almanac::scheduler::backfill::{self, Range};
use almanac::scheduler::history;
use almanac::scheduler::ledger;
use almanac::scheduler::spec::{self, Schedule};
use almanac::stats::snapshot::RunFigures;
use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::harness::http::{get, sample};
use crate::harness::{self, almanac, eventually};

fn rules_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus")
}

fn promtool(args: &[&str]) -> std::process::Output {
    Command::new("promtool")
        .args(args)
        .current_dir(rules_dir())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run promtool ({e}); run scripts/services.sh, which installs it")
        })
}

#[test]
fn the_alert_rules_are_valid_and_their_unit_tests_pass() {
    let check = promtool(&["check", "rules", "almanac.rules.yml"]);
    assert!(
        check.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let test = promtool(&["test", "rules", "almanac.rules.test.yml"]);
    assert!(
        test.status.success(),
        "promtool test rules: {}{}",
        String::from_utf8_lossy(&test.stdout),
        String::from_utf8_lossy(&test.stderr)
    );
    // Every rule has a unit test that names it.
    let rules = std::fs::read_to_string(rules_dir().join("almanac.rules.yml")).unwrap();
    let tests = std::fs::read_to_string(rules_dir().join("almanac.rules.test.yml")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert_eq!(alerts.len(), 6, "{alerts:?}");
    for alert in alerts {
        assert!(
            tests.contains(&format!(
                "alertname: {alert}\n        exp_alerts:\n          - "
            )),
            "no test expects {alert} to fire"
        );
    }
}

/// The `almanac_*` names the rules' expressions use.
fn names_in_rules() -> BTreeSet<String> {
    let rules = std::fs::read_to_string(rules_dir().join("almanac.rules.yml")).unwrap();
    let mut names = BTreeSet::new();
    for line in rules.lines().filter(|l| l.trim().starts_with("expr:")) {
        let mut rest = line;
        while let Some(at) = rest.find("almanac_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            names.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    names
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A fresh directory of this test process's own.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("almanac-alerts-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// `almanac run` with the scheduler and the collector every `interval`, on
/// the schedules in `dir`, serving HTTP on `addr`.
fn run(url: &str, dir: &Path, addr: &str, interval: &str) -> KillOnDrop {
    let mut cmd = almanac();
    cmd.args(["run", "--roles", "scheduler,metrics", "--schedules"])
        .arg(dir)
        .args(["--metrics-interval", interval, "--http-addr", addr])
        .env("DATABASE_URL", url)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    KillOnDrop(cmd.spawn().unwrap())
}

async fn metrics(addr: &str) -> String {
    get(addr, "/metrics")
        .await
        .map(|r| r.body)
        .unwrap_or_default()
}

async fn db_now(pool: &PgPool) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT now()")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn every_metric_the_rules_use_is_exposed_by_a_running_almanac(pool: PgPool) {
    let dir = scratch("exposed");
    std::fs::write(
        dir.join("s.toml"),
        "[nightly]\ncron = \"0 3 * * *\"\ndeadline = \"2h\"\n",
    )
    .unwrap();
    let addr = free_addr();
    let _proc = run(&harness::database_url(&pool), &dir, &addr, "200ms");
    let names = names_in_rules();
    assert!(names.len() >= 6, "{names:?}");
    eventually(
        "every metric the rules use in /metrics",
        Duration::from_secs(60),
        || async {
            let body = metrics(&addr).await;
            let exposed: BTreeSet<&str> = body
                .lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| l.split(['{', ' ']).next())
                .collect();
            let absent: Vec<&String> = names
                .iter()
                .filter(|n| !exposed.contains(n.as_str()))
                .collect();
            if absent.is_empty() {
                Ok(())
            } else {
                Err(format!("not exposed: {absent:?}"))
            }
        },
    )
    .await;
    let body = metrics(&addr).await;
    assert_eq!(
        sample(&body, "almanac_scheduler_leader", &[]),
        Some(1.0),
        "{body}"
    );
    // The leader's tick is recent (database time; the machine's clock is the
    // database's here).
    let tick = sample(&body, "almanac_scheduler_last_tick_timestamp_seconds", &[]).unwrap();
    let now = db_now(&pool).await.timestamp_millis() as f64 / 1000.0;
    assert!((now - tick).abs() < 30.0, "tick {tick}, now {now}");
}

/// A leader whose ticker stalls while its lock session and process stay
/// alive shows it: its tick gauge ages while it still reports leading (what
/// `AlmanacSchedulerTickStale` fires on), and it ticks again once unstuck.
/// The stall: its tick blocks on the ledger, locked by this test (within the
/// leader timeout, so the lock is kept).
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_leader_whose_ticker_stalls_shows_an_ageing_tick_while_it_still_leads(pool: PgPool) {
    let dir = scratch("stall");
    std::fs::write(
        dir.join("s.toml"),
        "[every-second]\ncron = \"* * * * * *\"\n",
    )
    .unwrap();
    let addr = free_addr();
    let mut cmd = almanac();
    cmd.args(["run", "--roles", "scheduler,metrics", "--schedules"])
        .arg(&dir)
        .args(["--leader-timeout", "60s", "--http-addr", &addr])
        .env("DATABASE_URL", harness::database_url(&pool))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut proc = KillOnDrop(cmd.spawn().unwrap());
    // Seconds between the database's now and the leader's last tick, while it leads.
    let tick_age = |pool: PgPool, addr: String| async move {
        let body = metrics(&addr).await;
        let leader = sample(&body, "almanac_scheduler_leader", &[]);
        let tick = sample(&body, "almanac_scheduler_last_tick_timestamp_seconds", &[]);
        let now = db_now(&pool).await.timestamp_millis() as f64 / 1000.0;
        match (leader, tick) {
            (Some(l), Some(t)) if l == 1.0 && t > 0.0 => Some(now - t),
            _ => None,
        }
    };
    eventually("the leader to tick", Duration::from_secs(30), || async {
        tick_age(pool.clone(), addr.clone())
            .await
            .is_some_and(|age| age < 2.0)
    })
    .await;
    let mut stall = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE almanac.schedule_runs IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *stall)
        .await
        .unwrap();
    eventually(
        "the stalled leader's tick to age past 4 s while it still leads",
        Duration::from_secs(30),
        || async {
            match tick_age(pool.clone(), addr.clone()).await {
                Some(age) if age > 4.0 => Ok(()),
                other => Err(format!("tick age {other:?}")),
            }
        },
    )
    .await;
    assert!(proc.0.try_wait().unwrap().is_none(), "the process is alive");
    stall.rollback().await.unwrap();
    eventually(
        "the leader to tick again once unstuck",
        Duration::from_secs(30),
        || async {
            tick_age(pool.clone(), addr.clone())
                .await
                .is_some_and(|age| age < 2.0)
        },
    )
    .await;
}

/// The run of `schedule` that fires at `fire` (a daily schedule's logical
/// run is its UTC date here).
fn daily_at(name: &str, fire: DateTime<Utc>, deadline: &str) -> String {
    format!(
        "[{name}]\ncron = \"{}\"\nkind = \"{name}\"\ndeadline = \"{deadline}\"\nmax_attempts = 1\n",
        fire.format("%S %M %H * * *")
    )
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_dead_run_is_overdue_after_its_deadline_and_clears_after_a_successful_retry(
    pool: PgPool,
) {
    let url = harness::database_url(&pool);
    let dir = scratch("overdue");
    let flag = dir.join("fixed");
    // A run firing in 4 s with a 3 s deadline, triggered now (its job is
    // due at once): the job dies at once, the deadline passes 7 s from now.
    let fire = db_now(&pool).await + chrono::Duration::seconds(4);
    let fire = fire - chrono::Duration::nanoseconds(i64::from(fire.timestamp_subsec_nanos()));
    let deadline = fire + chrono::Duration::seconds(3);
    let schedules = dir.join("schedules");
    std::fs::create_dir(&schedules).unwrap();
    std::fs::write(schedules.join("s.toml"), daily_at("report", fire, "3s")).unwrap();
    let logical = fire.format("%Y-%m-%d").to_string();
    let trigger = almanac()
        .args([
            "schedules",
            "trigger",
            "report",
            "--logical-run",
            &logical,
            "--schedules",
        ])
        .arg(&schedules)
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert!(
        trigger.status.success(),
        "{}",
        String::from_utf8_lossy(&trigger.stderr)
    );
    let job_id: i64 = sqlx::query_scalar(
        "SELECT job_id FROM almanac.schedule_runs WHERE schedule = 'report' AND logical_run = $1",
    )
    .bind(&logical)
    .fetch_one(&pool)
    .await
    .unwrap();

    let addr = free_addr();
    let interval = Duration::from_millis(500);
    let _run = run(&url, &schedules, &addr, "500ms");
    // Exit 65: a permanent failure, so the job is dead after one attempt;
    // once `fixed` exists, the command succeeds.
    let handler = format!("report=test -e '{}' || exit 65", flag.display());
    let _work = KillOnDrop(
        almanac()
            .args(["work", "--handler", &handler, "--poll-interval", "100ms"])
            .env("DATABASE_URL", &url)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let status = |pool: PgPool| async move {
        sqlx::query_scalar::<_, String>("SELECT status FROM almanac.jobs WHERE id = $1")
            .bind(job_id)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    eventually("the job to go dead", Duration::from_secs(30), || async {
        status(pool.clone()).await == "dead"
    })
    .await;

    // Overdue never shows before the deadline, and shows within one
    // collector interval after it (plus this poll's own pace).
    let schedule = [("schedule", "report")];
    eventually(
        "the dead run to show overdue",
        Duration::from_secs(60),
        || async {
            let body = metrics(&addr).await;
            let overdue = sample(&body, "almanac_schedule_overdue_runs", &schedule);
            let now = db_now(&pool).await;
            match overdue {
                Some(1.0) => {
                    assert!(
                        now >= deadline,
                        "overdue at {now}, before the deadline {deadline}"
                    );
                    let late = (now - deadline).to_std().unwrap();
                    assert!(
                        late < interval + Duration::from_millis(2500),
                        "overdue only {late:?} after the deadline (collector every {interval:?})"
                    );
                    Ok(())
                }
                other => Err(format!("overdue {other:?} at {now}")),
            }
        },
    )
    .await;
    let body = metrics(&addr).await;
    assert_eq!(
        sample(
            &body,
            "almanac_schedule_last_success_timestamp_seconds",
            &schedule
        ),
        Some(0.0),
        "{body}"
    );
    assert!(
        sample(&body, "almanac_schedule_success_late_seconds", &schedule)
            .is_some_and(|late| late > 0.0),
        "{body}"
    );
    let stats = almanac()
        .args(["stats"])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    let stats = String::from_utf8_lossy(&stats.stdout).to_string();
    let line = stats
        .lines()
        .skip_while(|l| !l.starts_with("SCHEDULE "))
        .find(|l| l.starts_with("report "))
        .unwrap_or_else(|| panic!("no line for the schedule in `almanac stats`:\n{stats}"));
    assert!(
        line.split_whitespace().collect::<Vec<_>>()[..4] == ["report", "3s", "1", "0"],
        "{line}"
    );

    // Fixed, retried, done: overdue clears.
    std::fs::write(&flag, "").unwrap();
    let retry = almanac()
        .args(["jobs", "retry", &job_id.to_string()])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert!(
        retry.status.success(),
        "{}",
        String::from_utf8_lossy(&retry.stderr)
    );
    eventually(
        "the retried job to be done",
        Duration::from_secs(30),
        || async { status(pool.clone()).await == "done" },
    )
    .await;
    eventually(
        "overdue to clear after the successful retry",
        Duration::from_secs(30),
        || async {
            let body = metrics(&addr).await;
            sample(&body, "almanac_schedule_overdue_runs", &schedule) == Some(0.0)
                && sample(&body, "almanac_schedule_success_late_seconds", &schedule) == Some(0.0)
                && sample(
                    &body,
                    "almanac_schedule_last_success_timestamp_seconds",
                    &schedule,
                ) == Some(fire.timestamp() as f64)
        },
    )
    .await;
}

fn hourly(deadline: &str) -> Schedule {
    let text = format!(
        "[hourly]\ncron = \"0 * * * *\"\ncatchup = \"none\"\noverlap = \"skip\"\ndeadline = \"{deadline}\"\n"
    );
    spec::load_sources(&[(PathBuf::from("s.toml"), text)])
        .unwrap()
        .remove(0)
}

fn t(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

/// The figures on an injected clock: a ledger seeded through the ledger's
/// own writes (backfill), the jobs moved as workers would.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_figures_count_overdue_missing_and_skipped_runs_and_missing_equals_gaps(pool: PgPool) {
    let schedule = hourly("30m");
    let mut conn = pool.acquire().await.unwrap();
    // First synced 10:00; runs at 10:00 .. 16:00 by 16:10.
    ledger::sync_at(&mut conn, std::slice::from_ref(&schedule), true, None)
        .await
        .unwrap();
    sqlx::query("UPDATE almanac.schedules SET created_at = '2026-03-02T10:00:00Z'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let synced = history::synced_one(&mut conn, "hourly")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(synced.deadline.as_deref(), Some("30m"));
    // A changed deadline is synced like any change of the definition; the
    // same definition synced again writes nothing.
    let stored = |pool: PgPool| async move {
        sqlx::query_as::<_, (Option<String>, DateTime<Utc>)>(
            "SELECT deadline, updated_at FROM almanac.schedules WHERE name = 'hourly'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let before = stored(pool.clone()).await;
    ledger::sync_at(&mut conn, &[hourly("30m")], true, None)
        .await
        .unwrap();
    assert_eq!(
        stored(pool.clone()).await,
        before,
        "unchanged: not rewritten"
    );
    for (deadline, want) in [(Some("06:00"), Some("06:00")), (None, None)] {
        let mut changed = hourly("30m");
        changed.deadline = deadline
            .map(|d| almanac::scheduler::deadline::Deadline::parse(d, chrono_tz::UTC).unwrap());
        ledger::sync_at(&mut conn, &[changed], true, None)
            .await
            .unwrap();
        assert_eq!(stored(pool.clone()).await.0.as_deref(), want);
    }
    ledger::sync_at(&mut conn, std::slice::from_ref(&schedule), true, None)
        .await
        .unwrap();
    let schedule = synced.schedule().unwrap();
    let now = t("2026-03-02T16:10:00Z");
    // 10:00 done, 11:00 dead, 12:00 missing, 13:00 running, 14:00 skipped
    // (overlap), 15:00 missing, 16:00 ready (deadline 16:30, not yet).
    for hour in [10, 11, 13, 16] {
        let from = t(&format!("2026-03-02T{hour}:00:00Z"));
        backfill::backfill(
            &mut conn,
            &schedule,
            Range {
                from,
                to: from + chrono::Duration::minutes(1),
                dry_run: false,
                allow_future: true,
            },
            |_, _| {},
        )
        .await
        .unwrap();
    }
    sqlx::query(
        "INSERT INTO almanac.schedule_runs (schedule, logical_run, fire_at, source, outcome)
         VALUES ('hourly', '2026-03-02T14:00Z', '2026-03-02T14:00:00Z', 'tick', 'skipped_overlap')",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let set = |run: &'static str, status: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "UPDATE almanac.jobs SET status = $2,
                        finished_at = CASE WHEN $2 IN ('done', 'dead') THEN now() END,
                        lease_token = CASE WHEN $2 = 'running' THEN gen_random_uuid() END,
                        lease_until = CASE WHEN $2 = 'running' THEN now() + interval '1 hour' END
                  WHERE idempotency_key = 'schedule:hourly:' || $1",
            )
            .bind(run)
            .bind(status)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    set("2026-03-02T10:00Z", "done").await;
    set("2026-03-02T11:00Z", "dead").await;
    set("2026-03-02T13:00Z", "running").await;

    let figures = |now: DateTime<Utc>| {
        let pool = pool.clone();
        let schedule = schedule.clone();
        async move {
            let mut conn = pool.acquire().await.unwrap();
            let calendar = history::calendar_at(&mut conn, &schedule, now)
                .await
                .unwrap();
            let gaps = backfill::gaps_at(&mut conn, &schedule, calendar.from, calendar.to, now)
                .await
                .unwrap();
            let f = RunFigures::of(&schedule, &calendar.cells, now);
            assert_eq!(f.missing, gaps.len() as u64, "missing is what gaps reports");
            f
        }
    };
    let f = figures(now).await;
    assert_eq!((f.overdue, f.missing), (2, 2), "{f:?}");
    assert_eq!(f.last_success, Some(t("2026-03-02T10:00:00Z")));
    assert_eq!(f.skipped.get("overlap"), Some(&1));
    // The latest run expected by now is 15:00 (missing), due 15:30: 40 min.
    assert_eq!(f.success_late_seconds, 40.0 * 60.0);

    // At 16:31 the 16:00 run (still ready) is overdue too.
    assert_eq!(figures(t("2026-03-02T16:31:00Z")).await.overdue, 3);

    // The dead run retried and done, the running one done, the holes backfilled.
    set("2026-03-02T11:00Z", "done").await;
    set("2026-03-02T13:00Z", "done").await;
    backfill::backfill(
        &mut conn,
        &schedule,
        Range {
            from: t("2026-03-02T12:00:00Z"),
            to: t("2026-03-02T16:00:00Z"),
            dry_run: false,
            allow_future: true,
        },
        |_, _| {},
    )
    .await
    .unwrap();
    for run in [
        "2026-03-02T12:00Z",
        "2026-03-02T14:00Z",
        "2026-03-02T15:00Z",
    ] {
        set(run, "done").await;
    }
    let f = figures(now).await;
    assert_eq!(
        (f.overdue, f.missing, f.success_late_seconds),
        (0, 0, 0.0),
        "{f:?}"
    );
    assert_eq!(f.last_success, Some(t("2026-03-02T15:00:00Z")));
    assert!(
        f.skipped.is_empty(),
        "the backfill emitted the skipped run: {f:?}"
    );

    // Without a deadline nothing is overdue or late; missing still counts.
    let mut plain = schedule.clone();
    plain.deadline = None;
    set("2026-03-02T15:00Z", "dead").await;
    let mut conn = pool.acquire().await.unwrap();
    let calendar = history::calendar_at(&mut conn, &plain, now).await.unwrap();
    let f = RunFigures::of(&plain, &calendar.cells, now);
    assert_eq!((f.overdue, f.success_late_seconds), (0, 0.0), "{f:?}");
}
