//! Kafka: an idempotent producer with `acks=all` (see
//! [`crate::broker::kafka::producer`]); the message key is the job's
//! idempotency key and headers carry job id, kind, attempt and logical run.
//! A batch is handed to the producer at once (its `linger.ms` groups it into
//! produce requests) and its delivery reports are awaited together, while
//! the relay hands over the next batch. A row
//! counts as published only when its delivery report succeeds; a failed or
//! timed-out delivery is "maybe sent" (a second copy is harmless: consumers
//! claim through the fence). After failed deliveries the producer is
//! recreated: a broker that came back may not know this idempotent
//! producer's id and sequence numbers.

use std::collections::HashSet;
use std::time::Duration;

use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;
use tracing::warn;

use super::OutboxRow;
use crate::broker::kafka::{admin, classify, ensure_topic, producer};
use crate::broker::{PublishError, SinkConfig, SinkError};

pub struct KafkaPublisher {
    brokers: String,
    producer: FutureProducer,
    admin: AdminClient<DefaultClientContext>,
    partitions: i32,
    replication: i32,
    ack_timeout: Duration,
    max_message_bytes: usize,
    ensured: HashSet<String>,
    retired: Option<FutureProducer>,
}

/// A message handed to the broker, resolving with its acknowledgement.
pub type Pending = futures::future::BoxFuture<'static, Result<(), PublishError>>;

impl KafkaPublisher {
    pub fn new(brokers: String, config: &SinkConfig) -> Result<Self, SinkError> {
        Ok(KafkaPublisher {
            producer: producer(&brokers, config.ack_timeout, config.max_message_bytes)?,
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

    pub async fn ensure(&mut self, topic: &str) -> Result<(), PublishError> {
        if self.ensured.contains(topic) {
            return Ok(());
        }
        ensure_topic(
            &self.admin,
            topic,
            self.partitions,
            self.replication,
            self.ack_timeout,
        )
        .await?;
        self.ensured.insert(topic.to_string());
        Ok(())
    }

    /// Hands `rows` (whose destinations are prepared) to the producer
    /// without waiting for the broker; one future per row, in order, that
    /// resolves with its delivery report. A full local queue waits for room
    /// (then for that delivery) instead of failing.
    pub async fn send(&mut self, rows: &[&OutboxRow]) -> Vec<Pending> {
        let mut pending: Vec<Pending> = Vec::with_capacity(rows.len());
        for row in rows {
            let mut headers = OwnedHeaders::new_with_capacity(row.header_names.len());
            for (key, value) in row.header_names.iter().zip(&row.header_values) {
                headers = headers.insert(Header {
                    key,
                    value: Some(value.as_str()),
                });
            }
            let record = FutureRecord::to(&row.destination)
                .key(&row.msg_key)
                .payload(row.payload.as_bytes())
                .headers(headers);
            let topic = row.destination.clone();
            match self.producer.send_result(record) {
                Ok(delivery) => pending.push(Box::pin(async move {
                    match delivery.await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err((error, _))) => Err(classify(&topic, error)),
                        Err(_) => Err(classify(&topic, KafkaError::Canceled)),
                    }
                })),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), record)) => {
                    let done = self
                        .producer
                        .send(record, Timeout::After(self.ack_timeout))
                        .await
                        .map(|_| ())
                        .map_err(|(e, _)| classify(&topic, e));
                    pending.push(Box::pin(std::future::ready(done)));
                }
                Err((error, _)) => {
                    pending.push(Box::pin(std::future::ready(Err(classify(&topic, error)))))
                }
            }
        }
        pending
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
        match producer(&self.brokers, self.ack_timeout, self.max_message_bytes) {
            Ok(fresh) => self.retired = Some(std::mem::replace(&mut self.producer, fresh)),
            Err(err) => warn!(%err, "recreating the Kafka producer failed; will retry"),
        }
    }

    pub async fn flush(&mut self) {
        let producer = self.producer.clone();
        let timeout = self.ack_timeout;
        let _ = tokio::task::spawn_blocking(move || producer.flush(Timeout::After(timeout))).await;
    }
}
