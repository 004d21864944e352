//! Backfill and gaps: explicit, operator-driven emission of past runs.
//!
//! `backfill` emits every logical run in a range that has no job yet, whatever
//! the catch-up policy and the overlap rule: runs missing from the ledger, and
//! runs recorded earlier as skipped. Runs already emitted are left alone, so a
//! backfill repeated gives the same ledger, and a run whose job was deleted by
//! retention is not emitted again. Nothing before the schedule's `start`.
//!
//! Backfill is for the past: a range reaching runs not yet due (by the
//! database's clock) is refused unless the operator allows the future
//! explicitly. Backfilled rows never move the scheduler's cursor (see
//! [`super::plan::Cursor`]), so a partial backfill cannot hide the runs
//! missed around it, and a future run backfilled early is simply found
//! already emitted when it comes due. `gaps` lists only runs already due.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::ledger::{self, LedgerError, Recorded};
use super::plan::{self, Decision, Planned, Source};
use super::spec::Schedule;
use super::timeline::Run;

/// Largest range one command handles, in runs.
pub const MAX_RUNS: usize = 2_000_000;
const CHUNK: usize = 5_000;

#[derive(Debug, thiserror::Error)]
pub enum BackfillError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("the range holds more than {MAX_RUNS} runs of `{0}`; split it into smaller ranges")]
    TooLarge(String),
    #[error("the range reaches runs of `{schedule}` that are not due yet (the first at {first}; the database's time is {now}); end the range earlier, or pass --allow-future to emit them ahead of time")]
    Future {
        schedule: String,
        first: DateTime<Utc>,
        now: DateTime<Utc>,
    },
}

/// What a backfill did, or (dry run) would do.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BackfillReport {
    /// Runs in the range (on or after `start`).
    pub in_range: u64,
    /// Runs that had no ledger row and were emitted.
    pub emitted: u64,
    /// Runs recorded as skipped before, emitted now.
    pub emitted_after_skip: u64,
    /// Runs that already had a job.
    pub already_emitted: u64,
}

fn runs(
    schedule: &Schedule,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Vec<Run>, BackfillError> {
    let runs = plan::runs_in(schedule, from, to, MAX_RUNS + 1);
    if runs.len() > MAX_RUNS {
        return Err(BackfillError::TooLarge(schedule.name.clone()));
    }
    Ok(runs)
}

/// The database's current time: the one clock the scheduler trusts.
pub async fn db_now(conn: &mut PgConnection) -> Result<DateTime<Utc>, BackfillError> {
    Ok(sqlx::query_scalar("SELECT now()")
        .fetch_one(conn)
        .await
        .map_err(LedgerError::from)?)
}

/// What a backfill covers and how.
#[derive(Debug, Clone, Copy)]
pub struct Range {
    /// Inclusive.
    pub from: DateTime<Utc>,
    /// Exclusive.
    pub to: DateTime<Utc>,
    /// Report only; write nothing.
    pub dry_run: bool,
    /// Emit runs that are not due yet, too.
    pub allow_future: bool,
}

/// Emits the runs with `from <= fire_at < to` that have no job yet.
/// `progress(done, total)` is called after each chunk.
pub async fn backfill(
    conn: &mut PgConnection,
    schedule: &Schedule,
    range: Range,
    mut progress: impl FnMut(u64, u64),
) -> Result<BackfillReport, BackfillError> {
    let Range {
        from,
        to,
        dry_run,
        allow_future,
    } = range;
    let runs = runs(schedule, from, to)?;
    if !allow_future {
        let now = db_now(conn).await?;
        if let Some(first) = runs.iter().find(|r| r.fire_at > now) {
            return Err(BackfillError::Future {
                schedule: schedule.name.clone(),
                first: first.fire_at,
                now,
            });
        }
    }
    if !dry_run {
        ledger::sync(conn, std::slice::from_ref(schedule), false).await?;
    }
    let recorded = ledger::recorded_between(conn, &schedule.name, from, to).await?;
    let mut report = BackfillReport {
        in_range: runs.len() as u64,
        ..Default::default()
    };
    let todo: Vec<Run> = runs
        .into_iter()
        .filter(|r| match recorded.get(&r.logical_run).map(String::as_str) {
            Some("emitted") => {
                report.already_emitted += 1;
                false
            }
            Some(_) => {
                report.emitted_after_skip += 1;
                true
            }
            None => {
                report.emitted += 1;
                true
            }
        })
        .collect();
    if dry_run {
        return Ok(report);
    }
    let total = todo.len() as u64;
    let mut done = Recorded::default();
    for chunk in todo.chunks(CHUNK) {
        let planned: Vec<Planned> = chunk
            .iter()
            .map(|run| Planned {
                run: run.clone(),
                source: Source::Backfill,
                decision: Decision::Emit,
            })
            .collect();
        let batch: Vec<(&Schedule, &Planned)> = planned.iter().map(|p| (schedule, p)).collect();
        done.add(ledger::record(conn, &batch, false, true).await?);
        progress(done.emitted + done.emitted_after_skip + done.existed, total);
    }
    // Anything another process recorded meanwhile counts as already there.
    report.emitted = done.emitted;
    report.emitted_after_skip = done.emitted_after_skip;
    report.already_emitted += done.existed;
    Ok(report)
}

/// The runs with `from <= fire_at < to`, already due, that have no ledger
/// row at all: holes anywhere in the range, not only after the last run.
pub async fn gaps(
    conn: &mut PgConnection,
    schedule: &Schedule,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Vec<Run>, BackfillError> {
    let now = db_now(conn).await?;
    let to = to.min(now + chrono::Duration::microseconds(1));
    let runs = runs(schedule, from, to)?;
    let recorded = ledger::recorded_between(conn, &schedule.name, from, to).await?;
    Ok(runs
        .into_iter()
        .filter(|r| !recorded.contains_key(&r.logical_run))
        .collect())
}
