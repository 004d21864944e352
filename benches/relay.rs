//! Relay throughput next to its two ceilings, in the same run (not a timed
//! test): a raw client sending the same messages to the same broker with
//! many in flight (pipelined), and the relay's own outbox statements with no
//! broker. Also a raw client awaiting each batch-sized chunk before the next
//! (the relay's own pattern), and with `ALMANAC_BENCH_SWEEPS=1` the re-drive
//! and reconcile sweeps at 100,000 and 1,000,000 ready jobs.
//!
//! `cargo bench --bench relay` with tansu on 127.0.0.1:9092 and RabbitMQ on
//! 127.0.0.1:5672 (`scripts/services.sh` starts both). Uses a scratch database.

use std::time::{Duration, Instant};

use almanac::queue::{self, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{outbox, Publisher, Relay, RelayConfig, SinkConfig, SinkKind};
use almanac::role::Settings;
use futures::StreamExt;
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

/// The relay's `n`th Kafka message of the turn: its key and its headers.
fn kafka_message(n: usize) -> (String, OwnedHeaders) {
    let mut headers = OwnedHeaders::new_with_capacity(4);
    for (key, value) in relay_headers("bench_kafka", n) {
        headers = headers.insert(Header {
            key,
            value: Some(value.as_str()),
        });
    }
    (format!("kafka:{n}"), headers)
}

/// The relay's `n`th RabbitMQ message of the turn: its properties and its
/// headers.
fn rabbit_properties(n: usize) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (key, value) in relay_headers("bench_rabbitmq", n) {
        headers.insert(key.into(), AMQPValue::LongString(value.as_str().into()));
    }
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(format!("rabbitmq:{n}").as_str().into())
        .with_headers(headers)
}

/// How a raw client waits for its acknowledgements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Raw {
    /// Chunks of the relay's batch, each awaited before the next is sent
    /// (the relay's own pattern).
    Awaited,
    /// Every message sent without waiting, at most [`KAFKA_IN_FLIGHT`] or
    /// [`RABBIT_IN_FLIGHT`] unacknowledged at a time, then all awaited (the
    /// broker client's ceiling).
    Pipelined,
}

/// Delivery futures the pipelined Kafka producer keeps at most (librdkafka
/// queues up to 200,000 messages in almanac's producer).
const KAFKA_IN_FLIGHT: usize = 10_000;

/// Unconfirmed publications the pipelined RabbitMQ publisher keeps at most.
const RABBIT_IN_FLIGHT: usize = 2_000;

