//! The JSON API under `/api/v1`, on the dashboard's server, behind the same
//! basic auth, `Host` check and cross-site refusal (see [`super`]). Reads
//! use the pages' own read-only transactions and bounded queries (the jobs
//! list is [`browse::page`], the same keyset page as `/jobs`); actions are
//! [`super::act`]'s, the functions the dashboard's forms call, so they are
//! refused with 403 unless `--ui-actions` and each writes one audit row
//! with source `api`.
//!
//! **CSRF.** An action is a `POST` with `Content-Type: application/json`
//! (the body may be empty). Another site's page cannot send that type
//! without a CORS preflight, which this server never grants, and a `POST`
//! whose `Origin` or `Sec-Fetch-Site` names another site is refused before
//! it gets here; a script (no `Origin`, no `Sec-Fetch-Site`) is fine.
//!
//! Every error is `{"error": "..."}` with its status (400 bad input, 403
//! actions off or cross-site, 404 unknown id, kind, schedule or path, 409
//! wrong state, 415 not JSON). The shapes are listed in README.md.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use super::act::job_id;
use super::{Ui, UiError};
use crate::control::audit;
use crate::control::pause;
use crate::queue::browse::{self, JobQuery};
use crate::queue::{self, JobStatus};
use crate::scheduler::backfill::db_now;
use crate::scheduler::history;
use crate::stats::{snapshot, Snapshot};

/// Jobs per page unless `limit` says otherwise (at most [`MAX_JOBS`]).
const DEFAULT_JOBS: i64 = 50;
const MAX_JOBS: i64 = 500;
const DEAD_GROUPS: i64 = 200;
const DEFAULT_AUDIT: i64 = 50;
const MAX_AUDIT: i64 = 1_000;

mod actions;
use actions::{
    cancel, pause_kind, pause_schedule, resume_kind, resume_schedule, retry, retry_group,
    trigger_schedule,
};

pub(super) fn router() -> Router<Ui> {
    Router::new()
        .route("/jobs", get(jobs))
        .route("/jobs/{id}", get(job))
        .route("/jobs/{id}/retry", post(retry))
        .route("/jobs/{id}/cancel", post(cancel))
        .route("/dead", get(dead))
        .route("/dead/retry", post(retry_group))
        .route("/schedules", get(schedules))
        .route("/schedules/{name}/pause", post(pause_schedule))
        .route("/schedules/{name}/resume", post(resume_schedule))
        .route("/schedules/{name}/trigger", post(trigger_schedule))
        .route("/routes", get(routes))
        .route("/stats", get(stats))
        .route("/kinds/paused", get(paused_kinds))
        .route("/kinds/limits", get(limited_kinds))
        .route("/kinds/{kind}/pause", post(pause_kind))
        .route("/kinds/{kind}/resume", post(resume_kind))
        .route(
            "/kinds/{kind}/limits",
            post(actions::set_limits).delete(actions::clear_limits),
        )
        .route("/audit", get(audit_log))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
}

async fn wrong_method() -> Response {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        "wrong method: reads are GET, actions are POST (clearing a kind's limits is DELETE; see README.md, JSON API)",
    )
}

/// `{"error": message}` with `status`.
pub(super) fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

/// A [`UiError`] as JSON.
pub(super) struct ApiError(pub(super) UiError);

macro_rules! into_api_error {
    ($($from:ty),*) => {$(
        impl From<$from> for ApiError {
            fn from(err: $from) -> Self {
                ApiError(err.into())
            }
        }
    )*};
}

into_api_error!(
    UiError,
    sqlx::Error,
    crate::queue::QueueError,
    crate::scheduler::ledger::LedgerError,
    crate::scheduler::backfill::BackfillError
);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.0.status();
        error(status, &self.0.to_string())
    }
}

type Answer = Result<Json<Value>, ApiError>;

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "no such endpoint; the API's endpoints are listed in README.md (JSON API)",
    )
}

fn bad(message: String) -> ApiError {
    ApiError(UiError::BadRequest(message))
}

/// A number from the query string, or the default.
fn number(name: &str, value: &Option<String>, default: i64) -> Result<i64, ApiError> {
    match value.as_deref().map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|_| bad(format!("{name}=`{v}` is not a number"))),
    }
}

fn text(value: &Option<String>) -> Option<String> {
    value
        .as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(String::from)
}

/// An action's JSON body (`T::default()` when empty), refused unless sent
/// as `application/json` (see "CSRF" above).
fn body<T: DeserializeOwned + Default>(
    headers: &HeaderMap,
    bytes: &Bytes,
) -> Result<T, (StatusCode, String)> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
        });
    if !json {
        return Err((
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "send actions with Content-Type: application/json (an empty body is fine)".into(),
        ));
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(bytes).map_err(|e| {
        (
            StatusCode::BAD_REQUEST,
            format!("the body is not the JSON this action takes: {e}"),
        )
    })
}

/// Every limited kind: its limits, who set them, how many run now.
async fn limited_kinds(State(ui): State<Ui>) -> Answer {
    let mut tx = ui.read().await?;
    let limits = crate::stats::snapshot::limited_kinds(&mut tx).await?;
    tx.commit().await?;
    Ok(Json(json!({ "limits": limits })))
}

#[derive(Debug, Default, Deserialize)]
struct JobsQuery {
    kind: Option<String>,
    status: Option<String>,
    key: Option<String>,
    schedule: Option<String>,
    q: Option<String>,
    before: Option<String>,
    limit: Option<String>,
}

