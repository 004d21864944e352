//! `almanac kinds pause|resume|list`

use clap::Subcommand;

use super::Ctx;
use crate::control::pause::{self, Paused, ALL_KINDS};
use crate::control::Actor;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: KindsCommand,
}

#[derive(Debug, Subcommand)]
enum KindsCommand {
    /// Stop starting jobs of KIND (`*`: every kind) on every worker and
    /// consumer; running jobs go on, waiting ones wait, nothing is lost.
    Pause {
        kind: String,
        /// Why, shown beside the pause and in the audit log.
        #[arg(long)]
        note: Option<String>,
    },
    /// Start jobs of KIND again (`*` lifts only the pause of every kind).
    Resume { kind: String },
    /// The paused kinds.
    List {
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    let pool = ctx.pool().await?;
    let actor = Actor::os_user();
    match args.command {
        KindsCommand::Pause { kind, note } => {
            let conn = &mut *pool.acquire().await?;
            match pause::pause(conn, &actor, &kind, note.as_deref()).await? {
                Paused::Now(_) if kind == ALL_KINDS => {
                    println!("every kind is paused: no job starts until `almanac kinds resume '*'`")
                }
                Paused::Now(_) => println!(
                    "kind {kind} is paused: no job of it starts until `almanac kinds resume {kind}`"
                ),
                Paused::Already(p) => println!(
                    "kind {kind} was already paused (by {} at {}); nothing changed",
                    p.paused_by,
                    p.paused_at.format("%Y-%m-%dT%H:%M:%SZ")
                ),
            }
        }
        KindsCommand::Resume { kind } => {
            let conn = &mut *pool.acquire().await?;
            if pause::resume(conn, &actor, &kind).await?.is_some() {
                println!("kind {kind} is resumed");
            } else {
                let paused: Vec<String> = pause::list(&pool)
                    .await?
                    .into_iter()
                    .map(|p| p.kind)
                    .collect();
                anyhow::bail!(
                    "kind {kind} is not paused; paused kinds: {}",
                    if paused.is_empty() {
                        "none".into()
                    } else {
                        paused.join(", ")
                    }
                );
            }
        }
        KindsCommand::List { json } => {
            let pauses = pause::list(&pool).await?;
            if json {
                for p in &pauses {
                    println!("{}", serde_json::to_string(p)?);
                }
            } else if pauses.is_empty() {
                println!("(no kind is paused)");
            } else {
                println!("{:<24} {:<21} {:<24} NOTE", "KIND", "PAUSED AT", "BY");
                for p in &pauses {
                    println!(
                        "{:<24} {:<21} {:<24} {}",
                        p.kind,
                        p.paused_at.format("%Y-%m-%dT%H:%M:%SZ"),
                        p.paused_by,
                        p.note.as_deref().unwrap_or("")
                    );
                }
            }
        }
    }
    Ok(())
}
