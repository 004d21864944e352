//! The leader's tick: every enabled schedule whose next run is due gets its
//! due runs planned and recorded. Each schedule's next run is computed once
//! from the scheduler's cursor when leadership starts and then carried
//! forward in memory, so a tick in which nothing is due touches no table,
//! and a due run costs one next-fire computation, not a rescan. A tick in
//! which a run is due reads the pause spells first (one statement), so a
//! pause or resume is in effect at the next due run on any leader.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::controls;
use super::ledger::{self, LedgerError, Recorded, Spell};
use super::plan::{self, Planned};
use super::spec::Schedule;
use super::timeline::Run;

/// Runs recorded per transaction (one step), at most.
pub const CHUNK: usize = 10_000;

struct Entry {
    schedule: Schedule,
    next: Option<Run>,
    /// The disabled spells that end after the cursor: the runs inside them
    /// are recorded `skipped_disabled` (see [`plan`]).
    disabled: Vec<Spell>,
}

pub struct Ticker {
    entries: Vec<Entry>,
    names: Vec<String>,
    grace: Duration,
}

/// What one step recorded, and whether runs due at the same `now` remain.
#[derive(Debug, Default, Clone)]
pub struct Step {
    pub recorded: Recorded,
    pub more: bool,
}

impl Ticker {
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
                }
            })
            .collect();
        Ok(Ticker {
            entries,
            names,
            grace,
        })
    }

    /// The earliest next fire time of any enabled schedule; `None` when no
    /// enabled schedule will ever fire again.
    pub fn next_wake(&self) -> Option<DateTime<Utc>> {
        self.entries
            .iter()
            .filter(|e| e.schedule.enabled)
            .filter_map(|e| e.next.as_ref().map(|r| r.fire_at))
            .min()
    }

    pub fn schedules(&self) -> impl Iterator<Item = &Schedule> {
        self.entries.iter().map(|e| &e.schedule)
    }

    /// Records every run due at `now`, step by step, on `conn`.
    pub async fn tick(
        &mut self,
        conn: &mut PgConnection,
        now: DateTime<Utc>,
    ) -> Result<Recorded, LedgerError> {
        let mut total = Recorded::default();
        loop {
            let step = self.step(conn, now).await?;
            total.add(step.recorded);
            if !step.more {
                return Ok(total);
            }
        }
    }

    /// Records up to [`CHUNK`] runs due at `now` in one transaction. The
    /// in-memory next runs advance only once that transaction committed.
    pub async fn step(
        &mut self,
        conn: &mut PgConnection,
        now: DateTime<Utc>,
    ) -> Result<Step, LedgerError> {
        let mut batch: Vec<(usize, Planned)> = Vec::new();
        let mut advanced: Vec<(usize, Option<Run>)> = Vec::new();
        let mut more = false;
        let Some(earliest) = self
            .entries
            .iter()
            .filter(|e| e.schedule.enabled)
            .filter_map(|e| e.next.as_ref().map(|n| n.fire_at))
            .filter(|at| *at <= now)
            .min()
        else {
            return Ok(Step::default());
        };
        let paused = controls::pause_spells(conn, &self.names, Some(earliest)).await?;
        for (i, entry) in self.entries.iter().enumerate() {
            let Some(next) = entry.next.as_ref().filter(|n| n.fire_at <= now) else {
                continue;
            };
            if !entry.schedule.enabled {
                continue;
            }
            if batch.len() >= CHUNK {
                more = true;
                break;
            }
            let limit = CHUNK - batch.len();
            let (runs, following) = plan::due_from(&entry.schedule, next.clone(), now, limit);
            let complete = following.as_ref().is_none_or(|f| f.fire_at > now);
            more |= !complete;
            advanced.push((i, following));
            batch.extend(
                plan::classify(
                    &entry.schedule,
                    runs,
                    now,
                    self.grace,
                    complete,
                    &entry.disabled,
                    paused.get(&entry.schedule.name).map_or(&[], Vec::as_slice),
                )
                .into_iter()
                .map(|p| (i, p)),
            );
        }
        if batch.is_empty() {
            return Ok(Step::default());
        }
        let refs: Vec<(&Schedule, &Planned)> = batch
            .iter()
            .map(|(i, p)| (&self.entries[*i].schedule, p))
            .collect();
        let recorded = ledger::record(conn, &refs, true, false).await?;
        for (i, following) in advanced {
            self.entries[i].next = following;
        }
        Ok(Step { recorded, more })
    }
}
