//! The relays' periodic sweeps over a large backlog of ready broker jobs
//! (`ALMANAC_BENCH_SWEEPS=1`): one whole re-drive sweep and one reconcile
//! sweep, at 100,000 and at 1,000,000 ready jobs, in a scratch database of
//! their own.
//!
//! The backlog is the case a sweep cannot skip: broker jobs due long ago,
//! all published within `redrive_after` (consumers behind, no drain marks),
//! so every one is a re-drive candidate and every one is found in a
//! publication record (`outbox_batches`, one per 500 jobs, as the relay
//! writes them), and none is re-driven; all of them are on their kind's
//! route, so reconcile repairs nothing. The jobs and records are written
//! with `generate_series`, the jobs with the route triggers off (they
//! would write an outbox row per job), then `VACUUM ANALYZE`, as
//! autovacuum would leave them.

use std::time::{Duration, Instant};

use almanac::queue::routing;
use almanac::relay::reconcile::Reconciler;
use almanac::relay::routes::{self, Reconciled, RouteMode};
use almanac::relay::SinkKind;
use sqlx::PgPool;

use super::common::Scratch;

const KIND: &str = "bench_sweep";

/// The `redrive_after` of the sweeps: the records are a minute old.
const REDRIVE_AFTER: Duration = Duration::from_secs(600);

/// Sweeps timed at 100,000 jobs (the median is reported); at 1,000,000
/// one (building that backlog is most of the bench's time; see
/// docs/speed.md).
const SWEEPS: usize = 3;

pub async fn run() -> anyhow::Result<()> {
    let scratch = Scratch::new("relay_sweeps").await?;
    let pool = scratch.pool.clone();
    routes::set(
        &mut *pool.acquire().await?,
        KIND,
        RouteMode::Broker,
        Some(SinkKind::Kafka),
        Some("almanac-bench-sweep"),
    )
    .await?;
    let mut built = 0;
    let mut before: Option<(Duration, Duration)> = None;
    for size in [100_000, 1_000_000] {
        let start = Instant::now();
        build(&pool, built, size).await?;
        built = size;
        println!(
            "sweeps: {size} ready broker jobs and {} publication records built in {:.1}s",
            size / 500,
            start.elapsed().as_secs_f64()
        );
        let mut redrives = Vec::new();
        let mut reconciles = Vec::new();
        let sweeps = if size > 100_000 { 1 } else { SWEEPS };
        for _ in 0..sweeps {
            let (took, steps) = redrive_sweep(&pool).await?;
            redrives.push(took);
            let took = reconcile_sweep(&pool).await?;
            reconciles.push(took);
            println!(
                "sweeps: {size:>9} jobs: re-drive {:>8.1} ms ({steps} steps, {:.2} ms a step), reconcile {:>8.1} ms",
                ms(redrives[redrives.len() - 1]),
                ms(redrives[redrives.len() - 1]) / steps as f64,
                ms(took),
            );
        }
        let (redrive, reconcile) = (median(redrives), median(reconciles));
        let growth = before.map_or(String::new(), |(r, c)| {
            format!(
                "; growth over the previous size: re-drive x{:.1}, reconcile x{:.1}",
                redrive.as_secs_f64() / r.as_secs_f64(),
                reconcile.as_secs_f64() / c.as_secs_f64()
            )
        });
        println!(
            "sweeps: {size:>9} jobs, median of {sweeps}: re-drive {:.1} ms a sweep ({:.2} µs a job), reconcile {:.1} ms a sweep ({:.2} µs a job){growth}",
            ms(redrive),
            redrive.as_secs_f64() * 1e6 / size as f64,
            ms(reconcile),
            reconcile.as_secs_f64() * 1e6 / size as f64,
        );
        before = Some((redrive, reconcile));
    }
    scratch.drop().await?;
    Ok(())
}

/// Adds ready broker jobs `from`+1..=`to` of [`KIND`], due two hours ago
/// and a millisecond apart, and a publication record a minute old for each
/// 500 of them.
async fn build(pool: &PgPool, from: usize, to: usize) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    let first: i64 = sqlx::query_scalar("SELECT coalesce(max(id), 0) + 1 FROM almanac.jobs")
        .fetch_one(&mut *tx)
        .await?;
    sqlx::query(
        "ALTER TABLE almanac.jobs DISABLE TRIGGER jobs_take_route, DISABLE TRIGGER jobs_to_outbox",
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        r#"
        INSERT INTO almanac.jobs (kind, payload, run_at, route, idempotency_key, created_at)
        SELECT $1, '{"order": 12345, "note": "benchmark payload"}',
            now() - interval '2 hours' + i * interval '1 millisecond', 'broker',
            'sweep:' || i, now() - interval '2 hours'
        FROM generate_series($2::bigint + 1, $3::bigint) AS i
        "#,
    )
    .bind(KIND)
    .bind(from as i64)
    .bind(to as i64)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "ALTER TABLE almanac.jobs ENABLE TRIGGER jobs_take_route, ENABLE TRIGGER jobs_to_outbox",
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        r#"
        INSERT INTO almanac.outbox_batches
            (token, sink, ids, job_ids, claimed_at, lease_until, published_at, job_span)
        SELECT gen_random_uuid(), 'kafka', b.ids, b.ids, now() - interval '1 minute',
            now() - interval '1 minute', now() - interval '1 minute', almanac.id_span(b.ids)
        FROM (SELECT array_agg(id ORDER BY id) AS ids FROM almanac.jobs
              WHERE kind = $1 AND id >= $2 GROUP BY (id - $2) / 500) AS b
        "#,
    )
    .bind(KIND)
    .bind(first)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    sqlx::query("VACUUM ANALYZE almanac.jobs, almanac.outbox_batches, almanac.outbox")
        .execute(pool)
        .await?;
    Ok(())
}

/// One whole re-drive sweep, as `almanac::relay::redrive` runs it; its
/// time and steps.
async fn redrive_sweep(pool: &PgPool) -> anyhow::Result<(Duration, usize)> {
    let start = Instant::now();
    let (mut from, mut steps) = (None, 0);
    loop {
        let step = routing::redrive(pool, SinkKind::Kafka.as_str(), REDRIVE_AFTER, from).await?;
        steps += 1;
        anyhow::ensure!(
            step.redriven == 0,
            "re-drive copied {} published jobs",
            step.redriven
        );
        match step.next {
            Some(next) => from = Some(next),
            None => return Ok((start.elapsed(), steps)),
        }
    }
}

/// One reconcile sweep that looks at every routed kind, as a relay runs it
/// after it starts or a route changes (once routes settle a sweep reads
/// only `routes` and `pg_locks`: `relay/reconcile.rs`).
async fn reconcile_sweep(pool: &PgPool) -> anyhow::Result<Duration> {
    let mut conn = pool.acquire().await?;
    let start = Instant::now();
    let done = Reconciler::default().sweep(&mut conn).await?;
    let took = start.elapsed();
    anyhow::ensure!(
        done == Reconciled::default(),
        "reconcile found work: {done:?}"
    );
    Ok(took)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}
