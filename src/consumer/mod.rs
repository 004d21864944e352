//! Broker consumers: take messages from Kafka or RabbitMQ and execute their
//! jobs through the same fence, and the same executor, as a worker.
//!
//! For each message the consumer reads the job id from the `almanac-job-id`
//! header and claims the job row by id (`status = 'ready'`, due, a `dual` or
//! `broker` route, a kind it handles). If the claim succeeds the job runs in
//! the worker's [`crate::worker::executor`]: slots, one heartbeat loop for all
//! jobs in hand, the local lease deadline, outcomes retried through database
//! blips. Then, and only then, the consumer acks the message (RabbitMQ) or
//! commits its offset (Kafka). A message whose job is already claimed,
//! finished, or not yet due is acked and skipped: in `dual` mode a worker may
//! have run it first, and a second copy of a message (the relay published
//! again after a crash) finds the job done. If the database is unreachable
//! the message is neither acked nor committed; the consumer retries it.
//!
//! **Shutdown** (SIGTERM, or the token) is a worker's: stop taking messages,
//! let running jobs finish within `shutdown_deadline`, then cancel them and
//! release their jobs (`ready` again, or `dead` with their attempts used up;
//! the release writes a fresh outbox row, so the message in hand is acked).
//! Nothing waits for a lease to expire.
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

use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::broker::{SinkConfig, SinkError, SinkKind};
use crate::metrics::Metrics;
use crate::queue::{self, QueueError};
use crate::retry::Retry;
use crate::role::{Role, RoleName, Valid};
use crate::worker::{Executed, Executor, Handler, WorkerConfig, WorkerReport};

/// The header carrying the job id.
pub const JOB_ID_HEADER: &str = "almanac-job-id";

#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    pub sink: SinkKind,
    pub destination: String,
    /// Kafka consumer group [default: `almanac-<destination>`].
    pub group: Option<String>,
    /// Lease, backoff and (RabbitMQ) concurrency; the same settings as a worker.
    pub worker: Valid<WorkerConfig>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("a consumer needs at least one handler; register one before run")]
    NoHandlers,
}

/// What a consumer did before it stopped.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerReport {
    /// Messages whose job this consumer claimed and ran.
    pub executed: u64,
    /// Messages acked without running: the job was claimed elsewhere, done, or not due.
    pub skipped: u64,
    /// How the executed jobs ended.
    pub jobs: WorkerReport,
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
    /// Message counts; `jobs` is filled in by [`Consumer::run`]'s final report.
    pub fn report(&self) -> ConsumerReport {
        ConsumerReport {
            executed: self.0.executed.load(Ordering::Relaxed),
            skipped: self.0.skipped.load(Ordering::Relaxed),
            jobs: WorkerReport::default(),
        }
    }
}

pub struct Consumer {
    pool: PgPool,
    sinks: SinkConfig,
    config: ConsumerConfig,
    handlers: HashMap<String, Arc<dyn Handler>>,
    counters: Arc<Counters>,
    metrics: Metrics,
}

/// Why a message's job could not be claimed; the message is not acked.
#[derive(Debug, thiserror::Error)]
enum ClaimError {
    #[error(transparent)]
    Db(#[from] QueueError),
    #[error("no answer from the database within {0:?}")]
    TimedOut(std::time::Duration),
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
            metrics: Metrics::new(),
        }
    }

    /// Counts into `metrics` (by default, a registry of its own).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
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

    /// Claims the message's job through the fence and runs it in the
    /// executor. An `Err` is a database failure: the message must not be
    /// acked. `Ok(None)`: the job was in hand when the executor stopped and
    /// its outcome is unknown; do not ack, the message comes again.
    async fn handle(
        &self,
        executor: &Executor,
        job_id: Option<i64>,
    ) -> Result<Option<Handled>, ClaimError> {
        let Some(id) = job_id else {
            warn!("message without a valid {JOB_ID_HEADER} header; skipping it");
            self.counters.skipped.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(Handled::Skipped));
        };
        let slot = executor.slot().await;
        let sent = Instant::now();
        // A claim that gets no answer is abandoned (and the message not
        // acked): should it have committed, its lease expires and the reaper
        // makes the job ready again, with a fresh message.
        let within = self.config.worker.lease / 3;
        let kinds = self.kinds();
        let claim = queue::claim_by_id(&self.pool, id, &kinds, self.config.worker.lease);
        let claimed = tokio::time::timeout(within, claim)
            .await
            .map_err(|_| ClaimError::TimedOut(within))??;
        let Some(job) = claimed else {
            self.counters.skipped.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(Handled::Skipped));
        };
        let handler = self.handlers[&job.kind].clone();
        self.counters.executed.fetch_add(1, Ordering::Relaxed);
        let executed = match executor.spawn(job, sent, handler, slot) {
            Ok(outcome) => match outcome.await {
                Ok(executed) => executed,
                Err(_) => return Ok(None),
            },
            Err(job) => executor.release_unstarted(job).await,
        };
        Ok(Some(Handled::Executed(executed)))
    }

    /// Handles a message until it is handled or shutdown comes; `None` on
    /// shutdown or when the outcome is unknown (do not ack).
    async fn handle_until_done(
        &self,
        executor: &Executor,
        job_id: Option<i64>,
        shutdown: &CancellationToken,
    ) -> Option<Handled> {
        let mut retry = Retry::new(
            std::time::Duration::from_millis(200),
            std::time::Duration::from_secs(10),
        );
        loop {
            match self.handle(executor, job_id).await {
                Ok(handled) => return handled,
                Err(err) => {
                    warn!(%err, job_id, "cannot handle the message; retrying it (not acked)");
                    if !retry.pause(shutdown).await {
                        return None;
                    }
                }
            }
        }
    }
}

impl Role for Consumer {
    const NAME: RoleName = RoleName::Consumer;
    type Output = ConsumerReport;
    type Error = ConsumerError;

    /// Consumes until `shutdown`, then drains and releases as the module doc says.
    async fn run(self, shutdown: CancellationToken) -> Result<ConsumerReport, ConsumerError> {
        if self.handlers.is_empty() {
            return Err(ConsumerError::NoHandlers);
        }
        let this = Arc::new(self);
        let executor = Executor::start(
            this.pool.clone(),
            this.config.worker.clone(),
            this.metrics.clone(),
        );
        // The broker loop stops taking messages on `stop`, then waits for the
        // jobs in hand; the executor's shutdown ends those within the deadline.
        let stop = shutdown.child_token();
        let consume = async {
            let result = match this.config.sink {
                SinkKind::Kafka => kafka::run(this.clone(), executor.clone(), stop.clone()).await,
                SinkKind::Rabbitmq => {
                    rabbitmq::run(this.clone(), executor.clone(), stop.clone()).await
                }
            };
            stop.cancel();
            result
        };
        let drain = async {
            stop.cancelled().await;
            executor.shutdown().await
        };
        let (result, jobs) = tokio::join!(consume, drain);
        result?;
        Ok(ConsumerReport {
            jobs,
            ..Progress(this.counters.clone()).report()
        })
    }
}
