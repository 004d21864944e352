//! The cancel listener: how an operator's cancel request reaches the
//! handler of a running job on whichever host holds its lease.
//!
//! `queue::cancel_in` records the request on the job and `NOTIFY`s
//! [`queue::CANCEL_CHANNEL`] with the job's id. Every executor `LISTEN`s
//! there on a connection of its own (outside the pool, like the worker's
//! wake-up listener, so handlers using the pool can never delay it). For an
//! id it holds, it reads the request back from the job row under its lease
//! (anyone may `NOTIFY`; the row is the truth, and says who asked and why)
//! and cancels the handler: a command's process group is killed at once,
//! a Rust handler sees [`super::JobContext::cancelled`] and is dropped
//! [`super::CANCEL_GRACE`] later if it does not return.
//!
//! A notification can be missed: while the listener reconnects (it then
//! checks every job in flight as soon as the connection is back: it reads
//! with `try_recv`, which says when the connection dropped), or in the few
//! milliseconds between a claim committing and its job entering the
//! executor's flights. The heartbeat is the net: each renewal also reports
//! the leases with a cancel request, so a missed one stops its handler
//! within a third of the lease. With `listen` off (say, behind a
//! transaction-pooling PgBouncer, where `LISTEN` does not work) the
//! heartbeat alone does it.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{bounded, Inner, Unanswered};
use crate::queue;
use crate::retry::Retry;

/// Listens until `stop` is cancelled, reconnecting with [`Retry`].
pub(super) async fn listen(inner: Arc<Inner>, stop: CancellationToken) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with((*inner.pool.connect_options()).clone());
    let within = (inner.config.lease / 3).max(Duration::from_millis(100));
    let mut retry = Retry::reconnect();
    loop {
        let connected = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(queue::CANCEL_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let connected = tokio::select! {
            _ = stop.cancelled() => return,
            connected = tokio::time::timeout(within, connected) => connected,
        };
        let mut listener = match connected {
            Ok(Ok(listener)) => listener,
            failed => {
                let err = match failed {
                    Ok(Err(err)) => err.to_string(),
                    _ => format!("no answer from the database within {within:?}"),
                };
                warn!(%err, "LISTEN for cancel requests failed; heartbeats find them meanwhile");
                if !retry.pause(&stop).await {
                    return;
                }
                continue;
            }
        };
        retry.succeeded();
        // Requests made while we were not listening.
        let leases = inner.leases();
        if let Err(err) = check(&inner, &mut listener, &leases, within).await {
            warn!(%err, "reading cancel requests failed; reconnecting");
            if !retry.pause(&stop).await {
                return;
            }
            continue;
        }
        loop {
            // `try_recv`, not `recv`: `recv` reconnects by itself when the
            // connection drops and says nothing, and the notifications sent
            // meanwhile are lost; `Ok(None)` tells us, so every job in
            // flight is checked again (the next call reconnects).
            let received = tokio::select! {
                _ = stop.cancelled() => return,
                received = listener.try_recv() => received,
            };
            let id = match received {
                Ok(Some(n)) => match n.payload().parse::<i64>() {
                    Ok(id) => id,
                    Err(_) => continue,
                },
                Ok(None) => {
                    warn!(
                        "LISTEN connection for cancel requests lost; checking every job in flight"
                    );
                    let leases = inner.leases();
                    if let Err(err) = check(&inner, &mut listener, &leases, within).await {
                        warn!(%err, "reading cancel requests failed; reconnecting");
                        break;
                    }
                    continue;
                }
                Err(err) => {
                    warn!(%err, "LISTEN connection for cancel requests lost; reconnecting");
                    break;
                }
            };
            // Every holder hears every cancel: only ours are read back.
            let leases: Vec<_> = inner
                .leases()
                .into_iter()
                .filter(|(held, _)| *held == id)
                .collect();
            if leases.is_empty() {
                continue;
            }
            if let Err(err) = check(&inner, &mut listener, &leases, within).await {
                warn!(job_id = id, %err, "reading a cancel request failed; reconnecting");
                break;
            }
        }
    }
}

/// Reads the cancel requests of `leases` and acts on them.
async fn check(
    inner: &Inner,
    listener: &mut PgListener,
    leases: &[(i64, uuid::Uuid)],
    within: Duration,
) -> Result<(), Unanswered> {
    if leases.is_empty() {
        return Ok(());
    }
    let requests = bounded(within, queue::cancel_requests(&mut *listener, leases)).await?;
    for request in requests {
        inner.request_cancel(request);
    }
    Ok(())
}
