//! `almanac bench`'s enqueue figures: what enqueueing through the SQL
//! function `almanac.enqueue(...)` costs beside the Rust API and beside the
//! hand-written INSERT + `pg_notify` clients wrote before it, side by side
//! in one run.
//!
//! - **one per transaction**: `--connections` connections, each running
//!   `BEGIN; <enqueue one job>; COMMIT` in a loop (a business transaction
//!   that enqueues one job), `--enqueue-jobs` jobs per way:
//!   - `almanac.enqueue(kind => $1, payload => $2)` from plain SQL;
//!   - the Rust API, `queue::enqueue` (which calls `almanac.enqueue` with
//!     all eight arguments bound);
//!   - by hand: `INSERT INTO almanac.jobs ... RETURNING id`, then
//!     `SELECT pg_notify('almanac_jobs', kind)` (the README's recipe before
//!     the function).
//! - **batches of 1,000 per transaction**, ten times as many jobs:
//!   `almanac.enqueue_many(kinds => $1, payloads => $2)` from SQL, the Rust
//!   API's `queue::enqueue_many`, and a plain `INSERT ... SELECT FROM
//!   unnest($1, $2) RETURNING id` with one `pg_notify`.
//!
//! Every way returns the new ids, as a client needs them. The ways take
//! turns in ten rounds (each round in another order, on an emptied and
//! vacuumed table), so that a slow spell of the shared machine falls on
//! all of them; each figure is the median of a way's ten rates. (One job
//! per transaction is bound by the commit: its WAL flush, which a commit
//! that notifies cannot share with another such commit, as PostgreSQL
//! serializes them; so the disk's mood moves these figures most.)

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::{Connection, PgConnection, PgPool};

use super::{vacuum, KIND};
use crate::queue::{self, NewJob, NOTIFY_CHANNEL};

#[derive(Debug, clap::Args)]
pub struct EnqueueArgs {
    /// Jobs enqueued one per transaction by each way of enqueueing (the
    /// batch figures enqueue ten times as many, 1,000 per transaction).
    #[arg(long, default_value_t = 10_000)]
    pub enqueue_jobs: u64,
}

/// Jobs in one batch.
const BATCH: usize = 1000;
/// Turns each way takes.
const ROUNDS: usize = 10;

/// One way of enqueueing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Way {
    SqlFunction,
    RustApi,
    HandWritten,
}

impl Way {
    const ALL: [Way; 3] = [Way::SqlFunction, Way::RustApi, Way::HandWritten];

