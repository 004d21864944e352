//! Backfill and gaps: explicit, operator-driven emission of past runs.
//!
//! `backfill` emits every logical run in a range that has no job yet, whatever
//! the catch-up policy and the overlap rule: runs missing from the ledger, and
//! runs recorded earlier as skipped. Runs already emitted are left alone, so a
//! backfill repeated gives the same ledger, and a run whose job was deleted by
//! retention is not emitted again. Nothing before the schedule's `start`.
//! (That is `--reprocess missing`, the default; re-running runs that have a
//! job, `failed` or `all`, and `--max-active` are [`super::reprocess`]'s.)
//!
//! Backfill is for the past: a range reaching runs not yet due (by the
//! database's clock) is refused unless the operator allows the future
//! explicitly. Backfilled rows never move the scheduler's cursor (see
//! [`super::plan::Cursor`]), so a partial backfill cannot hide the runs
//! missed around it, and a future run backfilled early is simply found
//! already emitted when it comes due.
//!
//! **Missing** is one rule, [`Expected::unrecorded`], which `gaps` (`almanac
//! gaps`) and the dashboard's calendar ([`super::history::calendar`]) both
//! apply, so the calendar's missing cells are exactly what `gaps` reports for
//! the same range at the same instant. A run with no ledger row is missing
//! when all of these hold:
//!
//! - the schedule's history had begun: the run fell due at or after the
//!   schedule's first sync, or at or after its earliest ledger row (a
//!   backfilled history counts from where it begins, so a hole inside it is
//!   missing even before the first sync); earlier runs are *before history*;
//! - it did not fall due while the schedule was disabled or paused (the
//!   scheduler records those `skipped_disabled` when the schedule is enabled
//!   again, and `skipped_paused` at its next tick, see [`super::plan`]);
//!   until then they are *disabled*;
//! - it is settled: it fell due more than [`DUE_GRACE`] ago; until then it is
//!   *due* (the leader records it at its next tick).
//!
//! Runs before `start` are not runs of the schedule at all. A schedule
//! never synced and never backfilled has no history, so nothing is missing.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::ledger::{self, LedgerError, Spell};
use super::plan;
use super::reprocess::{self, Options, Progress, Reprocess};
use super::spec::Schedule;
use super::timeline::Run;

/// How long after its fire time an unrecorded run is due rather than
/// missing: a leader's tick comes well within it.
pub const DUE_GRACE: chrono::Duration = chrono::Duration::seconds(60);

/// Largest range one command handles, in runs.
pub const MAX_RUNS: usize = 2_000_000;
/// Runs one step of a backfill records at most.
pub(super) const CHUNK: usize = 5_000;

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
    /// Which runs it was asked to give a job (`--reprocess`).
    pub reprocess: Reprocess,
    /// Runs in the range (on or after `start`).
    pub in_range: u64,
    /// Runs that had no ledger row and were emitted.
    pub emitted: u64,
    /// Runs recorded as skipped before, emitted now.
    pub emitted_after_skip: u64,
    /// Runs whose dead job was replaced by a new one (`failed`, `all`).
    pub reemitted_dead: u64,
    /// Runs whose done job was replaced by a new one (`all`).
    pub reemitted_done: u64,
    /// Runs whose cancelled job was replaced by a new one (`all`; `failed`
    /// leaves what an operator cancelled).
    pub reemitted_cancelled: u64,
    /// Runs whose job retention had deleted, emitted again (`all`).
    pub reemitted_deleted: u64,
    /// Runs that had a job (or one retention deleted) and were left as
    /// they were.
    pub already_emitted: u64,
    /// Of `already_emitted`: runs whose job is still ready or running.
    pub still_active: u64,
    /// Runs with no job that this mode does not emit (`failed`).
    pub without_job: u64,
}

