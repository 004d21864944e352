//! `almanac ordering set|clear|list`: run a kind's jobs one at a time per
//! ordering key, in enqueue order ([`crate::queue::ordering`] says what it
//! guarantees), each change audited ([`crate::control::ordering`]).

use clap::Subcommand;

use super::Ctx;
use crate::control::ordering as control;
use crate::control::{Actor, ControlError};
use crate::queue::ordering::{self, OnDead};
use crate::queue::QueueError;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: OrderingCommand,
}

#[derive(Debug, Subcommand)]
enum OrderingCommand {
    /// Order KIND: its jobs with the same ordering key run one at a time,
    /// in enqueue order. Jobs enqueued from the commit on take part; a job
    /// given no key (and none at --key-pointer) is not ordered.
    Set {
        /// The job kind.
        kind: String,
        /// A job enqueued without an ordering key takes the payload's value
        /// at this JSON pointer, e.g. /customer_id.
        #[arg(long, value_name = "JSON_POINTER", allow_hyphen_values = true)]
        key_pointer: Option<String>,
        /// What a dead job does to the jobs after it on its key: halt (they
        /// wait until it is retried or deleted) or skip (the next runs).
        #[arg(long, value_name = "halt|skip", default_value = "halt", value_parser = parse_on_dead)]
        on_dead: OnDead,
    },
    /// Stop ordering KIND: every job of it that waits for its turn runs as
    /// any job would.
    Clear {
        /// The job kind.
        kind: String,
    },
    /// Every ordered kind: its key, what a dead job does, how many jobs
    /// wait for their turn.
    List {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
}

fn parse_on_dead(s: &str) -> Result<OnDead, String> {
    s.parse().map_err(message)
}

/// A refusal's own words, without `invalid job:` (a setting is no job).
fn message(err: QueueError) -> String {
    match err {
        QueueError::Invalid(m) => m,
        other => other.to_string(),
    }
}

fn control_error(err: ControlError) -> anyhow::Error {
    match err {
        ControlError::Queue(q) => anyhow::anyhow!(message(q)),
        other => other.into(),
    }
}

fn released(n: u64) -> String {
    match n {
        0 => String::new(),
        1 => "; 1 held job was released".to_string(),
        n => format!("; {n} held jobs were released"),
    }
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    match args.command {
        OrderingCommand::Set {
            kind,
            key_pointer,
            on_dead,
        } => {
            // A bad pointer is refused before touching the database.
            if let Some(p) = &key_pointer {
                crate::queue::limits::pointer_path(p).map_err(|e| anyhow::anyhow!(message(e)))?;
            }
            let pool = ctx.pool().await?;
            let conn = &mut *pool.acquire().await?;
            let (stored, n) = control::set(
                conn,
                &Actor::os_user(),
                &kind,
                key_pointer.as_deref(),
                on_dead,
            )
            .await
            .map_err(control_error)?;
            println!(
                "kind {kind} is ordered per key ({}); a dead job {}{}",
                match &stored.key_pointer {
                    Some(p) => format!("the key given at enqueue, else the payload at {p}"),
                    None => "the key given at enqueue".to_string(),
                },
                match stored.on_dead {
                    OnDead::Halt => "holds the jobs after it until it is retried or deleted",
                    OnDead::Skip => "lets the next one run",
                },
                released(n)
            );
        }
        OrderingCommand::Clear { kind } => {
            let pool = ctx.pool().await?;
            let conn = &mut *pool.acquire().await?;
            match control::clear(conn, &Actor::os_user(), &kind)
                .await
                .map_err(control_error)?
            {
                Some((_, n)) => println!("kind {kind} is not ordered now{}", released(n)),
                None => println!("kind {kind} was not ordered; nothing changed"),
            }
        }
        OrderingCommand::List { json } => {
            let pool = ctx.pool().await?;
            let kinds = ordering::list(&pool).await?;
            if json {
                for k in &kinds {
                    println!("{}", serde_json::to_string(k)?);
                }
            } else if kinds.is_empty() {
                println!("(no kind is ordered)");
            } else {
                println!(
                    "{:<24} {:<20} {:<7} {:>7} {:<21} BY",
                    "KIND", "KEY POINTER", "ON DEAD", "HELD", "SET AT"
                );
                for k in &kinds {
                    println!(
                        "{:<24} {:<20} {:<7} {:>7} {:<21} {}",
                        k.kind,
                        k.key_pointer.as_deref().unwrap_or("-"),
                        k.on_dead,
                        k.held,
                        k.set_at.format("%Y-%m-%dT%H:%M:%SZ"),
                        k.set_by
                    );
                }
            }
        }
    }
    Ok(())
}
