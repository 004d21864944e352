//! The outbox relay: publishes outbox rows to Kafka or RabbitMQ and marks
//! them published only after the broker acknowledged them.
//!
//! - **Where rows come from.** A trigger on `almanac.jobs` writes an outbox
//!   row in the same transaction as every transition of a `dual` or `broker`
//!   job to `ready` (enqueue, retry, reaper, release, `route set`), with
//!   `available_at = run_at` (the baseline migration).
//! - **Short transactions.** A relay claims a batch of due rows of its sink in
//!   one statement: a row in `almanac.outbox_batches` names them, with a
//!   token and an in-flight lease; other claims skip rows a batch in flight
//!   names, and claims of one sink are serialised by an advisory lock, so
//!   several relays share the work. The outbox rows are not written by the
//!   claim. The batch is published and its acknowledgements awaited outside
//!   any transaction; then one more statement (a short transaction when some
//!   rows failed) takes the batch back by its token, deletes the published
//!   rows and keeps the batch as the record of their publication. No row lock
//!   or transaction is held while a broker thinks. Claims and marks commit
//!   asynchronously ([`outbox`] says why that is safe).
//!   While one batch is in flight the next is claimed, and the previous one
//!   is marked. Each claim starts after the previous batch, and from the
//!   start of the due rows at least once a second (`CLAIM_FROM_START_EVERY`).
//! - **Memory is bounded in bytes.** A claim stops at `--relay-batch-bytes`
//!   of payload (measured in the database; a batch always has its first
//!   row), and a row over `--max-message-bytes` comes without its payload,
//!   to be marked failed ([`outbox::claim_after`], migration 0106). Pipelined,
//!   the relay holds the payloads of at most [`BATCHES_IN_MEMORY`] batches at
//!   once: the one claimed ahead, the one being handed to the broker and the
//!   broker client's copy of it, and the client's copy of the one before,
//!   awaiting its acknowledgements (the relay drops its own copy of a batch
//!   once handed over; a batch being marked holds none). So at most
//!   [`payload_bound`] = 4 × max(`--relay-batch-bytes`, `--max-message-bytes`)
//!   of payload, 64 MiB with the defaults, beside the process's own memory
//!   and one row's read buffer per database connection.
//! - **Per-row outcomes** ([`crate::broker::PublishError`]): acknowledged rows
//!   are deleted, their batch kept as the record. A `Retriable` failure (broker down, timeout, broken
//!   link: "maybe sent") keeps the row, with `last_error`, for a later try with
//!   backoff, however long the broker stays away. An `Unroutable` row (no
//!   queue bound, destination cannot be created) is retried until it has used
//!   `max_publish_attempts`; a `Fatal` one (too large, invalid destination) at
//!   once. Such a row is marked failed with its reason and its job, when it is
//!   a ready `broker` job, goes `dead` with that reason (a `dual` job stays
//!   for workers). The other rows of the batch are not affected.
//! - **A batch never outlives its lease.** Everything a batch waits for,
//!   from its claim to its mark (the batch before it, destination set-up,
//!   reconnects, writing, acknowledgements), ends by its [`Deadline`]: its
//!   in-flight lease less the time its mark needs ([`mark_reserve`]). Past
//!   it the rows not acknowledged are retried ("maybe sent", one more copy
//!   at most), and a mark that comes after the lease marks nothing. (Left:
//!   a mark that starts just before the lease ends and commits after
//!   another relay's claim read the rows again records them in both
//!   batches and they go out once more; the relay starts its marks
//!   [`mark_reserve`] before the lease ends, and the job fence runs the
//!   job once either way. The database statements of a batch are bounded
//!   by the server's lock timeouts, not by this deadline.)
//! - **A blocked broker.** RabbitMQ blocks publishers on a memory or disk
//!   alarm (`connection.blocked`). The batch it caught fails retriable at
//!   its deadline; while the block lasts the relay claims nothing (no row
//!   is written into a blocked connection twice) but goes on maintaining
//!   and reading its notifications, says so once in the log and in
//!   `almanac_relay_broker_blocked{sink}`, and drains as soon as it lifts.
//! - **Crash between publish and mark.** The rows stay claimed until their
//!   in-flight lease ends, then come due and are published again: the message
//!   arrives twice, and the consumer's claim through the job fence makes the
//!   second copy a no-op. A relay whose batch was dropped (its lease ran out
//!   and a claim took the rows again, or `route set` re-addressed one) marks
//!   nothing.
//! - **Re-drive.** A `broker` job that stays ready and due longer than
//!   `redrive_after` with no row pending on its current route and none
//!   published there recently (its message was lost, purged or skipped) gets
//!   a fresh one, so broker mode never strands a job. **Re-drive does not
//!   amplify lag:** a destination whose consumers record drains
//!   (`almanac.consumer_marks`, see [`crate::consumer`]) is re-driven only
//!   when every partition was drained within `redrive_after`, so a job's
//!   message is copied again only once a drain after its last publication
//!   proves that copy is gone; however long consumers are down or behind,
//!   the broker holds at most one re-driven copy per job beyond the first.
//!   A destination no consumer records drains for is re-driven as before.
//!   The relay warns once when it starts holding a destination back, and
//!   says when it lets it go.
//! - **Reconcile.** Every `reconcile_interval` the relay repairs jobs whose
//!   route disagrees with `almanac.routes` and pending rows addressed to a
//!   sink or destination their kind no longer uses; it looks at a kind only
//!   until its route has settled, and hourly after ([`reconcile`]).
//! - LISTEN/NOTIFY (`almanac_outbox`) wakes the relay; polling is the safety net.
//! - **Tracing** (off unless [`Relay::with_tracer`]): a row whose headers
//!   carry a `traceparent` is published under an `almanac.publish` span,
//!   a child of it, and the message's `traceparent` header is that span's
//!   context (`relay/spans.rs`).

