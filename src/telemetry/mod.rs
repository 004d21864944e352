//! One trace per job: W3C trace context and OpenTelemetry spans, exported by
//! OTLP/HTTP (JSON) when configured. See `docs/tracing.md`.
//!
//! - **Off by default, no cost when off.** A [`Tracer`] is an
//!   `Option<Arc<_>>`; [`Tracer::off`] is `None`, and every span site asks
//!   [`Tracer::start`], which returns `None` before building anything: no
//!   span object, no allocation, no clock read on the hot path. What a job
//!   carries (its stored `traceparent`) is still passed on as it is: to the
//!   broker (an outbox header) and to a command (`TRACEPARENT`).
//! - **Spans.** `almanac.schedule.run` (one per logical run a scheduler
//!   records; its emitted job stores the span's `traceparent`),
//!   `almanac.publish` (producer, one per outbox row the relay publishes,
//!   child of the job's `traceparent`; the message's `traceparent` header
//!   is the publish span's), `almanac.execute` (consumer, one per attempt a
//!   worker or broker consumer runs: the first attempt is a child of the
//!   message's publish span, or of the job's `traceparent` when claimed from
//!   PostgreSQL; a retry, `attempt > 1`, starts a new trace with a *link* to
//!   the job's `traceparent`).
//! - **Sampling** is parent-based: a child follows its parent's sampled flag,
//!   a retry its link's; a root (a job enqueued without a `traceparent`, a
//!   schedule's run) is sampled when its trace id falls under the ratio
//!   (`OTEL_TRACES_SAMPLER_ARG`, default 1.0), as OpenTelemetry's
//!   `TraceIdRatioBased` does. An unsampled span still hands its context on
//!   (flags `00`), so the trace stays whole downstream; it is not exported.
//! - **Export** ([`otlp`]): finished spans go into a bounded queue
//!   ([`ExportConfig::queue`], 32,768) with `try_send`; a full queue drops the
//!   span and counts it ([`TracerReport::dropped`]): a slow or absent
//!   collector never blocks or slows a job beyond that. One task posts
//!   batches of up to 512 spans, at least every second, over HTTP/1.1; a
//!   failed post drops its batch (counted, warned at most every 30 s, the
//!   endpoint's password never shown).
//! - **Why in-house, not the `opentelemetry` crates.** The crates
//!   (`opentelemetry`, `_sdk`, `-otlp` with `reqwest` or `tonic`) add dozens
//!   of crates and minutes of build on the 2-core machines this project
//!   builds on, and their batch processor is a thread or a task plus a
//!   global provider that tests in one process share. What almanac needs is
//!   small: three span names, ids, a ratio, one JSON encoding and a POST.
//!   The cost is that only `http://` endpoints are supported (TLS: put a
//!   local collector in front) and only the JSON encoding (every collector
//!   accepts it on `/v1/traces`).
//! - **Nothing secret reaches a span:** attributes are ids, kinds, attempt
//!   numbers, destinations and schedule names; never payloads, URLs or
//!   errors' text beyond the outcome's name.

pub mod otlp;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::RngCore;
use tokio::sync::mpsc;

pub use otlp::{ExportConfig, ExportError};

/// The environment variable a command gets the execution span's context in.
pub const TRACEPARENT_ENV: &str = "TRACEPARENT";

/// The outbox and message header carrying the W3C trace context.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// A W3C trace context (`traceparent`): version `00` is written; any
/// version but `ff` is read in its first four fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

impl TraceContext {
    /// Parses a `traceparent` header; `None` if it is not one (wrong shape,
    /// upper-case hex, all-zero ids, version `ff`).
    pub fn parse(header: &str) -> Option<TraceContext> {
        let b = header.as_bytes();
        if b.len() < 55 || (b.len() > 55 && b[55] != b'-') {
            return None;
        }
        if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        let version = hex_byte(&b[0..2])?;
        if version == 0xff || (version == 0 && b.len() != 55) {
            return None;
        }
        let mut trace_id = [0u8; 16];
        for (i, out) in trace_id.iter_mut().enumerate() {
            *out = hex_byte(&b[3 + 2 * i..5 + 2 * i])?;
        }
        let mut span_id = [0u8; 8];
        for (i, out) in span_id.iter_mut().enumerate() {
            *out = hex_byte(&b[36 + 2 * i..38 + 2 * i])?;
        }
        let flags = hex_byte(&b[53..55])?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext {
            trace_id,
            span_id,
            flags,
        })
    }

    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The `traceparent` header: `00-<trace id>-<span id>-<flags>`.
    pub fn header(&self) -> String {
        let mut s = String::with_capacity(55);
        s.push_str("00-");
        push_hex(&mut s, &self.trace_id);
        s.push('-');
        push_hex(&mut s, &self.span_id);
        s.push('-');
        push_hex(&mut s, &[self.flags]);
        s
    }
}

