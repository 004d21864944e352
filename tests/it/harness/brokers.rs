//! Broker helpers: addresses (from the environment, with local defaults),
//! unique destinations, raw readers, a private tansu, RabbitMQ's memory
//! alarm and the lock that keeps it from other tests. The TCP proxy is
//! [`super::proxy`].

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use almanac::consumer::{Consumer, ConsumerConfig};
use almanac::relay::{SinkConfig, SinkKind};
use almanac::role::Settings;
use almanac::worker::WorkerConfig;
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::ClientConfig;
use sqlx::PgPool;

pub fn kafka_brokers() -> String {
    std::env::var("ALMANAC_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// The shared RabbitMQ's URL. Holds [`RABBITMQ`] shared for the rest of
/// the calling test: every test that uses RabbitMQ calls this (directly or
/// through [`sinks`]) before it touches the broker.
pub fn amqp_url() -> String {
    share_rabbitmq();
    std::env::var("ALMANAC_TEST_AMQP")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// RabbitMQ is one node for every test of the process, and some faults are
/// the node's (an alarm blocks every publisher on it): a test that raises
/// one holds this lock exclusively ([`rabbitmq_alone`]); every other test
/// that uses RabbitMQ holds it shared from its first [`amqp_url`] to its
/// end. The guard lives in a thread-local: libtest runs each test on a
/// thread of its own, and the thread's end (pass or panic) releases it.
static RABBITMQ: RwLock<()> = RwLock::new(());

enum Hold {
    Shared(#[allow(dead_code)] RwLockReadGuard<'static, ()>),
    Alone(#[allow(dead_code)] RwLockWriteGuard<'static, ()>),
}

thread_local! {
    static HELD: RefCell<Option<Hold>> = const { RefCell::new(None) };
}

fn share_rabbitmq() {
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        if held.is_none() {
            let guard = RABBITMQ.read().unwrap_or_else(|e| e.into_inner());
            *held = Some(Hold::Shared(guard));
        }
    });
}

/// Waits until no other test uses RabbitMQ, then keeps it for this test
/// (its thread) until the test ends. Blocks the thread: call it first.
pub fn rabbitmq_alone() {
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        if matches!(*held, Some(Hold::Alone(_))) {
            return;
        }
        // A thread that ran an earlier test may still hold it shared.
        *held = None;
        let guard = RABBITMQ.write().unwrap_or_else(|e| e.into_inner());
        *held = Some(Hold::Alone(guard));
    });
}

/// RabbitMQ's memory alarm, raised (`vm_memory_high_watermark` 0: the node
/// blocks every publisher) until dropped, which puts back the watermark
/// read before, even when the test panics. Take [`rabbitmq_alone`] first.
pub struct MemoryAlarm {
    restore: Vec<String>,
}

impl MemoryAlarm {
    pub fn raise() -> MemoryAlarm {
        let status = rabbitmqctl(&["status", "--formatter", "json"]);
        let status: serde_json::Value = serde_json::from_str(&status).unwrap();
        let setting = &status["vm_memory_high_watermark_setting"];
        let restore = if let Some(relative) = setting["relative"].as_f64() {
            vec![relative.to_string()]
        } else if let Some(absolute) = setting["absolute"].as_u64() {
            vec!["absolute".to_string(), absolute.to_string()]
        } else {
            panic!("unknown vm_memory_high_watermark_setting: {setting}");
        };
        assert!(
            status["alarms"].as_array().is_some_and(|a| a.is_empty()),
            "RabbitMQ already has an alarm: {}",
            status["alarms"]
        );
        let alarm = MemoryAlarm { restore };
        rabbitmqctl(&["set_vm_memory_high_watermark", "0"]);
        alarm
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        let mut args = vec!["set_vm_memory_high_watermark"];
        args.extend(self.restore.iter().map(String::as_str));
        let out = Command::new("rabbitmqctl").args(&args).output();
        if !matches!(&out, Ok(o) if o.status.success()) && !std::thread::panicking() {
            panic!("restoring RabbitMQ's memory watermark ({args:?}) failed: {out:?}");
        }
    }
}

fn rabbitmqctl(args: &[&str]) -> String {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl on PATH");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

pub fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("almanac-test-{name}-{}-{nanos}", std::process::id())
}

/// Routes `kind` to a fresh destination on `sink` (`unique(kind)`), made
/// to exist first; returns its name.
pub async fn route_to_fresh(
    pool: &sqlx::PgPool,
    kind: &str,
    mode: almanac::relay::routes::RouteMode,
    sink: SinkKind,
) -> String {
    let destination = unique(kind);
    let mut publisher = almanac::relay::Publisher::new(sink, &sinks()).unwrap();
    publisher.ensure(&destination).await.unwrap();
    publisher.flush().await;
    almanac::relay::routes::set(
        &mut pool.acquire().await.unwrap(),
        kind,
        mode,
        Some(sink),
        Some(&destination),
    )
    .await
    .unwrap();
    destination
}

pub fn sinks() -> SinkConfig {
    SinkConfig {
        kafka_brokers: Some(kafka_brokers()),
        amqp_url: Some(amqp_url()),
        kafka_partitions: 2,
        kafka_replication: 1,
        ack_timeout: Duration::from_secs(3),
        ..SinkConfig::default()
    }
}

/// A relay that polls and retries quickly, for tests.
pub fn relay_config() -> almanac::relay::RelayConfig {
    almanac::relay::RelayConfig {
        batch_size: 100,
        poll_interval: Duration::from_millis(50),
        retry: almanac::queue::Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_millis(300),
            jitter: 0.2,
        },
        in_flight_lease: Duration::from_secs(10),
        ..Default::default()
    }
}

