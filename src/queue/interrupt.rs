//! How a running job is interrupted short of its outcome: an operator's
//! cancel request as its holder learns it ([`cancel_requests`], and the
//! heartbeat's [`super::Written::cancels`]), and a handler's snooze
//! ([`snooze`]), which puts the job back for later without using an attempt.

use std::time::Duration;

use sqlx::PgExecutor;
use uuid::Uuid;

use super::{Fenced, JobStatus, QueueError};

/// An operator's request to stop a running job (`almanac jobs cancel`), as
/// recorded on the job: who asked, and why.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct CancelRequest {
    pub id: i64,
    pub by: Option<String>,
    pub reason: Option<String>,
}

impl std::fmt::Display for CancelRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cancelled by {}",
            self.by.as_deref().unwrap_or("an operator")
        )?;
        match &self.reason {
            Some(reason) => write!(f, " ({reason})"),
            None => Ok(()),
        }
    }
}

/// The cancel requests of the leases among `leases` that are still held:
/// what a holder checks when a `NOTIFY` on [`super::CANCEL_CHANNEL`] names
/// one of its jobs (anyone may send one; the row is the truth), and for all
/// of its jobs after its listener reconnected.
pub async fn cancel_requests<'e>(
    db: impl PgExecutor<'e>,
    leases: &[(i64, Uuid)],
) -> Result<Vec<CancelRequest>, QueueError> {
    if leases.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = leases.iter().copied().unzip();
    let requests = sqlx::query_as(
        r#"
        SELECT j.id, j.cancelled_by AS by, j.cancel_reason AS reason
        FROM unnest($1::bigint[], $2::uuid[]) AS l(id, token)
        JOIN almanac.jobs j ON j.id = l.id AND j.lease_token = l.token
        WHERE j.cancel_requested_at IS NOT NULL
        "#,
    )
    .bind(&ids)
    .bind(&tokens)
    .fetch_all(db)
    .await?;
    Ok(requests)
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Puts a running job back for later under the fence, giving back the
/// attempt its claim took: `ready`, due `delay` from now, on its kind's
/// current route (a dual or broker job gets its outbox row, as on every
/// transition to `ready`). `last_error` is left as it was. A job an operator
/// asked to cancel is `cancelled` instead. Returns the new status.
pub async fn snooze<'e>(
    db: impl PgExecutor<'e>,
    id: i64,
    token: Uuid,
    delay: Duration,
) -> Result<Fenced<JobStatus>, QueueError> {
    let status: Option<(JobStatus,)> = sqlx::query_as(
        r#"
        UPDATE almanac.jobs
        SET status = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'ready' END,
            attempts = CASE WHEN cancel_requested_at IS NOT NULL THEN attempts
                            ELSE greatest(attempts - 1, 0) END,
            run_at = CASE WHEN cancel_requested_at IS NOT NULL THEN run_at
                          ELSE clock_timestamp() + $3 * interval '1 millisecond' END,
            finished_at = CASE WHEN cancel_requested_at IS NOT NULL THEN clock_timestamp() END,
            route = CASE WHEN cancel_requested_at IS NOT NULL THEN route
                         ELSE almanac.route_of(kind) END,
            lease_token = NULL,
            lease_until = NULL
        WHERE id = $1 AND status = 'running' AND lease_token = $2
        RETURNING status
        "#,
    )
    .bind(id)
    .bind(token)
    .bind(millis(delay))
    .fetch_optional(db)
    .await?;
    Ok(match status {
        Some((status,)) => Fenced::Held(status),
        None => Fenced::Lost,
    })
}
