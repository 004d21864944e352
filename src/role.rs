//! The one contract every background role keeps.
//!
//! A role (scheduler, reaper, janitor, metrics collector, relay, worker,
//! consumer) is a value built from a [`Valid`] config, so an invalid
//! setting is refused where it is written and never reaches a timer
//! (`tokio::time::interval` panics on a zero period). It implements
//! [`Role`]: a typed [`RoleName`] and `run(self, shutdown)`, which returns
//! once `shutdown` is cancelled, after stopping in the role's own order. It
//! counts into the [`crate::metrics::Metrics`] it is handed (`with_metrics`).
//! The [`crate::supervisor`] runs roles (and the HTTP server, under
//! [`RoleName::Http`]) and names the one that fails.
//!
//! A role whose work is a sweep repeated on an interval (reaper, janitor,
//! collector) implements [`Periodic`] instead: `run_once` does one sweep and
//! is what tests call; [`Role::run`] comes from the one runner here, which
//! never overlaps sweeps (a slow sweep delays the next tick, it does not
//! stack up), logs a failed sweep at warn and tries again on the next tick,
//! and hands `shutdown` to the sweep so a long one stops between batches.

use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::str::FromStr;
use std::time::Duration;

use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Every kind of role a process can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RoleName {
    Http,
    Scheduler,
    Reaper,
    Janitor,
    Metrics,
    Relay,
    Worker,
    Consumer,
}

impl RoleName {
    /// The roles `almanac run` can run, in the order it starts them.
    pub const RUN: [RoleName; 5] = [
        RoleName::Scheduler,
        RoleName::Reaper,
        RoleName::Janitor,
        RoleName::Metrics,
        RoleName::Relay,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            RoleName::Http => "http",
            RoleName::Scheduler => "scheduler",
            RoleName::Reaper => "reaper",
            RoleName::Janitor => "janitor",
            RoleName::Metrics => "metrics",
            RoleName::Relay => "relay",
            RoleName::Worker => "worker",
            RoleName::Consumer => "consumer",
        }
    }
}

impl fmt::Display for RoleName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RoleName {
    type Err = String;

    /// One of the roles `almanac run` runs.
    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        RoleName::RUN
            .into_iter()
            .find(|r| r.as_str() == text)
            .ok_or_else(|| {
                let names: Vec<&str> = RoleName::RUN.iter().map(|r| r.as_str()).collect();
                format!("unknown role `{text}`; roles are {}", names.join(", "))
            })
    }
}

impl<'de> serde::Deserialize<'de> for RoleName {
    /// `roles = ["scheduler", "relay"]` in `almanac.toml`.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A background role.
pub trait Role: Send + Sized + 'static {
    const NAME: RoleName;
    /// What the role reports when it stops (a worker: the jobs it ran).
    type Output: Send + 'static;
    type Error: std::error::Error + Send + Sync + 'static;

    /// Runs until `shutdown` is cancelled, then stops in the role's order.
    fn run(
        self,
        shutdown: CancellationToken,
    ) -> impl Future<Output = Result<Self::Output, Self::Error>> + Send;
}

/// A role whose work is one sweep repeated every [`Periodic::period`].
pub trait Periodic: Send + Sync + 'static {
    const NAME: RoleName;
    /// What one sweep did.
    type Report: Send;
    type Error: fmt::Display + Send;

    fn period(&self) -> Period;

    /// One sweep; stops early (with what it did so far) once `shutdown` is
    /// cancelled.
    fn run_once(
        &self,
        shutdown: &CancellationToken,
    ) -> impl Future<Output = Result<Self::Report, Self::Error>> + Send;

    /// Logs what a sweep did (nothing when it did nothing).
    fn log(&self, report: &Self::Report);
}

impl<P: Periodic> Role for P {
    const NAME: RoleName = P::NAME;
    type Output = ();
    /// A periodic role does not fail: a failed sweep is retried next tick.
    type Error = std::convert::Infallible;

    async fn run(self, shutdown: CancellationToken) -> Result<(), Self::Error> {
        let mut tick = tokio::time::interval(self.period().get());
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => {}
            }
            match self.run_once(&shutdown).await {
                Ok(report) => self.log(&report),
                Err(err) => warn!(role = %P::NAME, %err, "sweep failed; the next sweep retries"),
            }
        }
    }
}

/// A period longer than zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Period(Duration);

impl Period {
    pub fn new(period: Duration) -> Option<Period> {
        (!period.is_zero()).then_some(Period(period))
    }

    /// For literal defaults: panics (at compile time in a `const`) on zero.
    pub const fn from_secs(secs: u64) -> Period {
        assert!(secs > 0, "a period is longer than zero");
        Period(Duration::from_secs(secs))
    }

    pub const fn get(self) -> Duration {
        self.0
    }
}

/// A setting that breaks a rule, named by its key in `almanac.toml`
/// (`[reaper] interval`); the CLI adds the flag that sets it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting} {problem}")]
pub struct InvalidSetting {
    /// `[section] key`.
    pub setting: &'static str,
    /// What is wrong and what to write instead.
    pub problem: String,
}

impl InvalidSetting {
    /// A duration that must be longer than zero.
    pub fn positive(setting: &'static str, value: Duration) -> Result<Period, InvalidSetting> {
        Period::new(value).ok_or_else(|| InvalidSetting {
            setting,
            problem: "must be longer than 0s; write a duration such as 500ms, 5s or 1m".into(),
        })
    }

    /// A count that must be at least `min`.
    pub fn at_least(setting: &'static str, value: i64, min: i64) -> Result<(), InvalidSetting> {
        if value < min {
            return Err(InvalidSetting {
                setting,
                problem: format!("must be at least {min}, got {value}"),
            });
        }
        Ok(())
    }
}

/// A role's settings, with the rules they must keep.
pub trait Settings: Sized {
    fn check(&self) -> Result<(), InvalidSetting>;

    /// The settings, checked: the only way to a [`Valid`] config.
    fn validated(self) -> Result<Valid<Self>, InvalidSetting> {
        self.check()?;
        Ok(Valid(self))
    }
}

/// Settings that passed [`Settings::check`]; read-only from then on.
#[derive(Debug, Clone)]
pub struct Valid<S>(S);

impl<S> Deref for Valid<S> {
    type Target = S;

    fn deref(&self) -> &S {
        &self.0
    }
}

impl<S: Settings + Default> Default for Valid<S> {
    /// The defaults, which keep every rule (`cli::settings` tests each role's).
    fn default() -> Self {
        S::default()
            .validated()
            .expect("default settings are valid")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_names_parse_or_list_the_roles() {
        assert_eq!("relay".parse::<RoleName>(), Ok(RoleName::Relay));
        assert_eq!(
            "reapr".parse::<RoleName>().unwrap_err(),
            "unknown role `reapr`; roles are scheduler, reaper, janitor, metrics, relay"
        );
        // Workers and consumers are their own commands, not `run` roles.
        assert!("worker".parse::<RoleName>().is_err());
    }

    #[test]
    fn a_zero_period_is_refused_with_the_setting_named() {
        let err = InvalidSetting::positive("[reaper] interval", Duration::ZERO).unwrap_err();
        assert_eq!(
            err.to_string(),
            "[reaper] interval must be longer than 0s; write a duration such as 500ms, 5s or 1m"
        );
        assert_eq!(
            InvalidSetting::positive("x", Duration::from_millis(1))
                .unwrap()
                .get(),
            Duration::from_millis(1)
        );
    }
}
