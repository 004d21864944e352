//! The process's HTTP endpoint (axum): `/healthz`, `/readyz`, `/metrics`; the
//! dashboard mounts on the same server.
//!
//! - `/healthz` answers 200 while the process runs: a liveness probe.
//! - `/readyz` answers 200 only when the database answers and has every
//!   migration this binary embeds, else 503 with a one-line reason. It uses a
//!   connection of its own under a 2 s deadline, so a saturated pool or a
//!   frozen network reads as "not ready", never as a hung probe.
//! - `/metrics` renders [`crate::metrics`] in the Prometheus text format.
//!
//! **Exposure.** The default address is loopback. Binding anywhere else
//! requires HTTP basic auth (`--http-basic-auth USER:PASSWORD`, best given as
//! `ALMANAC_HTTP_BASIC_AUTH`), which then guards everything but the two
//! probes. The credentials are never logged.

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

pub use crate::config::HttpAddr;

/// `USER:PASSWORD` for HTTP basic auth; `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct BasicAuth {
    user: String,
    password: String,
}

impl std::fmt::Debug for BasicAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BasicAuth({}:***)", self.user)
    }
}

impl FromStr for BasicAuth {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            Some((user, password)) if !user.is_empty() && !password.is_empty() => Ok(BasicAuth {
                user: user.to_string(),
                password: password.to_string(),
            }),
            _ => Err("expected USER:PASSWORD, both non-empty".to_string()),
        }
    }
}

impl BasicAuth {
    fn admits(&self, headers: &HeaderMap) -> bool {
        use base64::Engine as _;
        let Some(value) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        else {
            return false;
        };
        let Some(encoded) = value.strip_prefix("Basic ") else {
            return false;
        };
        let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(encoded.trim()) else {
            return false;
        };
        let expected = format!("{}:{}", self.user, self.password);
        constant_time_eq(&decoded, expected.as_bytes())
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot listen on --http-addr {addr}: {source}; pick a free address with --http-addr (or ALMANAC_HTTP_ADDR), or `off`")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("--http-addr {addr} is reachable beyond this machine; set --http-basic-auth USER:PASSWORD (or ALMANAC_HTTP_BASIC_AUTH) to expose it, or listen on 127.0.0.1")]
    NeedsAuth { addr: SocketAddr },
    #[error("the HTTP server failed: {0}")]
    Serve(#[source] std::io::Error),
}

/// A bound, not yet serving, HTTP endpoint: binding happens before any role
/// starts, so a taken port fails the start with the flag named.
pub struct HttpServer {
    listener: TcpListener,
    router: Router,
    auth: Option<Arc<BasicAuth>>,
    metrics: Metrics,
}

#[derive(Clone)]
struct AppState {
    probe: PgPool,
}

impl HttpServer {
    /// Binds `addr`; `database` is where `/readyz` looks.
    pub async fn bind(
        addr: SocketAddr,
        auth: Option<BasicAuth>,
        database: &PgConnectOptions,
    ) -> Result<HttpServer, HttpError> {
        if !addr.ip().is_loopback() && auth.is_none() {
            return Err(HttpError::NeedsAuth { addr });
        }
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| HttpError::Bind { addr, source })?;
        let probe = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(PROBE_DEADLINE)
            .connect_lazy_with(database.clone().application_name("almanac-readyz"));
        let auth = auth.map(Arc::new);
        let router = Router::new()
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .with_state(AppState { probe });
        Ok(HttpServer {
            listener,
            router,
            auth,
            metrics: Metrics::new(),
        })
    }

    /// Renders `metrics` at `/metrics`: the handle the process gave its
    /// roles (by default, an empty registry of its own).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Whether basic auth guards `/metrics` and what is mounted.
    pub fn has_auth(&self) -> bool {
        self.auth.is_some()
    }

    /// Adds `routes` (the dashboard) behind the same basic auth as `/metrics`.
    pub fn mount(mut self, routes: Router) -> HttpServer {
        self.router = self.router.merge(guard(routes, &self.auth));
        self
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until `shutdown` is cancelled.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), HttpError> {
        tracing::info!(addr = %self.local_addr(), "HTTP endpoint listening");
        let scrape = Router::new()
            .route("/metrics", get(render))
            .with_state(self.metrics);
        let router = self.router.merge(guard(scrape, &self.auth));
        let serving = axum::serve(self.listener, router)
            .with_graceful_shutdown(shutdown.clone().cancelled_owned());
        // Open connections get a moment to finish after the stop request; a
        // client that never completes its request cannot hold the process.
        let drained = async {
            shutdown.cancelled().await;
            tokio::time::sleep(DRAIN).await;
        };
        tokio::select! {
            served = serving => served.map_err(HttpError::Serve),
            _ = drained => Ok(()),
        }
    }
}

fn guard<S: Clone + Send + Sync + 'static>(
    routes: Router<S>,
    auth: &Option<Arc<BasicAuth>>,
) -> Router<S> {
    match auth {
        Some(auth) => routes.layer(middleware::from_fn_with_state(auth.clone(), require_auth)),
        None => routes,
    }
}

