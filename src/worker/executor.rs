//! The executor: how a claimed job is run to a recorded outcome, the same way
//! for a polling [`super::Worker`] and for a broker [`crate::consumer`].
//!
//! - **Slots.** At most `concurrency` jobs are in flight; a slot is taken
//!   before a job is claimed and given back only once its outcome is recorded
//!   (or given up), so a process never holds more leases than it can serve.
//!   A job that a completion claimed ([`Successor`]: the next of an ordering
//!   key) takes the slot of the completed job that released it, handed over
//!   without being freed; a completion releases at most one job per job it
//!   completed.
//! - **One heartbeat loop** renews every lease in flight, outcomes still being
//!   written included, in one statement every `lease / 3`. A lease the
//!   database no longer grants is lost: the handler's
//!   [`super::JobContext::cancelled`] fires.
//! - **The local lease deadline.** The executor remembers when the last
//!   successful renewal of each lease was *sent* (the claim counts as the
//!   first). Once `sent + lease - margin` passes without a newer renewal, it
//!   cancels the handler itself, whatever the database is doing: cut off,
//!   frozen or slow. The margin is **a fifth of the lease** (6 s of the
//!   default 30 s), because:
//!   - the database computed `lease_until` on receipt, so it is never earlier
//!     than `sent + lease` (local time is the monotonic clock, whose rate
//!     error is parts per million), and the handler is cancelled with a fifth
//!     of the lease still left on the database's clock: time for a command's
//!     process group to be killed, or a Rust handler to return, before the
//!     reaper can even see the lease expire;
//!   - a handler that ignores cancellation is dropped (abandoned, its future
//!     no longer polled; a command is killed) one margin later, at
//!     `sent + lease`, the earliest instant the lease can expire;
//!   - with renewals every third of the lease, two renewals in a row (at a
//!     third and at two thirds) can fail before a handler is cancelled, so a
//!     single lost heartbeat never stops a healthy job.
//! - **An operator's cancel stops the handler within 2 s, on any host.** A
//!   listener ([`cancels`]) hears `almanac jobs cancel`'s `NOTIFY` and each
//!   heartbeat reports cancel requests (the net for a lost notification:
//!   within a third of the lease). The handler is cancelled at once and
//!   dropped [`CANCEL_GRACE`] later if it has not returned (a command's
//!   group is killed at once). Whatever it returned, or if it was dropped,
//!   the job is recorded `cancelled` ([`Executed::Cancelled`]); if it
//!   returned `Ok` first, `done` is the truth and stays.
//! - **Snooze.** A handler's [`HandlerError::Snooze`] is written by
//!   [`queue::snooze`]: `ready` later, the attempt given back
//!   ([`Executed::Snoozed`]).
//! - **Handlers see the deadline.** Each renewal moves the job's local
//!   deadline, and the handler is told through
//!   [`super::JobContext::deadlines`]: the exec handler forwards it to the
//!   watchdog process beside its command ([`super::watchdog`]), which kills
//!   the command's process group at that deadline even when this process is
//!   stopped and can cancel nothing.
//! - **Outcomes survive blips.** Successes are completed in batches (one
//!   statement for many jobs), shutdown releases likewise, failures one by
//!   one. A write that fails or gets no answer within `lease / 3` is retried,
//!   paced by [`Retry`], with the same lease token while the job stays in the
//!   heartbeat set, until the job's local lease deadline. Only then is the
//!   outcome given up and counted as a lost lease. A write that failed in
//!   transit may have committed: when its retry finds the lease gone, the
//!   job's status decides whether it was ours (e.g. `done` after a complete).
//! - **Shutdown.** [`Executor::shutdown`]: take no more jobs, let running
//!   handlers finish within `shutdown_deadline`, then cancel them; those that
//!   still run a second later (or a margin, if shorter) are dropped. Jobs
//!   whose handlers were dropped or failed with a retryable error after the
//!   deadline are released: `ready` again at once, or `dead` when their
//!   attempts are used up. Outcomes still being written get their retries
//!   (bounded by their lease deadline) before the executor stops.
//! - **Tracing** (off unless the worker or consumer was given a tracer):
//!   each attempt gets an `almanac.execute` span when it is spawned (the
//!   handler reads its context in [`JobContext::traceparent`]), ended with
//!   the outcome when the flight is settled (`executor/spans.rs`).
//! - **Limit.** A handler future that is dropped stops being polled, but
//!   threads or tasks it spawned itself are not stopped. A database outage
//!   longer than the lease loses the outcome: the reaper takes the job back
//!   and it runs again (handlers must be idempotent). A process that dies
//!   records nothing; its leases expire.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

