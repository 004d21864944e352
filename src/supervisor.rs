//! One cancellation token and one `JoinSet` for every role a process runs.
//!
//! Every background role keeps one contract ([`crate::role`]): a typed name,
//! a validated config, `run(self, shutdown)`, and `run_once()` where it is
//! periodic. SIGINT or SIGTERM cancels the token; each role then stops in
//! its own order (a worker stops claiming, drains within its deadline and
//! releases what is left; the relay flushes). A role that fails, panics, or
//! ends on its own before shutdown stops the others too, and the process
//! exits non-zero naming that role: a process never keeps running with half
//! its roles, and a supervisor (systemd, Kubernetes) sees the failure.

use std::collections::HashMap;
use std::future::Future;

use tokio::task::{Id, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::role::{Role, RoleName};

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("role `{role}` failed: {source:#}")]
    Failed {
        role: RoleName,
        source: anyhow::Error,
    },
    #[error("role `{role}` panicked: {message}")]
    Panicked { role: RoleName, message: String },
    #[error("role `{role}` stopped on its own before shutdown was asked for")]
    Ended { role: RoleName },
    #[error("role{} {} did not stop within {grace:?} of the stop request (or a second signal came); aborted", if roles.len() == 1 { "" } else { "s" }, roles.iter().map(|r| r.as_str()).collect::<Vec<_>>().join(", "))]
    Stuck {
        roles: Vec<RoleName>,
        grace: std::time::Duration,
    },
}

pub struct Supervisor {
    token: CancellationToken,
    roles: JoinSet<anyhow::Result<()>>,
    names: HashMap<Id, RoleName>,
    grace: std::time::Duration,
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
            names: HashMap::new(),
            grace: std::time::Duration::from_secs(30),
        }
    }

    /// How long roles get to stop after the stop request (default 30 s; set
    /// it above a worker's shutdown deadline). Past it, or at a second
    /// SIGINT/SIGTERM, the roles left are aborted and the process fails: a
    /// stop request always ends the process.
    pub fn grace(mut self, grace: std::time::Duration) -> Self {
        self.grace = grace;
        self
    }

    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// Runs a [`Role`] under the supervisor's token.
    pub fn spawn_role<R: Role>(&mut self, role: R) {
        let token = self.token();
        self.spawn(R::NAME, async move { role.run(token).await.map(|_| ()) });
    }

    /// Runs a role's future; it must return once the token is cancelled.
    pub fn spawn<F, E>(&mut self, name: RoleName, role: F)
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<anyhow::Error> + Send + 'static,
    {
        let handle = self
            .roles
            .spawn(async move { role.await.map_err(Into::into) });
        self.names.insert(handle.id(), name);
    }

    /// Waits for SIGINT/SIGTERM (or for any role to end), stops every role,
    /// and returns the first failure, naming its role.
    pub async fn run_until_signal(self) -> Result<(), SupervisorError> {
        self.run_until(shutdown_signal()).await
    }

    /// As [`Supervisor::run_until_signal`], with the stop request given.
    pub async fn run_until(
        mut self,
        stop: impl Future<Output = &'static str>,
    ) -> Result<(), SupervisorError> {
        let token = self.token.clone();
        let mut first: Option<SupervisorError> = None;
        tokio::select! {
            signal = stop => info!(signal, "shutting down"),
            ended = self.roles.join_next_with_id() => {
                if let Some(ended) = ended {
                    let failure = self.judge(ended, false);
                    if let Some(failure) = &failure {
                        error!(%failure, "stopping the other roles");
                    }
                    first = failure;
                }
            }
        }
        token.cancel();
        let deadline = tokio::time::sleep(self.grace);
        tokio::pin!(deadline);
        let again = shutdown_signal();
        tokio::pin!(again);
        loop {
            tokio::select! {
                ended = self.roles.join_next_with_id() => {
                    let Some(ended) = ended else { break };
                    if let Some(failure) = self.judge(ended, true) {
                        error!(%failure, "during shutdown");
                        first.get_or_insert(failure);
                    }
                }
                _ = &mut deadline => return Err(self.abort_stuck()),
                _ = &mut again => return Err(self.abort_stuck()),
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Aborts the roles still running and names them.
    fn abort_stuck(&mut self) -> SupervisorError {
        let mut roles: Vec<RoleName> = self.names.values().copied().collect();
        roles.sort_unstable();
        self.roles.abort_all();
        let failure = SupervisorError::Stuck {
            roles,
            grace: self.grace,
        };
        error!(%failure, "stopping anyway");
        failure
    }

    fn judge(
        &mut self,
        ended: Result<(Id, anyhow::Result<()>), tokio::task::JoinError>,
        stopping: bool,
    ) -> Option<SupervisorError> {
        let id = match &ended {
            Ok((id, _)) => *id,
            Err(err) => err.id(),
        };
        // An ended role is no longer running, whatever its result.
        let Some(role) = self.names.remove(&id) else {
            unreachable!("every task in the set was spawned with a name")
        };
        let name = |_: Id| role;
        match ended {
            Ok((_, Ok(()))) if stopping => None,
            Ok((id, Ok(()))) => Some(SupervisorError::Ended { role: name(id) }),
            Ok((id, Err(source))) => Some(SupervisorError::Failed {
                role: name(id),
                source,
            }),
            Err(err) => {
                let role = name(err.id());
                let message = if err.is_panic() {
                    let payload = err.into_panic();
                    payload
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| payload.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "(no message)".to_string())
                } else {
                    "cancelled".to_string()
                };
                Some(SupervisorError::Panicked { role, message })
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failing_role_stops_the_others_and_is_named() {
        let mut sup = Supervisor::new();
        let token = sup.token();
        sup.spawn(RoleName::Reaper, async move {
            token.cancelled().await;
            Ok::<_, anyhow::Error>(())
        });
        sup.spawn(RoleName::Janitor, async {
            Err(anyhow::anyhow!("disk on fire"))
        });
        let err = sup
            .run_until(std::future::pending())
            .await
            .unwrap_err()
            .to_string();
        assert_eq!(err, "role `janitor` failed: disk on fire");
    }

    #[tokio::test]
    async fn a_panicking_role_is_named_with_its_message() {
        let mut sup = Supervisor::new();
        sup.spawn(RoleName::Relay, async {
            if true {
                panic!("bad state");
            }
            Ok::<_, anyhow::Error>(())
        });
        let err = sup.run_until(std::future::pending()).await.unwrap_err();
        assert_eq!(err.to_string(), "role `relay` panicked: bad state");
    }

    #[tokio::test]
    async fn a_role_that_ignores_the_stop_request_is_aborted_after_the_grace() {
        let mut sup = Supervisor::new().grace(std::time::Duration::from_millis(100));
        sup.spawn(RoleName::Scheduler, async {
            std::future::pending::<()>().await;
            Ok::<_, anyhow::Error>(())
        });
        let token = sup.token();
        sup.spawn(RoleName::Metrics, async move {
            token.cancelled().await;
            Ok::<_, anyhow::Error>(())
        });
        let err = sup.run_until(async { "test" }).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "role scheduler did not stop within 100ms of the stop request (or a second signal came); aborted"
        );
    }

    #[tokio::test]
    async fn a_stop_request_ends_every_role_cleanly() {
        let mut sup = Supervisor::new();
        for name in [RoleName::Reaper, RoleName::Janitor] {
            let token = sup.token();
            sup.spawn(name, async move {
                token.cancelled().await;
                Ok::<_, anyhow::Error>(())
            });
        }
        sup.run_until(async { "test" }).await.unwrap();
    }
}