mod config;
pub mod kafka;
pub mod outbox;
pub mod publisher;
pub mod rabbitmq;
pub mod reconcile;
pub mod routes;
mod spans;

use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio::time::{sleep, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub use crate::broker::{PublishError, SinkConfig, SinkError, SinkKind};
use crate::metrics::Metrics;
use crate::queue::routing;
use crate::retry::Retry;
use crate::role::{Role, RoleName, Valid};
pub use config::{Failpoint, RelayConfig, DEFAULT_BATCH_BYTES, MAX_BATCH_SIZE};
pub use outbox::{ClaimLimits, Claimed, FailedRow, OutboxRow, SinkOutboxStats};
pub use publisher::{Deadline, InFlight, Publisher};

pub const NOTIFY_CHANNEL: &str = "almanac_outbox";

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("failpoint {0:?} reached; the claimed rows were left in flight")]
    Failpoint(Failpoint),
    #[error("a relay task ended abnormally: {0}")]
    Task(String),
}

/// What the relay did with a batch (or several).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelayReport {
    /// Rows acknowledged by the broker and marked published.
    pub published: u64,
    /// Rows that failed this time and will be tried again.
    pub retried: u64,
    /// Rows marked failed for good (their jobs went dead).
    pub failed: u64,
}

impl std::ops::AddAssign for RelayReport {
    fn add_assign(&mut self, other: Self) {
        self.published += other.published;
        self.retried += other.retried;
        self.failed += other.failed;
    }
}

/// What becomes of one row after a publish.
#[derive(Debug, Clone)]
enum Outcome {
    Published,
    Retry { error: String, delay: Duration },
    Failed { error: String },
}

pub struct Relay {
    pool: PgPool,
    publisher: Publisher,
    config: Valid<RelayConfig>,
    metrics: Metrics,
    /// The `almanac.publish` spans' ([`spans`]); off by default.
    tracer: crate::telemetry::Tracer,
    /// Where the re-drive sweep goes on.
    redrive_from: Option<routing::RedriveCursor>,
    /// Destinations re-drive holds back (not drained), as last told.
    held: Vec<String>,
    /// When a claim last started from the start of the due rows.
    claimed_from_start: Instant,
    /// Cancelled at shutdown: a drain claims no further batch.
    stop: CancellationToken,
    /// Whether the broker blocked the publisher when last looked at.
    blocked: bool,
    /// Which kinds' routes have settled (`relay/reconcile.rs`).
    reconciler: tokio::sync::Mutex<reconcile::Reconciler>,
}

