//! `almanac bench`: how fast the queue runs on *your* database, every figure
//! from the same run, on a scratch database (`almanac_bench_<pid>`, created
//! next to the configured one and dropped after).
//!
//! - **raw**: the runtime's own claim and complete statements (`queue::claim`,
//!   `queue::complete_many`) driven by `--connections` concurrent connections
//!   with nothing in between, at batch 1, 10, 100 and 1000: the ceiling.
//! - **runtime**: the worker runtime burning down `--jobs` no-op jobs with its
//!   default settings, the same under limits that never bind (each kind
//!   of limit alone, and all three at once: what a limit costs when it
//!   holds nothing back), over 200 ordering keys beside the same jobs
//!   unordered ([`ordered`]), and with tuned ones (`--tuned-*`).
//! - **latency**: enqueue commit to handler start, jobs enqueued one at a time
//!   into an idle queue, with LISTEN/NOTIFY and with polling only.
//! - **exec**: the shell-command handler running `true`.
//! - **cost**: WAL bytes per job (enqueue, claim, complete) and dead tuples
//!   left in the jobs table after the burn-down.
//! - **enqueue**: the SQL function beside the Rust API and the hand-written
//!   INSERT it replaces, one job and 1,000 jobs per transaction
//!   ([`enqueue`]).
//! - **tracing**: the default runtime with tracing off beside every span
//!   exported by OTLP to a receiver in this process, in pairs, and the
//!   ratio ([`traced`]); `--tracing-only` measures just these.
//! - **scale** (`--scale 0,1000000,10000000`), instead of all the above:
//!   the queue's figures on tables of each size, beside their value on
//!   empty ones ([`scale`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;
use sqlx::{Connection, PgPool};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::Ctx;
use crate::db;
use crate::queue::limits::{Limits, PerKey, Rate};
use crate::queue::{self, Claim};
use crate::role::{Role, Settings};
use crate::worker::exec::ExecHandler;
use crate::worker::{JobContext, Worker, WorkerConfig};

mod enqueue;
mod ordered;
mod retention;
mod scale;
mod traced;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// No-op jobs for each runtime burn-down.
    #[arg(long, default_value_t = 100_000)]
    jobs: u64,
    /// Concurrent connections driving the raw statements.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Jobs enqueued one at a time for each latency figure.
    #[arg(long, default_value_t = 1000)]
    latency_jobs: usize,
    /// Jobs for the exec handler figure.
    #[arg(long, default_value_t = 5000)]
    exec_jobs: u64,
    /// Tuned runtime: handlers at once.
    #[arg(long, default_value_t = 2000)]
    tuned_concurrency: usize,
    /// Tuned runtime: jobs per claim.
    #[arg(long, default_value_t = 1000)]
    tuned_batch_size: usize,
    /// Instead of the figures above: the queue's figures at each of these
    /// numbers of jobs (a comma list), on one scratch database grown from
    /// size to size, each beside its value at the smallest.
    #[arg(long, value_name = "JOBS,...", num_args = 0..=1,
          default_missing_value = scale::DEFAULT_SIZES, value_parser = scale::parse_sizes,
          conflicts_with_all = ["tracing_only", "ordering_only", "retention_only", "enqueue_only"])]
    scale: Option<scale::Sizes>,
    /// Only the tracing figures (off beside on), nothing else.
    #[arg(long, conflicts_with = "ordering_only")]
    tracing_only: bool,
    /// Only the ordering figure (200 keys beside unordered), nothing else.
    #[arg(long, conflicts_with = "retention_only")]
    ordering_only: bool,
    /// Only the retention figures: `--retention-rate` jobs a second for
    /// `--retention-minutes` under the default worker and janitor.
    #[arg(long, conflicts_with = "tracing_only")]
    retention_only: bool,
    /// Only the enqueue figures (the SQL function beside the Rust API and
    /// a hand-written INSERT), nothing else.
    #[arg(long, conflicts_with_all = ["tracing_only", "ordering_only", "retention_only"])]
    enqueue_only: bool,
    #[command(flatten)]
    retention: retention::RetentionArgs,
    /// One JSON object instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    enqueue: enqueue::EnqueueArgs,
}

