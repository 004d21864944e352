//! Reprocessing: `almanac backfill --reprocess missing|failed|all
//! [--max-active N]` gives runs of a range a job again.
//!
//! - `missing` (the default): the runs with no job, never emitted or
//!   recorded skipped, get one, as [`super::backfill`] describes.
//! - `failed`: the runs whose job went `dead` (a ready job cancelled with `almanac jobs cancel` is `dead` too) get
//!   a new job; nothing else is touched.
//! - `all`: every run of the range runs again: a finished job (`done` or
//!   `dead`) is replaced by a new one, and runs with no job are emitted as
//!   `missing` emits them. A run whose job retention deleted runs again too:
//!   retention deletes only finished jobs, and `all` asks for every run.
//!   (`missing` and `failed` leave those runs alone: nobody knows any more
//!   whether their job succeeded.)
//!
//! **The guarantee: at most one active (`ready` or `running`) job per
//! logical run,** however many reprocesses, retries and leaders run at once.
//! A run's ledger row points at its newest job and is the lock of the run:
//! whatever revives or replaces a scheduled job locks that row first and
//! decides in a later statement (a fresh snapshot, while the lock is held):
//!
//! - a reprocess locks the rows (`FOR UPDATE`, in fire order), then replaces
//!   a run's job only when that job is finished (or deleted) and no job of
//!   the run is ready or running; a run whose job is active is left alone;
//! - `almanac jobs retry` and the dashboard's retries lock the row
//!   (`FOR SHARE`) and revive a dead job only while the ledger still points
//!   at it ([`crate::queue::retry`]): an earlier job of a reprocessed run
//!   is refused, saying which job is the run's now.
//!
//! A replacement is one statement: a new job keyed
//! `schedule:<name>:<logical_run>#<job id>`, and the ledger row re-pointed
//! at it. The earlier jobs stay, under their own keys, as the run's history
//! (`almanac jobs list`, their `schedule` and `logical_run`) until retention
//! deletes them. The key carries the new job's id, not a counter, so it is
//! never reused, even after retention deleted the earlier jobs: a handler
//! that passes it on as an idempotency key is never deduplicated against an
//! earlier execution. The ledger row keeps its `source` and `recorded_at`
//! (who recorded the run, and when), so the scheduler's cursor never moves.
//! Its limit: a job enqueued by hand through the library with a schedule's
//! name and logical run is not in the ledger; a reprocess still never adds
//! a job beside an active one, but a retry of such a job is not checked.
//!
//! **`--max-active N`** emits in steps: each step, under a transaction-level
//! advisory lock per schedule (so two capped backfills of one schedule do
//! not both fill the same free slots), counts the schedule's active jobs of
//! runs in the range (whoever emitted them) and emits at most the free
//! slots; with none free it waits, polling, and reports
//! [`Progress::Waiting`]. Runs are taken in fire order, a step commits as a
//! whole, so stopping the command (Ctrl-C) leaves the rest un-emitted:
//! `missing` and `failed` runs not reached are still missing or failed, and
//! the same command continues. (`all` would run the runs it already re-ran
//! again: continue it `--from` the next run, which the progress names.)

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::backfill::{self, BackfillError, BackfillReport, Range};
use super::ledger::{self, LedgerError, Recorded};
use super::plan::{Decision, Planned, Source};
use super::spec::Schedule;
use super::timeline::Run;
use crate::queue;

/// Which runs of the range get a job.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reprocess {
    /// Runs with no job: never emitted, or recorded skipped.
    #[default]
    Missing,
    /// Runs whose job went dead: each gets a new job.
    Failed,
    /// Every run: finished jobs are replaced, runs with no job are emitted.
    All,
}

impl Reprocess {
    pub fn as_str(self) -> &'static str {
        match self {
            Reprocess::Missing => "missing",
            Reprocess::Failed => "failed",
            Reprocess::All => "all",
        }
    }
}

/// How a backfill emits.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub reprocess: Reprocess,
    /// At most this many jobs of the range ready or running at once.
    pub max_active: Option<NonZeroU32>,
    /// How often to look again while waiting for a free slot.
    pub poll: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            reprocess: Reprocess::Missing,
            max_active: None,
            poll: Duration::from_millis(500),
        }
    }
}

/// What [`run`] reports while it works.
#[derive(Debug, Clone, Copy)]
pub enum Progress<'a> {
    /// A step committed: `done` of the `total` runs to emit were handled;
    /// `next` is the first not handled yet.
    Step {
        done: u64,
        total: u64,
        next: Option<&'a Run>,
    },
    /// No free slot under `--max-active`: `active` jobs of the range are
    /// ready or running; it looks again after [`Options::poll`].
    Waiting {
        active: u64,
        max: u32,
        done: u64,
        total: u64,
        next: Option<&'a Run>,
    },
}

