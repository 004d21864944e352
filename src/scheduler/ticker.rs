//! The leader's tick: every enabled schedule whose next run is due gets its
//! due runs planned and recorded. Each schedule's next run is computed once
//! from the scheduler's cursor when leadership starts and then carried
//! forward in memory, so a tick in which nothing is due touches no table,
//! and a due run costs one next-fire computation, not a rescan. A step in
//! which a run is due reads the pause spells in its transaction, so a
//! pause or resume is in effect at the next due run on any leader.
//!
//! **The scheduler never skips a run because it was itself slow.**
//!
//! - *Lateness is judged from when the leader began watching.* A run that
//!   fell due while this leader was leading is on time (a `tick`) however late
//!   its step records it; only runs that fell due before the leader started
//!   (the scheduler was down, or another leader was gone) can be missed and go
//!   through the catch-up policy (see [`plan::classify`]).
//! - *Steps are sized by time, not count.* A step is one transaction on the
//!   lock session under a statement timeout well inside the leader timeout
//!   ([`Budget`]); it starts with [`FIRST_CHUNK`] runs and doubles while full
//!   steps take under half the target, up to [`MAX_CHUNK`], and halves when
//!   one takes longer. A step that times out (statement or lock timeout)
//!   is rolled back and the next is a quarter of the size; its first
//!   schedule is tried again [`BUSY_RETRY`] later (so one that times out even
//!   alone holds back no other), and leadership is kept: only the heartbeat
//!   decides whether the leader is alive.
//! - *One busy kind holds back only itself.* The route lock of each kind a
//!   step emits is tried without waiting ([`routing::busy_kinds`]); schedules
//!   of a kind whose lock is held (by `almanac route set`, or an open
//!   transaction waited on by one) keep their next run and are tried again
//!   [`BUSY_RETRY`] later, while the others are recorded at once.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::controls;
use super::ledger::{self, LedgerError, Recorded, Spell};
use super::plan::{self, Decision, Planned};
use super::spec::Schedule;
use super::timeline::Run;
use crate::queue::routing;

/// Runs recorded in a leader's first step.
pub const FIRST_CHUNK: usize = 500;
/// Runs recorded per transaction (one step), at most.
pub const MAX_CHUNK: usize = 10_000;
/// How long a schedule whose step could not run (its kind's route lock was
/// busy, or the step timed out) waits before it is tried again.
pub const BUSY_RETRY: chrono::Duration = chrono::Duration::seconds(1);

/// The time a step may take.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// What step sizes aim for.
    pub target: Duration,
    /// The server-side `statement_timeout` of each statement in a step.
    pub statement: Duration,
    /// The server-side `lock_timeout` of each statement in a step.
    pub lock: Duration,
}

impl Budget {
    /// For a leader timeout `t`: each statement ends within `t/4` (a step
    /// has five, so a whole step within the leader's client-side limit of
    /// `2t` on it), lock waits within `t/8`, and steps aim at `t/8`.
    pub fn for_leader_timeout(t: Duration) -> Budget {
        Budget {
            target: t / 8,
            statement: t / 4,
            lock: t / 8,
        }
    }
}

impl Default for Budget {
    fn default() -> Self {
        Budget::for_leader_timeout(Duration::from_secs(10))
    }
}

struct Entry {
    schedule: Schedule,
    next: Option<Run>,
    /// The disabled spells that end after the cursor: the runs inside them
    /// are recorded `skipped_disabled` (see [`plan`]).
    disabled: Vec<Spell>,
    /// Not tried before this (its last step could not run).
    not_before: Option<DateTime<Utc>>,
    /// Lateness is judged from here rather than the leader's start (the
    /// definition was new or changed at a reload).
    awake: Option<DateTime<Utc>>,
}

impl Entry {
    fn due(&self, now: DateTime<Utc>) -> bool {
        self.schedule.enabled
            && self.next.as_ref().is_some_and(|n| n.fire_at <= now)
            && self.not_before.is_none_or(|t| t <= now)
    }

    /// When this entry wants the next tick.
    fn wake(&self) -> Option<DateTime<Utc>> {
        let next = self.next.as_ref()?.fire_at;
        Some(self.not_before.map_or(next, |t| t.max(next)))
    }
}

pub struct Ticker {
    entries: Vec<Entry>,
    names: Vec<String>,
    grace: Duration,
    budget: Budget,
    chunk: usize,
    /// Each recorded run's `almanac.schedule.run` span ([`ledger::record_in`]).
    tracer: crate::telemetry::Tracer,
}

/// What one step did, and whether runs due at the same `now` remain.
#[derive(Debug, Default, Clone)]
pub struct Step {
    pub recorded: Recorded,
    pub more: bool,
    /// Kinds whose route lock was busy: their schedules were deferred.
    pub busy: Vec<String>,
    /// The schedules deferred by a busy kind or a timed-out step.
    pub deferred: Vec<String>,
    /// The step hit its statement or lock timeout and was rolled back.
    pub timed_out: bool,
}

