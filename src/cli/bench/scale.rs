//! `almanac bench --scale 0,1000000,10000000`: the queue's figures on a
//! table of each size, each beside its value at the smallest, from one run
//! on one scratch database grown from size to size (issue #26).
//!
//! **The background** ([`fill`]): at each size the jobs table holds that
//! many jobs in a mix a service a few weeks old has: 80% `done` within the
//! 7-day retention, 14% `ready` a day or more in the future, 5% `dead`
//! within the 30-day retention, 1 in 10,000 `running` on a live lease, over
//! eight kinds (one routed `broker` to RabbitMQ, whose ready jobs have
//! pending outbox rows); and one ledger row (`almanac.schedule_runs`) per
//! ten jobs over ten every-minute schedules (1,000,000 at 10,000,000), the
//! runs of the last six days with their `done` job, older ones with their
//! job gone to retention. Each size adds rows to the last one's with
//! `INSERT ... SELECT FROM generate_series` (a million per statement), then
//! `VACUUM ANALYZE`. Every measurement after works on jobs of its own with
//! ids above the background's (the *floor*) and deletes them after, so the
//! background is the same for every figure of a size.
//!
//! **The figures** ([`measure`]), at each size: enqueue (one job per
//! transaction, and batches of 1,000) through the Rust API; the raw claim
//! and complete statements (best of batches of 100 and 1,000) and the worker
//! runtime with default settings, and the one over the other; LISTEN latency
//! (enqueue commit to handler start) p50 and p99; every dashboard page
//! through the real HTTP server (median of five requests); `almanac stats`'
//! snapshot and one collector refresh (median of five); one reaper sweep
//! over 1,000 expired leases, one re-drive sweep (RabbitMQ, the default
//! `redrive_after`) and a reconcile sweep once the routes settled and one
//! looking at every routed kind; the janitor's deletion rate
//! over 20,000 `done` jobs past retention (default batch, no pause); and
//! the table and index sizes of `almanac.jobs`, `almanac.outbox` and
//! `almanac.schedule_runs`. The goal of each time and rate is to stay
//! within 1.2 times its value at the smallest size; LISTEN p50 < 2 ms and
//! p99 < 5 ms and the runtime at least 0.7 of the raw limit at every size.
//!
//! **Before anything is written** ([`disk`]) the largest size's bytes are
//! estimated and compared with the free space of the PostgreSQL data
//! directory when the server is on this machine; a size that does not fit
//! is refused with both figures. The scratch database is dropped on every
//! way out: success, an error, SIGINT or SIGTERM.

use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{
    burn, clear_above, enqueue, fill_above, latency, raw_burn, report, scratch, vacuum_above, Args,
    KIND,
};
use crate::role::{Periodic, Settings};
use crate::worker::WorkerConfig;

mod disk;
mod fill;
mod pages;

/// What `--scale` alone means.
pub const DEFAULT_SIZES: &str = "0,1000000,10000000";
/// Expired leases the reaper sweep returns.
const REAPED: i64 = 1000;
/// `done` jobs past retention the janitor deletes.
const EXPIRED: i64 = 20_000;
/// Runs of each read-only figure (the median is reported).
const READS: usize = 5;

/// The sizes, ascending and distinct.
#[derive(Debug, Clone)]
pub struct Sizes(Vec<u64>);

/// `--scale`'s value: a comma list of job counts.
pub fn parse_sizes(value: &str) -> Result<Sizes, String> {
    let mut sizes = Vec::new();
    for part in value.split(',') {
        let part = part.trim().replace('_', "");
        let n: u64 = part.parse().map_err(|_| {
            format!("`{part}` is not a number of jobs; give a comma list such as {DEFAULT_SIZES}")
        })?;
        sizes.push(n);
    }
    sizes.sort_unstable();
    sizes.dedup();
    Ok(Sizes(sizes))
}

#[derive(Debug, Serialize)]
struct Report {
    /// Jobs in the table at each size (the background).
    sizes: Vec<u64>,
    /// Ledger rows at each size.
    ledger_rows: Vec<u64>,
    /// Jobs each throughput figure burns down.
    jobs: u64,
    connections: usize,
    disk: disk::Check,
    /// Every figure at every size, in the order of `sizes`.
    figures: Vec<Figure>,
}

