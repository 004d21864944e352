//! One cancellation token and one `JoinSet` for every role a process runs.
//!
//! SIGINT or SIGTERM cancels the token; each role then stops in its own
//! order (the worker stops claiming, drains within its deadline and releases
//! what is left). A role that ends on its own, or panics, stops the others too,
//! so a process never keeps running with half its roles.

use std::future::Future;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

pub struct Supervisor {
    token: CancellationToken,
    roles: JoinSet<&'static str>,
}

impl Default for Supervisor {
    fn default() -> Self {
        Self::new()
    }
}

impl Supervisor {
    pub fn new() -> Self {
        Supervisor {
            token: CancellationToken::new(),
            roles: JoinSet::new(),
        }
    }

    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// Runs a role; the role must return once the token is cancelled.
    pub fn spawn<F>(&mut self, name: &'static str, role: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.roles.spawn(async move {
            role.await;
            name
        });
    }

    /// Waits for a signal (or for any role to end), then for every role.
    pub async fn run_until_signal(mut self) {
        let token = self.token.clone();
        tokio::select! {
            signal = shutdown_signal() => info!(signal, "shutting down"),
            ended = self.roles.join_next() => {
                match ended {
                    Some(Ok(name)) => info!(role = name, "role ended; stopping the others"),
                    Some(Err(err)) => error!(%err, "a role panicked; stopping the others"),
                    None => {}
                }
            }
        }
        token.cancel();
        while let Some(ended) = self.roles.join_next().await {
            if let Err(err) = ended {
                error!(%err, "a role panicked during shutdown");
            }
        }
    }
}

/// Runs one role to its end: `start` gets the token to watch, which SIGINT or
/// SIGTERM cancels; the role's own result is returned either way, so a role
/// that fails makes its command fail.
pub async fn until_signal<F, T>(start: impl FnOnce(CancellationToken) -> F) -> T
where
    F: Future<Output = T>,
{
    let token = CancellationToken::new();
    let running = start(token.clone());
    tokio::pin!(running);
    tokio::select! {
        result = &mut running => result,
        signal = shutdown_signal() => {
            info!(signal, "shutting down");
            token.cancel();
            running.await
        }
    }
}

/// Resolves on SIGINT or SIGTERM with the signal's name.
pub async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}
