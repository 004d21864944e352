//! Scheduler benchmarks against the local PostgreSQL (not timed tests):
//!
//! - backfill of 10 years of a daily schedule, cold and again (all present);
//! - one leader tick over 10,000 schedules, when none is due and when all are,
//!   the latter next to a raw single-statement insert of the same rows.
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
    let many = text;
    let schedules = load_sources(&[("many.toml".into(), many.clone())])?;
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
    println!(
        "leader sync + cursors for 10,000 schedules: {}",
        ms(load_time)
    );
    println!(
        "leader tick over 10,000 schedules, none due: median {} (goal < 50 ms)",
        ms(idle[idle.len() / 2])
    );

    // All due: every five minutes each schedule has exactly one run due.
    // Next to it, in a second scratch database with the same schedules, the
    // same 10,000 ledger rows and 10,000 jobs written by one raw INSERT
    // statement (no planning, no conflict handling): the floor the tick is
    // judged against. Rounds alternate so both tables grow alike.
    let raw_db = common::Scratch::new("scheduler_raw").await?;
    let mut raw_conn = raw_db.pool.acquire().await?;
    almanac::scheduler::ledger::sync(
        &mut raw_conn,
        &load_sources(&[("many.toml".into(), many.clone())])?,
        true,
    )
    .await?;
    let (mut ticks, mut raws) = (Vec::new(), Vec::new());
    let mut emitted = 0;
    for round in 1..=5 {
        let busy_at = first + chrono::Duration::minutes(5 * round) - chrono::Duration::seconds(1);
        let t = Instant::now();
        let busy = ticker.tick(&mut conn, busy_at).await?;
        ticks.push(t.elapsed());
        emitted = busy.emitted;
        let rows: Vec<RawRow> = sqlx::query_as(
            r#"
                SELECT r.schedule, r.logical_run, r.fire_at, r.source, r.outcome,
                       j.kind, j.payload, j.max_attempts, j.idempotency_key
                FROM almanac.schedule_runs r JOIN almanac.jobs j ON j.id = r.job_id
                WHERE r.fire_at > $1 - interval '5 minutes' AND r.fire_at <= $1
                "#,
        )
        .bind(busy_at)
        .fetch_all(&mut *conn)
        .await?;
        assert_eq!(rows.len(), 10_000);
        let t = Instant::now();
        raw_insert(&mut raw_conn, &rows).await?;
        raws.push(t.elapsed());
    }
    ticks.sort();
    raws.sort();
    let (tick, raw) = (ticks[ticks.len() / 2], raws[raws.len() / 2]);
    println!(
        "leader tick over 10,000 schedules, all due: {emitted} runs recorded and emitted in {} (median of 5)",
        ms(tick)
    );
    println!(
        "raw single-statement insert of the same 10,000 ledger rows and 10,000 jobs: {} (median of 5)",
        ms(raw)
    );
    println!(
        "all-due tick / raw insert: {:.2} (goal <= 1.5)",
        tick.as_secs_f64() / raw.as_secs_f64()
    );
    raw_conn.close().await?;
    raw_db.drop().await?;

    conn.close().await?;
    scratch.drop().await?;
    Ok(())
}

type RawRow = (
    String,
    String,
    DateTime<Utc>,
    String,
    String,
    String,
    serde_json::Value,
    i32,
    String,
);

/// The same ledger rows and jobs, in one plain INSERT statement.
async fn raw_insert(conn: &mut sqlx::PgConnection, rows: &[RawRow]) -> anyhow::Result<()> {
    let col = |f: fn(&RawRow) -> String| rows.iter().map(f).collect::<Vec<_>>();
    let fires: Vec<DateTime<Utc>> = rows.iter().map(|r| r.2).collect();
    let payloads: Vec<&serde_json::Value> = rows.iter().map(|r| &r.6).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.7).collect();
    sqlx::query(
        r#"
        WITH p AS (
            SELECT * FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::text[], $5::text[],
                                 $6::text[], $7::jsonb[], $8::int[], $9::text[])
                AS p(schedule, logical_run, fire_at, source, outcome, kind, payload, max_attempts, key)
        ), j AS (
            INSERT INTO almanac.jobs (kind, payload, run_at, max_attempts, idempotency_key, schedule, logical_run)
            SELECT kind, payload, fire_at, max_attempts, key, schedule, logical_run FROM p
            RETURNING id, schedule, logical_run
        )
        INSERT INTO almanac.schedule_runs (schedule, logical_run, fire_at, source, outcome, job_id)
        SELECT p.schedule, p.logical_run, p.fire_at, p.source, p.outcome, j.id
        FROM p JOIN j USING (schedule, logical_run)
        "#,
    )
    .bind(col(|r| r.0.clone()))
    .bind(col(|r| r.1.clone()))
    .bind(&fires)
    .bind(col(|r| r.3.clone()))
    .bind(col(|r| r.4.clone()))
    .bind(col(|r| r.5.clone()))
    .bind(&payloads)
    .bind(&attempts)
    .bind(col(|r| r.8.clone()))
    .execute(conn)
    .await?;
    Ok(())
}
