//! `almanac jobs cancel` on a running job, with real processes: the
//! process holding the job (an `almanac work`, an `almanac consume` on
//! RabbitMQ and on Kafka, an embedded worker) stops its handler within 2 s
//! (a command's whole process group is gone), the job ends `cancelled`
//! with who and why and an audit row, and the CLI says what happened; a
//! holder that is gone leaves the cancel to the reaper, and the job never
//! runs again.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use almanac::metrics::Metrics;
use almanac::queue::{self, JobStatus, NewJob};
use almanac::relay::routes::RouteMode;
use almanac::relay::{Publisher, Relay, SinkKind};
use almanac::role::{Role, Settings};
use almanac::worker::{JobContext, Worker, WorkerConfig};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::brokers::{self, unique};
use crate::harness::scheduler_proc::Proc;
use crate::harness::{self, count, eventually, text};

/// The OS user the CLI runs as in these tests.
const OPERATOR: &str = "ops-alice";

pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(unique(name));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A command that records its shell's and its `sleep`'s pids in `dir`,
/// appends a line to `dir/runs` per run, and sleeps for ten minutes.
pub fn sleeper(dir: &Path) -> String {
    let dir = dir.display();
    format!(
        "echo \"$ALMANAC_JOB_ID $ALMANAC_ATTEMPT\" >> {dir}/runs; echo $$ > {dir}/sh.$ALMANAC_JOB_ID; \
         sleep 600 & echo $! > {dir}/sleep.$ALMANAC_JOB_ID; wait"
    )
}

pub fn runs(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("runs"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn pid(dir: &Path, what: &str, id: i64) -> Option<i32> {
    std::fs::read_to_string(dir.join(format!("{what}.{id}")))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether `pid` has ended (gone, or a zombie waiting for its parent).
pub fn gone(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z"))
        .unwrap_or(false);
    !alive || zombie
}

/// `almanac jobs cancel ID --reason REASON` as `OPERATOR`.
fn cancel_cli(url: &str, id: i64, extra: &[&str]) -> Output {
    harness::almanac()
        .args([
            "jobs",
            "cancel",
            &id.to_string(),
            "--reason",
            "wrong report",
        ])
        .args(extra)
        .env("DATABASE_URL", url)
        .env("USER", OPERATOR)
        .output()
        .unwrap()
}

async fn started(dir: &Path, id: i64) -> (i32, i32) {
    eventually("the command to start", Duration::from_secs(60), || async {
        pid(dir, "sh", id).is_some() && pid(dir, "sleep", id).is_some()
    })
    .await;
    (pid(dir, "sh", id).unwrap(), pid(dir, "sleep", id).unwrap())
}

/// Cancels running job `id` (kind `kind`, whose command is [`sleeper`] in
/// `dir`) from the CLI and checks everything a person relies on; returns
/// how long the command's processes took to go.
async fn cancel_and_check(pool: &PgPool, dir: &Path, id: i64, kind: &str) -> Duration {
    let url = harness::database_url(pool);
    let (sh, sleep) = started(dir, id).await;
    let asked = Instant::now();
    let cli = tokio::task::spawn_blocking({
        let url = url.clone();
        move || cancel_cli(&url, id, &[])
    });
    eventually(
        "the command's process group to be killed",
        Duration::from_secs(2),
        || async move { gone(sh) && gone(sleep) },
    )
    .await;
    let took = asked.elapsed();
    let out = cli.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!("job {id} ({kind}) cancelled: its handler was stopped on its worker")
    );
    let job = queue::get(pool, id).await.unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.cancelled_by.as_deref(), Some("ops-alice (cli)"));
    assert_eq!(job.cancel_reason.as_deref(), Some("wrong report"));
    let error = job.last_error.unwrap_or_default();
    assert!(
        error.starts_with("cancelled by ops-alice (cli) (wrong report); the handler ended: command killed: an operator cancelled the job"),
        "{error}"
    );
    assert_eq!(
        count(
            pool,
            &format!(
                "SELECT count(*) FROM almanac.audit_log WHERE actor = '{OPERATOR}' AND source = 'cli' \
                 AND action = 'cancel' AND target = 'job {id}' AND count = 1"
            )
        )
        .await,
        1
    );
    took
}

fn worker(url: &str, kind: &str, command: &str, lease: &str) -> Proc {
    let mut cmd = harness::almanac();
    cmd.args(["work", "--handler"])
        .arg(format!("{kind}={command}"))
        .args(["--lease", lease, "--concurrency", "2"])
        .args(["--poll-interval", "100ms", "--shutdown-deadline", "2s"])
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null());
    Proc::spawn(cmd)
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_running_command_is_killed_within_2s_by_jobs_cancel(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = scratch("cancel-work");
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("report").max_attempts(5))
        .await
        .unwrap()
        .id();
    let work = worker(&url, "report", &sleeper(&dir), "30s");
    let took = cancel_and_check(&pool, &dir, id, "report").await;
    eprintln!("almanac work: the command was gone {took:?} after jobs cancel started");
    assert!(
        work.said("job cancelled: its handler was stopped")
            && work.said("cancelled by ops-alice (cli) (wrong report)"),
        "{}",
        work.log()
    );
    assert_eq!(runs(&dir).len(), 1, "{:?}", runs(&dir));
    work.signal(libc::SIGTERM);
    assert_eq!(work.exit_code().await, Some(0));
}