mod cancels;
mod heartbeat;
mod record;
mod spans;

use heartbeat::heartbeat;
use record::{record, Outcome, Write};

use super::{failure_of, invoke, Handler, HandlerError, JobContext, WorkerConfig};
use crate::metrics::{Metrics, Outcome as Counted};
use crate::queue::{self, CancelRequest, Failure, Job, QueueError};
use crate::role::Valid;
use crate::telemetry::{Span, TraceContext, Tracer};

/// How long before the lease may run out the executor cancels a handler
/// whose lease it could not renew; see the module doc for why a fifth.
pub fn lease_margin(lease: Duration) -> Duration {
    lease / 5
}

/// Hands back claimed jobs that were never started (`what`: why, for the
/// log), in one statement, with their attempt restored and their kinds
/// notified; what cannot be handed back within `within` returns when its
/// lease expires.
pub(crate) async fn hand_back(
    pool: PgPool,
    leases: Vec<(i64, Uuid)>,
    within: Duration,
    what: &str,
) {
    if let Err(err) = bounded(within, queue::unclaim_many(&pool, &leases)).await {
        warn!(
            %err,
            jobs = leases.len(),
            "handing back jobs {what} failed; they return when their leases expire"
        );
    }
}

/// How long a handler whose job an operator cancelled may take to return
/// after its [`JobContext::cancelled`] fired before it is dropped (a command
/// is killed at once): so a cancel stops every handler within 2 s.
pub const CANCEL_GRACE: Duration = Duration::from_secs(1);

/// How a claimed job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Executed {
    Completed,
    /// Failed; `ready` again after its backoff.
    Retried,
    /// Failed for good, or released with its attempts used up.
    Dead,
    /// The lease was lost (or could not be kept) before the outcome was recorded.
    Lost,
    /// Given back to `ready` at shutdown.
    Released,
    /// Stopped on an operator's cancel request, and recorded `cancelled`.
    Cancelled,
    /// Put back for later by its handler ([`HandlerError::Snooze`]), its
    /// attempt given back.
    Snoozed,
}

/// What a worker (or a consumer's executions) did before it stopped.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WorkerReport {
    pub completed: u64,
    pub retried: u64,
    pub dead: u64,
    /// Outcomes the fence refused because the lease was lost, or that could
    /// not be recorded before the local lease deadline.
    pub lost: u64,
    /// Jobs given back to `ready` at shutdown.
    pub released: u64,
    /// Jobs stopped on an operator's cancel request.
    pub cancelled: u64,
    /// Jobs their handlers put back for later.
    pub snoozed: u64,
}

#[derive(Default)]
struct Counters {
    completed: AtomicU64,
    retried: AtomicU64,
    dead: AtomicU64,
    lost: AtomicU64,
    released: AtomicU64,
    cancelled: AtomicU64,
    snoozed: AtomicU64,
}

impl Counters {
    fn report(&self) -> WorkerReport {
        WorkerReport {
            completed: self.completed.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead: self.dead.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
            snoozed: self.snoozed.load(Ordering::Relaxed),
        }
    }
}

