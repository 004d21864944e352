//! The operator's control plane: every lever an operator pulls (from the
//! CLI, the dashboard or the JSON API) is a function here, and each one
//! **acts and writes its audit row in one transaction**: an action that
//! committed always has its row in `almanac.audit_log`, one that failed or
//! rolled back has none. The CLI, the dashboard and the API call the same
//! functions; only the [`Actor`] differs.
//!
//! - [`pause`]: pause and resume a kind (`*` for all). Claims and broker
//!   consumers consult `almanac.kind_pauses` before starting a job, so a
//!   pause holds from its commit on, on every host; resuming wakes waiting
//!   workers with the enqueue `NOTIFY`.
//! - [`jobs`]: cancel a job. A ready job is `cancelled` at once; a running
//!   one gets a cancel request that the process holding its lease acts on
//!   (see [`crate::worker::executor`]), or the reaper once its lease runs
//!   out; a finished one is left as it is, and the answer says so.
//! - [`bulk`]: retry, cancel or delete every job matching a filter, in
//!   short batches, acting on at most what was counted and confirmed.
//! - [`schedules`]: pause, resume and trigger a schedule
//!   ([`crate::scheduler::controls`]) with their audit rows.
//! - [`limits`]: set and clear a kind's limits
//!   ([`crate::queue::limits`]).
//! - [`ordering`]: order a kind's jobs per key, or stop
//!   ([`crate::queue::ordering`]).
//! - [`audit`]: the log itself, and reading it back.

pub mod audit;
pub mod bulk;
pub mod jobs;
pub mod limits;
pub mod ordering;
pub mod pause;
pub mod schedules;

use serde::Serialize;

/// The enqueue `NOTIFY` for `kind`, delivered at commit: workers waiting
/// for work claim at once (after a limit loosens, held jobs are released).
async fn wake(tx: &mut sqlx::PgConnection, kind: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(crate::queue::NOTIFY_CHANNEL)
        .bind(kind)
        .execute(tx)
        .await
        .map(drop)
}

/// Where an action came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Cli,
    Dashboard,
    Api,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Cli => "cli",
            Source::Dashboard => "dashboard",
            Source::Api => "api",
        }
    }
}

/// Who pulled a lever: the basic-auth user of the dashboard or the API, or
/// the OS user running the CLI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    pub name: String,
    pub source: Source,
}

impl Actor {
    pub fn new(name: impl Into<String>, source: Source) -> Actor {
        Actor {
            name: name.into(),
            source,
        }
    }

    /// The OS user running this process (`$USER`, `$LOGNAME`, else the
    /// numeric uid), for actions from the CLI.
    pub fn os_user() -> Actor {
        let name = ["USER", "LOGNAME"]
            .iter()
            .find_map(|var| std::env::var(var).ok().filter(|v| !v.is_empty()))
            // SAFETY: getuid has no preconditions and cannot fail.
            .unwrap_or_else(|| format!("uid {}", unsafe { libc::getuid() }));
        Actor::new(name, Source::Cli)
    }
}

impl std::fmt::Display for Actor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name, self.source.as_str())
    }
}

/// Why an operator action did nothing.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Queue(#[from] crate::queue::QueueError),
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("{0}")]
    Invalid(String),
}
