//! The outcome recorders: tasks that write every outcome through the fence,
//! completions and releases in batches, retried through blips with the same
//! lease token until each job's local lease deadline (see the parent
//! module's doc). Two share the outcomes, each on its own connection: while
//! one writes a batch the other gathers the next, so a worker whose jobs
//! come one completion after another (ordered keys, whose next job a
//! completion claims) has two statements in flight, not one. Each outcome
//! is taken by one of them, so what is said below holds per outcome.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio::time::{sleep, Instant};
use tracing::{debug, error, warn};
use uuid::Uuid;

use super::{bounded, Executed, Inner, Successor, Successors, Unanswered};
use crate::db;
use crate::queue::{self, Failure, Fenced, JobStatus, QueueError};

/// How long the recorder waits for a job's row that another transaction
/// holds before writing the rest of its batch without it.
const BUSY_ROW_WAIT: Duration = Duration::from_millis(250);
use crate::retry::Retry;

pub(super) enum Write {
    Complete,
    Fail(Failure),
    Release(String),
    /// Back to `ready` after this long, the attempt given back.
    Snooze(Duration),
}

pub(super) struct Outcome {
    pub(super) id: i64,
    pub(super) token: Uuid,
    pub(super) write: Write,
    /// An earlier try failed in transit: it may have committed.
    pub(super) ambiguous: bool,
}

/// Records outcomes: batches, retried through blips until each job's local
/// lease deadline.
pub(super) async fn record(
    inner: Arc<Inner>,
    rx: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Outcome>>>,
    successors: Option<Successors>,
) {
    const MAX_BATCH: usize = 512;
    let mut pending = Vec::with_capacity(MAX_BATCH);
    let mut open = true;
    // A row another transaction holds is skipped after a short wait (see
    // `queue::complete_many`) rather than holding up the whole batch.
    let mut link = db::Held::of(
        &inner.pool,
        (inner.config.lease / 3).max(Duration::from_millis(50)),
    )
    .lock_wait(BUSY_ROW_WAIT);
    let mut retry = Retry::new(
        Duration::from_millis(50),
        (inner.config.lease / 3).max(Duration::from_millis(50)),
    );
    loop {
        if pending.is_empty()
            && (!open || rx.lock().await.recv_many(&mut pending, MAX_BATCH).await == 0)
        {
            return;
        }
        inner.give_up_expired(&mut pending);
        if pending.is_empty() {
            continue;
        }
        inner
            .write(&mut link, &mut pending, successors.as_ref())
            .await;
        if pending.is_empty() {
            retry.succeeded();
            continue;
        }
        let now = Instant::now();
        let earliest = pending
            .iter()
            .map(|o| inner.deadline(o.id, o.token))
            .min()
            .unwrap_or(now);
        let pause = retry.failed().min(earliest.saturating_duration_since(now));
        if open {
            tokio::select! {
                _ = sleep(pause) => {}
                received = async { rx.lock().await.recv_many(&mut pending, MAX_BATCH).await } => open = received > 0,
            }
        } else {
            sleep(pause).await;
        }
    }
}

impl Inner {
    /// Gives up outcomes whose local lease deadline has passed.
    fn give_up_expired(&self, pending: &mut Vec<Outcome>) {
        let now = Instant::now();
        pending.retain(|o| {
            if self.deadline(o.id, o.token) > now {
                return true;
            }
            error!(
                job_id = o.id,
                "could not record the outcome before the local lease deadline; giving it up"
            );
            self.settle(
                o.id,
                o.token,
                Executed::Lost,
                Some("the outcome could not be recorded before the local lease deadline"),
            );
            false
        });
    }

