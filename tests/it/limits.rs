//! Per-kind limits held across real processes (issue #23): three `almanac
//! work` processes of 32 slots and an `almanac consume` (of 8) on a `dual` kind,
//! each job a 200 ms shell command that writes its start and end to an
//! execution log. The log, not the database, is what the assertions read:
//! what ran, and when. The full-size run (5,000 jobs, rate 600/1m) is
//! `limits_at_full_size`, ignored by default.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use almanac::broker::SinkKind;
use almanac::control::{self, Actor, Source};
use almanac::queue::limits::Limits;
use almanac::relay::routes::RouteMode;
use sqlx::PgPool;

use crate::harness::scheduler_proc::Proc;
use crate::harness::{self, brokers, count, eventually};

/// One execution as the log shows it: job, process, start and end in
/// nanoseconds since the epoch (`None`: it never wrote its end).
#[derive(Debug, Clone)]
struct Run {
    job: i64,
    process: String,
    start: i64,
    end: Option<i64>,
}

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(brokers::unique(test));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The handler: log the start, take 200 ms, log the end.
fn command(log: &Path, process: &str) -> String {
    let log = log.display();
    format!(
        "echo \"s $ALMANAC_JOB_ID {process} $(date +%s%N)\" >> {log}; sleep 0.2; \
         echo \"e $ALMANAC_JOB_ID {process} $(date +%s%N)\" >> {log}"
    )
}

fn runs(log: &Path) -> Vec<Run> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut open: HashMap<(i64, String), Vec<usize>> = HashMap::new();
    let mut runs = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [mark, job, process, at] = fields[..] else {
            panic!("a torn log line: {line:?}");
        };
        let (job, at): (i64, i64) = (job.parse().unwrap(), at.parse().unwrap());
        let key = (job, process.to_string());
        match mark {
            "s" => {
                open.entry(key).or_default().push(runs.len());
                runs.push(Run {
                    job,
                    process: process.to_string(),
                    start: at,
                    end: None,
                });
            }
            "e" => {
                let i = open
                    .get_mut(&key)
                    .and_then(|v| v.pop())
                    .expect("an end after its start");
                runs[i].end = Some(at);
            }
            other => panic!("unknown mark {other} in {line:?}"),
        }
    }
    runs
}

/// The most runs of `group` (by the key `of` gives each run) that overlap
/// at one instant; a run with no end lasts until `open_until`.
fn most_at_once<K: std::hash::Hash + Eq + Clone>(
    runs: &[Run],
    open_until: i64,
    of: impl Fn(&Run) -> K,
) -> HashMap<K, usize> {
    let mut edges: HashMap<K, Vec<(i64, i32)>> = HashMap::new();
    for run in runs {
        let e = edges.entry(of(run)).or_default();
        e.push((run.start, 1));
        e.push((run.end.unwrap_or(open_until), -1));
    }
    edges
        .into_iter()
        .map(|(k, mut e)| {
            // Ends before starts at the same instant: touching is not overlapping.
            e.sort();
            let (mut now, mut most) = (0i32, 0i32);
            for (_, d) in e {
                now += d;
                most = most.max(now);
            }
            (k, most as usize)
        })
        .collect()
}

/// Each job ran to its end exactly once, and no two runs of one job
/// overlapped. The one exception is a crash: a job whose command ended on
/// a process SIGKILLed (`crashed`: its name, and when) before it recorded
/// the outcome runs again (at least once, as the lease fence promises, not
/// exactly once); its first run must have ended from two seconds before
/// the kill to one after it (its watchdog's reach).
fn every_job_once(runs: &[Run], ids: &[i64], open_until: i64, crashed: Option<(&str, i64)>) {
    let mut ended: HashMap<i64, Vec<&Run>> = HashMap::new();
    for run in runs.iter().filter(|r| r.end.is_some()) {
        ended.entry(run.job).or_default().push(run);
    }
    for id in ids {
        let ends = ended.get(id).map(Vec::as_slice).unwrap_or_default();
        let lost_with_crash = |r: &&Run| {
            crashed.is_some_and(|(name, at)| {
                r.process == name
                    && r.end
                        .is_some_and(|e| e > at - 2_000_000_000 && e <= at + 1_000_000_000)
            })
        };
        let (crash, others): (Vec<&Run>, Vec<&Run>) =
            ends.iter().copied().partition(lost_with_crash);
        assert!(
            !ends.is_empty() && others.len() <= 1 && crash.len() <= 1,
            "job {id} ran to its end {} times: {ends:?}",
            ends.len()
        );
    }
    let overlapping: Vec<_> = most_at_once(runs, open_until, |r| r.job)
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    assert!(
        overlapping.is_empty(),
        "runs of one job overlapped: {overlapping:?}"
    );
}

