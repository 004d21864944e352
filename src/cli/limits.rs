//! `almanac limits set|clear|list`: a kind's concurrency and rate limits
//! ([`crate::queue::limits`] says what they guarantee), each change audited
//! ([`crate::control::limits`]).

use std::str::FromStr;

use clap::Subcommand;

use super::Ctx;
use crate::control::limits as control;
use crate::control::Actor;
use crate::queue::limits::{self, Limits, PerKey, Rate};
use crate::queue::QueueError;
use crate::stats::snapshot::limited_kinds;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: LimitsCommand,
}

#[derive(Debug, Subcommand)]
enum LimitsCommand {
    /// Set KIND's limits, replacing every limit it had: a limit not given
    /// here is removed. At least one limit is required. They hold for every
    /// claim on every worker and consumer from the commit on; running jobs
    /// are never stopped.
    Set {
        /// The job kind.
        kind: String,
        /// At most N jobs of KIND run at once, across every process.
        #[arg(long, value_name = "N", allow_negative_numbers = true)]
        global: Option<i32>,
        /// At most N run at once per value of the payload at the JSON
        /// pointer, e.g. /customer_id=1 (a payload without the key is a
        /// bucket of its own).
        #[arg(long, value_name = "JSON_POINTER=N", value_parser = parse::<PerKey>, allow_hyphen_values = true)]
        per_key: Option<PerKey>,
        /// At most STARTS per PERIOD, e.g. 600/1m or 10/1s.
        #[arg(long, value_name = "STARTS/PERIOD", value_parser = parse::<Rate>, allow_hyphen_values = true)]
        rate: Option<Rate>,
        /// Starts allowed above the rate in one period (with --rate) [default: 0].
        #[arg(long, value_name = "N", allow_negative_numbers = true)]
        burst: Option<i32>,
    },
    /// Remove KIND's limits: its jobs start as fast as workers claim them.
    Clear {
        /// The job kind.
        kind: String,
    },
    /// Every limited kind: its limits, how many of it run now, who set them.
    List {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
}

/// The library's parser, with its message as it is (clap adds the value
/// and the flag).
fn parse<T: FromStr<Err = QueueError>>(s: &str) -> Result<T, String> {
    s.parse().map_err(message)
}

/// A refusal's own words, without `invalid job:` (a limit is no job).
fn message(err: QueueError) -> String {
    match err {
        QueueError::Invalid(m) => m,
        other => other.to_string(),
    }
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    match args.command {
        LimitsCommand::Set {
            kind,
            global,
            per_key,
            rate,
            burst,
        } => {
            let new = Limits {
                global,
                per_key,
                rate,
                burst: burst.unwrap_or(0),
            };
            // Refused before touching the database, in the library's words.
            new.validate().map_err(|e| anyhow::anyhow!(message(e)))?;
            let pool = ctx.pool().await?;
            let conn = &mut *pool.acquire().await?;
            let before = limits::get(&mut *conn, &kind).await?;
            let stored = control::set(conn, &Actor::os_user(), &kind, &new)
                .await
                .map_err(|e| match e {
                    crate::control::ControlError::Queue(q) => anyhow::anyhow!(message(q)),
                    other => other.into(),
                })?;
            println!("kind {kind} is limited to: {}", stored.limits);
            println!(
                "set by {} at {}; {}",
                stored.set_by,
                stored.set_at.format("%Y-%m-%dT%H:%M:%SZ"),
                match before {
                    Some(b) => format!("this replaces all it had ({})", b.limits),
                    None => "it had no limits before".to_string(),
                }
            );
        }
        LimitsCommand::Clear { kind } => {
            let pool = ctx.pool().await?;
            let conn = &mut *pool.acquire().await?;
            match control::clear(conn, &Actor::os_user(), &kind).await? {
                Some(removed) => {
                    println!("kind {kind} has no limits now (it had: {})", removed.limits)
                }
                None => println!("kind {kind} had no limits; nothing changed"),
            }
        }
        LimitsCommand::List { json } => {
            let pool = ctx.pool().await?;
            let kinds = limited_kinds(&mut *pool.acquire().await?).await?;
            if json {
                for k in &kinds {
                    println!("{}", serde_json::to_string(k)?);
                }
            } else if kinds.is_empty() {
                println!("(no kind has limits)");
            } else {
                println!(
                    "{:<24} {:>7} {:<21} {:<24} LIMITS",
                    "KIND", "RUNNING", "SET AT", "BY"
                );
                for k in &kinds {
                    println!(
                        "{:<24} {:>7} {:<21} {:<24} {}",
                        k.limited.kind,
                        k.running,
                        k.limited.set_at.format("%Y-%m-%dT%H:%M:%SZ"),
                        k.limited.set_by,
                        k.limited.limits
                    );
                }
            }
        }
    }
    Ok(())
}