/// A job between claim and recorded outcome.
struct Flight {
    token: Uuid,
    kind: String,
    /// The job has an ordering key: its completion may release the next.
    ordered: bool,
    attempt: i32,
    cancel: CancellationToken,
    /// An operator's cancel request, once this process learnt of it.
    requested: Option<CancelRequest>,
    /// What [`JobContext::cancel_requested`] reads.
    requested_flag: Arc<AtomicBool>,
    /// When the last successful renewal (or the claim) was sent.
    renewed: Instant,
    /// The local lease deadline, `renewed + lease - margin`, as the handler
    /// sees it ([`JobContext::deadlines`]).
    deadline: watch::Sender<Instant>,
    /// When the handler was handed the job.
    started: Instant,
    /// When the handler returned and its outcome went to the recorder.
    /// Heartbeats stop renewing a lease whose outcome has been pending a
    /// whole lease, so an outcome that can never be written (a value the
    /// database rejects every time) reaches its local deadline and is given
    /// up, instead of holding the job `running` and its slot forever.
    returned: Option<Instant>,
    reply: Option<oneshot::Sender<Executed>>,
    /// The attempt's `almanac.execute` span (tracing on), ended when the
    /// flight is settled, with its outcome.
    span: Option<Span>,
    /// Freed when the flight is settled (or handed to a successor).
    slot: OwnedSemaphorePermit,
}

#[derive(Debug, thiserror::Error)]
enum Unanswered {
    #[error(transparent)]
    Db(#[from] QueueError),
    #[error("no answer from the database within {0:?}")]
    TimedOut(Duration),
}

impl Unanswered {
    /// The database refused the statement whole: a lock wait past the
    /// connection's lock timeout, or a deadlock. Nothing was written.
    fn refused(&self) -> bool {
        matches!(
            self,
            Unanswered::Db(QueueError::Db(sqlx::Error::Database(e)))
                if matches!(e.code().as_deref(), Some("55P03" | "40P01"))
        )
    }
}

async fn bounded<T>(
    within: Duration,
    op: impl Future<Output = Result<T, QueueError>>,
) -> Result<T, Unanswered> {
    match tokio::time::timeout(within, op).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(Unanswered::TimedOut(within)),
    }
}

struct Inner {
    pool: PgPool,
    config: Valid<WorkerConfig>,
    metrics: Metrics,
    tracer: Tracer,
    margin: Duration,
    slots: Arc<Semaphore>,
    flights: Mutex<HashMap<i64, Flight>>,
    counters: Counters,
    /// The shutdown deadline passed: handlers are cancelled and a retryable
    /// failure releases the job instead of scheduling a retry.
    giving_up: CancellationToken,
    /// The grace after that passed too: handlers still running are dropped.
    kill: CancellationToken,
    /// Completions claim the jobs they release for this executor's worker
    /// ([`Successor`]); cleared when shutdown begins.
    claiming: Arc<AtomicBool>,
}

/// Outcome recorders, each on its own connection ([`record`]'s module):
/// with two, the ordering figure of `almanac bench` went from 0.30-0.33 to
/// 0.42-0.43 (with completions claiming successors; neither alone moved it).
const RECORDERS: usize = 2;

/// Where a worker of `kinds` takes the jobs its completions claim.
#[derive(Clone)]
pub(crate) struct Successors {
    pub to: mpsc::UnboundedSender<Successor>,
    pub kinds: Vec<String>,
}

/// A job that a completion released and claimed for the worker that
/// completed its predecessor (`queue::complete_many_claiming`), to run in
/// the slot that predecessor held, under the lease the completion (sent at
/// `sent`) took.
pub(crate) struct Successor {
    pub job: Job,
    pub sent: Instant,
    pub slot: OwnedSemaphorePermit,
}

struct State {
    closed: bool,
    tasks: JoinSet<()>,
    outcomes: Option<mpsc::UnboundedSender<Outcome>>,
    recorders: Vec<JoinHandle<()>>,
    heartbeat: Option<(JoinHandle<()>, CancellationToken)>,
    /// The cancel listener ([`cancels`]); stops with the heartbeat.
    listener: Option<JoinHandle<()>>,
    /// [`Inner::claiming`], cleared when this is dropped too.
    claiming: Arc<AtomicBool>,
}

