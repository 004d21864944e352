//! The heartbeat: one loop that renews every lease in flight every third
//! of the lease, in one statement, moves each job's local deadline, cancels
//! handlers whose lease the database no longer grants, and stops those whose
//! job an operator asked to cancel (the net under [`super::cancels`]). See
//! the parent module's doc.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use uuid::Uuid;

use super::{bounded, Inner};
use crate::queue::{self, QueueError};

/// Renews every lease in flight every third of the lease; cancels handlers
/// whose lease the database no longer grants.
pub(super) async fn heartbeat(inner: Arc<Inner>, stop: CancellationToken) {
    let every = inner.config.lease / 3;
    // A connection of its own: handlers that use the pool can never make a
    // renewal wait for a connection until leases run out.
    let mut link = crate::db::Held::of(&inner.pool, every);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let lease = inner.config.lease;
        let leases: Vec<(i64, Uuid)> = inner
            .flights()
            .iter()
            .filter(|(_, f)| f.returned.is_none_or(|at| at.elapsed() < lease))
            .map(|(id, f)| (*id, f.token))
            .collect();
        if leases.is_empty() {
            continue;
        }
        let sent = Instant::now();
        let renewed = tokio::select! {
            _ = stop.cancelled() => return,
            renewed = bounded(every, renew(&mut link, &leases, inner.config.lease)) => renewed,
        };
        let (held, busy): (HashSet<i64>, HashSet<i64>) = match renewed {
            Ok(written) => {
                // A cancel request whose NOTIFY was lost (the listener was
                // reconnecting, or is off) is found here.
                for request in written.cancels {
                    inner.request_cancel(request);
                }
                (
                    written.ids.into_iter().collect(),
                    written.busy.into_iter().collect(),
                )
            }
            Err(err) => {
                link.discard();
                warn!(%err, jobs = leases.len(), "heartbeat failed; handlers are cancelled at their local lease deadline unless a renewal succeeds");
                continue;
            }
        };
        let mut flights = inner.flights();
        for (id, token) in &leases {
            // Only flights still holding this lease (not settled meanwhile).
            let Some(flight) = flights.get_mut(id).filter(|f| f.token == *token) else {
                continue;
            };
            if held.contains(id) {
                flight.renewed = flight.renewed.max(sent);
                let deadline = inner.local_deadline(flight.renewed);
                flight.deadline.send_if_modified(|d| {
                    let later = deadline > *d;
                    *d = (*d).max(deadline);
                    later
                });
            } else if busy.contains(id) {
                // Its row was held by another transaction: still ours, not
                // renewed this time (the local deadline keeps counting).
                debug!(job_id = id, "lease renewal skipped a busy row");
            } else if !flight.cancel.is_cancelled() {
                warn!(job_id = id, "lease lost; cancelling the handler");
                flight.cancel.cancel();
            }
        }
    }
}

/// One batched renewal on the heartbeat's own connection.
async fn renew(
    link: &mut crate::db::Held,
    leases: &[(i64, Uuid)],
    lease: Duration,
) -> Result<queue::Written, QueueError> {
    let conn = link.get().await?;
    queue::heartbeat_many(conn, leases, lease).await
}
