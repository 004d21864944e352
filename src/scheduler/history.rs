//! The schedules as last synced to the database, and a schedule's run
//! calendar: each run of a window with what became of it. The dashboard
//! reads these; the scheduler never does.
//!
//! A calendar's cells without a ledger row are classified by the missing
//! rule of [`super::backfill`] ([`backfill::Expected::unrecorded`]), the one
//! `almanac gaps` applies.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use sqlx::PgConnection;

use super::backfill::{self, BackfillError, Expected, Unrecorded};
use super::cron::CronExpr;
use super::deadline::Deadline;
use super::ledger::{self, LedgerError};
use super::plan;
use super::spec::{Catchup, Overlap, Schedule};
use super::timeline::{Run, Timeline};
use crate::queue::{self, JobStatus};

/// One row of `almanac.schedules`.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Synced {
    pub name: String,
    pub cron: String,
    pub timezone: String,
    pub kind: String,
    pub payload: serde_json::Value,
    pub catchup: String,
    pub catchup_window_seconds: f64,
    pub start: Option<NaiveDate>,
    pub overlap: String,
    pub max_attempts: i32,
    pub enabled: bool,
    /// `2h` or `06:00`, as [`super::deadline::Deadline`] writes it.
    pub deadline: Option<String>,
    /// Of every job it emits, 0 to 9.
    pub priority: i16,
    /// The schedule's first sync.
    pub created_at: DateTime<Utc>,
}

const SYNCED_SQL: &str = "SELECT name, cron, timezone, kind, payload, catchup, \
    extract(epoch FROM catchup_window)::float8 AS catchup_window_seconds, start, overlap, \
    max_attempts, enabled, deadline, priority, created_at FROM almanac.schedules";

/// Every synced schedule, enabled or not, by name.
pub async fn synced(conn: &mut PgConnection) -> Result<Vec<Synced>, LedgerError> {
    Ok(sqlx::query_as(&format!("{SYNCED_SQL} ORDER BY name"))
        .fetch_all(conn)
        .await?)
}

pub async fn synced_one(
    conn: &mut PgConnection,
    name: &str,
) -> Result<Option<Synced>, LedgerError> {
    Ok(sqlx::query_as(&format!("{SYNCED_SQL} WHERE name = $1"))
        .bind(name)
        .fetch_optional(conn)
        .await?)
}

/// Each synced schedule's latest emitted run: one backward probe of
/// `schedule_runs_emitted_idx` (migration 0121) per schedule, however many
/// skipped runs came since (`schedule_runs_fire_idx` walked them all).
pub const LAST_EMITTED_SQL: &str = r#"
    SELECT s.name, r.logical_run, r.fire_at FROM almanac.schedules s
    CROSS JOIN LATERAL (
        SELECT logical_run, fire_at FROM almanac.schedule_runs
         WHERE schedule = s.name AND outcome = 'emitted'
         ORDER BY fire_at DESC LIMIT 1) r
    "#;

/// Each synced schedule's latest emitted run: name → (logical run,
/// fire_at) ([`LAST_EMITTED_SQL`]).
pub async fn last_emitted(
    conn: &mut PgConnection,
) -> Result<HashMap<String, (String, DateTime<Utc>)>, LedgerError> {
    let rows: Vec<(String, String, DateTime<Utc>)> =
        sqlx::query_as(LAST_EMITTED_SQL).fetch_all(conn).await?;
    Ok(rows.into_iter().map(|(s, r, f)| (s, (r, f))).collect())
}

impl Synced {
    /// The schedule as the scheduler would load it (the stored definition is
    /// validated at sync, so an error here means the row was edited by hand).
    pub fn schedule(&self) -> Result<Schedule, String> {
        let cron = CronExpr::parse(&self.cron).map_err(|e| format!("cron `{}`: {e}", self.cron))?;
        let tz = self
            .timezone
            .parse()
            .map_err(|_| format!("unknown time zone `{}`", self.timezone))?;
        let deadline = self
            .deadline
            .as_deref()
            .map(|d| Deadline::parse(d, tz))
            .transpose()?;
        Ok(Schedule {
            name: self.name.clone(),
            timeline: Timeline::new(cron, tz),
            kind: self.kind.clone(),
            payload: self.payload.clone(),
            catchup: match self.catchup.as_str() {
                "all" => Catchup::All,
                "latest" => Catchup::Latest,
                _ => Catchup::None,
            },
            catchup_window: Duration::from_secs_f64(self.catchup_window_seconds.max(0.0)),
            start: self.start,
            overlap: match self.overlap.as_str() {
                "skip" => Overlap::Skip,
                _ => Overlap::Allow,
            },
            max_attempts: self.max_attempts,
            priority: self.priority,
            enabled: self.enabled,
            deadline,
            origin: "the database".into(),
        })
    }
}

/// What became of one run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CellState {
    /// Emitted; its job has not finished (`ready` or `running`).
    Emitted {
        job_id: i64,
    },
    Done {
        job_id: i64,
    },
    /// Emitted; its job is dead.
    Failed {
        job_id: i64,
    },
    /// Emitted; its job was deleted by retention.
    JobDeleted,
    /// Recorded as skipped: `catchup`, `overlap` or `disabled`.
    Skipped {
        reason: String,
    },
    /// No ledger row, and missing: what `almanac gaps` reports.
    Missing,
    /// No ledger row, before the schedule's history began.
    BeforeHistory,
    /// No ledger row yet; fell due while the schedule was disabled (recorded
    /// `skipped_disabled` when it is enabled again).
    Disabled,
    /// No ledger row yet; fell due within the last [`DUE_GRACE`] (the leader
    /// emits it at its next tick).
    Due,
}