/// Dropped with the last handle (say, an embedding application's timeout
/// dropped `Worker::run`): the job tasks in the `JoinSet` are aborted, so
/// their handlers are dropped (commands killed), and the heartbeat stops, so
/// no lease is renewed for a handler that no longer exists; the leases
/// expire and the reaper takes the jobs back. The recorders, which finish
/// the outcomes they hold, claim no more successors.
impl Drop for State {
    fn drop(&mut self) {
        self.claiming.store(false, Ordering::Release);
        if let Some((_, stop)) = &self.heartbeat {
            stop.cancel();
        }
    }
}

/// Runs claimed jobs; cheap to clone (one executor, many handles).
#[derive(Clone)]
pub(crate) struct Executor {
    inner: Arc<Inner>,
    state: Arc<Mutex<State>>,
}

impl Executor {
    /// Starts the heartbeat loop and the outcome recorders. With
    /// `successors`, completions claim the jobs they release when a claim by
    /// this worker would take them anyway, and send them there to be run
    /// ([`Executor::spawn`]); a worker passes it, a broker consumer (whose
    /// jobs come as messages) does not.
    pub fn start(
        pool: PgPool,
        config: Valid<WorkerConfig>,
        metrics: Metrics,
        tracer: Tracer,
        successors: Option<Successors>,
    ) -> Executor {
        let inner = Arc::new(Inner {
            pool,
            metrics,
            tracer,
            margin: lease_margin(config.lease),
            slots: Arc::new(Semaphore::new(config.concurrency)),
            config,
            flights: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            giving_up: CancellationToken::new(),
            kill: CancellationToken::new(),
            claiming: Arc::new(AtomicBool::new(successors.is_some())),
        });
        let (outcomes, rx) = mpsc::unbounded_channel();
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let recorders: Vec<JoinHandle<()>> = (0..RECORDERS)
            .map(|_| tokio::spawn(record(inner.clone(), rx.clone(), successors.clone())))
            .collect();
        let stop = CancellationToken::new();
        let heartbeat = tokio::spawn(heartbeat(inner.clone(), stop.clone()));
        let listener = inner
            .config
            .listen
            .then(|| tokio::spawn(cancels::listen(inner.clone(), stop.clone())));
        let claiming = inner.claiming.clone();
        Executor {
            inner,
            state: Arc::new(Mutex::new(State {
                closed: false,
                tasks: JoinSet::new(),
                outcomes: Some(outcomes),
                recorders,
                heartbeat: Some((heartbeat, stop)),
                listener,
                claiming,
            })),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("executor state lock")
    }

    pub fn free_slots(&self) -> usize {
        self.inner.slots.available_permits()
    }

    /// Waits until `n` slots are free at once (`n` at most `concurrency`).
    pub async fn slots(&self, n: usize) -> OwnedSemaphorePermit {
        self.inner
            .slots
            .clone()
            .acquire_many_owned(u32::try_from(n).unwrap_or(u32::MAX))
            .await
            .expect("the slot semaphore is never closed")
    }

    /// A free slot now, if there is one.
    pub fn try_slot(&self) -> Option<OwnedSemaphorePermit> {
        self.inner.slots.clone().try_acquire_owned().ok()
    }

    /// Waits for a free slot.
    pub async fn slot(&self) -> OwnedSemaphorePermit {
        self.inner
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the slot semaphore is never closed")
    }

    /// Runs `job` (claimed by a statement sent at `sent`) in `slot`. The
    /// receiver tells how it ended. After [`Executor::shutdown`] began, the
    /// job is handed back unrun: release it with [`Executor::release_unstarted`].
    /// `via` is the trace context the job came with besides its own (a
    /// broker message's publish span): its first attempt's span is a child
    /// of that, else of the job's `traceparent` ([`crate::telemetry`]).
    pub fn spawn(
        &self,
        job: Job,
        sent: Instant,
        handler: Arc<dyn Handler>,
        slot: OwnedSemaphorePermit,
        via: Option<TraceContext>,
    ) -> Result<oneshot::Receiver<Executed>, Box<Job>> {
        let mut state = self.state();
        let Some(outcomes) = state.outcomes.clone().filter(|_| !state.closed) else {
            return Err(Box::new(job));
        };
        let token = job.lease_token.expect("a claimed job holds a lease");
        let cancel = CancellationToken::new();
        let requested_flag = Arc::new(AtomicBool::new(false));
        let (reply, rx) = oneshot::channel();
        let (deadline, deadlines) = watch::channel(self.inner.local_deadline(sent));
        let span = spans::execution(&self.inner.tracer, &job, via);
        let trace = span.as_ref().map(|s| s.context);
        let displaced = self.inner.flights().insert(
            job.id,
            Flight {
                token,
                kind: job.kind.clone(),
                ordered: job.ordering_key.is_some(),
                attempt: job.attempts,
                cancel: cancel.clone(),
                requested: None,
                requested_flag: requested_flag.clone(),
                renewed: sent,
                deadline,
                started: Instant::now(),
                returned: None,
                reply: Some(reply),
                span,
                slot,
            },
        );
        if let Some(mut stale) = displaced {
            // A flight of an earlier claim of this job, not settled yet: its
            // lease is gone (the job was claimed again), so is its outcome.
            stale.cancel.cancel();
            self.inner.count(
                job.id,
                &stale.kind,
                stale.attempt,
                Executed::Lost,
                Some("the job was claimed again before this attempt ended"),
            );
            self.inner.end_span(stale.span.take(), Executed::Lost);
            if let Some(reply) = stale.reply.take() {
                let _ = reply.send(Executed::Lost);
            }
        }
        while state.tasks.try_join_next().is_some() {}
        let ctx = JobContext::new(job, cancel.clone())
            .with_deadline(deadlines, self.inner.margin)
            .with_cancel_flag(requested_flag)
            .with_trace(trace);
        state.tasks.spawn(execute(
            self.inner.clone(),
            ctx,
            token,
            cancel,
            handler,
            outcomes,
        ));
        Ok(rx)
    }

    /// Releases a job claimed while the executor was shutting down.
    pub async fn release_unstarted(&self, job: Box<Job>) -> Executed {
        let (id, kind, attempt) = (job.id, job.kind.clone(), job.attempts);
        let token = job.lease_token.expect("a claimed job holds a lease");
        // Never run, so the claim's attempt is given back: a job is not
        // buried for an attempt it did not get (max_attempts = 1 included).
        let unclaimed = bounded(
            self.inner.config.lease / 3,
            queue::unclaim(&self.inner.pool, id, token),
        )
        .await;
        let executed = match unclaimed {
            Ok(true) => Executed::Released,
            Ok(false) => Executed::Lost,
            Err(err) => {
                warn!(job_id = id, %err, "could not release a job claimed during shutdown; its lease will expire");
                Executed::Lost
            }
        };
        self.inner.count(id, &kind, attempt, executed, None);
        executed
    }

    /// What this executor did so far.
    pub fn report(&self) -> WorkerReport {
        self.inner.counters.report()
    }

    /// Stops as the module doc says; a second call only reports.
    pub async fn shutdown(&self) -> WorkerReport {
        let (mut tasks, recorder, heartbeat, listener) = {
            let mut state = self.state();
            state.closed = true;
            self.inner.claiming.store(false, Ordering::Release);
            // Running tasks hold their own senders; the channel closes when
            // the last of them has sent its outcome.
            state.outcomes = None;
            (
                std::mem::take(&mut state.tasks),
                std::mem::take(&mut state.recorders),
                state.heartbeat.take(),
                state.listener.take(),
            )
        };
        // Should this future be dropped half-way, the heartbeat stops with
        // it (and the tasks, aborted with their JoinSet).
        let heartbeat = heartbeat.map(|(handle, stop)| (handle, stop.drop_guard()));
        let deadline = self.inner.config.shutdown_deadline;
        if !tasks.is_empty() {
            info!(
                running = tasks.len(),
                deadline_ms = deadline.as_millis() as u64,
                "stopping: waiting for running handlers"
            );
            if !wait_all(&mut tasks, deadline).await {
                warn!(
                    running = tasks.len(),
                    "shutdown deadline passed; cancelling handlers"
                );
                self.inner.giving_up.cancel();
                for flight in self.inner.flights().values() {
                    flight.cancel.cancel();
                }
                let grace = Duration::from_secs(1).min(deadline).min(self.inner.margin);
                if !wait_all(&mut tasks, grace).await {
                    self.inner.kill.cancel();
                    while tasks.join_next().await.is_some() {}
                }
            }
        }
        for recorder in recorder {
            let _ = recorder.await;
        }
        if let Some((heartbeat, stop)) = heartbeat {
            drop(stop);
            let _ = heartbeat.await;
        }
        if let Some(listener) = listener {
            // Stopped with the heartbeat; should that have stopped already
            // (a second handle's shutdown), it is stopped here.
            listener.abort();
            let _ = listener.await;
        }
        self.report()
    }
}

async fn wait_all(tasks: &mut JoinSet<()>, within: Duration) -> bool {
    tokio::time::timeout(within, async { while tasks.join_next().await.is_some() {} })
        .await
        .is_ok()
}

impl Inner {
    fn flights(&self) -> MutexGuard<'_, HashMap<i64, Flight>> {
        self.flights.lock().expect("flights lock")
    }

