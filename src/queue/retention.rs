//! Retention of finished jobs: the janitor's statements on `almanac.jobs`.
//!
//! Deleting a job never deletes its ledger row: `schedule_runs.job_id` is
//! `ON DELETE SET NULL`, so the logical run stays recorded and is never emitted
//! again. Its outbox rows go with it (`ON DELETE CASCADE`).

use std::time::Duration;

use sqlx::PgExecutor;

use super::{JobStatus, QueueError};

/// Deletes at most `limit` jobs in `status` (`done`, `dead` or `cancelled`) that finished
/// more than `older_than` ago, oldest first, skipping rows another session
/// holds. Returns how many went.
pub async fn delete_finished<'e>(
    db: impl PgExecutor<'e>,
    status: JobStatus,
    older_than: Duration,
    limit: i64,
) -> Result<u64, QueueError> {
    assert!(
        matches!(
            status,
            JobStatus::Done | JobStatus::Dead | JobStatus::Cancelled
        ),
        "only finished jobs are deleted"
    );
    let deleted = sqlx::query(
        r#"
        DELETE FROM almanac.jobs WHERE id = ANY(ARRAY(
            SELECT id FROM almanac.jobs
             WHERE status = $1 AND finished_at < now() - make_interval(secs => $2)
             ORDER BY finished_at
             LIMIT $3
             FOR UPDATE SKIP LOCKED))
        "#,
    )
    .bind(status)
    .bind(older_than.as_secs_f64())
    .bind(limit)
    .execute(db)
    .await?;
    Ok(deleted.rows_affected())
}