#[derive(Debug, Serialize)]
struct Percentiles {
    p50: f64,
    p99: f64,
    max: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    jobs: u64,
    connections: usize,
    /// Batch size -> jobs/s.
    raw_jobs_per_s: BTreeMap<usize, f64>,
    runtime_default_jobs_per_s: f64,
    /// The default runtime under limits that never bind, by case.
    runtime_limited_jobs_per_s: BTreeMap<String, f64>,
    /// Each case's throughput over the run without limits beside it: the
    /// median of [`LIMIT_ROUNDS`] pairs.
    runtime_limited_ratio: BTreeMap<String, f64>,
    runtime_ordered: ordered::Report,
    runtime_tuned_jobs_per_s: f64,
    tuned_settings: String,
    latency_listen_ms: Percentiles,
    latency_poll_ms: Percentiles,
    poll_interval_ms: u64,
    exec_jobs_per_s: f64,
    wal_bytes_per_job: f64,
    dead_tuples: i64,
    enqueue: enqueue::Report,
    tracing: traced::Report,
}

const KIND: &str = "bench";

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.jobs > 0, "--jobs must be at least 1");
    anyhow::ensure!(args.connections > 0, "--connections must be at least 1");
    anyhow::ensure!(args.latency_jobs > 0, "--latency-jobs must be at least 1");
    let base = ctx.connect_options()?;
    if let Some(sizes) = &args.scale {
        return scale::run(base, &args, sizes).await;
    }
    let scratch = scratch(base, args.connections).await?;
    if args.tracing_only {
        let result = traced::measure(&scratch.0, args.jobs).await;
        return report(scratch, result, args.json, traced::print_table).await;
    }
    if args.ordering_only {
        let result = ordered::measure(&scratch.0, args.jobs).await;
        return report(scratch, result, args.json, ordered::print_table).await;
    }
    if args.retention_only {
        let result = retention::measure(&scratch.0, &args.retention).await;
        return report(scratch, result, args.json, retention::print_table).await;
    }
    if args.enqueue_only {
        let result = enqueue::measure(&scratch.0, args.connections, &args.enqueue).await;
        return report(scratch, result, args.json, enqueue::print_table).await;
    }
    let result = measure(&scratch.0, &args).await;
    report(scratch, result, args.json, print_table).await
}

/// The scratch database, migrated, with the options it was made from and
/// its name: what [`report`] drops.
type Scratch = (PgPool, sqlx::postgres::PgConnectOptions, String);

/// Creates and migrates `almanac_bench_<pid>` next to `base`'s database;
/// dropped again when migrating it fails.
async fn scratch(
    base: sqlx::postgres::PgConnectOptions,
    connections: usize,
) -> anyhow::Result<Scratch> {
    let name = format!("almanac_bench_{}", std::process::id());
    let options = base
        .clone()
        .database(&name)
        .application_name("almanac-bench");
    let pool = db::connect_with(options, (connections as u32 + 2).max(12)).await?;
    if let Err(err) = db::migrate(&pool).await {
        pool.close().await;
        drop_database(&base, &name).await;
        return Err(err.into());
    }
    Ok((pool, base, name))
}

/// Drops the scratch database, then prints `result` as one JSON object or
/// as a table.
async fn report<R: Serialize>(
    (pool, base, name): Scratch,
    result: anyhow::Result<R>,
    json: bool,
    table: fn(&R),
) -> anyhow::Result<()> {
    pool.close().await;
    drop_database(&base, &name).await;
    let report = result?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        table(&report);
    }
    Ok(())
}

async fn drop_database(base: &sqlx::postgres::PgConnectOptions, name: &str) {
    let admin = base.clone().database("postgres");
    match sqlx::PgConnection::connect_with(&admin).await {
        Ok(mut conn) => {
            if let Err(err) =
                sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .execute(&mut conn)
                    .await
            {
                tracing::warn!(%err, database = name, "could not drop the scratch database; drop it by hand");
            }
        }
        Err(err) => {
            tracing::warn!(%err, database = name, "could not drop the scratch database; drop it by hand")
        }
    }
}

