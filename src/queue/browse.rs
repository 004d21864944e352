//! Read views and bulk operator actions for the dashboard, each bounded so
//! it stays cheap on a table of millions of finished jobs.
//!
//! - [`page`] lists jobs newest first by keyset on `id` (never `OFFSET`), and
//!   scans at most [`SCAN_WINDOW`] ids per page: whatever the filters (kind,
//!   status, schedule, text in the payload), a page is one range scan of the
//!   primary key. A filter that matches rarely may give a short or empty page;
//!   the page then says which ids it searched and offers the next window.
//!   An idempotency key is looked up exactly (its unique index), no window.
//! - [`dead_groups`] groups the newest [`DEAD_SAMPLE`] dead jobs and
//!   [`dead_count`] reads the counters unless it filters by error;
//!   [`retry_dead_matching`] reads only dead rows (their partial indexes);
//!   done rows are never touched.
//! - [`throughput`] reads the last hour of the finished-at partial indexes.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Connection, PgConnection, PgExecutor, Postgres, QueryBuilder};

use super::{Job, JobStatus, QueueError, NOTIFY_CHANNEL};

/// Most ids one page of [`page`] scans.
pub const SCAN_WINDOW: i64 = 20_000;

/// Filters of the jobs list; every one is optional.
#[derive(Debug, Clone, Default)]
pub struct JobQuery {
    pub kind: Option<String>,
    pub status: Option<JobStatus>,
    pub idempotency_key: Option<String>,
    pub schedule: Option<String>,
    /// Text anywhere in the payload (its JSON text, case-insensitive).
    pub payload_text: Option<String>,
    /// Keyset cursor: only ids below this one.
    pub before: Option<i64>,
    pub limit: i64,
}

/// One page of [`page`].
#[derive(Debug, Clone)]
pub struct JobPage {
    pub jobs: Vec<Job>,
    /// The ids searched: `[searched_from, searched_below)`.
    pub searched_from: i64,
    pub searched_below: i64,
    /// The cursor of the next (older) page, if older rows may match.
    pub next_before: Option<i64>,
}

/// `text` as an `ILIKE` pattern matching it anywhere, its `%`, `_` and `\\`
/// taken literally.
pub fn like_pattern(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('%');
    for c in text.chars() {
        if matches!(c, '%' | '_' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('%');
    out
}

/// Prefix a statement with this to read its plan (`tests/it/ui.rs` checks that
/// every statement here uses an index on a large table).
pub const EXPLAIN: &str = "EXPLAIN (FORMAT JSON) ";

/// The statement [`page`] runs for `q` within `[from, below)`, after `prefix`
/// (empty, or [`EXPLAIN`]).
pub fn page_query(
    prefix: &str,
    q: &JobQuery,
    from: i64,
    below: i64,
) -> QueryBuilder<'static, Postgres> {
    let mut b = QueryBuilder::new(format!("{prefix}SELECT * FROM almanac.jobs WHERE "));
    if let Some(key) = &q.idempotency_key {
        b.push("idempotency_key = ").push_bind(key.clone());
    } else {
        b.push("id >= ")
            .push_bind(from)
            .push(" AND id < ")
            .push_bind(below);
    }
    if let Some(kind) = &q.kind {
        b.push(" AND kind = ").push_bind(kind.clone());
    }
    if let Some(status) = q.status {
        b.push(" AND status = ").push_bind(status.as_str());
    }
    if let Some(schedule) = &q.schedule {
        b.push(" AND schedule = ").push_bind(schedule.clone());
    }
    if let Some(text) = &q.payload_text {
        b.push(" AND payload::text ILIKE ")
            .push_bind(like_pattern(text));
    }
    b.push(" ORDER BY id DESC LIMIT ")
        .push_bind(q.limit.clamp(1, 500) + 1);
    b
}

/// The newest id in the table (an index probe), 0 when empty.
pub async fn newest_id<'e>(db: impl PgExecutor<'e>) -> Result<i64, QueueError> {
    Ok(
        sqlx::query_scalar::<_, Option<i64>>("SELECT max(id) FROM almanac.jobs")
            .fetch_one(db)
            .await?
            .unwrap_or(0),
    )
}

