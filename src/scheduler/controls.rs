//! The operator's runtime controls: pause, resume and trigger, stored in the
//! database (the schedule files stay the source of the definitions).
//!
//! **Pause** opens a spell in `almanac.schedule_pauses` (when, who, why);
//! **resume** closes it. Being rows, they need no reload and outlive a
//! leader; when the leader reads them is [`super::ticker`]'s, what they do
//! to the runs is [`super::plan`]'s rule.
//!
//! **Trigger** records one run of a schedule with source `trigger` through
//! [`ledger::record`], so it is never doubled: by another trigger (at once or
//! later), by a backfill, or by the tick that reaches the same logical run.
//! Its job is due at once. The run is the one named (`--logical-run`) or,
//! without a name, the most recent run that has fallen due: the logical-run
//! scheme names runs by their slot, so "now" is only idempotent as a slot
//! that exists. A run already recorded with a job is reported and nothing is
//! emitted; a run recorded as skipped gets its job, as a backfill would.
//! Triggered rows never move the scheduler's cursor forward, so they cannot
//! hide a due run. (A run the tick recorded skipped and a trigger then
//! emits is re-sourced `trigger`, as a backfill re-sources it `backfill`:
//! the cursor then reads the run before it, and the schedule's lag reads up
//! to one period high until the tick records the next run; nothing is
//! emitted twice, the next load finds every row already there.)

use chrono::{DateTime, NaiveDate, Utc};
use sqlx::PgConnection;

use super::backfill::{db_now, BackfillError};
use super::ledger::{self, LedgerError, Spell};
use super::plan::{self, Decision, Planned, Source};
use super::spec::Schedule;
use super::timeline::Run;
use crate::telemetry::Tracer;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Backfill(#[from] BackfillError),
    #[error("`{given}` is not a logical run of `{schedule}`; its runs are named like `{example}`")]
    NotALogicalRun {
        schedule: String,
        given: String,
        example: String,
    },
    #[error("no run of `{schedule}` has fallen due yet; name one with --logical-run (the next is `{next}`)")]
    NothingDue { schedule: String, next: String },
}

impl From<sqlx::Error> for ControlError {
    fn from(e: sqlx::Error) -> Self {
        ControlError::Ledger(e.into())
    }
}

/// An open or closed pause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pause {
    pub schedule: String,
    pub since: DateTime<Utc>,
    pub by: String,
    pub note: String,
}

/// What `pause` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Paused {
    Now(Pause),
    /// It was paused already; nothing changed.
    Already(Pause),
}

/// Pauses `schedule` (synced first, so it is known) from `at` (an injected
/// clock) or the database's `now()`.
pub async fn pause(
    conn: &mut PgConnection,
    schedule: &Schedule,
    note: &str,
    by: &str,
    at: Option<DateTime<Utc>>,
) -> Result<Paused, ControlError> {
    ledger::sync(conn, std::slice::from_ref(schedule), false).await?;
    let opened: Option<DateTime<Utc>> = sqlx::query_scalar(
        r#"
        INSERT INTO almanac.schedule_pauses (schedule, paused_at, note, paused_by)
        VALUES ($1, coalesce($2, now()), $3, $4)
        ON CONFLICT (schedule) WHERE resumed_at IS NULL DO NOTHING
        RETURNING paused_at
        "#,
    )
    .bind(&schedule.name)
    .bind(at)
    .bind(note)
    .bind(by)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(since) = opened {
        return Ok(Paused::Now(Pause {
            schedule: schedule.name.clone(),
            since,
            by: by.into(),
            note: note.into(),
        }));
    }
    let open = paused(conn, std::slice::from_ref(&schedule.name)).await?;
    match open.into_iter().next() {
        Some(p) => Ok(Paused::Already(p)),
        // Resumed in between: pause again.
        None => Box::pin(pause(conn, schedule, note, by, at)).await,
    }
}

/// Resumes `name` at `at` or the database's `now()`; the pause it ended, or
/// `None` when it was not paused.
pub async fn resume(
    conn: &mut PgConnection,
    name: &str,
    by: &str,
    at: Option<DateTime<Utc>>,
) -> Result<Option<Pause>, ControlError> {
    let row: Option<(DateTime<Utc>, String, String)> = sqlx::query_as(
        r#"
        UPDATE almanac.schedule_pauses
           SET resumed_at = greatest(paused_at, coalesce($2, now())), resumed_by = $3
         WHERE schedule = $1 AND resumed_at IS NULL
        RETURNING paused_at, paused_by, note
        "#,
    )
    .bind(name)
    .bind(at)
    .bind(by)
    .fetch_optional(conn)
    .await?;
    Ok(row.map(|(since, by, note)| Pause {
        schedule: name.into(),
        since,
        by,
        note,
    }))
}

