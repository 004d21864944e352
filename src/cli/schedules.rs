//! `almanac schedules check|list|preview|pause|resume|trigger`
//!
//! `trigger` of a run that already has a job prints which run it is and
//! that it exists, emits nothing, and exits 0: the run is there, which is
//! what was asked. The rules are [`crate::scheduler::controls`]'; pause,
//! resume and trigger go through [`crate::control::schedules`], so each
//! writes its audit row (actor: the OS user, source `cli`).

use anyhow::{bail, Context as _};
use chrono::{DateTime, Days, NaiveDate, Utc};
use chrono_tz::Tz;
use clap::Subcommand;

use super::{Ctx, SchedulesDir};
use crate::control::{self, Actor};
use crate::scheduler::controls::{self, Paused, Triggered};
use crate::scheduler::cron::CronExpr;
use crate::scheduler::timeline::{Run, Timeline};
use crate::scheduler::{history, ledger};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: SchedulesCommand,
}

#[derive(Debug, Subcommand)]
enum SchedulesCommand {
    /// Validate the schedule files; exit non-zero with file:line on a problem.
    Check {
        /// Directory to check [default: --schedules, or schedules].
        path: Option<std::path::PathBuf>,
        #[command(flatten)]
        schedules: SchedulesDir,
    },
    /// Each schedule with its next fire time, last emitted run and lag.
    List {
        #[command(flatten)]
        schedules: SchedulesDir,
        #[arg(long)]
        json: bool,
    },
    /// Pause a schedule: its runs are recorded skipped (paused) until resumed.
    Pause {
        name: String,
        /// Why, shown in `schedules list` and on the dashboard.
        #[arg(long, default_value = "")]
        note: String,
        #[command(flatten)]
        schedules: SchedulesDir,
    },
    /// Resume a paused schedule: its next run is emitted on time.
    Resume {
        name: String,
        #[command(flatten)]
        schedules: SchedulesDir,
    },
    /// Emit one run now, through the ledger (never twice): the named logical
    /// run, or the most recent due one.
    Trigger {
        name: String,
        /// A logical run of the schedule, e.g. 2026-03-08 for a daily one.
        #[arg(long)]
        logical_run: Option<String>,
        #[command(flatten)]
        schedules: SchedulesDir,
        /// The emitted run gets its `almanac.schedule.run` span, its job's trace.
        #[command(flatten)]
        tracing: super::tracing_flags::TracingFlags,
    },
    /// The runs in [FROM, TO) of a schedule or of an expression.
    Preview {
        /// A schedule from the files (or give --cron and --tz).
        name: Option<String>,
        #[arg(long, conflicts_with = "name")]
        cron: Option<String>,
        /// IANA zone for --cron [default: UTC].
        #[arg(long, requires = "cron")]
        tz: Option<String>,
        /// RFC 3339 instant, or a date (local midnight in the zone).
        #[arg(long)]
        from: String,
        #[arg(long)]
        to: String,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        schedules: SchedulesDir,
    },
}

/// An RFC 3339 instant, or a date meaning local midnight in the timeline's zone.
pub fn parse_bound(text: &str, timeline: &Timeline, flag: &str) -> anyhow::Result<Bound> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(Bound::Instant(t.with_timezone(&Utc)));
    }
    if let Ok(d) = NaiveDate::parse_from_str(text, "%Y-%m-%d") {
        return Ok(Bound::Date(d, timeline.start_of(d)));
    }
    bail!("{flag} `{text}` is neither a date (2026-03-08) nor an RFC 3339 instant (2026-03-08T07:30:00Z)")
}

#[derive(Debug, Clone, Copy)]
pub enum Bound {
    Instant(DateTime<Utc>),
    /// A local date and the instant its day starts.
    Date(NaiveDate, DateTime<Utc>),
}

impl Bound {
    pub fn start(self) -> DateTime<Utc> {
        match self {
            Bound::Instant(t) | Bound::Date(_, t) => t,
        }
    }

