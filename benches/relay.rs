//! Relay throughput next to a raw client sending the same messages to the
//! same broker in the same run (not a timed test).
//!
//! `cargo bench --bench relay` with tansu on 127.0.0.1:9092 and RabbitMQ on
//! 127.0.0.1:5672 (`scripts/services.sh` starts both). Uses a scratch database.

use std::time::{Duration, Instant};

use almanac::queue::{self, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{outbox, Publisher, Relay, RelayConfig, SinkConfig, SinkKind};
use almanac::role::Settings;
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

/// The relay's batch (its default, or `ALMANAC_BENCH_BATCH`), and the raw
/// clients' chunk: both send this many messages, then await their
/// acknowledgements.
fn batch() -> usize {
    static BATCH: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BATCH.get_or_init(|| {
        let batch = env_number(
            "ALMANAC_BENCH_BATCH",
            RelayConfig::default().batch_size as usize,
        );
        assert!(
            MESSAGES % batch == 0,
            "ALMANAC_BENCH_BATCH must divide {MESSAGES}"
        );
        batch
    })
}

/// A positive number from the environment variable `name`, else `default`.
fn env_number(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(text) => match text.parse() {
            Ok(n) if n > 0 => n,
            _ => panic!("{name} must be a positive number, not {text:?}"),
        },
        Err(_) => default,
    }
}

/// Runs `send` (a raw client's timed part) and returns how long it took
/// and the CPU time this process spent meanwhile.
async fn timed<F: std::future::Future<Output = ()>>(send: F) -> (Duration, Option<f64>) {
    let cpu = cpu_seconds("self");
    let start = Instant::now();
    send.await;
    let elapsed = start.elapsed();
    (
        elapsed,
        cpu_seconds("self").zip(cpu).map(|(now, then)| now - then),
    )
}

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