/// The raw Kafka producer's time and CPU for `MESSAGES` (after a warm-up).
async fn raw_kafka(
    sinks: &SinkConfig,
    topic: &str,
    body: &[u8],
    how: Raw,
) -> (Duration, Option<f64>) {
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
    let awaited = async {
        for chunk in 0..MESSAGES / batch() {
            let sends = (0..batch()).map(|i| {
                let (key, headers) = kafka_message(chunk * batch() + i);
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
    };
    let pipelined = async {
        let mut in_flight = futures::stream::FuturesUnordered::new();
        for n in 0..MESSAGES {
            let (key, headers) = kafka_message(n);
            let mut record = FutureRecord::to(topic)
                .key(&key)
                .payload(body)
                .headers(headers);
            loop {
                if in_flight.len() >= KAFKA_IN_FLIGHT {
                    delivered(in_flight.next().await);
                }
                match producer.send_result(record) {
                    Ok(delivery) => break in_flight.push(delivery),
                    // librdkafka's queue is full: wait for a delivery.
                    Err((
                        rdkafka::error::KafkaError::MessageProduction(
                            rdkafka::types::RDKafkaErrorCode::QueueFull,
                        ),
                        back,
                    )) if !in_flight.is_empty() => {
                        record = back;
                        delivered(in_flight.next().await);
                    }
                    Err((e, _)) => panic!("producing failed: {e}"),
                }
            }
        }
        while let Some(delivery) = in_flight.next().await {
            delivered(Some(delivery));
        }
    };
    match how {
        Raw::Awaited => timed(awaited).await,
        Raw::Pipelined => timed(pipelined).await,
    }
}

/// Panics unless a pipelined Kafka delivery succeeded.
fn delivered(
    delivery: Option<
        Result<
            rdkafka::producer::future_producer::OwnedDeliveryResult,
            futures::channel::oneshot::Canceled,
        >,
    >,
) {
    match delivery {
        Some(Ok(Ok(_))) => {}
        Some(Ok(Err((e, _)))) => panic!("a delivery failed: {e}"),
        Some(Err(_)) => panic!("a delivery was cancelled"),
        None => panic!("no delivery in flight"),
    }
}

/// The raw RabbitMQ publisher's time and CPU for `MESSAGES` (after connecting).
async fn raw_rabbit(
    sinks: &SinkConfig,
    queue: &str,
    body: &[u8],
    how: Raw,
) -> (Duration, Option<f64>) {
    let (conn, channel) =
        almanac::broker::rabbitmq::connect(sinks.amqp_url.as_deref().unwrap(), sinks.ack_timeout)
            .await
            .unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let options = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    let publish =
        |n: usize| channel.basic_publish(queue, queue, options, body, rabbit_properties(n));
    let confirmed = |confirm: lapin::Result<lapin::publisher_confirm::Confirmation>| {
        let confirmation = confirm.unwrap();
        assert!(
            confirmation.is_ack(),
            "the broker did not take a message: {confirmation:?}"
        );
    };
    let sent = match how {
        Raw::Awaited => {
            timed(async {
                for chunk in 0..MESSAGES / batch() {
                    let mut confirms = Vec::new();
                    for i in 0..batch() {
                        confirms.push(publish(chunk * batch() + i).await.unwrap());
                    }
                    for c in confirms {
                        confirmed(c.await);
                    }
                }
            })
            .await
        }
        Raw::Pipelined => {
            timed(async {
                let mut in_flight = std::collections::VecDeque::new();
                for n in 0..MESSAGES {
                    if in_flight.len() >= RABBIT_IN_FLIGHT {
                        confirmed(in_flight.pop_front().unwrap().await);
                    }
                    in_flight.push_back(publish(n).await.unwrap());
                }
                for c in in_flight {
                    confirmed(c.await);
                }
            })
            .await
        }
    };
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

#[path = "relay/sweeps.rs"]
mod sweeps;

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

/// One turn's throughputs, in messages (or rows) a second.
struct Turn {
    relay: f64,
    /// The raw client in chunks of the relay's batch, each awaited.
    awaited: f64,
    /// The raw client with many chunks' worth in flight.
    pipelined: f64,
    /// The relay's claim and mark with no broker.
    alone: f64,
}

impl Turn {
    /// The relay against the lower of its two ceilings: the broker client
    /// (pipelined) and the database (its statements alone).
    fn goal_ratio(&self) -> f64 {
        self.relay / self.pipelined.min(self.alone)
    }
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
    // ALMANAC_BENCH_SINKS=kafka,rabbitmq (the default) picks the sinks
    // (`none`: only the sweeps);
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
        let mut turns = Vec::new();
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
            let raw = |how| {
                let (sinks, destination, body) = (&sinks, &destination, &body);
                async move {
                    match sink {
                        SinkKind::Kafka => raw_kafka(sinks, destination, body, how).await,
                        SinkKind::Rabbitmq => raw_rabbit(sinks, destination, body, how).await,
                    }
                }
            };
            let (awaited, awaited_cpu) = raw(Raw::Awaited).await;
            let (pipelined, pipelined_cpu) = raw(Raw::Pipelined).await;
            enqueue(&pool, &kind, &format!("{sink}-alone-{round}"), MESSAGES).await?;
            let cpu = Cpu::now(&pool).await;
            let alone = outbox_alone(&pool, sink).await?;
            let (alone_db, alone_own) = Cpu::now(&pool).await.per_message(&cpu, MESSAGES);
            let turn = Turn {
                relay: rate(MESSAGES, relayed),
                awaited: rate(MESSAGES, awaited),
                pipelined: rate(MESSAGES, pipelined),
                alone: rate(MESSAGES, alone),
            };
            let per_message = |cpu: Option<f64>| cpu.map(|seconds| seconds * 1e6 / MESSAGES as f64);
            println!(
                "{sink:<9} turn {round}: relay {:>7.0} msg/s ({:.2}s)   raw awaited per chunk {:>7.0}   raw pipelined {:>7.0}   outbox statements alone {:>7.0} rows/s",
                turn.relay,
                relayed.as_secs_f64(),
                turn.awaited,
                turn.pipelined,
                turn.alone,
            );
            println!(
                "{sink:<9} turn {round}: relay / min(pipelined, statements) {:.2}   relay / awaited {:.2}   CPU µs/msg: relay {} + database {}, raw awaited {}, raw pipelined {}, statements alone {} + database {}",
                turn.goal_ratio(),
                turn.relay / turn.awaited,
                micros(relay_own),
                micros(relay_db),
                micros(per_message(awaited_cpu)),
                micros(per_message(pipelined_cpu)),
                micros(alone_own),
                micros(alone_db),
            );
            turns.push(turn);
        }
        let of = |f: fn(&Turn) -> f64| turns.iter().map(f).collect::<Vec<_>>();
        let spread = |values: Vec<f64>| {
            let low = values.iter().copied().fold(f64::INFINITY, f64::min);
            let high = values.iter().copied().fold(0.0, f64::max);
            (median(values), low, high)
        };
        let (goal, goal_low, goal_high) = spread(of(Turn::goal_ratio));
        let (awaited, awaited_low, awaited_high) = spread(of(|t| t.relay / t.awaited));
        println!(
            "{sink:<9} medians of {rounds} turns: relay {:.0} msg/s, raw awaited {:.0}, raw pipelined {:.0}, outbox statements alone {:.0} rows/s",
            median(of(|t| t.relay)),
            median(of(|t| t.awaited)),
            median(of(|t| t.pipelined)),
            median(of(|t| t.alone)),
        );
        println!(
            "{sink:<9} relay / min(pipelined, statements) median {goal:.2} (lowest {goal_low:.2}, highest {goal_high:.2}; goal 0.8)   relay / awaited median {awaited:.2} (lowest {awaited_low:.2}, highest {awaited_high:.2})",
        );
        remove_destination(&sinks, sink, &destination).await;
    }
    scratch.drop().await?;
    // ALMANAC_BENCH_SWEEPS=1: the re-drive and reconcile sweeps over
    // 100,000 and 1,000,000 ready jobs (minutes).
    if std::env::var("ALMANAC_BENCH_SWEEPS").is_ok_and(|v| v == "1") {
        sweeps::run().await?;
    }
    Ok(())
}