pub use super::backfill::DUE_GRACE;

#[derive(Debug, Clone)]
pub struct Cell {
    pub run: Run,
    pub state: CellState,
    /// `tick`, `catchup` or `backfill`, for recorded runs.
    pub source: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Calendar {
    /// Oldest first.
    pub cells: Vec<Cell>,
    /// The range the cells cover, `[from, to)`.
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
}

/// How far back a calendar looks.
pub const CALENDAR_DAYS: i64 = 90;
/// Most cells of a sub-daily schedule's calendar (its latest runs).
pub const CALENDAR_RUNS: usize = 240;

/// The first run of `runs` to show: a daily schedule shows its whole window,
/// a sub-daily one its last [`CALENDAR_RUNS`] runs.
fn window(schedule: &Schedule, now: DateTime<Utc>) -> Vec<Run> {
    let end = now + chrono::Duration::microseconds(1);
    let earliest = now - chrono::Duration::days(CALENDAR_DAYS);
    if schedule.timeline.is_daily() {
        return plan::runs_in(schedule, earliest, end, CALENDAR_DAYS as usize + 2);
    }
    let mut span = chrono::Duration::hours(1);
    loop {
        let from = (now - span).max(earliest);
        let mut runs = plan::runs_in(schedule, from, end, 400_000);
        if runs.len() >= CALENDAR_RUNS || from == earliest {
            let drop = runs.len().saturating_sub(CALENDAR_RUNS);
            runs.drain(..drop);
            return runs;
        }
        span = span * 4;
    }
}

/// The calendar of `schedule` up to the database's time.
pub async fn calendar(
    conn: &mut PgConnection,
    schedule: &Schedule,
) -> Result<Calendar, BackfillError> {
    let now = backfill::db_now(conn).await?;
    calendar_at(conn, schedule, now).await
}

/// The calendar of `schedule` up to the instant `now`.
pub async fn calendar_at(
    conn: &mut PgConnection,
    schedule: &Schedule,
    now: DateTime<Utc>,
) -> Result<Calendar, BackfillError> {
    let to = now + chrono::Duration::microseconds(1);
    let runs = window(schedule, now);
    let from = runs.first().map_or(now, |r| r.fire_at);
    let recorded = ledger::rows_between(conn, &schedule.name, from, to).await?;
    let expected = Expected::read(conn, &schedule.name, now).await?;
    let ids: Vec<i64> = recorded.values().filter_map(|r| r.job_id).collect();
    let statuses = queue::statuses(&mut *conn, &ids)
        .await
        .map_err(LedgerError::from)?;
    let cells = runs
        .into_iter()
        .map(|run| {
            let row = recorded.get(&run.logical_run);
            let state = match row {
                Some(row) if row.outcome == "emitted" => match row.job_id {
                    None => CellState::JobDeleted,
                    Some(job_id) => match statuses.get(&job_id) {
                        Some(JobStatus::Done) => CellState::Done { job_id },
                        Some(JobStatus::Dead | JobStatus::Cancelled) => {
                            CellState::Failed { job_id }
                        }
                        Some(_) => CellState::Emitted { job_id },
                        None => CellState::JobDeleted,
                    },
                },
                Some(row) => CellState::Skipped {
                    reason: row
                        .outcome
                        .strip_prefix("skipped_")
                        .unwrap_or(&row.outcome)
                        .to_string(),
                },
                None => match expected.unrecorded(&run) {
                    Unrecorded::BeforeHistory => CellState::BeforeHistory,
                    Unrecorded::Disabled => CellState::Disabled,
                    Unrecorded::Due => CellState::Due,
                    Unrecorded::Missing => CellState::Missing,
                },
            };
            Cell {
                source: row.map(|r| r.source.clone()),
                run,
                state,
            }
        })
        .collect();
    Ok(Calendar { cells, from, to })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(cron: &str) -> Schedule {
        Synced {
            name: "s".into(),
            cron: cron.into(),
            timezone: "Europe/Berlin".into(),
            kind: "k".into(),
            payload: serde_json::json!({}),
            catchup: "latest".into(),
            catchup_window_seconds: 3600.0,
            start: None,
            overlap: "skip".into(),
            max_attempts: 3,
            enabled: true,
            deadline: None,
            priority: 0,
            created_at: Utc::now(),
        }
        .schedule()
        .unwrap()
    }

    #[test]
    fn a_daily_calendar_covers_ninety_days_and_a_sub_daily_one_its_last_runs() {
        let now: DateTime<Utc> = "2026-06-15T12:00:00Z".parse().unwrap();
        let daily = window(&schedule("0 2 * * *"), now);
        assert_eq!(daily.len(), 90);
        assert_eq!(daily.last().unwrap().logical_run, "2026-06-15");
        let minutely = window(&schedule("*/5 * * * *"), now);
        assert_eq!(minutely.len(), CALENDAR_RUNS);
        assert_eq!(minutely.last().unwrap().fire_at, now);
        let rare = window(&schedule("0 */12 * * *"), now);
        assert!((178..=182).contains(&rare.len()), "{}", rare.len());
    }
}