/// One figure at every size.
#[derive(Debug, Serialize)]
struct Figure {
    name: String,
    unit: &'static str,
    values: Vec<f64>,
    /// The value at the largest size over the value at the smallest.
    ratio: Option<f64>,
    goal: &'static str,
    /// Whether the goal is met (None: no goal).
    met: Option<bool>,
}

/// How a figure is judged.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Goal {
    /// A time: at most 1.2 times its value at the smallest size.
    Time,
    /// A rate: at least 1/1.2 of its value at the smallest size.
    Rate,
    /// Below this at every size.
    Below(f64),
    /// At least this at every size.
    AtLeast(f64),
    /// Bytes: no goal, they grow with the rows.
    Size,
}

impl Goal {
    fn text(self) -> &'static str {
        match self {
            Goal::Time => "<= 1.2x at smallest",
            Goal::Rate => ">= 0.83x at smallest",
            Goal::Below(2.0) => "< 2 ms at every size",
            Goal::Below(_) => "< 5 ms at every size",
            Goal::AtLeast(_) => ">= 0.7 at every size",
            Goal::Size => "-",
        }
    }
}

/// The figures of one size, in order.
#[derive(Default)]
struct Figures(Vec<(String, &'static str, Goal, f64)>);

impl Figures {
    /// Adds the median time of `read` ([`median_ms`]), a [`Goal::Time`].
    async fn time<F, Fut>(&mut self, name: &str, read: F) -> anyhow::Result<()>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>>,
    {
        let ms = median_ms(read).await?;
        self.add(name, "ms", Goal::Time, ms);
        Ok(())
    }

    fn add(&mut self, name: impl Into<String>, unit: &'static str, goal: Goal, value: f64) {
        let name = name.into();
        eprintln!("  {name}: {value:.3} {unit}");
        self.0.push((name, unit, goal, value));
    }
}

pub async fn run(
    base: sqlx::postgres::PgConnectOptions,
    args: &Args,
    sizes: &Sizes,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    anyhow::ensure!(!sizes.0.is_empty(), "--scale needs at least one size");
    // Caught from here on, so that the scratch database is never left
    // behind: a signal while it is created stops the run right after.
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let largest = *sizes.0.last().expect("not empty");
    let check = disk::check(&base, largest).await?;
    let scratch = scratch(base, args.connections).await?;
    let (result, stopped) = tokio::select! {
        result = measure_all(&scratch.0, args, &sizes.0, check) => (result, None),
        _ = int.recv() => (Err(anyhow::anyhow!("stopped")), Some(("SIGINT", 130))),
        _ = term.recv() => (Err(anyhow::anyhow!("stopped")), Some(("SIGTERM", 143))),
    };
    let name = scratch.2.clone();
    let result = report(scratch, result, args.json, print_table).await;
    if let Some((signal, code)) = stopped {
        eprintln!(
            "almanac bench --scale: stopped by {signal}; the scratch database {name} was dropped"
        );
        std::process::exit(code);
    }
    result
}

async fn measure_all(
    pool: &PgPool,
    args: &Args,
    sizes: &[u64],
    disk: disk::Check,
) -> anyhow::Result<Report> {
    let mut background = fill::Background::start(pool).await?;
    let mut per_size = Vec::new();
    let mut ledger_rows = Vec::new();
    for &size in sizes {
        let started = Instant::now();
        background.grow(pool, size).await?;
        eprintln!(
            "scale {size}: filled ({} ledger rows) in {:.0} s",
            background.ledger_rows(),
            started.elapsed().as_secs_f64()
        );
        ledger_rows.push(background.ledger_rows());
        per_size.push(measure(pool, args, background.floor()).await?);
    }
    Ok(Report {
        sizes: sizes.to_vec(),
        ledger_rows,
        jobs: args.jobs,
        connections: args.connections,
        disk,
        figures: figures(per_size),
    })
}

/// Lines the sizes' figures up by name (every size has the same names).
fn figures(per_size: Vec<Figures>) -> Vec<Figure> {
    let Some(first) = per_size.first() else {
        return Vec::new();
    };
    first
        .0
        .iter()
        .enumerate()
        .map(|(i, (name, unit, goal, _))| {
            let values: Vec<f64> = per_size.iter().map(|f| f.0[i].3).collect();
            let (a, b) = (values[0], *values.last().expect("one size at least"));
            let ratio = (*goal != Goal::Size && a > 0.0).then(|| b / a);
            let met = match goal {
                Goal::Time => ratio.map(|r| r <= 1.2),
                Goal::Rate => ratio.map(|r| r >= 1.0 / 1.2),
                Goal::Below(v) => Some(values.iter().all(|x| x < v)),
                Goal::AtLeast(v) => Some(values.iter().all(|x| x >= v)),
                Goal::Size => None,
            };
            Figure {
                name: name.clone(),
                unit,
                values,
                ratio,
                goal: goal.text(),
                met,
            }
        })
        .collect()
}

/// Every figure on the table as it stands; jobs above `floor` are the
/// measurements' own.
async fn measure(pool: &PgPool, args: &Args, floor: i64) -> anyhow::Result<Figures> {
    let mut f = Figures::default();
    sizes(pool, &mut f).await?;

    // Read-only figures first, on the freshly vacuumed background (and
    // one dead job of the bench's kind, for the pages that show one).
    let probe: i64 = sqlx::query_scalar(
        "INSERT INTO almanac.jobs (kind, status, attempts, max_attempts, finished_at, last_error)
         VALUES ($1, 'dead', 1, 1, now(), 'exit status 1') RETURNING id",
    )
    .bind(KIND)
    .fetch_one(pool)
    .await?;
    // The job counters folded, as a running reaper folds them every sweep
    // (the fill's rows, and a first count after the migration).
    crate::queue::counts::fold(&mut *pool.acquire().await?, false).await?;
    pages::measure(pool, probe, &mut f).await?;
    f.time("stats snapshot", || async {
        crate::stats::Snapshot::read(&mut *pool.acquire().await?).await?;
        Ok(())
    })
    .await?;
    let collector = crate::stats::collector::Collector::new(
        pool.clone(),
        crate::stats::collector::CollectorConfig::default().validated()?,
    );
    let token = CancellationToken::new();
    f.time("collector refresh", || async {
        collector.run_once(&token).await?;
        Ok(())
    })
    .await?;
    let redrive_after = crate::relay::RelayConfig::default().redrive_after;
    f.time("re-drive sweep (rabbitmq)", || async {
        crate::relay::redrive(pool, crate::relay::SinkKind::Rabbitmq, redrive_after).await?;
        Ok(())
    })
    .await?;
    // A relay's sweep once every route has settled (the steady state), and
    // one that looks at every routed kind (after a start or a route change,
    // and at each kind's hourly look): `relay/reconcile.rs`.
    use crate::relay::reconcile::Reconciler;
    let settled = tokio::sync::Mutex::new(Reconciler::default());
    for _ in 0..100 {
        let mut r = settled.lock().await;
        r.sweep(&mut *pool.acquire().await?).await?;
        if r.looked_at() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::ensure!(
        settled.lock().await.looked_at() == 0,
        "the routes did not settle within 100 reconcile sweeps: a long transaction is open in the scratch database"
    );
    f.time("reconcile sweep", || async {
        settled
            .lock()
            .await
            .sweep(&mut *pool.acquire().await?)
            .await?;
        Ok(())
    })
    .await?;
    f.time("reconcile sweep, every kind looked at", || async {
        Reconciler::default()
            .sweep(&mut *pool.acquire().await?)
            .await?;
        Ok(())
    })
    .await?;

    enqueue_rates(pool, args, floor, &mut f).await?;
    let (raw, runtime) = claim_rates(pool, args, floor).await?;
    f.add("raw claim + complete", "jobs/s", Goal::Rate, raw);
    f.add(
        "worker runtime claim + complete",
        "jobs/s",
        Goal::Rate,
        runtime,
    );
    f.add(
        "worker runtime / raw",
        "ratio",
        Goal::AtLeast(0.7),
        runtime / raw,
    );

    let listen = latency(pool, floor, true, args.latency_jobs).await?;
    f.add("LISTEN latency p50", "ms", Goal::Below(2.0), listen.p50);
    f.add("LISTEN latency p99", "ms", Goal::Below(5.0), listen.p99);

    f.add(
        "reaper sweep (1000 expired)",
        "ms",
        Goal::Time,
        reaper_ms(pool, floor).await?,
    );
    f.add(
        "janitor deletion (done past retention)",
        "rows/s",
        Goal::Rate,
        janitor_rate(pool, floor).await?,
    );
    vacuum_above(pool, floor).await?;
    Ok(f)
}

/// The median of [`READS`] runs of `read`, in ms, after one unmeasured run.
async fn median_ms<F, Fut>(read: F) -> anyhow::Result<f64>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    read().await?;
    let mut ms = Vec::with_capacity(READS);
    for _ in 0..READS {
        let started = Instant::now();
        read().await?;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(super::median(&mut ms))
}

/// Table, toast and index bytes of the three big tables, and each index's.
async fn sizes(pool: &PgPool, f: &mut Figures) -> anyhow::Result<()> {
    for table in ["jobs", "outbox", "schedule_runs"] {
        let rel = format!("almanac.{table}");
        let (heap, indexes): (i64, i64) =
            sqlx::query_as("SELECT pg_table_size($1::regclass), pg_indexes_size($1::regclass)")
                .bind(&rel)
                .fetch_one(pool)
                .await?;
        f.add(
            format!("{rel} table bytes"),
            "bytes",
            Goal::Size,
            heap as f64,
        );
        f.add(
            format!("{rel} index bytes"),
            "bytes",
            Goal::Size,
            indexes as f64,
        );
        let each: Vec<(String, i64)> = sqlx::query_as(
            "SELECT c.relname::text, pg_relation_size(c.oid) FROM pg_index i
             JOIN pg_class c ON c.oid = i.indexrelid
             WHERE i.indrelid = $1::regclass ORDER BY c.relname",
        )
        .bind(&rel)
        .fetch_all(pool)
        .await?;
        for (index, bytes) in each {
            f.add(
                format!("  index {index} bytes"),
                "bytes",
                Goal::Size,
                bytes as f64,
            );
        }
    }
    Ok(())
}

/// Enqueue through the Rust API: one job per transaction, and batches of
/// 1,000 (the measured functions of [`enqueue`]).
async fn enqueue_rates(
    pool: &PgPool,
    args: &Args,
    floor: i64,
    f: &mut Figures,
) -> anyhow::Result<()> {
    let single = args.enqueue.enqueue_jobs;
    for (name, transactions, size) in [
        ("enqueue, one job per transaction", single, 1usize),
        (
            "enqueue, batches of 1000",
            single.div_ceil(100).max(1),
            1000,
        ),
    ] {
        vacuum_above(pool, floor).await?;
        let started = Instant::now();
        enqueue::run(
            pool,
            args.connections,
            enqueue::Way::RustApi,
            transactions,
            size,
        )
        .await?;
        let rate = (transactions * size as u64) as f64 / started.elapsed().as_secs_f64();
        f.add(name, "jobs/s", Goal::Rate, rate);
    }
    Ok(())
}

/// The raw limit (best of batches of 100 and 1,000) and the worker
/// runtime's rate with default settings, `--jobs` jobs each.
async fn claim_rates(pool: &PgPool, args: &Args, floor: i64) -> anyhow::Result<(f64, f64)> {
    // A vacuumed table and `--jobs` due jobs of the bench's kind.
    let refill = || async {
        vacuum_above(pool, floor).await?;
        fill_above(
            pool,
            floor,
            args.jobs,
            "jsonb_build_object('customer', g)",
            "NULL",
        )
        .await
    };
    let mut raw: f64 = 0.0;
    for batch in [100usize, 1000] {
        refill().await?;
        raw = raw.max(raw_burn(pool, args.connections, batch, args.jobs).await?);
    }
    refill().await?;
    let runtime = burn(pool, WorkerConfig::default(), args.jobs).await?;
    Ok((raw, runtime))
}

/// One reaper sweep over [`REAPED`] jobs of the bench's kind whose lease
/// expired a minute ago.
async fn reaper_ms(pool: &PgPool, floor: i64) -> anyhow::Result<f64> {
    vacuum_above(pool, floor).await?;
    sqlx::query(
        "INSERT INTO almanac.jobs (kind, status, attempts, lease_token, lease_until, run_at)
         SELECT $1, 'running', 1, gen_random_uuid(), now() - interval '1 minute',
                now() - interval '2 minutes'
         FROM generate_series(1, $2)",
    )
    .bind(KIND)
    .bind(REAPED)
    .execute(pool)
    .await?;
    let reaper = crate::maintenance::Reaper::new(
        pool.clone(),
        crate::maintenance::ReaperConfig::default().validated()?,
    );
    let started = Instant::now();
    let reaped = reaper.run_once(&CancellationToken::new()).await?;
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    anyhow::ensure!(
        reaped.requeued == REAPED as u64,
        "the reaper sweep requeued {} of {REAPED} expired leases",
        reaped.requeued
    );
    Ok(ms)
}

/// One janitor pass (default batch size, no pause between batches) over
/// [`EXPIRED`] `done` jobs finished eight days ago: rows deleted per second.
async fn janitor_rate(pool: &PgPool, floor: i64) -> anyhow::Result<f64> {
    vacuum_above(pool, floor).await?;
    sqlx::query(
        "INSERT INTO almanac.jobs (kind, status, attempts, run_at, created_at, finished_at)
         SELECT $1, 'done', 1, t, t, t FROM generate_series(1, $2),
                LATERAL (SELECT now() - interval '8 days' AS t) AS at",
    )
    .bind(KIND)
    .bind(EXPIRED)
    .execute(pool)
    .await?;
    sqlx::query("ANALYZE almanac.jobs").execute(pool).await?;
    let config = crate::maintenance::JanitorConfig {
        pause: Duration::ZERO,
        ..crate::maintenance::JanitorConfig::default()
    };
    let janitor = crate::maintenance::Janitor::new(pool.clone(), config.validated()?);
    let started = Instant::now();
    let deleted = janitor.run_once(&CancellationToken::new()).await?;
    let secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        deleted.done == EXPIRED as u64 && deleted.dead == 0 && deleted.cancelled == 0,
        "the janitor deleted {deleted:?}, not the {EXPIRED} done jobs past retention alone"
    );
    clear_above(pool, floor).await?;
    Ok(deleted.done as f64 / secs)
}

fn print_table(r: &Report) {
    let head = |n: u64| format!("at {}", human(n));
    println!(
        "almanac bench --scale: {} jobs per burn-down, {} connections; ledger rows {:?}",
        r.jobs, r.connections, r.ledger_rows
    );
    println!("{}", r.disk.line());
    println!();
    let mut header = format!("{:<44} {:>7}", "figure", "unit");
    for &size in &r.sizes {
        header.push_str(&format!(" {:>13}", head(size)));
    }
    header.push_str(&format!(" {:>7}  {}", "ratio", "goal"));
    println!("{header}");
    for fig in &r.figures {
        let mut line = format!("{:<44} {:>7}", fig.name, fig.unit);
        for v in &fig.values {
            line.push_str(&format!(" {:>13}", number(*v, fig.unit)));
        }
        let ratio = fig.ratio.map_or("-".to_string(), |x| format!("{x:.2}"));
        let verdict = match fig.met {
            Some(true) => " ok",
            Some(false) => " MISSED",
            None => "",
        };
        line.push_str(&format!(" {ratio:>7}  {}{verdict}", fig.goal));
        println!("{line}");
    }
}

fn number(v: f64, unit: &str) -> String {
    match unit {
        "ms" | "ratio" => format!("{v:.2}"),
        "bytes" => format!("{:.1} MB", v / 1e6),
        _ => format!("{v:.0}"),
    }
}

/// 1000 -> "1k", 10000000 -> "10M".
fn human(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 && n % 1_000_000_000 == 0 => format!("{}G", n / 1_000_000_000),
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 1000 && n % 1000 == 0 => format!("{}k", n / 1000),
        n => n.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_sorted_and_garbage_is_named() {
        assert_eq!(
            parse_sizes("10000000,0,1_000_000").unwrap().0,
            [0, 1_000_000, 10_000_000]
        );
        let err = parse_sizes("0,ten").unwrap_err();
        assert!(err.contains("`ten`"), "{err}");
        assert!(parse_sizes("-1").unwrap_err().contains("`-1`"));
    }
}
