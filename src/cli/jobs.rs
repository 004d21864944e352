//! `almanac jobs list|show|retry|cancel|delete`

use clap::Subcommand;

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
    /// once, a running one on its worker (the handler is stopped); it ends
    /// `cancelled`.
    Cancel {
        id: Option<i64>,
        /// Why, kept on the job and in the audit log.
        #[arg(long)]
        reason: Option<String>,
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
            println!(
                "job {} ({}) is ready again with {} attempts",
                job.id, job.kind, job.max_attempts
            );
        }
        JobsCommand::Cancel { id, reason, bulk } => {
            let Some(id) = one_or_bulk(id, &bulk, "cancel")? else {
                return super::bulk::run(&pool, Bulk::Cancel, &bulk, reason.as_deref()).await;
            };
            let actor = Actor::os_user();
            let conn = &mut *pool.acquire().await?;
            match control::jobs::cancel(conn, &actor, id, reason.as_deref()).await? {
                Cancel::Cancelled(job) => {
                    println!("job {} ({}) cancelled before it ran", job.id, job.kind)
                }
                Cancel::Requested(job) => println!(
                    "job {} ({}) is running: its worker was asked to stop it; it ends cancelled",
                    job.id, job.kind
                ),
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

fn print_table(jobs: &[Job]) {
    println!(
        "{:>10}  {:<20} {:<8} {:>8}  {:<25} LAST ERROR",
        "ID", "KIND", "STATUS", "ATTEMPTS", "RUN AT"
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
            "{:>10}  {:<20} {:<8} {:>8}  {:<25} {}",
            job.id,
            job.kind,
            job.status,
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
    println!("run at:          {}", job.run_at.to_rfc3339());
    println!("lease until:     {}", time(job.lease_until));
    println!("idempotency key: {}", job.effective_idempotency_key());
    println!("route:           {}", job.route);
    println!("schedule:        {}", opt(&job.schedule));
    println!("logical run:     {}", opt(&job.logical_run));
    println!("created at:      {}", job.created_at.to_rfc3339());
    println!("finished at:     {}", time(job.finished_at));
    println!("last error:      {}", opt(&job.last_error));
    println!("payload:         {}", job.payload);
}
