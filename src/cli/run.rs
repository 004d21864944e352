//! `almanac run`: the service roles until SIGINT/SIGTERM.

use anyhow::bail;
use tokio::sync::mpsc;

use super::sinks::{RelayFlags, SinkFlags};
use super::{Ctx, SchedulesDir};
use crate::config::HumanDuration;
use crate::maintenance::{Reaper, ReaperConfig};
use crate::relay::{Publisher, Relay, RelayConfig};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::supervisor::Supervisor;

const ROLES: [&str; 3] = ["scheduler", "reaper", "relay"];

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Roles to run, comma-separated [default: scheduler,reaper, and relay when a sink is configured].
    #[arg(long, env = "ALMANAC_ROLES", value_delimiter = ',')]
    roles: Vec<String>,
    #[command(flatten)]
    schedules: SchedulesDir,
    /// How often a standby scheduler tries to become leader [default: 2s].
    #[arg(long, env = "ALMANAC_STANDBY_RETRY")]
    standby_retry: Option<HumanDuration>,
    /// How often the reaper sweeps expired leases [default: 5s].
    #[arg(long, env = "ALMANAC_REAPER_INTERVAL")]
    reaper_interval: Option<HumanDuration>,
    /// Broker-route jobs ready this long with no recent message get a fresh one [default: 5m].
    #[arg(long, env = "ALMANAC_REDRIVE_AFTER")]
    redrive_after: Option<HumanDuration>,
    #[command(flatten)]
    sinks: SinkFlags,
    #[command(flatten)]
    relay: RelayFlags,
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    let mut roles: Vec<String> = if !args.roles.is_empty() {
        args.roles.clone()
    } else {
        ctx.config
            .roles
            .clone()
            .unwrap_or_else(|| ROLES.iter().map(|r| r.to_string()).collect())
    };
    roles.iter_mut().for_each(|r| *r = r.trim().to_string());
    if let Some(bad) = roles.iter().find(|r| !ROLES.contains(&r.as_str())) {
        bail!("unknown role `{bad}`; roles are {}", ROLES.join(", "));
    }
    let wants = |role: &str| roles.iter().any(|r| r == role);

    // Load the schedule files before anything else: a bad file fails the start.
    let scheduler = if wants("scheduler") {
        let defaults = SchedulerConfig::default();
        let config = SchedulerConfig {
            schedules_dir: args.schedules.resolve(ctx),
            standby_retry: args.standby_retry.map_or(defaults.standby_retry, |d| d.0),
            ..defaults
        };
        Some(Scheduler::new(ctx.connect_options()?, config)?)
    } else {
        None
    };
    let pool = ctx.migrated_pool(8).await?;
    let mut supervisor = Supervisor::new();
    if let Some(scheduler) = scheduler {
        let (reload_tx, reload_rx) = mpsc::channel(1);
        tokio::spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let Ok(mut hup) = signal(SignalKind::hangup()) else {
                return;
            };
            while hup.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading schedules");
                let _ = reload_tx.try_send(());
            }
        });
        supervisor.spawn("scheduler", scheduler.run(supervisor.token(), reload_rx));
    }
    if wants("reaper") {
        let defaults = ReaperConfig::default();
        let reaper = ReaperConfig {
            interval: args
                .reaper_interval
                .or(ctx.config.reaper.interval)
                .map_or(defaults.interval, |d| d.0),
            batch_size: ctx.config.reaper.batch_size.unwrap_or(defaults.batch_size),
        };
        supervisor.spawn(
            "reaper",
            Reaper::new(pool.clone(), reaper).run(supervisor.token()),
        );
    }
    if wants("relay") {
        let sinks = args.sinks.resolve(ctx);
        if sinks.configured().is_empty() {
            bail!("the relay role needs a sink: pass --kafka-brokers or --amqp-url");
        }
        let defaults = RelayConfig::default();
        let config = RelayConfig {
            redrive_after: args
                .redrive_after
                .or(ctx.config.relay.redrive_after)
                .map_or(defaults.redrive_after, |d| d.0),
            ..defaults
        };
        let config = args.relay.apply(config, &sinks)?;
        for sink in sinks.configured() {
            let publisher = Publisher::new(sink, &sinks)?;
            let relay = Relay::new(pool.clone(), publisher, config.clone());
            supervisor.spawn("relay", relay.run(supervisor.token()));
        }
    }
    tracing::info!(roles = %roles.join(","), "almanac running");
    supervisor.run_until_signal().await;
    Ok(())
}
