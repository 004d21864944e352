//! Kafka: an idempotent producer with `acks=all` (see
//! [`crate::broker::kafka::producer_with`]); the message key is the job's
//! idempotency key and headers carry job id, kind, attempt and logical run.
//! A batch is handed to the producer at once (its `linger.ms` groups it into
//! produce requests) and its delivery reports are awaited together, while
//! the relay hands over the next batch: librdkafka's polling thread writes
//! each report into the batch's [`Deliveries`], and the relay is woken once,
//! when the last is in (not once per message). A row counts as published
//! only when its delivery report succeeds; a failed or timed-out delivery,
//! or a report that never came, is "maybe sent" (a second copy is harmless:
//! consumers claim through the fence). After failed deliveries the producer
//! is recreated: a broker that came back may not know this idempotent
//! producer's id and sequence numbers.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::admin::AdminClient;
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::util::Timeout;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::warn;

use super::publisher::Deadline;
use super::OutboxRow;
use crate::broker::kafka::{admin, classify, ensure_topic, producer_with};
use crate::broker::{PublishError, SinkConfig, SinkError};
use crate::retry::Retry;

type RelayProducer = ThreadedProducer<Reports>;

pub struct KafkaPublisher {
    brokers: String,
    producer: Arc<RelayProducer>,
    admin: AdminClient<DefaultClientContext>,
    partitions: i32,
    replication: i32,
    ack_timeout: Duration,
    max_message_bytes: usize,
    ensured: HashSet<String>,
    retired: Option<Arc<RelayProducer>>,
}

/// How long past `ack_timeout` a batch waits for delivery reports that
/// librdkafka owes (it reports every message within `message.timeout.ms`)
/// before it calls the missing ones "maybe sent".
const REPORT_GRACE: Duration = Duration::from_secs(5);

/// A batch's delivery reports, one slot per message, written by the
/// producer's polling thread.
pub struct Deliveries {
    results: Mutex<Vec<Option<Result<(), KafkaError>>>>,
    left: AtomicUsize,
    done: Notify,
}

impl Deliveries {
    fn new(messages: usize) -> Arc<Self> {
        Arc::new(Deliveries {
            results: Mutex::new(vec![None; messages]),
            left: AtomicUsize::new(messages),
            done: Notify::new(),
        })
    }

    /// Records message `index`'s outcome; the first one recorded counts.
    fn set(&self, index: usize, result: Result<(), KafkaError>) {
        let mut results = self.results.lock().unwrap_or_else(|e| e.into_inner());
        if results[index].is_some() {
            return;
        }
        results[index] = Some(result);
        drop(results);
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_one();
        }
    }
}

/// A message's place in its batch, handed to librdkafka with the message
/// and back with its delivery report. Dropped without a report (a purged
/// producer, a send that failed), it records the message as canceled.
pub struct Slot {
    batch: Arc<Deliveries>,
    index: usize,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.batch.set(self.index, Err(KafkaError::Canceled));
    }
}

/// Receives the relay producer's delivery reports.
pub struct Reports;

impl ClientContext for Reports {}

impl ProducerContext for Reports {
    type DeliveryOpaque = Box<Slot>;

    fn delivery(&self, report: &DeliveryResult<'_>, slot: Box<Slot>) {
        let result = match report {
            Ok(_) => Ok(()),
            Err((error, _)) => Err(error.clone()),
        };
        slot.batch.set(slot.index, result);
    }
}

/// A sent batch whose delivery reports are still to come.
pub struct KafkaInFlight {
    batch: Arc<Deliveries>,
    deadline: Instant,
}

impl KafkaInFlight {
    /// Each message's outcome, in the order sent (`topics` names each
    /// message's topic, for the error), once all reports are in or the
    /// deadline passed (a missing report reads as canceled: maybe sent).
    pub async fn results<'a>(
        self,
        topics: impl Iterator<Item = &'a str>,
    ) -> Vec<Result<(), PublishError>> {
        if self.batch.left.load(Ordering::Acquire) > 0 {
            // `notify_one` keeps a permit when it fires first.
            let _ = tokio::time::timeout_at(self.deadline, self.batch.done.notified()).await;
        }
        let mut results = self.batch.results.lock().unwrap_or_else(|e| e.into_inner());
        // Every slot stays filled, so a report that comes later is ignored.
        results
            .iter_mut()
            .zip(topics)
            .map(|(r, topic)| {
                r.replace(Err(KafkaError::Canceled))
                    .unwrap_or(Err(KafkaError::Canceled))
                    .map_err(|e| classify(topic, e))
            })
            .collect()
    }
}

fn relay_producer(
    brokers: &str,
    config_ack: Duration,
    max: usize,
) -> Result<Arc<RelayProducer>, SinkError> {
    producer_with(brokers, config_ack, max, Reports).map(Arc::new)
}