/// The cluster: three workers of 32 slots and a consumer of 8 on the
/// kind's queue, a relay feeding it and a reaper: about 45 connections
/// (a consumer of 32 would hold 33 for its claims alone), so one cluster
/// runs at a time ([`ONE_AT_A_TIME`]) within PostgreSQL's default 100.
struct Cluster {
    _turn: tokio::sync::MutexGuard<'static, ()>,
    workers: Vec<Option<Proc>>,
    consumer: Proc,
    relay: Proc,
}

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

impl Cluster {
    async fn start(
        url: &str,
        sink: SinkKind,
        kind: &str,
        destination: &str,
        log: &Path,
        lease: &str,
    ) -> Cluster {
        let turn = ONE_AT_A_TIME.lock().await;
        let worker = |n: usize| {
            let mut cmd = harness::almanac();
            cmd.args(["work", "--handler"])
                .arg(format!("{kind}={}", command(log, &format!("w{n}"))))
                .args(["--concurrency", "32", "--lease", lease])
                .args(["--poll-interval", "1s", "--shutdown-deadline", "5s"])
                .env("DATABASE_URL", url)
                .stdout(Stdio::null());
            Some(Proc::spawn(cmd))
        };
        let broker = match sink {
            SinkKind::Rabbitmq => ["--amqp-url".to_string(), brokers::amqp_url()],
            SinkKind::Kafka => ["--kafka-brokers".to_string(), brokers::kafka_brokers()],
        };
        let mut consumer = harness::almanac();
        consumer
            .args([
                "consume",
                "--sink",
                &sink.to_string(),
                "--destination",
                destination,
            ])
            .args(&broker)
            .arg("--handler")
            .arg(format!("{kind}={}", command(log, "c")))
            .args(["--concurrency", "8", "--lease", lease])
            .args(["--shutdown-deadline", "5s"])
            .env("DATABASE_URL", url)
            .stdout(Stdio::null());
        let mut relay = harness::almanac();
        relay
            .args(["run", "--roles", "relay,reaper", "--reaper-interval", "1s"])
            .args(&broker)
            .env("DATABASE_URL", url)
            .stdout(Stdio::null());
        Cluster {
            _turn: turn,
            workers: (1..=3).map(worker).collect(),
            consumer: Proc::spawn(consumer),
            relay: Proc::spawn(relay),
        }
    }

    async fn stop(self) {
        for proc in self
            .workers
            .into_iter()
            .flatten()
            .chain([self.consumer, self.relay])
        {
            proc.signal(libc::SIGTERM);
            let log = proc.log();
            assert_eq!(proc.exit_code().await, Some(0), "{log}");
        }
    }
}

async fn enqueue(pool: &PgPool, kind: &str, n: i64, payload: &str) -> Vec<i64> {
    sqlx::query_scalar(&format!(
        "INSERT INTO almanac.jobs (kind, payload) \
         SELECT $1, {payload} FROM generate_series(0, $2 - 1) AS g RETURNING id"
    ))
    .bind(kind)
    .bind(n)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn set_limits(pool: &PgPool, kind: &str, limits: Limits) {
    let actor = Actor::new("night-ops", Source::Cli);
    let mut conn = pool.acquire().await.unwrap();
    control::limits::set(&mut conn, &actor, kind, &limits)
        .await
        .unwrap();
}

async fn all_done(pool: &PgPool, kind: &str, n: usize, within: Duration) {
    let sql =
        format!("SELECT count(*) FROM almanac.jobs WHERE kind = '{kind}' AND status = 'done'");
    eventually(&format!("{n} jobs of {kind} done"), within, || async {
        count(pool, &sql).await == n as i64
    })
    .await;
}

fn nanos_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64
}