/// A message as a broker client sees it.
#[derive(Debug, Clone)]
pub struct Received {
    /// Kafka key, or RabbitMQ message_id.
    pub key: String,
    pub headers: BTreeMap<String, String>,
    pub payload: serde_json::Value,
}

/// Reads `expect` messages (or what arrives before `within` passes).
pub async fn read(
    sink: SinkKind,
    destination: &str,
    expect: usize,
    within: Duration,
) -> Vec<Received> {
    let enough = |got: &[Received]| got.len() >= expect;
    match sink {
        SinkKind::Kafka => read_kafka(destination, within, enough).await,
        SinkKind::Rabbitmq => read_rabbit(destination, within, enough).await,
    }
}

/// The key (Kafka) or message id (RabbitMQ) of [`read_to_end`]'s markers.
const END: &str = "almanac-test-end";

/// Every message `destination` holds, read to its end, for a test that must
/// know nothing more is there (no duplicate, say) without waiting for nothing
/// to come. An end marker goes in behind what is there (one per partition for
/// Kafka), and the read stops when every marker is back: a queue and a
/// partition keep their order, so all that was published before the markers
/// has been read. Call it once the publishers have returned (what they
/// published is confirmed, so it is ahead of the markers). Panics if the
/// markers are not back within `within`.
pub async fn read_to_end(sink: SinkKind, destination: &str, within: Duration) -> Vec<Received> {
    let markers = match sink {
        SinkKind::Kafka => append_kafka_markers(destination).await,
        SinkKind::Rabbitmq => append_rabbit_marker(destination).await,
    };
    let ends = |got: &[Received]| got.iter().filter(|m| m.key == END).count();
    let all_back = |got: &[Received]| ends(got) >= markers;
    let got = match sink {
        SinkKind::Kafka => read_kafka(destination, within, all_back).await,
        SinkKind::Rabbitmq => read_rabbit(destination, within, all_back).await,
    };
    assert_eq!(
        ends(&got),
        markers,
        "the end of {destination} not reached within {within:?}"
    );
    got.into_iter().filter(|m| m.key != END).collect()
}

/// One end marker at the end of each partition of `topic`; how many.
async fn append_kafka_markers(topic: &str) -> usize {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers())
        .create()
        .unwrap();
    let metadata = producer
        .client()
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    let partitions: Vec<i32> = metadata.topics()[0]
        .partitions()
        .iter()
        .map(|p| p.id())
        .collect();
    assert!(!partitions.is_empty(), "topic {topic} has no partitions");
    for &partition in &partitions {
        producer
            .send(
                FutureRecord::to(topic)
                    .partition(partition)
                    .key(END)
                    .payload("{}"),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }
    partitions.len()
}