/// Jobs matching `q`, newest first, one bounded range of ids at a time.
pub async fn page(conn: &mut PgConnection, q: &JobQuery) -> Result<JobPage, QueueError> {
    let below = match q.before {
        Some(before) => before,
        None => newest_id(&mut *conn).await? + 1,
    };
    let from = if q.idempotency_key.is_some() {
        0
    } else {
        (below - SCAN_WINDOW).max(0)
    };
    let limit = q.limit.clamp(1, 500) as usize;
    let mut jobs: Vec<Job> = page_query("", q, from, below)
        .build_query_as()
        .fetch_all(&mut *conn)
        .await?;
    let next_before = if jobs.len() > limit {
        jobs.truncate(limit);
        jobs.last().map(|j| j.id)
    } else if q.idempotency_key.is_none() && from > 1 {
        Some(from)
    } else {
        None
    };
    Ok(JobPage {
        jobs,
        searched_from: from,
        searched_below: below,
        next_before,
    })
}

/// Dead jobs of one kind sharing the first line of their `last_error`.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadGroup {
    pub kind: String,
    pub error: String,
    pub count: i64,
    pub newest_id: i64,
    pub last_finished: Option<DateTime<Utc>>,
}

/// The first line of `last_error`, as the groups use it (SQL).
const FIRST_LINE: &str = "rtrim(split_part(coalesce(last_error, ''), E'\\n', 1), E'\\r')";

/// Most dead jobs [`dead_groups`] groups: the newest, so that the groups
/// cost the same however many dead jobs are kept (500,000 at ten million
/// jobs took 840 ms to group whole; issue #26).
pub const DEAD_SAMPLE: i64 = 10_000;

/// The newest [`DEAD_SAMPLE`] dead jobs grouped by kind and the first line
/// of their error, largest group first, at most `limit` groups: one
/// backward range of `jobs_dead_finished_idx`. The counts are within that
/// sample; [`dead_count`] gives a group's whole count.
pub async fn dead_groups<'e>(
    db: impl PgExecutor<'e>,
    limit: i64,
) -> Result<Vec<DeadGroup>, QueueError> {
    Ok(sqlx::query_as(&dead_groups_sql())
        .bind(limit)
        .fetch_all(db)
        .await?)
}

pub fn dead_groups_sql() -> String {
    format!(
        "SELECT kind, {FIRST_LINE} AS error, count(*) AS count, max(id) AS newest_id, \
         max(finished_at) AS last_finished \
         FROM (SELECT kind, last_error, id, finished_at FROM almanac.jobs \
               WHERE status = 'dead' ORDER BY finished_at DESC LIMIT {DEAD_SAMPLE}) AS newest \
         GROUP BY 1, 2 ORDER BY count(*) DESC, kind, 2 LIMIT $1"
    )
}

/// Which dead jobs a bulk retry takes: a kind, and optionally the exact first
/// line of their error.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadFilter {
    pub kind: Option<String>,
    pub error: Option<String>,
}

fn dead_where(b: &mut QueryBuilder<'static, Postgres>, f: &DeadFilter) {
    b.push(" WHERE status = 'dead'");
    if let Some(kind) = &f.kind {
        b.push(" AND kind = ").push_bind(kind.clone());
    }
    if let Some(error) = &f.error {
        b.push(format!(" AND {FIRST_LINE} = "))
            .push_bind(error.clone());
    }
}

/// The newest dead jobs matching `f`, at most `limit` (after `prefix`).
pub fn dead_list_query(
    prefix: &str,
    f: &DeadFilter,
    limit: i64,
) -> QueryBuilder<'static, Postgres> {
    let mut b = QueryBuilder::new(format!("{prefix}SELECT * FROM almanac.jobs"));
    dead_where(&mut b, f);
    b.push(" ORDER BY id DESC LIMIT ").push_bind(limit);
    b
}

