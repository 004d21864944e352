//! Scheduler benchmarks against the local PostgreSQL (not timed tests):
//!
//! - backfill of 10 years of a daily schedule, cold and again (all present);
//! - one leader tick over 10,000 schedules, when none is due and when all are.
//!
//! `cargo bench --bench scheduler`. Uses a scratch database it drops after.

use std::time::{Duration, Instant};

use almanac::scheduler::backfill;
use almanac::scheduler::spec::load_sources;
use almanac::scheduler::ticker::Ticker;
use chrono::{DateTime, Utc};

fn at(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

#[path = "common/mod.rs"]
mod common;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let scratch = common::Scratch::new("scheduler").await?;
    let pool = scratch.pool.clone();
    let mut conn = pool.acquire().await?;

    // Backfill: 2016-01-01 .. 2025-12-31, 3,653 daily runs.
    let daily = load_sources(&[(
        "bench.toml".into(),
        "[daily]\ncron = \"0 2 * * *\"\ntimezone = \"Asia/Seoul\"\n".into(),
    )])?
    .remove(0);
    let (from, to) = (at("2015-12-31T15:00:00Z"), at("2025-12-31T15:00:00Z"));
    let range = backfill::Range {
        from,
        to,
        dry_run: false,
        allow_future: false,
    };
    let t = Instant::now();
    let cold = backfill::backfill(&mut conn, &daily, range, |_, _| {}).await?;
    let cold_time = t.elapsed();
    let t = Instant::now();
    let warm = backfill::backfill(&mut conn, &daily, range, |_, _| {}).await?;
    let warm_time = t.elapsed();
    println!("backfill, 10 years daily: {} runs emitted in {} (goal < 1 s); repeated: {} already there, {}", cold.emitted, ms(cold_time), warm.already_emitted, ms(warm_time));

    // 10,000 schedules, every 5 minutes, spread over the 5 minutes.
    let text: String = (0..10_000)
        .map(|i| {
            format!(
                "[s{i}]\ncron = \"{} */5 * * * *\"\nkind = \"bench\"\n",
                i % 60
            )
        })
        .collect();
    let t = Instant::now();
    let schedules = load_sources(&[("many.toml".into(), text)])?;
    println!(
        "parse and validate one file of 10,000 schedules: {}",
        ms(t.elapsed())
    );
    let t = Instant::now();
    let mut ticker = Ticker::load(&mut conn, schedules, Duration::from_secs(60)).await?;
    let load_time = t.elapsed();
    let first = ticker.next_wake().expect("a next run");
    // Idle: nothing is due a second before the first run.
    let idle_at = first - chrono::Duration::seconds(1);
    let mut idle = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        ticker.tick(&mut conn, idle_at).await?;
        idle.push(t.elapsed());
    }
    idle.sort();
    // Busy: five minutes on, every schedule has exactly one run due.
    let busy_at = first + chrono::Duration::minutes(5) - chrono::Duration::seconds(1);
    let t = Instant::now();
    let busy = ticker.tick(&mut conn, busy_at).await?;
    let busy_time = t.elapsed();
    println!(
        "leader sync + cursors for 10,000 schedules: {}",
        ms(load_time)
    );
    println!(
        "leader tick over 10,000 schedules, none due: median {} (goal < 50 ms)",
        ms(idle[idle.len() / 2])
    );
    println!(
        "leader tick over 10,000 schedules, all due: {} runs recorded and emitted in {}",
        busy.emitted,
        ms(busy_time)
    );

    drop(conn);
    scratch.drop().await?;
    Ok(())
}
