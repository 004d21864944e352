//! Everything that talks to a broker before a message is published or
//! consumed: which sinks exist and where they are ([`SinkConfig`]),
//! connecting, and creating destinations (Kafka topics through the admin API;
//! RabbitMQ durable exchange, queue and binding). The relay's publishers and
//! the broker consumers both go through here, so a destination is prepared
//! the same way whoever touches it first.
//!
//! Publish results are typed ([`PublishError`]): `Retriable` (the broker is
//! down, slow, or the link broke: the message may or may not have been sent,
//! try again later, for as long as it takes), `Unroutable` (the broker is up
//! but has nowhere to put the message: a queue or topic is missing or cannot
//! be created; may heal when an operator fixes it, so it is retried a bounded
//! number of times), `Fatal` (the broker will never take this message: too
//! large, invalid destination name, not authorised). Each keeps its source.

pub mod kafka;
pub mod rabbitmq;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::redact::redact_url;
use crate::role::{InvalidSetting, Settings};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SinkKind {
    Kafka,
    Rabbitmq,
}

impl SinkKind {
    pub const ALL: [SinkKind; 2] = [SinkKind::Kafka, SinkKind::Rabbitmq];

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
    /// The largest message body the relay sends; a larger one is rejected
    /// for good (Kafka's `message.max.bytes`; checked before publishing to
    /// RabbitMQ, whose broker-side limit closes the whole channel instead).
    pub max_message_bytes: usize,
}

impl Settings for SinkConfig {
    /// Refuses settings that would fail every row (and so bury every
    /// broker job) or hang the relay.
    fn check(&self) -> Result<(), InvalidSetting> {
        InvalidSetting::at_least("[relay] kafka_partitions", self.kafka_partitions.into(), 1)?;
        if self.kafka_replication < 1 && self.kafka_replication != -1 {
            return Err(InvalidSetting {
                setting: "[relay] kafka_replication",
                problem: format!(
                    "must be at least 1 (or -1 for the broker's default), got {}",
                    self.kafka_replication
                ),
            });
        }
        if self.ack_timeout < Duration::from_millis(100) {
            return Err(InvalidSetting {
                setting: "[relay] ack_timeout",
                problem: format!("must be at least 100ms, got {:?}", self.ack_timeout),
            });
        }
        InvalidSetting::at_least(
            "[relay] max_message_bytes",
            i64::try_from(self.max_message_bytes).unwrap_or(i64::MAX),
            1024,
        )
    }
}

impl Default for SinkConfig {
    fn default() -> Self {
        SinkConfig {
            kafka_brokers: None,
            amqp_url: None,
            kafka_partitions: 3,
            kafka_replication: 1,
            ack_timeout: Duration::from_secs(10),
            max_message_bytes: 1_000_000,
        }
    }
}

impl fmt::Debug for SinkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SinkConfig")
            .field("kafka_brokers", &self.kafka_brokers)
            .field("amqp_url", &self.amqp_url.as_deref().map(redact_url))
            .field("kafka_partitions", &self.kafka_partitions)
            .field("kafka_replication", &self.kafka_replication)
            .field("ack_timeout", &self.ack_timeout)
            .field("max_message_bytes", &self.max_message_bytes)
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

    /// The Kafka bootstrap servers, or the flag to pass.
    pub fn kafka(&self) -> Result<&str, SinkError> {
        self.kafka_brokers
            .as_deref()
            .ok_or(SinkError::NotConfigured {
                sink: SinkKind::Kafka,
                flag: "--kafka-brokers (or ALMANAC_KAFKA_BROKERS)",
            })
    }

    /// The AMQP URL, or the flag to pass.
    pub fn amqp(&self) -> Result<&str, SinkError> {
        self.amqp_url.as_deref().ok_or(SinkError::NotConfigured {
            sink: SinkKind::Rabbitmq,
            flag: "--amqp-url (or ALMANAC_AMQP_URL)",
        })
    }
}

/// Setting up a client or a destination failed.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("{sink} is not configured: pass {flag}")]
    NotConfigured { sink: SinkKind, flag: &'static str },
    #[error("{0}")]
    Broker(String),
    #[error(transparent)]
    Publish(#[from] PublishError),
}

/// A source error that is only a message.
#[derive(Debug, Clone)]
pub struct Plain(pub String);

impl fmt::Display for Plain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Plain {}

pub type Source = Arc<dyn std::error::Error + Send + Sync>;

/// Why one message was not acknowledged. See the module doc for what each
/// kind means to the relay.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PublishError {
    #[error("{context}")]
    Retriable {
        context: String,
        #[source]
        source: Source,
    },
    #[error("{context}")]
    Unroutable {
        context: String,
        #[source]
        source: Source,
    },
    #[error("{context}")]
    Fatal {
        context: String,
        #[source]
        source: Source,
    },
}

impl PublishError {
    pub fn retriable(
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        PublishError::Retriable {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    pub fn unroutable(
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        PublishError::Unroutable {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    pub fn fatal(
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        PublishError::Fatal {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            PublishError::Retriable { .. } => "retriable",
            PublishError::Unroutable { .. } => "unroutable",
            PublishError::Fatal { .. } => "fatal",
        }
    }

    /// The message and its whole source chain, for `last_error` and logs.
    pub fn reason(&self) -> String {
        let mut text = self.to_string();
        let mut next = std::error::Error::source(self);
        while let Some(source) = next {
            let part = source.to_string();
            if !text.contains(&part) {
                text.push_str(": ");
                text.push_str(&part);
            }
            next = source.source();
        }
        text
    }
}

/// Makes sure `destination` exists on `sink` (a topic; an exchange, queue
/// and binding), as `route set` does before routing any job to it.
pub async fn ensure_destination(
    sink: SinkKind,
    config: &SinkConfig,
    destination: &str,
) -> Result<(), SinkError> {
    match sink {
        SinkKind::Kafka => {
            let admin = kafka::admin(config.kafka()?)?;
            kafka::ensure_topic(
                &admin,
                destination,
                config.kafka_partitions,
                config.kafka_replication,
                config.ack_timeout,
            )
            .await?;
        }
        SinkKind::Rabbitmq => {
            let url = config.amqp()?;
            let (conn, channel) = rabbitmq::connect(url, config.ack_timeout).await?;
            let declared = rabbitmq::declare_destination(&channel, destination).await;
            let _ = conn.close(200, "destination declared").await;
            declared?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_keeps_the_source_chain_once() {
        let err = PublishError::fatal("message of 20 bytes is too large", Plain("limit 10".into()));
        assert_eq!(err.reason(), "message of 20 bytes is too large: limit 10");
        assert_eq!(err.kind(), "fatal");
    }
}