    /// When the handler of `id` under `token` must be cancelled unless its
    /// lease is renewed (now, if that flight is gone).
    fn deadline(&self, id: i64, token: Uuid) -> Instant {
        let renewed = self
            .flights()
            .get(&id)
            .filter(|f| f.token == token)
            .map(|f| f.renewed);
        renewed.map_or_else(Instant::now, |at| self.local_deadline(at))
    }

    /// The cancel request of `id`'s flight under `token`, if it has one.
    fn cancel_request(&self, id: i64, token: Uuid) -> Option<CancelRequest> {
        self.flights()
            .get(&id)
            .filter(|f| f.token == token)
            .and_then(|f| f.requested.clone())
    }

    /// How long a cancelled handler of `id` may take to return before it is
    /// dropped: a lease margin, or at most [`CANCEL_GRACE`] when an operator
    /// cancelled the job.
    fn grace(&self, id: i64, token: Uuid) -> Duration {
        match self.cancel_request(id, token) {
            Some(_) => self.margin.min(CANCEL_GRACE),
            None => self.margin,
        }
    }

    /// Acts on an operator's cancel request: if `request` names a job in
    /// flight here that has not had it yet, its handler is cancelled.
    /// Returns whether it was.
    fn request_cancel(&self, request: CancelRequest) -> bool {
        let mut flights = self.flights();
        let Some(flight) = flights
            .get_mut(&request.id)
            .filter(|f| f.requested.is_none())
        else {
            return false;
        };
        info!(
            job_id = request.id,
            kind = %flight.kind,
            request = %request,
            "cancel requested; stopping the handler"
        );
        flight.requested_flag.store(true, Ordering::Release);
        flight.requested = Some(request);
        flight.cancel.cancel();
        true
    }