/// How long claims may start after the previous batch instead of from the
/// start of the due rows (which steps over every row published since the
/// last VACUUM: [`outbox::claim_after`]). A row that comes due behind the
/// batches (an earlier `run_at`, a late commit, a batch handed back or whose
/// lease ended) waits at most this long longer.
const CLAIM_FROM_START_EVERY: Duration = Duration::from_secs(1);

impl Relay {
    pub fn new(pool: PgPool, publisher: Publisher, config: Valid<RelayConfig>) -> Self {
        Relay {
            pool,
            publisher,
            config,
            metrics: Metrics::new(),
            tracer: crate::telemetry::Tracer::off(),
            redrive_from: None,
            held: Vec::new(),
            claimed_from_start: Instant::now(),
            stop: CancellationToken::new(),
            blocked: false,
            reconciler: Default::default(),
        }
    }

    /// Traces each publish into `tracer` (by default off): see `relay/spans.rs`.
    pub fn with_tracer(mut self, tracer: crate::telemetry::Tracer) -> Self {
        self.tracer = tracer;
        self
    }

    /// When `batch` must be done with the broker: its lease less
    /// [`mark_reserve`].
    fn deadline(&self, batch: &Claimed) -> Deadline {
        Deadline(batch.lease_ends - mark_reserve(self.config.in_flight_lease))
    }

    /// Reads whether the broker blocks the publisher: counted in
    /// `almanac_relay_broker_blocked`, logged when it changes.
    fn watch_blocked(&mut self) -> bool {
        let (sink, blocked) = (self.publisher.sink(), self.publisher.blocked());
        self.metrics.record_relay_blocked(sink.as_str(), blocked);
        if blocked != self.blocked {
            if blocked {
                warn!(%sink, "the broker blocks publishers (RabbitMQ connection.blocked: a memory or disk alarm); rows wait and nothing is claimed until it lifts");
            } else {
                info!(%sink, "the broker no longer blocks publishers; publishing again");
            }
            self.blocked = blocked;
        }
        blocked
    }

