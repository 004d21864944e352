//! The worker's loops: claim, heartbeat, listen, record outcomes, shut down.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use uuid::Uuid;

use super::{Handler, HandlerError, JobContext, WorkerConfig};
use crate::metrics;
use crate::queue::{self, Claim, Fenced, JobStatus, NOTIFY_CHANNEL};

/// What a worker did before it stopped.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WorkerReport {
    pub completed: u64,
    pub retried: u64,
    pub dead: u64,
    /// Outcomes the fence refused because the lease was lost.
    pub lost: u64,
    /// Jobs given back to `ready` at shutdown.
    pub released: u64,
}

#[derive(Default)]
struct Counters {
    completed: AtomicU64,
    retried: AtomicU64,
    dead: AtomicU64,
    lost: AtomicU64,
    released: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn report(&self) -> WorkerReport {
        WorkerReport {
            completed: self.completed.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead: self.dead.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
        }
    }
}

/// A job between claim and recorded outcome.
struct InFlight {
    token: Uuid,
    cancel: CancellationToken,
}

struct Shared {
    pool: PgPool,
    config: WorkerConfig,
    inflight: Mutex<HashMap<i64, InFlight>>,
    counters: Counters,
}

impl Shared {
    fn leases(&self) -> Vec<(i64, Uuid)> {
        let inflight = self.inflight.lock().expect("inflight lock");
        inflight.iter().map(|(id, f)| (*id, f.token)).collect()
    }

    fn forget(&self, ids: impl IntoIterator<Item = i64>) {
        let mut inflight = self.inflight.lock().expect("inflight lock");
        for id in ids {
            inflight.remove(&id);
        }
    }
}

struct Outcome {
    id: i64,
    token: Uuid,
    attempt: i32,
    kind: String,
    ran: Duration,
    result: Result<(), HandlerError>,
    _slot: OwnedSemaphorePermit,
}

pub(super) async fn run(
    pool: PgPool,
    config: WorkerConfig,
    handlers: HashMap<String, Arc<dyn Handler>>,
    shutdown: CancellationToken,
) -> WorkerReport {
    let mut kinds: Vec<String> = handlers.keys().cloned().collect();
    kinds.sort();
    let shared = Arc::new(Shared {
        pool,
        config,
        inflight: Mutex::new(HashMap::new()),
        counters: Counters::default(),
    });
    let slots = Arc::new(Semaphore::new(shared.config.concurrency));
    let wake = Arc::new(Notify::new());
    let aux_stop = CancellationToken::new();
    let mut aux = JoinSet::new();
    if shared.config.listen {
        aux.spawn(listen(
            shared.pool.clone(),
            kinds.clone(),
            wake.clone(),
            aux_stop.clone(),
        ));
    }
    aux.spawn(heartbeat(shared.clone(), aux_stop.clone()));
    let (outcomes, outcome_rx) = mpsc::unbounded_channel();
    let recorder = tokio::spawn(record_outcomes(shared.clone(), outcome_rx));
    info!(kinds = ?kinds, concurrency = shared.config.concurrency, "worker started");

    let mut running = JoinSet::new();
    let mut claim_errors = 0u32;
    while !shutdown.is_cancelled() {
        while running.try_join_next().is_some() {}
        let free = slots.available_permits().min(shared.config.batch_size);
        if free == 0 {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                permit = slots.clone().acquire_owned() => drop(permit),
            }
            continue;
        }
        let claimed = queue::claim(
            &shared.pool,
            &Claim {
                kinds: &kinds,
                limit: free as i64,
                lease: shared.config.lease,
            },
        )
        .await;
        let jobs = match claimed {
            Ok(jobs) => {
                claim_errors = 0;
                jobs
            }
            Err(err) => {
                claim_errors += 1;
                let pause = Duration::from_millis(100 * 2u64.pow(claim_errors.min(7)));
                warn!(%err, retry_in_ms = pause.as_millis() as u64, "claim failed");
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = sleep(pause) => continue,
                }
            }
        };
        let filled = jobs.len() == free;
        for job in jobs {
            let slot = slots
                .clone()
                .try_acquire_owned()
                .expect("a free slot per claimed job");
            let token = job.lease_token.expect("a claimed job holds a lease");
            let cancel = CancellationToken::new();
            shared.inflight.lock().expect("inflight lock").insert(
                job.id,
                InFlight {
                    token,
                    cancel: cancel.clone(),
                },
            );
            let handler = handlers[&job.kind].clone();
            let outcomes = outcomes.clone();
            running.spawn(async move {
                let (id, attempt, kind) = (job.id, job.attempts, job.kind.clone());
                debug!(job_id = id, kind = %job.kind, attempt, "running");
                let waited = (chrono::Utc::now() - job.run_at)
                    .to_std()
                    .unwrap_or_default();
                metrics::record_started(&kind, waited);
                let started = std::time::Instant::now();
                let result = super::invoke(handler.as_ref(), JobContext::new(job, cancel)).await;
                let _ = outcomes.send(Outcome {
                    id,
                    token,
                    attempt,
                    kind,
                    ran: started.elapsed(),
                    result,
                    _slot: slot,
                });
            });
        }
        if filled {
            continue;
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = wake.notified() => {}
            _ = sleep(shared.config.poll_interval) => {}
        }
    }

    drain(&shared, &mut running).await;
    drop(outcomes);
    let _ = recorder.await;
    let left = shared.leases();
    if !left.is_empty() {
        match queue::release(
            &shared.pool,
            &left,
            "released at worker shutdown before the handler finished",
        )
        .await
        {
            Ok(ids) => {
                Counters::add(&shared.counters.released, ids.len() as u64);
                info!(
                    released = ids.len(),
                    "released unfinished jobs back to ready"
                );
            }
            Err(err) => {
                error!(%err, jobs = left.len(), "could not release unfinished jobs; the reaper will take them back when their leases expire")
            }
        }
    }
    aux_stop.cancel();
    while aux.join_next().await.is_some() {}
    let report = shared.counters.report();
    info!(?report, "worker stopped");
    report
}

