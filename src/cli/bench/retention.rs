//! `almanac bench --retention-only`: whether retention keeps up with a
//! queue that finishes `--retention-rate` jobs a second (10,000) for
//! `--retention-minutes` (30), as issue #26 asks. Jobs are inserted at that
//! rate (one `INSERT ... SELECT` every 100 ms), the default worker runs
//! them, and the default janitor deletes done jobs with a retention of
//! [`RETENTION`] (seven days cannot be waited for). Every [`SAMPLE`] it
//! records: jobs finished a second, done jobs past their retention and how
//! long the oldest has been (the goal: gone within a minute of coming due),
//! the table's dead and live tuples and size, and the enqueue-to-start
//! latency (p50, p99) of the jobs started in the window (the goal: no
//! drift). Autovacuum runs as the database is configured.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{vacuum, KIND};
use crate::maintenance::janitor::{Janitor, JanitorConfig};
use crate::role::{Role, Settings};
use crate::worker::{JobContext, Worker, WorkerConfig};

/// The done jobs' retention in this run.
pub const RETENTION: Duration = Duration::from_secs(60);
/// How often a sample is taken.
const SAMPLE: Duration = Duration::from_secs(10);
/// How often jobs are inserted.
const TICK: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, clap::Args)]
pub struct RetentionArgs {
    /// `--retention-only`: minutes of sustained load.
    #[arg(long, default_value_t = 30.0)]
    retention_minutes: f64,
    /// `--retention-only`: jobs inserted (and to be finished) a second.
    #[arg(long, default_value_t = 10_000)]
    retention_rate: u64,
}

#[derive(Debug, Serialize)]
pub struct Sample {
    pub at_s: f64,
    pub finished_per_s: f64,
    /// Ready and running jobs: the backlog the worker has not finished.
    pub unfinished: i64,
    /// Done jobs past their retention, not deleted yet.
    pub past_retention: i64,
    /// How long the oldest of them has been past it.
    pub oldest_past_retention_s: f64,
    pub dead_tuples: i64,
    pub live_tuples: i64,
    pub table_mb: f64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub minutes: f64,
    pub rate: u64,
    pub retention_s: u64,
    pub samples: Vec<Sample>,
    /// The worst `oldest_past_retention_s` of any sample.
    pub worst_past_retention_s: f64,
    pub max_dead_tuples: i64,
    /// Latency p99 of the last sample over that of the first full one.
    pub latency_p99_drift: f64,
    pub finished_per_s: f64,
}

pub async fn measure(pool: &PgPool, args: &RetentionArgs) -> anyhow::Result<Report> {
    anyhow::ensure!(
        args.retention_minutes > 0.0 && args.retention_minutes <= 10_080.0,
        "--retention-minutes must be above 0 and at most 10080 (a week; got {})",
        args.retention_minutes
    );
    anyhow::ensure!(
        args.retention_rate > 0,
        "--retention-rate must be at least 1"
    );
    vacuum(pool).await?;
    let latencies = Arc::new(Mutex::new(Vec::<f64>::new()));
    let finished = Arc::new(AtomicU64::new(0));
    let (seen, count) = (latencies.clone(), finished.clone());
    let worker = Worker::new(pool.clone(), WorkerConfig::default().validated()?).register(
        KIND,
        move |ctx: JobContext| {
            let waited = (chrono::Utc::now() - ctx.job.created_at).num_microseconds();
            seen.lock()
                .unwrap()
                .push(waited.unwrap_or(0) as f64 / 1000.0);
            count.fetch_add(1, Ordering::Relaxed);
            async { Ok(()) }
        },
    );
    let janitor = Janitor::new(
        pool.clone(),
        JanitorConfig {
            done_retention: RETENTION,
            ..JanitorConfig::default()
        }
        .validated()?,
    );
    let stop = CancellationToken::new();
    let worker = tokio::spawn(worker.run(stop.clone()));
    let janitor = tokio::spawn(janitor.run(stop.clone()));
    let result = drive(pool, args, &latencies, &finished).await;
    stop.cancel();
    worker
        .await?
        .map_err(|e| anyhow::anyhow!("the worker failed: {e}"))?;
    janitor
        .await?
        .map_err(|e| anyhow::anyhow!("the janitor failed: {e}"))?;
    let samples = result?;
    let first = samples.iter().find(|s| s.latency_p99_ms > 0.0);
    let last = samples.iter().rev().find(|s| s.latency_p99_ms > 0.0);
    let drift = match (first, last) {
        (Some(f), Some(l)) => l.latency_p99_ms / f.latency_p99_ms,
        _ => 0.0,
    };
    let elapsed = samples.last().map(|s| s.at_s).unwrap_or(0.0);
    Ok(Report {
        minutes: args.retention_minutes,
        rate: args.retention_rate,
        retention_s: RETENTION.as_secs(),
        worst_past_retention_s: samples
            .iter()
            .map(|s| s.oldest_past_retention_s)
            .fold(0.0, f64::max),
        max_dead_tuples: samples.iter().map(|s| s.dead_tuples).max().unwrap_or(0),
        latency_p99_drift: drift,
        finished_per_s: finished.load(Ordering::Relaxed) as f64 / elapsed.max(1e-9),
        samples,
    })
}

