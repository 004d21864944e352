//! `almanac bench`'s ordering figure: what order per key costs
//! ([`crate::queue::ordering`]). The worker runtime (default settings)
//! burns down `--jobs` no-op jobs spread over [`KEYS`] ordering keys, and
//! the same jobs with the kind not ordered, in pairs; the figure is the
//! median of [`ROUNDS`] pairs' ratios (the goal: at least 0.5). Ordered,
//! at most one job per key is claimable at a time, so a key's jobs run one
//! claim and one completion after another: with 200 keys, 200 jobs are in
//! flight at most, where the unordered run has the worker's whole
//! concurrency busy.

use serde::Serialize;
use sqlx::PgPool;

use super::{burn, fill_with, median, vacuum, KIND};
use crate::control::{Actor, Source};
use crate::queue::ordering::OnDead;
use crate::worker::WorkerConfig;

/// Ordering keys the jobs are spread over.
pub const KEYS: i64 = 200;
/// Pairs of runs.
const ROUNDS: usize = 3;

#[derive(Debug, Serialize)]
pub struct Report {
    pub keys: i64,
    pub ordered_jobs_per_s: f64,
    pub unordered_jobs_per_s: f64,
    /// Median of the pairs' ratios.
    pub ratio: f64,
}

/// `n` ready no-op jobs, their payload's `key` one of [`KEYS`] (round
/// robin); an ordered kind holds all but each key's first.
async fn fill_keyed(pool: &PgPool, n: u64) -> anyhow::Result<()> {
    let payload = format!("jsonb_build_object('key', 'k' || (g % {KEYS}))");
    fill_with(pool, n, &payload, "NULL").await
}

pub async fn measure(pool: &PgPool, jobs: u64) -> anyhow::Result<Report> {
    let actor = Actor::new("almanac bench", Source::Cli);
    let mut ordered = Vec::new();
    let mut unordered = Vec::new();
    let mut ratios = Vec::new();
    sqlx::query("ALTER TABLE almanac.jobs SET (autovacuum_enabled = false)")
        .execute(pool)
        .await?;
    for _ in 0..ROUNDS {
        vacuum(pool).await?;
        fill_keyed(pool, jobs).await?;
        let without = burn(pool, WorkerConfig::default(), jobs).await?;
        vacuum(pool).await?;
        let mut conn = pool.acquire().await?;
        crate::control::ordering::set(&mut conn, &actor, KIND, Some("/key"), OnDead::Halt).await?;
        fill_keyed(pool, jobs).await?;
        let with = burn(pool, WorkerConfig::default(), jobs).await?;
        crate::control::ordering::clear(&mut conn, &actor, KIND).await?;
        unordered.push(without);
        ordered.push(with);
        ratios.push(with / without);
    }
    sqlx::query("ALTER TABLE almanac.jobs RESET (autovacuum_enabled)")
        .execute(pool)
        .await?;
    let report = Report {
        keys: KEYS,
        ordered_jobs_per_s: median(&mut ordered),
        unordered_jobs_per_s: median(&mut unordered),
        ratio: median(&mut ratios),
    };
    eprintln!(
        "runtime (defaults), ordered over {KEYS} keys: {:.0} jobs/s ({:.2} of unordered, median of {ROUNDS} pairs)",
        report.ordered_jobs_per_s, report.ratio
    );
    Ok(report)
}

pub fn print_table(r: &Report) {
    println!(
        "{:<44} {:>14.0}  ({:.2} of unordered, beside it)",
        format!("  the same ordered over {} keys", r.keys),
        r.ordered_jobs_per_s,
        r.ratio
    );
}
