//! One claimed job, run to its recorded outcome: what a broker consumer does
//! with each message after claiming the job by id. Same guarantees as the
//! worker: heartbeats every third of the lease, the handler cancelled when the
//! lease is lost, the outcome written through the fence.

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{failure_of, invoke, Handler, JobContext, WorkerConfig};
use crate::queue::{self, Fenced, Job, JobStatus, QueueError};

/// How a claimed job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Executed {
    Completed,
    Retried,
    Dead,
    /// The lease was lost before the outcome could be recorded.
    Lost,
}

pub async fn execute_claimed(
    pool: &PgPool,
    config: &WorkerConfig,
    handler: &dyn Handler,
    job: Job,
) -> Result<Executed, QueueError> {
    let (id, attempt) = (job.id, job.attempts);
    let token = job.lease_token.expect("a claimed job holds a lease");
    let cancel = CancellationToken::new();
    let heartbeat = {
        let (pool, cancel, lease) = (pool.clone(), cancel.clone(), config.lease);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(lease / 3);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            tick.tick().await;
            loop {
                tick.tick().await;
                match queue::heartbeat_many(&pool, &[(id, token)], lease).await {
                    Ok(held) if held.is_empty() => {
                        warn!(job_id = id, "lease lost; cancelling the handler");
                        cancel.cancel();
                        return;
                    }
                    Ok(_) => {}
                    Err(err) => warn!(job_id = id, %err, "heartbeat failed; the lease may expire"),
                }
            }
        })
    };
    let result = invoke(handler, JobContext::new(job, cancel)).await;
    heartbeat.abort();
    let recorded = match &result {
        Ok(()) => queue::complete(pool, id, token)
            .await?
            .is_held()
            .then_some(Executed::Completed),
        Err(err) => {
            match queue::fail(pool, id, token, &failure_of(err, attempt, &config.backoff)).await? {
                Fenced::Held(JobStatus::Dead) => Some(Executed::Dead),
                Fenced::Held(_) => Some(Executed::Retried),
                Fenced::Lost => None,
            }
        }
    };
    if let Err(err) = &result {
        warn!(job_id = id, attempt, error = %err.chain(), "job failed");
    }
    Ok(recorded.unwrap_or_else(|| {
        warn!(
            job_id = id,
            "outcome not recorded: the lease was lost first; the job may run again"
        );
        Executed::Lost
    }))
}