/// One end marker at the end of `queue`, confirmed by the broker.
async fn append_rabbit_marker(queue: &str) -> usize {
    let conn = lapin::Connection::connect(&amqp_url(), Default::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirmation = channel
        .basic_publish(
            "",
            queue,
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"{}",
            BasicProperties::default().with_message_id(END.into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(
        confirmation.is_ack() && confirmation.take_message().is_none(),
        "the end marker reached {queue}"
    );
    let _ = conn.close(200, "done").await;
    1
}

/// Reads until `done` says the messages so far are enough, or `within` passes.
async fn read_kafka(
    topic: &str,
    within: Duration,
    done: impl Fn(&[Received]) -> bool,
) -> Vec<Received> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers())
        .set("group.id", unique("reader"))
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let start = Instant::now();
    let mut out = Vec::new();
    while !done(&out) && start.elapsed() < within {
        let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(500), consumer.recv()).await
        else {
            continue;
        };
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        (
                            h.key.to_string(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.push(Received {
            key: String::from_utf8_lossy(m.key().unwrap_or_default()).to_string(),
            headers,
            payload: serde_json::from_slice(m.payload().unwrap_or_default()).unwrap(),
        });
    }
    out
}

async fn read_rabbit(
    queue: &str,
    within: Duration,
    done: impl Fn(&[Received]) -> bool,
) -> Vec<Received> {
    let conn = lapin::Connection::connect(&amqp_url(), Default::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let mut deliveries = channel
        .basic_consume(
            queue,
            &unique("reader"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let start = Instant::now();
    let mut out = Vec::new();
    while !done(&out) && start.elapsed() < within {
        let Ok(Some(Ok(d))) =
            tokio::time::timeout(Duration::from_millis(500), deliveries.next()).await
        else {
            continue;
        };
        let headers = d
            .properties
            .headers()
            .as_ref()
            .map(|t| {
                t.inner()
                    .iter()
                    .map(|(k, v)| {
                        let v = match v {
                            AMQPValue::LongString(s) => {
                                String::from_utf8_lossy(s.as_bytes()).to_string()
                            }
                            other => format!("{other:?}"),
                        };
                        (k.to_string(), v)
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.push(Received {
            key: d
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default(),
            headers,
            payload: serde_json::from_slice(&d.data).unwrap(),
        });
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = conn.close(200, "done").await;
    out
}

/// A tansu broker of the test's own, on a free port, that can be stopped
/// and started again (in memory: a restart forgets its topics).
pub struct Tansu {
    pub port: u16,
    child: Option<Child>,
}

impl Tansu {
    pub async fn start() -> Tansu {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut tansu = Tansu { port, child: None };
        tansu.up().await;
        tansu
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub async fn up(&mut self) {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let child = Command::new("tansu")
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("tansu on PATH (scripts/services.sh installs it)");
        self.child = Some(child);
        let port = self.port;
        super::eventually("tansu to listen", Duration::from_secs(30), || async move {
            TcpStream::connect(("127.0.0.1", port)).await.is_ok()
        })
        .await;
    }

    pub fn down(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.down();
    }
}

/// A consumer of `destination` on `sink` running `kinds`, each execution
/// logged in `exec_log` through `log` ([`super::logging_handler`]): 4 slots,
/// a 10 s lease.
pub fn consumer(
    pool: &PgPool,
    sink: SinkKind,
    destination: &str,
    kinds: &[&str],
    log: PgPool,
) -> Consumer {
    let config = ConsumerConfig {
        sink,
        destination: destination.to_string(),
        group: None,
        worker: WorkerConfig {
            concurrency: 4,
            batch_size: 4,
            lease: Duration::from_secs(10),
            poll_interval: Duration::from_millis(50),
            shutdown_deadline: Duration::from_secs(5),
            ..WorkerConfig::default()
        }
        .validated()
        .unwrap(),
    };
    kinds.iter().fold(
        Consumer::new(pool.clone(), sinks(), config),
        |consumer, kind| consumer.register(*kind, super::logging_handler(log.clone(), 1)),
    )
}