    /// Counts into `metrics` (by default, a registry of its own).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Claims the next batch, after `after` unless the last claim from the
    /// start is [`CLAIM_FROM_START_EVERY`] old.
    fn claim(
        &mut self,
        after: Option<outbox::ClaimPosition>,
    ) -> impl std::future::Future<Output = Result<Claimed, sqlx::Error>> + 'static {
        let now = Instant::now();
        let after = after.filter(|_| now < self.claimed_from_start + CLAIM_FROM_START_EVERY);
        if after.is_none() {
            self.claimed_from_start = now;
        }
        let (pool, sink) = (self.pool.clone(), self.publisher.sink());
        let limits = outbox::ClaimLimits {
            rows: self.config.batch_size,
            bytes: self.config.batch_bytes,
            max_message_bytes: i64::try_from(self.publisher.max_message_bytes())
                .unwrap_or(i64::MAX),
        };
        let lease = self.config.in_flight_lease;
        async move { outbox::claim_after(&pool, sink, limits, lease, after).await }
    }

    /// The outcome of each row of a published batch.
    fn outcomes(&self, rows: &[OutboxRow], results: Vec<Result<(), PublishError>>) -> Vec<Outcome> {
        rows.iter()
            .zip(results)
            .map(|(row, result)| match result {
                Ok(()) => Outcome::Published,
                Err(e @ PublishError::Fatal { .. }) => Outcome::Failed { error: e.reason() },
                Err(e @ PublishError::Unroutable { .. })
                    if row.attempts >= self.config.max_publish_attempts =>
                {
                    Outcome::Failed {
                        error: format!("{} (gave up after {} attempts)", e.reason(), row.attempts),
                    }
                }
                Err(e) => Outcome::Retry {
                    error: e.reason(),
                    delay: self.config.retry.delay(row.attempts),
                },
            })
            .collect()
    }

    /// Claims, publishes and marks one batch (without pipelining).
    pub async fn run_once(&mut self) -> Result<RelayReport, RelayError> {
        let mut claimed = self.claim(None).await?;
        if claimed.rows.is_empty() {
            return Ok(RelayReport::default());
        }
        let by = self.deadline(&claimed);
        let traced = spans::start(&self.tracer, self.publisher.sink(), &mut claimed.rows);
        let results = self.publisher.publish_by(&claimed.rows, by).await;
        spans::end(&self.tracer, traced, &results);
        if let Some(point) = self.config.failpoint {
            return Err(RelayError::Failpoint(point));
        }
        let outcomes = self.outcomes(&claimed.rows, results);
        Ok(mark(
            self.pool.clone(),
            self.publisher.sink(),
            self.metrics.clone(),
            claimed,
            outcomes,
        )
        .await?)
    }

    /// Publishes due rows batch after batch until a batch claimed from the
    /// start comes back short, or a batch has rows to retry. Each claim
    /// starts after the previous batch (a short one is followed by a claim
    /// from the start). Pipelined: while one batch awaits its
    /// acknowledgements the next is claimed and sent, and each batch is
    /// marked while the following ones go out. At most two batches are
    /// unacknowledged at a time, and the payloads of at most
    /// [`BATCHES_IN_MEMORY`] are in memory (a batch's own copy is dropped
    /// once it is handed to the broker client).
    pub async fn drain(&mut self) -> Result<RelayReport, RelayError> {
        let mut report = RelayReport::default();
        let mut marking: Option<JoinHandle<Result<RelayReport, sqlx::Error>>> = None;
        let mut outstanding: Option<(Claimed, InFlight, Vec<_>)> = None;
        let mut next_claim: Option<JoinHandle<Result<Claimed, sqlx::Error>>> = None;
        let mut claimed = Some(self.claim(None).await?);
        let mut result = Ok(());
        let mut finishing_failed = false;
        loop {
            let mut stop = true;
            let mut sent = None;
            if let Some(mut batch) = claimed.take() {
                let full = batch.full;
                // The next claim runs while this batch is handed over
                // (none once the relay is stopping).
                if (full || !batch.from_start) && !self.stop.is_cancelled() {
                    let after = if full { batch.last } else { None };
                    next_claim = Some(tokio::spawn(self.claim(after)));
                    stop = false;
                }
                if !batch.rows.is_empty() {
                    let by = self.deadline(&batch);
                    let traced = spans::start(&self.tracer, self.publisher.sink(), &mut batch.rows);
                    let in_flight = self.publisher.send(&batch.rows, by).await;
                    // The broker client has its copy: this one is not kept
                    // while the acknowledgements come and the batch is marked.
                    batch.drop_payloads();
                    sent = Some((batch, in_flight, traced));
                }
            }
            if let Some((batch, in_flight, traced)) = outstanding.take() {
                match self
                    .finish(batch, in_flight, traced, &mut marking, &mut report)
                    .await
                {
                    Ok(false) => {}
                    Ok(true) => stop = true,
                    Err(e) => {
                        result = Err(e);
                        finishing_failed = true;
                        stop = true;
                    }
                }
            }
            outstanding = sent;
            if stop {
                break;
            }
            match join(next_claim.take().expect("a claim is pending")).await {
                Ok(batch) => claimed = Some(batch),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        // The batch sent last is finished even when the next claim failed
        // (its messages are out: marking them spares a second copy); not
        // after finishing failed: then its rows go out again when their
        // in-flight lease ends.
        if let Some((batch, in_flight, traced)) = outstanding.take() {
            if !finishing_failed {
                if let Err(e) = self
                    .finish(batch, in_flight, traced, &mut marking, &mut report)
                    .await
                {
                    if result.is_ok() {
                        result = Err(e);
                    } else {
                        warn!(sink = %self.publisher.sink(), %e, "finishing a batch failed");
                    }
                }
            }
        }
        if let Some(previous) = marking.take() {
            match join(previous).await {
                Ok(r) => report += r,
                Err(e) if result.is_ok() => result = Err(e),
                Err(e) => warn!(sink = %self.publisher.sink(), %e, "marking a batch failed"),
            }
        }
        if let Some(claim) = next_claim {
            // Rows claimed ahead and never sent are handed back at once. If
            // that fails or takes too long (a database that stopped
            // answering), they come back when their in-flight lease ends.
            let pool = self.pool.clone();
            let hand_back = async move {
                let batch = claim
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| e.to_string())?;
                outbox::release(&pool, batch.token)
                    .await
                    .map_err(|e| e.to_string())
            };
            let outcome = tokio::time::timeout(Duration::from_secs(5), hand_back).await;
            if !matches!(outcome, Ok(Ok(_))) {
                warn!(sink = %self.publisher.sink(), "handing back rows claimed ahead failed or timed out; they return after their in-flight lease");
            }
        }
        result.map(|()| report)
    }

    /// Awaits a sent batch's acknowledgements and starts marking it (after
    /// the previous mark is done); `true` when some rows are to be retried.
    async fn finish(
        &mut self,
        batch: Claimed,
        in_flight: InFlight,
        traced: Vec<Option<crate::telemetry::Span>>,
        marking: &mut Option<JoinHandle<Result<RelayReport, sqlx::Error>>>,
        report: &mut RelayReport,
    ) -> Result<bool, RelayError> {
        let results = in_flight.acks(&batch.rows).await;
        spans::end(&self.tracer, traced, &results);
        self.publisher.settle(&batch.rows, &results);
        if let Some(point) = self.config.failpoint {
            return Err(RelayError::Failpoint(point));
        }
        let outcomes = self.outcomes(&batch.rows, results);
        let retrying = outcomes.iter().any(|o| matches!(o, Outcome::Retry { .. }));
        if let Some(previous) = marking.take() {
            *report += join(previous).await?;
        }
        let (pool, sink, metrics) = (
            self.pool.clone(),
            self.publisher.sink(),
            self.metrics.clone(),
        );
        *marking = Some(tokio::spawn(mark(pool, sink, metrics, batch, outcomes)));
        Ok(retrying)
    }

    /// Gives stranded broker-route jobs a fresh outbox row; returns how many.
    /// Goes on from where the last call stopped and stops after about a
    /// second's work, so a long list of candidates (consumers far behind) is
    /// covered over several sweeps without holding up publishing for long.
    pub async fn redrive(&mut self) -> Result<u64, RelayError> {
        let (sink, after) = (self.publisher.sink(), self.config.redrive_after);
        let start = Instant::now();
        let mut total = 0;
        loop {
            let step =
                routing::redrive(&self.pool, sink.as_str(), after, self.redrive_from).await?;
            total += step.redriven;
            self.redrive_from = step.next;
            self.tell_held(&step.held);
            if step.next.is_none() || start.elapsed() >= Duration::from_secs(1) {
                return Ok(total);
            }
        }
    }

    /// Says once when re-drive starts holding a destination back, and when
    /// it lets it go.
    fn tell_held(&mut self, held: &[routing::Held]) {
        let sink = self.publisher.sink();
        for h in held.iter().filter(|h| !self.held.contains(&h.destination)) {
            warn!(
                %sink,
                destination = %h.destination,
                kinds = ?h.kinds,
                drained_at = h.drained_at.map_or_else(|| "never".to_string(), |at| at.to_rfc3339()),
                redrive_after_ms = self.config.redrive_after.as_millis() as u64,
                "re-drive held back: the destination's consumers have not drained it within redrive_after, so stranded jobs' messages may still wait there and are not copied again. Start or scale its consumers; re-drive resumes once they drain it"
            );
        }
        for gone in self
            .held
            .iter()
            .filter(|d| !held.iter().any(|h| &h.destination == *d))
        {
            info!(%sink, destination = %gone, "re-drive no longer held back for the destination (drained, or no longer routed)");
        }
        self.held = held.iter().map(|h| h.destination.clone()).collect();
    }

    /// Repairs jobs and rows that disagree with their kind's route.
    pub async fn reconcile(&self) -> Result<routes::Reconciled, RelayError> {
        let mut conn = self.pool.acquire().await?;
        Ok(self.reconciler.lock().await.sweep(&mut conn).await?)
    }

    async fn maintain(&mut self, next_redrive: &mut Instant, next_reconcile: &mut Instant) {
        let sink = self.publisher.sink();
        if Instant::now() >= *next_redrive {
            match self.redrive().await {
                Ok(0) => {}
                Ok(n) => {
                    warn!(%sink, jobs = n, "re-drove stranded broker jobs with fresh outbox rows")
                }
                Err(err) => warn!(%sink, %err, "re-drive failed"),
            }
            *next_redrive = Instant::now() + self.config.redrive_after.min(Duration::from_secs(60));
        }
        if Instant::now() >= *next_reconcile {
            match self.reconcile().await {
                Ok(r) if r == routes::Reconciled::default() => {}
                Ok(r) => warn!(
                    %sink,
                    jobs_moved = r.jobs_moved,
                    rows_readdressed = r.rows_readdressed,
                    rows_dropped = r.rows_dropped,
                    "reconciled jobs and outbox rows with their routes"
                ),
                Err(err) => warn!(%sink, %err, "reconcile failed"),
            }
            *next_reconcile = Instant::now() + self.config.reconcile_interval;
        }
    }
}

