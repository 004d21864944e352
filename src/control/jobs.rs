//! Actions on single jobs: cancel and retry, each with its audit row.

use sqlx::{Connection, PgConnection};

use super::audit::{self, Action};
use super::{Actor, ControlError};
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
