//! Operator actions and read-only views of the queue.

use serde::Serialize;
use sqlx::{Connection, PgConnection, PgExecutor};

use super::{Job, JobStatus, QueueError, NOTIFY_CHANNEL};

pub async fn get<'e>(db: impl PgExecutor<'e>, id: i64) -> Result<Job, QueueError> {
    sqlx::query_as::<_, Job>("SELECT * FROM almanac.jobs WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await?
        .ok_or(QueueError::NotFound(id))
}

#[derive(Debug, Clone, Default)]
pub struct JobFilter {
    pub status: Option<JobStatus>,
    pub kind: Option<String>,
    pub limit: i64,
}

/// Newest first.
pub async fn list<'e>(db: impl PgExecutor<'e>, filter: &JobFilter) -> Result<Vec<Job>, QueueError> {
    Ok(sqlx::query_as::<_, Job>(
        r#"
        SELECT * FROM almanac.jobs
        WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR kind = $2)
        ORDER BY id DESC
        LIMIT $3
        "#,
    )
    .bind(filter.status)
    .bind(filter.kind.as_deref())
    .bind(filter.limit.max(0))
    .fetch_all(db)
    .await?)
}

/// Gives a dead or cancelled job a fresh set of attempts, due now. `last_error` is kept
/// until the next attempt overwrites it.
///
/// A job of a scheduled run is revived only while the run's ledger row
/// still points at it, checked under that row's lock (`FOR SHARE`), so a
/// retry and a reprocess of the run cannot both make a job of it active
/// ([`crate::scheduler::reprocess`]); an earlier job of a reprocessed run is
/// refused with [`QueueError::Superseded`].
pub async fn retry(conn: &mut PgConnection, id: i64) -> Result<Job, QueueError> {
    let mut tx = conn.begin().await?;
    // (`crate::control::jobs::retry` is this plus its audit row.)
    match retry_in(&mut tx, id).await {
        Ok(job) => {
            tx.commit().await?;
            Ok(job)
        }
        Err(err) => {
            // Rolled back now, not when the connection is next used: the
            // job's row lock must not outlive the refusal.
            let _ = tx.rollback().await;
            Err(err)
        }
    }
}

pub async fn retry_in(tx: &mut PgConnection, id: i64) -> Result<Job, QueueError> {
    // The job row first, then its ledger row: the janitor's delete of a job
    // locks them in that order too (its `ON DELETE SET NULL`), so the two
    // never deadlock.
    let run: Option<(Option<String>, Option<String>)> =
        sqlx::query_as("SELECT schedule, logical_run FROM almanac.jobs WHERE id = $1 FOR UPDATE")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
    if let Some((Some(schedule), Some(logical_run))) = run {
        let ledger: Option<Option<i64>> = sqlx::query_scalar(
            "SELECT job_id FROM almanac.schedule_runs \
             WHERE schedule = $1 AND logical_run = $2 FOR SHARE",
        )
        .bind(&schedule)
        .bind(&logical_run)
        .fetch_optional(&mut *tx)
        .await?;
        match ledger {
            Some(current) if current != Some(id) => {
                return Err(QueueError::Superseded {
                    id,
                    schedule,
                    logical_run,
                    current,
                })
            }
            _ => {}
        }
    }
    let job = transition(
        &mut *tx,
        id,
        "dead or cancelled",
        "retry",
        "UPDATE almanac.jobs SET status = almanac.retry_status(kind, ordering_key), \
             attempts = 0, run_at = now(), finished_at = NULL, \
             route = almanac.route_of(kind), \
             cancel_requested_at = NULL, cancelled_by = NULL, cancel_reason = NULL \
         WHERE id = $1 AND status IN ('dead', 'cancelled') RETURNING *",
    )
    .await?;
    // A job of an ordered kind came back `held`: its key's next job (this
    // one, unless a job stands before it) is released (migration 0115).
    let job = if job.status == JobStatus::Held {
        sqlx::query("SELECT almanac.release_held(ARRAY[$1::bigint])")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        get(&mut *tx, id).await?
    } else {
        job
    };
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(NOTIFY_CHANNEL)
        .bind(&job.kind)
        .execute(&mut *tx)
        .await?;
    Ok(job)
}

/// Running jobs' holders `LISTEN` here; a cancel request of a running job
/// `NOTIFY`s its id, so the process holding it stops the handler at once
/// (its heartbeat finds the request too, should the notification be lost).
pub const CANCEL_CHANNEL: &str = "almanac_cancel";