impl Role for Relay {
    const NAME: RoleName = RoleName::Relay;
    type Output = ();
    type Error = RelayError;

    /// Drains, maintains and waits (LISTEN or the poll interval) until
    /// `shutdown`, then flushes the producer within 10 s.
    async fn run(mut self, shutdown: CancellationToken) -> Result<(), RelayError> {
        let sink = self.publisher.sink();
        info!(%sink, "relay started");
        self.stop = shutdown.clone();
        self.watch_blocked();
        // LISTEN is set up (and retried, with its own pacing) by a task of
        // its own, which then reads it without pause ([`Drainer`]): a
        // database slow to give a connection never holds the drain (polling
        // covers for it meanwhile), and the connection is read from the
        // moment it listens, whatever this loop is waiting for.
        let mut drainer = Some(Drainer::start(
            self.pool.clone(),
            sink,
            self.metrics.clone(),
        ));
        let mut listen_retry = Retry::reconnect();
        let mut listen_next = Instant::now();
        let mut retry = Retry::new(self.config.retry.base, self.config.retry.max);
        let mut next_redrive =
            Instant::now() + self.config.redrive_after.min(Duration::from_secs(60));
        let mut next_reconcile = Instant::now();
        while !shutdown.is_cancelled() {
            if let Some(d) = drainer.as_ref() {
                let listened = d.listening.load(std::sync::atomic::Ordering::Relaxed);
                if listened {
                    // It listened: a break after that paces from the start.
                    listen_retry.succeeded();
                }
                if d.task.is_finished() {
                    if listened {
                        // sqlx could not reconnect it: set up again, paced, below.
                        warn!(%sink, "the relay's LISTEN connection broke; polling until it is back");
                    }
                    drainer = None;
                    listen_next = Instant::now() + listen_retry.failed();
                }
            }
            if drainer.is_none() && Instant::now() >= listen_next {
                drainer = Some(Drainer::start(
                    self.pool.clone(),
                    sink,
                    self.metrics.clone(),
                ));
            }
            self.maintain(&mut next_redrive, &mut next_reconcile).await;
            if self.watch_blocked() {
                // Nothing is claimed while the broker blocks publishers;
                // looked at again shortly (lapin has no wake-up for it).
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = sleep(BLOCKED_POLL) => continue,
                }
            }
            let drained = self.drain().await;
            self.watch_blocked();
            let pause = match drained {
                Ok(r) if r.retried > 0 => retry.failed(),
                Ok(_) => {
                    retry.succeeded();
                    self.config.poll_interval
                }
                Err(err) => {
                    warn!(%sink, %err, "relay batch failed");
                    retry.failed()
                }
            };
            let failing = retry.failures() > 0;
            // While the sink fails, the retry's pause paces the drain, and
            // notifications (still read, see `Drainer`) do not cut it short.
            let woken = async {
                match drainer.as_ref() {
                    Some(d) => d.wake.notified().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = sleep(pause) => {}
                _ = woken, if !failing => {}
            }
        }
        // Its LISTEN session ends with it (see `Drop for Drainer`).
        drop(drainer);
        // Bounded: a broker that stopped answering cannot hold the shutdown.
        if tokio::time::timeout(Duration::from_secs(10), self.publisher.flush())
            .await
            .is_err()
        {
            warn!(%sink, "the producer did not flush within 10 s; unacknowledged rows go out again after their in-flight lease");
        }
        info!(%sink, "relay stopped");
        Ok(())
    }
}

