//! The two sinks, their settings, and a publisher that speaks to either.

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use super::{kafka::KafkaPublisher, rabbitmq::RabbitPublisher, OutboxRow};
use crate::redact::redact_url;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SinkKind {
    Kafka,
    Rabbitmq,
}

impl SinkKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SinkKind::Kafka => "kafka",
            SinkKind::Rabbitmq => "rabbitmq",
        }
    }

    pub fn parse(text: &str) -> Option<SinkKind> {
        match text {
            "kafka" => Some(SinkKind::Kafka),
            "rabbitmq" => Some(SinkKind::Rabbitmq),
            _ => None,
        }
    }
}

impl fmt::Display for SinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the brokers are and how to talk to them.
#[derive(Clone)]
pub struct SinkConfig {
    /// `host:port,...`
    pub kafka_brokers: Option<String>,
    /// `amqp://user:password@host:port/vhost`; never logged.
    pub amqp_url: Option<String>,
    /// Partitions of topics almanac creates.
    pub kafka_partitions: i32,
    pub kafka_replication: i32,
    /// How long one publish may wait for the broker's acknowledgement.
    pub ack_timeout: Duration,
}

impl Default for SinkConfig {
    fn default() -> Self {
        SinkConfig {
            kafka_brokers: None,
            amqp_url: None,
            kafka_partitions: 3,
            kafka_replication: 1,
            ack_timeout: Duration::from_secs(10),
        }
    }
}

impl fmt::Debug for SinkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SinkConfig")
            .field("kafka_brokers", &self.kafka_brokers)
            .field("amqp_url", &self.amqp_url.as_deref().map(redact_url))
            .field("kafka_partitions", &self.kafka_partitions)
            .field("ack_timeout", &self.ack_timeout)
            .finish()
    }
}

impl SinkConfig {
    pub fn configured(&self) -> Vec<SinkKind> {
        let mut sinks = Vec::new();
        if self.kafka_brokers.is_some() {
            sinks.push(SinkKind::Kafka);
        }
        if self.amqp_url.is_some() {
            sinks.push(SinkKind::Rabbitmq);
        }
        sinks
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("{sink} is not configured: pass {flag}")]
    NotConfigured { sink: SinkKind, flag: &'static str },
    #[error("{0}")]
    Broker(String),
}

/// Publishes outbox rows to one sink and says, per row, whether the broker
/// acknowledged it.
pub enum Publisher {
    Kafka(KafkaPublisher),
    Rabbit(Box<RabbitPublisher>),
}

impl Publisher {
    pub fn new(sink: SinkKind, config: &SinkConfig) -> Result<Publisher, SinkError> {
        Ok(match sink {
            SinkKind::Kafka => {
                let brokers = config
                    .kafka_brokers
                    .clone()
                    .ok_or(SinkError::NotConfigured {
                        sink,
                        flag: "--kafka-brokers (or ALMANAC_KAFKA_BROKERS)",
                    })?;
                Publisher::Kafka(KafkaPublisher::new(brokers, config)?)
            }
            SinkKind::Rabbitmq => {
                let url = config.amqp_url.clone().ok_or(SinkError::NotConfigured {
                    sink,
                    flag: "--amqp-url (or ALMANAC_AMQP_URL)",
                })?;
                Publisher::Rabbit(Box::new(RabbitPublisher::new(url, config)))
            }
        })
    }

    pub fn sink(&self) -> SinkKind {
        match self {
            Publisher::Kafka(_) => SinkKind::Kafka,
            Publisher::Rabbit(_) => SinkKind::Rabbitmq,
        }
    }

    /// Makes sure the destination exists (topic; exchange, queue and binding).
    pub async fn ensure(&mut self, destination: &str) -> Result<(), SinkError> {
        match self {
            Publisher::Kafka(p) => p.ensure(destination).await,
            Publisher::Rabbit(p) => p.ensure(destination).await,
        }
    }

    /// One result per row, in order: `Ok` only for an acknowledged publish.
    pub async fn publish(&mut self, rows: &[OutboxRow]) -> Vec<Result<(), String>> {
        let destinations: HashSet<&str> = rows.iter().map(|r| r.destination.as_str()).collect();
        for destination in destinations {
            if let Err(err) = self.ensure(destination).await {
                let err = format!("cannot prepare destination `{destination}`: {err}");
                return rows.iter().map(|_| Err(err.clone())).collect();
            }
        }
        match self {
            Publisher::Kafka(p) => p.publish(rows).await,
            Publisher::Rabbit(p) => p.publish(rows).await,
        }
    }

    /// Waits for anything in flight (Kafka) before shutdown.
    pub async fn flush(&mut self) {
        match self {
            Publisher::Kafka(p) => p.flush().await,
            Publisher::Rabbit(p) => p.close().await,
        }
    }
}