/// Lets running handlers finish within the deadline; then cancels them, gives
/// them a moment, and aborts what is left.
async fn drain(shared: &Shared, running: &mut JoinSet<()>) {
    if running.is_empty() {
        return;
    }
    let deadline = shared.config.shutdown_deadline;
    info!(
        running = running.len(),
        deadline_ms = deadline.as_millis() as u64,
        "stopping: waiting for running handlers"
    );
    if wait_all(running, deadline).await {
        return;
    }
    warn!(
        running = running.len(),
        "shutdown deadline passed; cancelling handlers"
    );
    for flight in shared.inflight.lock().expect("inflight lock").values() {
        flight.cancel.cancel();
    }
    if !wait_all(running, Duration::from_secs(1).min(deadline)).await {
        running.abort_all();
        while running.join_next().await.is_some() {}
    }
}

async fn wait_all(running: &mut JoinSet<()>, within: Duration) -> bool {
    tokio::time::timeout(within, async {
        while running.join_next().await.is_some() {}
    })
    .await
    .is_ok()
}

/// Records outcomes, many successes per statement.
async fn record_outcomes(shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<Outcome>) {
    const MAX_BATCH: usize = 512;
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let (done, failed): (Vec<Outcome>, Vec<Outcome>) =
            batch.drain(..).partition(|o| o.result.is_ok());
        record_done(&shared, &done).await;
        for outcome in &failed {
            record_failure(&shared, outcome).await;
        }
        shared.forget(done.iter().chain(&failed).map(|o| o.id));
        // The outcomes (and their slots) drop here, after the write.
    }
}

async fn record_done(shared: &Shared, done: &[Outcome]) {
    if done.is_empty() {
        return;
    }
    let leases: Vec<(i64, Uuid)> = done.iter().map(|o| (o.id, o.token)).collect();
    let Some(held) = with_retries("complete", || queue::complete_many(&shared.pool, &leases)).await
    else {
        return;
    };
    Counters::add(&shared.counters.completed, held.len() as u64);
    let held: HashSet<i64> = held.into_iter().collect();
    for o in done {
        let outcome = if held.contains(&o.id) {
            metrics::Outcome::Completed
        } else {
            metrics::Outcome::LeaseLost
        };
        metrics::record_outcome(&o.kind, outcome, o.ran);
    }
    if held.len() < leases.len() {
        for (id, _) in leases.iter().filter(|(id, _)| !held.contains(id)) {
            Counters::add(&shared.counters.lost, 1);
            warn!(
                job_id = id,
                "handler succeeded but the lease was lost first; the job will run again"
            );
        }
    }
}

