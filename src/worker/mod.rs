//! The worker runtime: claims jobs for its registered kinds and hands them
//! to the [`executor`], which runs their handlers under heartbeated leases,
//! records each outcome through the fence, and drains at shutdown. Broker
//! consumers use the same executor.
//!
//! - **Slots, not batches.** At most `concurrency` handlers run at once; a
//!   claim asks for `min(free slots, batch_size)` jobs (and, while claims come
//!   back full, waits for half a batch of free slots), so a worker never holds
//!   a lease it has no slot for.
//! - **Wake-ups.** Enqueue and retry `NOTIFY`; the worker `LISTEN`s and claims
//!   at once. Polling every `poll_interval` is the safety net for lost
//!   notifications and for jobs whose `run_at` arrives.
//! - **Leases, outcomes, shutdown:** see [`executor`]. A failure goes through
//!   [`crate::queue::fail`] with the handler's delay or the configured
//!   [`Backoff`]; a panicking handler counts as a retryable failure.
//! - **Limit.** A crash (the process or runtime gone) records nothing: the
//!   leases expire and the reaper returns the jobs. Handlers must therefore be
//!   idempotent; [`JobContext::idempotency_key`] is the key to pass on.

pub mod exec;
pub mod executor;
mod runner;
pub mod watchdog;

use std::collections::HashMap;
use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use uuid::Uuid;

use crate::metrics::Metrics;
use crate::queue::{Backoff, Failure, Job};
use crate::role::{InvalidSetting, Role, RoleName, Settings, Valid};

pub(crate) use executor::Executor;
pub use executor::{lease_margin, Executed, WorkerReport};

pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;
pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send>>;

/// How an attempt failed.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Try again: after `after` if given, else after the worker's backoff.
    #[error("{source}")]
    Retry {
        #[source]
        source: BoxError,
        after: Option<Duration>,
    },
    /// Do not try again; the job goes to `dead` now.
    #[error("{source}")]
    Permanent {
        #[source]
        source: BoxError,
    },
    /// Not now: put the job back, due `after` from now, without using an
    /// attempt (the claim's is given back; [`crate::queue::snooze`]). It is
    /// `cancelled` instead if an operator asked for that meanwhile.
    #[error("snoozed for {after:?}")]
    Snooze { after: Duration },
}

impl HandlerError {
    pub fn retry(source: impl Into<BoxError>) -> Self {
        HandlerError::Retry {
            source: source.into(),
            after: None,
        }
    }

    pub fn retry_after(source: impl Into<BoxError>, after: Duration) -> Self {
        HandlerError::Retry {
            source: source.into(),
            after: Some(after),
        }
    }

    pub fn permanent(source: impl Into<BoxError>) -> Self {
        HandlerError::Permanent {
            source: source.into(),
        }
    }

    /// Put the job back for `after` without using an attempt.
    pub fn snooze(after: Duration) -> Self {
        HandlerError::Snooze { after }
    }

    /// The whole source chain, `outer: inner: root`, as stored in `last_error`.
    pub fn chain(&self) -> String {
        let (HandlerError::Retry { source, .. } | HandlerError::Permanent { source }) = self else {
            return self.to_string();
        };
        let mut text = source.to_string();
        let mut next = source.source();
        while let Some(err) = next {
            text.push_str(": ");
            text.push_str(&err.to_string());
            next = err.source();
        }
        text
    }
}

/// What a handler gets: the claimed job, a signal for when to stop, and
/// the lease it runs under (token and local deadline) to fence its own
/// writes with.
#[derive(Debug, Clone)]
pub struct JobContext {
    pub job: Job,
    cancel: CancellationToken,
    requested: Arc<AtomicBool>,
    deadlines: watch::Receiver<Instant>,
    margin: Duration,
    /// The execution span's context, when tracing is on.
    trace: Option<crate::telemetry::TraceContext>,
}

/// How far off a deadline that is not known is put: never, in practice.
const NO_DEADLINE: Duration = Duration::from_secs(60 * 60 * 24 * 365 * 30);

impl JobContext {
    /// A context with no known lease deadline (see [`JobContext::with_deadline`]).
    pub fn new(job: Job, cancel: CancellationToken) -> Self {
        let (_, deadlines) = watch::channel(Instant::now() + NO_DEADLINE);
        JobContext {
            job,
            cancel,
            requested: Arc::default(),
            deadlines,
            margin: Duration::ZERO,
            trace: None,
        }
    }

