//! The web dashboard `almanac run` serves at `/` on `--http-addr`: the
//! queue, paused kinds, dead letters, schedules with their run calendar,
//! routes and the audit log; and the JSON API under `/api/v1` (`api.rs`).
//!
//! Server-rendered HTML ([maud]); one small stylesheet and a few lines of
//! plain JavaScript (auto-refresh, nothing else) are compiled into the
//! binary. Every page works without JavaScript.
//!
//! **Guarantees.**
//! - *Read-only unless `--ui-actions`.* Pages are `GET`s that read inside a
//!   `READ ONLY` transaction with a 5 s `statement_timeout`. The only writes
//!   are the operator's actions (`act.rs`, shared with the API): retry one
//!   job or a dead-letter group (after a confirmation page showing how
//!   many), cancel a job, pause and resume a kind, and a schedule's pause,
//!   resume and trigger. They are `POST`s, refused with 403 and a message
//!   saying how to turn them on unless the process was started with
//!   `--ui-actions` (`ALMANAC_UI_ACTIONS`, `ui_actions` in `almanac.toml`).
//!   Without it no action form is rendered.
//! - *One audit row per action.* Each action goes through
//!   [`crate::control`], which writes its row in the action's own
//!   transaction; the actor is the basic-auth user the HTTP layer admitted
//!   ([`crate::http::AuthUser`]), never a name a request claims, or
//!   `anonymous` on loopback without auth.
//! - *CSRF.* Each process draws a random 256-bit token at start and embeds
//!   it in every action form; a `POST` whose `csrf` field does not equal it
//!   (compared in constant time) is refused with 403. Another site can make
//!   a browser send a `POST` here but cannot read a page of this origin, so
//!   it cannot learn the token; and since the dashboard sets no cookies
//!   there is no session to ride. We chose a per-process token over a
//!   double-submit cookie because it needs no cookie at all and no per-user
//!   state; the price is that a form left open across a restart must be
//!   reloaded (the message says so).
//! - *Foreign hosts.* Without basic auth (loopback only) a request whose
//!   `Host` is not a loopback name is refused with 421, so a page on another
//!   site that re-points its own name at 127.0.0.1 (DNS rebinding) cannot
//!   read the dashboard or its CSRF token. A `POST` (or any method but
//!   `GET` and `HEAD`, e.g. the API's `DELETE`) whose `Origin` (or
//!   `Sec-Fetch-Site`) says it comes from another site is refused too. With
//!   basic auth the browser holds the credentials for the dashboard's own
//!   origin only, so any `Host` is accepted.
//! - *Its own connections.* Pages use a pool of their own (2 connections,
//!   3 s to get one), so open tabs can never take the connections the
//!   reaper, janitor, relay and collector need.
//! - *Framing.* Every response forbids framing (`X-Frame-Options: DENY`,
//!   CSP `frame-ancestors 'none'`), so another site cannot overlay a retry
//!   button to steal a click; scripts and styles load from this origin only.
//! - *Auth.* The dashboard sits behind the same `--http-basic-auth` as
//!   `/metrics` (see [`crate::http`]); binding beyond loopback requires it.
//! - *Cheap queries.* No page reads done jobs in bulk: counts come from the
//!   partial indexes of unfinished and dead rows and the planner's estimate
//!   ([`crate::stats::snapshot`]); the jobs list is a keyset page on `id`
//!   that scans a bounded id range ([`crate::queue::browse`]); the calendar
//!   reads one schedule's ledger rows for its window and the statuses of
//!   their jobs by primary key. `tests/it/ui.rs` checks the plans with
//!   `EXPLAIN` on a table of done jobs.

mod act;
mod api;
mod audit;
mod dead;
mod jobs;
mod outbox;
mod overview;
mod routes;
mod schedules;
mod view;

use std::sync::Arc;

use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use sqlx::{PgPool, Postgres, Transaction};

/// How the dashboard is served.
#[derive(Debug, Clone, Copy, Default)]
pub struct UiConfig {
    /// Allow the actions: retries, schedule pause/resume/trigger (`--ui-actions`).
    pub actions: bool,
    /// Basic auth guards the dashboard, so any `Host` may be served;
    /// otherwise only loopback names are (see "Foreign hosts" above).
    pub any_host: bool,
}