/// What [`cancel_in`] did.
#[derive(Debug, Clone)]
pub enum Cancel {
    /// The job had not started: it is `cancelled` now.
    Cancelled(Job),
    /// The job is running: the request is recorded, and the process holding
    /// its lease stops the handler and records `cancelled` (or the reaper
    /// does, once the lease runs out). It may still end `done`, should the
    /// handler finish first.
    Requested(Job),
    /// The job had finished (`done`, `dead` or `cancelled`): nothing changed.
    Finished(Job),
}

/// Cancels job `id` inside the caller's transaction (see [`Cancel`]); `by`
/// and `reason` are kept on the job. A second request on a running job
/// keeps the first one's time.
pub async fn cancel_in(
    tx: &mut PgConnection,
    id: i64,
    by: &str,
    reason: Option<&str>,
) -> Result<Cancel, QueueError> {
    let reason = reason.map(super::storable);
    let changed: Option<Job> = sqlx::query_as(
        r#"
        UPDATE almanac.jobs
        SET status = CASE WHEN status = 'running' THEN status ELSE 'cancelled' END,
            finished_at = CASE WHEN status = 'running' THEN finished_at ELSE clock_timestamp() END,
            cancel_requested_at = coalesce(cancel_requested_at, clock_timestamp()),
            cancelled_by = $2,
            cancel_reason = $3
        WHERE id = $1 AND status IN ('ready', 'held', 'running')
        RETURNING *
        "#,
    )
    .bind(id)
    .bind(by)
    .bind(reason.as_deref())
    .fetch_optional(&mut *tx)
    .await?;
    let Some(job) = changed else {
        return Ok(Cancel::Finished(get(&mut *tx, id).await?));
    };
    if job.status == JobStatus::Running {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(CANCEL_CHANNEL)
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        return Ok(Cancel::Requested(job));
    }
    Ok(Cancel::Cancelled(job))
}

