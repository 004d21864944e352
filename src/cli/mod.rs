//! The `almanac` command line: one file per subcommand, each with its `Args`
//! and `run()`. Errors reach the person as `error: ...` on stderr with exit
//! status 1 (2 for usage errors, from clap).

mod audit;
mod backfill;
mod bench;
mod bulk;
mod consume;
#[cfg(test)]
mod doc_samples;
mod enqueue;
mod janitor;
mod jobs;
mod kinds;
mod limits;
mod migrate;
mod ops;
mod ordering;
mod route;
mod run;
mod schedules;
pub mod settings;
mod sinks;
mod stats;
mod tracing_flags;
mod work;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};
use sqlx::PgPool;

use crate::config::{Config, LogFormat, DEFAULT_DATABASE_URL};
use crate::db;
pub(crate) use settings::invalid;

#[derive(Debug, Parser)]
#[command(
    name = "almanac",
    version,
    about = "Scheduler and outbox relay on PostgreSQL"
)]
pub struct Cli {
    /// PostgreSQL URL; the database is created when missing
    /// [default: postgres://postgres@127.0.0.1:5432/almanac].
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// Config file (default: ./almanac.toml when present).
    #[arg(long, env = "ALMANAC_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// Log format on stderr [default: human].
    #[arg(long, env = "ALMANAC_LOG_FORMAT", global = true, value_enum)]
    log_format: Option<LogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the database migrations (schema `almanac`).
    Migrate(migrate::Args),
    /// Enqueue one job and print its id.
    Enqueue(enqueue::Args),
    /// List, inspect, retry or cancel jobs.
    Jobs(jobs::Args),
    /// Pause or resume job kinds on every worker and consumer.
    Kinds(kinds::Args),
    /// Set, clear or list a kind's concurrency and rate limits.
    Limits(limits::Args),
    /// Run a kind's jobs one at a time per ordering key, in enqueue order.
    Ordering(ordering::Args),
    /// The audit log of operator actions, newest first.
    Audit(audit::Args),
    /// Queue health: jobs by status and kind, oldest due job, expired leases.
    Stats(stats::Args),
    /// Run the service roles (scheduler, reaper, janitor, metrics, relay) until SIGINT/SIGTERM.
    Run(run::Args),
    /// Measure the queue on this database (a scratch database, dropped after).
    Bench(bench::Args),
    /// Delete finished jobs and published outbox rows past retention.
    Janitor(janitor::Args),
    /// Run jobs with shell-command handlers until SIGINT/SIGTERM.
    Work(work::Args),
    /// Check, list and preview schedules.
    Schedules(schedules::Args),
    /// Emit every missing logical run of a schedule in a date range.
    Backfill(backfill::BackfillArgs),
    /// List the logical runs of a schedule that have no ledger row.
    Gaps(backfill::GapsArgs),
    /// Show or change how each job kind is delivered (db, dual, broker).
    Route(route::Args),
    /// Run jobs from Kafka or RabbitMQ messages with shell-command handlers.
    Consume(consume::Args),
}

/// `--schedules DIR`, shared by every command that reads schedule files.
#[derive(Debug, Clone, clap::Args)]
pub struct SchedulesDir {
    /// Directory of schedule files (*.toml) [default: schedules].
    #[arg(long = "schedules", env = "ALMANAC_SCHEDULES")]
    dir: Option<PathBuf>,
}

impl SchedulesDir {
    pub fn resolve(&self, ctx: &Ctx) -> PathBuf {
        self.dir
            .clone()
            .or_else(|| ctx.config.schedules_dir.clone())
            .unwrap_or_else(|| PathBuf::from("schedules"))
    }

    /// Loads every schedule, or fails with each problem at its file and line.
    pub fn load(&self, ctx: &Ctx) -> anyhow::Result<Vec<crate::scheduler::spec::Schedule>> {
        Ok(crate::scheduler::spec::load_dir(&self.resolve(ctx))?)
    }

