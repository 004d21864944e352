//! The API's actions: each admits a JSON request (see "CSRF" in [`super`])
//! and calls the [`act`] function the dashboard's form calls, as the
//! request's actor with source `api`.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::{body, error, ApiError};
use crate::control::pause::Paused;
use crate::control::Source;
use crate::queue::browse::DeadFilter;
use crate::queue::limits::Limits;
use crate::queue::Cancel;
use crate::scheduler::controls::{Paused as SchedulePaused, Triggered};
use crate::ui::act::{self, job_id, Who};
use crate::ui::Ui;

/// Unwraps an action's body or answers with its refusal.
macro_rules! body_or_refuse {
    ($headers:expr, $bytes:expr) => {
        match body(&$headers, &$bytes) {
            Ok(b) => b,
            Err((status, message)) => return Ok(error(status, &message)),
        }
    };
}

type Acted = Result<Response, ApiError>;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Empty {}

pub(super) async fn retry(
    State(ui): State<Ui>,
    who: Who,
    Path(id): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Acted {
    let Empty {} = body_or_refuse!(headers, bytes);
    let id = job_id(&id)?;
    let job = act::retry(&ui, who.actor(Source::Api), id).await?;
    Ok(Json(json!({ "outcome": "retried", "job": job })).into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    reason: Option<String>,
}

pub(super) async fn cancel(
    State(ui): State<Ui>,
    who: Who,
    Path(id): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Acted {
    let CancelBody { reason } = body_or_refuse!(headers, bytes);
    let id = job_id(&id)?;
    Ok(
        match act::cancel(&ui, who.actor(Source::Api), id, reason).await? {
            Cancel::Cancelled(job) => {
                Json(json!({ "outcome": "cancelled", "job": job })).into_response()
            }
            Cancel::Requested(job) => {
                Json(json!({ "outcome": "stop_requested", "job": job })).into_response()
            }
            Cancel::Finished(job) => error(
                StatusCode::CONFLICT,
                &format!(
                    "job {id} had already finished ({}): nothing changed",
                    job.status
                ),
            ),
        },
    )
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupBody {
    kind: Option<String>,
    /// The exact first line of the error (`""`: dead without an error).
    error: Option<String>,
    /// Neither `kind` nor `error`: every dead job, only when this says so.
    #[serde(default)]
    all: bool,
}

pub(super) async fn retry_group(
    State(ui): State<Ui>,
    who: Who,
    headers: HeaderMap,
    bytes: Bytes,
) -> Acted {
    let GroupBody { kind, error, all } = body_or_refuse!(headers, bytes);
    let group = DeadFilter {
        kind: kind.filter(|k| !k.trim().is_empty()),
        error,
    };
    if ui.actions && group.kind.is_none() && group.error.is_none() && !all {
        return Err(super::bad(
            "name a dead-letter group (\"kind\", \"error\"), or send \"all\": true to retry every dead job"
                .into(),
        ));
    }
    let n = act::retry_group(&ui, who.actor(Source::Api), group).await?;
    Ok(Json(json!({ "outcome": "retried", "retried": n })).into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct NoteBody {
    note: Option<String>,
}

pub(super) async fn pause_kind(
    State(ui): State<Ui>,
    who: Who,
    Path(kind): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Acted {
    let NoteBody { note } = body_or_refuse!(headers, bytes);
    Ok(
        match act::pause_kind(&ui, who.actor(Source::Api), kind, note).await? {
            Paused::Now(p) => Json(json!({ "outcome": "paused", "pause": p })),
            Paused::Already(p) => Json(json!({ "outcome": "already_paused", "pause": p })),
        }
        .into_response(),
    )
}

pub(super) async fn resume_kind(
    State(ui): State<Ui>,
    who: Who,
    Path(kind): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Acted {
    let Empty {} = body_or_refuse!(headers, bytes);
    let lifted = act::resume_kind(&ui, who.actor(Source::Api), kind).await?;
    Ok(Json(json!({ "outcome": "resumed", "pause": lifted })).into_response())
}

pub(super) async fn pause_schedule(
    State(ui): State<Ui>,
    who: Who,
    Path(name): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Acted {
    let NoteBody { note } = body_or_refuse!(headers, bytes);
    let note = note.unwrap_or_default();
    let (outcome, p) = match act::pause_schedule(&ui, who.actor(Source::Api), name, note).await? {
        SchedulePaused::Now(p) => ("paused", p),
        SchedulePaused::Already(p) => ("already_paused", p),
    };
    Ok(Json(json!({
        "outcome": outcome,
        "pause": {"schedule": p.schedule, "since": p.since, "by": p.by, "note": p.note},
    }))
    .into_response())
}

pub(super) async fn resume_schedule(
    State(ui): State<Ui>,
    who: Who,
    Path(name): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Acted {
    let Empty {} = body_or_refuse!(headers, bytes);
    match act::resume_schedule(&ui, who.actor(Source::Api), name.clone()).await? {
        Some(p) => Ok(Json(json!({
            "outcome": "resumed",
            "pause": {"schedule": p.schedule, "since": p.since, "by": p.by, "note": p.note},
        }))
        .into_response()),
        None => Ok(error(
            StatusCode::CONFLICT,
            &format!("schedule {name} is not paused; nothing changed"),
        )),
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TriggerBody {
    logical_run: Option<String>,
}

pub(super) async fn trigger_schedule(
    State(ui): State<Ui>,
    who: Who,
    Path(name): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Acted {
    let TriggerBody { logical_run } = body_or_refuse!(headers, bytes);
    Ok(
        match act::trigger_schedule(&ui, who.actor(Source::Api), name, logical_run).await? {
            Triggered::Emitted { run, job_id } => Json(json!({
                "outcome": "emitted",
                "logical_run": run.logical_run,
                "fire_at": run.fire_at,
                "job_id": job_id,
            })),
            Triggered::Existed {
                run,
                source,
                job_id,
            } => Json(json!({
                "outcome": "existed",
                "logical_run": run.logical_run,
                "fire_at": run.fire_at,
                "recorded_by": source,
                "job_id": job_id,
            })),
        }
        .into_response(),
    )
}

/// `POST /api/v1/kinds/{kind}/limits`: the CLI's flags as JSON, each
/// optional, in the CLI's own grammar (`"per_key": "/customer_id=2"`,
/// `"rate": "600/1m"`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitsBody {
    global: Option<i32>,
    per_key: Option<String>,
    rate: Option<String>,
    burst: Option<i32>,
}

pub(super) async fn set_limits(
    State(ui): State<Ui>,
    who: Who,
    Path(kind): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Acted {
    let LimitsBody {
        global,
        per_key,
        rate,
        burst,
    } = body_or_refuse!(headers, bytes);
    let limits = Limits {
        global,
        per_key: per_key
            .map(|p| p.parse())
            .transpose()
            .map_err(act::limit_refusal)?,
        rate: rate
            .map(|r| r.parse())
            .transpose()
            .map_err(act::limit_refusal)?,
        burst: burst.unwrap_or(0),
    };
    let stored = act::set_limits(&ui, who.actor(Source::Api), kind, limits).await?;
    Ok(Json(json!({ "outcome": "set", "limits": stored })).into_response())
}

/// `DELETE /api/v1/kinds/{kind}/limits`.
pub(super) async fn clear_limits(
    State(ui): State<Ui>,
    who: Who,
    Path(kind): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Acted {
    let Empty {} = body_or_refuse!(headers, bytes);
    Ok(
        match act::clear_limits(&ui, who.actor(Source::Api), kind).await? {
            Some(removed) => Json(json!({ "outcome": "cleared", "limits": removed })),
            None => Json(json!({ "outcome": "had_none", "limits": null })),
        }
        .into_response(),
    )
}
