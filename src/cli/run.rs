//! `almanac run`: the service roles until SIGINT/SIGTERM.

use super::Ctx;
use crate::config::HumanDuration;
use crate::maintenance::{Reaper, ReaperConfig};
use crate::supervisor::Supervisor;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// How often the reaper sweeps expired leases [default: 5s].
    #[arg(long, env = "ALMANAC_REAPER_INTERVAL")]
    reaper_interval: Option<HumanDuration>,
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    let pool = ctx.migrated_pool(8).await?;
    let defaults = ReaperConfig::default();
    let reaper = ReaperConfig {
        interval: args
            .reaper_interval
            .or(ctx.config.reaper.interval)
            .map_or(defaults.interval, |d| d.0),
        batch_size: ctx.config.reaper.batch_size.unwrap_or(defaults.batch_size),
    };
    let mut supervisor = Supervisor::new();
    let token = supervisor.token();
    supervisor.spawn("reaper", Reaper::new(pool.clone(), reaper).run(token));
    tracing::info!("almanac running: reaper");
    supervisor.run_until_signal().await;
    Ok(())
}
