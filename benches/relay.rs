//! Relay throughput next to a raw client sending the same messages to the
//! same broker in the same run (not a timed test).
//!
//! `cargo bench --bench relay` with tansu on 127.0.0.1:9092 and RabbitMQ on
//! 127.0.0.1:5672 (`scripts/services.sh` starts both). Uses a scratch database.

use std::time::{Duration, Instant};

use almanac::queue::{self, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{outbox, Publisher, Relay, RelayConfig, SinkConfig, SinkKind};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::util::Timeout;

const MESSAGES: usize = 100_000;

/// The allocator the `almanac` binary uses (see `src/main.rs`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
const BATCH: usize = 500;

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// The headers the relay sends with the `n`th message of `kind` (what
/// `almanac.write_outbox` builds), so the raw clients send the same messages.
fn relay_headers(kind: &'static str, n: usize) -> [(&'static str, String); 4] {
    [
        ("almanac-attempt", "1".to_string()),
        ("almanac-job-id", (n + 1).to_string()),
        ("almanac-kind", kind.to_string()),
        ("almanac-logical-run", String::new()),
    ]
}

async fn raw_kafka(sinks: &SinkConfig, topic: &str, body: &[u8]) -> Duration {
    let producer = almanac::broker::kafka::producer(
        sinks.kafka_brokers.as_deref().unwrap(),
        sinks.ack_timeout,
        sinks.max_message_bytes,
    )
    .unwrap();
    // Warm up: connect and learn the topic's leaders before timing.
    producer
        .send(
            FutureRecord::to(topic).key("warm-up").payload(body),
            Timeout::After(Duration::from_secs(10)),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let start = Instant::now();
    for chunk in 0..MESSAGES / BATCH {
        let sends = (0..BATCH).map(|i| {
            let n = chunk * BATCH + i;
            // The relay's message: its key, its payload and its headers.
            let key = format!("kafka:{n}");
            let mut headers = OwnedHeaders::new_with_capacity(4);
            for (key, value) in relay_headers("bench_kafka", n) {
                headers = headers.insert(Header {
                    key,
                    value: Some(value.as_str()),
                });
            }
            let producer = &producer;
            async move {
                producer
                    .send(
                        FutureRecord::to(topic)
                            .key(&key)
                            .payload(body)
                            .headers(headers),
                        Timeout::After(Duration::from_secs(10)),
                    )
                    .await
                    .map(|_| ())
                    .map_err(|(e, _)| e)
            }
        });
        for r in futures::future::join_all(sends).await {
            r.unwrap();
        }
    }
    start.elapsed()
}

async fn raw_rabbit(sinks: &SinkConfig, queue: &str, body: &[u8]) -> Duration {
    let (conn, channel) =
        almanac::broker::rabbitmq::connect(sinks.amqp_url.as_deref().unwrap(), sinks.ack_timeout)
            .await
            .unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let start = Instant::now();
    for chunk in 0..MESSAGES / BATCH {
        let mut confirms = Vec::new();
        for i in 0..BATCH {
            // The relay's message: its properties and its headers.
            let n = chunk * BATCH + i;
            let mut headers = FieldTable::default();
            for (key, value) in relay_headers("bench_rabbitmq", n) {
                headers.insert(key.into(), AMQPValue::LongString(value.as_str().into()));
            }
            let props = BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into())
                .with_message_id(format!("rabbitmq:{n}").as_str().into())
                .with_headers(headers);
            let options = BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            };
            confirms.push(
                channel
                    .basic_publish(queue, queue, options, body, props)
                    .await
                    .unwrap(),
            );
        }
        for c in confirms {
            c.await.unwrap();
        }
    }
    let elapsed = start.elapsed();
    let _ = conn.close(200, "done").await;
    elapsed
}