async fn a_consumer_s_command_is_killed_within_2s_by_jobs_cancel(pool: PgPool, sink: SinkKind) {
    let url = harness::database_url(&pool);
    let dir = scratch("cancel-consume");
    let destination = brokers::route_to_fresh(&pool, "report", RouteMode::Broker, sink).await;
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("report"))
        .await
        .unwrap()
        .id();
    let publisher = Publisher::new(sink, &brokers::sinks()).unwrap();
    let mut relay = Relay::new(
        pool.clone(),
        publisher,
        brokers::relay_config().validated().unwrap(),
    );
    assert_eq!(relay.run_once().await.unwrap().published, 1);

    let mut cmd = harness::almanac();
    cmd.args(["consume", "--sink", &sink.to_string(), "--destination"])
        .arg(&destination)
        .arg("--handler")
        .arg(format!("report={}", sleeper(&dir)))
        .args(["--lease", "30s", "--shutdown-deadline", "2s"])
        .env("DATABASE_URL", &url)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null());
    match sink {
        SinkKind::Kafka => cmd.args(["--kafka-brokers", &brokers::kafka_brokers()]),
        SinkKind::Rabbitmq => cmd.args(["--amqp-url", &brokers::amqp_url()]),
    };
    let consumer = Proc::spawn(cmd);
    let took = cancel_and_check(&pool, &dir, id, "report").await;
    eprintln!("almanac consume ({sink}): the command was gone {took:?} after jobs cancel started");
    assert!(
        consumer.said("job cancelled: its handler was stopped"),
        "{}",
        consumer.log()
    );
    assert_eq!(runs(&dir).len(), 1, "{:?}", runs(&dir));
    consumer.signal(libc::SIGTERM);
    assert_eq!(consumer.exit_code().await, Some(0));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_rabbitmq_consumer_s_command_is_killed_within_2s_by_jobs_cancel(pool: PgPool) {
    a_consumer_s_command_is_killed_within_2s_by_jobs_cancel(pool, SinkKind::Rabbitmq).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_kafka_consumer_s_command_is_killed_within_2s_by_jobs_cancel(pool: PgPool) {
    a_consumer_s_command_is_killed_within_2s_by_jobs_cancel(pool, SinkKind::Kafka).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_job_on_a_host_that_is_gone_is_cancelled_by_the_reaper_and_never_runs_again(
    pool: PgPool,
) {
    let url = harness::database_url(&pool);
    let dir = scratch("cancel-gone");
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("report").max_attempts(5))
        .await
        .unwrap()
        .id();
    let first = worker(&url, "report", &sleeper(&dir), "3s");
    let (sh, _) = started(&dir, id).await;
    first.signal(libc::SIGKILL);
    assert_eq!(first.exit_code().await, None);

    // Nobody answers: the CLI says so, and when the reaper will act.
    let out = cancel_cli(&url, id, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(
        said.starts_with(&format!(
            "cancel requested; the worker holding job {id} did not answer within "
        )) && said.contains("the reaper cancels it when its lease runs out at ")
            && said.ends_with("(it will not run again)"),
        "{said}"
    );
    // The watchdog killed the command when its worker died.
    eventually(
        "the dead worker's command to end",
        Duration::from_secs(5),
        || async move { gone(sh) },
    )
    .await;

    eventually("the lease to run out", Duration::from_secs(10), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE lease_until < clock_timestamp()",
        )
        .await
            == 1
    })
    .await;
    let reaped = queue::reap_expired(&pool, 100).await.unwrap();
    assert_eq!((reaped.cancelled, reaped.requeued), (1, 0));
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.cancelled_by.as_deref(), Some("ops-alice (cli)"));

    // A new worker runs the next job, never the cancelled one.
    let next = queue::enqueue(&mut conn, &NewJob::new("report"))
        .await
        .unwrap()
        .id();
    let log = dir.join("runs");
    let command = format!(
        "echo \"$ALMANAC_JOB_ID $ALMANAC_ATTEMPT\" >> {}",
        log.display()
    );
    let second = worker(&url, "report", &command, "3s");
    eventually(
        "the next job to be done",
        Duration::from_secs(30),
        || async { queue::get(&pool, next).await.unwrap().status == JobStatus::Done },
    )
    .await;
    assert_eq!(runs(&dir), vec![format!("{id} 1"), format!("{next} 1")]);
    assert_eq!(
        queue::get(&pool, id).await.unwrap().status,
        JobStatus::Cancelled
    );
    second.signal(libc::SIGTERM);
    assert_eq!(second.exit_code().await, Some(0));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn cancelling_a_finished_job_changes_nothing_and_says_so(pool: PgPool) {
    let url = harness::database_url(&pool);
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("report"))
        .await
        .unwrap()
        .id();
    let job = queue::claim(
        &mut *conn,
        &queue::Claim {
            kinds: &["report".to_string()],
            limit: 1,
            lease: Duration::from_secs(30),
        },
    )
    .await
    .unwrap()
    .remove(0);
    let (_, token) = job.lease().unwrap();
    assert!(queue::complete(&pool, id, token).await.unwrap().is_held());

    let out = cancel_cli(&url, id, &[]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        text(&out.stdout),
        format!("job {id} (report) is already done: nothing changed")
    );
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!((job.status, job.cancelled_by), (JobStatus::Done, None));

    let out = cancel_cli(&url, 999_999, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stderr), "error: no job with id 999999");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.audit_log WHERE target = 'job 999999'"
        )
        .await,
        0
    );
}