pub(super) fn runs(
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

/// Emits the runs with `from <= fire_at < to` that have no job yet
/// ([`reprocess::run`] with `--reprocess missing`, the default, and no
/// tracer: `almanac backfill` calls that with its own).
/// `progress(done, total)` is called after each chunk.
pub async fn backfill(
    conn: &mut PgConnection,
    schedule: &Schedule,
    range: Range,
    mut progress: impl FnMut(u64, u64),
) -> Result<BackfillReport, BackfillError> {
    let off = crate::telemetry::Tracer::off();
    reprocess::run(conn, schedule, range, Options::default(), &off, |p| {
        if let Progress::Step { done, total, .. } = p {
            progress(done, total)
        }
    })
    .await
}

/// What became of a run with no ledger row, by the module doc's rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unrecorded {
    /// Before the schedule's first sync and its earliest ledger row.
    BeforeHistory,
    /// Fell due while the schedule was disabled or paused.
    Disabled,
    /// Fell due within the last [`DUE_GRACE`].
    Due,
    Missing,
}

/// Where schedule `$1`'s history begins: the earlier of its first sync and
/// its earliest ledger row (a trigger's is not history). One probe of
/// `schedule_runs_fire_idx` from the oldest end.
pub const HISTORY_SINCE_SQL: &str = r#"
    SELECT least(
        (SELECT created_at FROM almanac.schedules WHERE name = $1),
        (SELECT fire_at FROM almanac.schedule_runs WHERE schedule = $1
          AND source <> 'trigger' ORDER BY fire_at LIMIT 1))
    "#;

/// What the missing rule reads about one schedule at one instant.
#[derive(Debug, Clone)]
pub struct Expected {
    /// The earlier of the first sync and the earliest ledger row.
    since: Option<DateTime<Utc>>,
    disabled: Vec<Spell>,
    now: DateTime<Utc>,
}

impl Expected {
    /// Reads the schedule's first sync, earliest ledger row and disabled
    /// spells, for the rule at database time `now`.
    pub async fn read(
        conn: &mut PgConnection,
        schedule: &str,
        now: DateTime<Utc>,
    ) -> Result<Expected, BackfillError> {
        let since: Option<DateTime<Utc>> = sqlx::query_scalar(HISTORY_SINCE_SQL)
            .bind(schedule)
            .fetch_one(&mut *conn)
            .await
            .map_err(LedgerError::from)?;
        let name = [schedule.to_string()];
        let mut disabled = ledger::disabled_spells(conn, &name)
            .await?
            .remove(schedule)
            .unwrap_or_default();
        disabled.extend(
            super::controls::pause_spells(conn, &name, None)
                .await?
                .remove(schedule)
                .unwrap_or_default(),
        );
        Ok(Expected {
            since,
            disabled,
            now,
        })
    }

    /// The instant the rule is applied at.
    pub fn now(&self) -> DateTime<Utc> {
        self.now
    }

    /// The one rule: what a run with no ledger row is (see the module doc).
    pub fn unrecorded(&self, run: &Run) -> Unrecorded {
        if self.since.is_none_or(|since| run.fire_at < since) {
            Unrecorded::BeforeHistory
        } else if self.disabled.iter().any(|s| s.covers(run.fire_at)) {
            Unrecorded::Disabled
        } else if self.now - run.fire_at <= DUE_GRACE {
            Unrecorded::Due
        } else {
            Unrecorded::Missing
        }
    }
}

/// The runs with `from <= fire_at < to`, already due, that are missing from
/// the ledger by the module doc's rule: holes anywhere in the range, not only
/// after the last run.
pub async fn gaps(
    conn: &mut PgConnection,
    schedule: &Schedule,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<Vec<Run>, BackfillError> {
    let now = db_now(conn).await?;
    gaps_at(conn, schedule, from, to, now).await
}

/// [`gaps`] at the instant `now` (the calendar's, or a test's).
pub async fn gaps_at(
    conn: &mut PgConnection,
    schedule: &Schedule,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<Vec<Run>, BackfillError> {
    let to = to.min(now + chrono::Duration::microseconds(1));
    if to <= from {
        return Ok(Vec::new());
    }
    let expected = Expected::read(conn, &schedule.name, now).await?;
    let runs = runs(schedule, from, to)?;
    let recorded = ledger::rows_between(conn, &schedule.name, from, to).await?;
    Ok(runs
        .into_iter()
        .filter(|r| {
            !recorded.contains_key(&r.logical_run) && expected.unrecorded(r) == Unrecorded::Missing
        })
        .collect())
}
