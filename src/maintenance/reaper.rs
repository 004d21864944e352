//! The reaper: returns jobs whose lease expired to `ready`, or to `dead` when
//! their attempts are used up.
//!
//! A lease expires when its worker died, hung, or lost the database for longer
//! than the lease. Each sweep takes at most `batch_size` rows per statement
//! with SKIP LOCKED, so several reapers share the work and none holds locks for
//! long; a sweep repeats batches until one comes back short. Sweeps never
//! overlap: a slow sweep delays the next tick instead of stacking up.

use std::time::Duration;

use sqlx::PgPool;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::queue::{self, QueueError, ReapReport};

#[derive(Debug, Clone)]
pub struct ReaperConfig {
    pub interval: Duration,
    pub batch_size: i64,
}

impl ReaperConfig {
    pub fn validate(&self) -> Result<(), String> {
        crate::config::positive("--reaper-interval ([reaper] interval)", self.interval)?;
        if self.batch_size < 1 {
            return Err(format!(
                "--reaper-batch-size ([reaper] batch_size) must be at least 1, got {}",
                self.batch_size
            ));
        }
        Ok(())
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
    config: ReaperConfig,
}

impl Reaper {
    pub fn new(pool: PgPool, config: ReaperConfig) -> Self {
        Reaper { pool, config }
    }

    /// One sweep: batches until a batch comes back short.
    pub async fn run_once(&self) -> Result<ReapReport, QueueError> {
        let mut total = ReapReport::default();
        loop {
            let batch = queue::reap_expired(&self.pool, self.config.batch_size).await?;
            total.requeued += batch.requeued;
            total.buried += batch.buried;
            crate::metrics::record_reaped(batch.requeued + batch.buried);
            if ((batch.requeued + batch.buried) as i64) < self.config.batch_size {
                return Ok(total);
            }
        }
    }

    pub async fn run(self, shutdown: CancellationToken) -> Result<(), QueueError> {
        let mut tick = tokio::time::interval(self.config.interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => {}
            }
            match self.run_once().await {
                Ok(r) if r.requeued + r.buried > 0 => {
                    info!(
                        requeued = r.requeued,
                        buried = r.buried,
                        "reaped expired leases"
                    )
                }
                Ok(_) => {}
                Err(err) => warn!(%err, "reaper sweep failed; next sweep retries"),
            }
        }
    }
}