/// An embedded worker with `listen` as given and a 3 s lease, whose
/// handler ignores cancellation; counts into `metrics`.
fn stubborn_worker(
    pool: &PgPool,
    listen: bool,
    metrics: Metrics,
    started: Arc<AtomicUsize>,
) -> Worker {
    let config = WorkerConfig {
        concurrency: 2,
        batch_size: 2,
        lease: Duration::from_secs(3),
        poll_interval: Duration::from_millis(50),
        shutdown_deadline: Duration::from_secs(2),
        listen,
        ..WorkerConfig::default()
    }
    .validated()
    .unwrap();
    Worker::new(pool.clone(), config)
        .with_metrics(metrics)
        .register("stubborn", move |_ctx: JobContext| {
            let started = started.clone();
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                std::future::pending::<()>().await;
                Ok(())
            }
        })
}

/// A Rust handler that never looks at its cancellation is dropped within
/// 2 s of the request; with `listen` off, the heartbeat finds the request
/// (within a third of the lease, then the same grace).
async fn a_stubborn_rust_handler_is_dropped_on_cancel(pool: PgPool, listen: bool) {
    let metrics = Metrics::new();
    let started = Arc::new(AtomicUsize::new(0));
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("stubborn"))
        .await
        .unwrap()
        .id();
    let stop = CancellationToken::new();
    let worker = tokio::spawn(
        stubborn_worker(&pool, listen, metrics.clone(), started.clone()).run(stop.clone()),
    );
    let seen = started.clone();
    eventually("the handler to start", Duration::from_secs(10), || {
        let seen = seen.clone();
        async move { seen.load(Ordering::SeqCst) == 1 }
    })
    .await;
    let asked = Instant::now();
    let actor = almanac::control::Actor::new("bob", almanac::control::Source::Api);
    almanac::control::jobs::cancel(&mut conn, &actor, id, Some("stuck"))
        .await
        .unwrap();
    // Listening: 1 s of grace. Heartbeat only: a renewal every second, then
    // the grace.
    let within = if listen {
        Duration::from_secs(2)
    } else {
        Duration::from_secs(3)
    };
    eventually("the job to be cancelled", within, || async {
        queue::get(&pool, id).await.unwrap().status == JobStatus::Cancelled
    })
    .await;
    eprintln!(
        "listen={listen}: the stubborn handler's job was cancelled {:?} after the request",
        asked.elapsed()
    );
    let job = queue::get(&pool, id).await.unwrap();
    let error = job.last_error.unwrap_or_default();
    assert!(
        error.starts_with(
            // The grace is 1 s, or the lease margin (600 ms of 3 s) if shorter.
            "cancelled by bob (api) (stuck); the handler did not stop within 600ms and was dropped"
        ),
        "{error}"
    );
    stop.cancel();
    let report = worker.await.unwrap().unwrap();
    assert_eq!(
        (report.cancelled, report.retried, report.dead, report.lost),
        (1, 0, 0, 0)
    );
    let cancelled = metrics
        .cancelled
        .get_or_create(&almanac::metrics::KindLabel {
            kind: "stubborn".into(),
        })
        .get();
    assert_eq!(cancelled, 1);
    assert_eq!(started.load(Ordering::SeqCst), 1);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_stubborn_rust_handler_is_dropped_within_2s_of_a_cancel(pool: PgPool) {
    a_stubborn_rust_handler_is_dropped_on_cancel(pool, true).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn without_listen_the_heartbeat_finds_the_cancel_request(pool: PgPool) {
    a_stubborn_rust_handler_is_dropped_on_cancel(pool, false).await;
}
