//! The reaper: returns jobs whose lease expired to `ready`, or to `dead` when
//! their attempts are used up; and releases the ordering keys whose head
//! ended while the key was busy ([`crate::queue::ordering`]); and folds the
//! job counters ([`crate::queue::counts`]).
//!
//! A lease expires when its worker died, hung, or lost the database for longer
//! than the lease. Each sweep takes at most `batch_size` rows per statement
//! with SKIP LOCKED, so several reapers share the work and none holds locks for
//! long; a sweep repeats batches until one comes back short. Sweeps never
//! overlap: a slow sweep delays the next tick instead of stacking up.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::metrics::Metrics;
use crate::queue::{self, QueueError, ReapReport};
use crate::role::{InvalidSetting, Period, Periodic, RoleName, Settings, Valid};

#[derive(Debug, Clone)]
pub struct ReaperConfig {
    /// How often a sweep starts.
    pub interval: Duration,
    /// Most expired leases per statement.
    pub batch_size: i64,
}

impl Settings for ReaperConfig {
    fn check(&self) -> Result<(), InvalidSetting> {
        InvalidSetting::positive("[reaper] interval", self.interval)?;
        InvalidSetting::at_least("[reaper] batch_size", self.batch_size, 1)
    }
}

impl Default for ReaperConfig {
    fn default() -> Self {
        ReaperConfig {
            interval: Duration::from_secs(5),
            batch_size: 500,
        }
    }
}

pub struct Reaper {
    pool: PgPool,
    config: Valid<ReaperConfig>,
    metrics: Metrics,
    /// Where the walk of keys with held jobs goes on at the next sweep.
    held_cursor: std::sync::Mutex<queue::ordering::SweepCursor>,
}

impl Reaper {
    pub fn new(pool: PgPool, config: Valid<ReaperConfig>) -> Self {
        Reaper {
            pool,
            config,
            metrics: Metrics::new(),
            held_cursor: std::sync::Mutex::new(None),
        }
    }

    /// Counts into `metrics` (by default, a registry of its own).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }
}

impl Periodic for Reaper {
    const NAME: RoleName = RoleName::Reaper;
    type Report = ReapReport;
    type Error = QueueError;

    fn period(&self) -> Period {
        Period::new(self.config.interval).expect("checked by ReaperConfig")
    }

    /// One sweep: batches until a batch comes back short (or `shutdown`).
    async fn run_once(&self, shutdown: &CancellationToken) -> Result<ReapReport, QueueError> {
        let mut total = ReapReport::default();
        loop {
            let batch = queue::reap_expired(&self.pool, self.config.batch_size).await?;
            total.requeued += batch.requeued;
            total.buried += batch.buried;
            total.cancelled += batch.cancelled;
            let reaped = batch.requeued + batch.buried + batch.cancelled;
            self.metrics.record_reaped(reaped);
            if (reaped as i64) < self.config.batch_size || shutdown.is_cancelled() {
                break;
            }
        }
        // Ordering keys whose head ended while the key was busy, then a
        // slice of the walk over every key with held jobs (the safety net).
        loop {
            let released = queue::ordering::recheck(&self.pool, self.config.batch_size).await?;
            total.released += released;
            if (released as i64) < self.config.batch_size || shutdown.is_cancelled() {
                break;
            }
        }
        let cursor = self.held_cursor.lock().expect("not poisoned").clone();
        let (next, released) =
            queue::ordering::sweep(&self.pool, &cursor, self.config.batch_size).await?;
        total.released += released;
        *self.held_cursor.lock().expect("not poisoned") = next;
        // The counters' rows, summed: what keeps `stats` and the dashboard
        // a read of tens of rows (`queue::counts`). A fold that fails takes
        // nothing from the sweep: the next one folds.
        let folded = match self.pool.acquire().await {
            Ok(mut conn) => queue::counts::fold(&mut conn, false).await,
            Err(err) => Err(err),
        };
        if let Err(err) = folded {
            tracing::warn!(%err, "folding the counters failed; the next sweep tries again");
        }
        Ok(total)
    }

    fn log(&self, r: &ReapReport) {
        if r.requeued + r.buried + r.cancelled > 0 {
            info!(
                requeued = r.requeued,
                buried = r.buried,
                cancelled = r.cancelled,
                "reaped expired leases"
            );
        }
        if r.released > 0 {
            info!(released = r.released, "released held jobs of ordering keys");
        }
    }
}