    fn name(self) -> &'static str {
        match self {
            Way::SqlFunction => "sql_function",
            Way::RustApi => "rust_api",
            Way::HandWritten => "hand_written",
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Report {
    /// Jobs each one-per-transaction figure enqueued.
    pub jobs: u64,
    pub connections: usize,
    /// One job per transaction, jobs/s (the median of the rounds):
    /// `sql_function` (`almanac.enqueue`), `rust_api` (`queue::enqueue`),
    /// `hand_written` (INSERT + pg_notify).
    pub one_per_transaction_jobs_per_s: BTreeMap<&'static str, f64>,
    pub batch_size: usize,
    /// Jobs each batch figure enqueued.
    pub batch_jobs: u64,
    /// Batches per transaction, jobs/s: `sql_function`
    /// (`almanac.enqueue_many`), `rust_api` (`queue::enqueue_many`),
    /// `hand_written` (a plain unnest INSERT + pg_notify).
    pub batch_jobs_per_s: BTreeMap<&'static str, f64>,
}

pub async fn measure(
    pool: &PgPool,
    connections: usize,
    args: &EnqueueArgs,
) -> anyhow::Result<Report> {
    anyhow::ensure!(args.enqueue_jobs > 0, "--enqueue-jobs must be at least 1");
    let mut single = Figures::default();
    let mut batch = Figures::default();
    let per_round = args.enqueue_jobs.div_ceil(ROUNDS as u64);
    let batches_per_round = (per_round * 10).div_ceil(BATCH as u64);
    for round in 0..ROUNDS {
        // Each round in another order: no way is always first or last.
        let mut ways = Way::ALL;
        ways.rotate_left(round % Way::ALL.len());
        for way in ways {
            vacuum(pool).await?;
            let started = Instant::now();
            run(pool, connections, way, per_round, 1).await?;
            single.add(way, per_round, started.elapsed());
        }
        for way in ways {
            vacuum(pool).await?;
            let started = Instant::now();
            run(pool, connections, way, batches_per_round, BATCH).await?;
            batch.add(way, batches_per_round * BATCH as u64, started.elapsed());
        }
    }
    vacuum(pool).await?;
    let report = Report {
        jobs: per_round * ROUNDS as u64,
        connections,
        one_per_transaction_jobs_per_s: single.rates(),
        batch_size: BATCH,
        batch_jobs: batches_per_round * (BATCH * ROUNDS) as u64,
        batch_jobs_per_s: batch.rates(),
    };
    for (what, rates) in [
        (
            "one per transaction",
            &report.one_per_transaction_jobs_per_s,
        ),
        ("batches of 1000", &report.batch_jobs_per_s),
    ] {
        eprintln!(
            "enqueue, {what}: SQL function {:.0}, Rust API {:.0}, hand-written {:.0} jobs/s",
            rates["sql_function"], rates["rust_api"], rates["hand_written"]
        );
    }
    Ok(report)
}

/// Each way's rate in each round.
#[derive(Default)]
struct Figures(BTreeMap<Way, Vec<f64>>);

impl Figures {
    fn add(&mut self, way: Way, jobs: u64, took: Duration) {
        self.0
            .entry(way)
            .or_default()
            .push(jobs as f64 / took.as_secs_f64());
    }

    /// The median rate of each way.
    fn rates(&self) -> BTreeMap<&'static str, f64> {
        self.0
            .iter()
            .map(|(way, rates)| (way.name(), super::median(&mut rates.clone())))
            .collect()
    }
}

/// `transactions` transactions of `size` jobs each, spread over
/// `connections` connections.
pub(super) async fn run(
    pool: &PgPool,
    connections: usize,
    way: Way,
    transactions: u64,
    size: usize,
) -> anyhow::Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..connections as u64 {
        let share =
            transactions / connections as u64 + u64::from(c < transactions % connections as u64);
        let pool = pool.clone();
        tasks.spawn(async move {
            let mut conn = pool.acquire().await?;
            for t in 0..share {
                let mut tx = conn.begin().await?;
                let ids = enqueue(&mut tx, way, size, t).await?;
                anyhow::ensure!(ids == size, "{way:?} enqueued {ids} of {size} jobs");
                tx.commit().await?;
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(())
}

/// Enqueues `size` jobs `way`; the number of ids that came back.
async fn enqueue(conn: &mut PgConnection, way: Way, size: usize, t: u64) -> anyhow::Result<usize> {
    let payloads: Vec<serde_json::Value> = (0..size)
        .map(|i| serde_json::json!({"n": t * size as u64 + i as u64}))
        .collect();
    Ok(match (way, size) {
        (Way::SqlFunction, 1) => {
            let _: (i64, bool) = sqlx::query_as(
                "SELECT id, created FROM almanac.enqueue(kind => $1, payload => $2)",
            )
            .bind(KIND)
            .bind(&payloads[0])
            .fetch_one(&mut *conn)
            .await?;
            1
        }
        (Way::SqlFunction, _) => {
            let kinds = vec![KIND; size];
            let rows: Vec<(i64, i64, bool)> = sqlx::query_as(
                "SELECT ord, id, created FROM almanac.enqueue_many(kinds => $1, payloads => $2)",
            )
            .bind(&kinds)
            .bind(&payloads)
            .fetch_all(&mut *conn)
            .await?;
            rows.len()
        }
        (Way::RustApi, 1) => {
            let job = NewJob::new(KIND).payload(payloads.into_iter().next().expect("one"));
            queue::enqueue(conn, &job).await?;
            1
        }
        (Way::RustApi, _) => {
            let jobs: Vec<NewJob> = payloads
                .into_iter()
                .map(|p| NewJob::new(KIND).payload(p))
                .collect();
            queue::enqueue_many(conn, &jobs).await?.len()
        }
        (Way::HandWritten, 1) => {
            let _: i64 = sqlx::query_scalar(
                "INSERT INTO almanac.jobs (kind, payload) VALUES ($1, $2) RETURNING id",
            )
            .bind(KIND)
            .bind(&payloads[0])
            .fetch_one(&mut *conn)
            .await?;
            notify(conn).await?;
            1
        }
        (Way::HandWritten, _) => {
            let kinds = vec![KIND; size];
            let ids: Vec<i64> = sqlx::query_scalar(
                "INSERT INTO almanac.jobs (kind, payload) \
                 SELECT * FROM unnest($1::text[], $2::jsonb[]) RETURNING id",
            )
            .bind(&kinds)
            .bind(&payloads)
            .fetch_all(&mut *conn)
            .await?;
            notify(conn).await?;
            ids.len()
        }
    })
}

async fn notify(conn: &mut PgConnection) -> anyhow::Result<()> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(NOTIFY_CHANNEL)
        .bind(KIND)
        .execute(conn)
        .await?;
    Ok(())
}

/// The enqueue rows of `almanac bench`'s table.
pub fn print_table(r: &Report) {
    println!();
    println!(
        "{:<44} {:>14}",
        format!("enqueue, {} connections", r.connections),
        "jobs/s"
    );
    for (what, rates, size) in [
        (
            format!("one job per transaction ({} jobs each)", r.jobs),
            &r.one_per_transaction_jobs_per_s,
            1,
        ),
        (
            format!("a batch per transaction ({} jobs each)", r.batch_jobs),
            &r.batch_jobs_per_s,
            r.batch_size,
        ),
    ] {
        let base = rates["hand_written"];
        let label = |way: &str| match (way, size) {
            ("sql_function", 1) => "almanac.enqueue(...) from SQL".to_string(),
            ("sql_function", n) => format!("almanac.enqueue_many(...) of {n} from SQL"),
            ("rust_api", 1) => "Rust API queue::enqueue".to_string(),
            ("rust_api", n) => format!("Rust API queue::enqueue_many of {n}"),
            (_, 1) => "hand-written INSERT + pg_notify".to_string(),
            (_, n) => format!("plain unnest INSERT of {n} + pg_notify"),
        };
        println!("  {what}");
        for way in ["sql_function", "rust_api", "hand_written"] {
            let rate = rates[way];
            if way == "hand_written" {
                println!("{:<44} {:>14.0}", format!("    {}", label(way)), rate);
            } else {
                println!(
                    "{:<44} {:>14.0}  ({:.2} of hand-written)",
                    format!("    {}", label(way)),
                    rate,
                    rate / base
                );
            }
        }
    }
}