const PROBE_DEADLINE: Duration = Duration::from_secs(2);
const DRAIN: Duration = Duration::from_secs(3);

async fn require_auth(
    State(auth): State<Arc<BasicAuth>>,
    request: Request,
    next: Next,
) -> Response {
    let mut request = request;
    if auth.admits(request.headers()) {
        // The handlers learn who acts from here, never from a header they
        // would have to trust.
        request.extensions_mut().insert(AuthUser(auth.user.clone()));
        return next.run(request).await;
    }
    let challenge = [(header::WWW_AUTHENTICATE, "Basic realm=\"almanac\"")];
    if request.uri().path().starts_with("/api/") {
        let body = axum::Json(
            serde_json::json!({"error": "authentication required: send HTTP basic auth (--http-basic-auth)"}),
        );
        return (StatusCode::UNAUTHORIZED, challenge, body).into_response();
    }
    (
        StatusCode::UNAUTHORIZED,
        challenge,
        "authentication required\n",
    )
        .into_response()
}

/// The basic-auth user a request was admitted as (a request extension set
/// by the auth guard; absent when no auth is configured).
#[derive(Debug, Clone)]
pub struct AuthUser(pub String);

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<AppState>) -> Response {
    match tokio::time::timeout(PROBE_DEADLINE, ready(&state.probe)).await {
        Ok(Ok(())) => (StatusCode::OK, "ready\n".to_string()).into_response(),
        Ok(Err(reason)) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")).into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the database did not answer within {}s\n",
                PROBE_DEADLINE.as_secs()
            ),
        )
            .into_response(),
    }
}

/// `Ok` when the database answers and has every embedded migration; else a
/// one-line reason a person can act on (never a URL or password).
async fn ready(probe: &PgPool) -> Result<(), String> {
    let state = crate::db::schema::state(probe).await.map_err(|err| {
        let first = err.to_string();
        format!(
            "the database does not answer: {}",
            first.lines().next().unwrap_or("")
        )
    })?;
    state.problem().map_or(Ok(()), Err)
}

async fn render(State(metrics): State<Metrics>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.render(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_or_say_what_to_write() {
        assert_eq!("off".parse::<HttpAddr>(), Ok(HttpAddr::OFF));
        assert_eq!(
            "127.0.0.1:9797".parse::<HttpAddr>(),
            Ok(HttpAddr::RUN_DEFAULT)
        );
        let err = "localhost:99999".parse::<HttpAddr>().unwrap_err();
        assert!(err.contains("`localhost:99999` is not an address"), "{err}");
    }

    #[test]
    fn basic_auth_hides_its_password() {
        let auth: BasicAuth = "ops:s3cret".parse().unwrap();
        assert!(!format!("{auth:?}").contains("s3cret"));
        assert!("ops".parse::<BasicAuth>().is_err());
        assert!(":x".parse::<BasicAuth>().is_err());
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            "Basic b3BzOnMzY3JldA==".parse().unwrap(),
        );
        assert!(auth.admits(&headers));
        headers.insert(header::AUTHORIZATION, "Basic b3BzOndyb25n".parse().unwrap());
        assert!(!auth.admits(&headers));
    }
}