async fn join<T>(handle: JoinHandle<Result<T, sqlx::Error>>) -> Result<T, RelayError> {
    match handle.await {
        Ok(result) => Ok(result?),
        Err(e) => Err(RelayError::Task(e.to_string())),
    }
}

/// Marks a published batch by outcome ([`outbox::mark`]) and records each
/// outcome.
async fn mark(
    pool: PgPool,
    sink: SinkKind,
    metrics: Metrics,
    claimed: Claimed,
    outcomes: Vec<Outcome>,
) -> Result<RelayReport, sqlx::Error> {
    let mut rows = outbox::Outcomes::default();
    for (row, outcome) in claimed.rows.iter().zip(outcomes) {
        match outcome {
            Outcome::Published => rows.published.push((row.id, row.job_id)),
            Outcome::Retry { error, delay } => rows.retry.push((row.id, error, delay)),
            Outcome::Failed { error } => rows.failed.push((row.id, error)),
        }
    }
    let marked = outbox::mark(&pool, claimed.token, &rows).await?;
    record_published(&metrics, sink, marked.published);
    if marked.retried > 0 {
        metrics.record_publish_failed(sink.as_str(), marked.retried);
        warn!(%sink, rows = marked.retried, error = %rows.retry[0].1, "publishing failed; the rows stay unpublished and will be retried");
    }
    for row in &marked.failed {
        record_failed(&metrics, sink, row, marked.buried.contains(&row.job_id));
    }
    Ok(RelayReport {
        published: marked.published,
        retried: marked.retried,
        failed: marked.failed.len() as u64,
    })
}

