//! The levers the dashboard's forms and the JSON API both pull: one function
//! per action, each calling [`crate::control`] (which acts and writes the
//! audit row in one transaction). The HTML handlers and the `/api/v1`
//! handlers differ only in how they admit a request (a form's CSRF token, or
//! a JSON request) and how they render the answer.
//!
//! Every function here refuses with 403 unless `--ui-actions`, whoever
//! calls it, and runs its work in a task of its own, so a client that goes
//! away mid-way does not leave the action half-done.

use std::future::Future;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use sqlx::pool::PoolConnection;
use sqlx::Postgres;

use super::{Ui, UiError, ACTIONS_OFF};
use crate::control::{self, pause, Actor, Source};
use crate::http::AuthUser;
use crate::queue::browse::DeadFilter;
use crate::queue::limits::{KindLimits, Limits};
use crate::queue::{Cancel, Job, QueueError};
use crate::scheduler::controls::{Pause as SchedulePause, Paused as SchedulePaused, Triggered};

/// The basic-auth user the request was admitted as, if auth is on.
pub(super) struct Who(Option<String>);

impl<S: Send + Sync> FromRequestParts<S> for Who {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Who(parts.extensions.get::<AuthUser>().map(|u| u.0.clone())))
    }
}

impl Who {
    /// The actor of an action from `source`: the basic-auth user, or
    /// `anonymous` (loopback without auth).
    pub(super) fn actor(&self, source: Source) -> Actor {
        Actor::new(self.0.as_deref().unwrap_or("anonymous"), source)
    }
}

impl From<control::ControlError> for UiError {
    fn from(err: control::ControlError) -> Self {
        match err {
            control::ControlError::Queue(err) => err.into(),
            control::ControlError::Db(err) => err.into(),
            control::ControlError::Invalid(message) => UiError::BadRequest(message),
        }
    }
}