#[derive(Clone)]
struct Ui {
    pool: PgPool,
    actions: bool,
    csrf: Arc<str>,
    /// Schedule runs triggered here get their spans in it.
    tracer: crate::telemetry::Tracer,
}

/// The dashboard's routes, to mount on the HTTP server.
pub fn router(pool: &PgPool, config: UiConfig) -> Router {
    router_traced(pool, config, crate::telemetry::Tracer::off())
}

/// [`router`], a run triggered from the dashboard or the API getting its
/// `almanac.schedule.run` span in `tracer`.
pub fn router_traced(pool: &PgPool, config: UiConfig, tracer: crate::telemetry::Tracer) -> Router {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(std::time::Duration::from_secs(3))
        .connect_lazy_with((*pool.connect_options()).clone());
    let ui = Ui {
        pool,
        actions: config.actions,
        csrf: new_token().into(),
        tracer,
    };
    Router::new()
        .route("/", get(overview::page))
        .route("/jobs", get(jobs::list))
        .route("/jobs/{id}", get(jobs::detail))
        .route("/jobs/{id}/retry", post(dead::retry_one))
        .route("/jobs/{id}/cancel", post(jobs::cancel))
        .route("/kinds/pause", post(overview::pause_named))
        .route("/kinds/{kind}/pause", post(overview::pause))
        .route("/kinds/{kind}/resume", post(overview::resume))
        .route("/kinds/limits", post(overview::set_limits))
        .route("/kinds/{kind}/limits/clear", post(overview::clear_limits))
        .route("/audit", get(audit::page))
        .route("/dead", get(dead::page))
        .route("/dead/retry", get(dead::confirm).post(dead::retry_all))
        .route("/schedules", get(schedules::list))
        .route("/schedules/{name}", get(schedules::detail))
        .route("/schedules/{name}/pause", post(schedules::pause))
        .route("/schedules/{name}/resume", post(schedules::resume))
        .route("/schedules/{name}/trigger", post(schedules::trigger))
        .route("/routes", get(routes::page))
        .route("/ui/style.css", get(style))
        .route("/ui/app.js", get(script))
        .nest("/api/v1", api::router())
        .layer(axum::middleware::map_response(protect))
        .layer(axum::middleware::from_fn_with_state(config, same_site))
        .with_state(ui)
}

/// Refuses requests for a foreign host name and cross-site actions (see
/// "Foreign hosts" above).
async fn same_site(
    axum::extract::State(config): axum::extract::State<UiConfig>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let api = request.uri().path().starts_with("/api/");
    if !config.any_host && !is_loopback_host(host) {
        let message = "this dashboard answers only to localhost, 127.0.0.1 or [::1]; to serve it under another name, set --http-basic-auth";
        if api {
            return api::error(StatusCode::MISDIRECTED_REQUEST, message);
        }
        return (StatusCode::MISDIRECTED_REQUEST, format!("{message}\n")).into_response();
    }
    let method = request.method();
    if method != axum::http::Method::GET && method != axum::http::Method::HEAD {
        let origin = headers.get(header::ORIGIN).and_then(|h| h.to_str().ok());
        let fetch_site = headers.get("sec-fetch-site").and_then(|h| h.to_str().ok());
        let foreign_origin =
            origin.is_some_and(|o| o.split_once("://").map(|(_, rest)| rest) != Some(host));
        let foreign_fetch = fetch_site.is_some_and(|f| f != "same-origin" && f != "none");
        if foreign_origin || foreign_fetch {
            let refusal = UiError::Forbidden(
                "This action was sent from another site; submit it from the dashboard's own page."
                    .into(),
            );
            if api {
                return api::ApiError(refusal).into_response();
            }
            return refusal.into_response();
        }
    }
    next.run(request).await
}

/// `localhost`, `127.x.x.x` or `[::1]`, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

