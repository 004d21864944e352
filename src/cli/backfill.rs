//! `almanac backfill NAME --from --to [--dry-run] [--allow-future]` and
//! `almanac gaps NAME --from --to`

use std::io::Write as _;

use anyhow::bail;

use super::schedules::{parse_bound, print_run};
use chrono::{DateTime, Utc};

use super::{Ctx, SchedulesDir};
use crate::scheduler::spec::Schedule;
use crate::scheduler::{backfill, history};

/// A schedule and a range of its runs, both ends inclusive.
#[derive(Debug, clap::Args)]
pub struct ScheduleRange {
    name: String,
    /// First date (local to the schedule's zone) or RFC 3339 instant, inclusive.
    #[arg(long)]
    from: String,
    /// Last date or instant, inclusive.
    #[arg(long)]
    to: String,
    #[command(flatten)]
    schedules: SchedulesDir,
}

impl ScheduleRange {
    /// The schedule from the files, and the range as `[from, to)` instants.
    fn resolve(&self, ctx: &Ctx) -> anyhow::Result<(Schedule, DateTime<Utc>, DateTime<Utc>)> {
        let schedule = self.schedules.find(ctx, &self.name)?;
        let from = parse_bound(&self.from, &schedule.timeline, "--from")?.start();
        let to =
            parse_bound(&self.to, &schedule.timeline, "--to")?.end_inclusive(&schedule.timeline);
        if to <= from {
            bail!("--to is before --from");
        }
        Ok((schedule, from, to))
    }
}

#[derive(Debug, clap::Args)]
pub struct BackfillArgs {
    #[command(flatten)]
    range: ScheduleRange,
    /// Report what would be emitted; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Also emit runs that are not due yet (refused by default).
    #[arg(long)]
    allow_future: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub struct GapsArgs {
    #[command(flatten)]
    range: ScheduleRange,
    /// One JSON object per missing run.
    #[arg(long)]
    json: bool,
}

pub async fn run_backfill(ctx: &Ctx, args: BackfillArgs) -> anyhow::Result<()> {
    let (schedule, from, to) = args.range.resolve(ctx)?;
    let pool = if args.dry_run {
        ctx.pool().await?
    } else {
        ctx.migrated_pool(2).await?
    };
    let mut conn = pool.acquire().await?;
    let range = backfill::Range {
        from,
        to,
        dry_run: args.dry_run,
        allow_future: args.allow_future,
    };
    let report = backfill::backfill(&mut conn, &schedule, range, |done, total| {
        if total >= 5_000 {
            eprint!("\rbackfill {}: {done}/{total} runs", schedule.name);
            let _ = std::io::stderr().flush();
            if done == total {
                eprintln!();
            }
        }
    })
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
    let (schedule, from, to) = args.range.resolve(ctx)?;
    let pool = ctx.pool().await?;
    let mut conn = pool.acquire().await?;
    let missing = backfill::gaps(&mut conn, &schedule, from, to).await?;
    for run in &missing {
        print_run(run, schedule.timeline.tz(), args.json);
    }
    if !args.json {
        if missing.is_empty()
            && history::synced_one(&mut conn, &schedule.name)
                .await?
                .is_none()
        {
            eprintln!(
                "{}: never synced (no scheduler or backfill has run it), so no run is expected yet",
                schedule.name
            );
        }
        eprintln!(
            "{}: {} missing run{}",
            schedule.name,
            missing.len(),
            if missing.len() == 1 { "" } else { "s" }
        );
    }
    Ok(())
}
