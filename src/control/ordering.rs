//! Ordering a kind's jobs per key and stopping it
//! ([`crate::queue::ordering`] says what it guarantees), each with its
//! audit row.

use sqlx::{Connection, PgConnection};

use super::audit::{self, Action};
use super::{Actor, ControlError};
use crate::queue::ordering::{self, KindOrdering, OnDead};

/// Orders `kind`; returns the setting as stored and how many held jobs it
/// released.
pub async fn set(
    conn: &mut PgConnection,
    actor: &Actor,
    kind: &str,
    key_pointer: Option<&str>,
    on_dead: OnDead,
) -> Result<(KindOrdering, u64), ControlError> {
    let mut tx = conn.begin().await?;
    let (stored, released) =
        ordering::put(&mut tx, kind, key_pointer, on_dead, &actor.to_string()).await?;
    let target = format!("kind {kind}");
    let note = format!(
        "key {}, on dead {on_dead}{}",
        key_pointer.unwrap_or("given at enqueue"),
        released_note(released)
    );
    let action = Action {
        action: "ordering set",
        target: &target,
        count: 1,
        note: Some(&note),
    };
    audit::record(&mut tx, actor, &action).await?;
    tx.commit().await?;
    Ok((stored, released))
}

/// Stops ordering `kind`: its held jobs become ready. `Ok(None)` when it
/// was not ordered (nothing changed, nothing logged).
pub async fn clear(
    conn: &mut PgConnection,
    actor: &Actor,
    kind: &str,
) -> Result<Option<(KindOrdering, u64)>, ControlError> {
    let mut tx = conn.begin().await?;
    let Some((had, released)) = ordering::remove(&mut tx, kind).await? else {
        return Ok(None);
    };
    let target = format!("kind {kind}");
    let note = format!("was on dead {}{}", had.on_dead, released_note(released));
    let action = Action {
        action: "ordering clear",
        target: &target,
        count: 1,
        note: Some(&note),
    };
    audit::record(&mut tx, actor, &action).await?;
    if released > 0 {
        super::wake(&mut tx, kind).await?;
    }
    tx.commit().await?;
    Ok(Some((had, released)))
}

fn released_note(released: u64) -> String {
    match released {
        0 => String::new(),
        n => format!("; released {n} held job{}", if n == 1 { "" } else { "s" }),
    }
}
