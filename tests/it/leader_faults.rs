//! The scheduler leader under the faults production has, with real
//! `almanac run` processes and a schedule every two seconds: a leader whose
//! connection freezes (half-open, through tests/it/harness/proxy.rs), a leader
//! whose backend is terminated, a leader SIGSTOPped past the takeover time,
//! and a leader whose host clock is minutes ahead. Each ends with the ledger
//! check a user relies on: no logical run missing or doubled, none emitted
//! before it was due.

use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::harness::proxy::Proxy;
use crate::harness::scheduler_proc::{
    assert_every_run_once, db_now, dir_with, leader_backend, runs_after, Proc,
};
use crate::harness::{self, eventually};

const EVERY_2S: &str = "[pulse]\ncron = \"*/2 * * * * *\"\nkind = \"pulse\"\n";

/// The leader timeout these tests run with; takeover is documented to take
/// at most 2 × this + the standby retry (300 ms) + a connection set-up.
const LEADER_TIMEOUT: Duration = Duration::from_secs(3);
const FLAGS: [&str; 2] = ["--leader-timeout", "3s"];

/// The documented worst case, plus room for a loaded machine to start a
/// connection and be scheduled.
fn takeover_bound() -> Duration {
    LEADER_TIMEOUT * 2 + Duration::from_millis(300) + Duration::from_secs(4)
}

async fn leads(proc: &Proc, what: &str) {
    eventually(what, Duration::from_secs(30), || async {
        proc.said("became scheduler leader")
    })
    .await;
}

async fn runs_continue(pool: &PgPool, after: chrono::DateTime<chrono::Utc>, n: i64) {
    eventually(
        &format!("{n} runs after {after}"),
        Duration::from_secs(30),
        || async { runs_after(pool, "pulse", after).await >= n },
    )
    .await;
}

