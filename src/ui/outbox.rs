//! Read-only views of `almanac.outbox` for the dashboard. The relay owns
//! every write to the outbox; these only read, each through an index: a
//! job's rows (`outbox_job_idx`) and the records of its publications
//! (`outbox_batches_job_span_idx`), the unpublished backlog
//! (`outbox_due_idx`, bounded by what is unpublished) and failed rows
//! (`outbox_failed_idx`).

use chrono::{DateTime, Utc};
use maud::{html, Markup};
use sqlx::PgConnection;

use super::view::{age, dash, first_line, opt_time, time};

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Row {
    pub id: i64,
    pub job_id: i64,
    pub kind: Option<String>,
    pub sink: String,
    /// `None` for a publication record: a batch names jobs, not destinations.
    pub destination: Option<String>,
    pub created_at: DateTime<Utc>,
    pub published_at: Option<DateTime<Utc>>,
    pub failed_at: Option<DateTime<Utc>>,
    pub attempts: i32,
    pub last_error: Option<String>,
}

const COLUMNS: &str = "id, job_id, headers->>'almanac-kind' AS kind, sink, destination, \
    created_at, published_at, failed_at, attempts, last_error";

/// A job's outbox rows: waiting or failed ones, and the records of those
/// published (the relay deletes a row it published and keeps its batch).
pub async fn for_job(conn: &mut PgConnection, job_id: i64) -> Result<Vec<Row>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM almanac.outbox WHERE job_id = $1 \
         UNION ALL \
         SELECT x.id, x.job_id, NULL, b.sink, NULL, b.claimed_at, b.published_at, NULL, 0, NULL \
         FROM almanac.outbox_batches b, unnest(b.ids, b.job_ids) AS x(id, job_id) \
         WHERE b.job_span @> $1::bigint AND b.published_at IS NOT NULL \
           AND x.job_id = $1 \
         ORDER BY 1"
    ))
    .bind(job_id)
    .fetch_all(conn)
    .await
}

pub const FAILED_SQL: &str =
    "SELECT id, job_id, headers->>'almanac-kind' AS kind, sink, destination, \
    created_at, published_at, failed_at, attempts, last_error \
    FROM almanac.outbox WHERE failed_at IS NOT NULL ORDER BY failed_at DESC LIMIT $1";

/// The most recently failed rows.
pub async fn failed(conn: &mut PgConnection, limit: i64) -> Result<Vec<Row>, sqlx::Error> {
    sqlx::query_as(FAILED_SQL).bind(limit).fetch_all(conn).await
}

/// Unpublished rows per kind, over both sinks: the counters' (the same
/// cost whatever the backlog), or counted while those are not whole.
pub async fn backlog_by_kind(
    conn: &mut PgConnection,
) -> Result<std::collections::BTreeMap<String, i64>, sqlx::Error> {
    let rows: Vec<(String, i64)> = match crate::queue::counts::outbox(&mut *conn).await? {
        Some(counted) => counted
            .into_iter()
            .filter(|c| c.status == "pending")
            .map(|c| (c.kind, c.count))
            .collect(),
        None => {
            sqlx::query_as(
                "SELECT coalesce(headers->>'almanac-kind', ''), count(*) FROM almanac.outbox \
                 WHERE published_at IS NULL AND failed_at IS NULL GROUP BY 1",
            )
            .fetch_all(conn)
            .await?
        }
    };
    let mut by_kind = std::collections::BTreeMap::new();
    for (kind, n) in rows {
        *by_kind.entry(kind).or_insert(0) += n;
    }
    Ok(by_kind)
}

pub fn table(rows: &[Row]) -> Markup {
    html! {
        @if rows.is_empty() {
            p .muted { "None." }
        } @else {
            div .scroll { table .outbox-rows {
                thead { tr {
                    th .num { "id" } th .num { "job" } th { "kind" } th { "sink" } th { "destination" }
                    th { "state" } th .num { "attempts" } th { "error" }
                } }
                tbody {
                    @for r in rows {
                        tr data-id=(r.id) {
                            td .num { (r.id) }
                            td .num { a href={"/jobs/" (r.job_id)} { (r.job_id) } }
                            td { (r.kind.as_deref().unwrap_or("")) }
                            td { (r.sink) }
                            td { @match &r.destination { Some(d) => (d), None => (dash()) } }
                            td {
                                @if let Some(t) = r.published_at { "published " (time(t)) }
                                @else if let Some(t) = r.failed_at { span .badge .dead { "failed" } " " (time(t)) }
                                @else { "waiting since " (opt_time(Some(r.created_at))) " (" (age((Utc::now() - r.created_at).num_seconds() as f64)) ")" }
                            }
                            td .num { @if r.published_at.is_some() { (dash()) } @else { (r.attempts) } }
                            td .error { @match &r.last_error { Some(e) => (first_line(e)), None => (dash()) } }
                        }
                    }
                }
            } }
        }
    }
}