/// Inserts at the rate and samples, until the minutes are over.
async fn drive(
    pool: &PgPool,
    args: &RetentionArgs,
    latencies: &Mutex<Vec<f64>>,
    finished: &AtomicU64,
) -> anyhow::Result<Vec<Sample>> {
    let started = Instant::now();
    let length = Duration::from_secs_f64(args.retention_minutes * 60.0);
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut inserted = 0u64;
    let mut samples = Vec::new();
    let mut last_sample = (Instant::now(), 0u64);
    // Ctrl-C ends the run early: what was sampled is reported, and the
    // scratch database is dropped as after a full run.
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    while started.elapsed() < length {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = &mut interrupted => {
                eprintln!("interrupted: reporting the samples so far");
                break;
            }
        }
        // Behind schedule (a slow insert), the next insert catches up.
        let due = (started.elapsed().as_secs_f64() * args.retention_rate as f64) as u64;
        let n = due.saturating_sub(inserted);
        if n > 0 {
            sqlx::query(
                "WITH ins AS (INSERT INTO almanac.jobs (kind) \
                 SELECT $1 FROM generate_series(1, $2) RETURNING 1) \
                 SELECT pg_notify('almanac_jobs', $1) WHERE EXISTS (SELECT 1 FROM ins)",
            )
            .bind(KIND)
            .bind(n as i64)
            .execute(pool)
            .await
            .context("inserting the load")?;
            inserted += n;
        }
        if last_sample.0.elapsed() >= SAMPLE {
            let done = finished.load(Ordering::Relaxed);
            let window = last_sample.0.elapsed().as_secs_f64();
            let mut seen = std::mem::take(&mut *latencies.lock().unwrap());
            let sample = sample(
                pool,
                started,
                (done - last_sample.1) as f64 / window,
                &mut seen,
            )
            .await?;
            eprintln!(
                "{:>5.0} s: {:>6.0} finished/s, {:>7} unfinished, {:>7} past retention (oldest {:.0} s), {:>8} dead tuples, {:.0} MB, latency p50 {:.1} ms p99 {:.1} ms",
                sample.at_s,
                sample.finished_per_s,
                sample.unfinished,
                sample.past_retention,
                sample.oldest_past_retention_s,
                sample.dead_tuples,
                sample.table_mb,
                sample.latency_p50_ms,
                sample.latency_p99_ms
            );
            samples.push(sample);
            last_sample = (Instant::now(), done);
        }
    }
    Ok(samples)
}

async fn sample(
    pool: &PgPool,
    started: Instant,
    finished_per_s: f64,
    latencies: &mut [f64],
) -> anyhow::Result<Sample> {
    let (unfinished, past, oldest, dead, live, bytes): (i64, i64, f64, i64, i64, i64) =
        sqlx::query_as(
            r#"
            SELECT (SELECT count(*) FROM almanac.jobs WHERE status IN ('ready', 'running')),
                   (SELECT count(*) FROM almanac.jobs
                     WHERE status = 'done' AND finished_at < now() - make_interval(secs => $1)),
                   coalesce((SELECT extract(epoch FROM now() - make_interval(secs => $1) - min(finished_at))
                               FROM almanac.jobs
                              WHERE status = 'done' AND finished_at < now() - make_interval(secs => $1)),
                            0)::float8,
                   coalesce((SELECT n_dead_tup FROM pg_stat_user_tables
                              WHERE relid = 'almanac.jobs'::regclass), 0),
                   coalesce((SELECT n_live_tup FROM pg_stat_user_tables
                              WHERE relid = 'almanac.jobs'::regclass), 0),
                   pg_total_relation_size('almanac.jobs')
            "#,
        )
        .bind(RETENTION.as_secs_f64())
        .fetch_one(pool)
        .await?;
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| {
        if latencies.is_empty() {
            0.0
        } else {
            latencies[((latencies.len() - 1) as f64 * q).round() as usize]
        }
    };
    Ok(Sample {
        at_s: started.elapsed().as_secs_f64(),
        finished_per_s,
        unfinished,
        past_retention: past,
        oldest_past_retention_s: oldest,
        dead_tuples: dead,
        live_tuples: live,
        table_mb: bytes as f64 / 1_048_576.0,
        latency_p50_ms: at(0.5),
        latency_p99_ms: at(0.99),
    })
}

pub fn print_table(r: &Report) {
    println!(
        "retention at {} jobs/s for {} min (done jobs kept {} s, the default janitor):",
        r.rate, r.minutes, r.retention_s
    );
    println!("  finished: {:.0} jobs/s", r.finished_per_s);
    println!(
        "  worst wait of a done job past its retention: {:.0} s (goal: under 60)",
        r.worst_past_retention_s
    );
    println!("  most dead tuples: {}", r.max_dead_tuples);
    println!(
        "  latency p99, last sample over first: {:.2} (goal: no drift)",
        r.latency_p99_drift
    );
}