    /// One try at every pending write; what could not be written stays pending.
    async fn write(
        &self,
        link: &mut db::Held,
        pending: &mut Vec<Outcome>,
        successors: Option<&Successors>,
    ) {
        let within = self.config.lease / 3;
        let batch = std::mem::take(pending);
        let (completes, rest): (Vec<Outcome>, Vec<Outcome>) = batch
            .into_iter()
            .partition(|o| matches!(o.write, Write::Complete));
        let (releases, fails): (Vec<Outcome>, Vec<Outcome>) = rest
            .into_iter()
            .partition(|o| matches!(o.write, Write::Release(_)));
        let mut unsure = Vec::new();
        // After one write went unanswered the rest wait for the next round
        // (untried, so not ambiguous) instead of each waiting out a timeout.
        let mut reachable = true;

        if !completes.is_empty() {
            let leases: Vec<(i64, Uuid)> = completes.iter().map(|o| (o.id, o.token)).collect();
            // Released successors are claimed for this worker only while it
            // takes jobs (not once its shutdown began), and only by a batch
            // that can release any (the plain statement is cheaper).
            let claiming = successors.filter(|_| {
                self.claiming.load(Ordering::Acquire) && {
                    let flights = self.flights();
                    completes.iter().any(|o| {
                        flights
                            .get(&o.id)
                            .is_some_and(|f| f.token == o.token && f.ordered)
                    })
                }
            });
            let lease = self.config.lease;
            let sent = Instant::now();
            let completed = match claiming {
                Some(to) => {
                    bounded(
                        within,
                        on(link, |c| {
                            queue::complete_many_claiming(c, &leases, lease, &to.kinds)
                        }),
                    )
                    .await
                }
                None => bounded(within, on(link, |c| queue::complete_many(c, &leases)))
                    .await
                    .map(|written| (written, Vec::new())),
            };
            match completed {
                Ok((written, claimed)) => {
                    let held: HashSet<i64> = written.ids.into_iter().collect();
                    let busy: HashSet<i64> = written.busy.into_iter().collect();
                    let mut slots = Vec::new();
                    for o in completes {
                        if held.contains(&o.id) {
                            slots.extend(self.settle_keeping_slot(
                                o.id,
                                o.token,
                                Executed::Completed,
                                None,
                            ));
                        } else if busy.contains(&o.id) {
                            // Its row was held by another transaction: the
                            // next round tries again, as after a blip.
                            pending.push(o);
                        } else {
                            unsure.push(o);
                        }
                    }
                    if let Some(to) = claiming.filter(|_| !claimed.is_empty()) {
                        self.hand_over(claimed, sent, slots, to);
                    }
                }
                Err(err) => {
                    reachable = false;
                    link.discard();
                    self.unwritten("complete", &err, completes, pending);
                }
            }
        }

        if !reachable {
            pending.extend(releases);
        } else if !releases.is_empty() {
            let leases: Vec<(i64, Uuid)> = releases.iter().map(|o| (o.id, o.token)).collect();
            // One reason per statement: the first one's.
            let reason = match &releases[0].write {
                Write::Release(reason) => reason.clone(),
                _ => unreachable!("partitioned on Release"),
            };
            match bounded(within, on(link, |c| queue::release(c, &leases, &reason))).await {
                Ok(rows) => {
                    let rows: HashMap<i64, JobStatus> = rows.into_iter().collect();
                    for o in releases {
                        match rows.get(&o.id) {
                            Some(JobStatus::Dead) => self.settle(
                                o.id,
                                o.token,
                                Executed::Dead,
                                Some("released at shutdown with its attempts used up"),
                            ),
                            Some(JobStatus::Cancelled) => {
                                self.settle(o.id, o.token, Executed::Cancelled, None)
                            }
                            Some(_) => self.settle(o.id, o.token, Executed::Released, None),
                            None => unsure.push(o),
                        }
                    }
                }
                Err(err) if err.refused() => self.refused("release", &err, releases, pending),
                Err(err) => {
                    reachable = false;
                    link.discard();
                    self.unwritten("release", &err, releases, pending);
                }
            }
        }

        // Failures and snoozes, one by one.
        for o in fails {
            if !reachable {
                pending.push(o);
                continue;
            }
            let written = match &o.write {
                Write::Fail(failure) => {
                    bounded(within, on(link, |c| queue::fail(c, o.id, o.token, failure))).await
                }
                Write::Snooze(after) => {
                    bounded(
                        within,
                        on(link, |c| queue::snooze(c, o.id, o.token, *after)),
                    )
                    .await
                }
                _ => unreachable!("partitioned on Fail and Snooze"),
            };
            match written {
                Ok(Fenced::Held(status)) => {
                    let executed = recorded(&o.write, status);
                    self.settle(o.id, o.token, executed, Some(&detail_of(&o.write)));
                }
                Ok(Fenced::Lost) => unsure.push(o),
                Err(err) if err.refused() => self.refused("fail", &err, vec![o], pending),
                Err(err) => {
                    reachable = false;
                    link.discard();
                    self.unwritten("fail", &err, vec![o], pending);
                }
            }
        }

        self.settle_unsure(link, unsure).await;
    }

    /// Hands the successors a completion claimed to the worker, each in the
    /// slot of a job that completion settled (it released at most one per
    /// completed job). One that cannot be handed over (no slot left, or the
    /// worker stopped taking them) is given back unrun, its attempt
    /// restored; if that fails, its lease expires.
    fn hand_over(
        &self,
        claimed: Vec<queue::Job>,
        sent: Instant,
        mut slots: Vec<OwnedSemaphorePermit>,
        to: &Successors,
    ) {
        let mut unrun = Vec::new();
        for job in claimed {
            let Some(slot) = slots.pop() else {
                unrun.push(job);
                continue;
            };
            if let Err(refused) = to.to.send(Successor { job, sent, slot }) {
                unrun.push(refused.0.job);
            }
        }
        if unrun.is_empty() {
            return;
        }
        warn!(
            jobs = unrun.len(),
            "jobs claimed by a completion could not be handed to the worker; giving them back"
        );
        let leases = unrun.iter().filter_map(|j| j.lease()).collect();
        tokio::spawn(super::hand_back(
            self.pool.clone(),
            leases,
            self.config.lease / 3,
            "claimed by a completion",
        ));
    }

