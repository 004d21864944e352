//! The worker's own loops: claim into free slots, and listen for wake-ups.
//! Running, heartbeats, outcomes and shutdown are the [`Executor`]'s.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::time::{sleep, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::executor::{hand_back, Executor, Successor, Successors, WorkerReport};
use super::{Handler, WorkerConfig};
use crate::db;
use crate::metrics::Metrics;
use crate::queue::{self, Claim, QueueError, NOTIFY_CHANNEL};
use crate::retry::Retry;
use crate::role::Valid;

pub(super) async fn run(
    pool: PgPool,
    config: Valid<WorkerConfig>,
    metrics: Metrics,
    tracer: crate::telemetry::Tracer,
    handlers: HashMap<String, Arc<dyn Handler>>,
    shutdown: CancellationToken,
) -> WorkerReport {
    let mut kinds: Vec<String> = handlers.keys().cloned().collect();
    kinds.sort();
    let (successors, handed) = tokio::sync::mpsc::unbounded_channel();
    let executor = Executor::start(
        pool.clone(),
        config.clone(),
        metrics,
        tracer,
        Some(Successors {
            to: successors,
            kinds: kinds.clone(),
        }),
    );
    let handlers = Arc::new(handlers);
    // Jobs that our completions claimed as they released them (the next of
    // an ordering key): run at once, in the slot their predecessor held.
    // Aborted with this future (an embedding application's timeout), so
    // it does not keep the executor, and its heartbeats, alive.
    let mut chained = AbortOnDrop(tokio::spawn(run_successors(
        executor.clone(),
        handlers.clone(),
        handed,
    )));
    let wake = Arc::new(Notify::new());
    let listen_stop = CancellationToken::new();
    let listener = config.listen.then(|| {
        tokio::spawn(listen(
            pool.clone(),
            kinds.clone(),
            wake.clone(),
            listen_stop.clone(),
        ))
    });
    info!(kinds = ?kinds, concurrency = config.concurrency, "worker started");

    let mut retry = Retry::new(Duration::from_millis(100), Duration::from_secs(10));
    // A claim that gets no answer is abandoned: should it have committed,
    // its leases expire and the reaper takes the jobs back.
    let claim_within = config.lease / 3;
    let mut link = db::Held::of(&pool, claim_within).generic_index_plans();
    // While the last claim came back full (a backlog), the next one waits
    // until half a batch of slots is free: a claim costs a round trip
    // whatever its size, and claims of one or two jobs at a time as single
    // slots free up would make the round trips, not the handlers, the limit.
    // An idle worker claims as soon as it is woken, into any free slot. The
    // wait for half a batch is short: with slow handlers slots free slowly,
    // and they must not stay idle while jobs wait.
    let refill = (config.batch_size.min(config.concurrency) / 2).max(1);
    let mut backlog = false;
    // Whether one of our kinds has limits (`almanac limits`): a claim that
    // came back short may then have left due jobs behind for a limit, and
    // the worker claims again as soon as one of its own jobs ends (which
    // frees a slot of the limit too), and polls every [`LIMITED_POLL`].
    // Read at start and then at most once per `poll_interval`.
    let mut limited = has_limits(&mut link, &kinds).await.unwrap_or(false);
    let mut limits_read = Instant::now();
    while !shutdown.is_cancelled() {
        let want = if backlog { refill } else { 1 };
        if executor.free_slots() < want {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                slots = tokio::time::timeout(REFILL_WAIT, executor.slots(want)) => drop(slots),
            }
            if executor.free_slots() == 0 {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    slots = executor.slots(1) => drop(slots),
                }
            }
        }
        let free = executor.free_slots().min(config.batch_size);
        let sent = Instant::now();
        let claim = Claim {
            kinds: &kinds,
            limit: free as i64,
            lease: config.lease,
        };
        let claiming = claim_on(&mut link, &claim);
        // Not cut short by a stop request: a claim dropped half-way may
        // still commit, and its jobs would wait out their leases with an
        // attempt spent. It is bounded by `claim_within`; what it brings in
        // after a stop request is handed back.
        let claimed = tokio::time::timeout(claim_within, claiming).await;
        if shutdown.is_cancelled() {
            if let Ok(Ok(jobs)) = claimed {
                let leases = jobs.iter().filter_map(|j| j.lease()).collect();
                hand_back(pool.clone(), leases, claim_within, "claimed at shutdown").await;
            }
            break;
        }
        let jobs = match claimed {
            Ok(Ok(jobs)) => {
                retry.succeeded();
                jobs
            }
            failed => {
                link.discard();
                let err = match failed {
                    Ok(Err(err)) => err.to_string(),
                    _ => format!("no answer from the database within {claim_within:?}"),
                };
                warn!(%err, "claim failed; retrying");
                if retry.pause(&shutdown).await {
                    continue;
                }
                break;
            }
        };
        backlog = jobs.len() == free;
        for job in jobs {
            let slot = executor.try_slot().expect("a free slot per claimed job");
            let handler = handlers[&job.kind].clone();
            // Nobody waits for the outcome here: the executor records it.
            drop(
                executor
                    .spawn(job, sent, handler, slot, None)
                    .expect("the executor shuts down only after this loop"),
            );
        }
        if backlog {
            continue;
        }
        let free = executor.free_slots();
        let busy = free < config.concurrency;
        // A limit's slots also free up in other processes, and a rate's
        // tokens refill with time: a worker with limited kinds polls more
        // often.
        let poll = if limited {
            config.poll_interval.min(LIMITED_POLL)
        } else {
            config.poll_interval
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = wake.notified() => {}
            _ = executor.slots(free + 1), if limited && busy => {}
            _ = sleep(poll) => {
                if limits_read.elapsed() >= config.poll_interval {
                    limited = has_limits(&mut link, &kinds).await.unwrap_or(limited);
                    limits_read = Instant::now();
                }
            }
        }
    }

    executor.shutdown().await;
    // The recorder has stopped, and with it the successors' channel; what
    // was still in it was given back, and is in the report.
    let _ = (&mut chained.0).await;
    let report = executor.report();
    listen_stop.cancel();
    if let Some(listener) = listener {
        let _ = listener.await;
    }
    info!(?report, "worker stopped");
    report
}

