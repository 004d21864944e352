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
//! **A job of a kind the consumer has no handler for is never acknowledged.**
//! Its claim tells it apart from a skip ([`queue::ClaimById::OtherKind`]);
//! the consumer logs an error naming the kind and the destination (at most
//! every [`OTHER_KIND_LOG_EVERY`] per kind), counts it in
//! `almanac_consumer_unhandled_kind_total`, and gives the message back:
//! a RabbitMQ consumer puts it back at the tail of its queue after
//! [`OTHER_KIND_HOLD`] (a confirmed copy, then the ack: see [`rabbitmq`]),
//! so the queue's other consumers take turns with it; a Kafka consumer cannot pass one
//! message on inside its group, so it commits nothing past it and leaves the
//! group for a while ([`kafka`]), handing its partitions to the group's other
//! members. On Kafka, every consumer of a group should run every kind routed
//! to its topic; a consumer that does not is told so at start.
//!
//! **A paused kind's messages are held, never acknowledged.** Its claim
//! says so ([`queue::ClaimById::Paused`]); the consumer keeps the message
//! and looks every [`PAUSE_POLL`] whether the kind was resumed, then claims
//! it again. A RabbitMQ consumer holds it [`OTHER_KIND_HOLD`], then passes
//! it to the tail of its queue as it does a kind it cannot run, so the
//! deliveries behind it get their turn (a large paused backlog in a queue
//! shared with other kinds still slows them: each consumer cycles the
//! paused messages a prefetch at a time). A Kafka consumer holds it for as
//! long as the pause lasts: nothing past it may be committed, so what
//! follows it in its partition waits too (give a kind you may pause a topic
//! of its own); past `max.poll.interval.ms` (5 minutes) the group
//! rebalances and the message comes again, to be held again. While it is
//! held its partition is never seen drained, so the relay re-drives no
//! stranded message of any kind on that topic until the pause ends (paused
//! kinds themselves are never re-driven: [`queue::routing::redrive`]).
//!
//! **A limited kind's messages are held, never acknowledged.** When a
//! job's kind is at one of its limits ([`crate::queue::limits`]) the claim
//! says so ([`queue::ClaimById::Limited`]); no attempt is used, and the
//! consumer claims it again every [`LIMIT_POLL`]. As with a pause, a
//! RabbitMQ consumer passes a message still held after
//! [`OTHER_KIND_HOLD`] to the tail of its queue, and a Kafka consumer
//! holds its partition until the job can start.
//!
//! **Claims end on the server.** A claim that gets no answer within
//! `lease / 3` of being sent is given up (the message is not acked); its
//! connection (a pool of its own, see [`crate::db::bounded_pool`], waited for
//! apart) has a `statement_timeout` and `lock_timeout` of `lease / 4`, so a
//! claim stuck on the server (behind a lock, say) rolls back before the
//! consumer gives up on it, instead of committing a lease nobody holds. (A
//! reply held up in the network for more than `lease / 12`, or a commit
//! waiting on a synchronous replica, can still commit a claim the consumer
//! abandoned: its lease then runs out and the reaper makes the job ready
//! again, with one attempt used.)
//!
//! **Shutdown** (SIGTERM, or the token) is a worker's: stop taking messages,
//! let running jobs finish within `shutdown_deadline`, then cancel them and
//! release their jobs (`ready` again, or `dead` with their attempts used up;
//! the release writes a fresh outbox row, so the message in hand is acked).
//! Nothing waits for a lease to expire.
//!
//! **Drain marks.** About once a second a running consumer asks its broker
//! whether every message published to its destination so far has been
//! taken, and records when it was (`almanac.consumer_marks`; `consumer/marks.rs` says how):
//! the relay re-drives a destination's stranded jobs only after such a
//! drain, so a consumer outage does not multiply messages.
//!
//! **Tracing** (off unless [`Consumer::with_tracer`]): a message's
//! `traceparent` header (the relay's publish span) is read and the first
//! attempt's execution span is its child ([`crate::telemetry`]); with
//! tracing off the header is not even read.
//!
//! Kafka messages are handled one at a time per consumer (commit order is
//! offset order); scale out with partitions and more consumers. A handler
//! that runs longer than Kafka's `max.poll.interval.ms` (5 minutes) makes the
//! group rebalance and the message is delivered again; the fence turns that
//! copy into a skip. RabbitMQ deliveries are handled up to `concurrency` at
//! once (the prefetch).