async fn stop(procs: Vec<Proc>) {
    for proc in procs {
        proc.signal(libc::SIGTERM);
        assert_eq!(proc.exit_code().await, Some(0));
    }
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_frozen_leader_connection_loses_the_lock_to_a_standby_within_the_bound(pool: PgPool) {
    let url = harness::database_url(&pool);
    let proxy = Proxy::postgres().await;
    let dir = dir_with("freeze", &[("pulse.toml", EVERY_2S)]);
    let old = Proc::start_with(&proxy.postgres_url(&url), &dir, &FLAGS, &[]);
    leads(&old, "the proxied process to lead").await;
    let standby = Proc::start_with(&url, &dir, &FLAGS, &[]);
    eventually(
        "the direct process to stand by",
        Duration::from_secs(30),
        || async { standby.said("another scheduler leads; standing by") },
    )
    .await;
    runs_continue(&pool, db_now(&pool).await, 2).await;

    proxy.freeze();
    let frozen = Instant::now();
    let frozen_at = db_now(&pool).await;
    leads(&standby, "the standby to lead").await;
    let took = frozen.elapsed();
    eprintln!("takeover after the freeze: {took:?}");
    assert!(
        took <= takeover_bound(),
        "takeover took {took:?}; documented bound {:?}",
        takeover_bound()
    );
    eventually(
        "the frozen leader to give up",
        Duration::from_secs(30),
        || async { old.said("scheduler leadership lost") },
    )
    .await;
    runs_continue(&pool, frozen_at + chrono::Duration::seconds(4), 2).await;

    // Thaw: whatever the old leader had in flight reaches a session the
    // server already ended; it stands by behind the new leader.
    proxy.thaw();
    eventually(
        "the old leader to stand by again",
        Duration::from_secs(30),
        || async { old.times_said("another scheduler leads; standing by") >= 1 },
    )
    .await;
    runs_continue(&pool, db_now(&pool).await, 2).await;
    assert_eq!(
        old.times_said("became scheduler leader"),
        1,
        "{}",
        old.log()
    );
    stop(vec![old, standby]).await;
    assert_every_run_once(&pool, "pulse", 2).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_terminated_leader_backend_moves_leadership_and_no_run_is_missing_or_doubled(
    pool: PgPool,
) {
    let url = harness::database_url(&pool);
    let dir = dir_with("terminate", &[("pulse.toml", EVERY_2S)]);
    let procs = vec![
        Proc::start_with(&url, &dir, &FLAGS, &[]),
        Proc::start_with(&url, &dir, &FLAGS, &[]),
    ];
    eventually("a leader", Duration::from_secs(30), || async {
        procs.iter().any(|p| p.said("became scheduler leader"))
    })
    .await;
    runs_continue(&pool, db_now(&pool).await, 2).await;
    let leader = procs
        .iter()
        .position(|p| p.said("became scheduler leader"))
        .unwrap();
    let backend = leader_backend(&pool)
        .await
        .expect("the leader holds the lock");
    // Only this test's database: the lock query joined on current_database().
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(backend)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(terminated);
    let killed_at = db_now(&pool).await;
    eventually("the leader to notice", Duration::from_secs(30), || async {
        procs[leader].said("scheduler leadership lost")
    })
    .await;
    eventually("a new lock session", Duration::from_secs(30), || async {
        leader_backend(&pool)
            .await
            .is_some_and(|pid| pid != backend)
    })
    .await;
    let elected: usize = procs
        .iter()
        .map(|p| p.times_said("became scheduler leader"))
        .sum();
    assert_eq!(elected, 2, "one election after the termination");
    runs_continue(&pool, killed_at + chrono::Duration::seconds(2), 3).await;
    stop(procs).await;
    assert_every_run_once(&pool, "pulse", 2).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_leader_stopped_past_the_takeover_time_emits_nothing_twice_when_continued(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = dir_with("sigstop", &[("pulse.toml", EVERY_2S)]);
    let old = Proc::start_with(&url, &dir, &FLAGS, &[]);
    leads(&old, "the first process to lead").await;
    let standby = Proc::start_with(&url, &dir, &FLAGS, &[]);
    eventually(
        "the second process to stand by",
        Duration::from_secs(30),
        || async { standby.said("another scheduler leads; standing by") },
    )
    .await;
    runs_continue(&pool, db_now(&pool).await, 2).await;

    old.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    let stopped_at = db_now(&pool).await;
    leads(&standby, "the standby to lead").await;
    let took = stopped.elapsed();
    eprintln!("takeover after SIGSTOP: {took:?}");
    assert!(took <= takeover_bound(), "takeover took {took:?}");
    runs_continue(&pool, stopped_at + chrono::Duration::seconds(4), 2).await;

    old.signal(libc::SIGCONT);
    eventually(
        "the continued leader to find it lost",
        Duration::from_secs(30),
        || async { old.said("scheduler leadership lost") },
    )
    .await;
    runs_continue(&pool, db_now(&pool).await, 3).await;
    assert_eq!(
        old.times_said("became scheduler leader"),
        1,
        "{}",
        old.log()
    );
    stop(vec![old, standby]).await;
    assert_every_run_once(&pool, "pulse", 2).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_leader_whose_clock_runs_ahead_skips_nothing_and_emits_nothing_early(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = dir_with("skew", &[("pulse.toml", EVERY_2S)]);
    let proc = Proc::start_with(&url, &dir, &FLAGS, &[("ALMANAC_CLOCK_OFFSET", "5m")]);
    leads(&proc, "the skewed process to lead").await;
    eventually("the skew warning", Duration::from_secs(30), || async {
        proc.said("the host clock differs from the database's")
    })
    .await;
    let log = proc.log();
    let skew: i64 = log
        .split("host_minus_database_ms=")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit() && c != '-').next())
        .and_then(|n| n.parse().ok())
        .expect("the warning gives the skew");
    assert!((290_000..310_000).contains(&skew), "{log}");
    runs_continue(&pool, db_now(&pool).await, 4).await;
    stop(vec![proc]).await;
    // Five minutes ahead is past the 60 s grace: planning by the host clock
    // would have recorded not-yet-due runs as skipped, or emitted them early.
    assert_every_run_once(&pool, "pulse", 2).await;
}
