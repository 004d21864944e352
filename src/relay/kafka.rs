//! Kafka: an idempotent producer with `acks=all` (see
//! [`crate::broker::kafka::producer`]); the message key is the job's
//! idempotency key and headers carry job id, kind, attempt and logical run.
//! A batch is handed to the producer at once (its `linger.ms` groups it into
//! produce requests) and every delivery report is awaited together. A row
//! counts as published only when its delivery report succeeds; a failed or
//! timed-out delivery is "maybe sent" (a second copy is harmless: consumers
//! claim through the fence). After failed deliveries the producer is
//! recreated: a broker that came back may not know this idempotent
//! producer's id and sequence numbers.

use std::collections::HashSet;
use std::time::Duration;

use futures::future::join_all;
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
}

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

    /// Publishes `rows` (whose destinations are prepared) and waits for
    /// every delivery report; one result per row, in order.
    pub async fn publish(&mut self, rows: &[&OutboxRow]) -> Vec<Result<(), PublishError>> {
        let mut pending = Vec::with_capacity(rows.len());
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
            pending.push(self.enqueue(record));
        }
        let results: Vec<Result<(), PublishError>> = join_all(pending)
            .await
            .into_iter()
            .zip(rows)
            .map(|(result, row)| result.map_err(|e| classify(&row.destination, e)))
            .collect();
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
        results
    }

    /// Hands one record to the producer without waiting for the broker; the
    /// returned future resolves with its delivery report. A full local queue
    /// waits for room (up to the ack timeout) instead of failing.
    fn enqueue<'a>(
        &'a self,
        record: FutureRecord<'a, String, [u8]>,
    ) -> impl std::future::Future<Output = Result<(), KafkaError>> + 'a {
        let size = record.payload.map_or(0, <[u8]>::len);
        let queued = if size > self.max_message_bytes {
            Err(Some(KafkaError::MessageProduction(
                RDKafkaErrorCode::MessageSizeTooLarge,
            )))
        } else {
            match self.producer.send_result(record) {
                Ok(delivery) => Ok(Ok(delivery)),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), record)) => {
                    Ok(Err(record))
                }
                Err((error, _)) => Err(Some(error)),
            }
        };
        let timeout = self.ack_timeout;
        async move {
            let delivery = match queued {
                Err(error) => return Err(error.expect("an error")),
                Ok(Ok(delivery)) => delivery,
                Ok(Err(record)) => {
                    return self
                        .producer
                        .send(record, Timeout::After(timeout))
                        .await
                        .map(|_| ())
                        .map_err(|(e, _)| e)
                }
            };
            match delivery.await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err((error, _))) => Err(error),
                Err(_) => Err(KafkaError::Canceled),
            }
        }
    }

    fn recover(&mut self) {
        self.ensured.clear();
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            warn!(?code, %reason, "Kafka producer hit a fatal error");
        }
        // Every delivery of the batch is settled here, so a fresh producer
        // costs nothing and cannot lose a message in flight.
        match producer(&self.brokers, self.ack_timeout, self.max_message_bytes) {
            Ok(fresh) => self.producer = fresh,
            Err(err) => warn!(%err, "recreating the Kafka producer failed; will retry"),
        }
    }

    pub async fn flush(&mut self) {
        let producer = self.producer.clone();
        let timeout = self.ack_timeout;
        let _ = tokio::task::spawn_blocking(move || producer.flush(Timeout::After(timeout))).await;
    }
}