fn hex_byte(pair: &[u8]) -> Option<u8> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    Some(digit(pair[0])? << 4 | digit(pair[1])?)
}

pub(crate) fn push_hex(s: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
}

/// Where a span sits in its trace.
#[derive(Debug, Clone, Copy)]
pub enum Parent {
    /// A child of this context (same trace).
    Child(TraceContext),
    /// A new trace.
    Root,
    /// A new trace, linked to this context (a retry's execution).
    Linked(TraceContext),
}

/// OTLP span kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Producer = 4,
    Consumer = 5,
}

/// An attribute value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Str(String),
    /// A constant: an outcome's or a system's name (nothing allocated).
    Static(&'static str),
    Int(i64),
}

/// A span in progress; [`Tracer::end`] finishes and exports it.
#[derive(Debug)]
pub struct Span {
    pub context: TraceContext,
    pub parent_span_id: Option<[u8; 8]>,
    pub link: Option<TraceContext>,
    pub name: &'static str,
    pub kind: SpanKind,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    pub attributes: Vec<(&'static str, Value)>,
    /// `Some(message)` marks the span an error.
    pub error: Option<String>,
}

impl Span {
    /// Its context as a `traceparent` header, for whatever runs inside it.
    pub fn traceparent(&self) -> String {
        self.context.header()
    }

    /// Adds an attribute (kept only when the span is sampled).
    pub fn attr(&mut self, key: &'static str, value: impl Into<Value>) {
        if self.context.sampled() {
            self.attributes.push((key, value.into()));
        }
    }

    /// Marks the span failed with `message` (an outcome's name, never a secret).
    pub fn fail(&mut self, message: impl Into<String>) {
        self.error = Some(message.into());
    }
}

impl From<&'static str> for Value {
    fn from(s: &'static str) -> Value {
        Value::Static(s)
    }
}
impl From<String> for Value {
    fn from(s: String) -> Value {
        Value::Str(s)
    }
}
impl From<i64> for Value {
    fn from(n: i64) -> Value {
        Value::Int(n)
    }
}
impl From<i32> for Value {
    fn from(n: i32) -> Value {
        Value::Int(n.into())
    }
}

/// Spans exported and dropped so far.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TracerReport {
    /// Spans the collector accepted.
    pub exported: u64,
    /// Spans dropped: the queue was full, or their batch's post failed.
    pub dropped: u64,
}

pub(crate) struct Shared {
    /// A root is sampled when the low 8 bytes of its trace id are below this.
    threshold: u64,
    always: bool,
    queue: mpsc::Sender<Span>,
    pub(crate) exported: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) flush: mpsc::UnboundedSender<tokio::sync::oneshot::Sender<()>>,
}

/// Starts and exports spans; cheap to clone. [`Tracer::off`] (the default)
/// does nothing and costs a pointer test.
#[derive(Clone, Default)]
pub struct Tracer(Option<Arc<Shared>>);

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_on() {
            "Tracer(on)"
        } else {
            "Tracer(off)"
        })
    }
}

impl Tracer {
    pub const fn off() -> Tracer {
        Tracer(None)
    }

    /// Exports to `config`'s endpoint from a task on the current runtime.
    pub fn otlp(config: ExportConfig) -> Result<Tracer, ExportError> {
        otlp::start(config).map(|shared| Tracer(Some(shared)))
    }

    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Starts a span now; `None` when tracing is off.
    pub fn start(&self, name: &'static str, kind: SpanKind, parent: Parent) -> Option<Span> {
        let shared = self.0.as_ref()?;
        let mut rng = rand::thread_rng();
        let mut span_id = [0u8; 8];
        while span_id == [0; 8] {
            rng.fill_bytes(&mut span_id);
        }
        let new_trace = |rng: &mut rand::rngs::ThreadRng| {
            let mut id = [0u8; 16];
            while id == [0; 16] {
                rng.fill_bytes(&mut id);
            }
            id
        };
        let (trace_id, parent_span_id, link, sampled) = match parent {
            Parent::Child(p) => (p.trace_id, Some(p.span_id), None, p.sampled()),
            Parent::Linked(l) => (new_trace(&mut rng), None, Some(l), l.sampled()),
            Parent::Root => {
                let id = new_trace(&mut rng);
                (id, None, None, shared.samples(&id))
            }
        };
        Some(Span {
            context: TraceContext {
                trace_id,
                span_id,
                flags: u8::from(sampled),
            },
            parent_span_id,
            link,
            name,
            kind,
            start_unix_nanos: unix_nanos(),
            end_unix_nanos: 0,
            attributes: Vec::with_capacity(if sampled { 6 } else { 0 }),
            error: None,
        })
    }

