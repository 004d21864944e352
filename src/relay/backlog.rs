//! The outbox at a glance, per sink (what `almanac stats` and the metrics
//! collector report; walks the partial index of unpublished rows only), and
//! the janitor's retention of published rows.

use serde::Serialize;
use sqlx::PgConnection;

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct SinkBacklog {
    pub sink: String,
    /// Rows waiting to be published.
    pub backlog: i64,
    /// Seconds since the oldest of them was written (0 when none).
    pub oldest_seconds: f64,
}

pub async fn backlog(conn: &mut PgConnection) -> Result<Vec<SinkBacklog>, sqlx::Error> {
    sqlx::query_as::<_, SinkBacklog>(
        r#"
        SELECT sink, count(*) AS backlog,
               greatest(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_seconds
          FROM almanac.outbox WHERE published_at IS NULL
         GROUP BY sink ORDER BY sink
        "#,
    )
    .fetch_all(conn)
    .await
}

/// Deletes at most `limit` outbox rows published more than `older_than` ago,
/// oldest first; returns how many went. Unpublished rows are never touched.
pub async fn delete_published<'e>(
    db: impl sqlx::PgExecutor<'e>,
    older_than: std::time::Duration,
    limit: i64,
) -> Result<u64, sqlx::Error> {
    let deleted = sqlx::query(
        r#"
        DELETE FROM almanac.outbox WHERE id = ANY(ARRAY(
            SELECT id FROM almanac.outbox
             WHERE published_at < now() - make_interval(secs => $1)
             ORDER BY published_at
             LIMIT $2
             FOR UPDATE SKIP LOCKED))
        "#,
    )
    .bind(older_than.as_secs_f64())
    .bind(limit)
    .execute(db)
    .await?;
    Ok(deleted.rows_affected())
}