pub async fn dead_list(
    conn: &mut PgConnection,
    f: &DeadFilter,
    limit: i64,
) -> Result<Vec<Job>, QueueError> {
    Ok(dead_list_query("", f, limit)
        .build_query_as()
        .fetch_all(conn)
        .await?)
}

/// The count of dead jobs matching `f` (after `prefix`).
pub fn dead_count_query(prefix: &str, f: &DeadFilter) -> QueryBuilder<'static, Postgres> {
    let mut b = QueryBuilder::new(format!("{prefix}SELECT count(*) FROM almanac.jobs"));
    dead_where(&mut b, f);
    b
}

/// How many dead jobs match `f`: of a kind or of all kinds, the counters'
/// ([`super::counts`]; the same cost at any size); with an error line, or
/// while the counters are not whole, counted (reads dead rows only).
pub async fn dead_count(conn: &mut PgConnection, f: &DeadFilter) -> Result<i64, QueueError> {
    if f.error.is_none() {
        if let Some(counts) = super::counts::jobs(&mut *conn).await? {
            return Ok(counts
                .iter()
                .filter(|c| c.status == JobStatus::Dead)
                .filter(|c| f.kind.as_ref().is_none_or(|k| *k == c.kind))
                .map(|c| c.count)
                .sum());
        }
    }
    Ok(dead_count_query("", f)
        .build_query_scalar()
        .fetch_one(conn)
        .await?)
}

/// Jobs one statement of [`retry_dead_matching`] retries.
pub const RETRY_BATCH: usize = 1_000;

/// Gives every dead job matching `f` a fresh set of attempts, due now, the
/// same transition as [`super::retry`]. The matching ids are read once, then
/// retried [`RETRY_BATCH`] at a time in short statements, so a large group
/// holds no long lock and a job that dies again meanwhile is not retried
/// twice. An earlier job of a reprocessed scheduled run stays dead, as
/// [`super::retry`] refuses it. Returns how many were retried.
pub async fn retry_dead_matching(
    conn: &mut PgConnection,
    f: &DeadFilter,
) -> Result<u64, QueueError> {
    let ids = dead_ids(&mut *conn, f).await?;
    let mut retried = 0u64;
    for chunk in ids.chunks(RETRY_BATCH) {
        let mut tx = conn.begin().await?;
        retried += retry_dead_batch(&mut tx, chunk).await?;
        tx.commit().await?;
    }
    Ok(retried)
}

/// The ids of the dead jobs matching `f`, ascending (read once, through
/// the partial index of dead rows).
pub async fn dead_ids(conn: &mut PgConnection, f: &DeadFilter) -> Result<Vec<i64>, QueueError> {
    let mut b = QueryBuilder::new("SELECT id FROM almanac.jobs");
    dead_where(&mut b, f);
    b.push(" ORDER BY id");
    Ok(b.build_query_scalar().fetch_all(&mut *conn).await?)
}

/// One batch of [`retry_dead_matching`], inside the caller's transaction:
/// the jobs of `chunk` still dead are locked and retried.
pub async fn retry_dead_batch(tx: &mut PgConnection, chunk: &[i64]) -> Result<u64, QueueError> {
    // As in [`super::retry`]: the job rows, then the ledger rows of the
    // scheduled ones are locked (the janitor's order), and an earlier job
    // of a reprocessed run (the ledger points elsewhere) is left dead.
    let locked: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM almanac.jobs WHERE id = ANY($1) AND status = 'dead' ORDER BY id FOR UPDATE",
    )
    .bind(chunk)
    .fetch_all(&mut *tx)
    .await?;
    retry_locked(tx, &locked).await
}

