//! Order per key: the jobs of one ordered kind that share an ordering key
//! run one at a time, in enqueue order (issue #24 item 2; docs/ordering.md
//! is the user's guide, migration 0115 the SQL).
//!
//! **The guarantee.** For an ordered kind ([`put`], `almanac ordering
//! set`), of the jobs with one ordering key at most one is `ready` or
//! `running` at any moment, and they become `ready` in the order they were
//! enqueued: a job starts only once every earlier job of its key has ended
//! `done` or `cancelled`, or `dead` when the kind skips dead jobs. With
//! `on_dead = halt` (the default) a dead job holds the jobs after it until
//! an operator retries it (it then runs first) or deletes it. The order is
//! the same in every route mode and across a live `db -> dual -> broker`
//! move, since it is kept in the database: a job waiting for its turn is
//! `held`, has no outbox row and is claimable by no one, so a broker only
//! ever carries the head of a key. The broker message's key is the
//! ordering key (its Kafka partition), but the order does not depend on it.
//!
//! **Why it holds.**
//! - *Enqueue.* The insert trigger takes the key's advisory lock for the
//!   rest of the enqueuing transaction, then looks for a job of the key
//!   that stands before the new one (ready, running, held, or dead under
//!   `halt`) with a snapshot taken after the lock; if there is one the new
//!   job is `held`. Enqueues of one key are thereby serialized, so ids
//!   ascend in commit order within a key, and no commit can slip a job
//!   before one that is already held. This needs READ COMMITTED: an
//!   ordered job enqueued under REPEATABLE READ or SERIALIZABLE is refused
//!   (SQLSTATE 0A000).
//! - *Release.* When a job that could stand before others ends (`done`,
//!   `cancelled`, `dead`) or is deleted, its key is released in the same
//!   transaction, by a trigger after the statement that ended it (one
//!   UPDATE for all the keys a statement ended, migration 0117; the keys
//!   read from the statement's transition tables, migration 0129): unless a
//!   job still stands before them, the key's
//!   lowest held job becomes `ready`, with its kind's route now (a `dual` or
//!   `broker` kind gets its outbox row), and workers are notified. The
//!   release needs the key's lock, which an enqueue of the key holds until
//!   its transaction ends: the trigger waits at most 50 ms for it; past
//!   that (a client's transaction left open, or `route set` holding the
//!   kind's lock), the key is noted in `almanac.ordering_recheck` and the
//!   reaper releases it at its next sweep ([`recheck`]), so a worker's
//!   batch of completions is never held up for long by a client.
//! - *Taken at once.* A worker's batch of completions
//!   ([`super::complete_many_claiming`], migration 0130) claims a key's
//!   released job for itself instead (`held -> running`, the claim's fence)
//!   when its claim would take that job anyway (db route, not paused, no
//!   limits, due, and no due job of the worker's kinds waiting `ready`).
//!   The order is the release's: the job is the key's next, and nothing
//!   stands before it.
//! - *Retry, cancel.* An operator's retry makes the job `held` and releases
//!   its key: it runs after the key's current job and before the later
//!   ones. A cancel of a held job ends it at once (and its key is released,
//!   should it have been the next).
//! - *Safety net.* A release that could not take the key's locks, or the
//!   row of the held job it picked (an operator's cancel under way), notes
//!   the key; an enqueue that finds its key with held jobs and nothing
//!   before them releases the first; and the reaper releases the noted keys
//!   and walks every key with held jobs, a slice per sweep ([`sweep`]),
//!   releasing any that nothing stands before (migration 0118).
//! - *Settings.* [`put`] and [`remove`] take the kind's route lock
//!   exclusively, as `route set` does and every insert takes it shared: no
//!   enqueue reads a setting that is being changed. Clearing a kind's
//!   ordering makes all its held jobs `ready`; switching `halt` to `skip`
//!   releases the keys a dead job was holding.
//!
//! **What it costs.** A kind that is not ordered pays a lookup in the
//! (small) settings table at insert; the release's statement triggers,
//! called once per UPDATE or DELETE on the jobs table, look through the
//! statement's old rows for one with a key, find none and return (a scan
//! of the statement's rows, which PostgreSQL keeps for the counters'
//! triggers anyway: microseconds for a batch of hundreds). A
//! key's throughput is one job at a time, one round of claim (or relay,
//! broker and consumer) per job; different keys run in parallel.
//!
//! **What it does not do.** Order across kinds (the key's scope is its
//! kind), or among jobs enqueued by different transactions at the same
//! instant beyond their commit order. Deleting a dead job (retention, `jobs
//! delete`) releases its key as a cancel would.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgExecutor};