/// The one place rows marked published are recorded.
fn record_published(metrics: &Metrics, sink: SinkKind, rows: u64) {
    metrics.record_published(sink.as_str(), rows);
    if rows > 0 {
        debug!(%sink, rows, "outbox rows published");
    }
}

/// The one place a row marked failed for good is recorded.
fn record_failed(metrics: &Metrics, sink: SinkKind, row: &FailedRow, job_buried: bool) {
    metrics.record_publish_failed(sink.as_str(), 1);
    warn!(
        %sink,
        outbox_id = row.id,
        job_id = row.job_id,
        destination = %row.destination,
        job_dead = job_buried,
        reason = %row.error,
        "the broker rejected an outbox row for good; it will not be retried"
    );
}

/// A LISTEN connection of its own, or `None` within [`LISTEN_DEADLINE`]
/// (the relay polls meanwhile and tries again with its own pacing): an
/// unreachable database cannot hold the relay's loop, nor its shutdown.
///
/// Its `application_name` is [`relay_application_name`]: while it is
/// connected, `stats`, `/metrics` and the dashboard count the sink as served.
async fn listen(pool: PgPool, sink: SinkKind) -> Option<PgListener> {
    let options = (*pool.connect_options())
        .clone()
        .application_name(&relay_application_name(sink));
    let own = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(LISTEN_DEADLINE)
        .connect_lazy_with(options);
    let connect = async {
        let mut listener = PgListener::connect_with(&own).await.ok()?;
        listener.listen(NOTIFY_CHANNEL).await.ok()?;
        Some(listener)
    };
    tokio::time::timeout(LISTEN_DEADLINE, connect)
        .await
        .ok()
        .flatten()
}

const LISTEN_DEADLINE: Duration = Duration::from_secs(5);