/// The raw Kafka producer's time and CPU for `MESSAGES` (after a warm-up).
async fn raw_kafka(sinks: &SinkConfig, topic: &str, body: &[u8]) -> (Duration, Option<f64>) {
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
    timed(async {
        for chunk in 0..MESSAGES / batch() {
            let sends = (0..batch()).map(|i| {
                let n = chunk * batch() + i;
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
    })
    .await
}

/// The raw RabbitMQ publisher's time and CPU for `MESSAGES` (after connecting).
async fn raw_rabbit(sinks: &SinkConfig, queue: &str, body: &[u8]) -> (Duration, Option<f64>) {
    let (conn, channel) =
        almanac::broker::rabbitmq::connect(sinks.amqp_url.as_deref().unwrap(), sinks.ack_timeout)
            .await
            .unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let sent = timed(async {
        for chunk in 0..MESSAGES / batch() {
            let mut confirms = Vec::new();
            for i in 0..batch() {
                // The relay's message: its properties and its headers.
                let n = chunk * batch() + i;
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
    })
    .await;
    let _ = conn.close(200, "done").await;
    sent
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
        let limits = outbox::ClaimLimits {
            rows: batch() as i64,
            bytes: RelayConfig::default().batch_bytes,
            max_message_bytes: SinkConfig::default().max_message_bytes as i64,
        };
        let claimed = outbox::claim_after(pool, sink, limits, lease, after).await?;
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

/// Deletes the benchmark's topic or queue and exchange (each run leaves
/// 200,000 or more messages behind otherwise).
async fn remove_destination(sinks: &SinkConfig, sink: SinkKind, destination: &str) {
    let outcome = match sink {
        SinkKind::Kafka => {
            let admin = almanac::broker::kafka::admin(sinks.kafka_brokers.as_deref().unwrap())
                .expect("an admin client");
            let options = rdkafka::admin::AdminOptions::new()
                .operation_timeout(Some(rdkafka::util::Timeout::After(Duration::from_secs(10))));
            match admin.delete_topics(&[destination], &options).await {
                Ok(results) => results
                    .into_iter()
                    .try_for_each(|r| r.map(|_| ()).map_err(|(_, code)| code.to_string())),
                Err(e) => Err(e.to_string()),
            }
        }
        SinkKind::Rabbitmq => {
            async {
                let (conn, channel) = almanac::broker::rabbitmq::connect(
                    sinks.amqp_url.as_deref().unwrap(),
                    sinks.ack_timeout,
                )
                .await
                .map_err(|e| e.to_string())?;
                channel
                    .queue_delete(destination, Default::default())
                    .await
                    .map_err(|e| e.to_string())?;
                channel
                    .exchange_delete(destination, Default::default())
                    .await
                    .map_err(|e| e.to_string())?;
                let _ = conn.close(200, "done").await;
                Ok(())
            }
            .await
        }
    };
    if let Err(e) = outcome {
        eprintln!("could not delete {sink} destination {destination}: {e}");
    }
}

/// CPU time (user and system) a process has used so far, from
/// `/proc/PID/stat`; `None` where that cannot be read (not Linux, or the
/// database on another host).
fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): state is the
    // first, utime the 12th, stime the 13th.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64)
}

/// CPU time used so far by this process and by the database's backends
/// serving the scratch database, by backend.
struct Cpu {
    bench: Option<f64>,
    backends: std::collections::HashMap<i32, f64>,
}

impl Cpu {
    async fn now(pool: &sqlx::PgPool) -> Cpu {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()",
        )
        .fetch_all(pool)
        .await
        .unwrap_or_default();
        Cpu {
            bench: cpu_seconds("self"),
            backends: pids
                .into_iter()
                .filter_map(|pid| Some((pid, cpu_seconds(&pid.to_string())?)))
                .collect(),
        }
    }

    /// Microseconds of CPU per message since `before`: (database, this
    /// process); a backend that started since counts from zero.
    fn per_message(&self, before: &Cpu, messages: usize) -> (Option<f64>, Option<f64>) {
        let per = |seconds: f64| seconds * 1e6 / messages as f64;
        let database: f64 = self
            .backends
            .iter()
            .map(|(pid, now)| now - before.backends.get(pid).unwrap_or(&0.0))
            .sum();
        let database = (!self.backends.is_empty()).then(|| per(database));
        let bench = self
            .bench
            .zip(before.bench)
            .map(|(now, then)| per(now - then));
        (database, bench)
    }
}

fn micros(value: Option<f64>) -> String {
    value.map_or("?".into(), |v| format!("{v:.1}"))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

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
    // ALMANAC_BENCH_SINKS=kafka,rabbitmq (the default) picks the sinks;
    // ALMANAC_BENCH_ROUNDS (default 3) how often relay and raw client take
    // turns.
    let wanted = std::env::var("ALMANAC_BENCH_SINKS").unwrap_or_else(|_| "kafka,rabbitmq".into());
    let rounds = env_number("ALMANAC_BENCH_ROUNDS", 3);
    println!(
        "{MESSAGES} messages a turn, relay batches and raw client chunks of {}",
        batch()
    );
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
            batch_size: batch() as i64,
            ..RelayConfig::default()
        };
        let mut relay = Relay::new(pool.clone(), publisher, config.validated()?);
        // Warm up as the raw client does: connect, learn the destination,
        // prepare the statements.
        enqueue(&pool, &kind, &format!("{sink}-warm-up"), 1).await?;
        while relay.drain().await?.published == 0 {}
        // Relay and raw client take turns, so a broker or machine that
        // slows down over the run weighs on both.
        let mut ratios = Vec::new();
        for round in 1..=rounds {
            enqueue(&pool, &kind, &format!("{sink}-{round}"), MESSAGES).await?;
            let cpu = Cpu::now(&pool).await;
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
            let (relay_db, relay_own) = Cpu::now(&pool).await.per_message(&cpu, MESSAGES);
            let (raw, raw_cpu) = match sink {
                SinkKind::Kafka => raw_kafka(&sinks, &destination, &body).await,
                SinkKind::Rabbitmq => raw_rabbit(&sinks, &destination, &body).await,
            };
            let raw_own = raw_cpu.map(|seconds| seconds * 1e6 / MESSAGES as f64);
            let ratio = rate(MESSAGES, relayed) / rate(MESSAGES, raw);
            ratios.push(ratio);
            println!(
                "{sink:<9} turn {round}: relay {:>7.0} msg/s ({:.2}s)   raw client {:>7.0} msg/s   relay/raw {ratio:.2}   CPU µs/msg: relay {} + database {}, raw client {}",
                rate(MESSAGES, relayed),
                relayed.as_secs_f64(),
                rate(MESSAGES, raw),
                micros(relay_own),
                micros(relay_db),
                micros(raw_own),
            );
        }
        enqueue(&pool, &kind, &format!("{sink}-alone"), MESSAGES).await?;
        let alone = outbox_alone(&pool, sink).await?;
        let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let high = ratios.iter().copied().fold(0.0, f64::max);
        println!(
            "{sink:<9} relay/raw median {:.2} (lowest {low:.2}, highest {high:.2}, {rounds} turns)   outbox statements alone {:>7.0} rows/s",
            median(ratios),
            rate(MESSAGES, alone),
        );
        remove_destination(&sinks, sink, &destination).await;
    }
    scratch.drop().await?;
    Ok(())
}