/// What a run of the range is, by its ledger row and its job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    Unrecorded,
    Skipped,
    Active,
    Dead,
    Done,
    /// Stopped by an operator: replaced by `all` only (it did not fail).
    Cancelled,
    /// Emitted; its job was deleted by retention.
    Deleted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    /// Record it and emit its job ([`ledger::record`]).
    Emit,
    /// Replace its finished job ([`replace`]).
    Replace,
}

fn action(mode: Reprocess, found: Found) -> Option<Action> {
    use Found::*;
    match (mode, found) {
        (Reprocess::Missing | Reprocess::All, Unrecorded | Skipped) => Some(Action::Emit),
        (Reprocess::Failed, Dead) | (Reprocess::All, Dead | Done | Cancelled | Deleted) => {
            Some(Action::Replace)
        }
        _ => None,
    }
}

/// The recorded runs of `$1` with `$2 <= fire_at < $3`, and their jobs'
/// statuses (by primary key).
pub const FOUND_BETWEEN: &str = r#"
SELECT r.logical_run, r.outcome, j.status
  FROM almanac.schedule_runs r LEFT JOIN almanac.jobs j ON j.id = r.job_id
 WHERE r.schedule = $1 AND r.fire_at >= $2 AND r.fire_at < $3
"#;

/// The state of the recorded runs of `schedule` with `from <= fire_at < to`.
async fn found_between(
    conn: &mut PgConnection,
    schedule: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<HashMap<String, Found>, LedgerError> {
    let rows: Vec<(String, String, Option<String>)> = sqlx::query_as(FOUND_BETWEEN)
        .bind(schedule)
        .bind(from)
        .bind(to)
        .fetch_all(conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(run, outcome, status)| {
            let found = match (outcome.as_str(), status.as_deref()) {
                ("emitted", Some("ready" | "running")) => Found::Active,
                ("emitted", Some("dead")) => Found::Dead,
                ("emitted", Some("cancelled")) => Found::Cancelled,
                ("emitted", Some(_)) => Found::Done,
                ("emitted", None) => Found::Deleted,
                _ => Found::Skipped,
            };
            (run, found)
        })
        .collect())
}

/// Locks the ledger rows of `runs` (logical runs of `$1`), in fire order so
/// that two reprocesses never deadlock.
pub const LOCK_RUNS: &str = r#"
SELECT 1 FROM almanac.schedule_runs
 WHERE schedule = $1 AND logical_run = ANY($2)
 ORDER BY fire_at
   FOR UPDATE
"#;

/// Replaces the finished jobs of locked ledger rows (see the module doc):
/// `$2` the logical runs, `$3` their base keys, `$10` their traceparents
/// (empty when tracing is off), `$4` the job states to
/// replace (`dead`, `done`, `deleted`); `$5`, `$6`, `$7`, `$9` the new
/// jobs' kind, payload, max_attempts and priority. One statement: the ledger row and
/// its new job are written together (the foreign key is checked at its
/// end, when both exist). Returns, per state replaced, the runs.
pub const REPLACE: &str = r#"
WITH planned AS (
    SELECT * FROM unnest($2::text[], $3::text[], $10::text[]) AS p(logical_run, key, traceparent)
), active AS (
    SELECT DISTINCT logical_run FROM almanac.jobs
     WHERE schedule = $1 AND (status IN ('ready', 'running') OR status = 'held') AND logical_run = ANY($2)
), chosen AS MATERIALIZED (
    SELECT r.logical_run, r.fire_at, p.key, p.traceparent, coalesce(j.status, 'deleted') AS was,
           nextval('almanac.jobs_id_seq') AS id
      FROM almanac.schedule_runs r
      JOIN planned p ON p.logical_run = r.logical_run
      LEFT JOIN almanac.jobs j ON j.id = r.job_id
     WHERE r.schedule = $1 AND r.outcome = 'emitted'
       AND coalesce(j.status, 'deleted') = ANY($4)
       AND NOT EXISTS (SELECT 1 FROM active a WHERE a.logical_run = r.logical_run)
), emitted AS (
    INSERT INTO almanac.jobs
        (id, kind, payload, run_at, max_attempts, idempotency_key, schedule, logical_run, priority,
         traceparent)
    OVERRIDING SYSTEM VALUE
    SELECT c.id, $5, $6, c.fire_at, $7, c.key || '#' || c.id, $1, c.logical_run, $9::smallint,
           c.traceparent
      FROM chosen c
    RETURNING id
), relinked AS (
    UPDATE almanac.schedule_runs r SET job_id = c.id
      FROM chosen c
     WHERE r.schedule = $1 AND r.logical_run = c.logical_run
    RETURNING c.was, c.logical_run
), notified AS (
    SELECT pg_notify($8, $5) WHERE EXISTS (SELECT 1 FROM emitted)
)
SELECT was, count(*), array_agg(logical_run) FROM relinked
 WHERE (SELECT count(*) FROM notified) >= 0
 GROUP BY was
