//! The leader's tick: every enabled schedule whose next run is due gets its
//! due runs planned and recorded. Cursors (the last recorded run per
//! schedule) are read once when leadership starts and kept in memory, so a
//! tick in which nothing is due touches no table.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::ledger::{self, Cursor, LedgerError, Recorded};
use super::plan::{self, Planned};
use super::spec::Schedule;

/// Runs planned per schedule, and recorded per transaction, at most.
const CHUNK: usize = 5_000;

struct Entry {
    schedule: Schedule,
    cursor: Cursor,
    next: Option<DateTime<Utc>>,
}

pub struct Ticker {
    entries: Vec<Entry>,
    grace: Duration,
}

impl Ticker {
    /// Syncs the definitions and reads every cursor.
    pub async fn load(
        conn: &mut PgConnection,
        schedules: Vec<Schedule>,
        grace: Duration,
    ) -> Result<Ticker, LedgerError> {
        ledger::sync(conn, &schedules, true).await?;
        let names: Vec<String> = schedules.iter().map(|s| s.name.clone()).collect();
        let mut cursors = ledger::cursors(conn, &names).await?;
        let entries = schedules
            .into_iter()
            .map(|schedule| {
                let cursor = cursors
                    .remove(&schedule.name)
                    .expect("synced schedules have a cursor");
                let next = next_of(&schedule, &cursor);
                Entry {
                    schedule,
                    cursor,
                    next,
                }
            })
            .collect();
        Ok(Ticker { entries, grace })
    }

    /// The earliest next fire time of any enabled schedule.
    pub fn next_wake(&self) -> Option<DateTime<Utc>> {
        self.entries
            .iter()
            .filter(|e| e.schedule.enabled)
            .filter_map(|e| e.next)
            .min()
    }

    pub fn schedules(&self) -> impl Iterator<Item = &Schedule> {
        self.entries.iter().map(|e| &e.schedule)
    }

    /// Records every run due at `now`, chunk by chunk, on `conn`.
    pub async fn tick(
        &mut self,
        conn: &mut PgConnection,
        now: DateTime<Utc>,
    ) -> Result<Recorded, LedgerError> {
        let mut total = Recorded::default();
        loop {
            let mut batch: Vec<(usize, Planned)> = Vec::new();
            let mut advanced: Vec<(usize, Option<DateTime<Utc>>)> = Vec::new();
            for (i, entry) in self.entries.iter().enumerate() {
                if !entry.schedule.enabled || entry.next.is_none_or(|n| n > now) {
                    continue;
                }
                let runs = plan::due_runs(&entry.schedule, &entry.cursor, now, CHUNK);
                let complete = runs.len() < CHUNK;
                advanced.push((i, runs.last().map(|r| r.fire_at)));
                batch.extend(
                    plan::classify(&entry.schedule, runs, now, self.grace, complete)
                        .into_iter()
                        .map(|p| (i, p)),
                );
                if batch.len() >= CHUNK {
                    break;
                }
            }
            if advanced.is_empty() {
                return Ok(total);
            }
            let refs: Vec<(&Schedule, Planned)> = batch
                .iter()
                .map(|(i, p)| (&self.entries[*i].schedule, p.clone()))
                .collect();
            total.add(ledger::record(conn, &refs, true, false).await?);
            for (i, last) in advanced {
                let entry = &mut self.entries[i];
                match last {
                    Some(last) => {
                        entry.cursor.last_fire = Some(last);
                        entry.next = next_of(&entry.schedule, &entry.cursor);
                    }
                    // Nothing was due after all (e.g. filtered by `start`).
                    None => entry.next = entry.schedule.timeline.next_after(now).map(|r| r.fire_at),
                }
            }
        }
    }
}

pub(crate) fn next_of(schedule: &Schedule, cursor: &Cursor) -> Option<DateTime<Utc>> {
    let after = plan::next_from(schedule, cursor) - chrono::Duration::microseconds(1);
    let mut next = schedule.timeline.next_after(after)?;
    // Skip runs dated before `start` (a slot shifted across midnight).
    while schedule.start.is_some_and(|s| next.date < s) {
        next = schedule.timeline.next_after(next.fire_at)?;
    }
    Some(next.fire_at)
}
