//! The relay's settings, and the rules they keep.

use std::time::Duration;

use crate::queue::Backoff;
use crate::role::{InvalidSetting, Settings};

/// A test hook: stop at a chosen point as a crash would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// After the broker acknowledged the batch, before the rows are marked.
    AfterPublishBeforeMark,
}

#[derive(Debug, Clone)]
pub struct RelayConfig {
    pub batch_size: i64,
    pub poll_interval: Duration,
    /// Delay before a failed row is tried again (doubling per attempt); also
    /// paces the relay after a failed batch.
    pub retry: Backoff,
    /// How long a claimed row stays with the relay that claimed it: the
    /// whole time a batch may take, from its claim to its mark (the relay
    /// gives a batch up before its lease ends). `almanac run` requires more
    /// than [`super::in_flight_bound`] of the ack timeout, what a batch takes
    /// while the broker answers in time.
    pub in_flight_lease: Duration,
    /// Tries after which an unroutable row is marked failed.
    pub max_publish_attempts: i32,
    /// Broker-route jobs ready and due this long without a recent outbox row
    /// get a fresh one.
    pub redrive_after: Duration,
    /// How often jobs and rows that disagree with their route are repaired.
    pub reconcile_interval: Duration,
    pub failpoint: Option<Failpoint>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch_size: 500,
            poll_interval: Duration::from_secs(1),
            retry: Backoff {
                base: Duration::from_millis(500),
                max: Duration::from_secs(60),
                jitter: 0.25,
            },
            in_flight_lease: Duration::from_secs(60),
            max_publish_attempts: 10,
            redrive_after: Duration::from_secs(300),
            reconcile_interval: Duration::from_secs(60),
            failpoint: None,
        }
    }
}

/// The largest batch a relay claims: a batch's ids are one array in one row
/// of `almanac.outbox_batches`, and its messages are in memory at once.
pub const MAX_BATCH_SIZE: i64 = 10_000;

impl Settings for RelayConfig {
    fn check(&self) -> Result<(), InvalidSetting> {
        if !(1..=MAX_BATCH_SIZE).contains(&self.batch_size) {
            return Err(InvalidSetting {
                setting: "[relay] batch_size",
                problem: format!(
                    "is {}; it must be between 1 and {MAX_BATCH_SIZE}",
                    self.batch_size
                ),
            });
        }
        InvalidSetting::at_least(
            "[relay] max_publish_attempts",
            self.max_publish_attempts.into(),
            1,
        )?;
        if self.in_flight_lease < Duration::from_secs(1) {
            return Err(InvalidSetting {
                setting: "[relay] in_flight_lease",
                problem: format!("is {:?}; it must be at least 1s", self.in_flight_lease),
            });
        }
        InvalidSetting::positive("[relay] poll_interval", self.poll_interval)?;
        InvalidSetting::positive("[relay] redrive_after", self.redrive_after)?;
        InvalidSetting::positive("[relay] reconcile_interval", self.reconcile_interval)?;
        // Paces a failing relay too: zero would retry in a tight loop.
        InvalidSetting::positive("[relay] retry base", self.retry.base)?;
        Ok(())
    }
}
