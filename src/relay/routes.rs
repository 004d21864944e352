//! Routes per job kind, changed live for every running instance.
//!
//! `db`: workers polling PostgreSQL claim the kind. `dual`: workers can still
//! claim it, and every ready transition also writes an outbox row that the
//! relay publishes; whichever of worker and broker consumer claims first
//! runs the job. `broker`: only broker consumers run it.
//!
//! **A short change, then a walk.** `set` takes the kind's advisory lock
//! exclusively (enqueue takes it shared, in the insert trigger or, for
//! their own inserts, in the enqueue functions, migration 0137, and so does
//! a job coming back to `ready`, through `almanac.route_of`, migration 0107), writes the route and
//! commits: new jobs and jobs ready again take the new route from then on.
//! It then walks the kind's ready jobs in windows of [`WINDOW`], each in a
//! transaction of its own under the lock taken shared: the window's jobs
//! move to the route (those leaving `db` get their outbox rows from the
//! trigger), their pending outbox rows are re-addressed to the new sink and
//! destination when those changed (dropping any batch in flight that names
//! them), or dropped when the kind returns to `db`. Rows a worker is
//! claiming are skipped, not waited for, and running jobs are never
//! touched: a worker's heartbeats and outcomes never wait behind a route
//! change, and a backlog of a million jobs moves while enqueues, claims,
//! relays and the scheduler go on. Until the walk is over, jobs not yet
//! moved run where they were (`db` jobs of a kind now on the broker wait
//! for their window). A walk cut short (the command interrupted, a
//! window that kept failing) is finished by the relays' reconcile
//! ([`super::reconcile`]), or
//! by running the same `route set` again. So no ready job stays addressed to
//! a sink or destination the kind no longer uses, and a retired sink's
//! relay can go away once the walk is done.
//!
//! **Snapshots older than the route.** The insert trigger reads `routes` with
//! the enqueueing transaction's snapshot. Under READ COMMITTED (PostgreSQL's
//! default) every statement sees the latest committed route, and the advisory
//! lock orders the insert after any change. A REPEATABLE READ or SERIALIZABLE
//! transaction whose snapshot predates a committed change inserts its job on
//! the old route (and addresses its outbox row to the old destination). We
//! do not refuse such enqueues — many applications run their business
//! transactions at those levels and enqueue is meant to join them — instead
//! the reconcile run by every relay on an interval moves jobs whose route
//! disagrees with `routes` and re-addresses their pending rows, so the case
//! heals within one sweep.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Connection, PgConnection};

use super::outbox;
use crate::broker::SinkKind;
use crate::queue::routing::route_lock_key as lock_key;
use crate::queue::routing::{self, Window};
use crate::retry::Retry;

/// How long `set` waits for the kind's lock by default.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// How many ready jobs one window of a walk looks at (see the module doc):
/// a few tens of milliseconds of locks at a time.
pub const WINDOW: i64 = 2_000;

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
    #[error(
        "the route of kind `{kind}` is changed, but moving its ready jobs stopped after {moved} of them: {source}. Run the same `almanac route set` again to finish, or let a running relay's reconcile sweep finish it"
    )]
    Unfinished {
        kind: String,
        moved: u64,
        source: sqlx::Error,
    },
    #[error(
        "the route of kind `{kind}` is changed and its ready jobs moved, but {held} of them were held by other transactions for seconds and are still on the old route. Run the same `almanac route set` again, or let a running relay's reconcile sweep move them"
    )]
    Held { kind: String, held: u64 },
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
    /// Ready jobs of the kind moved to the new route.
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
    set_within(
        conn,
        kind,
        mode,
        sink,
        destination,
        DEFAULT_LOCK_TIMEOUT,
        None,
    )
    .await
}

/// Changes `kind`'s route, waiting at most `lock_timeout` for the kind's
/// lock, then moves its ready jobs (see the module doc). With an `actor`
/// (an operator's `almanac route set`), the change's transaction also
/// writes its audit row ([`crate::control::audit`]).
pub async fn set_within(
    conn: &mut PgConnection,
    kind: &str,
    mode: RouteMode,
    sink: Option<SinkKind>,
    destination: Option<&str>,
    lock_timeout: Duration,
    actor: Option<&crate::control::Actor>,
) -> Result<RouteChange, RouteError> {
    let written = write_route(conn, kind, mode, sink, destination, lock_timeout, actor).await;
    let route = match written {
        Err(RouteError::Db(sqlx::Error::Database(e))) if e.code().as_deref() == Some("55P03") => {
            let blockers = lock_holders(conn, kind).await.unwrap_or_default();
            return Err(RouteError::LockTimeout {
                kind: kind.to_string(),
                waited: lock_timeout,
                blockers,
            });
        }
        other => other?,
    };
    let walked = walk(conn, kind, Persist::Retry)
        .await
        .map_err(|(moved, source)| RouteError::Unfinished {
            kind: kind.to_string(),
            moved: moved.jobs_moved,
            source,
        })?;
    if walked.jobs_held > 0 {
        return Err(RouteError::Held {
            kind: kind.to_string(),
            held: walked.jobs_held,
        });
    }
    Ok(RouteChange {
        route,
        jobs_moved: walked.jobs_moved,
        rows_readdressed: walked.rows_readdressed,
        rows_dropped: walked.rows_dropped,
    })
}

