//! Broker consumers under faults, one body per behaviour run against Kafka
//! and RabbitMQ: `almanac consume` stopped with SIGTERM mid-job, as a
//! process (a job that finishes within the shutdown deadline is done, one
//! that does not is released; neither waits for its lease, a minute here, to
//! expire); and a consumer whose database path freezes as its handlers
//! return.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use almanac::consumer::{Consumer, ConsumerConfig};
use almanac::queue::{self, JobStatus, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{Publisher, Relay, SinkKind};
use almanac::role::{Role, Settings};
use almanac::worker::{JobContext, WorkerConfig};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::brokers::{self, unique};
use crate::harness::{self, count, eventually};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(unique(name));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn consume(url: &str, sink: SinkKind, destination: &str, dir: &Path) -> Child {
    let dir = dir.display();
    let finishes = format!(
        "finishes=touch {dir}/started-finishes; while [ ! -f {dir}/go ]; do sleep 0.05; done"
    );
    let hangs = format!("hangs=touch {dir}/started-hangs; sleep 600");
    let mut args = vec![
        "consume".to_string(),
        "--sink".into(),
        sink.to_string(),
        "--destination".into(),
        destination.into(),
        "--handler".into(),
        finishes,
        "--handler".into(),
        hangs,
        "--lease".into(),
        "60s".into(),
        "--shutdown-deadline".into(),
        "2s".into(),
    ];
    match sink {
        SinkKind::Kafka => args.extend(["--kafka-brokers".into(), brokers::kafka_brokers()]),
        SinkKind::Rabbitmq => args.extend(["--amqp-url".into(), brokers::amqp_url()]),
    }
    harness::almanac()
        .args(&args)
        .env("DATABASE_URL", url)
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// Sends SIGTERM; returns the exit code and how long the exit took.
async fn terminate(mut child: Child, then: impl FnOnce()) -> (Option<i32>, Duration) {
    // SAFETY: signals a child process this test spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let sent = Instant::now();
    then();
    let mut code = None;
    eventually("the consumer to exit", Duration::from_secs(60), || {
        let exited = child.try_wait().unwrap();
        if let Some(status) = exited {
            code = Some(status.code());
        }
        async move { exited.is_some() }
    })
    .await;
    (code.flatten(), sent.elapsed())
}

async fn enqueue_and_publish(pool: &PgPool, kind: &str, sink: SinkKind) -> i64 {
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new(kind))
        .await
        .unwrap()
        .id();
    let publisher = Publisher::new(sink, &brokers::sinks()).unwrap();
    let mut relay = Relay::new(
        pool.clone(),
        publisher,
        brokers::relay_config().validated().unwrap(),
    );
    let report = relay.run_once().await.unwrap();
    assert_eq!(report.published, 1);
    id
}

async fn a_consumer_stopped_mid_job_finishes_or_releases_it(pool: PgPool, sink: SinkKind) {
    let url = harness::database_url(&pool);
    let destination = unique("sigterm");
    let mut publisher = Publisher::new(sink, &brokers::sinks()).unwrap();
    publisher.ensure(&destination).await.unwrap();
    publisher.flush().await;
    let mut conn = pool.acquire().await.unwrap();
    for kind in ["finishes", "hangs"] {
        routes::set(
            &mut conn,
            kind,
            RouteMode::Broker,
            Some(sink),
            Some(&destination),
        )
        .await
        .unwrap();
    }
    let dir = scratch("sigterm");
    let started = |kind: &str| dir.join(format!("started-{kind}"));

    // A job that ends within the deadline once told to: done, acked.
    let finishes = enqueue_and_publish(&pool, "finishes", sink).await;
    let consumer = consume(&url, sink, &destination, &dir);
    eventually("the job to start", Duration::from_secs(60), || async {
        started("finishes").exists()
    })
    .await;
    let (code, took) = terminate(consumer, || std::fs::write(dir.join("go"), "").unwrap()).await;
    assert_eq!(code, Some(0));
    let job = queue::get(&pool, finishes).await.unwrap();
    assert_eq!((job.status, job.attempts), (JobStatus::Done, 1));
    assert!(took < Duration::from_secs(30), "stopping took {took:?}");

    // A job that does not end: killed at the deadline and released at once.
    let hangs = enqueue_and_publish(&pool, "hangs", sink).await;
    let consumer = consume(&url, sink, &destination, &dir);
    eventually("the job to start", Duration::from_secs(60), || async {
        started("hangs").exists()
    })
    .await;
    let (code, took) = terminate(consumer, || {}).await;
    assert_eq!(code, Some(0));
    let job = queue::get(&pool, hangs).await.unwrap();
    assert_eq!(
        (job.status, job.attempts, job.lease_token),
        (JobStatus::Ready, 1, None),
        "released, not left to a lease expiry: {job:?}"
    );
    assert!(
        job.last_error
            .as_deref()
            .unwrap_or_default()
            .contains("released at shutdown"),
        "{:?}",
        job.last_error
    );
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(30),
        "the deadline is 2 s and the lease a minute; stopping took {took:?}"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn kafka_consumer_stopped_mid_job_finishes_or_releases_it(pool: PgPool) {
    a_consumer_stopped_mid_job_finishes_or_releases_it(pool, SinkKind::Kafka).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rabbitmq_consumer_stopped_mid_job_finishes_or_releases_it(pool: PgPool) {
    a_consumer_stopped_mid_job_finishes_or_releases_it(pool, SinkKind::Rabbitmq).await;
}

/// A job's status and attempts used.
async fn job_state(pool: &PgPool, id: i64) -> (String, i32) {
    sqlx::query_as("SELECT status, attempts FROM almanac.jobs WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// `jobs` of kind `task`, routed to a fresh destination on `sink` and
/// published there by one relay pass; the destination and the jobs' ids.
async fn routed_and_published(
    pool: &PgPool,
    sink: SinkKind,
    jobs: &[NewJob],
) -> (String, Vec<i64>) {
    let destination = brokers::route_to_fresh(pool, "task", RouteMode::Broker, sink).await;
    let enqueued = queue::enqueue_many(&mut pool.acquire().await.unwrap(), jobs)
        .await
        .unwrap();
    let mut relay = Relay::new(
        pool.clone(),
        Publisher::new(sink, &brokers::sinks()).unwrap(),
        brokers::relay_config().validated().unwrap(),
    );
    assert_eq!(relay.run_once().await.unwrap().published, jobs.len() as u64);
    (destination, enqueued.iter().map(|e| e.id()).collect())
}

/// A consumer whose database path freezes for two seconds just as its
/// handlers return: every outcome is recorded (retried with the same lease)
/// before the message is acked, and each job runs once.
async fn a_consumer_frozen_as_handlers_return_records_every_outcome(pool: PgPool, sink: SinkKind) {
    harness::create_exec_log(&pool).await;
    const JOBS: usize = 5;
    let jobs: Vec<NewJob> = (0..JOBS)
        .map(|i| NewJob::new("task").idempotency_key(format!("task:{i}")))
        .collect();
    let (destination, _) = routed_and_published(&pool, sink, &jobs).await;

    let proxy = harness::proxy::Proxy::postgres().await;
    let proxied = sqlx::postgres::PgPoolOptions::new()
        .max_connections(6)
        .connect(&proxy.postgres_url(&harness::database_url(&pool)))
        .await
        .unwrap();
    let log = harness::log_pool(&pool, 4).await;
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let handler_gate = gate.clone();
    let config = ConsumerConfig {
        sink,
        destination: destination.clone(),
        group: None,
        worker: WorkerConfig {
            concurrency: JOBS,
            // Renewals every 3 s; the local deadline leaves > 4 s after a freeze.
            lease: Duration::from_secs(9),
            shutdown_deadline: Duration::from_secs(5),
            ..WorkerConfig::default()
        }
        .validated()
        .unwrap(),
    };
    let consumer = Consumer::new(proxied, brokers::sinks(), config).register(
        "task",
        move |ctx: JobContext| {
            let (log, gate) = (log.clone(), handler_gate.clone());
            async move {
                harness::log_exec(&log, ctx.job.id, ctx.job.attempts, 0).await;
                gate.acquire().await.unwrap().forget();
                Ok(())
            }
        },
    );
    let stop = CancellationToken::new();
    let running = tokio::spawn(consumer.run(stop.clone()));
    eventually("a handler to start", Duration::from_secs(60), || async {
        count(&pool, "SELECT count(*) FROM exec_log").await >= 1
    })
    .await;
    proxy.freeze();
    gate.add_permits(JOBS);
    // The blip itself: two seconds without a byte through.
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.thaw();
    eventually("every job to be done", Duration::from_secs(60), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
        )
        .await
            == JOBS as i64
    })
    .await;
    stop.cancel();
    let report = running.await.unwrap().unwrap();
    assert_eq!(
        count(&pool, "SELECT count(*) FROM exec_log").await,
        JOBS as i64
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT job_id) FROM exec_log").await,
        JOBS as i64
    );
    assert_eq!(
        (report.jobs.completed, report.jobs.lost),
        (JOBS as u64, 0),
        "{report:?}"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn kafka_consumer_frozen_as_handlers_return_records_every_outcome(pool: PgPool) {
    a_consumer_frozen_as_handlers_return_records_every_outcome(pool, SinkKind::Kafka).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rabbitmq_consumer_frozen_as_handlers_return_records_every_outcome(pool: PgPool) {
    a_consumer_frozen_as_handlers_return_records_every_outcome(pool, SinkKind::Rabbitmq).await;
}

/// A consumer's claim that waits on a row lock ends on the server at
/// `lease / 4` (issue #20 item 8): it never commits a lease after the
/// consumer gave up on it, so a `max_attempts = 1` job whose row someone
/// holds (an operator's transaction, a long statement) keeps its attempt
/// and runs, once, when the lock goes, instead of going dead unrun.
async fn a_claim_behind_a_row_lock_ends_on_the_server(pool: PgPool, sink: SinkKind) {
    harness::create_exec_log(&pool).await;
    let (destination, ids) =
        routed_and_published(&pool, sink, &[NewJob::new("task").max_attempts(1)]).await;
    let id = ids[0];

    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM almanac.jobs WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(&mut *holder)
        .await
        .unwrap();
    // A 10 s lease: claims end on the server after 2.5 s, the consumer
    // gives up on one after 3.3 s.
    let log = harness::log_pool(&pool, 2).await;
    let consumer = brokers::consumer(&pool, sink, &destination, &["task"], log);
    let stop = CancellationToken::new();
    let running = tokio::spawn(consumer.run(stop.clone()));
    let waiting = || async {
        sqlx::query_scalar::<_, Option<chrono::DateTime<chrono::Utc>>>(
            "SELECT max(query_start) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = loop {
        if let Some(at) = waiting().await {
            break at;
        }
        assert!(Instant::now() < deadline, "no claim waited on the lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // A later claim waiting means the first one is over: it ended on the
    // server (its lock timeout) and the message was tried again.
    eventually(
        "the claim to be tried again",
        Duration::from_secs(30),
        || async { waiting().await.is_some_and(|at| at > first) },
    )
    .await;
    let (status, attempts) = job_state(&pool, id).await;
    assert_eq!(
        (status.as_str(), attempts),
        ("ready", 0),
        "a claim committed behind the lock"
    );
    holder.rollback().await.unwrap();
    eventually("the job to run", Duration::from_secs(60), || async {
        let (status, attempts) = job_state(&pool, id).await;
        match status.as_str() {
            "done" | "dead" => Ok(()),
            _ => Err(format!("{status}, attempts {attempts} (a claim behind the lock committed a lease nobody holds?)")),
        }
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    let (status, attempts) = job_state(&pool, id).await;
    assert_eq!((status.as_str(), attempts), ("done", 1));
    assert_eq!(count(&pool, "SELECT count(*) FROM exec_log").await, 1);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn kafka_claim_behind_a_row_lock_ends_on_the_server(pool: PgPool) {
    a_claim_behind_a_row_lock_ends_on_the_server(pool, SinkKind::Kafka).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rabbitmq_claim_behind_a_row_lock_ends_on_the_server(pool: PgPool) {
    a_claim_behind_a_row_lock_ends_on_the_server(pool, SinkKind::Rabbitmq).await;
}