use super::limits::pointer_path;
use super::routing::route_lock_key;
use super::QueueError;

/// What a dead job does to the jobs after it on its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnDead {
    /// They stay held until the dead job is retried or deleted.
    Halt,
    /// The next one runs.
    Skip,
}

impl OnDead {
    pub fn as_str(self) -> &'static str {
        match self {
            OnDead::Halt => "halt",
            OnDead::Skip => "skip",
        }
    }
}

impl std::fmt::Display for OnDead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for OnDead {
    type Err = QueueError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "halt" => Ok(OnDead::Halt),
            "skip" => Ok(OnDead::Skip),
            other => Err(QueueError::Invalid(format!(
                "on-dead is `{other}`; give halt (a dead job holds the jobs after it) or skip (the next one runs)"
            ))),
        }
    }
}

/// One ordered kind's setting.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct KindOrdering {
    pub kind: String,
    /// A job enqueued without a key takes the payload's value here.
    pub key_pointer: Option<String>,
    #[sqlx(try_from = "String")]
    pub on_dead: OnDead,
    pub set_at: DateTime<Utc>,
    pub set_by: String,
    /// Jobs of the kind held behind an earlier job of their key now.
    pub held: i64,
}

/// As the column stores it.
impl TryFrom<String> for OnDead {
    type Error = QueueError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

const SELECT: &str = "SELECT o.kind, o.key_pointer, o.on_dead, o.set_at, o.set_by, \
     (SELECT count(*) FROM almanac.jobs AS j \
       WHERE j.kind = o.kind AND j.ordering_key IS NOT NULL AND j.status = 'held') AS held \
     FROM almanac.kind_ordering AS o";

/// Every ordered kind, by kind.
pub async fn list<'e>(db: impl PgExecutor<'e>) -> Result<Vec<KindOrdering>, sqlx::Error> {
    sqlx::query_as(&format!("{SELECT} ORDER BY o.kind"))
        .fetch_all(db)
        .await
}

/// `kind`'s setting, if it is ordered.
pub async fn get<'e>(
    db: impl PgExecutor<'e>,
    kind: &str,
) -> Result<Option<KindOrdering>, sqlx::Error> {
    sqlx::query_as(&format!("{SELECT} WHERE o.kind = $1"))
        .bind(kind)
        .fetch_optional(db)
        .await
}

/// Takes `kind`'s route lock exclusively for the rest of the caller's
/// transaction, waiting at most `lock_timeout` for enqueues of the kind in
/// flight (each holds it shared until it commits).
async fn lock_kind(tx: &mut PgConnection, kind: &str) -> Result<(), QueueError> {
    sqlx::query("SET LOCAL lock_timeout = '10s'")
        .execute(&mut *tx)
        .await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(route_lock_key(kind))
        .execute(&mut *tx)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03") => {
                QueueError::Invalid(format!(
                    "kind {kind} stayed busy for 10 s (an enqueue of it left open, or `almanac route set` under way); try again"
                ))
            }
            _ => QueueError::Db(e),
        })?;
    Ok(())
}

