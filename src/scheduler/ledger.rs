//! The schedule tables: definitions as last synced, and the run ledger.
//!
//! Recording a batch of runs is one transaction: the `schedule_runs` rows
//! (keyed by `(schedule, logical_run)`) and the jobs they emit (keyed by
//! `schedule:<name>:<logical_run>`) commit together. A run already in the
//! ledger is left alone, so two leaders, a retried tick, or a backfill
//! repeated twice can never emit a run twice, and a run whose job the janitor
//! has deleted (the ledger row stays, `job_id` NULL) is never emitted again.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use sqlx::{Connection, PgConnection};

use super::plan::{Cursor, Decision, Planned};

/// The scheduler's cursor, as SQL: the latest run of schedule `s` that a
/// tick or catch-up planned (backfilled and triggered rows are not the
/// scheduler's plan and never move it). One definition for the leader's
/// planning ([`cursors`]) and the lag `stats` reports.
macro_rules! cursor_sql {
    () => {
        "(SELECT r.fire_at FROM almanac.schedule_runs r \
          WHERE r.schedule = s.name AND r.source <> 'backfill' AND r.source <> 'trigger' \
          ORDER BY r.fire_at DESC LIMIT 1)"
    };
}
use super::spec::{Overlap, Schedule};
use super::timeline::Run;
use crate::queue::{self, QueueError};
use crate::telemetry::{Parent, SpanKind, Tracer};
pub(crate) use cursor_sql;

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    Queue(#[from] QueueError),
}

impl LedgerError {
    /// The statement ran out of its `statement_timeout` or `lock_timeout`
    /// (its transaction is aborted; nothing of it was written).
    pub fn is_timeout(&self) -> bool {
        match self {
            LedgerError::Db(sqlx::Error::Database(e)) => {
                matches!(e.code().as_deref(), Some("57014" | "55P03"))
            }
            _ => false,
        }
    }
}

/// Upserts the definitions in one transaction, at the database's time. With
/// `disable_missing`, the schedules not in `schedules` (removed from the
/// files) are disabled; their ledger stays.
pub async fn sync(
    conn: &mut PgConnection,
    schedules: &[Schedule],
    disable_missing: bool,
) -> Result<(), LedgerError> {
    sync_at(conn, schedules, disable_missing, None).await
}