mod kafka;
mod marks;
pub mod presence;
mod rabbitmq;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::broker::{SinkConfig, SinkError, SinkKind};
use crate::metrics::Metrics;
use crate::queue::{self, ClaimById, QueueError};
use crate::retry::Retry;
use crate::role::{Role, RoleName, Valid};
use crate::telemetry::{TraceContext, Tracer};
use crate::worker::{Executed, Executor, Handler, WorkerConfig, WorkerReport};

/// The header carrying the job id.
pub const JOB_ID_HEADER: &str = "almanac-job-id";

/// How long a RabbitMQ consumer holds a message of a kind it cannot run
/// before giving it back (no hot loop of redeliveries).
pub const OTHER_KIND_HOLD: Duration = Duration::from_secs(1);

/// The error about a kind the consumer cannot run is logged at most this often per kind.
pub const OTHER_KIND_LOG_EVERY: Duration = Duration::from_secs(30);

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
    /// Claims go through connections bound by the claim deadline.
    claims: PgPool,
    /// When the error about each kind it cannot run was last logged, and how
    /// many messages of it came since.
    other_kinds: Mutex<HashMap<String, (Option<Instant>, u64)>>,
    /// When holding a paused kind's messages was last logged, per kind.
    paused_told: Mutex<HashMap<String, Instant>>,
    sinks: SinkConfig,
    config: ConsumerConfig,
    handlers: HashMap<String, Arc<dyn Handler>>,
    counters: Arc<Counters>,
    metrics: Metrics,
    tracer: Tracer,
    /// This consumer's row in `almanac.consumers`, from [`Role::run`] on.
    presence: Option<Arc<presence::Presence>>,
}

/// Why a message's job could not be claimed; the message is not acked.
#[derive(Debug, thiserror::Error)]
enum ClaimError {
    #[error(transparent)]
    Db(#[from] QueueError),
    #[error("no answer from the database within {0:?}")]
    TimedOut(std::time::Duration),
    /// The job's kind is paused: hold the message until it is resumed.
    #[error("kind {0} is paused")]
    Paused(String),
    /// Starting the job now would break its kind's limits: hold the
    /// message and try again shortly.
    #[error("kind {0} is at its limit")]
    Limited(String),
}

/// What became of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handled {
    Executed(Executed),
    Skipped,
    /// Its job is of a kind this consumer has no handler for: give the
    /// message back, never acknowledge it.
    OtherKind(String),
    /// Its job's kind stayed paused for as long as the caller may hold a
    /// message: give the message back, never acknowledge it.
    Paused(String),
    /// Its job's kind stayed at its limit for as long as the caller may
    /// hold a message: give the message back, never acknowledge it.
    Limited(String),
}

impl Consumer {
    pub fn new(pool: PgPool, sinks: SinkConfig, config: ConsumerConfig) -> Self {
        // Statements end on the server a quarter before the client gives up
        // on them (see `handle`), so one the client abandoned never commits.
        let claims = crate::db::bounded_pool(
            &pool,
            config.worker.lease / 4,
            config.worker.lease / 3,
            (config.worker.concurrency as u32).saturating_add(1),
        );
        Consumer {
            pool,
            claims,
            other_kinds: Mutex::default(),
            paused_told: Mutex::default(),
            sinks,
            config,
            handlers: HashMap::new(),
            counters: Arc::default(),
            metrics: Metrics::new(),
            tracer: Tracer::off(),
            presence: None,
        }
    }

    /// Traces each attempt into `tracer` (by default off), joining the
    /// trace of the message's `traceparent` header: see [`crate::telemetry`].
    pub fn with_tracer(mut self, tracer: Tracer) -> Self {
        self.tracer = tracer;
        self
    }

