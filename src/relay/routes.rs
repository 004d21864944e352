//! Routes per job kind, changed live for every running instance.
//!
//! `db`: workers polling PostgreSQL claim the kind. `dual`: workers can still
//! claim it, and every ready transition also writes an outbox row that the
//! relay publishes; whichever of worker and broker consumer claims first
//! runs the job. `broker`: only broker consumers run it.
//!
//! **One transaction per change.** `set` takes the kind's advisory lock
//! exclusively (enqueue takes it shared, in the insert trigger), updates the
//! route, moves the kind's ready and running jobs to it (ready jobs leaving
//! `db` get their outbox rows from the trigger), re-addresses pending outbox
//! rows to the new sink and destination when those changed (dropping any
//! batch in flight that names them), and drops pending rows when the kind returns to `db`.
//! No job is left addressed to a sink or destination the kind no longer uses,
//! so a retired sink's relay can go away without stranding anything.
//!
//! **Never a long stall.** The change runs under `lock_timeout` (default
//! 5 s): waiting for open transactions that enqueued the kind holds up every
//! new enqueue of the kind behind it, so past the timeout `set` gives up,
//! changes nothing, and names the sessions that held the lock.
//!
//! **Snapshots older than the route.** The insert trigger reads `routes` with
//! the enqueueing transaction's snapshot. Under READ COMMITTED (PostgreSQL's
//! default) every statement sees the latest committed route, and the advisory
//! lock orders the insert after any change. A REPEATABLE READ or SERIALIZABLE
//! transaction whose snapshot predates a committed change inserts its job on
//! the old route (and addresses its outbox row to the old destination). We
//! do not refuse such enqueues — many applications run their business
//! transactions at those levels and enqueue is meant to join them — instead
//! [`reconcile`], run by every relay on an interval, moves jobs whose route
//! disagrees with `routes` and re-addresses their pending rows, so the case
//! heals within one sweep.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Connection, PgConnection};

use super::outbox;
use crate::broker::SinkKind;
use crate::queue::routing;
use crate::queue::routing::route_lock_key as lock_key;
use crate::retry::Retry;

/// How long `set` waits for the kind's lock by default.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteMode {
    Db,
    Dual,
    Broker,
}

impl RouteMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteMode::Db => "db",
            RouteMode::Dual => "dual",
            RouteMode::Broker => "broker",
        }
    }
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Route {
    pub kind: String,
    pub mode: String,
    pub sink: Option<String>,
    pub destination: Option<String>,
    pub updated_at: DateTime<Utc>,
}

/// A session that held the kind's lock when `set` gave up.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Blocker {
    pub pid: i32,
    pub application: String,
    pub state: String,
    pub seconds_in_transaction: f64,
    pub query: String,
}

impl std::fmt::Display for Blocker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pid {} (application `{}`, {} for {:.0}s, last statement: `{}`)",
            self.pid,
            if self.application.is_empty() {
                "?"
            } else {
                &self.application
            },
            self.state,
            self.seconds_in_transaction,
            self.query
        )
    }
}

fn blockers_text(blockers: &[Blocker]) -> String {
    if blockers.is_empty() {
        "a transaction that has since finished, or row locks on the kind's jobs".to_string()
    } else {
        blockers
            .iter()
            .map(Blocker::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error(
        "mode {mode} needs a sink and a destination: add --sink kafka|rabbitmq --destination NAME"
    )]
    MissingSink { mode: &'static str },
    #[error(
        "route set for kind `{kind}` gave up after {waited:?} waiting for transactions that enqueued it: {}; nothing was changed. Let them finish (or end them), then retry, or allow longer with --lock-timeout",
        blockers_text(.blockers)
    )]
    LockTimeout {
        kind: String,
        waited: Duration,
        blockers: Vec<Blocker>,
    },
}

pub async fn list(conn: &mut PgConnection) -> Result<Vec<Route>, RouteError> {
    Ok(sqlx::query_as::<_, Route>(
        "SELECT kind, mode, sink, destination, updated_at FROM almanac.routes ORDER BY kind",
    )
    .fetch_all(conn)
    .await?)
}