/// The relay's own statements with no broker: claim a batch (after the
/// previous one, as the relay does), mark the previous one published (on
/// another connection, as the relay does), until
/// `MESSAGES` rows are through. The ceiling the database puts on the relay.
async fn outbox_alone(pool: &sqlx::PgPool, sink: SinkKind) -> anyhow::Result<Duration> {
    let lease = RelayConfig::default().in_flight_lease;
    let start = Instant::now();
    let mut done = 0;
    let mut marking: Option<tokio::task::JoinHandle<Result<u64, sqlx::Error>>> = None;
    let mut after = None;
    while done < MESSAGES {
        let claimed = outbox::claim_after(pool, sink, BATCH as i64, lease, after).await?;
        after = claimed.last;
        anyhow::ensure!(!claimed.rows.is_empty(), "the outbox ran dry at {done}");
        done += claimed.rows.len();
        if let Some(previous) = marking.take() {
            previous.await??;
        }
        let pool = pool.clone();
        marking = Some(tokio::spawn(async move {
            let outcomes = outbox::Outcomes::all_published(&claimed.rows);
            let marked = outbox::mark(&pool, claimed.token, &outcomes).await?;
            Ok(marked.published)
        }));
    }
    if let Some(previous) = marking {
        previous.await??;
    }
    Ok(start.elapsed())
}

async fn enqueue(pool: &sqlx::PgPool, kind: &str, tag: &str, n: usize) -> anyhow::Result<()> {
    let jobs: Vec<NewJob> = (0..n)
        .map(|i| {
            NewJob::new(kind.to_string())
                .payload(serde_json::json!({"order": 12345, "note": "benchmark payload"}))
                .idempotency_key(format!("{tag}:{i}"))
        })
        .collect();
    for chunk in jobs.chunks(1000) {
        queue::enqueue_many(&mut *pool.acquire().await?, chunk).await?;
    }
    Ok(())
}

#[path = "common/mod.rs"]
mod common;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let scratch = common::Scratch::new("relay").await?;
    let pool = scratch.pool.clone();
    let sinks = SinkConfig {
        kafka_brokers: Some(
            std::env::var("ALMANAC_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into()),
        ),
        amqp_url: Some(
            std::env::var("ALMANAC_AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
        ),
        kafka_partitions: 3,
        ..SinkConfig::default()
    };
    let body =
        serde_json::to_vec(&serde_json::json!({"order": 12345, "note": "benchmark payload"}))?;
    // ALMANAC_BENCH_SINKS=kafka,rabbitmq (the default) picks the sinks.
    let wanted = std::env::var("ALMANAC_BENCH_SINKS").unwrap_or_else(|_| "kafka,rabbitmq".into());
    for sink in [SinkKind::Kafka, SinkKind::Rabbitmq] {
        if !wanted.split(',').any(|w| w.trim() == sink.as_str()) {
            continue;
        }
        let destination = format!("almanac-bench-{}-{}", sink, std::process::id());
        let kind = format!("bench_{sink}");
        let mut publisher = Publisher::new(sink, &sinks)?;
        publisher.ensure(&destination).await?;
        routes::set(
            &mut *pool.acquire().await?,
            &kind,
            RouteMode::Broker,
            Some(sink),
            Some(&destination),
        )
        .await?;
        let config = RelayConfig {
            batch_size: BATCH as i64,
            ..RelayConfig::default()
        };
        let mut relay = Relay::new(pool.clone(), publisher, config);
        // Warm up as the raw client does: connect, learn the destination,
        // prepare the statements.
        enqueue(&pool, &kind, &format!("{sink}-warm-up"), 1).await?;
        while relay.drain().await?.published == 0 {}
        enqueue(&pool, &kind, sink.as_str(), MESSAGES).await?;
        let start = Instant::now();
        let mut published = 0;
        while published < MESSAGES as u64 {
            let r = relay.drain().await?;
            assert_eq!(
                (r.retried, r.failed),
                (0, 0),
                "publishing failed during the benchmark"
            );
            published += r.published;
        }
        let relayed = start.elapsed();
        let raw = match sink {
            SinkKind::Kafka => raw_kafka(&sinks, &destination, &body).await,
            SinkKind::Rabbitmq => raw_rabbit(&sinks, &destination, &body).await,
        };
        enqueue(&pool, &kind, &format!("{sink}-alone"), MESSAGES).await?;
        let alone = outbox_alone(&pool, sink).await?;
        println!(
            "{sink:<9} relay {:>7.0} msg/s ({MESSAGES} in {:.2}s)   raw client {:>7.0} msg/s   relay/raw {:.2}   outbox statements alone {:>7.0} rows/s",
            rate(MESSAGES, relayed),
            relayed.as_secs_f64(),
            rate(MESSAGES, raw),
            rate(MESSAGES, relayed) / rate(MESSAGES, raw),
            rate(MESSAGES, alone),
        );
    }
    scratch.drop().await?;
    Ok(())
}
