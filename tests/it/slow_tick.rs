//! The scheduler never skips a run because it was itself slow or blocked
//! (src/scheduler/ticker.rs): a run that fell due while a leader led is on
//! time however late its step is; a kind whose route lock is held waits
//! alone while the other schedules emit on time; a step too big for its
//! statement timeout shrinks instead of costing leadership. The last test
//! holds a route lock under a real `almanac run` process.

use std::time::Duration;

use almanac::scheduler::spec::{load_sources, Schedule};
use almanac::scheduler::ticker::{Budget, Ticker, BUSY_RETRY};
use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::harness::scheduler_proc::{assert_every_run_once, dir_with, runs_after, Proc};
use crate::harness::{self, count, eventually};

const GRACE: Duration = Duration::from_secs(60);

fn schedules(text: &str) -> Vec<Schedule> {
    load_sources(&[("test.toml".into(), text.to_string())]).unwrap()
}

/// (source, outcome) of each ledger row of `schedule`, in fire order.
async fn rows(pool: &PgPool, schedule: &str) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT source, outcome FROM almanac.schedule_runs WHERE schedule = $1 ORDER BY fire_at",
    )
    .bind(schedule)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Holds `kind`'s route lock exclusively, as `almanac route set` does, on a
/// connection of its own until the returned transaction ends.
async fn hold_route_lock(pool: &PgPool, kind: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('almanac.route:' || $1))")
        .bind(kind)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn runs_due_while_a_leader_led_are_on_time_however_late_its_step(pool: PgPool) {
    let text = "[none]\ncron = \"* * * * *\"\ncatchup = \"none\"\n";
    let mut conn = pool.acquire().await.unwrap();
    let mut ticker = Ticker::load(&mut conn, schedules(text), GRACE)
        .await
        .unwrap();
    let first = ticker.next_wake().unwrap();
    let awake = first - chrono::Duration::seconds(30);
    // The leader woke before the first run, then its next step came ten
    // minutes late (blocked, or slow): every run of those ten minutes fell
    // due while it led, so none is missed, even under catchup = "none".
    let late = first + chrono::Duration::minutes(10);
    let step = ticker.step(&mut conn, late, awake).await.unwrap();
    assert_eq!(
        (step.recorded.emitted, step.recorded.skipped_catchup),
        (11, 0)
    );
    assert!(rows(&pool, "none").await.iter().all(|r| r.0 == "tick"));

    // A leader that has just woken judges lateness from now: runs missed
    // while no leader ran go through the catch-up policy.
    let back = late + chrono::Duration::minutes(10) + chrono::Duration::seconds(30);
    let step = ticker.step(&mut conn, back, back).await.unwrap();
    assert_eq!(
        (step.recorded.emitted, step.recorded.skipped_catchup),
        (1, 9),
        "the on-time run emitted, the nine missed ones skipped"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_busy_route_lock_defers_only_its_own_kind(pool: PgPool) {
    let text = "[free]\ncron = \"* * * * *\"\nkind = \"free\"\n\
                [held]\ncron = \"* * * * *\"\nkind = \"held\"\ncatchup = \"none\"\n";
    let mut conn = pool.acquire().await.unwrap();
    let mut ticker = Ticker::load(&mut conn, schedules(text), GRACE)
        .await
        .unwrap();
    let first = ticker.next_wake().unwrap();
    let awake = first - chrono::Duration::seconds(1);
    let lock = hold_route_lock(&pool, "held").await;

    let at = first + chrono::Duration::seconds(1);
    let step = ticker.step(&mut conn, at, awake).await.unwrap();
    assert_eq!(step.busy, vec!["held".to_string()]);
    assert_eq!(step.deferred, vec!["held".to_string()]);
    assert_eq!(step.recorded.emitted, 1, "the free kind is not held back");
    assert_eq!(rows(&pool, "held").await.len(), 0);
    assert!(ticker.deferring());
    // Retried no sooner than BUSY_RETRY: no busy loop against the lock.
    assert_eq!(ticker.next_wake(), Some(at + BUSY_RETRY));
    // Still held a minute later: the free kind goes on, the held one waits.
    let later = at + chrono::Duration::minutes(1);
    let step = ticker.step(&mut conn, later, awake).await.unwrap();
    assert_eq!((step.recorded.emitted, step.busy.len()), (1, 1));

    lock.commit().await.unwrap();
    let free_again = later + BUSY_RETRY;
    let step = ticker.step(&mut conn, free_again, awake).await.unwrap();
    assert!(step.busy.is_empty() && !ticker.deferring());
    assert_eq!(
        rows(&pool, "held").await,
        vec![("tick".to_string(), "emitted".to_string()); 2],
        "both runs emitted once the lock is free, on time: the leader was up"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE kind = 'held'"
        )
        .await,
        2
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_catchup_too_big_for_the_statement_timeout_shrinks_its_steps(pool: PgPool) {
    // Three weeks of a once-a-minute schedule: 30,240 runs to catch up, under
    // a statement timeout a step of 10,000 runs (the most before steps were
    // sized by time) does not fit in.
    let text = "[minutely]\ncron = \"* * * * *\"\ncatchup = \"all\"\ncatchup_window = \"30d\"\n";
    let mut conn = pool.acquire().await.unwrap();
    let mut ticker = Ticker::load(&mut conn, schedules(text), GRACE)
        .await
        .unwrap()
        .with_budget(Budget {
            target: Duration::from_millis(60),
            statement: Duration::from_millis(250),
            lock: Duration::from_millis(250),
        });
    let first = ticker.next_wake().unwrap();
    let mut now = first + chrono::Duration::days(21);
    let (mut timeouts, mut steps, mut emitted) = (0, 0, 0);
    while steps < 5_000 {
        let step = ticker.step(&mut conn, now, now).await.unwrap();
        steps += 1;
        emitted += step.recorded.emitted;
        if step.timed_out {
            timeouts += 1;
            now += BUSY_RETRY;
        } else if !step.more {
            break;
        }
    }
    let expected = (now - first).num_minutes() as u64 + 1;
    assert_eq!(
        emitted, expected,
        "every run emitted, after {timeouts} timeouts in {steps} steps"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.schedule_runs").await as u64,
        expected
    );
}

async fn db_now(pool: &PgPool) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT now()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The scenario with a real process: one kind's route lock is held
/// for 10 s (longer than three leader timeouts); the other schedule keeps
/// emitting on time, the leader keeps its lock, and the held kind's runs are
/// emitted once the lock is free, each once and on time (`tick`).
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_held_route_lock_delays_only_its_kind_and_costs_no_leadership(pool: PgPool) {
    let url = harness::database_url(&pool);
    let every_2s = "[pulse]\ncron = \"*/2 * * * * *\"\nkind = \"pulse\"\n\
                    [held]\ncron = \"*/2 * * * * *\"\nkind = \"held\"\ncatchup = \"none\"\n";
    let dir = dir_with("held-route-lock", &[("s.toml", every_2s)]);
    let started = db_now(&pool).await - chrono::Duration::hours(1);
    let proc = Proc::start_with(&url, &dir, &["--leader-timeout", "3s"], &[]);
    eventually("the first runs", Duration::from_secs(30), || async {
        runs_after(&pool, "held", started).await >= 2
    })
    .await;

    let lock = hold_route_lock(&pool, "held").await;
    let held_at = db_now(&pool).await;
    eventually(
        "10 s of pulse runs while the lock is held",
        Duration::from_secs(40),
        || async { runs_after(&pool, "pulse", held_at).await >= 5 },
    )
    .await;
    assert!(proc.said("route lock is busy"), "{}", proc.log());
    let late: Vec<(String, f64)> = sqlx::query_as(
        "SELECT logical_run, extract(epoch FROM recorded_at - fire_at)::float8 \
         FROM almanac.schedule_runs WHERE schedule = 'pulse' AND fire_at > $1 \
           AND recorded_at - fire_at > interval '3 s'",
    )
    .bind(held_at)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        late.is_empty(),
        "pulse runs held back by another kind's lock: {late:?}"
    );
    let released_at = db_now(&pool).await;
    lock.commit().await.unwrap();

    eventually(
        "the held kind's runs after the release",
        Duration::from_secs(30),
        || async { runs_after(&pool, "held", released_at).await >= 1 },
    )
    .await;
    proc.signal(libc::SIGTERM);
    let log = proc.log();
    assert_eq!(proc.exit_code().await, Some(0));
    assert!(!log.contains("leadership lost"), "{log}");
    assert_eq!(log.matches("became scheduler leader").count(), 1, "{log}");
    assert_every_run_once(&pool, "pulse", 2).await;
    assert_every_run_once(&pool, "held", 2).await;
    let skipped = count(
        &pool,
        "SELECT count(*) FROM almanac.schedule_runs WHERE source <> 'tick'",
    )
    .await;
    assert_eq!(skipped, 0, "no run judged missed");
}

/// A schedule whose definition changed at a reload (daily made minutely)
/// does not get every run its new definition gives since its last planned
/// run as on-time ticks: those are judged from the reload, through its
/// catch-up policy.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_schedule_changed_at_a_reload_is_judged_from_the_reload(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let daily = "[s]\ncron = \"0 3 * * *\"\ncatchup = \"none\"\n";
    let mut ticker = Ticker::load(&mut conn, schedules(daily), GRACE)
        .await
        .unwrap();
    let first = ticker.next_wake().unwrap();
    let awake = first - chrono::Duration::seconds(30);
    ticker.step(&mut conn, first, awake).await.unwrap();
    // Six hours later the file says minutely, and the leader reloads.
    let reload = first + chrono::Duration::hours(6);
    let minutely = "[s]\ncron = \"* * * * *\"\ncatchup = \"none\"\n";
    let mut ticker = Ticker::load(&mut conn, schedules(minutely), GRACE)
        .await
        .unwrap();
    ticker.judge_from(&["s".to_string()].into_iter().collect(), reload);
    let step = ticker.step(&mut conn, reload, awake).await.unwrap();
    assert_eq!(
        (step.recorded.emitted, step.recorded.skipped_catchup),
        (2, 358),
        "only the runs within the minute's grace (due now and a minute ago); the six hours \
         before the reload were never planned as minutely"
    );
}
