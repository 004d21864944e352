//! Kafka: an idempotent producer with `acks=all`; the message key is the
//! job's idempotency key and headers carry job id, kind, attempt and logical
//! run. A row counts as published only when its delivery report succeeds; a
//! failed or timed-out delivery is "maybe sent", and the row stays
//! unpublished (a second copy is harmless: consumers claim through the fence).
//! After failed deliveries (a fatal error among them) the producer is
//! recreated.

use std::collections::HashSet;
use std::time::Duration;

use futures::future::join_all;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;
use rdkafka::ClientConfig;
use tracing::warn;

use super::sink::{SinkConfig, SinkError};
use super::OutboxRow;

pub struct KafkaPublisher {
    brokers: String,
    producer: FutureProducer,
    admin: AdminClient<DefaultClientContext>,
    partitions: i32,
    replication: i32,
    ack_timeout: Duration,
    ensured: HashSet<String>,
}

pub fn producer(brokers: &str, ack_timeout: Duration) -> Result<FutureProducer, SinkError> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.timeout.ms", ack_timeout.as_millis().to_string())
        .create()
        .map_err(|e| {
            SinkError::Broker(format!("cannot create a Kafka producer for {brokers}: {e}"))
        })
}

/// Creates `topic` unless it exists.
pub async fn ensure_topic(
    admin: &AdminClient<DefaultClientContext>,
    topic: &str,
    partitions: i32,
    replication: i32,
    timeout: Duration,
) -> Result<(), SinkError> {
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(replication));
    let options = AdminOptions::new()
        .operation_timeout(Some(Timeout::After(timeout)))
        .request_timeout(Some(Timeout::After(timeout)));
    let results = admin
        .create_topics([&new], &options)
        .await
        .map_err(|e| SinkError::Broker(format!("cannot create Kafka topic `{topic}`: {e}")))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => {
                return Err(SinkError::Broker(format!(
                    "cannot create Kafka topic `{name}`: {code}"
                )))
            }
        }
    }
    Ok(())
}

pub fn admin(brokers: &str) -> Result<AdminClient<DefaultClientContext>, SinkError> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| {
            SinkError::Broker(format!(
                "cannot create a Kafka admin client for {brokers}: {e}"
            ))
        })
}

impl KafkaPublisher {
    pub fn new(brokers: String, config: &SinkConfig) -> Result<Self, SinkError> {
        Ok(KafkaPublisher {
            producer: producer(&brokers, config.ack_timeout)?,
            admin: admin(&brokers)?,
            brokers,
            partitions: config.kafka_partitions,
            replication: config.kafka_replication,
            ack_timeout: config.ack_timeout,
            ensured: HashSet::new(),
        })
    }

    pub async fn ensure(&mut self, topic: &str) -> Result<(), SinkError> {
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

    pub async fn publish(&mut self, rows: &[OutboxRow]) -> Vec<Result<(), String>> {
        let bodies: Vec<Vec<u8>> = rows
            .iter()
            .map(|r| serde_json::to_vec(&r.payload).unwrap_or_default())
            .collect();
        let sends = rows.iter().zip(&bodies).map(|(row, body)| {
            let mut headers = OwnedHeaders::new();
            for (key, value) in row.headers() {
                headers = headers.insert(Header {
                    key: &key,
                    value: Some(value.as_str()),
                });
            }
            let record = FutureRecord::to(&row.destination)
                .key(&row.msg_key)
                .payload(body)
                .headers(headers);
            self.producer.send(record, Timeout::After(self.ack_timeout))
        });
        let results: Vec<Result<(), String>> = join_all(sends)
            .await
            .into_iter()
            .map(|r| {
                r.map(|_| ())
                    .map_err(|(e, _)| format!("Kafka delivery failed (maybe sent): {e}"))
            })
            .collect();
        if results.iter().any(Result::is_err) {
            // Topics may have been deleted behind our back; check them again.
            self.ensured.clear();
            // A broker that came back may not know this idempotent producer's
            // id and sequence numbers, and librdkafka can stay wedged on them;
            // every delivery is settled here, so a fresh producer costs nothing.
            if let Some((code, reason)) = self.producer.client().fatal_error() {
                warn!(?code, %reason, "Kafka producer hit a fatal error");
            }
            match producer(&self.brokers, self.ack_timeout) {
                Ok(fresh) => self.producer = fresh,
                Err(err) => warn!(%err, "recreating the Kafka producer failed; will retry"),
            }
        }
        results
    }

    pub async fn flush(&mut self) {
        let producer = self.producer.clone();
        let timeout = self.ack_timeout;
        let _ = tokio::task::spawn_blocking(move || producer.flush(Timeout::After(timeout))).await;
    }
}