    /// The leases in flight, as `(id, token)`.
    fn leases(&self) -> Vec<(i64, Uuid)> {
        self.flights()
            .iter()
            .map(|(id, f)| (*id, f.token))
            .collect()
    }

    /// The local lease deadline of a lease renewed (or claimed) by a
    /// statement sent at `sent`.
    fn local_deadline(&self, sent: Instant) -> Instant {
        sent + self.config.lease.saturating_sub(self.margin)
    }

    /// The one place an outcome is counted and logged.
    fn count(&self, id: i64, kind: &str, attempt: i32, executed: Executed, detail: Option<&str>) {
        let c = &self.counters;
        let detail = detail.unwrap_or("");
        match executed {
            Executed::Completed => {
                c.completed.fetch_add(1, Ordering::Relaxed);
                debug!(job_id = id, kind, attempt, "job done");
            }
            Executed::Retried => {
                c.retried.fetch_add(1, Ordering::Relaxed);
                warn!(
                    job_id = id,
                    kind,
                    attempt,
                    error = detail,
                    "job failed; will retry"
                );
            }
            Executed::Dead => {
                c.dead.fetch_add(1, Ordering::Relaxed);
                warn!(
                    job_id = id,
                    kind,
                    attempt,
                    error = detail,
                    "job failed for good; now dead"
                );
            }
            Executed::Lost => {
                c.lost.fetch_add(1, Ordering::Relaxed);
                warn!(
                    job_id = id,
                    kind,
                    attempt,
                    reason = detail,
                    "lease lost before the outcome was recorded; the job may run again"
                );
            }
            Executed::Released => {
                c.released.fetch_add(1, Ordering::Relaxed);
                info!(job_id = id, kind, attempt, "job released back to ready");
            }
            Executed::Cancelled => {
                c.cancelled.fetch_add(1, Ordering::Relaxed);
                info!(
                    job_id = id,
                    kind,
                    attempt,
                    request = detail,
                    "job cancelled: its handler was stopped"
                );
            }
            Executed::Snoozed => {
                c.snoozed.fetch_add(1, Ordering::Relaxed);
                info!(
                    job_id = id,
                    kind,
                    attempt,
                    detail,
                    "job snoozed: back to ready later, its attempt given back"
                );
            }
        }
    }

