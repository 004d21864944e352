//! The scheduler: schedules from TOML files become exactly one job per
//! logical run.
//!
//! - [`cron`] parses expressions with crontab(5) meanings; [`timeline`] turns
//!   them into real instants and logical runs under the project's DST rules.
//! - [`spec`] loads and validates the schedule files, all or nothing; a
//!   schedule's `start` date is applied there, once.
//! - [`plan`] decides, for an injected `now`, which runs are on time, which
//!   were missed, and what the catch-up policy does with them, starting from
//!   the scheduler's own cursor.
//! - [`ledger`] records runs and emits their jobs in one transaction keyed by
//!   logical run: the guarantee that no run is emitted twice lives there.
//! - [`leader`] is the advisory-lock leadership and its lock session, which
//!   the server ends when the leader goes silent (the takeover time and what
//!   bounds it are stated there); [`ticker`] is the leader's in-memory tick;
//!   [`backfill`] is the operator's backfill and gaps; [`controls`] is the
//!   operator's pause, resume and trigger.
//!
//! [`Scheduler::run`] ties them together: stand by until the lock is won;
//! then sync the definitions, catch up, and sleep until the next fire time
//! (at most `min(max_sleep, leader_timeout / 3)`, so the lock session speaks
//! often enough, and leadership and reloads are re-checked), emitting each
//! run when it comes due. With no enabled schedule the leader only keeps its
//! session alive at that pace until a reload or shutdown. SIGHUP (a message on
//! the reload channel) reloads the files; a bad file keeps the old set and
//! logs why.
//!
//! **Time is the database's.** Every tick plans and classifies by `now()`
//! read on the lock session ([`leader::Leadership::heartbeat`]); sleeps are
//! measured on the monotonic clock from that reading. The host's wall clock is
//! only compared with it, to warn when they differ: a host clock minutes off
//! changes nothing. (`clock_offset` shifts that host clock, for tests.)

pub mod backfill;
pub mod controls;
pub mod cron;
pub mod deadline;
pub mod history;
pub mod leader;
pub mod ledger;
pub mod plan;
pub mod reprocess;
pub mod spec;
pub mod ticker;
pub mod timeline;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnectOptions;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Begins one of the scheduler's transactions: READ COMMITTED whatever the
/// database's default, since a job of an ordered kind can only be enqueued
/// so ([`crate::queue::ordering`]) and a schedule may emit one. On a
/// connection already in a transaction, a savepoint of it.
pub(crate) async fn begin(
    conn: &mut sqlx::PgConnection,
) -> Result<sqlx::Transaction<'_, sqlx::Postgres>, sqlx::Error> {
    use sqlx::Connection as _;
    if conn.is_in_transaction() {
        conn.begin().await
    } else {
        conn.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
    }
}

use crate::metrics::Metrics;
use crate::retry::Retry;
use crate::role::{InvalidSetting, Role, RoleName, Settings, Valid};
use leader::{LeaderLost, Leadership};
use ledger::Recorded;
use spec::Schedule;
use ticker::{Budget, Step, Ticker};

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub schedules_dir: PathBuf,
    /// How often a standby tries the lock.
    pub standby_retry: Duration,
    /// The longest the leader sleeps between ticks.
    pub max_sleep: Duration,
    /// A run this late or less is on time; later, it was missed.
    pub grace: Duration,
    /// How long the lock session may stay silent before PostgreSQL ends it,
    /// and the client-side limit on each of its statements (see [`leader`]).
    pub leader_timeout: Duration,
    /// Added to the host clock this process reads (tests inject a skewed
    /// clock with it). Zero in production.
    pub clock_offset: chrono::Duration,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            schedules_dir: PathBuf::from("schedules"),
            standby_retry: Duration::from_secs(2),
            max_sleep: Duration::from_secs(5),
            grace: Duration::from_secs(60),
            leader_timeout: Duration::from_secs(10),
            clock_offset: chrono::Duration::zero(),
        }
    }
}

impl Settings for SchedulerConfig {
    fn check(&self) -> Result<(), InvalidSetting> {
        if self.leader_timeout < Duration::from_secs(1) {
            return Err(InvalidSetting {
                setting: "[scheduler] leader_timeout",
                problem: format!(
                    "is {:?}, too short; use at least 1s (the default is 10s)",
                    self.leader_timeout
                ),
            });
        }
        InvalidSetting::positive("[scheduler] standby_retry", self.standby_retry)?;
        InvalidSetting::positive("[scheduler] max_sleep", self.max_sleep)?;
        Ok(())
    }
}

