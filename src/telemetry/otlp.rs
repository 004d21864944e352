//! The OTLP/HTTP exporter: JSON-encoded `ExportTraceServiceRequest`s posted
//! to `<endpoint>/v1/traces`, in batches of up to [`ExportConfig::batch`]
//! spans, at least every [`ExportConfig::interval`]. One connection per post
//! (`Connection: close`): at most a few posts a second, so keeping
//! connections alive is not worth a parser for chunked replies. A post that
//! fails or gets no answer within 10 s drops its batch (counted); the
//! exporter never retries, so it never holds more than its queue.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::warn;

use super::{push_hex, Shared, Span, Value};
use crate::redact::redact_url;

/// Where and how spans are exported.
#[derive(Debug, Clone)]
pub struct ExportConfig {
    /// `http://host:port[/base]` (spans go to `<base>/v1/traces`), or, with
    /// [`ExportConfig::traces_path_given`], the full URL of the traces path.
    /// A `user:password@` in it is sent as HTTP basic auth; never logged.
    pub endpoint: String,
    /// The endpoint names the traces path itself
    /// (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`).
    pub traces_path_given: bool,
    /// Share of root traces sampled, 0 to 1.
    pub ratio: f64,
    /// The resource's `service.name`.
    pub service_name: String,
    /// Finished spans waiting for export; more are dropped and counted.
    pub queue: usize,
    pub batch: usize,
    pub interval: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("tracing endpoint {0}: only http:// is supported by almanac's OTLP exporter; run a local OpenTelemetry collector and point OTEL_EXPORTER_OTLP_ENDPOINT (or [tracing] otlp_endpoint) at it, e.g. http://127.0.0.1:4318")]
    Scheme(String),
    #[error("tracing endpoint {0} has no host; give http://HOST:PORT")]
    NoHost(String),
    #[error("--trace-sample-ratio (OTEL_TRACES_SAMPLER_ARG, [tracing] sample_ratio) is {0}; give a ratio from 0 to 1, e.g. 0.1")]
    Ratio(String),
}

impl ExportConfig {
    pub fn new(endpoint: impl Into<String>) -> ExportConfig {
        ExportConfig {
            endpoint: endpoint.into(),
            traces_path_given: false,
            ratio: 1.0,
            service_name: "almanac".into(),
            queue: 8192,
            batch: 512,
            interval: Duration::from_secs(1),
        }
    }
}

/// Where to post: `host:port`, the request path, the `Host` header and
/// basic auth if the URL had a user.
#[derive(Debug, Clone)]
struct Target {
    addr: String,
    path: String,
    auth: Option<String>,
}

fn target(config: &ExportConfig) -> Result<Target, ExportError> {
    let shown = redact_url(&config.endpoint);
    let Some(rest) = config.endpoint.strip_prefix("http://") else {
        return Err(ExportError::Scheme(shown));
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let (userinfo, host) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    if host.is_empty() {
        return Err(ExportError::NoHost(shown));
    }
    let addr = if host
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        host.to_string()
    } else {
        format!("{host}:80")
    };
    let path = if config.traces_path_given {
        if path.is_empty() {
            "/".to_string()
        } else {
            path.to_string()
        }
    } else {
        format!("{}/v1/traces", path.trim_end_matches('/'))
    };
    use base64::Engine as _;
    let auth = userinfo.map(|u| base64::engine::general_purpose::STANDARD.encode(u));
    Ok(Target { addr, path, auth })
}

pub(super) fn start(config: ExportConfig) -> Result<Arc<Shared>, ExportError> {
    if !(0.0..=1.0).contains(&config.ratio) {
        return Err(ExportError::Ratio(config.ratio.to_string()));
    }
    let target = target(&config)?;
    let (queue, spans) = mpsc::channel(config.queue.max(1));
    let (flush, flushes) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared::new(config.ratio, queue, flush));
    let shown = redact_url(&config.endpoint);
    tokio::spawn(export(
        Arc::downgrade(&shared),
        config,
        target,
        shown,
        spans,
        flushes,
    ));
    Ok(shared)
}

/// The exporter task; it ends when the last [`super::Tracer`] is dropped.
async fn export(
    shared: std::sync::Weak<Shared>,
    config: ExportConfig,
    target: Target,
    shown: String,
    mut spans: mpsc::Receiver<Span>,
    mut flushes: mpsc::UnboundedReceiver<oneshot::Sender<()>>,
) {
    let mut batch: Vec<Span> = Vec::with_capacity(config.batch);
    let mut warned: Option<Instant> = None;
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        let mut flushed = None;
        tokio::select! {
            n = spans.recv_many(&mut batch, config.batch) => {
                if n == 0 {
                    return;
                }
                if batch.len() < config.batch {
                    continue;
                }
            }
            request = flushes.recv() => {
                let Some(request) = request else { return };
                while batch.len() < config.batch * 64 {
                    match spans.try_recv() {
                        Ok(span) => batch.push(span),
                        Err(_) => break,
                    }
                }
                flushed = Some(request);
            }
            _ = tick.tick() => {}
        }
        for chunk in batch.chunks(config.batch) {
            let n = chunk.len() as u64;
            let body = encode(&config.service_name, chunk);
            let result = tokio::time::timeout(Duration::from_secs(10), post(&target, &body)).await;
            let Some(shared) = shared.upgrade() else {
                return;
            };
            match result {
                Ok(Ok(status)) if (200..300).contains(&status) => {
                    shared.exported.fetch_add(n, Ordering::Relaxed);
                }
                outcome => {
                    shared.dropped.fetch_add(n, Ordering::Relaxed);
                    let why = match outcome {
                        Ok(Ok(status)) => format!("HTTP status {status}"),
                        Ok(Err(e)) => e.to_string(),
                        Err(_) => "no answer within 10s".into(),
                    };
                    if warned.is_none_or(|at| at.elapsed() >= Duration::from_secs(30)) {
                        warned = Some(Instant::now());
                        warn!(endpoint = %shown, error = %redact(&why, &config.endpoint), spans = n,
                            "tracing: exporting spans failed; they are dropped (said at most every 30 s)");
                    }
                }
            }
        }
        batch.clear();
        if let Some(done) = flushed {
            let _ = done.send(());
        }
    }
}