/// [`sync`], with the instant the disabled spells open and close at: `None`
/// is the database's `now()`; tests on an injected clock pass theirs.
///
/// With `disable_missing` (the leader's sync of the whole set), in the same
/// transaction, every disabled schedule without an open spell in
/// `almanac.schedule_disabled` gets one from `at`, and every enabled
/// schedule's open spell is closed at `at`: the spells follow the leader's
/// definitions, never those of a CLI run on another host.
pub async fn sync_at(
    conn: &mut PgConnection,
    schedules: &[Schedule],
    disable_missing: bool,
    at: Option<DateTime<Utc>>,
) -> Result<(), LedgerError> {
    let rows: Vec<serde_json::Value> = schedules
        .iter()
        .map(|s| {
            let mut d = s.definition();
            d["name"] = s.name.clone().into();
            d
        })
        .collect();
    let mut tx = conn.begin().await?;
    sqlx::query(
        r#"
        INSERT INTO almanac.schedules AS s
            (name, cron, timezone, kind, payload, catchup, catchup_window, start, overlap,
             max_attempts, enabled, deadline, priority, definition_hash)
        SELECT d->>'name', d->>'cron', d->>'timezone', d->>'kind', d->'payload', d->>'catchup',
               (d->>'catchup_window')::interval, (d->>'start')::date, d->>'overlap',
               (d->>'max_attempts')::int, (d->>'enabled')::boolean, d->>'deadline',
               coalesce((d->>'priority')::smallint, 0), md5((d - 'name')::text)
        FROM unnest($1::jsonb[]) AS d
        ON CONFLICT (name) DO UPDATE SET
            cron = excluded.cron, timezone = excluded.timezone, kind = excluded.kind,
            payload = excluded.payload, catchup = excluded.catchup,
            catchup_window = excluded.catchup_window, start = excluded.start,
            overlap = excluded.overlap, max_attempts = excluded.max_attempts,
            enabled = excluded.enabled, deadline = excluded.deadline,
            priority = excluded.priority, definition_hash = excluded.definition_hash,
            updated_at = now()
        WHERE s.definition_hash IS DISTINCT FROM excluded.definition_hash
        "#,
    )
    .bind(&rows)
    .execute(&mut *tx)
    .await?;
    if disable_missing {
        let names: Vec<&str> = schedules.iter().map(|s| s.name.as_str()).collect();
        sqlx::query(
            "UPDATE almanac.schedules SET enabled = false, updated_at = now() WHERE enabled AND name <> ALL($1)",
        )
        .bind(&names)
        .execute(&mut *tx)
        .await?;
    }
    // Only the leader's sync (the whole set: `disable_missing`) keeps the
    // spells: a CLI syncing one schedule from its own host's files (backfill,
    // pause, trigger) must not open or close the leader's spells.
    if disable_missing {
        keep_spells(&mut tx, at).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Opens a spell for every disabled schedule without one, closes the open
/// spell of every enabled schedule, at `at` (`None`: the database's now).
async fn keep_spells(
    conn: &mut PgConnection,
    at: Option<DateTime<Utc>>,
) -> Result<(), LedgerError> {
    sqlx::query(
        r#"
        WITH opened AS (
            INSERT INTO almanac.schedule_disabled (schedule, disabled_at)
            SELECT s.name, coalesce($1, now()) FROM almanac.schedules s
             WHERE NOT s.enabled
               AND NOT EXISTS (SELECT 1 FROM almanac.schedule_disabled d
                                WHERE d.schedule = s.name AND d.enabled_at IS NULL)
            ON CONFLICT (schedule) WHERE enabled_at IS NULL DO NOTHING
        )
        UPDATE almanac.schedule_disabled d
           SET enabled_at = greatest(d.disabled_at, coalesce($1, now()))
          FROM almanac.schedules s
         WHERE s.name = d.schedule AND s.enabled AND d.enabled_at IS NULL
        "#,
    )
    .bind(at)
    .execute(conn)
    .await?;
    Ok(())
}

/// A span during which a schedule was disabled, `[from, until)`; `until` is
/// `None` while it still is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Spell {
    pub from: DateTime<Utc>,
    pub until: Option<DateTime<Utc>>,
}

impl Spell {
    pub fn covers(&self, at: DateTime<Utc>) -> bool {
        self.from <= at && self.until.is_none_or(|u| at < u)
    }
}

/// The disabled spells of each named schedule, oldest first.
pub async fn disabled_spells(
    conn: &mut PgConnection,
    names: &[String],
) -> Result<HashMap<String, Vec<Spell>>, LedgerError> {
    let rows: Vec<(String, DateTime<Utc>, Option<DateTime<Utc>>)> = sqlx::query_as(
        r#"
        SELECT schedule, disabled_at, enabled_at FROM almanac.schedule_disabled
         WHERE schedule = ANY($1)
         ORDER BY schedule, disabled_at
        "#,
    )
    .bind(names)
    .fetch_all(conn)
    .await?;
    let mut out: HashMap<String, Vec<Spell>> = HashMap::new();
    for (name, from, until) in rows {
        out.entry(name).or_default().push(Spell { from, until });
    }
    Ok(out)
}

/// The planning cursor of each named, synced schedule: the latest run a
/// `tick` or `catchup` recorded (backfilled rows are not the scheduler's
/// plan and never move it), and the schedule's first sync.
pub async fn cursors(
    conn: &mut PgConnection,
    names: &[String],
) -> Result<HashMap<String, Cursor>, LedgerError> {
    let rows: Vec<(String, DateTime<Utc>, Option<DateTime<Utc>>)> = sqlx::query_as(concat!(
        "SELECT s.name, s.created_at, ",
        cursor_sql!(),
        " FROM almanac.schedules s WHERE s.name = ANY($1)"
    ))
    .bind(names)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, first_seen, last_planned)| {
            (
                name,
                Cursor {
                    last_planned,
                    first_seen,
                },
            )
        })
        .collect())
}

