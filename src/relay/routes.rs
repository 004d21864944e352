//! Routes per job kind, changed live for every running instance.
//!
//! `db`: workers polling PostgreSQL claim the kind. `dual`: workers can still
//! claim it, and every ready transition also writes an outbox row that the
//! relay publishes; whichever of worker and broker consumer claims first
//! runs the job. `broker`: only broker consumers run it.
//!
//! Changing a route takes the kind's advisory lock exclusively (enqueue takes
//! it shared, in the insert trigger), moves the kind's ready and running
//! jobs to the new route and, for ready jobs leaving `db`, writes their
//! outbox rows, all in one transaction: no job is stranded on the old route,
//! and workers stop taking the kind the moment the change commits.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Connection, PgConnection};

use super::sink::SinkKind;

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

#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error(
        "mode {mode} needs a sink and a destination: add --sink kafka|rabbitmq --destination NAME"
    )]
    MissingSink { mode: &'static str },
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
}

pub async fn set(
    conn: &mut PgConnection,
    kind: &str,
    mode: RouteMode,
    sink: Option<SinkKind>,
    destination: Option<&str>,
) -> Result<RouteChange, RouteError> {
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('almanac.route:' || $1))")
        .bind(kind)
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
    let moved = sqlx::query(
        "UPDATE almanac.jobs SET route = $2 WHERE kind = $1 AND status IN ('ready', 'running') AND route <> $2",
    )
    .bind(kind)
    .bind(mode.as_str())
    .execute(&mut *tx)
    .await?
    .rows_affected();
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
    })
}
