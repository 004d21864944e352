//! The job table, its state machine and its lease fence.
//!
//! ```text
//!            enqueue
//!               |
//!               v        claim (SKIP LOCKED, fresh lease_token)
//!  +-------> [ready] ---------------------------------> [running]
//!  |            ^  \ cancel                              |  |  |
//!  |            |   `---------> [dead] <-- permanent, ---'  |  |
//!  |  retry     |                  ^       or attempts      |  |
//!  |  (operator)|                  |       used up          |  |
//!  |            `---- fail (retryable, backoff) ------------'  |
//!  |                 or reaper (lease expired)                 |
//!  |                 or release (shutdown)                     |
//!  `------------------------------------ [done] <-- complete --'
//! ```
//!
//! Fail, the reaper and release all bury a job instead when its attempts are
//! used up (`attempts >= max_attempts`): a claim is an attempt, however it
//! ended. Two ways out of that count: a handler's snooze ([`snooze`]:
//! `running -> ready`, due later, the attempt given back) and an unclaim at
//! shutdown ([`unclaim`]).
//!
//! **Cancelled.** An operator's cancel ([`cancel_in`]) makes a ready job
//! `cancelled` at once; on a running job it records a request, and
//! whichever statement ends the attempt (fail, release, unclaim, snooze, the
//! reaper) writes `cancelled` instead of `ready` or `dead`; only `complete`
//! keeps `done`.
//!
//! **Held.** A job of an ordered kind enqueued while an earlier job of its
//! ordering key is ready, running or (when the kind halts on one) dead is
//! `held`: not claimable, no outbox row. When that earlier job ends, the
//! key's lowest held job becomes `ready` ([`ordering`] states the
//! guarantee). A cancel makes a held job `cancelled` at once.
//!
//! **The fence.** Claiming sets `status = 'running'`, `attempts + 1`, a fresh
//! random `lease_token` per job and `lease_until`. Every later write by the
//! claimant — complete, fail, heartbeat — names that token:
//! `WHERE id = $1 AND status = 'running' AND lease_token = $2`, and complete and
//! heartbeat also require `lease_until > clock_timestamp()`. Zero rows means the
//! lease was lost (it expired and the reaper took it back, or another worker
//! now holds it): the caller gets [`Fenced::Lost`] and nothing is overwritten.
//!
//! **The limit.** The lease makes sure a job is never stuck and that a stale
//! worker cannot record an outcome over a newer attempt. It does not make side
//! effects happen once: a worker that loses its lease mid-call may already have
//! charged the card. Handlers get the job's idempotency key to pass on
//! (result upserts, API idempotency keys).
//!
//! **Time.** Every instant the fence compares is the database's
//! (`clock_timestamp()`), so clock skew between workers cannot break it.

mod admin;
mod backoff;
pub mod browse;
pub mod counts;
mod enqueue;
mod interrupt;
mod lease;
pub mod limits;
pub mod ordering;
mod retention;
pub mod routing;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

pub use admin::{
    cancel_in, get, list, retry, retry_in, schedules_with_unfinished_jobs, stats, Cancel,
    JobFilter, KindAge, KindStatusCount, Stats, CANCEL_CHANNEL,
};
pub use backoff::Backoff;
pub use enqueue::{
    check_priority, check_traceparent, enqueue, enqueue_many, Enqueued, NewJob, MAX_PRIORITY,
    NOTIFY_CHANNEL,
};
pub use interrupt::{cancel_requests, snooze, CancelRequest};
pub use lease::{
    claim, claim_by_id, complete, complete_many, complete_many_claiming, fail, heartbeat_many,
    reap_expired, release, statuses, unclaim, unclaim_many, unclaim_successors, Claim, ClaimById,
    Failure, Fenced, ReapReport, Written, CLAIM_SQL, PER_KEY_WINDOW, PRIORITY_STEP,
};
pub use retention::{delete_finished, Deleted};

/// `text` as PostgreSQL can store it: a NUL byte (which a command may write
/// to stderr) is refused in `text` columns, and an outcome that can never be
/// written would keep its job `running`; it becomes U+FFFD.
pub(crate) fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') {
        std::borrow::Cow::Owned(text.replace('\0', "\u{FFFD}"))
    } else {
        std::borrow::Cow::Borrowed(text)
    }
}

