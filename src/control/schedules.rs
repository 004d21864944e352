//! A schedule's runtime controls (pause, resume, trigger) with their audit
//! row: [`crate::scheduler::controls`] does the work inside a transaction
//! this module opens, writes the row on it, and commits both together.
//!
//! What is logged: a pause (count 1, or 0 when it was paused already), a
//! resume that ended a pause (a resume of a schedule that was not paused
//! changes nothing and is not logged, as for kinds), and a trigger (count 1
//! when it emitted a job, 0 when the run already existed).

use sqlx::{Connection, PgConnection};

use super::audit::{self, Action};
use super::Actor;
use crate::scheduler::controls::{self, ControlError, Pause, Paused, Triggered};
use crate::scheduler::spec::Schedule;

/// Pauses `schedule` ([`controls::pause`]) as `actor`, and logs it.
pub async fn pause(
    conn: &mut PgConnection,
    actor: &Actor,
    schedule: &Schedule,
    note: &str,
) -> Result<Paused, ControlError> {
    let mut tx = conn.begin().await?;
    let paused = controls::pause(&mut tx, schedule, note, &actor.to_string(), None).await?;
    let target = format!("schedule {}", schedule.name);
    let action = Action {
        action: "pause",
        target: &target,
        count: i64::from(matches!(paused, Paused::Now(_))),
        note: Some(note).filter(|n| !n.is_empty()),
    };
    audit::record(&mut tx, actor, &action).await?;
    tx.commit().await?;
    Ok(paused)
}

/// Resumes schedule `name` ([`controls::resume`]) as `actor`, and logs it
/// when it was paused.
pub async fn resume(
    conn: &mut PgConnection,
    actor: &Actor,
    name: &str,
) -> Result<Option<Pause>, ControlError> {
    let mut tx = conn.begin().await?;
    let Some(ended) = controls::resume(&mut tx, name, &actor.to_string(), None).await? else {
        return Ok(None);
    };
    let target = format!("schedule {name}");
    let action = Action {
        action: "resume",
        target: &target,
        count: 1,
        note: None,
    };
    audit::record(&mut tx, actor, &action).await?;
    tx.commit().await?;
    Ok(Some(ended))
}

/// Triggers one run of `schedule` ([`controls::trigger`]) as `actor`, and
/// logs it.
pub async fn trigger(
    conn: &mut PgConnection,
    actor: &Actor,
    schedule: &Schedule,
    logical_run: Option<&str>,
    tracer: &crate::telemetry::Tracer,
) -> Result<Triggered, ControlError> {
    let mut tx = conn.begin().await?;
    let triggered = controls::trigger(&mut tx, schedule, logical_run, tracer).await?;
    let (count, note) = match &triggered {
        Triggered::Emitted { run, job_id } => (
            1,
            format!("logical run {} as job {job_id}", run.logical_run),
        ),
        Triggered::Existed { run, source, .. } => (
            0,
            format!(
                "logical run {} already existed (recorded by {source}); nothing emitted",
                run.logical_run
            ),
        ),
    };
    let target = format!("schedule {}", schedule.name);
    let action = Action {
        action: "trigger",
        target: &target,
        count,
        note: Some(&note),
    };
    audit::record(&mut tx, actor, &action).await?;
    tx.commit().await?;
    Ok(triggered)
}
