//! The audit log: one row per operator action, written by the action's own
//! transaction (see [`super`]), read back by `almanac audit` and `/audit`.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgExecutor};

use super::Actor;

/// One action as it was logged.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Entry {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub source: String,
    pub action: String,
    pub target: String,
    pub count: i64,
    pub note: Option<String>,
}

/// What an action did, for its row.
#[derive(Debug, Clone)]
pub struct Action<'a> {
    /// `pause`, `resume`, `cancel`, `retry`, ...
    pub action: &'a str,
    /// `job 42`, `kind report`, a bulk filter.
    pub target: &'a str,
    /// Rows changed.
    pub count: i64,
    pub note: Option<&'a str>,
}

/// Writes `action`'s row on `tx`: call it inside the action's transaction.
pub async fn record(
    tx: &mut PgConnection,
    actor: &Actor,
    action: &Action<'_>,
) -> Result<(), sqlx::Error> {
    record_returning(tx, actor, action).await.map(|_| ())
}

/// [`record`], returning the row's id (a bulk action brings its count up
/// to date batch by batch).
pub async fn record_returning(
    tx: &mut PgConnection,
    actor: &Actor,
    action: &Action<'_>,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO almanac.audit_log (actor, source, action, target, count, note) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
    )
    .bind(&actor.name)
    .bind(actor.source.as_str())
    .bind(action.action)
    .bind(crate::queue::storable(action.target))
    .bind(action.count.max(0))
    .bind(action.note.map(crate::queue::storable))
    .fetch_one(tx)
    .await
}

/// Newest first: at most `limit` rows with an id below `before` (all, when
/// `None`).
pub async fn list<'e>(
    db: impl PgExecutor<'e>,
    limit: i64,
    before: Option<i64>,
) -> Result<Vec<Entry>, sqlx::Error> {
    sqlx::query_as::<_, Entry>(
        "SELECT * FROM almanac.audit_log WHERE ($1::bigint IS NULL OR id < $1) \
         ORDER BY id DESC LIMIT $2",
    )
    .bind(before)
    .bind(limit.clamp(0, 10_000))
    .fetch_all(db)
    .await
}