"#;

/// Active jobs of `$1` whose logical run fell in `[$2, $3)`, through the
/// partial index of unfinished scheduled jobs and the ledger's key.
pub const ACTIVE_IN_RANGE: &str = r#"
SELECT count(*) FROM almanac.jobs j
 WHERE j.schedule = $1 AND (j.status IN ('ready', 'running') OR j.status = 'held')
   AND EXISTS (SELECT 1 FROM almanac.schedule_runs r
                WHERE r.schedule = $1 AND r.logical_run = j.logical_run
                  AND r.fire_at >= $2 AND r.fire_at < $3)
"#;

/// Runs whose finished job a [`replace`] replaced, by what that job was.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Replaced {
    pub dead: u64,
    pub done: u64,
    pub cancelled: u64,
    pub deleted: u64,
}

impl Replaced {
    pub fn total(&self) -> u64 {
        self.dead + self.done + self.cancelled + self.deleted
    }
}

/// Gives each of `runs` (recorded runs of `schedule`) a new job when its
/// job is finished in a way `mode` replaces and no job of the run is active,
/// in one transaction (a savepoint inside the caller's). See the module doc.
/// Each run given a job gets an `almanac.schedule.run` span in `tracer`
/// (source `reprocess`), and its job that span's context.
pub async fn replace(
    conn: &mut PgConnection,
    schedule: &Schedule,
    mode: Reprocess,
    runs: &[&Run],
    tracer: &crate::telemetry::Tracer,
) -> Result<Replaced, LedgerError> {
    let mut replaced = Replaced::default();
    let states: &[&str] = match mode {
        Reprocess::Missing => return Ok(replaced),
        Reprocess::Failed => &["dead"],
        Reprocess::All => &["dead", "done", "cancelled", "deleted"],
    };
    if runs.is_empty() {
        return Ok(replaced);
    }
    let names: Vec<&str> = runs.iter().map(|r| r.logical_run.as_str()).collect();
    let keys: Vec<String> = runs
        .iter()
        .map(|r| schedule.job_key(&r.logical_run))
        .collect();
    // Empty when tracing is off: `unnest` pads it with NULLs.
    let mut traceparents: Vec<Option<String>> = Vec::new();
    let mut spans = Vec::new();
    for run in runs {
        if let Some(span) = ledger::run_span(tracer, schedule, run, "reprocess", "emitted") {
            traceparents.push(Some(span.traceparent()));
            spans.push((run.logical_run.as_str(), span));
        }
    }
    let mut tx = super::begin(&mut *conn).await?;
    sqlx::query(LOCK_RUNS)
        .bind(&schedule.name)
        .bind(&names)
        .execute(&mut *tx)
        .await?;
    // A new statement: it sees every change committed before the locks
    // were granted.
    let counts: Vec<(String, i64, Vec<String>)> = sqlx::query_as(REPLACE)
        .bind(&schedule.name)
        .bind(&names)
        .bind(&keys)
        .bind(states)
        .bind(&schedule.kind)
        .bind(&schedule.payload)
        .bind(schedule.max_attempts)
        .bind(queue::NOTIFY_CHANNEL)
        .bind(schedule.priority)
        .bind(&traceparents)
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    // Only the runs given a job export their spans.
    let given: HashSet<&str> = counts
        .iter()
        .flat_map(|(_, _, runs)| runs.iter().map(String::as_str))
        .collect();
    for (run, span) in spans {
        if given.contains(run) {
            tracer.end(span);
        }
    }
    for (was, n, _) in counts {
        let n = n as u64;
        match was.as_str() {
            "dead" => replaced.dead += n,
            "done" => replaced.done += n,
            "cancelled" => replaced.cancelled += n,
            _ => replaced.deleted += n,
        }
    }
    Ok(replaced)
}

