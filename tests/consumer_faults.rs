//! `almanac consume` stopped with SIGTERM mid-job, as a process: a job that
//! finishes within the shutdown deadline is done, one that does not is
//! released; neither waits for its lease (a minute here) to expire. One body,
//! run against Kafka and RabbitMQ.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use almanac::queue::{self, JobStatus, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{Publisher, Relay, SinkKind};
use common::brokers::{self, unique};
use common::eventually;
use sqlx::PgPool;

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
    Command::new(env!("CARGO_BIN_EXE_almanac"))
        .args(&args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .env_remove("ALMANAC_CONFIG")
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
    let mut relay = Relay::new(pool.clone(), publisher, brokers::relay_config());
    let report = relay.run_once().await.unwrap();
    assert_eq!(report.published, 1);
    id
}

async fn a_consumer_stopped_mid_job_finishes_or_releases_it(pool: PgPool, sink: SinkKind) {
    let url = common::database_url(&pool);
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