/// Where a job stands in the state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type, Serialize)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
#[serde(rename_all = "lowercase")]
pub enum JobStatus {
    Ready,
    Running,
    Done,
    Dead,
    /// Stopped by an operator (`almanac jobs cancel`); counted apart from
    /// `dead`, and never run again unless retried.
    Cancelled,
    /// Of an ordered kind, waiting for the earlier jobs of its ordering key
    /// ([`ordering`]); made `ready` when the one before it ends.
    Held,
}

impl JobStatus {
    pub const ALL: [JobStatus; 6] = [
        Self::Ready,
        Self::Running,
        Self::Done,
        Self::Dead,
        Self::Cancelled,
        Self::Held,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Running => "running",
            Self::Done => "done",
            Self::Dead => "dead",
            Self::Cancelled => "cancelled",
            Self::Held => "held",
        }
    }
}

impl std::fmt::Display for JobStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for JobStatus {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown status `{s}`; expected one of ready, running, done, dead, cancelled, held"
                )
            })
    }
}

/// One row of `almanac.jobs`.
#[derive(Debug, Clone, sqlx::FromRow, Serialize)]
pub struct Job {
    pub id: i64,
    pub kind: String,
    pub payload: serde_json::Value,
    pub status: JobStatus,
    pub run_at: DateTime<Utc>,
    pub attempts: i32,
    pub max_attempts: i32,
    /// The fence's secret: never printed.
    #[serde(skip)]
    pub lease_token: Option<Uuid>,
    pub lease_until: Option<DateTime<Utc>>,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub route: String,
    pub schedule: Option<String>,
    pub logical_run: Option<String>,
    /// On a running job: an operator asked for it to stop (`jobs cancel`);
    /// it ends `cancelled` whichever way its attempt ends but `done`.
    pub cancel_requested_at: Option<DateTime<Utc>>,
    /// Who cancelled the job, or asked to.
    pub cancelled_by: Option<String>,
    /// Why, in their words.
    pub cancel_reason: Option<String>,
    /// 0 to 9, higher claimed first within its kind.
    pub priority: i16,
    /// Of an ordered kind: the jobs with this key run one at a time, in
    /// enqueue order ([`ordering`]).
    #[sqlx(default)]
    pub ordering_key: Option<String>,
    /// The W3C traceparent the job was enqueued with.
    #[sqlx(default)]
    pub traceparent: Option<String>,
}

impl Job {
    /// The key a handler passes to the outside world so that a re-run of this
    /// job has no second effect: the enqueuer's key, or `almanac:job:<id>`.
    pub fn effective_idempotency_key(&self) -> String {
        self.idempotency_key
            .clone()
            .unwrap_or_else(|| format!("almanac:job:{}", self.id))
    }

    /// The `(id, lease_token)` pair that the fence checks, for a running job.
    pub fn lease(&self) -> Option<(i64, Uuid)> {
        self.lease_token.map(|token| (self.id, token))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("no job with id {0}")]
    NotFound(i64),
    #[error("job {id} is {status}; {action} applies only to {expected} jobs")]
    WrongStatus {
        id: i64,
        status: JobStatus,
        action: &'static str,
        expected: &'static str,
    },
    #[error("invalid job: {0}")]
    Invalid(String),
    /// A dead job of a scheduled run whose ledger row points at another job
    /// (the run was reprocessed since): reviving it would make two jobs of
    /// one logical run active (see [`crate::scheduler::reprocess`]).
    #[error("job {id} is an earlier job of run {logical_run} of schedule `{schedule}`, which was reprocessed since ({}); it is kept as history and not retried. To run the run again, reprocess it: `almanac backfill {schedule} --from DATE --to DATE --reprocess failed` (or `all`)", match .current { Some(j) => format!("its job now is {j}; retry that one if it is dead"), None => "its newer job was deleted by retention".to_string() })]
    Superseded {
        id: i64,
        schedule: String,
        logical_run: String,
        current: Option<i64>,
    },
}
