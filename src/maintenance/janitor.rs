//! The janitor: deletes `done` jobs, `dead` and `cancelled` jobs (both kept
//! for `dead_retention`) and the records of
//! published outbox rows (published batches, and rows published row by
//! row by pre-release builds) past their retention, so the tables stop growing forever.
//!
//! It deletes in batches of `batch_size` rows (oldest first, SKIP LOCKED, one
//! short transaction each) with `pause` between batches, so it never holds
//! many row locks at once nor writes a burst of WAL that replicas and
//! autovacuum must swallow in one go. A pass deletes what was past
//! retention when it started, so it ends however fast jobs finish (and
//! reaches dead and cancelled jobs and the outbox records after done jobs).
//! When it is behind (the jobs a batch deleted had been past their
//! retention for longer than one `interval`), the pause after a batch is
//! cut to the time the batch took: at most half of the janitor's time goes
//! to deleting, and a queue that finishes more jobs a second than
//! `batch_size` per `pause` (10,000 by default) does not outgrow its
//! retention for good (`almanac bench --retention-only` measures it).
//! Several janitors may run; they skip each other's rows. It never deletes
//! ledger rows (`schedule_runs`): a deleted job leaves its logical run
//! recorded, so the run is never emitted again.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::metrics::Metrics;
use crate::queue::{self, JobStatus, QueueError};
use crate::relay::outbox;
use crate::role::{InvalidSetting, Period, Periodic, RoleName, Settings, Valid};

#[derive(Debug, Clone)]
pub struct JanitorConfig {
    /// How often a pass starts.
    pub interval: Duration,
    /// `done` jobs finished longer ago than this are deleted.
    pub done_retention: Duration,
    /// `dead` and `cancelled` jobs finished longer ago than this are deleted.
    pub dead_retention: Duration,
    /// Outbox rows published longer ago than this are deleted.
    pub outbox_retention: Duration,
    /// Rows per delete statement.
    pub batch_size: i64,
    /// Pause between two batches.
    pub pause: Duration,
}

impl Default for JanitorConfig {
    fn default() -> Self {
        JanitorConfig {
            // Half a minute: a job is gone within about a minute of
            // coming due (the wait for the next pass, then the pass).
            interval: Duration::from_secs(30),
            done_retention: Duration::from_secs(7 * 86_400),
            dead_retention: Duration::from_secs(30 * 86_400),
            outbox_retention: Duration::from_secs(86_400),
            batch_size: 1000,
            pause: Duration::from_millis(100),
        }
    }
}

impl Settings for JanitorConfig {
    fn check(&self) -> Result<(), InvalidSetting> {
        InvalidSetting::positive("[janitor] interval", self.interval)?;
        InvalidSetting::positive("[janitor] done_retention", self.done_retention)?;
        InvalidSetting::positive("[janitor] dead_retention", self.dead_retention)?;
        InvalidSetting::positive("[janitor] outbox_retention", self.outbox_retention)?;
        InvalidSetting::at_least("[janitor] batch_size", self.batch_size, 1)
    }
}

/// What one pass deleted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct JanitorReport {
    pub done: u64,
    pub dead: u64,
    pub cancelled: u64,
    pub outbox: u64,
    /// Delete statements run.
    pub batches: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum JanitorError {
    #[error("the janitor could not delete old rows: {0}")]
    Queue(#[from] QueueError),
    #[error("the janitor could not delete old outbox rows: {0}")]
    Outbox(#[from] sqlx::Error),
}

pub struct Janitor {
    pool: PgPool,
    config: Valid<JanitorConfig>,
    metrics: Metrics,
}

#[derive(Clone, Copy)]
enum Target {
    Jobs(JobStatus, &'static str),
    Outbox,
}

impl Janitor {
    pub fn new(pool: PgPool, config: Valid<JanitorConfig>) -> Self {
        Janitor {
            pool,
            config,
            metrics: Metrics::new(),
        }
    }

    /// Counts into `metrics` (by default, a registry of its own).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// One batch: the rows deleted, and whether the janitor is behind
    /// (see the module doc).
    async fn delete_batch(
        &self,
        target: Target,
        pass_started: DateTime<Utc>,
    ) -> Result<(u64, bool), JanitorError> {
        let limit = self.config.batch_size;
        let (what, deleted, behind) = match target {
            Target::Jobs(status, what) => {
                let retention = match status {
                    JobStatus::Done => self.config.done_retention,
                    _ => self.config.dead_retention,
                };
                let d = queue::delete_finished(
                    &self.pool,
                    status,
                    retention,
                    Some(pass_started),
                    limit,
                )
                .await?;
                let behind = d.behind.is_some_and(|b| b > self.config.interval);
                (what, d.rows, behind)
            }
            Target::Outbox => {
                let n = outbox::delete_published(&self.pool, self.config.outbox_retention, limit)
                    .await?;
                ("outbox", n, false)
            }
        };
        self.metrics.record_janitor_deleted(what, deleted);
        Ok((deleted, behind))
    }
}

impl Periodic for Janitor {
    const NAME: RoleName = RoleName::Janitor;
    type Report = JanitorReport;
    type Error = JanitorError;

    fn period(&self) -> Period {
        Period::new(self.config.interval).expect("checked by JanitorConfig")
    }

    /// One pass over done jobs, dead jobs and published outbox rows, each in
    /// batches until a batch comes back short. Stops early (with what it did
    /// so far) when `shutdown` is cancelled.
    async fn run_once(&self, shutdown: &CancellationToken) -> Result<JanitorReport, JanitorError> {
        let mut report = JanitorReport::default();
        let pass_started: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.pool)
            .await
            .map_err(QueueError::from)?;
        for target in [
            Target::Jobs(JobStatus::Done, "done"),
            Target::Jobs(JobStatus::Dead, "dead"),
            Target::Jobs(JobStatus::Cancelled, "cancelled"),
            Target::Outbox,
        ] {
            loop {
                if shutdown.is_cancelled() {
                    return Ok(report);
                }
                let started = std::time::Instant::now();
                let (deleted, behind) = self.delete_batch(target, pass_started).await?;
                report.batches += 1;
                match target {
                    Target::Jobs(JobStatus::Done, _) => report.done += deleted,
                    Target::Jobs(JobStatus::Cancelled, _) => report.cancelled += deleted,
                    Target::Jobs(_, _) => report.dead += deleted,
                    Target::Outbox => report.outbox += deleted,
                }
                if (deleted as i64) < self.config.batch_size {
                    break;
                }
                let pause = if behind {
                    self.config.pause.min(started.elapsed())
                } else {
                    self.config.pause
                };
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(report),
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
        Ok(report)
    }

    fn log(&self, r: &JanitorReport) {
        if r.done + r.dead + r.cancelled + r.outbox > 0 {
            info!(
                done = r.done,
                dead = r.dead,
                cancelled = r.cancelled,
                outbox = r.outbox,
                "janitor deleted rows past retention"
            );
        }
    }
}
