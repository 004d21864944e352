//! `almanac backfill NAME --from --to [--reprocess missing|failed|all]
//! [--max-active N] [--dry-run] [--allow-future]` and `almanac gaps NAME
//! --from --to`
//!
//! A backfill stopped with Ctrl-C says how far it got and exits 130; what
//! it had not emitted stays un-emitted (the rules are
//! [`crate::scheduler::reprocess`]'s).

use std::io::Write as _;

use anyhow::bail;

use super::schedules::{parse_bound, print_run};
use chrono::{DateTime, Utc};

use super::{Ctx, SchedulesDir};
use crate::scheduler::backfill::BackfillReport;
use crate::scheduler::reprocess::{self, Progress, Reprocess};
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
    /// Which runs get a job: `missing` (no job yet), `failed` (their job is
    /// dead: a new job replaces it), `all` (every run: finished jobs are
    /// replaced, missing runs emitted; active jobs are left alone).
    #[arg(long, value_enum, default_value_t = Reprocess::Missing)]
    reprocess: Reprocess,
    /// At most N jobs of the range ready or running at once: emit, wait
    /// for some to finish, emit more.
    #[arg(long, value_name = "N", value_parser = parse_max_active)]
    max_active: Option<std::num::NonZeroU32>,
    #[arg(long)]
    json: bool,
    /// Each emitted run gets its `almanac.schedule.run` span, its job's trace.
    #[command(flatten)]
    tracing: super::tracing_flags::TracingFlags,
}

/// Where an interrupted backfill continues: the first run not handled, as
/// an instant `--from` takes.
fn resume_at(run: &crate::scheduler::timeline::Run) -> String {
    run.fire_at.format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

fn parse_max_active(text: &str) -> Result<std::num::NonZeroU32, String> {
    match text.parse::<u32>() {
        Ok(n) if n >= 1 => Ok(std::num::NonZeroU32::new(n).expect("n >= 1")),
        _ => Err(format!(
            "`{text}` is not a number of jobs; give 1 or more (how many jobs of the range may be ready or running at once)"
        )),
    }
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
    let tracer = args.tracing.tracer_or_off(ctx);
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
    let options = reprocess::Options {
        reprocess: args.reprocess,
        max_active: args.max_active,
        ..Default::default()
    };
    let name = schedule.name.clone();
    // Registered before any work, so a Ctrl-C at any point is ours.
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    // How far it got, for the line Ctrl-C prints.
    let reached: std::cell::RefCell<(u64, u64, Option<String>)> = Default::default();
    let mut waiting = false;
    let work = reprocess::run(&mut conn, &schedule, range, options, &tracer, |p| match p {
        Progress::Step { done, total, next } => {
            *reached.borrow_mut() = (done, total, next.map(resume_at));
            if total >= 5_000 || args.max_active.is_some() {
                eprint!("\rbackfill {name}: {done}/{total} runs handled{:40}", "");
                let _ = std::io::stderr().flush();
                if done == total {
                    eprintln!();
                }
            }
            waiting = false;
        }
        Progress::Waiting {
            active,
            max,
            done,
            total,
            next,
        } => {
            *reached.borrow_mut() = (done, total, next.map(resume_at));
            if !waiting {
                eprint!(
                    "\rbackfill {name}: {done}/{total} runs handled; waiting: {active} of at most {max} jobs ready or running (next run {})",
                    next.map_or("-", |r| r.logical_run.as_str())
                );
                let _ = std::io::stderr().flush();
            }
            waiting = true;
        }
    });
    let report = tokio::select! {
        report = work => match report {
            Ok(report) => report,
            Err(err) => {
                super::flush_spans(&tracer).await;
                if let (Reprocess::All, (done, total, Some(next))) = (args.reprocess, &*reached.borrow()) {
                    eprintln!();
                    eprintln!(
                        "{name}: stopped by an error after {done} of {total} runs; with --reprocess all, running the same command again would run the runs already re-run again: continue with --from {next}, the fire time of the first run not handled"
                    );
                }
                return Err(err.into());
            }
        },
        _ = interrupt.recv() => {
            {
                let (done, total, next) = &*reached.borrow();
                eprintln!();
                eprintln!(
                    "{name}: interrupted after {done} of {total} runs; the rest were not emitted. Run the same command again to continue{}",
                    match (args.reprocess, next) {
                        (Reprocess::All, Some(next)) => format!(
                            " (with --reprocess all it would run the runs already re-run again: continue with --from {next}, the fire time of the first run not handled)"
                        ),
                        _ => String::new(),
                    }
                );
            }
            // The runs already committed keep their spans (their jobs name them).
            super::flush_spans(&tracer).await;
            std::process::exit(130);
        }
    };
    super::flush_spans(&tracer).await;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"schedule": schedule.name, "dry_run": args.dry_run, "report": report})
        );
        return Ok(());
    }
    println!("{}", describe(&schedule.name, args.dry_run, &report));
    Ok(())
}

/// The one line a backfill prints: what it emitted and what it left.
fn describe(name: &str, dry_run: bool, r: &BackfillReport) -> String {
    let verb = if dry_run { "would emit" } else { "emitted" };
    let dry = if dry_run { "dry run: " } else { "" };
    if r.reprocess == Reprocess::Missing {
        return format!(
            "{dry}{name}: {} runs in range; {verb} {} new, {verb} {} previously skipped; {} already emitted",
            r.in_range, r.emitted, r.emitted_after_skip, r.already_emitted
        );
    }
    let again = if dry_run {
        "would re-emit"
    } else {
        "re-emitted"
    };
    let mut did = Vec::new();
    let mut part = |n: u64, what: &str| {
        if n > 0 {
            did.push(format!("{n} {what}"));
        }
    };
    part(r.reemitted_dead, "whose job was dead");
    part(r.reemitted_done, "whose job was done");
    part(r.reemitted_cancelled, "whose job was cancelled");
    part(r.reemitted_deleted, "whose job retention had deleted");
    let mut done = if did.is_empty() {
        format!(
            "nothing to reprocess (no run {})",
            match r.reprocess {
                Reprocess::Failed => "whose job is dead",
                _ => "whose job is finished or missing",
            }
        )
    } else {
        format!(
            "{again} {} runs: {}",
            r.reemitted_dead + r.reemitted_done + r.reemitted_cancelled + r.reemitted_deleted,
            did.join(", ")
        )
    };
    if r.emitted + r.emitted_after_skip > 0 {
        done.push_str(&format!(
            "; {verb} {} new, {} previously skipped",
            r.emitted, r.emitted_after_skip
        ));
    }
    let mut left = Vec::new();
    if r.already_emitted > 0 {
        left.push(format!(
            "{} with a job left as they were ({} still ready or running)",
            r.already_emitted, r.still_active
        ));
    }
    if r.without_job > 0 {
        left.push(format!(
            "{} without a job (missing or skipped: --reprocess missing or all emits them)",
            r.without_job
        ));
    }
    let left = if left.is_empty() {
        String::new()
    } else {
        format!("; {}", left.join("; "))
    };
    format!(
        "{dry}{name}: {} runs in range (--reprocess {}); {done}{left}",
        r.in_range,
        r.reprocess.as_str()
    )
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
