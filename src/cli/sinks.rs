//! Broker flags shared by `run`, `consume` and `route set`, and the relay's
//! own flags for `run`.

use anyhow::bail;

use super::Ctx;
use crate::broker::SinkConfig;
use crate::config::{pick, HumanDuration};
use crate::relay::RelayConfig;
use crate::role::{Settings, Valid};

#[derive(Debug, Clone, clap::Args)]
pub struct SinkFlags {
    /// Kafka bootstrap servers, HOST:PORT[,...]; turns on the Kafka relay in `run` [default: none].
    #[arg(long, env = "ALMANAC_KAFKA_BROKERS")]
    pub kafka_brokers: Option<String>,
    /// RabbitMQ URL, amqp://USER:PASSWORD@HOST:PORT/VHOST; turns on the RabbitMQ relay in `run` [default: none].
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
    /// The largest message body the relay sends; a larger one is marked failed [default: 1000000].
    #[arg(long, env = "ALMANAC_MAX_MESSAGE_BYTES")]
    pub max_message_bytes: Option<usize>,
}

impl SinkFlags {
    /// Flags and environment first, then `[relay]` in the config file.
    pub fn resolve(&self, ctx: &Ctx) -> anyhow::Result<SinkConfig> {
        let file = &ctx.config.relay;
        let defaults = SinkConfig::default();
        let config = SinkConfig {
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
            ack_timeout: pick(self.ack_timeout, file.ack_timeout, defaults.ack_timeout),
            max_message_bytes: self
                .max_message_bytes
                .or(file.max_message_bytes)
                .unwrap_or(defaults.max_message_bytes),
        };
        config.check().map_err(super::invalid)?;
        Ok(config)
    }
}

/// The relay's settings in `almanac run`.
#[derive(Debug, Clone, clap::Args)]
pub struct RelayFlags {
    /// Outbox rows a relay claims and publishes at a time, 1 to 10000 [default: 500].
    #[arg(long, env = "ALMANAC_RELAY_BATCH_SIZE")]
    pub relay_batch_size: Option<i64>,
    /// Tries after which an outbox row the broker cannot route is marked failed and its job dead [default: 10].
    #[arg(long, env = "ALMANAC_MAX_PUBLISH_ATTEMPTS")]
    pub max_publish_attempts: Option<i32>,
    /// How long a relay holds a claimed batch before another relay may publish it again; the relay gives a batch up before it ends. Longer than three --ack-timeouts and 10s [default: 60s].
    #[arg(long, env = "ALMANAC_IN_FLIGHT_LEASE")]
    pub in_flight_lease: Option<HumanDuration>,
    /// How often the relay repairs jobs and outbox rows that disagree with their route [default: 60s].
    #[arg(long, env = "ALMANAC_RECONCILE_INTERVAL")]
    pub reconcile_interval: Option<HumanDuration>,
    /// Broker-route jobs ready this long with no recent message get a fresh one [default: 5m].
    #[arg(long, env = "ALMANAC_REDRIVE_AFTER")]
    pub redrive_after: Option<HumanDuration>,
}

impl RelayFlags {
    /// The relay's settings: these flags, then `[relay]` in the config
    /// file, then the defaults; validated against `sinks`.
    pub fn resolve(&self, ctx: &Ctx) -> anyhow::Result<Valid<RelayConfig>> {
        let file = &ctx.config.relay;
        let d = RelayConfig::default();
        let config = RelayConfig {
            batch_size: self
                .relay_batch_size
                .or(file.batch_size)
                .unwrap_or(d.batch_size),
            max_publish_attempts: self
                .max_publish_attempts
                .or(file.max_publish_attempts)
                .unwrap_or(d.max_publish_attempts),
            in_flight_lease: pick(
                self.in_flight_lease,
                file.in_flight_lease,
                d.in_flight_lease,
            ),
            reconcile_interval: pick(
                self.reconcile_interval,
                file.reconcile_interval,
                d.reconcile_interval,
            ),
            redrive_after: pick(self.redrive_after, file.redrive_after, d.redrive_after),
            ..d
        };
        config.validated().map_err(super::invalid)
    }
}

/// Refuses an `--in-flight-lease` no longer than [`crate::relay::in_flight_bound`]
/// of the ack timeout: what a batch takes while the broker answers in time.
/// The lease is the bound the relay keeps (it gives a batch up before its
/// lease ends, whatever the broker does); a shorter one would give healthy
/// batches up. Checked only where a relay runs.
pub fn check_in_flight(config: &RelayConfig, sinks: &SinkConfig) -> anyhow::Result<()> {
    {
        let needed = crate::relay::in_flight_bound(sinks.ack_timeout);
        if config.in_flight_lease <= needed {
            bail!(
                "--in-flight-lease ({:?}) must be longer than {:?} with --ack-timeout {:?} (three ack timeouts and {:?}: what a pipelined batch takes while the broker answers in time: the batch before it, room to send, its acks, its mark); the relay gives a batch up when its lease runs out, so with a shorter lease healthy batches would be given up and sent again. Raise --in-flight-lease or lower --ack-timeout",
                config.in_flight_lease,
                needed,
                sinks.ack_timeout,
                crate::relay::IN_FLIGHT_MARGIN,
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(batch: Option<i64>) -> RelayFlags {
        RelayFlags {
            relay_batch_size: batch,
            max_publish_attempts: None,
            in_flight_lease: None,
            reconcile_interval: None,
            redrive_after: None,
        }
    }

    fn ctx(file_batch: Option<i64>) -> Ctx {
        let mut config = crate::config::Config::default();
        config.relay.batch_size = file_batch;
        Ctx {
            config,
            database_url: String::new(),
        }
    }

    #[test]
    fn the_relay_batch_size_is_the_flag_then_the_file_then_500() {
        let batch = |flag, file| flags(flag).resolve(&ctx(file)).unwrap().batch_size;
        assert_eq!(batch(Some(40), Some(70)), 40);
        assert_eq!(batch(None, Some(70)), 70);
        assert_eq!(batch(None, None), 500);
    }

    #[test]
    fn the_in_flight_lease_must_outlast_three_ack_timeouts_and_the_margin() {
        let sinks = SinkConfig::default(); // ack timeout 10 s: at least 40 s
        let lease = |secs| RelayConfig {
            in_flight_lease: std::time::Duration::from_secs(secs),
            ..RelayConfig::default()
        };
        assert!(
            check_in_flight(&lease(60), &sinks).is_ok(),
            "the defaults pass"
        );
        let refused = check_in_flight(&lease(40), &sinks).unwrap_err().to_string();
        assert!(
            refused
                .contains("--in-flight-lease (40s) must be longer than 40s with --ack-timeout 10s"),
            "{refused}"
        );
    }
}