/// What a step's transaction did, before the ticker takes it in.
struct Done {
    recorded: Recorded,
    advanced: Vec<(usize, Option<Run>)>,
    busy: Vec<String>,
    runs: usize,
    more: bool,
}

impl Ticker {
    /// Steps sized and bounded for this budget (the leader's timeout).
    pub fn with_budget(mut self, budget: Budget) -> Self {
        self.budget = budget;
        self
    }

    /// Traces every run it records into `tracer` (by default off).
    pub fn with_tracer(mut self, tracer: crate::telemetry::Tracer) -> Self {
        self.tracer = tracer;
        self
    }

    /// Syncs the definitions (at the database's time) and reads every
    /// cursor and disabled spell.
    pub async fn load(
        conn: &mut PgConnection,
        schedules: Vec<Schedule>,
        grace: Duration,
    ) -> Result<Ticker, LedgerError> {
        Ticker::load_at(conn, schedules, grace, None).await
    }

    /// [`Ticker::load`], syncing at `at` (an injected clock) when given.
    pub async fn load_at(
        conn: &mut PgConnection,
        schedules: Vec<Schedule>,
        grace: Duration,
        at: Option<DateTime<Utc>>,
    ) -> Result<Ticker, LedgerError> {
        ledger::sync_at(conn, &schedules, true, at).await?;
        let names: Vec<String> = schedules.iter().map(|s| s.name.clone()).collect();
        let mut cursors = ledger::cursors(conn, &names).await?;
        let mut spells = ledger::disabled_spells(conn, &names).await?;
        let entries = schedules
            .into_iter()
            .map(|schedule| {
                let cursor = cursors
                    .remove(&schedule.name)
                    .expect("synced schedules have a cursor");
                let next = plan::next_run(&schedule, &cursor);
                let from = cursor.from();
                let disabled = spells
                    .remove(&schedule.name)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|s| s.until.is_none_or(|u| u > from))
                    .collect();
                Entry {
                    schedule,
                    next,
                    disabled,
                    not_before: None,
                    awake: None,
                }
            })
            .collect();
        Ok(Ticker {
            entries,
            names,
            grace,
            budget: Budget::default(),
            chunk: FIRST_CHUNK,
            tracer: crate::telemetry::Tracer::off(),
        })
    }

    /// The earliest instant a tick has something to do: the next fire time
    /// of any enabled schedule (or its retry, when deferred); `None` when no
    /// enabled schedule will ever fire again.
    pub fn next_wake(&self) -> Option<DateTime<Utc>> {
        self.entries
            .iter()
            .filter(|e| e.schedule.enabled)
            .filter_map(Entry::wake)
            .min()
    }

    /// Judges the lateness of the named schedules' runs from `at` rather
    /// than from when the leadership began: a schedule new or changed at a
    /// reload (a daily schedule made minutely, say) did not have the runs its
    /// new definition gives before `at` planned on time, so those go through
    /// its catch-up policy.
    pub fn judge_from(&mut self, names: &std::collections::HashSet<String>, at: DateTime<Utc>) {
        for entry in self
            .entries
            .iter_mut()
            .filter(|e| names.contains(&e.schedule.name))
        {
            entry.awake = Some(at);
        }
    }

    /// Some schedule waits for a retry (its kind was busy, or its step timed out).
    pub fn deferring(&self) -> bool {
        self.entries.iter().any(|e| e.not_before.is_some())
    }

    pub fn schedules(&self) -> impl Iterator<Item = &Schedule> {
        self.entries.iter().map(|e| &e.schedule)
    }

    /// Records every run due at `now`, step by step, on `conn`, judging
    /// lateness at `now` (as a leader that has just woken would). Schedules
    /// deferred by a busy route lock stay due for a later tick.
    pub async fn tick(
        &mut self,
        conn: &mut PgConnection,
        now: DateTime<Utc>,
    ) -> Result<Recorded, LedgerError> {
        let mut total = Recorded::default();
        loop {
            let step = self.step(conn, now, now).await?;
            total.add(step.recorded);
            if !step.more {
                return Ok(total);
            }
        }
    }

    /// Records runs due at `now` in one transaction, as many as the step
    /// size allows (see the module doc). `awake_since` is when this leader
    /// began watching. The in-memory next runs advance only once the
    /// transaction committed.
    pub async fn step(
        &mut self,
        conn: &mut PgConnection,
        now: DateTime<Utc>,
        awake_since: DateTime<Utc>,
    ) -> Result<Step, LedgerError> {
        if !self.entries.iter().any(|e| e.due(now)) {
            return Ok(Step::default());
        }
        let started = Instant::now();
        let mut tx = super::begin(&mut *conn).await?;
        let done = match self.plan_and_record(&mut tx, now, awake_since).await {
            Ok(done) => done,
            Err(err) if err.is_timeout() => {
                drop(tx);
                // Smaller next time; and the first due schedule (the one a
                // step of one run would hold) waits a retry, so a schedule
                // that times out even alone cannot hold back the others.
                self.chunk = (self.chunk / 4).max(1);
                let first = self.entries.iter_mut().find(|e| e.due(now));
                let deferred = first
                    .map(|entry| {
                        entry.not_before = Some(now + BUSY_RETRY);
                        vec![entry.schedule.name.clone()]
                    })
                    .unwrap_or_default();
                return Ok(Step {
                    deferred,
                    more: true,
                    timed_out: true,
                    ..Step::default()
                });
            }
            Err(err) => return Err(err),
        };
        tx.commit().await?;
        let mut deferred = Vec::new();
        for (i, following) in done.advanced {
            let entry = &mut self.entries[i];
            if done.busy.contains(&entry.schedule.kind) {
                entry.not_before = Some(now + BUSY_RETRY);
                deferred.push(entry.schedule.name.clone());
            } else {
                entry.next = following;
                entry.not_before = None;
            }
        }
        self.resize(done.runs, started.elapsed(), done.more);
        Ok(Step {
            recorded: done.recorded,
            more: done.more,
            busy: done.busy,
            deferred,
            timed_out: false,
        })
    }

    /// The statements of one step, in the caller's transaction `tx`.
    async fn plan_and_record(
        &self,
        tx: &mut PgConnection,
        now: DateTime<Utc>,
        awake_since: DateTime<Utc>,
    ) -> Result<Done, LedgerError> {
        let ms = |d: Duration| d.as_millis().max(1).to_string();
        sqlx::query(
            "SELECT set_config('statement_timeout', $1, true), set_config('lock_timeout', $2, true)",
        )
        .bind(ms(self.budget.statement))
        .bind(ms(self.budget.lock))
        .execute(&mut *tx)
        .await?;
        let earliest = self
            .entries
            .iter()
            .filter(|e| e.due(now))
            .filter_map(|e| e.next.as_ref().map(|n| n.fire_at))
            .min();
        let paused = controls::pause_spells(&mut *tx, &self.names, earliest).await?;
        let mut batch: Vec<(usize, Planned)> = Vec::new();
        let mut advanced: Vec<(usize, Option<Run>)> = Vec::new();
        let mut more = false;
        for (i, entry) in self.entries.iter().enumerate() {
            if !entry.due(now) {
                continue;
            }
            if batch.len() >= self.chunk {
                more = true;
                break;
            }
            let next = entry.next.clone().expect("a due entry has a next run");
            let limit = self.chunk - batch.len();
            let (runs, following) = plan::due_from(&entry.schedule, next, now, limit);
            let complete = following.as_ref().is_none_or(|f| f.fire_at > now);
            more |= !complete;
            advanced.push((i, following));
            batch.extend(
                plan::classify(
                    &entry.schedule,
                    runs,
                    entry
                        .awake
                        .map_or(awake_since, |a| a.max(awake_since))
                        .min(now),
                    self.grace,
                    complete,
                    &entry.disabled,
                    paused.get(&entry.schedule.name).map_or(&[], Vec::as_slice),
                )
                .into_iter()
                .map(|p| (i, p)),
            );
        }
        let mut kinds: Vec<&str> = batch
            .iter()
            .filter(|(_, p)| p.decision == Decision::Emit)
            .map(|(i, _)| self.entries[*i].schedule.kind.as_str())
            .collect();
        kinds.sort_unstable();
        kinds.dedup();
        let busy = routing::busy_kinds(&mut *tx, &kinds).await?;
        let refs: Vec<(&Schedule, &Planned)> = batch
            .iter()
            .map(|(i, p)| (&self.entries[*i].schedule, p))
            .filter(|(s, _)| !busy.contains(&s.kind))
            .collect();
        let recorded = ledger::record_in(&mut *tx, &refs, true, false, &self.tracer).await?;
        Ok(Done {
            recorded,
            advanced,
            busy,
            runs: refs.len(),
            more,
        })
    }

    /// Sizes the next step by how long this one took: doubled while a full
    /// step takes under half the target, halved when one takes longer than
    /// the target.
    fn resize(&mut self, runs: usize, took: Duration, more: bool) {
        if took > self.budget.target {
            self.chunk = (self.chunk / 2).max(1);
        } else if more && runs >= self.chunk && took < self.budget.target / 2 {
            self.chunk = (self.chunk * 2).min(MAX_CHUNK);
        }
    }
}
