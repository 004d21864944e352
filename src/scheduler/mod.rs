//! The scheduler: schedules from TOML files become exactly one job per
//! logical run.
//!
//! - [`cron`] parses expressions with crontab(5) meanings; [`timeline`] turns
//!   them into real instants and logical runs under the project's DST rules.
//! - [`spec`] loads and validates the schedule files, all or nothing.
//! - [`plan`] decides, for an injected `now`, which runs are on time, which
//!   were missed, and what the catch-up policy does with them.
//! - [`ledger`] records runs and emits their jobs in one transaction keyed by
//!   logical run: the guarantee that no run is emitted twice lives there.
//! - [`leader`] is the advisory-lock leadership; [`ticker`] is the leader's
//!   in-memory tick; [`backfill`] is the operator's backfill and gaps.
//!
//! [`Scheduler::run`] ties them together: stand by until the lock is won;
//! then sync the definitions, catch up, and sleep until the next fire time
//! (at most `max_sleep`, so leadership and reloads are re-checked), emitting
//! each run when it comes due. SIGHUP (a message on the reload channel)
//! reloads the files; a bad file keeps the old set and logs why.

pub mod backfill;
pub mod cron;
pub mod leader;
pub mod ledger;
pub mod plan;
pub mod spec;
pub mod ticker;
pub mod timeline;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sqlx::postgres::PgConnectOptions;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use leader::Leadership;
use spec::Schedule;
use ticker::Ticker;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub schedules_dir: PathBuf,
    /// How often a standby tries the lock.
    pub standby_retry: Duration,
    /// The longest the leader sleeps between checks.
    pub max_sleep: Duration,
    /// A run this late or less is on time; later, it was missed.
    pub grace: Duration,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            schedules_dir: PathBuf::from("schedules"),
            standby_retry: Duration::from_secs(2),
            max_sleep: Duration::from_secs(5),
            grace: Duration::from_secs(60),
        }
    }
}

pub struct Scheduler {
    options: PgConnectOptions,
    config: SchedulerConfig,
    schedules: Vec<Schedule>,
    leading: Arc<AtomicBool>,
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
        config: SchedulerConfig,
    ) -> Result<Self, spec::LoadError> {
        let schedules = spec::load_dir(&config.schedules_dir)?;
        Ok(Scheduler {
            options,
            config,
            schedules,
            leading: Arc::new(AtomicBool::new(false)),
        })
    }

    /// True while this instance is the leader (for metrics and health).
    pub fn leading(&self) -> Arc<AtomicBool> {
        self.leading.clone()
    }

    fn reload(&mut self) {
        match spec::load_dir(&self.config.schedules_dir) {
            Ok(schedules) => {
                info!(schedules = schedules.len(), "schedules reloaded");
                self.schedules = schedules;
            }
            Err(err) => error!("schedule reload rejected; keeping the previous set:\n{err}"),
        }
    }

    pub async fn run(mut self, shutdown: CancellationToken, mut reload: mpsc::Receiver<()>) {
        info!(schedules = self.schedules.len(), dir = %self.config.schedules_dir.display(), "scheduler started");
        let mut standing_by = false;
        let mut pause = self.config.standby_retry;
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            match Leadership::try_acquire(&self.options).await {
                Ok(Some(mut leadership)) => {
                    standing_by = false;
                    pause = self.config.standby_retry;
                    info!("became scheduler leader");
                    self.leading.store(true, Ordering::SeqCst);
                    crate::metrics::record_leadership(true);
                    let ended = loop {
                        match self.lead(&mut leadership, &shutdown, &mut reload).await {
                            Ended::Reload => self.reload(),
                            other => break other,
                        }
                    };
                    self.leading.store(false, Ordering::SeqCst);
                    crate::metrics::record_leadership(false);
                    match ended {
                        Ended::Shutdown => {
                            leadership.release().await;
                            info!("scheduler leader stepped down at shutdown");
                            return;
                        }
                        _ => warn!("scheduler leadership lost; standing by"),
                    }
                    drop(leadership);
                }
                Ok(None) => {
                    if !standing_by {
                        info!("another scheduler leads; standing by");
                        standing_by = true;
                    }
                }
                Err(err) => {
                    warn!(%err, retry_in_ms = pause.as_millis() as u64, "cannot reach PostgreSQL for leadership");
                    pause = (pause * 2).min(Duration::from_secs(30));
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                Some(()) = reload.recv() => self.reload(),
                _ = tokio::time::sleep(if standing_by { self.config.standby_retry } else { pause }) => {}
            }
        }
    }

    /// Leads until shutdown, a reload, or the loss of the lock.
    async fn lead(
        &self,
        leadership: &mut Leadership,
        shutdown: &CancellationToken,
        reload: &mut mpsc::Receiver<()>,
    ) -> Ended {
        let mut ticker = match Ticker::load(
            leadership.conn(),
            self.schedules.clone(),
            self.config.grace,
        )
        .await
        {
            Ok(ticker) => ticker,
            Err(err) => {
                warn!(%err, "syncing schedules failed");
                return Ended::Lost;
            }
        };
        loop {
            if let Err(err) = leadership.check().await {
                error!(%err, "stopping emission");
                return Ended::Lost;
            }
            match ticker.tick(leadership.conn(), Utc::now()).await {
                Ok(r) if r.emitted + r.skipped_catchup + r.skipped_overlap > 0 => info!(
                    emitted = r.emitted,
                    skipped_catchup = r.skipped_catchup,
                    skipped_overlap = r.skipped_overlap,
                    "scheduler tick"
                ),
                Ok(_) => {}
                Err(err) => {
                    warn!(%err, "scheduler tick failed");
                    return Ended::Lost;
                }
            }
            let sleep = ticker
                .next_wake()
                .and_then(|next| (next - Utc::now()).to_std().ok())
                .unwrap_or(Duration::ZERO)
                .min(self.config.max_sleep);
            tokio::select! {
                _ = shutdown.cancelled() => return Ended::Shutdown,
                Some(()) = reload.recv() => return Ended::Reload,
                _ = tokio::time::sleep(sleep) => {}
            }
        }
    }
}