/// Orders `kind` (replacing its setting) on the caller's transaction; jobs
/// enqueued after this commits are ordered. Returns the setting as stored
/// and how many held jobs it released (a switch to `skip` frees the keys a
/// dead job was holding).
pub async fn put(
    tx: &mut PgConnection,
    kind: &str,
    key_pointer: Option<&str>,
    on_dead: OnDead,
    by: &str,
) -> Result<(KindOrdering, u64), QueueError> {
    if kind.trim().is_empty() || kind == "*" {
        return Err(QueueError::Invalid(format!(
            "ordering is per kind; `{kind}` is not a kind name"
        )));
    }
    let path = key_pointer.map(pointer_path).transpose()?;
    lock_kind(tx, kind).await?;
    sqlx::query(
        "INSERT INTO almanac.kind_ordering AS o (kind, key_pointer, key_path, on_dead, set_at, set_by) \
         VALUES ($1, $2, $3, $4, now(), $5) \
         ON CONFLICT (kind) DO UPDATE SET key_pointer = excluded.key_pointer, \
             key_path = excluded.key_path, on_dead = excluded.on_dead, \
             set_at = now(), set_by = excluded.set_by",
    )
    .bind(kind)
    .bind(key_pointer)
    .bind(path)
    .bind(on_dead.as_str())
    .bind(by)
    .execute(&mut *tx)
    .await?;
    // Keys whose head is dead are released when dead jobs no longer hold
    // them (and a key the reaper has not rechecked yet, whatever the
    // setting). Each key's lock is taken, in one order, as a retry does.
    let released: i32 = sqlx::query_scalar(
        "SELECT almanac.release_held(ARRAY(SELECT j.id FROM almanac.jobs AS j \
             WHERE j.kind = $1 AND j.ordering_key IS NOT NULL AND j.status = 'held'))",
    )
    .bind(kind)
    .fetch_one(&mut *tx)
    .await?;
    let stored = get(&mut *tx, kind)
        .await?
        .expect("written by this transaction");
    Ok((stored, released as u64))
}

/// Stops ordering `kind` on the caller's transaction: every job of it that
/// was held becomes `ready` (with its kind's route). Returns the setting it
/// had and how many jobs it released; `None` when it was not ordered.
pub async fn remove(
    tx: &mut PgConnection,
    kind: &str,
) -> Result<Option<(KindOrdering, u64)>, QueueError> {
    lock_kind(tx, kind).await?;
    let Some(had) = get(&mut *tx, kind).await? else {
        return Ok(None);
    };
    sqlx::query("DELETE FROM almanac.kind_ordering WHERE kind = $1")
        .bind(kind)
        .execute(&mut *tx)
        .await?;
    let released = sqlx::query(
        "UPDATE almanac.jobs SET status = 'ready', route = almanac.route_of(kind) \
         WHERE kind = $1 AND ordering_key IS NOT NULL AND status = 'held'",
    )
    .bind(kind)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    Ok(Some((had, released)))
}

/// The reaper's sweep: releases up to `limit` keys whose head ended while
/// their lock was busy; returns how many jobs it made ready.
pub async fn recheck<'e>(db: impl PgExecutor<'e>, limit: i64) -> Result<u64, sqlx::Error> {
    let released: i32 = sqlx::query_scalar("SELECT almanac.recheck_keys($1)")
        .bind(limit.clamp(1, i64::from(i32::MAX)) as i32)
        .fetch_one(db)
        .await?;
    Ok(released.max(0) as u64)
}

/// Where the reaper's walk of keys with held jobs stands: after this
/// `(kind, key)`; `None` starts from the first.
pub type SweepCursor = Option<(String, String)>;

/// The safety net ([`recheck`] is the path): walks up to `limit` keys with
/// held jobs after `cursor` and releases those that nothing stands before
/// (their locks tried, never waited for). Returns where the next walk
/// starts (`None` once this one reached the end) and how many jobs it made
/// ready.
pub async fn sweep<'e>(
    db: impl PgExecutor<'e>,
    cursor: &SweepCursor,
    limit: i64,
) -> Result<(SweepCursor, u64), sqlx::Error> {
    let (kind, key) = match cursor {
        Some((kind, key)) => (Some(kind.as_str()), Some(key.as_str())),
        None => (None, None),
    };
    let (last_kind, last_key, released): (Option<String>, Option<String>, i32) =
        sqlx::query_as("SELECT last_kind, last_key, released FROM almanac.sweep_held($1, $2, $3)")
            .bind(kind)
            .bind(key)
            .bind(limit.clamp(1, i64::from(i32::MAX)) as i32)
            .fetch_one(db)
            .await?;
    Ok((last_kind.zip(last_key), released.max(0) as u64))
}