    /// The exclusive end when this bound is inclusive: the next day's start,
    /// or just after the instant.
    pub fn end_inclusive(self, timeline: &Timeline) -> DateTime<Utc> {
        match self {
            Bound::Instant(t) => t + chrono::Duration::microseconds(1),
            Bound::Date(d, _) => timeline.start_of(d + Days::new(1)),
        }
    }
}

pub fn print_run(run: &Run, tz: Tz, json: bool) {
    let fire = run.fire_at.format("%Y-%m-%dT%H:%M:%SZ");
    if json {
        println!(
            "{}",
            serde_json::json!({"logical_run": run.logical_run, "fire_at": fire.to_string()})
        );
    } else {
        let local = run
            .fire_at
            .with_timezone(&tz)
            .format("%Y-%m-%d %H:%M:%S %Z");
        println!("{:<22} {}  ({local})", run.logical_run, fire);
    }
}

fn utc(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

fn describe(p: &controls::Pause) -> String {
    let note = if p.note.is_empty() {
        String::new()
    } else {
        format!(": {}", p.note)
    };
    format!("paused since {} by {}{note}", utc(p.since), p.by)
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    match args.command {
        SchedulesCommand::Pause {
            name,
            note,
            schedules,
        } => {
            let schedule = schedules.find(ctx, &name)?;
            let pool = ctx.migrated_pool(1).await?;
            let mut conn = pool.acquire().await?;
            match control::schedules::pause(&mut conn, &Actor::os_user(), &schedule, &note).await? {
                Paused::Now(p) => println!("{name}: {}", describe(&p)),
                Paused::Already(p) => println!("{name}: already {}; nothing changed", describe(&p)),
            }
            Ok(())
        }
        SchedulesCommand::Resume { name, schedules } => {
            schedules.find(ctx, &name)?;
            let pool = ctx.migrated_pool(1).await?;
            let mut conn = pool.acquire().await?;
            match control::schedules::resume(&mut conn, &Actor::os_user(), &name).await? {
                Some(p) => println!("{name}: resumed (was {})", describe(&p)),
                None => println!("{name}: not paused; nothing changed"),
            }
            Ok(())
        }
        SchedulesCommand::Trigger {
            name,
            logical_run,
            schedules,
            tracing,
        } => {
            let schedule = schedules.find(ctx, &name)?;
            let tracer = tracing.tracer_or_off(ctx);
            let pool = ctx.migrated_pool(1).await?;
            let mut conn = pool.acquire().await?;
            let triggered = control::schedules::trigger(
                &mut conn,
                &Actor::os_user(),
                &schedule,
                logical_run.as_deref(),
                &tracer,
            )
            .await;
            super::flush_spans(&tracer).await;
            match triggered? {
                Triggered::Emitted { run, job_id } => {
                    println!("{name}: emitted logical run {} as job {job_id}", run.logical_run)
                }
                Triggered::Existed {
                    run,
                    source,
                    job_id,
                } => println!(
                    "{name}: logical run {} already exists (recorded by {source}{}); nothing emitted",
                    run.logical_run,
                    job_id.map(|j| format!(", job {j}")).unwrap_or_default()
                ),
            }
            Ok(())
        }
        SchedulesCommand::Check { path, schedules } => {
            let dir = path.unwrap_or_else(|| schedules.resolve(ctx));
            let all = crate::scheduler::spec::load_dir(&dir)?;
            println!(
                "{}: {} schedule{} OK",
                dir.display(),
                all.len(),
                if all.len() == 1 { "" } else { "s" }
            );
            Ok(())
        }
        SchedulesCommand::Preview {
            name,
            cron,
            tz,
            from,
            to,
            json,
            schedules,
        } => {
            let timeline = match (name, cron) {
                (Some(name), _) => schedules.find(ctx, &name)?.timeline,
                (None, Some(cron)) => {
                    let zone = tz.unwrap_or_else(|| "UTC".into());
                    let tz: Tz = zone.parse().map_err(|_| {
                        anyhow::anyhow!("unknown time zone `{zone}`; use an IANA name such as Asia/Seoul or UTC")
                    })?;
                    Timeline::new(CronExpr::parse(&cron)?, tz)
                }
                (None, None) => bail!("name a schedule, or give --cron EXPR (and --tz ZONE)"),
            };
            let from = parse_bound(&from, &timeline, "--from")?.start();
            let to = parse_bound(&to, &timeline, "--to")?.start();
            if to <= from {
                bail!("--to must be after --from");
            }
            let runs = timeline.runs_between(from, to);
            for run in &runs {
                print_run(run, timeline.tz(), json);
            }
            Ok(())
        }
        SchedulesCommand::List { schedules, json } => {
            let all = schedules.load(ctx)?;
            let pool = ctx.pool().await?;
            let mut conn = pool.acquire().await?;
            let names: Vec<String> = all.iter().map(|s| s.name.clone()).collect();
            let cursors = ledger::cursors(&mut conn, &names)
                .await
                .context("reading the ledger")?;
            let emitted = history::last_emitted(&mut conn)
                .await
                .context("reading the ledger")?;
            let paused: std::collections::HashMap<String, controls::Pause> =
                controls::paused(&mut conn, &names)
                    .await
                    .context("reading the pauses")?
                    .into_iter()
                    .map(|p| (p.schedule.clone(), p))
                    .collect();
            // The database's clock, as the scheduler uses.
            let now = crate::scheduler::backfill::db_now(&mut conn)
                .await
                .context("reading the database's time")?;
            if !json {
                println!(
                    "{:<24} {:<16} {:<20} {:<22} {:<22} {:<16} PAUSED",
                    "NAME", "CRON", "ZONE", "NEXT FIRE (UTC)", "LAST EMITTED", "LAG"
                );
            }
            for s in &all {
                let cursor = cursors.get(&s.name);
                let pending = cursor.and_then(|c| crate::scheduler::plan::next_run(s, c));
                let lag = pending
                    .filter(|run| run.fire_at <= now)
                    .map(|run| (now - run.fire_at).num_seconds());
                let next = s
                    .next_after(now)
                    .map(|r| r.fire_at.format("%Y-%m-%dT%H:%M:%SZ").to_string());
                let last = emitted.get(&s.name).map(|(run, _)| run.clone());
                let pause = paused.get(&s.name);
                if json {
                    println!(
                        "{}",
                        serde_json::json!({
                            "name": s.name, "cron": s.timeline.cron().source(), "timezone": s.timeline.tz().name(),
                            "enabled": s.enabled, "next_fire_at": next, "last_emitted": last, "lag_seconds": lag.unwrap_or(0),
                            "synced": cursor.is_some(),
                            "deadline": s.deadline.as_ref().map(|d| d.to_string()),
                            "paused": pause.map(|p| serde_json::json!({
                                "since": utc(p.since), "by": p.by, "note": p.note,
                            })),
                        })
                    );
                } else {
                    println!(
                        "{:<24} {:<16} {:<20} {:<22} {:<22} {:<16} {}",
                        s.name,
                        s.timeline.cron().source(),
                        s.timeline.tz().name(),
                        if s.enabled {
                            next.unwrap_or_else(|| "never".into())
                        } else {
                            "disabled".into()
                        },
                        last.unwrap_or_else(|| "-".into()),
                        match (cursor, lag) {
                            (None, _) => "not synced yet".to_string(),
                            (_, Some(l)) => format!("{} behind", crate::config::coarse_age(l)),
                            (_, None) => "0s".to_string(),
                        },
                        pause.map_or("-".to_string(), describe)
                    );
                }
            }
            Ok(())
        }
    }
}
