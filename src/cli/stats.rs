//! `almanac stats [--json]`

use super::Ctx;
use crate::queue;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// One JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    let pool = ctx.pool().await?;
    let stats = queue::stats(&mut *pool.acquire().await?).await?;
    if args.json {
        println!("{}", serde_json::to_string(&stats)?);
        return Ok(());
    }
    println!("{:<24} {:<8} {:>10}", "KIND", "STATUS", "JOBS");
    for row in &stats.by_kind_status {
        println!("{:<24} {:<8} {:>10}", row.kind, row.status, row.count);
    }
    if stats.by_kind_status.is_empty() {
        println!("(no jobs)");
    }
    println!();
    println!(
        "oldest due ready job:   {:.1}s waiting",
        stats.oldest_due_ready_seconds
    );
    println!("expired leases:         {}", stats.expired_leases);
    println!("dead jobs:              {}", stats.dead);
    Ok(())
}
