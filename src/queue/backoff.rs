//! Retry delays: exponential, capped, with jitter that never lets a later
//! attempt wait less than an earlier one.

use std::time::Duration;

use rand::Rng;

/// `base * 2^(attempt-1)`, capped at `max`, then shortened by up to
/// `jitter` (a fraction below 0.5), so delays still grow strictly until the cap:
/// the shortest next delay, `2d(1-jitter)`, exceeds the longest current one, `d`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_secs(1),
            max: Duration::from_secs(3600),
            jitter: 0.25,
        }
    }
}

impl Backoff {
    /// The delay before the retry that follows failed attempt `attempt` (1-based).
    pub fn delay(&self, attempt: i32) -> Duration {
        self.delay_with(attempt, rand::thread_rng().gen_range(0.0..=1.0))
    }

    /// As [`Backoff::delay`], with the random draw `unit` in `[0, 1]` supplied.
    pub fn delay_with(&self, attempt: i32, unit: f64) -> Duration {
        let exponent = attempt.clamp(1, 63) as u32 - 1;
        let full = self
            .base
            .checked_mul(2u32.saturating_pow(exponent.min(31)))
            .unwrap_or(self.max)
            .min(self.max);
        full.mul_f64(1.0 - self.jitter.clamp(0.0, 0.49) * unit.clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_strictly_until_the_cap_whatever_the_jitter() {
        let b = Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(60),
            jitter: 0.25,
        };
        for attempt in 1..9 {
            let longest_now = b.delay_with(attempt, 0.0);
            let shortest_next = b.delay_with(attempt + 1, 1.0);
            assert!(shortest_next > longest_now, "attempt {attempt}");
        }
        assert_eq!(b.delay_with(1, 0.0), Duration::from_millis(100));
        assert_eq!(b.delay_with(40, 0.0), Duration::from_secs(60));
        assert_eq!(b.delay_with(i32::MAX, 0.0), Duration::from_secs(60));
    }
}