    fn unwritten(
        &self,
        what: &str,
        err: &Unanswered,
        outcomes: Vec<Outcome>,
        pending: &mut Vec<Outcome>,
    ) {
        warn!(
            %err,
            jobs = outcomes.len(),
            "recording outcomes ({what}) failed; retrying with the same lease until the local lease deadline"
        );
        pending.extend(outcomes.into_iter().map(|o| Outcome {
            ambiguous: true,
            ..o
        }));
    }

    /// Outcomes whose statement the database refused whole (a lock wait
    /// past the link's short lock timeout, e.g. the kind's route lock while
    /// `route set` wants it, or a deadlock): nothing was written, the link
    /// is fine, and the next round tries again.
    fn refused(
        &self,
        what: &str,
        err: &Unanswered,
        outcomes: Vec<Outcome>,
        pending: &mut Vec<Outcome>,
    ) {
        debug!(%err, jobs = outcomes.len(), "recording outcomes ({what}) waited too long for a lock; trying again");
        pending.extend(outcomes);
    }

    /// Outcomes the fence refused. If an earlier try failed in transit it may
    /// have been ours that committed: within the lease nobody else can have
    /// taken the job, so its status tells.
    async fn settle_unsure(&self, link: &mut db::Held, unsure: Vec<Outcome>) {
        if unsure.is_empty() {
            return;
        }
        let ambiguous: Vec<i64> = unsure
            .iter()
            .filter(|o| o.ambiguous)
            .map(|o| o.id)
            .collect();
        let statuses = if ambiguous.is_empty() {
            HashMap::new()
        } else {
            match bounded(
                self.config.lease / 3,
                on(link, |c| queue::statuses(c, &ambiguous)),
            )
            .await
            {
                Ok(statuses) => statuses,
                Err(_) => {
                    link.discard();
                    HashMap::new()
                }
            }
        };
        // A completion found written by a try whose answer was lost may
        // have claimed the next jobs of its keys: they are given back.
        let orphans: Vec<Uuid> = unsure
            .iter()
            .filter(|o| {
                o.ambiguous
                    && matches!(o.write, Write::Complete)
                    && statuses.get(&o.id) == Some(&JobStatus::Done)
            })
            .map(|o| o.token)
            .collect();
        if !orphans.is_empty() {
            let given = bounded(
                self.config.lease / 3,
                on(link, |c| queue::unclaim_successors(c, &orphans)),
            )
            .await;
            match given {
                Ok(0) => {}
                Ok(n) => warn!(
                    jobs = n,
                    "gave back the jobs a completion claimed before its answer was lost"
                ),
                Err(err) => {
                    link.discard();
                    warn!(%err, "could not give back the jobs a completion claimed before its answer was lost; their leases will expire");
                }
            }
        }
        for o in unsure {
            let status = statuses.get(&o.id).copied().filter(|_| o.ambiguous);
            let executed = match status {
                Some(status) if ours(&o.write, status) => recorded(&o.write, status),
                _ => Executed::Lost,
            };
            let detail = match (&o.write, executed) {
                (_, Executed::Lost) => {
                    "the fence refused the outcome: the lease was taken back".to_string()
                }
                (Write::Fail(_) | Write::Snooze(_), _) => detail_of(&o.write),
                _ => "recorded by a try whose answer was lost".to_string(),
            };
            self.settle(o.id, o.token, executed, Some(&detail));
        }
    }
}

/// What a failure, snooze or release that the fence let through became,
/// by the job's new status.
fn recorded(write: &Write, status: JobStatus) -> Executed {
    match (write, status) {
        (_, JobStatus::Cancelled) => Executed::Cancelled,
        (_, JobStatus::Dead) => Executed::Dead,
        (Write::Snooze(_), _) => Executed::Snoozed,
        (Write::Release(_), _) => Executed::Released,
        (Write::Complete, _) => Executed::Completed,
        (Write::Fail(_), _) => Executed::Retried,
    }
}

/// Whether `status` is one that `write` leaves a job in.
fn ours(write: &Write, status: JobStatus) -> bool {
    use JobStatus::{Cancelled, Dead, Done, Ready};
    matches!(
        (write, status),
        (Write::Complete, Done)
            | (Write::Release(_) | Write::Fail(_), Ready | Dead | Cancelled)
            | (Write::Snooze(_), Ready | Cancelled)
    )
}

/// What the log says of a failure or snooze.
fn detail_of(write: &Write) -> String {
    match write {
        Write::Fail(failure) => failure.error().to_string(),
        Write::Snooze(after) => format!("due again in {after:?}"),
        Write::Complete | Write::Release(_) => String::new(),
    }
}

/// Runs one statement on the recorder's own connection (see [`db::Held`]).
async fn on<'c, T, F, Fut>(link: &'c mut db::Held, statement: F) -> Result<T, QueueError>
where
    F: FnOnce(&'c mut sqlx::PgConnection) -> Fut,
    Fut: std::future::Future<Output = Result<T, QueueError>> + 'c,
{
    let conn = link.get().await?;
    statement(conn).await
}
