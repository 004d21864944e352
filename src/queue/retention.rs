//! Retention of finished jobs: the janitor's statements on `almanac.jobs`.
//!
//! Deleting a job never deletes its ledger row: `schedule_runs.job_id` is
//! `ON DELETE SET NULL`, so the logical run stays recorded and is never emitted
//! again. Its outbox rows go with it (`ON DELETE CASCADE`).

use std::time::Duration;

use chrono::{DateTime, Utc};

use sqlx::PgExecutor;

use super::{JobStatus, QueueError};

/// What one [`delete_finished`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Deleted {
    /// Jobs deleted.
    pub rows: u64,
    /// How long the newest of them had been past its retention: how far
    /// behind the deletions are (`None` when nothing was deleted).
    pub behind: Option<Duration>,
}

/// Deletes at most `limit` jobs in `status` (`done`, `dead` or `cancelled`) that finished
/// more than `older_than` before `at` (the database's time when `None`),
/// oldest first, skipping rows another session holds.
pub async fn delete_finished<'e>(
    db: impl PgExecutor<'e>,
    status: JobStatus,
    older_than: Duration,
    at: Option<DateTime<Utc>>,
    limit: i64,
) -> Result<Deleted, QueueError> {
    assert!(
        matches!(
            status,
            JobStatus::Done | JobStatus::Dead | JobStatus::Cancelled
        ),
        "only finished jobs are deleted"
    );
    let (rows, behind): (i64, Option<f64>) = sqlx::query_as(
        r#"
        WITH gone AS (
            DELETE FROM almanac.jobs WHERE id = ANY(ARRAY(
                SELECT id FROM almanac.jobs
                 WHERE status = $1
                   AND finished_at < coalesce($4, now()) - make_interval(secs => $2)
                 ORDER BY finished_at
                 LIMIT $3
                 FOR UPDATE SKIP LOCKED))
            RETURNING finished_at)
        SELECT count(*),
               extract(epoch FROM now() - make_interval(secs => $2) - max(finished_at))::float8
        FROM gone
        "#,
    )
    .bind(status)
    .bind(older_than.as_secs_f64())
    .bind(limit)
    .bind(at)
    .fetch_one(db)
    .await?;
    Ok(Deleted {
        rows: rows as u64,
        behind: behind.map(|s| Duration::from_secs_f64(s.max(0.0))),
    })
}
