//! `almanac bench`'s tracing figures (issue #24 item 3): the worker
//! runtime (default settings) burning down `--jobs` no-op jobs, each
//! carrying a `traceparent`, with tracing off (no tracer, as `almanac work`
//! runs without an endpoint) and with every span sampled and exported by
//! OTLP/HTTP to a receiver in this process (an axum server on 127.0.0.1:0
//! that parses each post's JSON and counts its spans: [`Post`]), side by
//! side.
//!
//! The runs take turns in [`ROUNDS`] pairs, each on a refilled and vacuumed
//! table, and each figure is the median of its rates; the ratio is the
//! median of the pairs' ratios, so a slow spell of the shared machine
//! falls on both runs of a pair. The receiver runs on the same cores as
//! the worker and the database: what it costs is counted against tracing,
//! a pessimistic figure beside a collector on another host.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;

use super::{burn_with, fill_with, median, vacuum};
use crate::telemetry::{ExportConfig, Tracer};
use crate::worker::WorkerConfig;

/// Pairs of burn-downs (off, then on).
const ROUNDS: usize = 3;

#[derive(Debug, Serialize)]
pub struct Report {
    pub off_jobs_per_s: f64,
    pub on_jobs_per_s: f64,
    /// Median of the pairs' on / off.
    pub ratio: f64,
    /// Spans the receiver decoded over all traced runs.
    pub spans_received: u64,
    /// Spans the exporter dropped (queue full or a failed post).
    pub spans_dropped: u64,
}

/// An OTLP/HTTP JSON post as the receiver reads it: the whole body is
/// parsed and checked, each span skipped over without being built (a
/// collector's decoding is not almanac's cost: building every span as a
/// `serde_json::Value` took about 6 µs a span on these cores, more than
/// almanac's own work for it).
#[derive(serde::Deserialize)]
struct Post {
    #[serde(rename = "resourceSpans")]
    resource_spans: Vec<ResourceSpans>,
}

#[derive(serde::Deserialize)]
struct ResourceSpans {
    #[serde(rename = "scopeSpans")]
    scope_spans: Vec<ScopeSpans>,
}

#[derive(serde::Deserialize)]
struct ScopeSpans {
    spans: Vec<serde::de::IgnoredAny>,
}

impl Post {
    fn spans(&self) -> usize {
        self.resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum()
    }
}

/// The receiver: counts the spans of every post it parses.
async fn receiver() -> anyhow::Result<(String, Arc<AtomicU64>)> {
    let received = Arc::new(AtomicU64::new(0));
    let counter = received.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let counter = counter.clone();
            async move {
                let spans = serde_json::from_slice::<Post>(&body).map_or(0, |post| post.spans());
                counter.fetch_add(spans as u64, Ordering::Relaxed);
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((format!("http://{addr}"), received))
}

/// `n` due jobs, each with a traceparent of its own.
async fn fill_traced(pool: &PgPool, n: u64) -> anyhow::Result<()> {
    fill_with(
        pool,
        n,
        "jsonb_build_object('customer', g)",
        "'00-' || md5(g::text) || '-' || left(md5('s' || g), 16) || '-01'",
    )
    .await
}

pub async fn measure(pool: &PgPool, jobs: u64) -> anyhow::Result<Report> {
    let (endpoint, received) = receiver().await?;
    let tracer = Tracer::otlp(ExportConfig::new(endpoint))?;
    let (mut offs, mut ons, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        vacuum(pool).await?;
        fill_traced(pool, jobs).await?;
        let off = burn_with(pool, WorkerConfig::default(), jobs, Tracer::off()).await?;
        vacuum(pool).await?;
        fill_traced(pool, jobs).await?;
        let on = burn_with(pool, WorkerConfig::default(), jobs, tracer.clone()).await?;
        // The spans still queued go out between runs, not during the next.
        tokio::time::timeout(Duration::from_secs(30), tracer.flush()).await?;
        eprintln!(
            "tracing pair {}: off {off:.0} jobs/s, on {on:.0} jobs/s ({:.2})",
            round + 1,
            on / off
        );
        offs.push(off);
        ons.push(on);
        ratios.push(on / off);
    }
    let report = Report {
        off_jobs_per_s: median(&mut offs),
        on_jobs_per_s: median(&mut ons),
        ratio: median(&mut ratios),
        spans_received: received.load(Ordering::Relaxed),
        spans_dropped: tracer.report().dropped,
    };
    Ok(report)
}

pub fn print_table(r: &Report) {
    println!();
    println!("{:<44} {:>14}", "tracing (median of 3 pairs)", "jobs/s");
    println!(
        "{:<44} {:>14.0}",
        "worker runtime, tracing off", r.off_jobs_per_s
    );
    println!(
        "{:<44} {:>14.0}  ({:.2} of off, pairwise median)",
        "worker runtime, every span exported (OTLP)", r.on_jobs_per_s, r.ratio
    );
    println!(
        "spans received by the in-process OTLP receiver: {}, dropped by the exporter: {}",
        r.spans_received, r.spans_dropped
    );
}
