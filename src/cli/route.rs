//! `almanac route show` and `almanac route set KIND --mode db|dual|broker`

use anyhow::Context as _;
use clap::Subcommand;

use super::sinks::SinkFlags;
use super::Ctx;
use crate::broker::{self, SinkKind};
use crate::config::HumanDuration;
use crate::relay::routes::{self, RouteMode};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: RouteCommand,
}

#[derive(Debug, Subcommand)]
enum RouteCommand {
    /// Every kind with a route (kinds not listed use db).
    Show {
        #[arg(long)]
        json: bool,
    },
    /// Change a kind's route, live for every running instance.
    Set {
        kind: String,
        #[arg(long, value_enum)]
        mode: RouteMode,
        /// Needed for dual and broker unless the kind already has one.
        #[arg(long, value_enum)]
        sink: Option<SinkKind>,
        /// Kafka topic, or RabbitMQ exchange and queue.
        #[arg(long)]
        destination: Option<String>,
        /// Give up (changing nothing) when transactions that enqueued the kind hold it longer than this.
        #[arg(long, env = "ALMANAC_ROUTE_LOCK_TIMEOUT", default_value = "5s")]
        lock_timeout: HumanDuration,
        #[command(flatten)]
        sinks: SinkFlags,
    },
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    match args.command {
        RouteCommand::Show { json } => {
            let pool = ctx.pool().await?;
            let all = routes::list(&mut *pool.acquire().await?).await?;
            if json {
                for route in &all {
                    println!("{}", serde_json::to_string(route)?);
                }
                return Ok(());
            }
            println!(
                "{:<24} {:<7} {:<9} {:<24} UPDATED",
                "KIND", "MODE", "SINK", "DESTINATION"
            );
            for r in &all {
                println!(
                    "{:<24} {:<7} {:<9} {:<24} {}",
                    r.kind,
                    r.mode,
                    r.sink.as_deref().unwrap_or("-"),
                    r.destination.as_deref().unwrap_or("-"),
                    r.updated_at.format("%Y-%m-%dT%H:%M:%SZ")
                );
            }
            if all.is_empty() {
                println!("(no routes: every kind runs from the database)");
            }
            Ok(())
        }
        RouteCommand::Set {
            kind,
            mode,
            sink,
            destination,
            lock_timeout,
            sinks,
        } => {
            let pool = ctx.migrated_pool(2).await?;
            let mut conn = pool.acquire().await?;
            let (sink_kind, dest) =
                routes::resolve(&mut conn, &kind, mode, sink, destination.as_deref()).await?;
            // The destination must exist before any job is routed to it.
            if let (RouteMode::Dual | RouteMode::Broker, Some(sink_kind), Some(dest)) =
                (mode, sink_kind, &dest)
            {
                let config = sinks.resolve(ctx)?;
                match broker::ensure_destination(sink_kind, &config, dest).await {
                    Err(err @ broker::SinkError::NotConfigured { .. }) => {
                        return Err(anyhow::Error::new(err).context("the route was not changed"))
                    }
                    other => other.with_context(|| {
                        format!("cannot prepare {sink_kind} destination `{dest}`; the route was not changed")
                    })?,
                }
            }
            let change = routes::set_within(
                &mut conn,
                &kind,
                mode,
                sink_kind,
                dest.as_deref(),
                lock_timeout.0,
                Some(&crate::control::Actor::os_user()),
            )
            .await?;
            let plural = |n: u64| if n == 1 { "" } else { "s" };
            let mut line = format!(
                "{kind}: {}{}; {} ready job{} moved to it",
                change.route.mode,
                match (&change.route.sink, &change.route.destination) {
                    (Some(s), Some(d)) if mode != RouteMode::Db => format!(" via {s} `{d}`"),
                    _ => String::new(),
                },
                change.jobs_moved,
                plural(change.jobs_moved)
            );
            if change.rows_readdressed > 0 {
                line += &format!(
                    "; {} pending message{} re-addressed",
                    change.rows_readdressed,
                    plural(change.rows_readdressed)
                );
            }
            if change.rows_dropped > 0 {
                line += &format!(
                    "; {} pending message{} dropped (workers run those jobs)",
                    change.rows_dropped,
                    plural(change.rows_dropped)
                );
            }
            println!("{line}");
            // The change is made; a failure to look at the consumers is a
            // note, not a failed command.
            if mode != RouteMode::Db {
                match crate::consumer::presence::gaps(&mut conn).await {
                    Ok(gaps) => {
                        for gap in gaps.iter().filter(|g| g.kind == kind) {
                            eprintln!("warning: {}", gap.describe());
                        }
                    }
                    Err(e) => eprintln!(
                        "note: the route is set, but the running consumers could not be read ({e}); see `almanac stats`"
                    ),
                }
            }
            Ok(())
        }
    }
}