/// The route change itself: one short transaction under the kind's lock,
/// held exclusively.
async fn write_route(
    conn: &mut PgConnection,
    kind: &str,
    mode: RouteMode,
    sink: Option<SinkKind>,
    destination: Option<&str>,
    lock_timeout: Duration,
    actor: Option<&crate::control::Actor>,
) -> Result<Route, RouteError> {
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
    if let Some(actor) = actor {
        let target = format!("kind {kind}");
        let note = match (mode, &route.sink, &route.destination) {
            (RouteMode::Dual | RouteMode::Broker, Some(sink), Some(dest)) => {
                format!("mode {} via {sink} `{dest}`", route.mode)
            }
            _ => format!("mode {}", route.mode),
        };
        let action = crate::control::audit::Action {
            action: "route set",
            target: &target,
            count: 1,
            note: Some(&note),
        };
        crate::control::audit::record(&mut tx, actor, &action).await?;
    }
    tx.commit().await?;
    Ok(route)
}

/// What a window that cannot get its locks does: `set` retries it, paced
/// (a busy moment passes); the relay's reconcile leaves the kind for its
/// next sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Persist {
    Retry,
    GiveUp,
}

/// Walks `kind`'s ready jobs window by window (see the module doc), then
/// looks again at the jobs windows skipped because another transaction
/// held them, a few times over about two seconds. On an error, returns what
/// was done before it.
pub(super) async fn walk(
    conn: &mut PgConnection,
    kind: &str,
    persist: Persist,
) -> Result<Reconciled, (Reconciled, sqlx::Error)> {
    let mut done = Reconciled::default();
    let mut cursor = None;
    let mut skipped = Vec::new();
    let mut again = 0;
    let mut retry = Retry::new(Duration::from_millis(50), Duration::from_secs(1));
    let mut said = tokio::time::Instant::now();
    loop {
        let of = if again == 0 {
            Window::After(cursor, WINDOW)
        } else {
            Window::Ids(&skipped)
        };
        match window(conn, kind, of).await {
            Ok((step, moved)) => {
                retry.succeeded();
                done.jobs_moved += step.jobs_moved;
                done.rows_readdressed += step.rows_readdressed;
                done.rows_dropped += step.rows_dropped;
                if said.elapsed() >= Duration::from_secs(5) {
                    said = tokio::time::Instant::now();
                    tracing::info!(
                        kind,
                        moved = done.jobs_moved,
                        "moving the kind's ready jobs to its route"
                    );
                }
                if again == 0 {
                    skipped.extend(moved.skipped);
                    cursor = moved.next;
                    if cursor.is_some() {
                        continue;
                    }
                } else {
                    skipped = moved.skipped;
                }
                if skipped.is_empty() || again == 4 {
                    done.jobs_held = skipped.len() as u64;
                    return Ok(done);
                }
                again += 1;
                tokio::time::sleep(Duration::from_millis(100) * 2u32.pow(again)).await;
            }
            // A deadlock victim (outbox rows a relay's mark holds) or a lock
            // busy past a second: the window rolled back whole.
            Err(sqlx::Error::Database(e))
                if matches!(e.code().as_deref(), Some("40P01" | "55P03"))
                    && persist == Persist::Retry
                    && retry.failures() < 8 =>
            {
                let pause = retry.failed();
                tracing::warn!(kind, tries = retry.failures(), retry_in_ms = pause.as_millis() as u64, error = %e, "a window of the route walk could not get its locks; retrying");
                tokio::time::sleep(pause).await;
            }
            Err(e) => return Err((done, e)),
        }
    }
}

/// One window of the walk in its own transaction. READ COMMITTED whatever
/// the session's default: `outbox::readdress` must see batches claimed
/// before it took the claim locks.
async fn window(
    conn: &mut PgConnection,
    kind: &str,
    of: Window<'_>,
) -> Result<(Reconciled, routing::Moved), sqlx::Error> {
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
    let moved = routing::move_window(&mut tx, kind, of).await?;
    let (rows_readdressed, rows_dropped) = outbox::readdress(&mut tx, &moved.ids).await?;
    if moved.moved > 0 {
        // Workers wake and claim when jobs come back to the database.
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(crate::queue::NOTIFY_CHANNEL)
            .bind(kind)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok((
        Reconciled {
            jobs_moved: moved.moved,
            rows_readdressed,
            rows_dropped,
            jobs_held: 0,
        },
        moved,
    ))
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
    /// Ready jobs off the route that other transactions held throughout
    /// (the next sweep, or the same `route set` again, moves them).
    pub jobs_held: u64,
}