/// Active (`ready` or `running`) jobs of `schedule`'s runs with
/// `from <= fire_at < to`.
pub async fn active_in_range(
    conn: &mut PgConnection,
    schedule: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<u64, LedgerError> {
    let n: i64 = sqlx::query_scalar(ACTIVE_IN_RANGE)
        .bind(schedule)
        .bind(from)
        .bind(to)
        .fetch_one(conn)
        .await?;
    Ok(n as u64)
}

/// Gives the runs of `range` that `options.reprocess` selects a job (see the
/// module doc), at most `options.max_active` active at once. `progress` is
/// called after every step and while waiting.
pub async fn run(
    conn: &mut PgConnection,
    schedule: &Schedule,
    range: Range,
    options: Options,
    tracer: &crate::telemetry::Tracer,
    mut progress: impl FnMut(Progress<'_>),
) -> Result<BackfillReport, BackfillError> {
    let Range {
        from,
        to,
        dry_run,
        allow_future,
    } = range;
    let runs = backfill::runs(schedule, from, to)?;
    if !allow_future {
        let now = backfill::db_now(conn).await?;
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
    let found = found_between(conn, &schedule.name, from, to).await?;
    let mode = options.reprocess;
    let mut report = BackfillReport {
        in_range: runs.len() as u64,
        reprocess: mode,
        ..Default::default()
    };
    let mut todo: Vec<(&Run, Action)> = Vec::new();
    for run in &runs {
        let state = found
            .get(&run.logical_run)
            .copied()
            .unwrap_or(Found::Unrecorded);
        match (state, action(mode, state)) {
            (Found::Unrecorded, Some(a)) => {
                report.emitted += 1;
                todo.push((run, a));
            }
            (Found::Skipped, Some(a)) => {
                report.emitted_after_skip += 1;
                todo.push((run, a));
            }
            (Found::Unrecorded | Found::Skipped, None) => report.without_job += 1,
            (found, Some(a)) => {
                match found {
                    Found::Dead => report.reemitted_dead += 1,
                    Found::Done => report.reemitted_done += 1,
                    Found::Cancelled => report.reemitted_cancelled += 1,
                    _ => report.reemitted_deleted += 1,
                }
                todo.push((run, a));
            }
            (found, None) => {
                report.already_emitted += 1;
                if found == Found::Active {
                    report.still_active += 1;
                }
            }
        }
    }
    if dry_run {
        return Ok(report);
    }

    let total = todo.len() as u64;
    let mut recorded = Recorded::default();
    let mut replaced = Replaced::default();
    let mut not_replaced = 0u64;
    let mut done = 0usize;
    while done < todo.len() {
        let mut tx = super::begin(&mut *conn).await.map_err(LedgerError::from)?;
        let room = match options.max_active {
            None => backfill::CHUNK,
            Some(max) => {
                sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
                    .bind(format!("almanac.backfill:{}", schedule.name))
                    .execute(&mut *tx)
                    .await
                    .map_err(LedgerError::from)?;
                let active = active_in_range(&mut tx, &schedule.name, from, to).await?;
                let free = u64::from(max.get()).saturating_sub(active);
                if free == 0 {
                    tx.rollback().await.map_err(LedgerError::from)?;
                    progress(Progress::Waiting {
                        active,
                        max: max.get(),
                        done: done as u64,
                        total,
                        next: todo.get(done).map(|(r, _)| *r),
                    });
                    tokio::time::sleep(options.poll).await;
                    continue;
                }
                (free as usize).min(backfill::CHUNK)
            }
        };
        let step = &todo[done..(done + room).min(todo.len())];
        let planned: Vec<Planned> = step
            .iter()
            .filter(|(_, a)| *a == Action::Emit)
            .map(|(run, _)| Planned {
                run: (*run).clone(),
                source: Source::Backfill,
                decision: Decision::Emit,
            })
            .collect();
        let batch: Vec<(&Schedule, &Planned)> = planned.iter().map(|p| (schedule, p)).collect();
        let to_replace: Vec<&Run> = step
            .iter()
            .filter(|(_, a)| *a == Action::Replace)
            .map(|(run, _)| *run)
            .collect();
        let r = replace(&mut tx, schedule, mode, &to_replace, tracer).await?;
        recorded.add(ledger::record(&mut tx, &batch, false, true, tracer).await?);
        tx.commit().await.map_err(LedgerError::from)?;
        not_replaced += to_replace.len() as u64 - r.total();
        replaced.dead += r.dead;
        replaced.done += r.done;
        replaced.cancelled += r.cancelled;
        replaced.deleted += r.deleted;
        done += step.len();
        progress(Progress::Step {
            done: done as u64,
            total,
            next: todo.get(done).map(|(r, _)| *r),
        });
    }
    // What another process did meanwhile counts as already there.
    report.emitted = recorded.emitted;
    report.emitted_after_skip = recorded.emitted_after_skip;
    report.reemitted_dead = replaced.dead;
    report.reemitted_done = replaced.done;
    report.reemitted_cancelled = replaced.cancelled;
    report.reemitted_deleted = replaced.deleted;
    report.already_emitted += recorded.existed + not_replaced;
    Ok(report)
}