impl SchedulerConfig {
    /// The longest the leader stays silent on its lock session.
    pub fn heartbeat(&self) -> Duration {
        self.max_sleep.min(self.leader_timeout / 3)
    }

    /// A standby takes over from a silent leader within this, in the usual
    /// case (see [`leader`] for the worst case).
    pub fn takeover(&self) -> Duration {
        self.leader_timeout + self.standby_retry
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    #[error(transparent)]
    Load(#[from] spec::LoadError),
}

/// A signed duration such as `5m`, `-90s` or `+1h` (for `clock_offset`).
pub fn parse_offset(text: &str) -> Result<chrono::Duration, String> {
    let text = text.trim();
    let (sign, rest) = match text.strip_prefix('-') {
        Some(rest) => (-1, rest),
        None => (1, text.strip_prefix('+').unwrap_or(text)),
    };
    let d: crate::config::HumanDuration = rest.parse()?;
    let d = chrono::Duration::from_std(d.0).map_err(|e| e.to_string())?;
    Ok(d * sign)
}

/// How long the leader sleeps after a tick at database time `now`: until the
/// next fire time, at most `heartbeat`; the full `heartbeat` when nothing
/// enabled will fire (never a busy loop).
pub fn pause(
    next_wake: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    heartbeat: Duration,
) -> Duration {
    match next_wake {
        Some(next) => (next - now)
            .to_std()
            .unwrap_or(Duration::ZERO)
            .min(heartbeat),
        None => heartbeat,
    }
}

pub struct Scheduler {
    options: PgConnectOptions,
    config: Valid<SchedulerConfig>,
    schedules: Vec<Schedule>,
    leading: Arc<AtomicBool>,
    /// A message here reloads the schedule files (SIGHUP in `almanac run`).
    reload: Option<mpsc::Receiver<()>>,
    metrics: Metrics,
    tracer: crate::telemetry::Tracer,
}

enum Ended {
    Shutdown,
    Reload,
    Lost,
}

impl Scheduler {
    /// Loads the schedule files now, so a bad file fails the start.
    pub fn new(
        options: PgConnectOptions,
        config: Valid<SchedulerConfig>,
    ) -> Result<Self, SchedulerError> {
        let schedules = spec::load_dir(&config.schedules_dir)?;
        Ok(Scheduler {
            options,
            config,
            schedules,
            leading: Arc::new(AtomicBool::new(false)),
            reload: None,
            metrics: Metrics::new(),
            tracer: crate::telemetry::Tracer::off(),
        })
    }

    /// Counts into `metrics` (by default, a registry of its own).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Gives each logical run it records an `almanac.schedule.run` span
    /// in `tracer` (by default off), which its job's trace joins.
    pub fn with_tracer(mut self, tracer: crate::telemetry::Tracer) -> Self {
        self.tracer = tracer;
        self
    }

    /// Reloads the schedule files at each message on `reload`.
    pub fn reload_on(mut self, reload: mpsc::Receiver<()>) -> Self {
        self.reload = Some(reload);
        self
    }

    /// True while this instance is the leader (for metrics and health).
    pub fn leading(&self) -> Arc<AtomicBool> {
        self.leading.clone()
    }

    /// Reloads the files; returns the schedules that are new or whose
    /// definition changed (their runs since the reload are judged from it,
    /// not from when the leadership began: see [`ticker::Ticker::judge_from`]).
    fn reload(&mut self) -> HashSet<String> {
        match spec::load_dir(&self.config.schedules_dir) {
            Ok(schedules) => {
                info!(schedules = schedules.len(), "schedules reloaded");
                let fresh = schedules
                    .iter()
                    .filter(|s| {
                        !self
                            .schedules
                            .iter()
                            .any(|old| old.name == s.name && old.definition() == s.definition())
                    })
                    .map(|s| s.name.clone())
                    .collect();
                self.schedules = schedules;
                fresh
            }
            Err(err) => {
                error!("schedule reload rejected; keeping the previous set:\n{err}");
                HashSet::new()
            }
        }
    }

    /// Leadership gained: the one place that records it.
    fn gained(&self, leadership: &Leadership) {
        self.leading.store(true, Ordering::SeqCst);
        self.metrics.record_leadership(true);
        info!(
            backend_pid = leadership.pid(),
            takeover_bound_ms = self.config.takeover().as_millis() as u64,
            "became scheduler leader"
        );
    }

    /// Leadership lost or given up: the one place that records it.
    fn lost(&self, why: &str) {
        self.leading.store(false, Ordering::SeqCst);
        self.metrics.record_leadership(false);
        warn!(
            reason = why,
            "scheduler leadership lost; stopped emitting, standing by"
        );
    }

    /// What a tick recorded: the one place that records emitted and skipped runs.
    fn recorded(&self, r: Recorded) {
        for (schedule, outcome, rows) in &r.written {
            self.metrics.record_schedule_runs(schedule, outcome, *rows);
        }
        if r.emitted + r.skipped_catchup + r.skipped_overlap + r.skipped_disabled + r.skipped_paused
            > 0
        {
            info!(
                emitted = r.emitted,
                skipped_catchup = r.skipped_catchup,
                skipped_overlap = r.skipped_overlap,
                skipped_disabled = r.skipped_disabled,
                skipped_paused = r.skipped_paused,
                existed = r.existed,
                "scheduler tick"
            );
        }
    }

    /// Says which schedules a step deferred and why, once per busy spell
    /// of a kind; and when the kinds are free again.
    fn deferred(&self, step: &Step, deferring: bool, busy_said: &mut HashSet<String>) {
        if step.timed_out {
            warn!(
                schedules = ?step.deferred,
                "a scheduler step ran out of its time and was rolled back; retrying it smaller in a second"
            );
        }
        for kind in &step.busy {
            if busy_said.insert(kind.clone()) {
                warn!(
                    kind = %kind,
                    schedules = ?step.deferred,
                    "the kind's route lock is busy (a route change, or a transaction it waits on); its runs are emitted when it is free, the other schedules go on"
                );
            }
        }
        if !busy_said.is_empty() && !deferring {
            info!(kinds = ?busy_said, "route locks free again; the deferred runs are recorded");
            busy_said.clear();
        }
    }

    /// The host clock as this process reads it.
    fn host_now(&self) -> DateTime<Utc> {
        Utc::now() + self.config.clock_offset
    }

    /// Leads until shutdown, a reload, or the loss of the lock session.
    /// `awake_since` is when this leadership began (kept across reloads:
    /// runs that fell due since are never missed, see [`ticker`]).
    async fn lead(
        &self,
        leadership: &mut Leadership,
        awake_since: &mut Option<DateTime<Utc>>,
        fresh: &mut HashSet<String>,
        shutdown: &CancellationToken,
        reload: &mut mpsc::Receiver<()>,
    ) -> Ended {
        let limit = leadership.timeout();
        let heartbeat = self.config.heartbeat();
        let loaded = tokio::time::timeout(
            limit,
            Ticker::load(leadership.conn(), self.schedules.clone(), self.config.grace),
        )
        .await;
        let mut ticker = match loaded {
            Ok(Ok(ticker)) => ticker
                .with_budget(Budget::for_leader_timeout(limit))
                .with_tracer(self.tracer.clone()),
            Ok(Err(err)) => {
                self.lost(&format!("syncing schedules failed: {err}"));
                return Ended::Lost;
            }
            Err(_) => {
                self.lost(&LeaderLost::Timeout(limit).to_string());
                return Ended::Lost;
            }
        };
        let mut skew_warned = false;
        let mut idle_said = false;
        let mut busy_said: HashSet<String> = HashSet::new();
        loop {
            let now = match leadership.heartbeat().await {
                Ok(now) => now,
                Err(err) => {
                    self.lost(&err.to_string());
                    return Ended::Lost;
                }
            };
            let read_at = Instant::now();
            let awake_since = *awake_since.get_or_insert(now);
            if !fresh.is_empty() {
                ticker.judge_from(fresh, now);
                fresh.clear();
            }
            let skew = self.host_now() - now;
            if !skew_warned && skew.abs() > chrono::Duration::seconds(2) {
                skew_warned = true;
                warn!(
                    host_minus_database_ms = skew.num_milliseconds(),
                    "the host clock differs from the database's; the scheduler plans by the database's time"
                );
            }
            // Steps until nothing is due at `now`; after `heartbeat`, back to
            // the heartbeat (a fresh `now`), never sleeping while runs are due.
            let mut caught_up;
            loop {
                let step = ticker.step(leadership.conn(), now, awake_since);
                // The step's statements are bounded on the server (see
                // `ticker::Budget`); this only catches a connection that no
                // longer answers at all.
                match tokio::time::timeout(limit * 2, step).await {
                    Ok(Ok(step)) => {
                        self.deferred(&step, ticker.deferring(), &mut busy_said);
                        self.recorded(step.recorded);
                        caught_up = !step.more;
                        if !step.more || read_at.elapsed() >= heartbeat {
                            break;
                        }
                    }
                    Ok(Err(err)) => {
                        self.lost(&format!("tick failed: {err}"));
                        return Ended::Lost;
                    }
                    Err(_) => {
                        self.lost(&LeaderLost::Timeout(limit * 2).to_string());
                        return Ended::Lost;
                    }
                }
            }
            // The tick gauge says up to when every due run is recorded: a tick
            // that had to defer a schedule (a busy kind, a step that timed
            // out) or left runs for the next round leaves it where it was, so
            // a ticker stuck that way ages it.
            if caught_up && !ticker.deferring() {
                self.metrics.record_tick(now);
            }
            let next = ticker.next_wake();
            if next.is_none() && !idle_said {
                idle_said = true;
                info!("no enabled schedule will fire; idle until a reload or shutdown");
            }
            let sleep = pause(next, now, heartbeat).saturating_sub(read_at.elapsed());
            tokio::select! {
                _ = shutdown.cancelled() => return Ended::Shutdown,
                Some(()) = reload.recv() => return Ended::Reload,
                _ = tokio::time::sleep(sleep) => {}
            }
        }
    }
}

impl Role for Scheduler {
    const NAME: RoleName = RoleName::Scheduler;
    type Output = ();
    type Error = SchedulerError;

    /// Stands by or leads until `shutdown`; the leader steps down (releasing
    /// the lock) before it returns.
    async fn run(mut self, shutdown: CancellationToken) -> Result<(), SchedulerError> {
        // Without a reload channel, one whose sender is gone: never a message.
        let mut reload = self.reload.take().unwrap_or_else(|| mpsc::channel(1).1);
        info!(
            schedules = self.schedules.len(),
            dir = %self.config.schedules_dir.display(),
            leader_timeout_ms = self.config.leader_timeout.as_millis() as u64,
            "scheduler started"
        );
        let mut standing_by = false;
        let mut retry = Retry::new(self.config.standby_retry, Duration::from_secs(30));
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let pause = match Leadership::try_acquire(&self.options, self.config.leader_timeout)
                .await
            {
                Ok(Some(mut leadership)) => {
                    standing_by = false;
                    retry.succeeded();
                    self.gained(&leadership);
                    let mut awake_since = None;
                    let mut fresh = HashSet::new();
                    let ended = loop {
                        let led = self.lead(
                            &mut leadership,
                            &mut awake_since,
                            &mut fresh,
                            &shutdown,
                            &mut reload,
                        );
                        match led.await {
                            Ended::Reload => fresh = self.reload(),
                            other => break other,
                        }
                    };
                    if let Ended::Shutdown = ended {
                        self.leading.store(false, Ordering::SeqCst);
                        self.metrics.record_leadership(false);
                        leadership.release().await;
                        info!("scheduler leader stepped down at shutdown");
                        return Ok(());
                    }
                    // The connection is dropped here: nothing more goes through it.
                    drop(leadership);
                    self.config.standby_retry
                }
                Ok(None) => {
                    retry.succeeded();
                    if !standing_by {
                        info!("another scheduler leads; standing by");
                        standing_by = true;
                    }
                    self.config.standby_retry
                }
                Err(err) => {
                    let pause = retry.failed();
                    warn!(%err, retry_in_ms = pause.as_millis() as u64, "cannot reach PostgreSQL for leadership");
                    pause
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                Some(()) = reload.recv() => {
                    self.reload();
                }
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leader_sleeps_until_the_next_run_and_never_spins_with_nothing_to_do() {
        let now = Utc::now();
        let beat = Duration::from_secs(3);
        assert_eq!(
            pause(None, now, beat),
            beat,
            "nothing enabled: no busy loop"
        );
        assert_eq!(
            pause(Some(now + chrono::Duration::milliseconds(700)), now, beat),
            Duration::from_millis(700)
        );
        assert_eq!(
            pause(Some(now + chrono::Duration::hours(1)), now, beat),
            beat
        );
        assert_eq!(
            pause(Some(now - chrono::Duration::seconds(5)), now, beat),
            Duration::ZERO
        );
    }

    #[test]
    fn the_lock_session_speaks_often_enough_for_its_timeout() {
        let config = SchedulerConfig {
            leader_timeout: Duration::from_secs(6),
            ..SchedulerConfig::default()
        };
        assert_eq!(config.heartbeat(), Duration::from_secs(2));
        assert!(SchedulerConfig {
            leader_timeout: Duration::from_millis(500),
            ..config
        }
        .validated()
        .is_err());
    }
}