    /// The local lease deadline, as the [`executor`] moves it with each
    /// renewal, and the lease margin it was computed with.
    pub fn with_deadline(mut self, deadlines: watch::Receiver<Instant>, margin: Duration) -> Self {
        self.deadlines = deadlines;
        self.margin = margin;
        self
    }

    /// The lease token of this attempt: a write fenced on it (`WHERE
    /// lease_token = $token` joined with the job row, in the same database)
    /// cannot land after the lease was lost.
    pub fn lease_token(&self) -> Option<Uuid> {
        self.job.lease_token
    }

    /// The local lease deadline now: the handler is cancelled at this
    /// instant unless a renewal moves it (see [`executor`]), a lease margin
    /// before the lease can expire on the database's clock.
    pub fn deadline(&self) -> Instant {
        *self.deadlines.borrow()
    }

    /// Every move of [`JobContext::deadline`]: `changed()` resolves when a
    /// renewal extends it, and fails once the job's flight is over.
    pub fn deadlines(&self) -> watch::Receiver<Instant> {
        self.deadlines.clone()
    }

    /// How long before the lease can expire its local deadline falls
    /// ([`lease_margin`]); zero when no deadline is known.
    pub fn lease_margin(&self) -> Duration {
        self.margin
    }

    /// The flag [`JobContext::cancel_requested`] reads, set by the
    /// [`executor`] when an operator cancels the job.
    pub(crate) fn with_cancel_flag(mut self, requested: Arc<AtomicBool>) -> Self {
        self.requested = requested;
        self
    }

    /// The execution span's context ([`crate::telemetry`]).
    pub(crate) fn with_trace(mut self, trace: Option<crate::telemetry::TraceContext>) -> Self {
        self.trace = trace;
        self
    }

    /// The W3C `traceparent` to pass on from this attempt: its execution
    /// span's when tracing is on, else the one the job was enqueued with
    /// (handed on unchanged). The exec handler sets `TRACEPARENT` to it.
    pub fn traceparent(&self) -> Option<String> {
        match &self.trace {
            Some(trace) => Some(trace.header()),
            None => self.job.traceparent.clone(),
        }
    }

    /// Whether an operator asked for this job to stop (`almanac jobs
    /// cancel`): when [`JobContext::cancelled`] fired for that reason. The job
    /// ends `cancelled` whatever the handler returns, but `Ok` (`done`).
    pub fn cancel_requested(&self) -> bool {
        self.requested.load(Ordering::Acquire)
    }

    /// Resolves when the lease is lost, could not be renewed in time (see
    /// [`executor`]), an operator cancelled the job, or the shutdown deadline
    /// has passed: the handler should stop. One that does not is dropped a
    /// lease margin later (a second after a cancel, at most).
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// The key to pass to the outside world so a re-run has no second effect.
    pub fn idempotency_key(&self) -> String {
        self.job.effective_idempotency_key()
    }
}

/// A job handler. Closures `Fn(JobContext) -> impl Future<Output = Result<(), HandlerError>>`
/// implement it.
pub trait Handler: Send + Sync + 'static {
    fn call(&self, ctx: JobContext) -> HandlerFuture;
}

impl<F, Fut> Handler for F
where
    F: Fn(JobContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    fn call(&self, ctx: JobContext) -> HandlerFuture {
        Box::pin(self(ctx))
    }
}

/// Worker settings; [`WorkerConfig::default`] suits most handlers.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Handlers running at once. Slots beyond the handlers that are busy
    /// are what lets the next claim run while a batch is still being
    /// completed: keep it at least twice `batch_size` for throughput.
    pub concurrency: usize,
    /// Most jobs one claim statement takes. Each claim and each batch of
    /// completions is a commit (a WAL flush), so jobs per commit set the
    /// throughput.
    pub batch_size: usize,
    /// Lease length; heartbeats renew it every third of it.
    pub lease: Duration,
    pub poll_interval: Duration,
    pub shutdown_deadline: Duration,
    pub backoff: Backoff,
    /// LISTEN for enqueue notifications (polling alone when false).
    pub listen: bool,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            // Measured with `almanac bench` (README, Speed): 10 and 10 ran
            // at 0.05-0.1 of the raw limit, bound by one commit per 10 jobs;
            // 200 and 100 at 0.42-0.44, 400 and 200 at 0.57 (100,000 jobs).
            // Two batches in flight keep claims and completions overlapping.
            concurrency: 400,
            batch_size: 200,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            shutdown_deadline: Duration::from_secs(30),
            backoff: Backoff::default(),
            listen: true,
        }
    }
}

