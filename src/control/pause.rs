//! Paused kinds. A paused kind's jobs stay where they are: ready jobs are
//! not claimed by any worker ([`crate::queue::claim`] skips the kind), and a
//! broker consumer that meets one holds its message, unacknowledged, until
//! the kind is resumed ([`crate::queue::ClaimById::Paused`]). Jobs already
//! running go on (cancel them to stop them). `*` pauses every kind;
//! resuming `*` lifts only that row, not the pauses of single kinds.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Connection, PgConnection, PgExecutor};

use super::audit::{self, Action};
use super::{Actor, ControlError};
use crate::queue::NOTIFY_CHANNEL;

/// The kind name that pauses every kind.
pub const ALL_KINDS: &str = "*";

/// One paused kind.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Pause {
    pub kind: String,
    pub paused_at: DateTime<Utc>,
    pub paused_by: String,
    pub note: Option<String>,
}

/// What [`pause`] found.
#[derive(Debug, Clone)]
pub enum Paused {
    Now(Pause),
    /// It was paused already; the earlier pause (and its note) stands.
    Already(Pause),
}

fn check_kind(kind: &str) -> Result<(), ControlError> {
    if kind.trim().is_empty() {
        return Err(ControlError::Invalid(
            "a kind name is required (`*` pauses every kind)".into(),
        ));
    }
    Ok(())
}

/// Pauses `kind` from this transaction's commit on.
pub async fn pause(
    conn: &mut PgConnection,
    actor: &Actor,
    kind: &str,
    note: Option<&str>,
) -> Result<Paused, ControlError> {
    check_kind(kind)?;
    let mut tx = conn.begin().await?;
    let inserted: Option<Pause> = sqlx::query_as(
        "INSERT INTO almanac.kind_pauses (kind, paused_by, note) VALUES ($1, $2, $3) \
         ON CONFLICT (kind) DO NOTHING RETURNING *",
    )
    .bind(kind)
    .bind(actor.to_string())
    .bind(note)
    .fetch_optional(&mut *tx)
    .await?;
    let paused = match inserted {
        Some(pause) => Paused::Now(pause),
        None => Paused::Already(
            sqlx::query_as("SELECT * FROM almanac.kind_pauses WHERE kind = $1")
                .bind(kind)
                .fetch_one(&mut *tx)
                .await?,
        ),
    };
    let count = i64::from(matches!(paused, Paused::Now(_)));
    let target = format!("kind {kind}");
    let action = Action {
        action: "pause",
        target: &target,
        count,
        note,
    };
    audit::record(&mut tx, actor, &action).await?;
    tx.commit().await?;
    Ok(paused)
}

/// Resumes `kind`; `Ok(None)` when it was not paused (nothing changed, and
/// nothing is logged).
pub async fn resume(
    conn: &mut PgConnection,
    actor: &Actor,
    kind: &str,
) -> Result<Option<Pause>, ControlError> {
    check_kind(kind)?;
    let mut tx = conn.begin().await?;
    let lifted: Option<Pause> =
        sqlx::query_as("DELETE FROM almanac.kind_pauses WHERE kind = $1 RETURNING *")
            .bind(kind)
            .fetch_optional(&mut *tx)
            .await?;
    let Some(lifted) = lifted else {
        return Ok(None);
    };
    let target = format!("kind {kind}");
    let action = Action {
        action: "resume",
        target: &target,
        count: 1,
        note: None,
    };
    audit::record(&mut tx, actor, &action).await?;
    // Workers waiting for work wake at once (delivered at commit); `*`
    // wakes every worker.
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(NOTIFY_CHANNEL)
        .bind(kind)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Some(lifted))
}

/// Every paused kind, `*` first.
pub async fn list<'e>(db: impl PgExecutor<'e>) -> Result<Vec<Pause>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM almanac.kind_pauses ORDER BY kind <> '*', kind")
        .fetch_all(db)
        .await
}

/// Whether `kind` is paused, by its own pause or by `*`.
pub async fn is_paused<'e>(db: impl PgExecutor<'e>, kind: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM almanac.kind_pauses WHERE kind IN ($1, '*'))")
        .bind(kind)
        .fetch_one(db)
        .await
}