/// Wakes the claim loop on `NOTIFY` for one of our kinds (or `*`: every
/// kind was resumed); reconnects with backoff.
/// The listener holds a connection of its own, outside the worker's pool, so
/// LISTEN never takes a connection that claims and completions need.
async fn listen(pool: PgPool, kinds: Vec<String>, wake: Arc<Notify>, stop: CancellationToken) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with((*pool.connect_options()).clone());
    let mut retry = Retry::reconnect();
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
                    if !retry.pause(&stop).await {
                        return;
                    }
                    continue;
                }
            },
        };
        retry.succeeded();
        // Anything enqueued while we were not listening is found by this claim.
        wake.notify_one();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                // `try_recv`: `recv` reconnects silently when the
                // connection drops; `Ok(None)` says it did (and it is back),
                // so what was enqueued meanwhile is claimed now.
                received = listener.try_recv() => match received {
                    Ok(Some(n)) if n.payload() == "*" || kinds.iter().any(|k| k == n.payload()) => wake.notify_one(),
                    Ok(Some(_)) => {}
                    Ok(None) => wake.notify_one(),
                    Err(err) => {
                        warn!(%err, "LISTEN connection lost; reconnecting");
                        break;
                    }
                },
            }
        }
    }
}

/// A task aborted when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs the jobs our completions claimed ([`Successor`]) as the claim loop
/// runs its own; after shutdown began they are given back unrun.
async fn run_successors(
    executor: Executor,
    handlers: Arc<HashMap<String, Arc<dyn Handler>>>,
    mut handed: tokio::sync::mpsc::UnboundedReceiver<Successor>,
) {
    while let Some(Successor { job, sent, slot }) = handed.recv().await {
        let Some(handler) = handlers.get(&job.kind).cloned() else {
            // Not possible: a successor is of the kind of a job this worker
            // ran. Given back rather than dropped, should it ever be.
            drop(slot);
            executor.release_unstarted(Box::new(job)).await;
            continue;
        };
        if let Err(job) = executor.spawn(job, sent, handler, slot, None) {
            executor.release_unstarted(job).await;
        }
    }
}

/// How often a worker with limited kinds polls while it waits for work.
const LIMITED_POLL: Duration = Duration::from_millis(100);

/// How long a worker with a backlog waits for half a batch of free slots
/// before it claims into the slots it has.
const REFILL_WAIT: Duration = Duration::from_millis(5);

/// Whether any of `kinds` has limits; `None` if the database did not say.
async fn has_limits(link: &mut db::Held, kinds: &[String]) -> Option<bool> {
    let conn = link.get().await.ok()?;
    let found = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM almanac.kind_limits WHERE kind = ANY($1))",
    )
    .bind(kinds)
    .fetch_one(conn)
    .await;
    match found {
        Ok(found) => Some(found),
        Err(_) => {
            link.discard();
            None
        }
    }
}

async fn claim_on(
    link: &mut db::Held,
    claim: &Claim<'_>,
) -> Result<Vec<crate::queue::Job>, QueueError> {
    let conn = link.get().await?;
    queue::claim(conn, claim).await
}
