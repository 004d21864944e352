//! The filter flags of `almanac jobs retry|cancel|delete`, and running a
//! bulk action: count, confirm (or `--yes`), act in batches
//! ([`crate::control::bulk`]).

use std::io::{BufRead, IsTerminal, Write};

use anyhow::bail;
use sqlx::PgPool;

use crate::config::HumanDuration;
use crate::control::bulk::{self, Bulk, Filter};
use crate::control::Actor;
use crate::queue::JobStatus;

#[derive(Debug, Clone, Default, clap::Args)]
pub struct BulkArgs {
    /// Act on every job of this kind (with the other filters).
    #[arg(long)]
    kind: Option<String>,
    /// Only jobs in this status [default: every status the action applies to].
    #[arg(long)]
    status: Option<JobStatus>,
    /// Only jobs whose last error contains this text (case-insensitive).
    #[arg(long, value_name = "TEXT")]
    error_like: Option<String>,
    /// Only jobs that finished (or, unfinished, were created) longer ago than this: 2h, 7d.
    #[arg(long, value_name = "DURATION")]
    older_than: Option<HumanDuration>,
    /// Act without asking (for scripts).
    #[arg(long)]
    yes: bool,
    /// Only count what would be acted on.
    #[arg(long)]
    dry_run: bool,
}

impl BulkArgs {
    /// Whether any filter was given (a bulk action needs one).
    pub fn is_given(&self) -> bool {
        self.kind.is_some()
            || self.status.is_some()
            || self.error_like.is_some()
            || self.older_than.is_some()
    }

    fn filter(&self) -> Filter {
        Filter {
            kind: self.kind.clone(),
            status: self.status,
            error_like: self.error_like.clone(),
            older_than: self.older_than.map(|d| d.0),
        }
    }
}

/// Counts, confirms and acts; `note` is kept with the audit row (and, for
/// cancel, on each job as its reason).
pub async fn run(
    pool: &PgPool,
    bulk: Bulk,
    args: &BulkArgs,
    note: Option<&str>,
) -> anyhow::Result<()> {
    let verb = bulk.as_str();
    if !args.is_given() {
        bail!(
            "jobs {verb} needs a job id or at least one filter (--kind, --status, --error-like, --older-than)"
        );
    }
    let conn = &mut *pool.acquire().await?;
    let selection = bulk::select(conn, bulk, &args.filter()).await?;
    let what = args.filter().describe(bulk);
    let count = selection.ids.len();
    if count == 0 {
        println!("no job matches ({what}): nothing changed");
        return Ok(());
    }
    let (plural, verb_s, them) = if count == 1 {
        ("", "es", "it")
    } else {
        ("s", "", "them")
    };
    if args.dry_run {
        println!("{count} job{plural} match{verb_s} ({what}); --dry-run: nothing changed");
        return Ok(());
    }
    if !args.yes {
        if !std::io::stdin().is_terminal() {
            bail!("{count} job{plural} match{verb_s} ({what}); add --yes to {verb} {them} without a prompt");
        }
        eprint!("{verb} {count} job{plural} ({what})? [y/N] ");
        std::io::stderr().flush()?;
        let mut answer = String::new();
        std::io::stdin().lock().read_line(&mut answer)?;
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            println!("nothing changed");
            return Ok(());
        }
    }
    let actor = Actor::os_user();
    let report = bulk::apply(conn, &actor, &selection, note, |done| {
        if count > bulk::BATCH {
            eprintln!("{verb}: {done} of {count}");
        }
    })
    .await?;
    let past = match bulk {
        Bulk::Retry => "retried",
        Bulk::Cancel => "cancelled (running ones: asked to stop)",
        Bulk::Delete => "deleted",
    };
    println!(
        "{} of {count} job{plural} {past}{}",
        report.acted,
        if report.skipped > 0 {
            format!(
                "; {} no longer matched, were busy, or (retry) belong to a reprocessed scheduled run",
                report.skipped
            )
        } else {
            String::new()
        }
    );
    Ok(())
}