/// The route a `set` would give, filling in the current sink and
/// destination when they are not named.
pub async fn resolve(
    conn: &mut PgConnection,
    kind: &str,
    mode: RouteMode,
    sink: Option<SinkKind>,
    destination: Option<&str>,
) -> Result<(Option<SinkKind>, Option<String>), RouteError> {
    let current: Option<(Option<String>, Option<String>)> =
        sqlx::query_as("SELECT sink, destination FROM almanac.routes WHERE kind = $1")
            .bind(kind)
            .fetch_optional(conn)
            .await?;
    let (old_sink, old_destination) = current.unwrap_or_default();
    let sink = sink.or_else(|| old_sink.as_deref().and_then(SinkKind::parse));
    let destination = destination.map(str::to_string).or(old_destination);
    if mode != RouteMode::Db && (sink.is_none() || destination.as_deref().is_none_or(str::is_empty))
    {
        return Err(RouteError::MissingSink {
            mode: mode.as_str(),
        });
    }
    Ok((sink, destination))
}

/// What a route change did.
#[derive(Debug, Clone, Serialize)]
pub struct RouteChange {
    pub route: Route,
    /// Ready and running jobs of the kind moved to the new route.
    pub jobs_moved: u64,
    /// Pending outbox rows pointed at the new sink or destination.
    pub rows_readdressed: u64,
    /// Pending outbox rows dropped because the kind is back on `db`.
    pub rows_dropped: u64,
}

/// [`set_within`] with [`DEFAULT_LOCK_TIMEOUT`].
pub async fn set(
    conn: &mut PgConnection,
    kind: &str,
    mode: RouteMode,
    sink: Option<SinkKind>,
    destination: Option<&str>,
) -> Result<RouteChange, RouteError> {
    set_within(conn, kind, mode, sink, destination, DEFAULT_LOCK_TIMEOUT).await
}

/// Changes `kind`'s route in one transaction (see the module doc), waiting
/// at most `lock_timeout` for any lock it needs.
pub async fn set_within(
    conn: &mut PgConnection,
    kind: &str,
    mode: RouteMode,
    sink: Option<SinkKind>,
    destination: Option<&str>,
    lock_timeout: Duration,
) -> Result<RouteChange, RouteError> {
    // Moving a kind's jobs locks many rows in heap order while workers lock
    // some of them in theirs (outcomes, heartbeats), so PostgreSQL may pick
    // this transaction as a deadlock victim. It rolled back whole: try again.
    // At most 5 tries, paced so the workers' statements get through between.
    let mut retry = Retry::new(Duration::from_millis(50), Duration::from_secs(1));
    let result = loop {
        match set_in_tx(conn, kind, mode, sink, destination, lock_timeout).await {
            Err(RouteError::Db(sqlx::Error::Database(e)))
                if e.code().as_deref() == Some("40P01") && retry.failures() < 4 =>
            {
                let pause = retry.failed();
                tracing::warn!(
                    kind,
                    tries = retry.failures(),
                    retry_in_ms = pause.as_millis() as u64,
                    "route set was a deadlock victim; retrying"
                );
                tokio::time::sleep(pause).await;
            }
            other => break other,
        }
    };
    match result {
        Err(RouteError::Db(sqlx::Error::Database(e))) if e.code().as_deref() == Some("55P03") => {
            let blockers = lock_holders(conn, kind).await.unwrap_or_default();
            Err(RouteError::LockTimeout {
                kind: kind.to_string(),
                waited: lock_timeout,
                blockers,
            })
        }
        other => other,
    }
}

