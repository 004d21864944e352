//! `almanac backfill NAME --from --to [--dry-run]` and `almanac gaps NAME --from --to`

use std::io::Write as _;

use anyhow::bail;

use super::schedules::{parse_bound, print_run};
use super::{Ctx, SchedulesDir};
use crate::scheduler::backfill;

#[derive(Debug, clap::Args)]
pub struct BackfillArgs {
    name: String,
    /// First date (local to the schedule's zone) or RFC 3339 instant, inclusive.
    #[arg(long)]
    from: String,
    /// Last date or instant, inclusive.
    #[arg(long)]
    to: String,
    /// Report what would be emitted; write nothing.
    #[arg(long)]
    dry_run: bool,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    schedules: SchedulesDir,
}

#[derive(Debug, clap::Args)]
pub struct GapsArgs {
    name: String,
    #[arg(long)]
    from: String,
    #[arg(long)]
    to: String,
    /// One JSON object per missing run.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    schedules: SchedulesDir,
}

fn range(
    schedule: &crate::scheduler::spec::Schedule,
    from: &str,
    to: &str,
) -> anyhow::Result<(chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)> {
    let from = parse_bound(from, &schedule.timeline, "--from")?.start();
    let to = parse_bound(to, &schedule.timeline, "--to")?.end_inclusive(&schedule.timeline);
    if to <= from {
        bail!("--to is before --from");
    }
    Ok((from, to))
}

pub async fn run_backfill(ctx: &Ctx, args: BackfillArgs) -> anyhow::Result<()> {
    let schedule = args.schedules.find(ctx, &args.name)?;
    let (from, to) = range(&schedule, &args.from, &args.to)?;
    let pool = if args.dry_run {
        ctx.pool().await?
    } else {
        ctx.migrated_pool(2).await?
    };
    let mut conn = pool.acquire().await?;
    let report = backfill::backfill(
        &mut conn,
        &schedule,
        from,
        to,
        args.dry_run,
        |done, total| {
            if total >= 5_000 {
                eprint!("\rbackfill {}: {done}/{total} runs", schedule.name);
                let _ = std::io::stderr().flush();
                if done == total {
                    eprintln!();
                }
            }
        },
    )
    .await?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"schedule": schedule.name, "dry_run": args.dry_run, "report": report})
        );
        return Ok(());
    }
    let verb = if args.dry_run {
        "would emit"
    } else {
        "emitted"
    };
    println!(
        "{}{}: {} runs in range; {verb} {} new, {verb} {} previously skipped; {} already emitted",
        if args.dry_run { "dry run: " } else { "" },
        schedule.name,
        report.in_range,
        report.emitted,
        report.emitted_after_skip,
        report.already_emitted
    );
    Ok(())
}

pub async fn run_gaps(ctx: &Ctx, args: GapsArgs) -> anyhow::Result<()> {
    let schedule = args.schedules.find(ctx, &args.name)?;
    let (from, to) = range(&schedule, &args.from, &args.to)?;
    let pool = ctx.pool().await?;
    let mut conn = pool.acquire().await?;
    let missing = backfill::gaps(&mut conn, &schedule, from, to).await?;
    for run in &missing {
        print_run(run, schedule.timeline.tz(), args.json);
    }
    if !args.json {
        eprintln!(
            "{}: {} missing run{}",
            schedule.name,
            missing.len(),
            if missing.len() == 1 { "" } else { "s" }
        );
    }
    Ok(())
}