/// What recording a batch did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// Ledger rows written, per schedule and outcome (`emitted`,
    /// `skipped_catchup`, `skipped_overlap`, `skipped_disabled`,
    /// `skipped_paused`): what the
    /// metrics count.
    pub written: Vec<(String, String, u64)>,
    /// New ledger rows with a job.
    pub emitted: u64,
    /// Ledger rows that were skipped before and now have a job (backfill).
    pub emitted_after_skip: u64,
    pub skipped_catchup: u64,
    pub skipped_overlap: u64,
    pub skipped_disabled: u64,
    pub skipped_paused: u64,
    /// Runs already in the ledger, left as they were.
    pub existed: u64,
}

impl Recorded {
    pub fn add(&mut self, other: Recorded) {
        self.emitted += other.emitted;
        self.emitted_after_skip += other.emitted_after_skip;
        self.skipped_catchup += other.skipped_catchup;
        self.skipped_overlap += other.skipped_overlap;
        self.skipped_disabled += other.skipped_disabled;
        self.skipped_paused += other.skipped_paused;
        self.existed += other.existed;
        self.written.extend(other.written);
    }
}

/// Records planned runs and emits their jobs in one transaction.
///
/// With `overlap` true, a `skip` schedule whose previous job is unfinished
/// records its run as `skipped_overlap` (and so does every run after the first
/// in the same batch). With `emit_skipped` true (backfill), runs recorded
/// earlier as skipped get their job now. A `trigger` run's job is due at
/// once (its fire time, or now if that is later).
///
/// The whole batch is one statement, set-based: the ledger rows are inserted
/// from `unnest(...)` (a run already there is left alone), each new emitted
/// row takes its job id up front from the jobs' identity sequence (or the id
/// of a job already holding its key), and the jobs of exactly the rows
/// inserted are inserted from the same arrays. Nothing is read back row by
/// row and no row is updated afterwards. (The foreign key from the ledger to
/// its job is checked at the end of the statement, when both rows exist.)
///
/// This is the one statement outside `queue/` that writes `almanac.jobs`,
/// on purpose: a ledger row and its job must be written together, and only
/// for ledger rows this statement inserted, which a second statement cannot
/// learn without a window in which a concurrent leader or backfill slips in
/// (and the foreign key would be checked between them). It cannot call
/// `almanac.enqueue_many`, the one enqueue implementation that
/// [`queue::enqueue_many`] calls: each ledger row must name its job's id
/// before that job exists, and the function draws its own ids. Its job
/// columns, defaults and NOTIFY follow the function's
/// (migrations/0114_enqueue_function.sql); a change to one is a change to
/// both.
pub async fn record(
    conn: &mut PgConnection,
    batch: &[(&Schedule, &Planned)],
    overlap: bool,
    emit_skipped: bool,
    tracer: &Tracer,
) -> Result<Recorded, LedgerError> {
    if batch.is_empty() {
        return Ok(Recorded::default());
    }
    let mut tx = super::begin(&mut *conn).await?;
    let report = record_in(&mut tx, batch, overlap, emit_skipped, tracer).await?;
    tx.commit().await?;
    Ok(report)
}

/// The `almanac.schedule.run` span of `run` (`None` when tracing is off or
/// the trace is not sampled): each logical run starts a trace.
pub(super) fn run_span(
    tracer: &Tracer,
    schedule: &Schedule,
    run: &Run,
    source: &str,
    outcome: &str,
) -> Option<crate::telemetry::Span> {
    let mut span = tracer.start("almanac.schedule.run", SpanKind::Internal, Parent::Root)?;
    span.attr("almanac.schedule", schedule.name.clone());
    span.attr("almanac.logical_run", run.logical_run.clone());
    span.attr("almanac.schedule.fire_at", run.fire_at.to_rfc3339());
    span.attr("almanac.schedule.source", source.to_string());
    span.attr("almanac.schedule.outcome", outcome.to_string());
    Some(span)
}