    /// Ends `span` now and queues it for export if sampled; never waits.
    pub fn end(&self, mut span: Span) {
        let Some(shared) = &self.0 else { return };
        if !span.context.sampled() {
            return;
        }
        span.end_unix_nanos = unix_nanos().max(span.start_unix_nanos);
        if shared.queue.try_send(span).is_err() {
            shared.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Posts every span queued so far and waits for that (a clean
    /// shutdown calls it); returns at once when off.
    pub async fn flush(&self) {
        let Some(shared) = &self.0 else { return };
        let (tx, rx) = tokio::sync::oneshot::channel();
        if shared.flush.send(tx).is_ok() {
            let _ = rx.await;
        }
    }

    pub fn report(&self) -> TracerReport {
        self.0
            .as_ref()
            .map_or_else(TracerReport::default, |s| TracerReport {
                exported: s.exported.load(Ordering::Relaxed),
                dropped: s.dropped.load(Ordering::Relaxed),
            })
    }
}

impl Shared {
    pub(crate) fn new(
        ratio: f64,
        queue: mpsc::Sender<Span>,
        flush: mpsc::UnboundedSender<tokio::sync::oneshot::Sender<()>>,
    ) -> Shared {
        let ratio = ratio.clamp(0.0, 1.0);
        Shared {
            threshold: (ratio * u64::MAX as f64) as u64,
            always: ratio >= 1.0,
            queue,
            exported: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            flush,
        }
    }

    fn samples(&self, trace_id: &[u8; 16]) -> bool {
        let low = u64::from_be_bytes(trace_id[8..].try_into().expect("8 bytes"));
        self.always || low < self.threshold
    }
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_round_trips_and_bad_ones_are_refused() {
        let ctx = TraceContext::parse(TP).expect("valid");
        assert!(ctx.sampled());
        assert_eq!(ctx.header(), TP);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
        }
        // A later version may carry more fields; its first four are read.
        assert!(TraceContext::parse(&format!("01{}-later", &TP[2..])).is_some());
    }

    #[test]
    fn off_builds_nothing() {
        let off = Tracer::off();
        assert!(off.start("x", SpanKind::Internal, Parent::Root).is_none());
        assert_eq!(off.report(), TracerReport::default());
    }

    #[tokio::test]
    async fn children_keep_the_trace_and_follow_the_parent_s_sampling() {
        let (tx, _rx) = mpsc::channel(8);
        let (flush, _) = mpsc::unbounded_channel();
        let tracer = Tracer(Some(Arc::new(Shared::new(0.0, tx, flush))));
        let parent = TraceContext::parse(TP).unwrap();
        let child = tracer
            .start("c", SpanKind::Consumer, Parent::Child(parent))
            .unwrap();
        assert_eq!(child.context.trace_id, parent.trace_id);
        assert_eq!(child.parent_span_id, Some(parent.span_id));
        assert_ne!(child.context.span_id, parent.span_id);
        assert!(
            child.context.sampled(),
            "a sampled parent's child is sampled"
        );
        let retry = tracer
            .start("r", SpanKind::Consumer, Parent::Linked(parent))
            .unwrap();
        assert_ne!(retry.context.trace_id, parent.trace_id);
        assert_eq!(retry.link, Some(parent));
        assert_eq!(retry.parent_span_id, None);
        let root = tracer.start("s", SpanKind::Internal, Parent::Root).unwrap();
        assert!(!root.context.sampled(), "ratio 0 samples no root");
    }

    #[test]
    fn the_ratio_samples_about_its_share_of_roots() {
        let (tx, _rx) = mpsc::channel(8);
        let (flush, _) = mpsc::unbounded_channel();
        let shared = Shared::new(0.25, tx, flush);
        let mut rng = rand::thread_rng();
        let sampled = (0..10_000)
            .filter(|_| {
                let mut id = [0u8; 16];
                rng.fill_bytes(&mut id);
                shared.samples(&id)
            })
            .count();
        assert!((2_000..3_000).contains(&sampled), "{sampled} of 10,000");
    }
}
