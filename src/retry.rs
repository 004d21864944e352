//! One pacing helper for every reconnect and retry loop in the process
//! (LISTEN connections, broker reconnects, relay batches, consumers, the
//! reaper and the leader's standby loop), so they share one shape: a pause
//! that doubles from `first` up to `max` with jitter after each consecutive
//! failure, resets on success, and never outlives a cancelled token.
//!
//! Job retry delays (`run_at` of a failed job) are [`crate::queue::Backoff`];
//! this type reuses its arithmetic for process-local pauses.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::queue::Backoff;

#[derive(Debug, Clone)]
pub struct Retry {
    backoff: Backoff,
    failures: u32,
}

impl Retry {
    /// Pauses of `first`, doubling per consecutive failure, capped at `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        Retry {
            backoff: Backoff {
                base: first,
                max: max.max(first),
                jitter: 0.2,
            },
            failures: 0,
        }
    }

    /// The usual pacing for reconnecting to a database or broker: 100 ms up to 10 s.
    pub fn reconnect() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(10))
    }

    /// Records a failure and returns how long to pause before the next try.
    pub fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.backoff
            .delay(i32::try_from(self.failures).unwrap_or(i32::MAX))
    }

    /// Records a success: the next failure pauses `first` again.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// Consecutive failures since the last success.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Records a failure and sleeps its pause; `false` when `shutdown` was
    /// cancelled first (the caller should stop).
    pub async fn pause(&mut self, shutdown: &CancellationToken) -> bool {
        self.pause_told(shutdown, |_| {}).await
    }

    /// As [`Retry::pause`], telling `tell` the pause first (for the log
    /// line that says when the next try comes).
    pub async fn pause_told(
        &mut self,
        shutdown: &CancellationToken,
        tell: impl FnOnce(Duration),
    ) -> bool {
        let pause = self.failed();
        tell(pause);
        tokio::select! {
            _ = shutdown.cancelled() => false,
            _ = tokio::time::sleep(pause) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_to_the_cap_and_reset_on_success() {
        let mut retry = Retry::new(Duration::from_millis(100), Duration::from_secs(1));
        let first = retry.failed();
        assert!(first <= Duration::from_millis(100) && first >= Duration::from_millis(80));
        let second = retry.failed();
        assert!(second > first);
        for _ in 0..10 {
            assert!(retry.failed() <= Duration::from_secs(1));
        }
        assert_eq!(retry.failures(), 12);
        retry.succeeded();
        assert_eq!(retry.failures(), 0);
        assert!(retry.failed() <= Duration::from_millis(100));
    }

    #[tokio::test]
    async fn a_cancelled_token_ends_the_pause() {
        let mut retry = Retry::new(Duration::from_secs(60), Duration::from_secs(60));
        let token = CancellationToken::new();
        token.cancel();
        assert!(!retry.pause(&token).await);
    }
}