    /// Ends an attempt's span (if traced) with how the attempt ended.
    fn end_span(&self, span: Option<Span>, executed: Executed) {
        if let Some(span) = span {
            spans::end(&self.tracer, span, executed);
        }
    }

    /// Ends a flight: counts its outcome, tells whoever waits, frees its slot.
    fn settle(&self, id: i64, token: Uuid, executed: Executed, detail: Option<&str>) {
        drop(self.settle_keeping_slot(id, token, executed, detail));
    }

    /// [`Inner::settle`], handing back the flight's slot instead of freeing it.
    fn settle_keeping_slot(
        &self,
        id: i64,
        token: Uuid,
        executed: Executed,
        detail: Option<&str>,
    ) -> Option<OwnedSemaphorePermit> {
        let removed = {
            let mut flights = self.flights();
            match flights.get(&id) {
                Some(flight) if flight.token == token => flights.remove(&id),
                _ => None,
            }
        };
        let mut flight = removed?;
        let request = flight.requested.as_ref().map(ToString::to_string);
        if let (Some(request), Executed::Completed) = (&request, executed) {
            info!(
                job_id = id,
                request = %request,
                "the handler finished before the cancel took effect; the job stays done"
            );
        }
        // A cancel is logged with who asked and why.
        let detail = match executed {
            Executed::Cancelled => request.as_deref().or(detail),
            _ => detail,
        };
        self.count(id, &flight.kind, flight.attempt, executed, detail);
        let counted = match executed {
            Executed::Completed => Some(Counted::Completed),
            Executed::Retried => Some(Counted::Retried),
            Executed::Dead => Some(Counted::Dead),
            Executed::Lost => Some(Counted::LeaseLost),
            Executed::Cancelled => Some(Counted::Cancelled),
            Executed::Snoozed => Some(Counted::Snoozed),
            Executed::Released => None,
        };
        if let Some(counted) = counted {
            self.metrics
                .record_outcome(&flight.kind, counted, flight.started.elapsed());
        }
        self.end_span(flight.span.take(), executed);
        if let Some(reply) = flight.reply.take() {
            let _ = reply.send(executed);
        }
        Some(flight.slot)
    }
}

