//! Actions on single jobs: cancel and retry, each with its audit row.

use sqlx::{Connection, PgConnection};

use super::audit::{self, Action};
use super::{Actor, ControlError};
use crate::queue::browse::{self, DeadFilter, RETRY_BATCH};
use crate::queue::{self, Cancel, Job};

/// Cancels job `id` as [`queue::Cancel`] says, and logs it. A job that had
/// finished is left as it is; that is logged too, with a count of 0.
pub async fn cancel(
    conn: &mut PgConnection,
    actor: &Actor,
    id: i64,
    reason: Option<&str>,
) -> Result<Cancel, ControlError> {
    let mut tx = conn.begin().await?;
    let outcome = queue::cancel_in(&mut tx, id, &actor.to_string(), reason).await?;
    let (count, note) = match &outcome {
        Cancel::Cancelled(_) => (1, reason.map(str::to_string)),
        Cancel::Requested(_) => (
            1,
            Some(match reason {
                Some(reason) => format!("running: stop requested; {reason}"),
                None => "running: stop requested".into(),
            }),
        ),
        Cancel::Finished(job) => (0, Some(format!("already {}: nothing changed", job.status))),
    };
    let target = format!("job {id}");
    let action = Action {
        action: "cancel",
        target: &target,
        count,
        note: note.as_deref(),
    };
    audit::record(&mut tx, actor, &action).await?;
    tx.commit().await?;
    Ok(outcome)
}

/// Gives a dead or cancelled job a fresh set of attempts ([`queue::retry`]),
/// and logs it.
pub async fn retry(conn: &mut PgConnection, actor: &Actor, id: i64) -> Result<Job, ControlError> {
    let mut tx = conn.begin().await?;
    let job = match queue::retry_in(&mut tx, id).await {
        Ok(job) => job,
        Err(err) => {
            // Rolled back now: the job's row lock must not outlive the refusal.
            let _ = tx.rollback().await;
            return Err(err.into());
        }
    };
    let target = format!("job {id}");
    let action = Action {
        action: "retry",
        target: &target,
        count: 1,
        note: None,
    };
    audit::record(&mut tx, actor, &action).await?;
    tx.commit().await?;
    Ok(job)
}

/// Retries every dead job of one dead-letter group (the dashboard's "retry
/// all"), as [`browse::retry_dead_matching`] does: the ids are read once,
/// then retried [`RETRY_BATCH`] at a time. Its one audit row is written
/// first (count 0) and each batch's transaction adds what it retried, so the
/// row always says how many were retried, even if it stops half-way.
pub async fn retry_dead_group(
    conn: &mut PgConnection,
    actor: &Actor,
    group: &DeadFilter,
) -> Result<u64, ControlError> {
    let ids = browse::dead_ids(&mut *conn, group).await?;
    let target = match (&group.kind, &group.error) {
        (Some(kind), Some(error)) => format!("dead jobs of kind {kind} with error {error:?}"),
        (Some(kind), None) => format!("dead jobs of kind {kind}"),
        (None, Some(error)) => format!("dead jobs with error {error:?}"),
        (None, None) => "every dead job".to_string(),
    };
    let note = format!("{} selected", ids.len());
    let action = Action {
        action: "bulk retry",
        target: &target,
        count: 0,
        note: Some(&note),
    };
    let audit_id = audit::record_returning(&mut *conn, actor, &action).await?;
    let mut retried = 0u64;
    for chunk in ids.chunks(RETRY_BATCH) {
        let mut tx = conn.begin().await?;
        let n = browse::retry_dead_batch(&mut tx, chunk).await?;
        sqlx::query("UPDATE almanac.audit_log SET count = count + $2 WHERE id = $1")
            .bind(audit_id)
            .bind(n as i64)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        retried += n;
    }
    Ok(retried)
}
