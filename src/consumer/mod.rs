//! Broker consumers: take messages from Kafka or RabbitMQ and execute their
//! jobs through the same fence as a worker.
//!
//! For each message the consumer reads the job id from the `almanac-job-id`
//! header and claims the job row by id (`status = 'ready'`, due, a `dual` or
//! `broker` route, a kind it handles). If the claim succeeds it runs the
//! handler under a heartbeated lease and records the outcome; then, and only
//! then, it acks the message (RabbitMQ) or commits its offset (Kafka). A
//! message whose job is already claimed, finished, or not yet due is acked
//! and skipped: in `dual` mode a worker may have run it first, and a second
//! copy of a message (the relay published again after a crash) finds the job
//! done. If the database is unreachable the message is neither acked nor
//! committed; the consumer retries it.
//!
//! Kafka messages are handled one at a time per consumer (commit order is
//! offset order); scale out with partitions and more consumers. A handler
//! that runs longer than Kafka's `max.poll.interval.ms` (5 minutes) makes the
//! group rebalance and the message is delivered again; the fence turns that
//! copy into a skip. RabbitMQ deliveries are handled up to `concurrency` at
//! once (the prefetch).

mod kafka;
mod rabbitmq;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::broker::{SinkConfig, SinkError, SinkKind};
use crate::queue::{self, QueueError};
use crate::worker::{execute_claimed, Executed, Handler, WorkerConfig};

/// The header carrying the job id.
pub const JOB_ID_HEADER: &str = "almanac-job-id";

#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    pub sink: SinkKind,
    pub destination: String,
    /// Kafka consumer group [default: `almanac-<destination>`].
    pub group: Option<String>,
    /// Lease, backoff and (RabbitMQ) concurrency; the same settings as a worker.
    pub worker: WorkerConfig,
}

#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("no handlers registered")]
    NoHandlers,
}

/// What a consumer did before it stopped.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerReport {
    /// Messages whose job this consumer claimed and ran.
    pub executed: u64,
    /// Messages acked without running: the job was claimed elsewhere, done, or not due.
    pub skipped: u64,
}

#[derive(Default)]
struct Counters {
    executed: AtomicU64,
    skipped: AtomicU64,
}

/// A live view of a running consumer's counts.
#[derive(Clone)]
pub struct Progress(Arc<Counters>);

impl Progress {
    pub fn report(&self) -> ConsumerReport {
        ConsumerReport {
            executed: self.0.executed.load(Ordering::Relaxed),
            skipped: self.0.skipped.load(Ordering::Relaxed),
        }
    }
}

pub struct Consumer {
    pool: PgPool,
    sinks: SinkConfig,
    config: ConsumerConfig,
    handlers: HashMap<String, Arc<dyn Handler>>,
    counters: Arc<Counters>,
}

/// What became of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    Executed(Executed),
    Skipped,
}

impl Consumer {
    pub fn new(pool: PgPool, sinks: SinkConfig, config: ConsumerConfig) -> Self {
        Consumer {
            pool,
            sinks,
            config,
            handlers: HashMap::new(),
            counters: Arc::default(),
        }
    }

    pub fn register(mut self, kind: impl Into<String>, handler: impl Handler) -> Self {
        self.handlers.insert(kind.into(), Arc::new(handler));
        self
    }

    /// Counts that keep updating while [`Consumer::run`] runs.
    pub fn progress(&self) -> Progress {
        Progress(self.counters.clone())
    }

    fn kinds(&self) -> Vec<String> {
        self.handlers.keys().cloned().collect()
    }

    /// Claims the message's job through the fence and runs it. An `Err` is a
    /// database failure: the message must not be acked.
    pub async fn handle(&self, job_id: Option<i64>) -> Result<Handled, QueueError> {
        let Some(id) = job_id else {
            warn!("message without a valid {JOB_ID_HEADER} header; skipping it");
            self.counters.skipped.fetch_add(1, Ordering::Relaxed);
            return Ok(Handled::Skipped);
        };
        let claimed =
            queue::claim_by_id(&self.pool, id, &self.kinds(), self.config.worker.lease).await?;
        let Some(job) = claimed else {
            self.counters.skipped.fetch_add(1, Ordering::Relaxed);
            return Ok(Handled::Skipped);
        };
        let handler = self.handlers[&job.kind].clone();
        let executed =
            execute_claimed(&self.pool, &self.config.worker, handler.as_ref(), job).await?;
        self.counters.executed.fetch_add(1, Ordering::Relaxed);
        Ok(Handled::Executed(executed))
    }

    /// Handles a message until it is handled or shutdown comes; `None` on shutdown.
    async fn handle_until_done(
        &self,
        job_id: Option<i64>,
        shutdown: &CancellationToken,
    ) -> Option<Handled> {
        let mut pause = Duration::from_millis(200);
        loop {
            match self.handle(job_id).await {
                Ok(handled) => return Some(handled),
                Err(err) => {
                    warn!(%err, job_id, "cannot handle the message; retrying it (not acked)");
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        _ = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(Duration::from_secs(10));
                }
            }
        }
    }

    pub async fn run(self, shutdown: CancellationToken) -> Result<ConsumerReport, ConsumerError> {
        if self.handlers.is_empty() {
            return Err(ConsumerError::NoHandlers);
        }
        let this = Arc::new(self);
        match this.config.sink {
            SinkKind::Kafka => kafka::run(this.clone(), shutdown).await?,
            SinkKind::Rabbitmq => rabbitmq::run(this.clone(), shutdown).await?,
        }
        Ok(Progress(this.counters.clone()).report())
    }
}