async fn measure(pool: &PgPool, args: &Args) -> anyhow::Result<Report> {
    let mut raw = BTreeMap::new();
    for batch in [1usize, 10, 100, 1000] {
        // Small batches are slow: size each run to take seconds, not minutes.
        let n = (batch as u64 * 2000).clamp(2000, args.jobs.max(2000));
        fill(pool, n).await?;
        raw.insert(batch, raw_burn(pool, args.connections, batch, n).await?);
        eprintln!("raw batch {batch}: {:.0} jobs/s", raw[&batch]);
    }

    vacuum(pool).await?;
    let wal_before = wal_lsn(pool).await?;
    fill(pool, args.jobs).await?;
    let default = burn(pool, WorkerConfig::default(), args.jobs).await?;
    let wal_after = wal_lsn(pool).await?;
    let dead_tuples = dead_tuples(pool).await?;
    eprintln!("runtime (defaults): {default:.0} jobs/s");

    // The same burn-down under limits that do not bind, side by side:
    // what a limit costs when it holds nothing back.
    let (limited, limited_ratio) = limited_burns(pool, args.jobs).await?;
    let ordered = ordered::measure(pool, args.jobs).await?;

    vacuum(pool).await?;
    let tuned_config = WorkerConfig {
        concurrency: args.tuned_concurrency,
        batch_size: args.tuned_batch_size,
        poll_interval: Duration::from_millis(10),
        ..WorkerConfig::default()
    };
    let tuned_settings = format!(
        "--concurrency {} --batch-size {} --poll-interval 10ms",
        args.tuned_concurrency, args.tuned_batch_size
    );
    fill(pool, args.jobs).await?;
    let tuned = burn(pool, tuned_config, args.jobs).await?;
    eprintln!("runtime (tuned): {tuned:.0} jobs/s");

    let listen = latency(pool, 0, true, args.latency_jobs).await?;
    let poll_interval = Duration::from_millis(100);
    let poll = latency_polling(pool, poll_interval, args.latency_jobs).await?;

    vacuum(pool).await?;
    fill(pool, args.exec_jobs).await?;
    let exec = burn_exec(pool).await?;

    let enqueue = enqueue::measure(pool, args.connections, &args.enqueue).await?;
    let tracing = traced::measure(pool, args.jobs).await?;

    Ok(Report {
        jobs: args.jobs,
        connections: args.connections,
        raw_jobs_per_s: raw,
        runtime_default_jobs_per_s: default,
        runtime_limited_jobs_per_s: limited,
        runtime_limited_ratio: limited_ratio,
        runtime_ordered: ordered,
        runtime_tuned_jobs_per_s: tuned,
        tuned_settings,
        latency_listen_ms: listen,
        latency_poll_ms: poll,
        poll_interval_ms: poll_interval.as_millis() as u64,
        exec_jobs_per_s: exec,
        wal_bytes_per_job: (wal_after - wal_before) as f64 / args.jobs as f64,
        dead_tuples,
        enqueue,
        tracing,
    })
}

/// Pairs of burn-downs per limit case: a run without limits, then one
/// under the case's limits, in each pair. A ratio from one pair is at the
/// mercy of whatever else the machine does for those seconds; the median
/// of a few pairs is not.
const LIMIT_ROUNDS: usize = 3;

/// Per case of [`unbinding_limits`]: the median throughput under the
/// limits, and the median ratio to the run without limits in its pair.
async fn limited_burns(
    pool: &PgPool,
    jobs: u64,
) -> anyhow::Result<(BTreeMap<String, f64>, BTreeMap<String, f64>)> {
    let actor = crate::control::Actor::new("almanac bench", crate::control::Source::Cli);
    let mut rates = BTreeMap::new();
    let mut ratios = BTreeMap::new();
    // Each run starts from a vacuumed table; an autovacuum that starts in
    // one run of a pair and not the other would be all its ratio showed.
    sqlx::query("ALTER TABLE almanac.jobs SET (autovacuum_enabled = false)")
        .execute(pool)
        .await?;
    for (case, limits) in unbinding_limits() {
        let mut case_rates = Vec::new();
        let mut case_ratios = Vec::new();
        for _ in 0..LIMIT_ROUNDS {
            vacuum(pool).await?;
            fill(pool, jobs).await?;
            let without = burn(pool, WorkerConfig::default(), jobs).await?;
            vacuum(pool).await?;
            fill(pool, jobs).await?;
            let mut conn = pool.acquire().await?;
            crate::control::limits::set(&mut conn, &actor, KIND, &limits).await?;
            let rate = burn(pool, WorkerConfig::default(), jobs).await?;
            crate::control::limits::clear(&mut conn, &actor, KIND).await?;
            case_rates.push(rate);
            case_ratios.push(rate / without);
        }
        let (rate, ratio) = (median(&mut case_rates), median(&mut case_ratios));
        eprintln!("runtime (defaults) under {case}: {rate:.0} jobs/s ({ratio:.2} of without, median of {LIMIT_ROUNDS} pairs)");
        rates.insert(case.to_string(), rate);
        ratios.insert(case.to_string(), ratio);
    }
    sqlx::query("ALTER TABLE almanac.jobs RESET (autovacuum_enabled)")
        .execute(pool)
        .await?;
    Ok((rates, ratios))
}