/// [`record`] inside the caller's transaction `tx`, which commits it.
pub async fn record_in(
    tx: &mut PgConnection,
    batch: &[(&Schedule, &Planned)],
    overlap: bool,
    emit_skipped: bool,
    tracer: &Tracer,
) -> Result<Recorded, LedgerError> {
    let mut report = Recorded::default();
    if batch.is_empty() {
        return Ok(report);
    }
    let mut busy: HashSet<&str> = HashSet::new();
    let mut busy_rows: Vec<String> = Vec::new();
    if overlap {
        let skippers: Vec<&str> = batch
            .iter()
            .filter(|(s, p)| s.overlap == Overlap::Skip && p.decision == Decision::Emit)
            .map(|(s, _)| s.name.as_str())
            .collect();
        if !skippers.is_empty() {
            busy_rows = queue::schedules_with_unfinished_jobs(&mut *tx, &skippers).await?;
        }
    }
    busy.extend(busy_rows.iter().map(String::as_str));
    let n = batch.len();
    let mut names = Vec::with_capacity(n);
    let mut runs = Vec::with_capacity(n);
    let mut fires = Vec::with_capacity(n);
    let mut sources = Vec::with_capacity(n);
    let mut outcomes = Vec::with_capacity(n);
    let mut kinds = Vec::with_capacity(n);
    let mut payloads = Vec::with_capacity(n);
    let mut attempts = Vec::with_capacity(n);
    let mut priorities = Vec::with_capacity(n);
    let mut keys = Vec::with_capacity(n);
    // Empty when tracing is off: `unnest` pads the shorter array with NULLs.
    let mut traceparents: Vec<Option<String>> = Vec::new();
    let mut spans = Vec::new();
    for (schedule, planned) in batch {
        let outcome = match planned.decision {
            Decision::SkipCatchup => "skipped_catchup",
            Decision::SkipDisabled => "skipped_disabled",
            Decision::SkipPaused => "skipped_paused",
            Decision::Emit if overlap && schedule.overlap == Overlap::Skip => {
                if busy.insert(schedule.name.as_str()) {
                    "emitted"
                } else {
                    "skipped_overlap"
                }
            }
            Decision::Emit => "emitted",
        };
        names.push(schedule.name.as_str());
        runs.push(planned.run.logical_run.as_str());
        fires.push(planned.run.fire_at);
        sources.push(planned.source.as_str());
        outcomes.push(outcome);
        kinds.push(schedule.kind.as_str());
        payloads.push(&schedule.payload);
        attempts.push(schedule.max_attempts);
        priorities.push(schedule.priority);
        keys.push(schedule.job_key(&planned.run.logical_run));
        if let Some(span) = run_span(
            tracer,
            schedule,
            &planned.run,
            planned.source.as_str(),
            outcome,
        ) {
            traceparents.push((outcome == "emitted").then(|| span.traceparent()));
            spans.push((
                (schedule.name.as_str(), planned.run.logical_run.as_str()),
                span,
            ));
        }
    }
    let on_conflict = if emit_skipped {
        "DO UPDATE SET outcome = 'emitted', source = excluded.source, recorded_at = now(), \
         job_id = excluded.job_id \
         WHERE r.outcome <> 'emitted' AND excluded.outcome = 'emitted'"
    } else {
        "DO NOTHING"
    };
    let counts: Vec<(String, String, bool, i64, Vec<String>)> = sqlx::query_as(&format!(
        r#"
        WITH planned AS (
            SELECT * FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::text[], $5::text[],
                                 $6::text[], $7::jsonb[], $8::int[], $9::text[], $11::smallint[],
                                 $12::text[])
                AS p(schedule, logical_run, fire_at, source, outcome, kind, payload, max_attempts, key,
                     priority, traceparent)
        ), recorded AS (
            INSERT INTO almanac.schedule_runs AS r (schedule, logical_run, fire_at, source, outcome, job_id)
            SELECT p.schedule, p.logical_run, p.fire_at, p.source, p.outcome,
                   CASE WHEN p.outcome = 'emitted' THEN coalesce(
                       (SELECT j.id FROM almanac.jobs j WHERE j.idempotency_key = p.key),
                       nextval('almanac.jobs_id_seq'))
                   END
            FROM planned p
            ON CONFLICT (schedule, logical_run) {on_conflict}
            RETURNING r.schedule, r.logical_run, r.outcome, r.job_id, (r.xmax <> 0) AS was_there
        ), emitted AS (
            INSERT INTO almanac.jobs
                (id, kind, payload, run_at, max_attempts, idempotency_key, schedule, logical_run,
                 priority, traceparent)
            OVERRIDING SYSTEM VALUE
            SELECT r.job_id, p.kind, p.payload,
                   CASE WHEN p.source = 'trigger' THEN least(p.fire_at, now()) ELSE p.fire_at END,
                   p.max_attempts, p.key, r.schedule, r.logical_run, p.priority, p.traceparent
            FROM recorded r JOIN planned p USING (schedule, logical_run)
            WHERE r.job_id IS NOT NULL
            ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
            RETURNING kind
        ), notified AS (
            SELECT pg_notify($10, k.kind) FROM (SELECT DISTINCT kind FROM emitted) k
        )
        SELECT schedule, outcome, was_there, count(*),
               CASE WHEN $13 THEN array_agg(logical_run) ELSE '{{}}' END
        FROM recorded
        WHERE (SELECT count(*) FROM notified) >= 0
        GROUP BY schedule, outcome, was_there
        "#
    ))
    .bind(&names)
    .bind(&runs)
    .bind(&fires)
    .bind(&sources)
    .bind(&outcomes)
    .bind(&kinds)
    .bind(&payloads)
    .bind(&attempts)
    .bind(&keys)
    .bind(queue::NOTIFY_CHANNEL)
    .bind(&priorities)
    .bind(&traceparents)
    .bind(tracer.is_on())
    .fetch_all(&mut *tx)
    .await?;
    // The spans of the runs this statement wrote are ended (exported); a
    // run already recorded (a second trigger, a race with the scheduler)
    // drops its span unexported. Ended once the statement ran: a
    // transaction rolled back later leaves a span whose run does not exist
    // (the scheduler records the run again later under a new span; a
    // trigger or backfill only when run again).
    if !spans.is_empty() {
        let wrote: HashSet<(&str, &str)> = counts
            .iter()
            .flat_map(|(schedule, _, _, _, runs)| {
                runs.iter()
                    .map(move |run| (schedule.as_str(), run.as_str()))
            })
            .collect();
        for (key, span) in spans {
            if wrote.contains(&key) {
                tracer.end(span);
            }
        }
    }
    let mut written = 0;
    for (schedule, outcome, was_there, count, _) in counts {
        let count = count as u64;
        written += count;
        match (outcome.as_str(), was_there) {
            ("emitted", true) => report.emitted_after_skip += count,
            ("emitted", false) => report.emitted += count,
            ("skipped_catchup", _) => report.skipped_catchup += count,
            ("skipped_disabled", _) => report.skipped_disabled += count,
            ("skipped_paused", _) => report.skipped_paused += count,
            _ => report.skipped_overlap += count,
        }
        report.written.push((schedule, outcome, count));
    }
    report.existed = n as u64 - written;
    Ok(report)
}

