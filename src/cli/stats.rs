//! `almanac stats [--json]`: the figures `/metrics` exports from the
//! database, for a person: jobs by kind and status, the oldest due job per
//! kind, expired leases, the outbox per sink, who leads the scheduler, and
//! per schedule its deadline, overdue and missing runs, lag and last success;
//! the paused kinds, and the limited ones with how many of each run now.

use super::Ctx;
use crate::stats::Snapshot;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// One JSON object instead of tables.
    #[arg(long)]
    json: bool,
    /// Count the jobs again and rebuild the counters `stats` reads (O(jobs)):
    /// after a bulk load or delete made with triggers off.
    #[arg(long)]
    recount: bool,
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    let pool = ctx.pool().await?;
    // Fold the counters' rows first, so the read is of tens of rows; a
    // fold that cannot run (a standby, a read-only session) leaves the read
    // to count, unless a recount was asked for.
    use crate::queue::counts::{fold, Fold};
    match fold(&mut *pool.acquire().await?, args.recount).await {
        Ok(Fold::Busy) if args.recount => anyhow::bail!(
            "another process is folding the counters right now; run `almanac stats --recount` again"
        ),
        Ok(Fold::Skipped) if args.recount => anyhow::bail!(
            "cannot recount here: the database is a standby or the session is read-only; run `almanac stats --recount` against the primary"
        ),
        Ok(_) => {}
        Err(err) if args.recount => return Err(err.into()),
        Err(err) => tracing::warn!(%err, "folding the counters failed; counting instead where they are not whole"),
    }
    let s = Snapshot::read(&mut *pool.acquire().await?).await?;
    if args.json {
        println!("{}", serde_json::to_string(&s)?);
        return Ok(());
    }
    println!("{:<24} {:<8} {:>10}", "KIND", "STATUS", "JOBS");
    for row in &s.jobs.by_kind_status {
        println!(
            "{:<24} {:<8} {:>10}",
            row.kind,
            row.status.as_str(),
            row.count
        );
    }
    if s.jobs.by_kind_status.is_empty() {
        println!("(no ready, running or dead jobs)");
    }
    println!(
        "{:<24} {:<8} {:>10}",
        "(all kinds)",
        "done",
        if s.jobs.done_exact {
            s.jobs.done_estimate.to_string()
        } else {
            format!("~{}", s.jobs.done_estimate)
        }
    );
    println!();
    if !s.jobs.oldest_due_ready.is_empty() {
        println!("{:<24} {:>18}", "KIND", "OLDEST DUE (WAIT)");
        for age in &s.jobs.oldest_due_ready {
            println!("{:<24} {:>17.1}s", age.kind, age.seconds);
        }
        println!();
    }
    println!("expired leases:         {}", s.jobs.expired_leases);
    println!("dead jobs:              {}", s.jobs.dead);
    println!("cancelled jobs:         {}", s.jobs.cancelled);
    for p in &s.paused {
        println!(
            "paused {:<15} since {} by {}{}",
            format!("{}:", p.kind),
            p.paused_at.format("%Y-%m-%dT%H:%M:%SZ"),
            p.paused_by,
            p.note
                .as_deref()
                .map_or(String::new(), |note| format!(": {note}"))
        );
    }
    for l in &s.limits {
        println!(
            "limited {:<14} {}; {} running now; set by {} at {}",
            format!("{}:", l.limited.kind),
            l.limited.limits,
            l.running,
            l.limited.set_by,
            l.limited.set_at.format("%Y-%m-%dT%H:%M:%SZ"),
        );
    }
    for sink in &s.outbox {
        println!(
            "outbox {:<15} {} unpublished ({} in flight), oldest {:.1}s, {} failed for good",
            format!("{}:", sink.sink),
            sink.backlog,
            sink.in_flight,
            sink.oldest_unpublished_seconds,
            sink.failed
        );
    }
    for u in &s.unserved {
        println!(
            "route {:<16} {} to {}, but no relay for {} is running: its jobs wait in the outbox{}",
            format!("{}:", u.kind),
            u.mode,
            u.sink,
            u.sink,
            if u.mode == "broker" {
                " and nothing runs them"
            } else {
                ""
            }
        );
    }
    for g in &s.unconsumed {
        println!("consumers {:<12} {}", format!("{}:", g.kind), g.describe());
    }
    if !s.schedules.is_empty() {
        println!();
        println!(
            "{:<24} {:>8} {:>7} {:>7} {:>9}  {:<20}  SKIPPED",
            "SCHEDULE", "DEADLINE", "OVERDUE", "MISSING", "LAG", "LAST SUCCESS (FIRE)"
        );
        for sched in &s.schedules {
            let f = &sched.runs;
            let skipped: Vec<String> = f
                .skipped
                .iter()
                .map(|(reason, n)| format!("{reason} {n}"))
                .collect();
            println!(
                "{:<24} {:>8} {:>7} {:>7} {:>8.0}s  {:<20}  {}",
                sched.name,
                sched.deadline.as_deref().unwrap_or("-"),
                f.overdue,
                f.missing,
                sched.lag_seconds,
                f.last_success.map_or("-".to_string(), |t| t
                    .format("%Y-%m-%dT%H:%M:%SZ")
                    .to_string()),
                if skipped.is_empty() {
                    "-".to_string()
                } else {
                    skipped.join(", ")
                }
            );
        }
        println!(
            "(overdue, missing, last success and skipped: over each schedule's calendar window)"
        );
        println!();
    }
    match &s.leader {
        Some(l) => println!(
            "scheduler leader:       backend pid {} ({}{}), leading for up to {:.0}s",
            l.pid,
            l.application_name,
            l.client_addr
                .as_deref()
                .map(|a| format!(" from {a}"))
                .unwrap_or_default(),
            l.session_seconds
        ),
        None => println!("scheduler leader:       none (no `almanac run` holds the lock)"),
    }
    Ok(())
}