impl WorkerConfig {
    /// The defaults for shell-command handlers (`almanac work`, `almanac
    /// consume`): every slot there is a process, so `concurrency` is four per
    /// core (at least 4), not the 400 in-process tasks of [`Default`], which
    /// would start 400 processes at once on a backlog. The throughput of
    /// commands is bound by starting processes (`almanac bench`: about 1,300
    /// `true` per second on 2 cores), which a few per core already reach.
    pub fn for_commands() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let concurrency = (4 * cores).max(4);
        WorkerConfig {
            concurrency,
            batch_size: Self::half_batch(concurrency),
            ..WorkerConfig::default()
        }
    }

    /// Batches of half the slots: one batch is claimed while the previous
    /// one is completed.
    pub fn half_batch(concurrency: usize) -> usize {
        (concurrency / 2).max(1)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("a worker needs at least one handler; register one before run")]
    NoHandlers,
}

impl Settings for WorkerConfig {
    fn check(&self) -> Result<(), InvalidSetting> {
        InvalidSetting::at_least("[worker] concurrency", self.concurrency as i64, 1)?;
        InvalidSetting::at_least("[worker] batch_size", self.batch_size as i64, 1)?;
        if self.lease < Duration::from_millis(300) {
            return Err(InvalidSetting {
                setting: "[worker] lease",
                problem: format!(
                    "is {:?}; it must be at least 300ms (heartbeats run every third of it)",
                    self.lease
                ),
            });
        }
        InvalidSetting::positive("[worker] poll_interval", self.poll_interval)?;
        Ok(())
    }
}

/// A worker: handlers by kind, and the settings to run them with.
pub struct Worker {
    pool: PgPool,
    config: Valid<WorkerConfig>,
    metrics: Metrics,
    tracer: crate::telemetry::Tracer,
    handlers: HashMap<String, Arc<dyn Handler>>,
}

impl Worker {
    pub fn new(pool: PgPool, config: Valid<WorkerConfig>) -> Self {
        Worker {
            pool,
            config,
            metrics: Metrics::new(),
            tracer: crate::telemetry::Tracer::off(),
            handlers: HashMap::new(),
        }
    }

    /// Traces each attempt into `tracer` (by default off): see [`crate::telemetry`].
    pub fn with_tracer(mut self, tracer: crate::telemetry::Tracer) -> Self {
        self.tracer = tracer;
        self
    }

    /// Counts into `metrics` (by default, a registry of its own).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Runs `handler` for jobs of `kind`; a second registration replaces the first.
    pub fn register(mut self, kind: impl Into<String>, handler: impl Handler) -> Self {
        self.handlers.insert(kind.into(), Arc::new(handler));
        self
    }

    pub fn kinds(&self) -> Vec<String> {
        let mut kinds: Vec<String> = self.handlers.keys().cloned().collect();
        kinds.sort();
        kinds
    }
}

impl Role for Worker {
    const NAME: RoleName = RoleName::Worker;
    type Output = WorkerReport;
    type Error = WorkerError;

    /// Runs until `shutdown` is cancelled, then shuts down as the module doc says.
    async fn run(self, shutdown: CancellationToken) -> Result<WorkerReport, WorkerError> {
        if self.handlers.is_empty() {
            return Err(WorkerError::NoHandlers);
        }
        Ok(runner::run(
            self.pool,
            self.config,
            self.metrics,
            self.tracer,
            self.handlers,
            shutdown,
        )
        .await)
    }
}

/// Runs a handler, turning a panic into a retryable failure.
pub(crate) async fn invoke(handler: &dyn Handler, ctx: JobContext) -> Result<(), HandlerError> {
    use futures::FutureExt;
    match std::panic::AssertUnwindSafe(handler.call(ctx))
        .catch_unwind()
        .await
    {
        Ok(result) => result,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            Err(HandlerError::retry(format!("handler panicked: {message}")))
        }
    }
}

/// What the fence records for a failed attempt: the handler's delay, or the backoff's.
pub(crate) fn failure_of(err: &HandlerError, attempt: i32, backoff: &Backoff) -> Failure {
    match err {
        HandlerError::Permanent { .. } => Failure::Permanent { error: err.chain() },
        HandlerError::Retry { after, .. } => Failure::Retry {
            delay: after.unwrap_or_else(|| backoff.delay(attempt)),
            error: err.chain(),
        },
        // The executor writes a snooze itself; as a failure it is a retry.
        HandlerError::Snooze { after } => Failure::Retry {
            delay: *after,
            error: err.chain(),
        },
    }
}