async fn protect(mut response: Response) -> Response {
    use axum::http::HeaderValue;
    let headers = response.headers_mut();
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
        ),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn new_token() -> String {
    use rand::RngCore as _;
    let mut bytes = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Ui {
    /// A read-only transaction with a statement deadline, for one page.
    async fn read(&self) -> Result<Transaction<'static, Postgres>, UiError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION READ ONLY")
            .execute(&mut *tx)
            .await?;
        sqlx::query("SET LOCAL statement_timeout = '5s'")
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }

    /// Admits an action: refused unless `--ui-actions` and the form carries
    /// this process's CSRF token.
    fn admit(&self, token: Option<&str>) -> Result<(), UiError> {
        if !self.actions {
            return Err(UiError::Forbidden(ACTIONS_OFF.into()));
        }
        let given = token.unwrap_or("").as_bytes();
        let ours = self.csrf.as_bytes();
        let same = given.len() == ours.len()
            && given.iter().zip(ours).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0;
        if !same {
            return Err(UiError::Forbidden(
                "The form's CSRF token does not match this almanac process (it changes at every start). Reload the page and submit again.".into(),
            ));
        }
        Ok(())
    }
}

const ACTIONS_OFF: &str = "Actions are off: this dashboard is read-only. Start `almanac run` with --ui-actions (or ALMANAC_UI_ACTIONS=true, or ui_actions = true in almanac.toml) to retry and cancel jobs, pause and resume kinds, set and clear their limits and pause, resume or trigger schedules from here or through /api/v1, or use `almanac jobs retry|cancel ID`, `almanac kinds pause|resume KIND`, `almanac limits set|clear KIND` and `almanac schedules pause|resume|trigger NAME`.";

/// What a page or an action can fail with; shown as a page with its status.
#[derive(Debug, thiserror::Error)]
enum UiError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Forbidden(String),
    /// The target is in a state the action does not apply to.
    #[error("{0}")]
    Conflict(String),
    #[error("database error: {0}")]
    Db(String),
}

impl From<sqlx::Error> for UiError {
    fn from(err: sqlx::Error) -> Self {
        UiError::Db(err.to_string())
    }
}

impl From<crate::queue::QueueError> for UiError {
    fn from(err: crate::queue::QueueError) -> Self {
        use crate::queue::QueueError;
        match err {
            QueueError::NotFound(id) => UiError::NotFound(format!("no job with id {id}")),
            QueueError::WrongStatus { .. } | QueueError::Superseded { .. } => {
                UiError::Conflict(err.to_string())
            }
            QueueError::Invalid(_) => UiError::BadRequest(err.to_string()),
            QueueError::Db(err) => err.into(),
        }
    }
}

impl From<crate::scheduler::ledger::LedgerError> for UiError {
    fn from(err: crate::scheduler::ledger::LedgerError) -> Self {
        UiError::Db(err.to_string())
    }
}

impl From<crate::scheduler::backfill::BackfillError> for UiError {
    fn from(err: crate::scheduler::backfill::BackfillError) -> Self {
        UiError::Db(err.to_string())
    }
}

impl UiError {
    fn status(&self) -> StatusCode {
        match self {
            UiError::NotFound(_) => StatusCode::NOT_FOUND,
            UiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            UiError::Forbidden(_) => StatusCode::FORBIDDEN,
            UiError::Conflict(_) => StatusCode::CONFLICT,
            UiError::Db(message) => {
                tracing::error!(error = %message, "dashboard or API request failed");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }
}

impl IntoResponse for UiError {
    fn into_response(self) -> Response {
        let title = match &self {
            UiError::NotFound(_) => "Not found",
            UiError::BadRequest(_) | UiError::Conflict(_) => "Cannot do that",
            UiError::Forbidden(_) => "Refused",
            UiError::Db(_) => "Database error",
        };
        let status = self.status();
        let body = maud::html! {
            p #error-message .error { (self.to_string()) }
            p { a href="/" { "Back to the overview" } }
        };
        (
            status,
            Html(view::layout(title, "", false, body).into_string()),
        )
            .into_response()
    }
}

type Page = Result<Html<String>, UiError>;

async fn style() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("style.css"),
    )
}

async fn script() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("app.js"),
    )
}