/// The median of a non-empty set of figures (of an even number, the mean
/// of the middle two).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 0 {
        (values[mid - 1] + values[mid]) / 2.0
    } else {
        values[mid]
    }
}

/// Limits that never bind: each kind of limit alone, and all three at
/// once. The per-key pointer names a key every job has, a different value
/// each: a per-key limit of 1,000 is one no key can reach in a claim (the
/// claim skips counting keys), a per-key limit of 1 is one every claim
/// must count keys for.
fn unbinding_limits() -> [(&'static str, Limits); 5] {
    let global = Limits {
        global: Some(1_000_000),
        ..Limits::default()
    };
    let per_key = Limits {
        per_key: Some(PerKey {
            pointer: "/customer".to_string(),
            limit: 1_000,
        }),
        ..Limits::default()
    };
    let per_key_one = Limits {
        per_key: Some(PerKey {
            pointer: "/customer".to_string(),
            limit: 1,
        }),
        ..Limits::default()
    };
    let rate = Limits {
        rate: Some(Rate {
            count: 1_000_000_000,
            period: Duration::from_secs(1),
        }),
        burst: 1_000_000,
        ..Limits::default()
    };
    let all = Limits {
        global: global.global,
        per_key: per_key.per_key.clone(),
        rate: rate.rate,
        burst: rate.burst,
    };
    [
        ("a global limit", global),
        ("a per-key limit of 1,000", per_key),
        ("a per-key limit of 1", per_key_one),
        ("a rate limit", rate),
        ("global, per-key and rate limits", all),
    ]
}

/// `n` ready no-op jobs, due now, in one statement; each has a payload
/// with a key of its own (`customer`, for the per-key limit).
async fn fill(pool: &PgPool, n: u64) -> anyhow::Result<()> {
    fill_with(pool, n, "jsonb_build_object('customer', g)", "NULL").await
}

/// [`fill`] with each job's payload and traceparent given as SQL over
/// `g`, its number.
async fn fill_with(pool: &PgPool, n: u64, payload: &str, traceparent: &str) -> anyhow::Result<()> {
    fill_above(pool, 0, n, payload, traceparent).await
}

/// [`fill_with`] that replaces only the jobs above id `floor`: the
/// measurement's own (`bench --scale` keeps its background below it).
async fn fill_above(
    pool: &PgPool,
    floor: i64,
    n: u64,
    payload: &str,
    traceparent: &str,
) -> anyhow::Result<()> {
    clear_above(pool, floor).await?;
    sqlx::query(&format!(
        "INSERT INTO almanac.jobs (kind, run_at, payload, traceparent) \
         SELECT $1, now() - interval '1 second', {payload}, {traceparent} \
         FROM generate_series(1, $2) AS g"
    ))
    .bind(KIND)
    .bind(n as i64)
    .execute(pool)
    .await
    .context("filling the scratch queue")?;
    sqlx::query("ANALYZE almanac.jobs").execute(pool).await?;
    Ok(())
}

async fn vacuum(pool: &PgPool) -> anyhow::Result<()> {
    vacuum_above(pool, 0).await
}

/// Deletes the jobs above id `floor`, then vacuums the table and its
/// indexes. `INDEX_CLEANUP ON`: a plain VACUUM skips the indexes when
/// fewer than 2% of the table's pages hold dead rows (PostgreSQL 14 on),
/// which the last figure's jobs are on a big background; their entries
/// would stay in `jobs_ready_kind_idx`, at the head of the bench kind's
/// range, and every claim of the next figure would walk over them (at
/// 10,000,000 jobs: 890 index pages, 2 ms, for each one-job claim).
async fn vacuum_above(pool: &PgPool, floor: i64) -> anyhow::Result<()> {
    clear_above(pool, floor).await?;
    sqlx::query("VACUUM (INDEX_CLEANUP ON) almanac.jobs")
        .execute(pool)
        .await?;
    Ok(())
}

async fn clear_above(pool: &PgPool, floor: i64) -> anyhow::Result<()> {
    sqlx::query("DELETE FROM almanac.jobs WHERE id > $1")
        .bind(floor)
        .execute(pool)
        .await?;
    Ok(())
}

async fn wal_lsn(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")
            .fetch_one(pool)
            .await?,
    )
}