    pub fn find(&self, ctx: &Ctx, name: &str) -> anyhow::Result<crate::scheduler::spec::Schedule> {
        let dir = self.resolve(ctx);
        let all = self.load(ctx)?;
        let names: Vec<String> = all.iter().map(|s| s.name.clone()).collect();
        all.into_iter().find(|s| s.name == name).ok_or_else(|| {
            anyhow::anyhow!(
                "no schedule named `{name}` in {}; known: {} (see `almanac schedules list`)",
                dir.display(),
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            )
        })
    }
}

/// What every subcommand gets: the resolved config and a way to the database.
pub struct Ctx {
    pub config: Config,
    database_url: String,
}

impl Ctx {
    pub fn connect_options(&self) -> anyhow::Result<sqlx::postgres::PgConnectOptions> {
        Ok(db::parse_url(&self.database_url)?)
    }

    /// Connects and applies pending migrations (for the long-running roles).
    pub async fn migrated_pool(&self, max_connections: u32) -> anyhow::Result<PgPool> {
        Ok(db::connect_and_migrate(&self.database_url, max_connections).await?)
    }

    /// Connects to a database that must already have the schema.
    pub async fn pool(&self) -> anyhow::Result<PgPool> {
        let pool = db::connect(&self.database_url, 2).await?;
        let state = db::schema::state(&pool)
            .await
            .context("checking the almanac schema")?;
        if let Some(problem) = state.problem() {
            bail!("{}: {problem}", db::Target::of(&pool.connect_options()));
        }
        if let Some(warning) = state.warning() {
            tracing::warn!("{warning}");
        }
        Ok(pool)
    }
}

pub async fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(cli.config.as_deref()) {
        Ok(config) => config,
        Err(err) => {
            init_logging(cli.log_format.unwrap_or(LogFormat::Human));
            return report(anyhow::Error::new(err));
        }
    };
    init_logging(
        cli.log_format
            .or(config.log_format)
            .unwrap_or(LogFormat::Human),
    );
    let database_url = cli
        .database_url
        .clone()
        .or_else(|| config.database_url.clone())
        .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_string());
    let ctx = Ctx {
        config,
        database_url,
    };
    let result = match cli.command {
        Command::Migrate(args) => migrate::run(&ctx, args).await,
        Command::Enqueue(args) => enqueue::run(&ctx, args).await,
        Command::Jobs(args) => jobs::run(&ctx, args).await,
        Command::Kinds(args) => kinds::run(&ctx, args).await,
        Command::Limits(args) => limits::run(&ctx, args).await,
        Command::Ordering(args) => ordering::run(&ctx, args).await,
        Command::Audit(args) => audit::run(&ctx, args).await,
        Command::Stats(args) => stats::run(&ctx, args).await,
        Command::Run(args) => run::run(&ctx, args).await,
        Command::Janitor(args) => janitor::run(&ctx, args).await,
        Command::Bench(args) => bench::run(&ctx, args).await,
        Command::Work(args) => work::run(&ctx, args).await,
        Command::Schedules(args) => schedules::run(&ctx, args).await,
        Command::Backfill(args) => backfill::run_backfill(&ctx, args).await,
        Command::Gaps(args) => backfill::run_gaps(&ctx, args).await,
        Command::Route(args) => route::run(&ctx, args).await,
        Command::Consume(args) => consume::run(&ctx, args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => report(err),
    }
}

fn report(err: anyhow::Error) -> ExitCode {
    eprintln!("error: {}", chain_text(&err));
    ExitCode::FAILURE
}

/// The error and its causes, `a: b: c`, leaving out a cause whose text the
/// message already carries (many errors repeat their source in `Display`).
pub fn chain_text(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

/// Posts the spans still queued at shutdown, waiting at most 5 s, and says
/// how many were dropped over the run (when tracing is on).
pub(crate) async fn flush_spans(tracer: &crate::telemetry::Tracer) {
    if !tracer.is_on() {
        return;
    }
    let flushed = tokio::time::timeout(std::time::Duration::from_secs(5), tracer.flush()).await;
    let report = tracer.report();
    if flushed.is_err() || report.dropped > 0 {
        tracing::warn!(
            exported = report.exported,
            dropped = report.dropped,
            flushed = flushed.is_ok(),
            "tracing: spans dropped (queue full or collector unreachable)"
        );
    }
}

fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