impl KafkaPublisher {
    pub fn new(brokers: String, config: &SinkConfig) -> Result<Self, SinkError> {
        Ok(KafkaPublisher {
            producer: relay_producer(&brokers, config.ack_timeout, config.max_message_bytes)?,
            admin: admin(&brokers)?,
            brokers,
            partitions: config.kafka_partitions,
            replication: config.kafka_replication,
            ack_timeout: config.ack_timeout,
            max_message_bytes: config.max_message_bytes,
            ensured: HashSet::new(),
            retired: None,
        })
    }

    pub async fn ensure(&mut self, topic: &str, by: Deadline) -> Result<(), PublishError> {
        if self.ensured.contains(topic) {
            return Ok(());
        }
        let create = ensure_topic(
            &self.admin,
            topic,
            self.partitions,
            self.replication,
            self.ack_timeout,
        );
        tokio::time::timeout_at(by.wait(self.ack_timeout), create)
            .await
            .map_err(|_| {
                by.timed_out(
                    &format!("Kafka did not create topic `{topic}`"),
                    self.ack_timeout,
                    "not sent",
                )
            })??;
        self.ensured.insert(topic.to_string());
        Ok(())
    }

    /// Hands `rows` (whose destinations are prepared) to the producer
    /// without waiting for the broker. A full local queue waits for room
    /// (up to `ack_timeout` for the whole batch, or until `by`) instead of
    /// failing; reports still missing at `ack_timeout` and
    /// [`REPORT_GRACE`] from now, or at `by`, read as "maybe sent".
    pub async fn send(&mut self, rows: &[&OutboxRow], by: Deadline) -> KafkaInFlight {
        let batch = Deliveries::new(rows.len());
        let room_by = by.wait(self.ack_timeout);
        // Paces the waits for room in a full producer queue.
        let mut room = Retry::new(Duration::from_millis(1), Duration::from_millis(20));
        for (index, row) in rows.iter().enumerate() {
            let mut headers = OwnedHeaders::new_with_capacity(row.header_names.len());
            for (key, value) in row.header_names.iter().zip(&row.header_values) {
                headers = headers.insert(Header {
                    key,
                    value: Some(value.as_str()),
                });
            }
            let slot = Box::new(Slot {
                batch: batch.clone(),
                index,
            });
            let mut record = BaseRecord::with_opaque_to(&row.destination, slot)
                .key(&row.msg_key)
                .payload(row.payload.as_bytes())
                .headers(headers);
            loop {
                match self.producer.send(record) {
                    Ok(()) => {
                        room.succeeded();
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                        if Instant::now() < room_by =>
                    {
                        // Room comes as earlier messages are acknowledged.
                        record = back;
                        let pause = room.failed().min(room_by - Instant::now());
                        tokio::time::sleep(pause).await;
                    }
                    Err((error, back)) => {
                        batch.set(index, Err(error));
                        drop(back);
                        break;
                    }
                }
            }
        }
        KafkaInFlight {
            batch,
            deadline: by.wait(self.ack_timeout + REPORT_GRACE),
        }
    }

    /// Bookkeeping after a batch's deliveries settled: a fresh producer
    /// after retriable failures, topics checked again after unroutable ones.
    pub fn settle(&mut self, results: &[Result<(), PublishError>]) {
        if results
            .iter()
            .any(|r| matches!(r, Err(PublishError::Retriable { .. })))
        {
            self.recover();
        }
        if results
            .iter()
            .any(|r| matches!(r, Err(PublishError::Unroutable { .. })))
        {
            // Topics may have been deleted behind our back; check them again.
            self.ensured.clear();
        }
    }

    fn recover(&mut self) {
        self.ensured.clear();
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            warn!(?code, %reason, "Kafka producer hit a fatal error");
        }
        // The old producer stays alive until the next recovery, so a batch
        // still in flight on it settles (published, or "maybe sent").
        match relay_producer(&self.brokers, self.ack_timeout, self.max_message_bytes) {
            Ok(fresh) => {
                let old = std::mem::replace(&mut self.producer, fresh);
                if let Some(older) = self.retired.replace(old) {
                    // Dropping a producer joins its polling thread and
                    // flushes: not on the async runtime.
                    tokio::task::spawn_blocking(move || drop(older));
                }
            }
            Err(err) => warn!(%err, "recreating the Kafka producer failed; will retry"),
        }
    }

    pub async fn flush(&mut self) {
        let producer = self.producer.clone();
        let timeout = self.ack_timeout;
        let _ = tokio::task::spawn_blocking(move || producer.flush(Timeout::After(timeout))).await;
    }
}