/// Gives the dead or cancelled jobs among `ids`, whose rows the caller's
/// transaction has locked, a fresh set of attempts, due now (the
/// transition of [`super::retry`]), and wakes their kinds' workers at
/// commit. The ledger rows of scheduled ones are locked after the job rows
/// (the janitor's order), and an earlier job of a reprocessed run (the
/// ledger points elsewhere) is left as it is. Returns how many were retried.
pub async fn retry_locked(tx: &mut PgConnection, ids: &[i64]) -> Result<u64, QueueError> {
    sqlx::query(
        "SELECT 1 FROM almanac.schedule_runs r \
         WHERE (r.schedule, r.logical_run) IN \
               (SELECT schedule, logical_run FROM almanac.jobs \
                 WHERE id = ANY($1) AND schedule IS NOT NULL AND logical_run IS NOT NULL) \
         ORDER BY r.schedule, r.fire_at FOR SHARE OF r",
    )
    .bind(ids)
    .execute(&mut *tx)
    .await?;
    let mut kinds: Vec<String> = sqlx::query_scalar(
        "UPDATE almanac.jobs j SET status = almanac.retry_status(j.kind, j.ordering_key), \
             attempts = 0, run_at = now(), finished_at = NULL, \
             route = almanac.route_of(j.kind), \
             cancel_requested_at = NULL, cancelled_by = NULL, cancel_reason = NULL \
         WHERE id = ANY($1) AND status IN ('dead', 'cancelled') \
           AND NOT EXISTS (SELECT 1 FROM almanac.schedule_runs r \
                            WHERE r.schedule = j.schedule AND r.logical_run = j.logical_run \
                              AND r.job_id IS DISTINCT FROM j.id) \
         RETURNING kind",
    )
    .bind(ids)
    .fetch_all(&mut *tx)
    .await?;
    let retried = kinds.len() as u64;
    // Jobs of ordered kinds came back `held`: each key's next job is
    // released (migration 0115).
    sqlx::query("SELECT almanac.release_held($1)")
        .bind(ids)
        .execute(&mut *tx)
        .await?;
    // Workers of these kinds wake now rather than at their next poll.
    kinds.sort();
    kinds.dedup();
    for kind in &kinds {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(NOTIFY_CHANNEL)
            .bind(kind)
            .execute(&mut *tx)
            .await?;
    }
    Ok(retried)
}

/// Jobs finished per minute over the last hour.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct MinuteCount {
    /// Minutes ago (0 = the current minute).
    pub minutes_ago: i32,
    pub done: i64,
    pub dead: i64,
}

pub const THROUGHPUT_SQL: &str = r#"
    SELECT m.minutes_ago,
           coalesce(d.n, 0) AS done, coalesce(x.n, 0) AS dead
      FROM generate_series(0, 59) AS m(minutes_ago)
      LEFT JOIN (SELECT floor(extract(epoch FROM now() - finished_at) / 60)::int AS ago, count(*) AS n
                   FROM almanac.jobs WHERE status = 'done' AND finished_at > now() - interval '1 hour'
                  GROUP BY 1) d ON d.ago = m.minutes_ago
      LEFT JOIN (SELECT floor(extract(epoch FROM now() - finished_at) / 60)::int AS ago, count(*) AS n
                   FROM almanac.jobs WHERE status = 'dead' AND finished_at > now() - interval '1 hour'
                  GROUP BY 1) x ON x.ago = m.minutes_ago
     ORDER BY m.minutes_ago DESC
"#;

/// Done and dead jobs per minute over the last hour, oldest minute first;
/// cost follows the jobs finished in that hour, not the table.
pub async fn throughput<'e>(db: impl PgExecutor<'e>) -> Result<Vec<MinuteCount>, QueueError> {
    Ok(sqlx::query_as(THROUGHPUT_SQL).fetch_all(db).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn like_patterns_match_text_literally() {
        assert_eq!(like_pattern("50%_off\\"), "%50\\%\\_off\\\\%");
    }

    #[test]
    fn a_key_lookup_has_no_window_and_a_list_has_one() {
        let q = JobQuery {
            idempotency_key: Some("k".into()),
            limit: 10,
            ..Default::default()
        };
        assert!(!page_query("", &q, 0, 5).sql().contains("id >="));
        let q = JobQuery {
            kind: Some("mail".into()),
            limit: 10,
            ..Default::default()
        };
        let sql = page_query("", &q, 0, 5).into_sql();
        assert!(sql.contains("id >= $1 AND id < $2 AND kind = $3"), "{sql}");
    }
}
