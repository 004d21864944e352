//! `almanac jobs list|show|retry|cancel|delete`

use std::time::{Duration, Instant};

use clap::Subcommand;
use sqlx::PgConnection;

use super::bulk::BulkArgs;
use super::Ctx;
use crate::control::bulk::Bulk;
use crate::control::{self, Actor};
use crate::queue::{self, Cancel, Job, JobFilter, JobStatus};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: JobsCommand,
}

#[derive(Debug, Subcommand)]
enum JobsCommand {
    /// Newest jobs first.
    List {
        #[arg(long)]
        status: Option<JobStatus>,
        #[arg(long)]
        kind: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// One job in full.
    Show {
        id: i64,
        #[arg(long)]
        json: bool,
    },
    /// Give a dead or cancelled job (or every one matching the filters) a
    /// fresh set of attempts.
    Retry {
        id: Option<i64>,
        #[command(flatten)]
        bulk: BulkArgs,
    },
    /// Cancel a job (or every one matching the filters): a ready one at
    /// once, a running one on its worker (the handler is stopped, a
    /// command's process group killed); it ends `cancelled`. For one running
    /// job, waits until its worker has stopped it and says so.
    Cancel {
        id: Option<i64>,
        /// Why, kept on the job and in the audit log.
        #[arg(long)]
        reason: Option<String>,
        /// Return once the request is recorded, without waiting for the
        /// worker holding a running job to stop it.
        #[arg(long)]
        no_wait: bool,
        #[command(flatten)]
        bulk: BulkArgs,
    },
    /// Delete every finished (done, dead, cancelled) job matching the filters.
    Delete {
        #[command(flatten)]
        bulk: BulkArgs,
    },
}

/// The one job named, or `None` for a bulk action; both is refused.
fn one_or_bulk(id: Option<i64>, bulk: &BulkArgs, verb: &str) -> anyhow::Result<Option<i64>> {
    if id.is_some() && bulk.is_given() {
        anyhow::bail!("jobs {verb} takes a job id or filters (--kind, --status, --error-like, --older-than), not both");
    }
    Ok(id)
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    let pool = ctx.pool().await?;
    match args.command {
        JobsCommand::List {
            status,
            kind,
            limit,
            json,
        } => {
            let jobs = queue::list(
                &pool,
                &JobFilter {
                    status,
                    kind,
                    limit,
                },
            )
            .await?;
            if json {
                for job in &jobs {
                    println!("{}", serde_json::to_string(job)?);
                }
            } else {
                print_table(&jobs);
            }
        }
        JobsCommand::Show { id, json } => {
            let job = queue::get(&pool, id).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&job)?);
            } else {
                print_job(&job);
            }
        }
        JobsCommand::Retry { id, bulk } => {
            let Some(id) = one_or_bulk(id, &bulk, "retry")? else {
                return super::bulk::run(&pool, Bulk::Retry, &bulk, None).await;
            };
            let actor = Actor::os_user();
            let job = control::jobs::retry(&mut *pool.acquire().await?, &actor, id).await?;
            if job.status == JobStatus::Held {
                println!(
                    "job {} ({}) has {} attempts again; it is held until the job of its ordering key `{}` that runs now ends, then runs before the key's later jobs",
                    job.id,
                    job.kind,
                    job.max_attempts,
                    job.ordering_key.as_deref().unwrap_or_default()
                );
            } else {
                println!(
                    "job {} ({}) is ready again with {} attempts",
                    job.id, job.kind, job.max_attempts
                );
            }
        }
        JobsCommand::Cancel {
            id,
            reason,
            no_wait,
            bulk,
        } => {
            let Some(id) = one_or_bulk(id, &bulk, "cancel")? else {
                return super::bulk::run(&pool, Bulk::Cancel, &bulk, reason.as_deref()).await;
            };
            let actor = Actor::os_user();
            let conn = &mut *pool.acquire().await?;
            match control::jobs::cancel(conn, &actor, id, reason.as_deref()).await? {
                Cancel::Cancelled(job) => {
                    println!("job {} ({}) cancelled before it ran", job.id, job.kind)
                }
                Cancel::Requested(job) if no_wait => println!(
                    "job {} ({}) is running: its worker was asked to stop it; it ends cancelled (see `almanac jobs show {}`)",
                    job.id, job.kind, job.id
                ),
                Cancel::Requested(job) => println!("{}", wait_for_cancel(conn, &job).await?),
                Cancel::Finished(job) => println!(
                    "job {} ({}) is already {}: nothing changed",
                    job.id, job.kind, job.status
                ),
            }
        }
        JobsCommand::Delete { bulk } => {
            super::bulk::run(&pool, Bulk::Delete, &bulk, None).await?;
        }
    }
    Ok(())
}