async fn set_in_tx(
    conn: &mut PgConnection,
    kind: &str,
    mode: RouteMode,
    sink: Option<SinkKind>,
    destination: Option<&str>,
    lock_timeout: Duration,
) -> Result<RouteChange, RouteError> {
    // READ COMMITTED whatever the session's default: `outbox::readdress`
    // must see batches claimed before it took the claim locks.
    let mut tx = conn
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await?;
    sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(format!("{}ms", lock_timeout.as_millis().max(1)))
        .execute(&mut *tx)
        .await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(lock_key(kind))
        .execute(&mut *tx)
        .await?;
    let (sink, destination) = resolve(&mut tx, kind, mode, sink, destination).await?;
    let route = sqlx::query_as::<_, Route>(
        r#"
        INSERT INTO almanac.routes (kind, mode, sink, destination) VALUES ($1, $2, $3, $4)
        ON CONFLICT (kind) DO UPDATE SET mode = excluded.mode, sink = excluded.sink,
            destination = excluded.destination, updated_at = now()
        RETURNING kind, mode, sink, destination, updated_at
        "#,
    )
    .bind(kind)
    .bind(mode.as_str())
    .bind(sink.map(SinkKind::as_str))
    .bind(destination.as_deref())
    .fetch_one(&mut *tx)
    .await?;
    let moved = routing::move_kind(&mut tx, kind, mode.as_str()).await?;
    let (readdressed, dropped) = outbox::readdress(&mut tx, Some(kind)).await?;
    // Workers wake and re-claim when a kind comes back to the database.
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(crate::queue::NOTIFY_CHANNEL)
        .bind(kind)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(RouteChange {
        route,
        jobs_moved: moved,
        rows_readdressed: readdressed,
        rows_dropped: dropped,
    })
}

/// Sessions holding `kind`'s route lock (shared: transactions that
/// enqueued the kind and are still open).
async fn lock_holders(conn: &mut PgConnection, kind: &str) -> Result<Vec<Blocker>, sqlx::Error> {
    sqlx::query_as(
        r#"
        WITH k AS (SELECT hashtext($1)::bigint AS key)
        SELECT a.pid, coalesce(a.application_name, '') AS application,
            coalesce(a.state, 'unknown') AS state,
            coalesce(extract(epoch FROM now() - a.xact_start), 0)::float8 AS seconds_in_transaction,
            left(regexp_replace(coalesce(a.query, ''), '\s+', ' ', 'g'), 120) AS query
        FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid, k
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid::bigint = ((k.key >> 32) & 4294967295)
          AND l.objid::bigint = (k.key & 4294967295)
          AND l.pid <> pg_backend_pid()
        ORDER BY a.xact_start
        "#,
    )
    .bind(lock_key(kind))
    .fetch_all(conn)
    .await
}

/// What one reconcile sweep repaired.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reconciled {
    pub jobs_moved: u64,
    pub rows_readdressed: u64,
    pub rows_dropped: u64,
}

/// Moves jobs whose route disagrees with `almanac.routes` onto it and points
/// pending outbox rows at their kind's current sink and destination (see the
/// module doc). Each kind in its own short transaction under its lock
/// (shared, so enqueues go on, but after any `route set` in progress); a
/// kind whose locks are not free within a second is left for the next sweep.
pub async fn reconcile(conn: &mut PgConnection) -> Result<Reconciled, sqlx::Error> {
    let mut done = Reconciled::default();
    let mut kinds = routing::kinds_off_route(&mut *conn).await?;
    kinds.extend(outbox::misaddressed_kinds(&mut *conn).await?);
    kinds.sort_unstable();
    kinds.dedup();
    for kind in kinds {
        match reconcile_kind(conn, &kind).await {
            Ok(r) => {
                done.jobs_moved += r.jobs_moved;
                done.rows_readdressed += r.rows_readdressed;
                done.rows_dropped += r.rows_dropped;
            }
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

async fn reconcile_kind(conn: &mut PgConnection, kind: &str) -> Result<Reconciled, sqlx::Error> {
    // READ COMMITTED whatever the session's default: `outbox::readdress`
    // must see batches claimed before it took the claim locks.
    let mut tx = conn
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await?;
    sqlx::query("SELECT set_config('lock_timeout', '1000ms', true)")
        .execute(&mut *tx)
        .await?;
    sqlx::query("SELECT pg_advisory_xact_lock_shared(hashtext($1))")
        .bind(lock_key(kind))
        .execute(&mut *tx)
        .await?;
    let jobs_moved = routing::reconcile_kind(&mut tx, kind).await?;
    let (rows_readdressed, rows_dropped) = outbox::readdress(&mut tx, Some(kind)).await?;
    tx.commit().await?;
    Ok(Reconciled {
        jobs_moved,
        rows_readdressed,
        rows_dropped,
    })
}