/// Global 10 on every path at once (workers and a consumer of `sink`); one
/// worker SIGKILLed mid-run gives its slots back within one lease.
async fn global_limit(pool: PgPool, sink: SinkKind, jobs: i64) {
    let url = harness::database_url(&pool);
    let dir = scratch("limits-global");
    let log = dir.join("runs.log");
    let destination = brokers::route_to_fresh(&pool, "api", RouteMode::Dual, sink).await;
    let global = Limits {
        global: Some(10),
        ..Limits::default()
    };
    set_limits(&pool, "api", global).await;
    let lease = Duration::from_secs(5);
    let mut cluster = Cluster::start(&url, sink, "api", &destination, &log, "5s").await;
    let ids = enqueue(&pool, "api", jobs, "'{}'::jsonb").await;

    // Mid-run, once a third is done, SIGKILL a worker the moment the log
    // shows it running a job.
    eventually(
        "a third of the jobs done",
        Duration::from_secs(120),
        || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
            )
            .await
                >= jobs / 3
        },
    )
    .await;
    let open_in = |n: usize| {
        runs(&log)
            .iter()
            .filter(|r| r.process == format!("w{n}") && r.end.is_none())
            .count()
    };
    let victim = std::sync::Mutex::new(None);
    // Two open runs, not one: a 200 ms run can end between this look at
    // the log and the kill (it did once), and then the slots held by a
    // killed worker would go untested.
    eventually("a worker running two jobs", Duration::from_secs(60), || {
        let found = (1..=3).find(|&n| open_in(n) >= 2);
        *victim.lock().unwrap() = found;
        async move { found.is_some() }
    })
    .await;
    let victim = victim.into_inner().unwrap().unwrap();
    let killed_name = format!("w{victim}");
    let killed = cluster.workers[victim - 1].take().unwrap();
    killed.signal(libc::SIGKILL);
    let killed_at = nanos_now();
    assert_eq!(killed.exit_code().await, None, "killed by a signal");

    all_done(&pool, "api", jobs as usize, Duration::from_secs(240)).await;
    cluster.stop().await;
    let runs = runs(&log);
    // The killed worker's commands die with it (its watchdog polls every
    // 500 ms): the runs it never ended count as running for a second more.
    // Their slots stay taken until their leases run out.
    let lease_ns = lease.as_nanos() as i64;
    let open_until = killed_at + 1_000_000_000;
    every_job_once(&runs, &ids, open_until, Some((&killed_name, killed_at)));
    let at_once = most_at_once(&runs, open_until, |_| ())[&()];
    assert!(
        at_once <= 10,
        "{at_once} jobs ran at once under a global limit of 10"
    );
    assert_eq!(
        at_once, 10,
        "the limit was never reached: the test proves nothing"
    );
    let by_process = most_at_once(&runs, open_until, |r| r.process.clone());
    assert!(
        by_process.get("c").is_some_and(|n| *n > 0),
        "the consumer ran none: {by_process:?}"
    );
    // The killed worker's slots: the runs it never ended.
    let held = runs
        .iter()
        .filter(|r| r.process == killed_name && r.end.is_none())
        .count();
    assert!(held >= 1, "the killed worker had {held} runs open");
    let survivors: Vec<Run> = runs
        .iter()
        .filter(|r| r.process != killed_name)
        .cloned()
        .collect();
    let running_at = |t: i64| {
        survivors
            .iter()
            .filter(|r| r.start <= t && r.end.is_none_or(|e| e > t))
            .count()
    };
    // While the dead worker's leases last (renewed every third of a lease,
    // so at least two thirds of one from the kill), its slots stay taken:
    // from when its commands are gone to half a lease, the others run at
    // most 10 - held at once...
    let held_until = killed_at + lease_ns / 2;
    let while_held = survivors
        .iter()
        .map(|r| r.start)
        .filter(|&t| t >= open_until && t < held_until)
        .map(running_at)
        .max()
        .unwrap_or(0);
    assert!(
        while_held <= 10 - held,
        "{while_held} ran at once while the killed worker's {held} leases held"
    );
    // ...and once they run out, the others run 10 at once again, within
    // one lease of the kill (plus two seconds of claims on a loaded machine).
    let back = survivors
        .iter()
        .map(|r| r.start)
        .filter(|&t| t > killed_at)
        .find(|&t| running_at(t) == 10);
    let last_start = survivors.iter().map(|r| r.start).max().unwrap();
    eprintln!(
        "global 10 ({sink}): {jobs} jobs; the killed worker ran {held}; the others ran at most {while_held} at once while its leases held, and 10 again {:?} after the kill (the last job started {:?} after it)",
        back.map(|t| Duration::from_nanos((t - killed_at) as u64)),
        Duration::from_nanos((last_start - killed_at) as u64)
    );
    let back = back.expect("the others never ran 10 at once after the kill");
    assert!(
        back - killed_at <= lease_ns + 2_000_000_000,
        "the killed worker's slots came back {:?} after the kill; the lease is {lease:?}",
        Duration::from_nanos((back - killed_at) as u64)
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_global_limit_holds_across_workers_and_a_consumer_and_a_killed_worker_gives_its_slots_back(
    pool: PgPool,
) {
    global_limit(pool, SinkKind::Rabbitmq, 800).await;
}

/// The same with the consumer on Kafka (one message at a time per
/// partition: a held message holds its partition).
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_global_limit_holds_with_a_kafka_consumer_too(pool: PgPool) {
    global_limit(pool, SinkKind::Kafka, 800).await;
}

/// Per-key 1 over 50 keys (and a bucket of jobs without the key).
async fn per_key_limit(pool: PgPool, jobs: i64) {
    let url = harness::database_url(&pool);
    let dir = scratch("limits-per-key");
    let log = dir.join("runs.log");
    let queue = brokers::route_to_fresh(&pool, "sync", RouteMode::Dual, SinkKind::Rabbitmq).await;
    let per_key = Limits {
        per_key: Some("/customer_id=1".parse().unwrap()),
        ..Limits::default()
    };
    set_limits(&pool, "sync", per_key).await;
    let cluster = Cluster::start(&url, SinkKind::Rabbitmq, "sync", &queue, &log, "30s").await;
    let mut ids = enqueue(
        &pool,
        "sync",
        jobs,
        "jsonb_build_object('customer_id', g % 50)",
    )
    .await;
    ids.extend(enqueue(&pool, "sync", 10, "'{}'::jsonb").await);
    all_done(&pool, "sync", ids.len(), Duration::from_secs(240)).await;
    cluster.stop().await;
    let runs = runs(&log);
    every_job_once(&runs, &ids, nanos_now(), None);
    let keys: HashMap<i64, Option<String>> = sqlx::query_as(
        "SELECT id, payload ->> 'customer_id' FROM almanac.jobs WHERE kind = 'sync'",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let per_key = most_at_once(&runs, i64::MAX, |r| keys[&r.job].clone());
    let worst = per_key.iter().max_by_key(|(_, n)| **n).unwrap();
    assert_eq!(*worst.1, 1, "two jobs of one key ran at once: {worst:?}");
    assert!(
        per_key.contains_key(&None),
        "the jobs without the key never ran"
    );
    let at_once = most_at_once(&runs, i64::MAX, |_| ())[&()];
    eprintln!(
        "per key 1: {} jobs over 50 keys, {at_once} at once",
        ids.len()
    );
    assert!(
        at_once >= 10,
        "only {at_once} keys ran at once: the limit held back other keys"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_per_key_limit_never_runs_two_jobs_of_one_key_at_once_and_keyless_jobs_share_a_bucket(
    pool: PgPool,
) {
    per_key_limit(pool, 300).await;
}

/// Rate `count/period` with `burst`: no window `[t, t + period)` of starts
/// holds more than count + burst.
async fn rate_limit(
    pool: PgPool,
    jobs: i64,
    rate: &str,
    period: Duration,
    count_: usize,
    burst: usize,
) {
    let url = harness::database_url(&pool);
    let dir = scratch("limits-rate");
    let log = dir.join("runs.log");
    let queue = brokers::route_to_fresh(&pool, "mail", RouteMode::Dual, SinkKind::Rabbitmq).await;
    let limits = Limits {
        rate: Some(rate.parse().unwrap()),
        burst: burst as i32,
        ..Limits::default()
    };
    set_limits(&pool, "mail", limits).await;
    let cluster = Cluster::start(&url, SinkKind::Rabbitmq, "mail", &queue, &log, "30s").await;
    let started = Instant::now();
    let ids = enqueue(&pool, "mail", jobs, "'{}'::jsonb").await;
    all_done(
        &pool,
        "mail",
        jobs as usize,
        Duration::from_secs(jobs as u64 * 2 + 120),
    )
    .await;
    let took = started.elapsed();
    cluster.stop().await;
    let runs = runs(&log);
    every_job_once(&runs, &ids, nanos_now(), None);
    let mut starts: Vec<i64> = runs.iter().map(|r| r.start).collect();
    starts.sort();
    let period_ns = period.as_nanos() as i64;
    let most = (0..starts.len())
        .map(|i| {
            starts[i..]
                .iter()
                .take_while(|&&t| t < starts[i] + period_ns)
                .count()
        })
        .max()
        .unwrap();
    eprintln!("rate {rate} burst {burst}: {jobs} jobs in {took:?}, at most {most} starts in a window of {period:?}");
    assert!(
        most <= count_ + burst,
        "{most} starts in one window of {period:?}; the limit is {count_} + {burst}"
    );
    assert!(
        most > count_ / 2,
        "only {most} starts in the busiest window of {period:?}: the rate was never approached"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_rate_limit_never_starts_more_than_rate_plus_burst_in_any_window(pool: PgPool) {
    rate_limit(pool, 150, "60/6s", Duration::from_secs(6), 60, 10).await;
}

/// The numbers: 5,000 jobs of 200 ms; global 10, per key 1 over 50
/// keys, rate 600/1m burst 10 (about 8 minutes for the rate alone).
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
#[ignore = "full size: about 20 minutes; run with --ignored"]
async fn limits_at_full_size(pool: PgPool) {
    let second = harness::another_pool(&pool, 4).await;
    global_limit(pool, SinkKind::Rabbitmq, 5000).await;
    sqlx::query("DELETE FROM almanac.jobs")
        .execute(&second)
        .await
        .unwrap();
    per_key_limit(second.clone(), 5000).await;
    sqlx::query("DELETE FROM almanac.jobs")
        .execute(&second)
        .await
        .unwrap();
    rate_limit(second, 5000, "600/1m", Duration::from_secs(60), 600, 10).await;
}

/// A claim never waits for a limit's lock: while another transaction holds
/// a limited kind's row, a claim of that kind and an unlimited one returns
/// at once with the unlimited kind's jobs, and the limited kind's jobs are
/// claimed (within the limit) once the row is free.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_claim_never_waits_for_a_limit_held_by_another_claim(pool: PgPool) {
    set_limits(
        &pool,
        "limited",
        Limits {
            global: Some(2),
            ..Limits::default()
        },
    )
    .await;
    enqueue(&pool, "limited", 5, "'{}'::jsonb").await;
    enqueue(&pool, "free", 5, "'{}'::jsonb").await;
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM almanac.kind_limits WHERE kind = 'limited' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let kinds = ["free".to_string(), "limited".to_string()];
    let claim = almanac::queue::Claim {
        kinds: &kinds,
        limit: 10,
        lease: Duration::from_secs(30),
    };
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET lock_timeout = '2s'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let started = Instant::now();
    let claimed = almanac::queue::claim(&mut *conn, &claim).await.unwrap();
    assert!(
        claimed.iter().all(|j| j.kind == "free") && claimed.len() == 5,
        "{claimed:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the claim waited"
    );
    holder.rollback().await.unwrap();
    let claimed = almanac::queue::claim(&mut *conn, &claim).await.unwrap();
    assert_eq!(
        claimed.len(),
        2,
        "within the global limit of 2: {claimed:?}"
    );
    assert!(claimed.iter().all(|j| j.kind == "limited"));
}

/// A small claim of a per-key kind looks past a busy key's queued jobs
/// (up to the per-key window): one customer with 150 queued jobs and one
/// running does not keep 20 other customers' jobs waiting.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_busy_key_s_backlog_does_not_hold_back_other_keys(pool: PgPool) {
    set_limits(
        &pool,
        "sync",
        Limits {
            per_key: Some("/c=1".parse().unwrap()),
            ..Limits::default()
        },
    )
    .await;
    sqlx::raw_sql(
        "INSERT INTO almanac.jobs (kind, payload, run_at)
             SELECT 'sync', '{\"c\": \"hot\"}', now() - interval '1 hour' + g * interval '1 ms'
             FROM generate_series(1, 151) AS g;
         UPDATE almanac.jobs SET status = 'running', attempts = 1, lease_token = gen_random_uuid(),
                lease_until = now() + interval '1 hour'
         WHERE id = (SELECT min(id) FROM almanac.jobs);
         INSERT INTO almanac.jobs (kind, payload, run_at)
             SELECT 'sync', jsonb_build_object('c', g), now() - interval '30 minutes'
             FROM generate_series(1, 20) AS g;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let kinds = ["sync".to_string()];
    let claimed = almanac::queue::claim(
        &pool,
        &almanac::queue::Claim {
            kinds: &kinds,
            limit: 10,
            lease: Duration::from_secs(30),
        },
    )
    .await
    .unwrap();
    let keys: std::collections::HashSet<String> =
        claimed.iter().map(|j| j.payload["c"].to_string()).collect();
    assert_eq!(claimed.len(), 10, "{claimed:?}");
    assert_eq!(keys.len(), 10, "one job per key: {keys:?}");
    assert!(
        !keys.contains("\"hot\""),
        "the busy key's job ran twice at once"
    );
}

/// A per-key limit holds at its edge: a claim skips counting keys only
/// when no key can reach its limit (the kind's running jobs plus the
/// claim's size within it), and otherwise never starts a job whose key is
/// at its limit. Per-key 3, two of key `a` running, `a`'s jobs due first.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_per_key_limit_holds_at_its_edge(pool: PgPool) {
    set_limits(
        &pool,
        "sync",
        Limits {
            per_key: Some("/c=3".parse().unwrap()),
            ..Limits::default()
        },
    )
    .await;
    sqlx::raw_sql(
        "INSERT INTO almanac.jobs (kind, payload, run_at)
             SELECT 'sync', '{\"c\": \"a\"}', now() - interval '1 hour' + g * interval '1 ms'
             FROM generate_series(1, 7) AS g;
         UPDATE almanac.jobs SET status = 'running', attempts = 1, lease_token = gen_random_uuid(),
                lease_until = now() + interval '1 hour'
         WHERE id IN (SELECT id FROM almanac.jobs ORDER BY id LIMIT 2);
         INSERT INTO almanac.jobs (kind, payload, run_at)
             SELECT 'sync', '{\"c\": \"b\"}', now() - interval '30 minutes' + g * interval '1 ms'
             FROM generate_series(1, 5) AS g;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let kinds = ["sync".to_string()];
    let claim = |limit| {
        let pool = pool.clone();
        let kinds = kinds.clone();
        async move {
            let claimed = almanac::queue::claim(
                &pool,
                &almanac::queue::Claim {
                    kinds: &kinds,
                    limit,
                    lease: Duration::from_secs(60),
                },
            )
            .await
            .unwrap();
            claimed
                .iter()
                .map(|j| j.payload["c"].as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        }
    };
    // 2 running + 1 = 3: no key can pass 3, the earliest due is taken.
    assert_eq!(claim(1).await, ["a"]);
    // 3 running + 1 > 3: `a` is at its limit, `b` is next.
    assert_eq!(claim(1).await, ["b"]);
    // `a` full, `b` has 2 slots left.
    assert_eq!(claim(10).await, ["b", "b"]);
    assert!(claim(10).await.is_empty());
    let running: Vec<(String, i64)> = sqlx::query_as(
        "SELECT payload ->> 'c', count(*) FROM almanac.jobs WHERE status = 'running'
         GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(running, [("a".to_string(), 3), ("b".to_string(), 3)]);
}
