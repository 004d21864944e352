//! `almanac audit [--limit N] [--json]`: the audit log, newest first; every
//! operator action from the CLI, the dashboard or the API
//! ([`crate::control::audit`]).

use super::Ctx;
use crate::control::audit;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// How many rows, newest first (1 to 10000).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    limit: i64,
    /// Only rows older than this audit row id (to page back).
    #[arg(long)]
    before: Option<i64>,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    let pool = ctx.pool().await?;
    let entries = audit::list(&pool, args.limit, args.before).await?;
    if args.json {
        for e in &entries {
            println!("{}", serde_json::to_string(e)?);
        }
        return Ok(());
    }
    if entries.is_empty() {
        println!("(no action logged)");
        return Ok(());
    }
    println!(
        "{:<8} {:<21} {:<20} {:<9} {:<12} {:<28} {:>6} NOTE",
        "ID", "AT", "ACTOR", "SOURCE", "ACTION", "TARGET", "COUNT"
    );
    for e in &entries {
        println!(
            "{:<8} {:<21} {:<20} {:<9} {:<12} {:<28} {:>6} {}",
            e.id,
            e.at.format("%Y-%m-%dT%H:%M:%SZ"),
            e.actor,
            e.source,
            e.action,
            e.target,
            e.count,
            e.note.as_deref().unwrap_or("")
        );
    }
    Ok(())
}