    /// The trace context a message came with (its `traceparent` header,
    /// read only when tracing is on).
    fn via(&self, header: impl FnOnce() -> Option<TraceContext>) -> Option<TraceContext> {
        if self.tracer.is_on() {
            header()
        } else {
            None
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
        via: Option<TraceContext>,
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
        // The connection is waited for apart from the claim, so the claim's
        // own client deadline (`lease / 3`) starts when it is sent and
        // outlasts its server-side limit (`lease / 4`).
        let within = self.config.worker.lease / 3;
        let kinds = self.kinds();
        let mut conn = tokio::time::timeout(within, self.claims.acquire())
            .await
            .map_err(|_| ClaimError::TimedOut(within))?
            .map_err(QueueError::from)?;
        let claim = queue::claim_by_id(&mut conn, id, &kinds, self.config.worker.lease);
        let claimed = tokio::time::timeout(within, claim)
            .await
            .map_err(|_| ClaimError::TimedOut(within))??;
        drop(conn);
        let job = match claimed {
            ClaimById::Claimed(job) => *job,
            ClaimById::Skip => {
                self.counters.skipped.fetch_add(1, Ordering::Relaxed);
                return Ok(Some(Handled::Skipped));
            }
            ClaimById::OtherKind(kind) => {
                drop(slot);
                self.other_kind(&kind, id);
                return Ok(Some(Handled::OtherKind(kind)));
            }
            ClaimById::Paused(kind) => return Err(ClaimError::Paused(kind)),
            ClaimById::Limited(kind) => return Err(ClaimError::Limited(kind)),
        };
        let handler = self.handlers[&job.kind].clone();
        self.counters.executed.fetch_add(1, Ordering::Relaxed);
        let executed = match executor.spawn(job, sent, handler, slot, via) {
            Ok(outcome) => match outcome.await {
                Ok(executed) => executed,
                Err(_) => return Ok(None),
            },
            Err(job) => executor.release_unstarted(job).await,
        };
        Ok(Some(Handled::Executed(executed)))
    }

    /// Says which kinds routed to this consumer's destination it has no
    /// handler for, and which of them no running consumer of the
    /// destination has one for either (read once, at start; nothing is said
    /// if the database did not answer within a few seconds).
    async fn tell_unhandled_routed_kinds(&self) {
        let sink = self.config.sink;
        let destination = self.config.destination.as_str();
        let read = async {
            let mut conn = self.pool.acquire().await.ok()?;
            let routes = crate::relay::routes::list(&mut conn).await.ok()?;
            // Unknown (`None`) if the rows cannot be read: then nothing is
            // said about other consumers.
            let handled = presence::handled_at(&mut conn, sink, destination)
                .await
                .ok();
            Some((routes, handled))
        };
        let Ok(Some((routes, handled))) = tokio::time::timeout(Duration::from_secs(5), read).await
        else {
            return;
        };
        let missing: Vec<(String, String)> = routes
            .into_iter()
            .filter(|r| r.mode != "db" && r.sink.as_deref() == Some(sink.as_str()))
            .filter(|r| r.destination.as_deref() == Some(destination))
            .filter(|r| !self.handlers.contains_key(&r.kind))
            .map(|r| (r.kind, r.mode))
            .collect();
        if missing.is_empty() {
            return;
        }
        let kinds: Vec<&String> = missing.iter().map(|(kind, _)| kind).collect();
        warn!(
            %sink,
            destination,
            kinds = ?kinds,
            handled = ?self.kinds(),
            "kinds routed to this destination have no handler in this consumer: their messages are given back, never run here. Every consumer of a destination should run every kind routed to it (on Kafka, a consumer that cannot steps out of its group when it meets one)"
        );
        let Some(handled) = handled else { return };
        let nowhere = |mode: &str| -> Vec<&String> {
            missing
                .iter()
                .filter(|(kind, m)| m == mode && !handled.contains(kind))
                .map(|(kind, _)| kind)
                .collect()
        };
        let (broker, dual) = (nowhere("broker"), nowhere("dual"));
        if !broker.is_empty() {
            error!(
                %sink,
                destination,
                kinds = ?broker,
                "no running consumer of this destination has a handler for these kinds routed to the broker: nothing runs their jobs until one starts. Start a consumer that handles them, or route them elsewhere (almanac route set)"
            );
        }
        if !dual.is_empty() {
            warn!(
                %sink,
                destination,
                kinds = ?dual,
                "no running consumer of this destination has a handler for these kinds in dual mode: workers run their jobs, and their messages are given back. Start a consumer that handles them before moving them to the broker"
            );
        }
    }

    /// Says that a message of `kind` came that this consumer cannot run: a
    /// metric each time, an error at most every [`OTHER_KIND_LOG_EVERY`].
    fn other_kind(&self, kind: &str, job_id: i64) {
        let destination = &self.config.destination;
        self.metrics.record_unhandled_kind(kind, destination);
        if let Some(presence) = &self.presence {
            presence.gave_back(kind);
        }
        let mut seen = self.other_kinds.lock().expect("not poisoned");
        let now = Instant::now();
        let (last, since) = seen.entry(kind.to_string()).or_insert((None, 0));
        *since += 1;
        if last.is_none_or(|at| now.duration_since(at) >= OTHER_KIND_LOG_EVERY) {
            error!(
                kind,
                destination = %destination,
                sink = %self.config.sink,
                job_id,
                messages = *since,
                handled = ?self.kinds(),
                "a message's job is of a kind this consumer has no handler for; giving it back unacknowledged. Start a consumer of this destination that handles the kind, or route the kind elsewhere (almanac route set)"
            );
            *last = Some(now);
            *since = 0;
        }
    }

    /// Handles a message until it is handled or shutdown comes; `None` on
    /// shutdown or when the outcome is unknown (do not ack). A message of a
    /// paused kind is held until the kind is resumed, then claimed again;
    /// after `hold` (if any) of pause it comes back as [`Handled::Paused`].
    /// One held back by its kind's limits is claimed again every
    /// [`LIMIT_POLL`]; after `hold` (if any) it comes back as
    /// [`Handled::Limited`].
    async fn handle_until_done(
        &self,
        executor: &Executor,
        job_id: Option<i64>,
        via: Option<TraceContext>,
        shutdown: &CancellationToken,
        hold: Option<Duration>,
    ) -> Option<Handled> {
        let mut retry = Retry::new(
            std::time::Duration::from_millis(200),
            std::time::Duration::from_secs(10),
        );
        let since = Instant::now();
        loop {
            match self.handle(executor, job_id, via).await {
                Ok(handled) => return handled,
                Err(ClaimError::Limited(kind)) => {
                    self.metrics.record_held_by_limit(&kind);
                    if hold.is_some_and(|hold| since.elapsed() >= hold) {
                        return Some(Handled::Limited(kind));
                    }
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        _ = tokio::time::sleep(LIMIT_POLL) => {}
                    }
                }
                Err(ClaimError::Paused(kind)) => {
                    match self.hold_while_paused(&kind, job_id, shutdown, hold).await {
                        Held::Resumed => continue,
                        Held::Shutdown => return None,
                        Held::TooLong => return Some(Handled::Paused(kind)),
                    }
                }
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

/// How [`Consumer::hold_while_paused`] ended.
enum Held {
    Resumed,
    Shutdown,
    TooLong,
}

/// How often a consumer holding a paused kind's message looks whether the
/// kind was resumed: a resume reaches held messages within this.
pub const PAUSE_POLL: Duration = Duration::from_millis(250);

/// How often a consumer holding a message that its kind's limits hold back
/// tries to claim it again.
pub const LIMIT_POLL: Duration = Duration::from_millis(100);

impl Consumer {
    /// Waits while `kind` is paused (a primary-key read every
    /// [`PAUSE_POLL`]; a failed read counts as still paused).
    async fn hold_while_paused(
        &self,
        kind: &str,
        job_id: Option<i64>,
        shutdown: &CancellationToken,
        hold: Option<Duration>,
    ) -> Held {
        let tell = {
            let mut told = self.paused_told.lock().expect("not poisoned");
            let now = Instant::now();
            let last = told.get(kind).copied();
            let due = last.is_none_or(|at| now.duration_since(at) >= OTHER_KIND_LOG_EVERY);
            if due {
                told.insert(kind.to_string(), now);
            }
            due
        };
        if tell {
            info!(
                kind,
                job_id,
                destination = %self.config.destination,
                "the kind is paused; holding its messages (unacknowledged) until it is resumed (said at most every 30 s per kind)"
            );
        }
        let until = hold.map(|hold| Instant::now() + hold);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Held::Shutdown,
                _ = tokio::time::sleep(PAUSE_POLL) => {}
            }
            let paused = tokio::time::timeout(
                self.config.worker.lease / 3,
                crate::control::pause::is_paused(&self.claims, kind),
            )
            .await;
            if let Ok(Ok(false)) = paused {
                return Held::Resumed;
            }
            if until.is_some_and(|until| Instant::now() >= until) {
                return Held::TooLong;
            }
        }
    }
}

impl Role for Consumer {
    const NAME: RoleName = RoleName::Consumer;
    type Output = ConsumerReport;
    type Error = ConsumerError;

    /// Consumes until `shutdown`, then drains and releases as the module doc says.
    async fn run(mut self, shutdown: CancellationToken) -> Result<ConsumerReport, ConsumerError> {
        if self.handlers.is_empty() {
            return Err(ConsumerError::NoHandlers);
        }
        let presence = Arc::new(presence::Presence::new(
            &self.pool,
            self.config.sink,
            &self.config.destination,
            self.kinds(),
        ));
        // Written before the check below, so that consumers starting
        // together see each other.
        let _ = tokio::time::timeout(presence::BEAT_EVERY, presence.beat()).await;
        self.presence = Some(presence.clone());
        self.tell_unhandled_routed_kinds().await;
        let this = Arc::new(self);
        let executor = Executor::start(
            this.pool.clone(),
            this.config.worker.clone(),
            this.metrics.clone(),
            this.tracer.clone(),
            None,
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
        let present = presence.keep(&stop);
        let (result, jobs, ()) = tokio::join!(consume, drain, present);
        result?;
        Ok(ConsumerReport {
            jobs,
            ..Progress(this.counters.clone()).report()
        })
    }
}
