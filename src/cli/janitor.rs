//! `almanac janitor --once`: one retention pass, printing what it deleted.

use anyhow::bail;

use super::ops::JanitorFlags;
use super::Ctx;
use crate::maintenance::Janitor;
use crate::role::Periodic;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Run one pass and exit (the janitor role in `almanac run` repeats it).
    #[arg(long)]
    once: bool,
    /// One JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    janitor: JanitorFlags,
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    if !args.once {
        bail!("`almanac janitor` needs --once; the janitor runs continuously as a role of `almanac run`");
    }
    let config = args.janitor.resolve(ctx)?;
    let pool = ctx.pool().await?;
    let once = tokio_util::sync::CancellationToken::new();
    let report = Janitor::new(pool, config).run_once(&once).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "deleted {} done job{}, {} dead job{}, {} cancelled job{} and {} published outbox row{} ({} batch{})",
            report.done,
            plural(report.done),
            report.dead,
            plural(report.dead),
            report.cancelled,
            plural(report.cancelled),
            report.outbox,
            plural(report.outbox),
            report.batches,
            if report.batches == 1 { "" } else { "es" }
        );
    }
    Ok(())
}

fn plural(n: u64) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}