async fn jobs(State(ui): State<Ui>, Query(f): Query<JobsQuery>) -> Answer {
    let status = match text(&f.status) {
        Some(s) => Some(s.parse::<JobStatus>().map_err(bad)?),
        None => None,
    };
    let limit = number("limit", &f.limit, DEFAULT_JOBS)?;
    if !(1..=MAX_JOBS).contains(&limit) {
        return Err(bad(format!(
            "limit={limit} is out of range; use 1 to {MAX_JOBS}"
        )));
    }
    let before = match text(&f.before) {
        Some(b) => Some(b.parse::<i64>().map_err(|_| {
            bad(format!(
                "before=`{b}` is not a job id; pass the next_before of the previous page"
            ))
        })?),
        None => None,
    };
    let q = JobQuery {
        kind: text(&f.kind),
        status,
        idempotency_key: text(&f.key),
        schedule: text(&f.schedule),
        payload_text: text(&f.q),
        before,
        limit,
    };
    let mut tx = ui.read().await?;
    let page = browse::page(&mut tx, &q).await?;
    tx.commit().await?;
    Ok(Json(json!({
        "jobs": page.jobs,
        "next_before": page.next_before,
        "searched_from": page.searched_from,
        "searched_below": page.searched_below,
    })))
}

async fn job(State(ui): State<Ui>, Path(id): Path<String>) -> Answer {
    let id = job_id(&id)?;
    let mut tx = ui.read().await?;
    let job = queue::get(&mut *tx, id).await?;
    tx.commit().await?;
    Ok(Json(json!(job)))
}

async fn dead(State(ui): State<Ui>) -> Answer {
    let mut tx = ui.read().await?;
    let groups = browse::dead_groups(&mut *tx, DEAD_GROUPS).await?;
    let total = browse::dead_count(&mut tx, &browse::DeadFilter::default()).await?;
    tx.commit().await?;
    Ok(Json(json!({
        "total": total,
        "truncated": groups.len() as i64 == DEAD_GROUPS,
        // The groups are of the newest `sample` dead jobs, their counts within it.
        "sampled": total > browse::DEAD_SAMPLE,
        "sample": browse::DEAD_SAMPLE,
        "groups": groups,
    })))
}

async fn schedules(State(ui): State<Ui>) -> Answer {
    let mut tx = ui.read().await?;
    let rows = history::synced(&mut tx).await?;
    let mut states: std::collections::HashMap<String, snapshot::ScheduleState> =
        snapshot::schedules(&mut tx)
            .await?
            .into_iter()
            .map(|s| (s.name.clone(), s))
            .collect();
    let emitted = history::last_emitted(&mut tx).await?;
    let names: Vec<String> = rows.iter().map(|r| r.name.clone()).collect();
    let paused = crate::scheduler::controls::paused(&mut tx, &names).await?;
    let now = db_now(&mut tx).await?;
    tx.commit().await?;
    let list: Vec<Value> = rows
        .iter()
        .map(|row| {
            let next_fire = row
                .schedule()
                .ok()
                .filter(|s| s.enabled)
                .and_then(|s| s.next_after(now))
                .map(|run| run.fire_at);
            let pause = paused.iter().find(|p| p.schedule == row.name);
            json!({
                "name": row.name,
                "cron": row.cron,
                "timezone": row.timezone,
                "kind": row.kind,
                "enabled": row.enabled,
                "deadline": row.deadline,
                "next_fire": next_fire,
                "last_emitted": emitted.get(&row.name).map(|(run, _)| run),
                "state": states.remove(&row.name),
                "paused": pause.map(|p| json!({"since": p.since, "by": p.by, "note": p.note})),
            })
        })
        .collect();
    Ok(Json(json!({ "schedules": list })))
}

async fn routes(State(ui): State<Ui>) -> Answer {
    let mut tx = ui.read().await?;
    let routes = crate::relay::routes::list(&mut tx)
        .await
        .map_err(|e| UiError::Db(e.to_string()))?;
    tx.commit().await?;
    Ok(Json(json!({ "routes": routes })))
}

async fn stats(State(ui): State<Ui>) -> Answer {
    let mut tx = ui.read().await?;
    let snap = Snapshot::read(&mut tx).await?;
    tx.commit().await?;
    Ok(Json(json!(snap)))
}

async fn paused_kinds(State(ui): State<Ui>) -> Answer {
    let mut tx = ui.read().await?;
    let paused = pause::list(&mut *tx).await?;
    tx.commit().await?;
    Ok(Json(json!({ "paused": paused })))
}

#[derive(Debug, Default, Deserialize)]
struct AuditQuery {
    limit: Option<String>,
    before: Option<String>,
}

async fn audit_log(State(ui): State<Ui>, Query(aq): Query<AuditQuery>) -> Answer {
    let limit = number("limit", &aq.limit, DEFAULT_AUDIT)?;
    if !(1..=MAX_AUDIT).contains(&limit) {
        return Err(bad(format!(
            "limit={limit} is out of range; use 1 to {MAX_AUDIT}"
        )));
    }
    let before = match text(&aq.before) {
        Some(_) => Some(number("before", &aq.before, 0)?),
        None => None,
    };
    let mut tx = ui.read().await?;
    let entries = audit::list(&mut *tx, limit, before).await?;
    tx.commit().await?;
    let next_before = (entries.len() as i64 == limit)
        .then(|| entries.last().map(|e| e.id))
        .flatten();
    Ok(Json(
        json!({ "entries": entries, "next_before": next_before }),
    ))
}
