//! Setting and clearing a kind's limits ([`crate::queue::limits`] says
//! what they guarantee), each with its audit row.

use sqlx::{Connection, PgConnection};

use super::audit::{self, Action};
use super::{wake, Actor, ControlError};
use crate::queue::limits::{self, KindLimits, Limits};

/// Sets `kind`'s limits, replacing any it had; they hold for every claim
/// that starts after this commits. Workers waiting for work are woken, so
/// a loosened limit is used at once.
pub async fn set(
    conn: &mut PgConnection,
    actor: &Actor,
    kind: &str,
    new: &Limits,
) -> Result<KindLimits, ControlError> {
    let mut tx = conn.begin().await?;
    let stored = limits::put(&mut tx, kind, new, &actor.to_string()).await?;
    let target = format!("kind {kind}");
    let note = stored.limits.to_string();
    let action = Action {
        action: "limits set",
        target: &target,
        count: 1,
        note: Some(&note),
    };
    audit::record(&mut tx, actor, &action).await?;
    wake(&mut tx, kind).await?;
    tx.commit().await?;
    Ok(stored)
}

/// Removes `kind`'s limits; `Ok(None)` when it had none (nothing changed,
/// nothing logged).
pub async fn clear(
    conn: &mut PgConnection,
    actor: &Actor,
    kind: &str,
) -> Result<Option<KindLimits>, ControlError> {
    let mut tx = conn.begin().await?;
    let Some(removed) = limits::remove(&mut tx, kind).await? else {
        return Ok(None);
    };
    let target = format!("kind {kind}");
    let note = format!("was: {}", removed.limits);
    let action = Action {
        action: "limits clear",
        target: &target,
        count: 1,
        note: Some(&note),
    };
    audit::record(&mut tx, actor, &action).await?;
    wake(&mut tx, kind).await?;
    tx.commit().await?;
    Ok(Some(removed))
}