/// One ledger row, as the calendar and `gaps` read it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct LedgerRow {
    pub logical_run: String,
    /// `emitted`, or `skipped_` and the reason.
    pub outcome: String,
    /// `tick`, `catchup`, `backfill` or `trigger`.
    pub source: String,
    /// `None` for a skipped run, or when the janitor deleted its job.
    pub job_id: Option<i64>,
}

/// The ledger rows of schedule `$1` with `$2 <= fire_at < $3`: one range of
/// `schedule_runs_fire_idx`, so it reads the rows of the range and no
/// others, however long the ledger (`tests/it/ledger_scale.rs` holds the
/// plan at a million rows).
pub const ROWS_BETWEEN_SQL: &str = "SELECT logical_run, outcome, source, job_id \
    FROM almanac.schedule_runs WHERE schedule = $1 AND fire_at >= $2 AND fire_at < $3";

/// The ledger rows of one schedule with `from <= fire_at < to`, by logical
/// run: what the calendar and `gaps` read ([`ROWS_BETWEEN_SQL`]).
pub async fn rows_between(
    conn: &mut PgConnection,
    schedule: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<HashMap<String, LedgerRow>, LedgerError> {
    let rows: Vec<LedgerRow> = sqlx::query_as(ROWS_BETWEEN_SQL)
        .bind(schedule)
        .bind(from)
        .bind(to)
        .fetch_all(conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.logical_run.clone(), r))
        .collect())
}