/// The relay's LISTEN connection, set up ([`listen`]) and then read without
/// pause by a task of its own, whatever the relay is doing (publishing,
/// waiting out a failing sink's backoff). PostgreSQL's notification queue is
/// one for the whole cluster, and its tail moves only when every listening
/// session has read what was sent to it: a listener left unread holds the
/// tail back, and once the queue is full every transaction that notifies
/// fails at commit (every enqueue, and other applications on the cluster).
/// So the task that listens is the task that reads: a connection that
/// listens but waits for the relay's loop to pick it up (as one did until
/// 2026-12-06, through a whole backoff when the sink was down as the relay
/// started) is never left unread. Notifications only wake the relay: any
/// number of them between two drains is one wake.
struct Drainer {
    task: JoinHandle<()>,
    wake: std::sync::Arc<tokio::sync::Notify>,
    /// Set by the task once its LISTEN is up.
    listening: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Drainer {
    /// With the relay (however its future ends): its LISTEN session must not
    /// outlive it, or the sink would still count as served.
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Drainer {
    fn start(pool: PgPool, sink: SinkKind, metrics: Metrics) -> Drainer {
        let wake = std::sync::Arc::new(tokio::sync::Notify::new());
        let listening = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (waker, up) = (wake.clone(), listening.clone());
        let task = tokio::spawn(async move {
            let Some(mut listener) = listen(pool, sink).await else {
                return;
            };
            up.store(true, std::sync::atomic::Ordering::Relaxed);
            // Ends when sqlx cannot reconnect the listener. Notifications
            // for another sink's relays are read (so they do not pile up)
            // but wake nothing here.
            loop {
                match listener.recv().await {
                    Ok(n) if n.payload() == sink.as_str() => {
                        metrics.record_relay_notification(sink.as_str());
                        waker.notify_one();
                    }
                    Ok(_) => {}
                    Err(err) => {
                        warn!(%sink, %err, "the relay's LISTEN connection failed");
                        return;
                    }
                }
            }
        });
        Drainer {
            task,
            wake,
            listening,
        }
    }
}

/// Batches whose payloads a relay holds at once at most ([`Relay::drain`]):
/// the one claimed ahead, the one being sent (its rows and the broker
/// client's copy), and the client's copy of the one awaiting its
/// acknowledgements.
pub const BATCHES_IN_MEMORY: u64 = 4;

/// The most payload bytes a relay holds at once: [`BATCHES_IN_MEMORY`]
/// batches of at most `batch_bytes`, or of one message up to
/// `max_message_bytes` when that is larger (a batch always has its first
/// row). Not counted: the process's own memory, and the read buffer of each
/// database connection, which keeps the size of the largest row it read.
pub fn payload_bound(batch_bytes: i64, max_message_bytes: usize) -> u64 {
    let batch = u64::try_from(batch_bytes)
        .unwrap_or(0)
        .max(max_message_bytes as u64);
    BATCHES_IN_MEMORY.saturating_mul(batch)
}

/// How often a relay whose broker blocks publishers looks again.
const BLOCKED_POLL: Duration = Duration::from_millis(500);

/// What a batch's mark may take at most: [`mark_reserve`].
pub const MARK_RESERVE: Duration = Duration::from_secs(5);

/// The end of a batch's in-flight lease kept for its mark: the batch is
/// done with the broker by then ([`Deadline`]). [`MARK_RESERVE`], or a
/// quarter of a shorter lease's.
pub fn mark_reserve(in_flight_lease: Duration) -> Duration {
    MARK_RESERVE.min(in_flight_lease / 4)
}

/// Beyond three ack timeouts, what a healthy batch in flight may still
/// take: the Kafka delivery reports' grace, and [`MARK_RESERVE`].
pub const IN_FLIGHT_MARGIN: Duration = Duration::from_secs(10);

/// What a batch takes at most while the broker answers every call within
/// `ack_timeout`, and so what `--in-flight-lease` must exceed: it waits for
/// the batch before it (pipelined: up to one ack timeout), for room to send
/// or a connection (one more), for its acknowledgements (one more), and is
/// marked. The lease itself is the hard bound, whatever the broker does
/// (destination set-up, reconnects, a broker that stops answering or blocks
/// publishers): a batch is given up at its [`Deadline`] and a mark after its
/// lease marks nothing. With a lease shorter than this bound healthy batches
/// would be given up and sent again.
pub fn in_flight_bound(ack_timeout: Duration) -> Duration {
    ack_timeout * 3 + IN_FLIGHT_MARGIN
}

/// The `application_name` of a relay's LISTEN connection for `sink`: how
/// the stats tell a sink some relay serves (see
/// [`crate::stats::snapshot::unserved_routes`]).
pub fn relay_application_name(sink: SinkKind) -> String {
    format!("{RELAY_APPLICATION_PREFIX}{sink}")
}

/// What [`relay_application_name`] puts before the sink.
pub const RELAY_APPLICATION_PREFIX: &str = "almanac-relay/";

/// One whole re-drive sweep over every candidate (see [`Relay::redrive`],
/// which spreads a sweep over its rounds).
pub async fn redrive(pool: &PgPool, sink: SinkKind, after: Duration) -> Result<u64, RelayError> {
    let (mut total, mut from) = (0, None);
    loop {
        let step = routing::redrive(pool, sink.as_str(), after, from).await?;
        total += step.redriven;
        match step.next {
            Some(_) => from = step.next,
            None => return Ok(total),
        }
    }
}

/// Backlog, in-flight, oldest unpublished and failed rows per sink, for
/// `almanac stats` and the metrics.
pub async fn outbox_stats(pool: &PgPool) -> Result<Vec<SinkOutboxStats>, RelayError> {
    Ok(outbox::stats(&mut *pool.acquire().await?).await?)
}
