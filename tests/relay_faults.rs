//! The relay when brokers misbehave: the broker goes away mid-stream, a
//! RabbitMQ message is unroutable, a broker job's message is lost.

mod common;

use std::time::Duration;

use almanac::queue::{self, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{redrive, Publisher, Relay, SinkConfig, SinkKind};
use common::brokers::{self, unique, Tansu};
use common::count;
use common::proxy::Proxy;
use sqlx::PgPool;

async fn unpublished(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM almanac.outbox WHERE published_at IS NULL",
    )
    .await
}

async fn enqueue(pool: &PgPool, prefix: &str, n: usize) {
    let mut conn = pool.acquire().await.unwrap();
    let batch: Vec<NewJob> = (0..n)
        .map(|i| NewJob::new("task").idempotency_key(format!("{prefix}:{i}")))
        .collect();
    queue::enqueue_many(&mut conn, &batch).await.unwrap();
}

/// The generic body: publish, lose the broker, keep enqueueing, get it back.
/// `cut` and `restore` take the broker away and bring it back.
async fn broker_outage_loses_nothing<C, R>(
    pool: PgPool,
    sink: SinkKind,
    sinks: SinkConfig,
    mut cut: C,
    mut restore: R,
) where
    C: FnMut(),
    R: AsyncFnMut(),
{
    let destination = unique("outage");
    let mut publisher = Publisher::new(sink, &sinks).unwrap();
    publisher.ensure(&destination).await.unwrap();
    routes::set(
        &mut pool.acquire().await.unwrap(),
        "task",
        RouteMode::Broker,
        Some(sink),
        Some(&destination),
    )
    .await
    .unwrap();
    let mut relay = Relay::new(pool.clone(), publisher, brokers::relay_config());

    enqueue(&pool, "before", 10).await;
    assert_eq!(relay.run_once().await.unwrap().published, 10);

    cut();
    enqueue(&pool, "during", 10).await;
    let report = relay.run_once().await.unwrap();
    assert_eq!(
        (report.published, report.failed),
        (0, 10),
        "nothing is marked while the broker is away"
    );
    assert_eq!(unpublished(&pool).await, 10);
    let errors = count(&pool, "SELECT count(*) FROM almanac.outbox WHERE published_at IS NULL AND last_error IS NOT NULL AND attempts = 1").await;
    assert_eq!(errors, 10, "each failed row keeps its error");

    restore().await;
    let start = std::time::Instant::now();
    while unpublished(&pool).await > 0 {
        if start.elapsed() > Duration::from_secs(60) {
            let errors: Vec<Option<String>> = sqlx::query_scalar(
                "SELECT DISTINCT last_error FROM almanac.outbox WHERE published_at IS NULL",
            )
            .fetch_all(&pool)
            .await
            .unwrap();
            panic!("the relay did not recover within 60s: {errors:?}");
        }
        let _ = relay.run_once().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.outbox WHERE published_at IS NOT NULL"
        )
        .await,
        20
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rabbitmq_going_away_leaves_rows_unpublished_until_it_returns(pool: PgPool) {
    let target = "127.0.0.1:5672".parse().unwrap();
    let proxy = std::sync::Arc::new(tokio::sync::Mutex::new(Proxy::start(target).await));
    let port = proxy.lock().await.port;
    let sinks = SinkConfig {
        amqp_url: Some(format!("amqp://guest:guest@127.0.0.1:{port}/%2f")),
        ack_timeout: Duration::from_secs(2),
        ..brokers::sinks()
    };
    let (p1, p2) = (proxy.clone(), proxy.clone());
    broker_outage_loses_nothing(
        pool,
        SinkKind::Rabbitmq,
        sinks,
        move || p1.try_lock().unwrap().cut(),
        async move || p2.lock().await.restore().await,
    )
    .await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn kafka_going_away_leaves_rows_unpublished_until_it_returns(pool: PgPool) {
    let tansu = std::sync::Arc::new(tokio::sync::Mutex::new(Tansu::start().await));
    let brokers = tansu.lock().await.brokers();
    let sinks = SinkConfig {
        kafka_brokers: Some(brokers),
        ack_timeout: Duration::from_secs(2),
        ..brokers::sinks()
    };
    let (t1, t2) = (tansu.clone(), tansu.clone());
    // tansu keeps topics in memory: the restarted broker has none, and the
    // relay must create the topic again before publishing.
    broker_outage_loses_nothing(
        pool,
        SinkKind::Kafka,
        sinks,
        move || t1.try_lock().unwrap().down(),
        async move || t2.lock().await.up().await,
    )
    .await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rabbitmq_unroutable_messages_are_returned_and_not_marked(pool: PgPool) {
    let sinks = brokers::sinks();
    let destination = unique("unroutable");
    let mut publisher = Publisher::new(SinkKind::Rabbitmq, &sinks).unwrap();
    publisher.ensure(&destination).await.unwrap();
    routes::set(
        &mut pool.acquire().await.unwrap(),
        "task",
        RouteMode::Broker,
        Some(SinkKind::Rabbitmq),
        Some(&destination),
    )
    .await
    .unwrap();
    // Someone deletes the queue: the exchange routes the message nowhere.
    let conn = lapin::Connection::connect(&brokers::amqp_url(), Default::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_delete(&destination, Default::default())
        .await
        .unwrap();

    enqueue(&pool, "lost", 3).await;
    let mut relay = Relay::new(pool.clone(), publisher, brokers::relay_config());
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.published, report.failed), (0, 3));
    let errors: Vec<String> =
        sqlx::query_scalar("SELECT last_error FROM almanac.outbox WHERE published_at IS NULL")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(errors.len(), 3);
    assert!(
        errors[0].contains("returned the message as unroutable (312 NO_ROUTE)"),
        "{}",
        errors[0]
    );

    // The next batch declares the queue again and the rows go out.
    sqlx::query("UPDATE almanac.outbox SET available_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(relay.run_once().await.unwrap().published, 3);
    let _ = conn.close(200, "done").await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_broker_job_whose_message_was_lost_is_redriven(pool: PgPool) {
    let sink = SinkKind::Rabbitmq;
    let destination = unique("redrive");
    routes::set(
        &mut pool.acquire().await.unwrap(),
        "task",
        RouteMode::Broker,
        Some(sink),
        Some(&destination),
    )
    .await
    .unwrap();
    enqueue(&pool, "stranded", 2).await;
    // The messages went out, then were purged: the jobs sit ready, due, with no message.
    sqlx::query("UPDATE almanac.outbox SET published_at = now() - interval '10 minutes'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE almanac.jobs SET run_at = now() - interval '10 minutes'")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        redrive(&pool, sink, Duration::from_secs(3600))
            .await
            .unwrap(),
        0,
        "not stranded long enough yet"
    );
    assert_eq!(
        redrive(&pool, sink, Duration::from_secs(60)).await.unwrap(),
        2
    );
    assert_eq!(unpublished(&pool).await, 2);
    assert_eq!(
        redrive(&pool, sink, Duration::from_secs(60)).await.unwrap(),
        0,
        "a fresh row is pending: no second copy"
    );
}