async fn transition(
    conn: &mut PgConnection,
    id: i64,
    expected: &'static str,
    action: &'static str,
    sql: &'static str,
) -> Result<Job, QueueError> {
    if let Some(job) = sqlx::query_as::<_, Job>(sql)
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?
    {
        return Ok(job);
    }
    let current = get(&mut *conn, id).await?;
    Err(QueueError::WrongStatus {
        id,
        status: current.status,
        action,
        expected,
    })
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct KindStatusCount {
    pub kind: String,
    pub status: JobStatus,
    pub count: i64,
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct KindAge {
    pub kind: String,
    /// Seconds since the kind's oldest due ready job became due.
    pub seconds: f64,
}

/// The queue at a glance; `almanac stats` and the metrics collector read it.
///
/// The same cost at any size: the counts are the counters' ([`super::counts`]);
/// only while those are not whole are the jobs counted (through partial
/// indexes of unfinished, `dead` or `cancelled` rows, never `done` ones; `done`
/// is then PostgreSQL's row estimate minus the rest).
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    /// Ready, running, held, dead and cancelled jobs per kind (kinds with none are absent).
    pub by_kind_status: Vec<KindStatusCount>,
    /// Per kind with due ready jobs: how long the oldest has waited.
    pub oldest_due_ready: Vec<KindAge>,
    /// Seconds since the oldest due ready job of any kind became due (0 when none).
    pub oldest_due_ready_seconds: f64,
    /// Running jobs whose lease has expired and that the reaper has not taken back yet.
    pub expired_leases: i64,
    pub dead: i64,
    /// Stopped by an operator (kept as long as dead jobs).
    pub cancelled: i64,
    /// Done jobs: exact from the counters, else an estimate (planner
    /// statistics; counting done jobs costs a full scan).
    pub done_estimate: i64,
    /// Whether `done_estimate` is exact (the counters were whole).
    pub done_exact: bool,
}

pub async fn stats(conn: &mut PgConnection) -> Result<Stats, QueueError> {
    // The counters (`counts`): a read of tens of rows at any size. Counted
    // from the jobs only when they are not whole (after a crash, on a
    // standby), which the next fold repairs.
    let (by_kind_status, done) = match super::counts::jobs(&mut *conn).await? {
        Some(counts) => {
            let (done, open): (Vec<_>, Vec<_>) = counts
                .into_iter()
                .partition(|c| c.status == JobStatus::Done);
            (open, Some(done.iter().map(|c| c.count).sum::<i64>()))
        }
        None => (count_unfinished(&mut *conn).await?, None),
    };
    // One probe of `jobs_ready_kind_idx` per kind with ready jobs (the
    // counts above found them): the oldest due job is the first entry.
    let ready_kinds: Vec<&str> = by_kind_status
        .iter()
        .filter(|c| c.status == JobStatus::Ready)
        .map(|c| c.kind.as_str())
        .collect();
    let oldest_due_ready = sqlx::query_as::<_, KindAge>(
        r#"
        SELECT k.kind, greatest(extract(epoch FROM now() - o.run_at), 0)::float8 AS seconds
          FROM unnest($1::text[]) AS k(kind)
          CROSS JOIN LATERAL (
              SELECT j.run_at FROM almanac.jobs j
               WHERE j.kind = k.kind AND j.status = 'ready' AND j.run_at <= now()
               ORDER BY j.run_at LIMIT 1) AS o
         ORDER BY k.kind
        "#,
    )
    .bind(&ready_kinds)
    .fetch_all(&mut *conn)
    .await?;
    let (expired, estimate): (i64, f64) = sqlx::query_as(
        r#"
        SELECT (SELECT count(*) FROM almanac.jobs
                 WHERE status = 'running' AND lease_until < clock_timestamp()),
               (SELECT greatest(reltuples, 0)::float8 FROM pg_class
                 WHERE oid = 'almanac.jobs'::regclass)
        "#,
    )
    .fetch_one(&mut *conn)
    .await?;
    let dead = by_kind_status
        .iter()
        .filter(|c| c.status == JobStatus::Dead)
        .map(|c| c.count)
        .sum();
    let cancelled = by_kind_status
        .iter()
        .filter(|c| c.status == JobStatus::Cancelled)
        .map(|c| c.count)
        .sum();
    let unfinished: i64 = by_kind_status.iter().map(|c| c.count).sum();
    Ok(Stats {
        oldest_due_ready_seconds: oldest_due_ready
            .iter()
            .map(|k| k.seconds)
            .fold(0.0, f64::max),
        by_kind_status,
        oldest_due_ready,
        expired_leases: expired,
        dead,
        cancelled,
        done_estimate: done.unwrap_or((estimate as i64 - unfinished).max(0)),
        done_exact: done.is_some(),
    })
}

/// The ready, running, held, dead and cancelled jobs per kind, counted:
/// O(those jobs), for when the counters are not whole.
async fn count_unfinished(conn: &mut PgConnection) -> Result<Vec<KindStatusCount>, sqlx::Error> {
    sqlx::query_as::<_, KindStatusCount>(
        r#"
        -- The status as a constant, not the column: a partial index does
        -- not hold its predicate's column, so reading it ruled out an
        -- index-only scan (a bitmap scan of the heap instead: 62 ms for
        -- 128,000 ready jobs beside 7 ms; issue #26).
        SELECT kind, 'ready'::text AS status, count(*) AS count FROM almanac.jobs
         WHERE status = 'ready' GROUP BY kind
        UNION ALL
        SELECT kind, 'running', count(*) FROM almanac.jobs
         WHERE status = 'running' GROUP BY kind
        UNION ALL
        SELECT kind, 'dead', count(*) FROM almanac.jobs
         WHERE status = 'dead' GROUP BY kind
        UNION ALL
        SELECT kind, 'cancelled', count(*) FROM almanac.jobs
         WHERE status = 'cancelled' GROUP BY kind
        UNION ALL
        SELECT kind, 'held', count(*) FROM almanac.jobs
         WHERE status = 'held' AND ordering_key IS NOT NULL GROUP BY kind
        ORDER BY kind, status
        "#,
    )
    .fetch_all(conn)
    .await
}

/// Of `schedules`, those with a job still ready, running or held (the
/// scheduler's `overlap = "skip"` check), through
/// `jobs_schedule_unfinished_idx` and `jobs_schedule_held_idx`.
pub async fn schedules_with_unfinished_jobs(
    conn: &mut PgConnection,
    schedules: &[&str],
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT DISTINCT schedule FROM almanac.jobs \
         WHERE schedule = ANY($1) AND (status IN ('ready', 'running') OR status = 'held')",
    )
    .bind(schedules)
    .fetch_all(conn)
    .await
}