/// Runs one handler under the local lease deadline and sends its outcome.
async fn execute(
    inner: Arc<Inner>,
    ctx: JobContext,
    token: Uuid,
    cancel: CancellationToken,
    handler: Arc<dyn Handler>,
    outcomes: mpsc::UnboundedSender<Outcome>,
) {
    let job = &ctx.job;
    let (id, attempt) = (job.id, job.attempts);
    debug!(job_id = id, kind = %job.kind, attempt, "running");
    let waited = (chrono::Utc::now() - job.run_at)
        .to_std()
        .unwrap_or_default();
    inner.metrics.record_started(&job.kind, waited);
    let work = invoke(handler.as_ref(), ctx);
    tokio::pin!(work);
    // Set once the handler is cancelled: when it is dropped if still running.
    let mut abandon_at: Option<Instant> = None;
    let result = loop {
        let wake = abandon_at.unwrap_or_else(|| inner.deadline(id, token));
        tokio::select! {
            result = &mut work => break Some(result),
            _ = inner.kill.cancelled() => break None,
            _ = cancel.cancelled(), if abandon_at.is_none() => {
                abandon_at = Some(Instant::now() + inner.grace(id, token));
            }
            _ = sleep_until(wake) => {
                if abandon_at.is_some() {
                    break None;
                }
                if inner.deadline(id, token) > wake {
                    continue;
                }
                warn!(
                    job_id = id,
                    attempt,
                    margin_ms = inner.margin.as_millis() as u64,
                    "lease not renewed in time; cancelling the handler before the lease can run out"
                );
                cancel.cancel();
            }
        }
    };
    // A job with a cancel request ends `cancelled` however its attempt
    // ends but `done` (the fence's statements see to it); its `last_error`
    // says who stopped it.
    let requested = inner.cancel_request(id, token);
    let write = match result {
        None if inner.giving_up.is_cancelled() => Write::Release(
            "released at shutdown: the handler did not finish within the shutdown deadline".into(),
        ),
        None => {
            match &requested {
                Some(request) => Write::Fail(Failure::Permanent {
                    error: format!(
                        "{request}; the handler did not stop within {:?} and was dropped",
                        inner.grace(id, token)
                    ),
                }),
                None => {
                    inner.settle(
                    id,
                    token,
                    Executed::Lost,
                    Some("the handler ignored cancellation and was dropped at the end of its lease"),
                );
                    return;
                }
            }
        }
        Some(Ok(())) => Write::Complete,
        Some(Err(HandlerError::Snooze { after })) => Write::Snooze(after),
        Some(Err(err @ HandlerError::Retry { .. })) if inner.giving_up.is_cancelled() => {
            Write::Release(format!(
                "released at shutdown before the handler finished: {}",
                err.chain()
            ))
        }
        Some(Err(err)) => {
            let failure = failure_of(&err, attempt, &inner.config.backoff);
            Write::Fail(match &requested {
                Some(request) => noted(failure, request),
                None => failure,
            })
        }
    };
    if let Some(flight) = inner.flights().get_mut(&id).filter(|f| f.token == token) {
        flight.returned = Some(Instant::now());
    }
    let _ = outcomes.send(Outcome {
        id,
        token,
        write,
        ambiguous: false,
    });
}

/// `failure` with `request` (who cancelled, and why) before its message.
fn noted(failure: Failure, request: &CancelRequest) -> Failure {
    match failure {
        Failure::Retry { delay, error } => Failure::Retry {
            delay,
            error: format!("{request}; the handler ended: {error}"),
        },
        Failure::Permanent { error } => Failure::Permanent {
            error: format!("{request}; the handler ended: {error}"),
        },
    }
}
