//! Broker flags shared by `run`, `consume` and `route set`.

use super::Ctx;
use crate::config::HumanDuration;
use crate::relay::SinkConfig;

#[derive(Debug, Clone, clap::Args)]
pub struct SinkFlags {
    /// Kafka bootstrap servers, HOST:PORT[,...]; turns on the Kafka relay in `run`.
    #[arg(long, env = "ALMANAC_KAFKA_BROKERS")]
    pub kafka_brokers: Option<String>,
    /// RabbitMQ URL, amqp://USER:PASSWORD@HOST:PORT/VHOST; turns on the RabbitMQ relay in `run`.
    #[arg(long, env = "ALMANAC_AMQP_URL", hide_env_values = true)]
    pub amqp_url: Option<String>,
    /// Partitions of Kafka topics almanac creates [default: 3].
    #[arg(long, env = "ALMANAC_KAFKA_PARTITIONS")]
    pub kafka_partitions: Option<i32>,
    /// Replication factor of Kafka topics almanac creates [default: 1].
    #[arg(long, env = "ALMANAC_KAFKA_REPLICATION")]
    pub kafka_replication: Option<i32>,
    /// How long a publish waits for the broker's acknowledgement [default: 10s].
    #[arg(long, env = "ALMANAC_ACK_TIMEOUT")]
    pub ack_timeout: Option<HumanDuration>,
}

impl SinkFlags {
    /// Flags and environment first, then `[relay]` in the config file.
    pub fn resolve(&self, ctx: &Ctx) -> SinkConfig {
        let file = &ctx.config.relay;
        let defaults = SinkConfig::default();
        SinkConfig {
            kafka_brokers: self
                .kafka_brokers
                .clone()
                .or_else(|| file.kafka_brokers.clone())
                .filter(|s| !s.is_empty()),
            amqp_url: self
                .amqp_url
                .clone()
                .or_else(|| file.amqp_url.clone())
                .filter(|s| !s.is_empty()),
            kafka_partitions: self
                .kafka_partitions
                .or(file.kafka_partitions)
                .unwrap_or(defaults.kafka_partitions),
            kafka_replication: self
                .kafka_replication
                .or(file.kafka_replication)
                .unwrap_or(defaults.kafka_replication),
            ack_timeout: self
                .ack_timeout
                .or(file.ack_timeout)
                .map_or(defaults.ack_timeout, |d| d.0),
        }
    }
}