async fn record_failure(shared: &Shared, outcome: &Outcome) {
    let Err(err) = &outcome.result else { return };
    let failure = super::failure_of(err, outcome.attempt, &shared.config.backoff);
    let recorded = with_retries("fail", || {
        queue::fail(&shared.pool, outcome.id, outcome.token, &failure)
    })
    .await;
    let counted = match recorded {
        Some(Fenced::Held(JobStatus::Dead)) => Some(metrics::Outcome::Dead),
        Some(Fenced::Held(_)) => Some(metrics::Outcome::Retried),
        Some(Fenced::Lost) => Some(metrics::Outcome::LeaseLost),
        None => None,
    };
    if let Some(counted) = counted {
        metrics::record_outcome(&outcome.kind, counted, outcome.ran);
    }
    match recorded {
        Some(Fenced::Held(JobStatus::Dead)) => {
            Counters::add(&shared.counters.dead, 1);
            warn!(job_id = outcome.id, attempt = outcome.attempt, error = %err.chain(), "job failed for good; now dead");
        }
        Some(Fenced::Held(_)) => {
            Counters::add(&shared.counters.retried, 1);
            warn!(job_id = outcome.id, attempt = outcome.attempt, error = %err.chain(), "job failed; will retry");
        }
        Some(Fenced::Lost) => {
            Counters::add(&shared.counters.lost, 1);
            warn!(
                job_id = outcome.id,
                "handler failed after its lease was lost; outcome not recorded"
            );
        }
        None => {}
    }
}

/// Runs a write a few times over a short outage. When it still fails the
/// lease expires and the reaper takes the job back, so nothing is lost.
async fn with_retries<T, F, Fut>(what: &str, mut op: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, queue::QueueError>>,
{
    for attempt in 1..=4u32 {
        match op().await {
            Ok(value) => return Some(value),
            Err(err) if attempt < 4 => {
                warn!(%err, attempt, "recording the outcome ({what}) failed; retrying");
                sleep(Duration::from_millis(200 * u64::from(attempt))).await;
            }
            Err(err) => {
                error!(%err, "recording the outcome ({what}) failed; the lease will expire and the job will run again");
            }
        }
    }
    None
}

/// Keeps in-flight leases alive; cancels handlers whose lease was lost.
async fn heartbeat(shared: Arc<Shared>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(shared.config.lease / 3);
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let leases = shared.leases();
        if leases.is_empty() {
            continue;
        }
        match queue::heartbeat_many(&shared.pool, &leases, shared.config.lease).await {
            Ok(held) => {
                if held.len() == leases.len() {
                    continue;
                }
                let held: HashSet<i64> = held.into_iter().collect();
                let inflight = shared.inflight.lock().expect("inflight lock");
                for (id, token) in leases.iter().filter(|(id, _)| !held.contains(id)) {
                    // Only if the job was not recorded meanwhile.
                    if let Some(flight) = inflight.get(id).filter(|f| f.token == *token) {
                        warn!(job_id = id, "lease lost; cancelling the handler");
                        flight.cancel.cancel();
                    }
                }
            }
            Err(err) => warn!(%err, jobs = leases.len(), "heartbeat failed; leases may expire"),
        }
    }
}

/// Wakes the claim loop on `NOTIFY` for one of our kinds; reconnects with backoff.
/// The listener holds a connection of its own, outside the worker's pool, so
/// LISTEN never takes a connection that claims and completions need.
async fn listen(pool: PgPool, kinds: Vec<String>, wake: Arc<Notify>, stop: CancellationToken) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with((*pool.connect_options()).clone());
    let mut pause = Duration::from_millis(100);
    loop {
        let connected = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let mut listener = tokio::select! {
            _ = stop.cancelled() => return,
            connected = connected => match connected {
                Ok(listener) => listener,
                Err(err) => {
                    warn!(%err, "LISTEN failed; polling meanwhile");
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = sleep(pause) => {}
                    }
                    pause = (pause * 2).min(Duration::from_secs(10));
                    continue;
                }
            },
        };
        pause = Duration::from_millis(100);
        // Anything enqueued while we were not listening is found by this claim.
        wake.notify_one();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                received = listener.recv() => match received {
                    Ok(n) if kinds.iter().any(|k| k == n.payload()) => wake.notify_one(),
                    Ok(_) => {}
                    Err(err) => {
                        warn!(%err, "LISTEN connection lost; reconnecting");
                        break;
                    }
                },
            }
        }
    }
}