/// Runs `work` on a connection of the dashboard's pool, in its own task,
/// once actions are on.
async fn act<T, F, Fut>(ui: &Ui, work: F) -> Result<T, UiError>
where
    T: Send + 'static,
    F: FnOnce(PoolConnection<Postgres>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, UiError>> + Send + 'static,
{
    if !ui.actions {
        return Err(UiError::Forbidden(ACTIONS_OFF.into()));
    }
    let pool = ui.pool.clone();
    tokio::spawn(async move { work(pool.acquire().await?).await })
        .await
        .map_err(|e| UiError::Db(format!("the action's task failed: {e}")))?
}

/// A job id from a path segment.
pub(super) fn job_id(text: &str) -> Result<i64, UiError> {
    text.parse()
        .map_err(|_| UiError::BadRequest(format!("`{text}` is not a job id")))
}

/// Retries one dead or cancelled job.
pub(super) async fn retry(ui: &Ui, actor: Actor, id: i64) -> Result<Job, UiError> {
    let job = act(ui, move |mut conn| async move {
        Ok(control::jobs::retry(&mut conn, &actor, id).await?)
    })
    .await?;
    tracing::info!(job_id = job.id, kind = %job.kind, "operator retried a job");
    Ok(job)
}

/// Retries every dead job of a group; how many were retried.
pub(super) async fn retry_group(ui: &Ui, actor: Actor, group: DeadFilter) -> Result<u64, UiError> {
    let kind = group.kind.clone();
    let n = act(ui, move |mut conn| async move {
        Ok(control::jobs::retry_dead_group(&mut conn, &actor, &group).await?)
    })
    .await?;
    tracing::info!(kind = ?kind, retried = n, "operator retried a group of dead jobs");
    Ok(n)
}

/// Cancels a job (ready: at once; running: by request to its holder).
pub(super) async fn cancel(
    ui: &Ui,
    actor: Actor,
    id: i64,
    reason: Option<String>,
) -> Result<Cancel, UiError> {
    let reason = reason
        .map(|r| r.trim().to_string())
        .filter(|r| !r.is_empty());
    let outcome = act(ui, move |mut conn| async move {
        Ok(control::jobs::cancel(&mut conn, &actor, id, reason.as_deref()).await?)
    })
    .await?;
    tracing::info!(job_id = id, "operator cancelled a job");
    Ok(outcome)
}

/// Pauses a kind (`*`: every kind).
pub(super) async fn pause_kind(
    ui: &Ui,
    actor: Actor,
    kind: String,
    note: Option<String>,
) -> Result<pause::Paused, UiError> {
    let note = note.map(|n| n.trim().to_string()).filter(|n| !n.is_empty());
    act(ui, move |mut conn| async move {
        Ok(pause::pause(&mut conn, &actor, &kind, note.as_deref()).await?)
    })
    .await
}

/// Resumes a kind: its lifted pause, or 409 naming the paused kinds when it
/// was not paused.
pub(super) async fn resume_kind(
    ui: &Ui,
    actor: Actor,
    kind: String,
) -> Result<pause::Pause, UiError> {
    act(ui, move |mut conn| async move {
        match pause::resume(&mut conn, &actor, &kind).await? {
            Some(lifted) => Ok(lifted),
            None => {
                let paused: Vec<String> = pause::list(&mut *conn)
                    .await?
                    .into_iter()
                    .map(|p| p.kind)
                    .collect();
                Err(UiError::Conflict(format!(
                    "kind {kind} is not paused; paused kinds: {}",
                    if paused.is_empty() {
                        "none".into()
                    } else {
                        paused.join(", ")
                    }
                )))
            }
        }
    })
    .await
}

/// Sets a kind's limits, replacing any it had; a refusal (a bad value, no
/// limit, no kind) is 400 in the library's words.
pub(super) async fn set_limits(
    ui: &Ui,
    actor: Actor,
    kind: String,
    new: Limits,
) -> Result<KindLimits, UiError> {
    act(ui, move |mut conn| async move {
        new.validate().map_err(limit_refusal)?;
        control::limits::set(&mut conn, &actor, &kind, &new)
            .await
            .map_err(|e| match e {
                control::ControlError::Queue(e) => limit_refusal(e),
                other => other.into(),
            })
    })
    .await
}

/// Clears a kind's limits: what it had, `None` when it had none.
pub(super) async fn clear_limits(
    ui: &Ui,
    actor: Actor,
    kind: String,
) -> Result<Option<KindLimits>, UiError> {
    act(ui, move |mut conn| async move {
        Ok(control::limits::clear(&mut conn, &actor, &kind).await?)
    })
    .await
}

/// A limit's refusal as its own message (no `invalid job:`: a limit is no job).
pub(super) fn limit_refusal(err: QueueError) -> UiError {
    match err {
        QueueError::Invalid(message) => UiError::BadRequest(message),
        other => other.into(),
    }
}

/// Pauses a synced schedule.
pub(super) async fn pause_schedule(
    ui: &Ui,
    actor: Actor,
    name: String,
    note: String,
) -> Result<SchedulePaused, UiError> {
    act(ui, move |mut conn| async move {
        let schedule = super::schedules::synced(&mut conn, &name).await?;
        Ok(control::schedules::pause(&mut conn, &actor, &schedule, note.trim()).await?)
    })
    .await
}

/// Resumes a synced schedule; `None` when it was not paused.
pub(super) async fn resume_schedule(
    ui: &Ui,
    actor: Actor,
    name: String,
) -> Result<Option<SchedulePause>, UiError> {
    act(ui, move |mut conn| async move {
        super::schedules::synced(&mut conn, &name).await?;
        Ok(control::schedules::resume(&mut conn, &actor, &name).await?)
    })
    .await
}

/// Triggers a run of a synced schedule (the one named, or the latest due).
pub(super) async fn trigger_schedule(
    ui: &Ui,
    actor: Actor,
    name: String,
    logical_run: Option<String>,
) -> Result<Triggered, UiError> {
    let logical_run = logical_run
        .map(|r| r.trim().to_string())
        .filter(|r| !r.is_empty());
    let tracer = ui.tracer.clone();
    act(ui, move |mut conn| async move {
        let schedule = super::schedules::synced(&mut conn, &name).await?;
        Ok(control::schedules::trigger(
            &mut conn,
            &actor,
            &schedule,
            logical_run.as_deref(),
            &tracer,
        )
        .await?)
    })
    .await
}
