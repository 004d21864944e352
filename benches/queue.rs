//! Queue throughput (not a timed test): the worker runtime with a no-op
//! handler, next to the raw claim/complete SQL on the same database in the
//! same run, at two batch sizes.
//!
//! `cargo bench --bench queue`. Uses a scratch database it drops after.

use std::time::{Duration, Instant};

use almanac::queue::{self, Claim, NewJob};
use almanac::worker::{JobContext, Worker, WorkerConfig};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const JOBS: usize = 20_000;

async fn fill(pool: &PgPool, kind: &str) -> anyhow::Result<()> {
    sqlx::query("INSERT INTO almanac.jobs (kind) SELECT $1 FROM generate_series(1, $2)")
        .bind(kind)
        .bind(JOBS as i64)
        .execute(pool)
        .await?;
    Ok(())
}

/// Claim a batch, complete it, in two statements per batch: the floor the
/// runtime is measured against.
async fn raw(pool: &PgPool, kind: &str, batch: i64) -> anyhow::Result<Duration> {
    fill(pool, kind).await?;
    let kinds = vec![kind.to_string()];
    let start = Instant::now();
    loop {
        let jobs = queue::claim(
            pool,
            &Claim {
                kinds: &kinds,
                limit: batch,
                lease: Duration::from_secs(60),
            },
        )
        .await?;
        if jobs.is_empty() {
            break;
        }
        let leases: Vec<_> = jobs.iter().filter_map(|j| j.lease()).collect();
        queue::complete_many(pool, &leases).await?;
    }
    Ok(start.elapsed())
}

async fn runtime(
    pool: &PgPool,
    kind: &str,
    concurrency: usize,
    batch: usize,
) -> anyhow::Result<Duration> {
    fill(pool, kind).await?;
    let config = WorkerConfig {
        concurrency,
        batch_size: batch,
        poll_interval: Duration::from_millis(10),
        ..WorkerConfig::default()
    };
    let worker =
        Worker::new(pool.clone(), config).register(kind, |_ctx: JobContext| async { Ok(()) });
    let stop = CancellationToken::new();
    let start = Instant::now();
    let running = tokio::spawn(worker.run(stop.clone()));
    loop {
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM almanac.jobs WHERE kind = $1 AND status = 'done'",
        )
        .bind(kind)
        .fetch_one(pool)
        .await?;
        if done == JOBS as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = start.elapsed();
    stop.cancel();
    running.await??;
    Ok(elapsed)
}

fn rate(d: Duration) -> f64 {
    JOBS as f64 / d.as_secs_f64()
}

#[path = "common/mod.rs"]
mod common;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let scratch = common::Scratch::new("queue").await?;
    let pool = scratch.pool.clone();
    let mut conn = pool.acquire().await?;
    queue::enqueue(&mut conn, &NewJob::new("warm-up")).await?;
    drop(conn);
    for (batch, concurrency) in [(1usize, 1usize), (100, 200)] {
        let raw = raw(&pool, &format!("raw{batch}"), batch as i64).await?;
        let rt = runtime(&pool, &format!("rt{batch}"), concurrency, batch).await?;
        println!(
            "batch {batch:>3}: raw claim+complete {:>7.0} jobs/s   worker runtime (concurrency {concurrency}) {:>7.0} jobs/s   runtime/raw {:.2}",
            rate(raw),
            rate(rt),
            rate(rt) / rate(raw)
        );
    }
    scratch.drop().await?;
    Ok(())
}
