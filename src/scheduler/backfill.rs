//! Backfill and gaps: explicit, operator-driven emission of past runs.
//!
//! `backfill` emits every logical run in a range that has no job yet, whatever
//! the catch-up policy and the overlap rule: runs missing from the ledger, and
//! runs recorded earlier as skipped. Runs already emitted are left alone, so a
//! backfill repeated gives the same ledger, and a run whose job was deleted by
//! retention is not emitted again. Nothing before the schedule's `start`.

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

/// Emits the runs with `from <= fire_at < to` that have no job yet.
/// `progress(done, total)` is called after each chunk.
pub async fn backfill(
    conn: &mut PgConnection,
    schedule: &Schedule,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    dry_run: bool,
    mut progress: impl FnMut(u64, u64),
) -> Result<BackfillReport, BackfillError> {
    let runs = runs(schedule, from, to)?;
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
        let batch: Vec<(&Schedule, Planned)> = chunk
            .iter()
            .map(|run| {
                (
                    schedule,
                    Planned {
                        run: run.clone(),
                        source: Source::Backfill,
                        decision: Decision::Emit,
                    },
                )
            })
            .collect();
        done.add(ledger::record(conn, &batch, false, true).await?);
        progress(done.emitted + done.emitted_after_skip + done.existed, total);
    }
    // Anything another process recorded meanwhile counts as already there.
    report.emitted = done.emitted;
    report.emitted_after_skip = done.emitted_after_skip;
    report.already_emitted += done.existed;
    Ok(report)
}

/// The runs with `from <= fire_at < to` that have no ledger row at all:
/// holes anywhere in the range, not only after the last run.
pub async fn gaps(
    conn: &mut PgConnection,
    schedule: &Schedule,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Vec<Run>, BackfillError> {
    let runs = runs(schedule, from, to)?;
    let recorded = ledger::recorded_between(conn, &schedule.name, from, to).await?;
    Ok(runs
        .into_iter()
        .filter(|r| !recorded.contains_key(&r.logical_run))
        .collect())
}