/// The open pauses among `names`.
pub async fn paused(conn: &mut PgConnection, names: &[String]) -> Result<Vec<Pause>, LedgerError> {
    let rows: Vec<(String, DateTime<Utc>, String, String)> = sqlx::query_as(
        r#"
        SELECT schedule, paused_at, paused_by, note FROM almanac.schedule_pauses
         WHERE schedule = ANY($1) AND resumed_at IS NULL
         ORDER BY schedule
        "#,
    )
    .bind(names)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(schedule, since, by, note)| Pause {
            schedule,
            since,
            by,
            note,
        })
        .collect())
}

/// The pause spells of each named schedule that end after `after` (all of
/// them with `None`; open ones always), oldest first (what [`plan::classify`] reads).
pub async fn pause_spells(
    conn: &mut PgConnection,
    names: &[String],
    after: Option<DateTime<Utc>>,
) -> Result<std::collections::HashMap<String, Vec<Spell>>, LedgerError> {
    let rows: Vec<(String, DateTime<Utc>, Option<DateTime<Utc>>)> = sqlx::query_as(
        r#"
        SELECT schedule, paused_at, resumed_at FROM almanac.schedule_pauses
         WHERE schedule = ANY($1) AND (resumed_at IS NULL OR $2::timestamptz IS NULL OR resumed_at > $2)
         ORDER BY schedule, paused_at
        "#,
    )
    .bind(names)
    .bind(after)
    .fetch_all(conn)
    .await?;
    let mut out: std::collections::HashMap<String, Vec<Spell>> = Default::default();
    for (name, from, until) in rows {
        out.entry(name).or_default().push(Spell { from, until });
    }
    Ok(out)
}

/// What `trigger` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Triggered {
    /// The run had no job; it has one now.
    Emitted { run: Run, job_id: i64 },
    /// The run already had a job: nothing was emitted.
    Existed {
        run: Run,
        source: String,
        job_id: Option<i64>,
    },
}

/// The most recent run of `schedule` at or before `now`, looking back as
/// far as about ten years.
pub fn latest_due(schedule: &Schedule, now: DateTime<Utc>) -> Option<Run> {
    let to = now + chrono::Duration::microseconds(1);
    [1, 50, 800, 13_000, 130_000]
        .into_iter()
        .map(|hours| {
            let from = now - chrono::Duration::hours(hours);
            plan::runs_in(schedule, from, to, usize::MAX)
        })
        .find_map(|runs| runs.into_iter().last())
}

/// The run of `schedule` named `name`: logical runs start with a date (a
/// local date, or the UTC date of a minute or second), so the run is looked
/// for in the days around it.
pub fn find_run(schedule: &Schedule, name: &str, now: DateTime<Utc>) -> Result<Run, ControlError> {
    let found = name
        .get(..10)
        .and_then(|d| NaiveDate::parse_from_str(d, "%Y-%m-%d").ok())
        .and_then(|date| {
            let around = schedule.timeline.start_of(date);
            let from = around - chrono::Duration::days(2);
            let to = around + chrono::Duration::days(3);
            plan::runs_in(schedule, from, to, usize::MAX)
                .into_iter()
                .find(|r| r.logical_run == name)
        });
    found.ok_or_else(|| ControlError::NotALogicalRun {
        schedule: schedule.name.clone(),
        given: name.into(),
        example: latest_due(schedule, now)
            .or_else(|| schedule.next_after(now))
            .map(|r| r.logical_run)
            .unwrap_or_else(|| "(none: it has no runs)".into()),
    })
}

/// Emits one run of `schedule` now (see the module doc): `logical_run`, or
/// the most recent due run; an emitted run gets its
/// `almanac.schedule.run` span in `tracer` (docs/tracing.md).
pub async fn trigger(
    conn: &mut PgConnection,
    schedule: &Schedule,
    logical_run: Option<&str>,
    tracer: &Tracer,
) -> Result<Triggered, ControlError> {
    let now = db_now(conn).await?;
    let run = match logical_run {
        Some(name) => find_run(schedule, name, now)?,
        None => latest_due(schedule, now).ok_or_else(|| ControlError::NothingDue {
            schedule: schedule.name.clone(),
            next: schedule
                .next_after(now)
                .map(|r| r.logical_run)
                .unwrap_or_else(|| "none".into()),
        })?,
    };
    ledger::sync(conn, std::slice::from_ref(schedule), false).await?;
    let planned = Planned {
        run: run.clone(),
        source: Source::Trigger,
        decision: Decision::Emit,
    };
    let recorded = ledger::record(conn, &[(schedule, &planned)], false, true, tracer).await?;
    let (source, job_id): (String, Option<i64>) = sqlx::query_as(
        "SELECT source, job_id FROM almanac.schedule_runs WHERE schedule = $1 AND logical_run = $2",
    )
    .bind(&schedule.name)
    .bind(&run.logical_run)
    .fetch_one(&mut *conn)
    .await?;
    if recorded.emitted + recorded.emitted_after_skip == 1 {
        Ok(Triggered::Emitted {
            run,
            job_id: job_id.unwrap_or_default(),
        })
    } else {
        Ok(Triggered::Existed {
            run,
            source,
            job_id,
        })
    }
}