/// How long past the lease the CLI waits for a holder to stop a cancelled
/// job, and how long it waits at least (and at most).
const CANCEL_WAIT_SLACK: Duration = Duration::from_secs(1);
const CANCEL_WAIT_MIN: Duration = Duration::from_secs(3);
const CANCEL_WAIT_MAX: Duration = Duration::from_secs(120);

/// Waits until the running `job`, whose cancel was just requested, has
/// ended, and says how; gives up when its lease (as it stood) has run out,
/// plus a little: a holder that is alive renews within a third of the lease
/// and learns of the request then at the latest.
async fn wait_for_cancel(conn: &mut PgConnection, job: &Job) -> anyhow::Result<String> {
    let started = Instant::now();
    let remaining: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM lease_until - clock_timestamp())::float8 FROM almanac.jobs WHERE id = $1",
    )
    .bind(job.id)
    .fetch_one(&mut *conn)
    .await?;
    let within = Duration::try_from_secs_f64(remaining.unwrap_or(0.0).max(0.0))
        .unwrap_or(CANCEL_WAIT_MAX)
        .saturating_add(CANCEL_WAIT_SLACK)
        .clamp(CANCEL_WAIT_MIN, CANCEL_WAIT_MAX);
    let (id, kind) = (job.id, &job.kind);
    loop {
        let now = queue::get(&mut *conn, id).await?;
        match now.status {
            JobStatus::Running => {}
            JobStatus::Cancelled
                if now
                    .last_error
                    .as_deref()
                    .is_some_and(|e| e.starts_with("lease expired")) =>
            {
                return Ok(format!(
                    "job {id} ({kind}) cancelled: its worker did not answer, and the reaper finished the cancel when its lease ran out"
                ));
            }
            JobStatus::Cancelled => {
                return Ok(format!(
                    "job {id} ({kind}) cancelled: its handler was stopped on its worker"
                ))
            }
            JobStatus::Done => {
                return Ok(format!(
                    "job {id} ({kind}) finished (done) before its worker could stop it: the cancel changed nothing"
                ))
            }
            other => return Ok(format!("job {id} ({kind}) is {other} now")),
        }
        if started.elapsed() >= within {
            let until = now
                .lease_until
                .map_or("-".into(), |t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string());
            return Ok(format!(
                "cancel requested; the worker holding job {id} did not answer within {}s; the reaper cancels it when its lease runs out at {until} (it will not run again)",
                within.as_secs()
            ));
        }
        tokio::time::sleep(CANCEL_POLL).await;
    }
}

/// How often the CLI looks at a job it is waiting for.
const CANCEL_POLL: Duration = Duration::from_millis(100);

fn print_table(jobs: &[Job]) {
    println!(
        "{:>10}  {:<20} {:<8} {:>3} {:>8}  {:<25} LAST ERROR",
        "ID", "KIND", "STATUS", "PRI", "ATTEMPTS", "RUN AT"
    );
    for job in jobs {
        let error = job.last_error.as_deref().unwrap_or("");
        let error: String = error
            .lines()
            .next()
            .unwrap_or("")
            .chars()
            .take(60)
            .collect();
        println!(
            "{:>10}  {:<20} {:<8} {:>3} {:>8}  {:<25} {}",
            job.id,
            job.kind,
            job.status,
            job.priority,
            format!("{}/{}", job.attempts, job.max_attempts),
            job.run_at.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
            error
        );
    }
    if jobs.is_empty() {
        println!("(no jobs match)");
    }
}

fn print_job(job: &Job) {
    let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    let time = |v: Option<chrono::DateTime<chrono::Utc>>| v.map_or("-".into(), |t| t.to_rfc3339());
    println!("id:              {}", job.id);
    println!("kind:            {}", job.kind);
    println!("status:          {}", job.status);
    println!("attempts:        {}/{}", job.attempts, job.max_attempts);
    println!("priority:        {}", job.priority);
    println!("run at:          {}", job.run_at.to_rfc3339());
    println!("lease until:     {}", time(job.lease_until));
    println!("idempotency key: {}", job.effective_idempotency_key());
    println!("route:           {}", job.route);
    println!("ordering key:    {}", opt(&job.ordering_key));
    println!("traceparent:     {}", opt(&job.traceparent));
    println!("schedule:        {}", opt(&job.schedule));
    println!("logical run:     {}", opt(&job.logical_run));
    println!("created at:      {}", job.created_at.to_rfc3339());
    println!("finished at:     {}", time(job.finished_at));
    println!("last error:      {}", opt(&job.last_error));
    println!("payload:         {}", job.payload);
}