async fn dead_tuples(pool: &PgPool) -> anyhow::Result<i64> {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .ok();
    Ok(sqlx::query_scalar(
        "SELECT coalesce(n_dead_tup, 0) FROM pg_stat_user_tables WHERE relid = 'almanac.jobs'::regclass",
    )
    .fetch_one(pool)
    .await?)
}

/// The raw statements: each connection claims `batch` and completes them.
async fn raw_burn(pool: &PgPool, connections: usize, batch: usize, n: u64) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..connections {
        let pool = pool.clone();
        tasks.spawn(async move {
            let kinds = [KIND.to_string()];
            let mut conn = pool.acquire().await?;
            loop {
                let jobs = queue::claim(
                    &mut *conn,
                    &Claim {
                        kinds: &kinds,
                        limit: batch as i64,
                        lease: Duration::from_secs(60),
                    },
                )
                .await?;
                if jobs.is_empty() {
                    return Ok::<_, anyhow::Error>(());
                }
                let leases: Vec<_> = jobs
                    .iter()
                    .map(|j| (j.id, j.lease_token.expect("claimed")))
                    .collect();
                queue::complete_many(&mut conn, &leases).await?;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// Burns down the queue with the worker runtime; jobs/s until the last
/// outcome is recorded.
async fn burn(pool: &PgPool, config: WorkerConfig, jobs: u64) -> anyhow::Result<f64> {
    burn_with(pool, config, jobs, crate::telemetry::Tracer::off()).await
}

/// [`burn`], tracing into `tracer`.
async fn burn_with(
    pool: &PgPool,
    config: WorkerConfig,
    jobs: u64,
    tracer: crate::telemetry::Tracer,
) -> anyhow::Result<f64> {
    let ran = Arc::new(AtomicU64::new(0));
    let counter = ran.clone();
    let worker = Worker::new(pool.clone(), config.validated()?)
        .with_tracer(tracer)
        .register(KIND, move |_ctx: JobContext| {
            counter.fetch_add(1, Ordering::Relaxed);
            async { Ok(()) }
        });
    timed_burn(pool, worker, Some((ran, jobs))).await
}

async fn burn_exec(pool: &PgPool) -> anyhow::Result<f64> {
    let worker = Worker::new(pool.clone(), WorkerConfig::for_commands().validated()?).register(
        KIND,
        ExecHandler::new("true").watchdog(crate::worker::watchdog::this_executable()),
    );
    timed_burn(pool, worker, None).await
}

/// `ran`: a count of handler calls and the number of jobs; until it is
/// reached the database is not asked at all (each probe walks the dead
/// index entries of every job claimed so far, work the raw figures do not
/// carry).
async fn timed_burn(
    pool: &PgPool,
    worker: Worker,
    ran: Option<(Arc<AtomicU64>, u64)>,
) -> anyhow::Result<f64> {
    let since: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await?;
    let stop = CancellationToken::new();
    let started = Instant::now();
    let running = tokio::spawn(worker.run(stop.clone()));
    if let Some((ran, jobs)) = ran {
        while ran.load(Ordering::Relaxed) < jobs {
            if running.is_finished() {
                anyhow::bail!("the worker stopped with jobs left");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    loop {
        // Two index probes that stop at the first row (0.2 ms). Counting
        // the unfinished rows took 7 ms at 100,000 ready: a third of a core
        // taken from the database being measured.
        // Only the bench kind's: `bench --scale` has other kinds' rows
        // ready in the future and running beside them.
        let left: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM almanac.jobs WHERE status = 'ready' AND kind = $1)
                 OR EXISTS (SELECT 1 FROM almanac.jobs WHERE status = 'running' AND kind = $1)
                 OR EXISTS (SELECT 1 FROM almanac.jobs
                             WHERE status = 'held' AND ordering_key IS NOT NULL AND kind = $1)",
        )
        .bind(KIND)
        .fetch_one(pool)
        .await?;
        if !left {
            break;
        }
        if running.is_finished() {
            anyhow::bail!("the worker stopped with jobs left");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let elapsed = started.elapsed();
    stop.cancel();
    running.await??;
    // The jobs this burn finished (a range of `jobs_done_finished_idx`,
    // not a count of every done row `bench --scale` keeps).
    let done: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM almanac.jobs WHERE status = 'done' AND finished_at >= $1 AND kind = $2",
    )
    .bind(since)
    .bind(KIND)
    .fetch_one(pool)
    .await?;
    Ok(done as f64 / elapsed.as_secs_f64())
}

/// Enqueue commit -> handler start, one job at a time into an idle queue.
/// `floor`: the jobs at or below that id are kept (see [`fill_above`]).
async fn latency(
    pool: &PgPool,
    floor: i64,
    listen: bool,
    samples: usize,
) -> anyhow::Result<Percentiles> {
    let config = WorkerConfig {
        listen,
        ..WorkerConfig::default()
    };
    sampled_latency(pool, floor, config, samples).await
}

async fn latency_polling(
    pool: &PgPool,
    poll: Duration,
    samples: usize,
) -> anyhow::Result<Percentiles> {
    let config = WorkerConfig {
        listen: false,
        poll_interval: poll,
        ..WorkerConfig::default()
    };
    sampled_latency(pool, 0, config, samples).await
}

async fn sampled_latency(
    pool: &PgPool,
    floor: i64,
    config: WorkerConfig,
    samples: usize,
) -> anyhow::Result<Percentiles> {
    vacuum_above(pool, floor).await?;
    let started_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let started = Arc::new(Notify::new());
    let (slot, signal) = (started_at.clone(), started.clone());
    let worker =
        Worker::new(pool.clone(), config.validated()?).register(KIND, move |_ctx: JobContext| {
            *slot.lock().expect("latency slot") = Some(Instant::now());
            signal.notify_one();
            async { Ok(()) }
        });
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    // Let the worker settle (LISTEN connected, first idle poll done).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut millis = Vec::with_capacity(samples);
    let mut conn = pool.acquire().await?;
    for _ in 0..samples {
        *started_at.lock().expect("latency slot") = None;
        queue::enqueue(&mut conn, &queue::NewJob::new(KIND)).await?;
        let committed = Instant::now();
        tokio::time::timeout(Duration::from_secs(30), started.notified())
            .await
            .context("a job did not start within 30 s")?;
        let at = started_at
            .lock()
            .expect("latency slot")
            .context("the handler signalled without a start time")?;
        millis.push(at.saturating_duration_since(committed).as_secs_f64() * 1000.0);
    }
    stop.cancel();
    running.await??;
    millis.sort_by(f64::total_cmp);
    let at =
        |q: f64| millis[((millis.len() as f64 * q).ceil() as usize).clamp(1, millis.len()) - 1];
    Ok(Percentiles {
        p50: at(0.50),
        p99: at(0.99),
        max: *millis.last().expect("at least one sample"),
    })
}

fn print_table(r: &Report) {
    println!(
        "almanac bench: {} jobs per burn-down, {} raw connections",
        r.jobs, r.connections
    );
    println!();
    println!("{:<44} {:>14}", "what", "jobs/s");
    for (batch, rate) in &r.raw_jobs_per_s {
        println!(
            "{:<44} {:>14.0}",
            format!("raw claim + complete, batch {batch}"),
            rate
        );
    }
    let best = r.raw_jobs_per_s.values().copied().fold(0.0, f64::max);
    println!(
        "{:<44} {:>14.0}  ({:.2} of best raw)",
        "worker runtime, default settings",
        r.runtime_default_jobs_per_s,
        r.runtime_default_jobs_per_s / best
    );
    for (case, rate) in &r.runtime_limited_jobs_per_s {
        println!(
            "{:<44} {:>14.0}  ({:.2} of without, beside it)",
            format!("  the same under {case} (never reached)"),
            rate,
            r.runtime_limited_ratio[case]
        );
    }
    ordered::print_table(&r.runtime_ordered);
    println!(
        "{:<44} {:>14.0}  ({:.2} of best raw)",
        "worker runtime, tuned",
        r.runtime_tuned_jobs_per_s,
        r.runtime_tuned_jobs_per_s / best
    );
    println!("  tuned: {}", r.tuned_settings);
    println!(
        "{:<44} {:>14.0}",
        "exec handler (`true`), default settings", r.exec_jobs_per_s
    );
    println!();
    println!(
        "{:<44} {:>8} {:>8} {:>8}",
        "enqueue commit -> handler start (ms)", "p50", "p99", "max"
    );
    println!(
        "{:<44} {:>8.2} {:>8.2} {:>8.2}",
        "LISTEN/NOTIFY", r.latency_listen_ms.p50, r.latency_listen_ms.p99, r.latency_listen_ms.max
    );
    println!(
        "{:<44} {:>8.2} {:>8.2} {:>8.2}",
        format!("polling only, every {} ms", r.poll_interval_ms),
        r.latency_poll_ms.p50,
        r.latency_poll_ms.p99,
        r.latency_poll_ms.max
    );
    println!();
    println!(
        "WAL per job (enqueue + claim + complete): {:.0} bytes",
        r.wal_bytes_per_job
    );
    println!(
        "dead tuples in almanac.jobs after the default burn-down: {}",
        r.dead_tuples
    );
    enqueue::print_table(&r.enqueue);
    traced::print_table(&r.tracing);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers one walk to the first due job of the bench's kind reads:
    /// the claim's range of `jobs_ready_kind_idx` and its heap visits.
    async fn walk_buffers(pool: &PgPool) -> i64 {
        let plan: serde_json::Value = sqlx::query_scalar(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
             SELECT id FROM almanac.jobs
             WHERE kind = $1 AND status = 'ready' AND run_at <= now()
             ORDER BY kind, run_at, id LIMIT 1",
        )
        .bind(KIND)
        .fetch_one(pool)
        .await
        .unwrap();
        let top = &plan[0]["Plan"];
        top["Shared Hit Blocks"].as_i64().unwrap() + top["Shared Read Blocks"].as_i64().unwrap()
    }

    /// A figure's jobs, claimed and then cleared by [`vacuum_above`], leave
    /// nothing in the ready index for the next figure's claims to walk,
    /// even when they sit on under 2% of a big table's pages (where a
    /// plain VACUUM skips the indexes).
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn vacuum_above_leaves_no_dead_entries_in_the_ready_index(pool: PgPool) {
        sqlx::query(
            "INSERT INTO almanac.jobs (kind, run_at)
             SELECT 'background', now() + interval '1 day' FROM generate_series(1, 200000)",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("VACUUM ANALYZE almanac.jobs")
            .execute(&pool)
            .await
            .unwrap();
        let floor: i64 = sqlx::query_scalar("SELECT max(id) FROM almanac.jobs")
            .fetch_one(&pool)
            .await
            .unwrap();
        // The last figure's 2,000 jobs, run (their ready entries dead).
        fill_above(&pool, floor, 2000, "'{}'::jsonb", "NULL")
            .await
            .unwrap();
        sqlx::query("UPDATE almanac.jobs SET status = 'done', attempts = 1, finished_at = now() WHERE id > $1")
            .bind(floor)
            .execute(&pool)
            .await
            .unwrap();
        vacuum_above(&pool, floor).await.unwrap();
        fill_above(&pool, floor, 1, "'{}'::jsonb", "NULL")
            .await
            .unwrap();
        // A plain VACUUM here leaves the 2,000 entries: the walk then reads
        // their index and heap pages (58 buffers measured).
        let first = walk_buffers(&pool).await;
        assert!(
            first < 10,
            "the walk to the one due job read {first} buffers: dead entries were left in the index"
        );
    }
}