fn redact(text: &str, url: &str) -> String {
    crate::redact::redact_in(text, url)
}

async fn post(target: &Target, body: &[u8]) -> std::io::Result<u16> {
    let mut stream = TcpStream::connect(&target.addr).await?;
    stream.set_nodelay(true)?;
    let mut head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        target.path,
        target.addr,
        body.len()
    );
    if let Some(auth) = &target.auth {
        head.push_str("Authorization: Basic ");
        head.push_str(auth);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    let mut reply = Vec::with_capacity(256);
    stream.read_to_end(&mut reply).await?;
    let line = reply.split(|b| *b == b'\n').next().unwrap_or_default();
    std::str::from_utf8(line)
        .ok()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other("the collector's reply is not HTTP"))
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Request<'a> {
    resource_spans: [ResourceSpans<'a>; 1],
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ResourceSpans<'a> {
    resource: Resource<'a>,
    scope_spans: [ScopeSpans; 1],
}

#[derive(Serialize)]
struct Resource<'a> {
    attributes: [KeyValue<'a>; 1],
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ScopeSpans {
    scope: Scope,
    spans: Vec<JsonSpan>,
}

#[derive(Serialize)]
struct Scope {
    name: &'static str,
    version: &'static str,
}

#[derive(Serialize)]
struct KeyValue<'a> {
    key: &'a str,
    value: AnyValue<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
enum AnyValue<'a> {
    StringValue(&'a str),
    /// int64 is a string in OTLP/JSON.
    IntValue(String),
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonSpan {
    trace_id: String,
    span_id: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    parent_span_id: String,
    name: &'static str,
    kind: u8,
    start_time_unix_nano: String,
    end_time_unix_nano: String,
    attributes: Vec<serde_json::Value>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    links: Vec<serde_json::Value>,
    status: serde_json::Value,
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    push_hex(&mut s, bytes);
    s
}

/// The JSON body of one post.
pub fn encode(service_name: &str, spans: &[Span]) -> Vec<u8> {
    let spans = spans
        .iter()
        .map(|s| JsonSpan {
            trace_id: hex(&s.context.trace_id),
            span_id: hex(&s.context.span_id),
            parent_span_id: s.parent_span_id.map(|p| hex(&p)).unwrap_or_default(),
            name: s.name,
            kind: s.kind as u8,
            start_time_unix_nano: s.start_unix_nanos.to_string(),
            end_time_unix_nano: s.end_unix_nanos.to_string(),
            attributes: s
                .attributes
                .iter()
                .map(|(key, value)| {
                    let value = match value {
                        Value::Str(v) => AnyValue::StringValue(v),
                        Value::Int(n) => AnyValue::IntValue(n.to_string()),
                    };
                    serde_json::to_value(KeyValue { key, value }).unwrap_or_default()
                })
                .collect(),
            links: s
                .link
                .iter()
                .map(|l| {
                    serde_json::json!({
                        "traceId": hex(&l.trace_id),
                        "spanId": hex(&l.span_id),
                        "flags": l.flags as u32 | 0x100,
                    })
                })
                .collect(),
            status: match &s.error {
                None => serde_json::json!({ "code": 1 }),
                Some(message) => serde_json::json!({ "code": 2, "message": message }),
            },
        })
        .collect();
    let request = Request {
        resource_spans: [ResourceSpans {
            resource: Resource {
                attributes: [KeyValue {
                    key: "service.name",
                    value: AnyValue::StringValue(service_name),
                }],
            },
            scope_spans: [ScopeSpans {
                scope: Scope {
                    name: "almanac",
                    version: env!("CARGO_PKG_VERSION"),
                },
                spans,
            }],
        }],
    };
    serde_json::to_vec(&request).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_become_a_target_and_https_is_refused_without_its_password() {
        let t = target(&ExportConfig::new("http://127.0.0.1:4318")).unwrap();
        assert_eq!(
            (t.addr.as_str(), t.path.as_str()),
            ("127.0.0.1:4318", "/v1/traces")
        );
        let t = target(&ExportConfig::new("http://u:pw@collector/base/")).unwrap();
        assert_eq!(
            (t.addr.as_str(), t.path.as_str()),
            ("collector:80", "/base/v1/traces")
        );
        assert_eq!(t.auth.as_deref(), Some("dTpwdw=="));
        let mut given = ExportConfig::new("http://c:4318/custom");
        given.traces_path_given = true;
        assert_eq!(target(&given).unwrap().path, "/custom");
        let err = target(&ExportConfig::new("https://u:s3cret@c:4318"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("only http://") && !err.contains("s3cret"),
            "{err}"
        );
    }
}
