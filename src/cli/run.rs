//! `almanac run`: the service roles until SIGINT/SIGTERM.
//!
//! With no flags and no config file it runs the scheduler (on `schedules/`),
//! the reaper, the janitor and the metrics collector, serves
//! 127.0.0.1:9797, and adds the relay only when a sink is configured.
//! Everything is validated, the schedule files loaded and the HTTP port bound
//! before any role starts, so bad input fails the start and nothing runs.

use anyhow::{bail, Context as _};
use tokio::sync::mpsc;

use super::ops::{HttpFlags, JanitorFlags, UiFlags};
use super::sinks::{RelayFlags, SinkFlags};
use super::{Ctx, SchedulesDir};
use crate::broker::SinkConfig;
use crate::config::{pick, HumanDuration};
use crate::http::HttpAddr;
use crate::maintenance::{Janitor, Reaper, ReaperConfig};
use crate::metrics::Metrics;
use crate::relay::{Publisher, Relay};
use crate::role::{RoleName, Settings};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::stats::{Collector, CollectorConfig};
use crate::supervisor::Supervisor;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Roles to run, comma-separated, of scheduler, reaper, janitor, metrics,
    /// relay [default: scheduler, reaper, janitor, metrics when the HTTP
    /// endpoint is on, and relay when a sink is configured].
    #[arg(long, env = "ALMANAC_ROLES", value_delimiter = ',')]
    roles: Vec<RoleName>,
    #[command(flatten)]
    schedules: SchedulesDir,
    /// How often a standby scheduler tries to become leader [default: 2s].
    #[arg(long, env = "ALMANAC_STANDBY_RETRY")]
    standby_retry: Option<HumanDuration>,
    /// PostgreSQL ends a silent scheduler leader's session after this; a standby takes over within about this plus --standby-retry [default: 10s].
    #[arg(long, env = "ALMANAC_LEADER_TIMEOUT")]
    leader_timeout: Option<HumanDuration>,
    /// Tests only: skew this process's host clock, e.g. `5m` or `-5m`.
    #[arg(
        long,
        env = "ALMANAC_CLOCK_OFFSET",
        hide = true,
        allow_hyphen_values = true
    )]
    clock_offset: Option<String>,
    /// How often the reaper sweeps expired leases [default: 5s].
    #[arg(long, env = "ALMANAC_REAPER_INTERVAL")]
    reaper_interval: Option<HumanDuration>,
    /// Most expired leases the reaper takes per statement [default: 500].
    #[arg(long, env = "ALMANAC_REAPER_BATCH_SIZE")]
    reaper_batch_size: Option<i64>,
    /// How often the metrics collector reads the database [default: 5s].
    #[arg(long, env = "ALMANAC_METRICS_INTERVAL")]
    metrics_interval: Option<HumanDuration>,
    #[command(flatten)]
    http: HttpFlags,
    #[command(flatten)]
    ui: UiFlags,
    #[command(flatten)]
    janitor: JanitorFlags,
    #[command(flatten)]
    sinks: SinkFlags,
    #[command(flatten)]
    relay: RelayFlags,
    #[command(flatten)]
    tracing: super::tracing_flags::TracingFlags,
}

/// The roles to run: `--roles` (or `roles`), else every role that applies;
/// a role that cannot work with these settings fails the start.
fn roles(
    ctx: &Ctx,
    args: &Args,
    sinks: &SinkConfig,
    http_on: bool,
) -> anyhow::Result<Vec<RoleName>> {
    let explicit = if args.roles.is_empty() {
        ctx.config.roles.clone()
    } else {
        Some(args.roles.clone())
    };
    let roles: Vec<RoleName> = explicit.unwrap_or_else(|| {
        RoleName::RUN
            .into_iter()
            .filter(|r| match r {
                RoleName::Relay => !sinks.configured().is_empty(),
                RoleName::Metrics => http_on,
                _ => true,
            })
            .collect()
    });
    if roles.contains(&RoleName::Relay) && sinks.configured().is_empty() {
        bail!("the relay role needs a sink: pass --kafka-brokers or --amqp-url (or leave `relay` out of --roles)");
    }
    if roles.contains(&RoleName::Metrics) && !http_on {
        bail!("the metrics role feeds the HTTP endpoint, which is off: set --http-addr (or leave `metrics` out of --roles)");
    }
    Ok(roles)
}

/// The scheduler, its schedule files loaded (a bad file fails the start).
fn scheduler(ctx: &Ctx, args: &Args) -> anyhow::Result<Scheduler> {
    let d = SchedulerConfig::default();
    let config = SchedulerConfig {
        schedules_dir: args.schedules.resolve(ctx),
        standby_retry: pick(
            args.standby_retry,
            ctx.config.scheduler.standby_retry,
            d.standby_retry,
        ),
        leader_timeout: pick(
            args.leader_timeout,
            ctx.config.scheduler.leader_timeout,
            d.leader_timeout,
        ),
        clock_offset: match args.clock_offset.as_deref() {
            Some(text) => crate::scheduler::parse_offset(text)
                .map_err(|e| anyhow::anyhow!("--clock-offset: {e}"))?,
            None => d.clock_offset,
        },
        ..d
    };
    let config = config.validated().map_err(super::invalid)?;
    Ok(Scheduler::new(ctx.connect_options()?, config)?)
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    let sinks = args.sinks.resolve(ctx)?;
    let http_on = args.http.addr(ctx, HttpAddr::RUN_DEFAULT).0.is_some();
    let roles = roles(ctx, &args, &sinks, http_on)?;
    let wants = |role: RoleName| roles.contains(&role);

    // Validate every setting and load the schedule files before anything
    // starts: bad input fails the start, and nothing runs half-configured.
    let reaper = ReaperConfig {
        interval: pick(
            args.reaper_interval,
            ctx.config.reaper.interval,
            ReaperConfig::default().interval,
        ),
        batch_size: args
            .reaper_batch_size
            .or(ctx.config.reaper.batch_size)
            .unwrap_or(ReaperConfig::default().batch_size),
    };
    let reaper = reaper.validated().map_err(super::invalid)?;
    let janitor = args.janitor.resolve(ctx)?;
    let collector = CollectorConfig {
        interval: pick(
            args.metrics_interval,
            ctx.config.metrics.interval,
            CollectorConfig::default().interval,
        ),
    };
    let collector = collector.validated().map_err(super::invalid)?;
    let relay = args.relay.resolve(ctx)?;
    let scheduler = if wants(RoleName::Scheduler) {
        Some(scheduler(ctx, &args)?)
    } else {
        None
    };
    let publishers = if wants(RoleName::Relay) {
        if !sinks.configured().is_empty() {
            super::sinks::check_in_flight(&relay, &sinks)?;
        }
        sinks
            .configured()
            .into_iter()
            .map(|sink| {
                Publisher::new(sink, &sinks).with_context(|| format!("starting the {sink} relay"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?
    } else {
        Vec::new()
    };

    // Last before the database: a taken port fails the start, nothing applied.
    let http = args.http.bind(ctx, HttpAddr::RUN_DEFAULT).await?;
    // Before the database too: a bad endpoint or ratio fails the start.
    let tracer = args.tracing.tracer(ctx)?;
    let pool = ctx.migrated_pool(8).await?;
    // One registry for the process: every role counts into it, /metrics renders it.
    let metrics = Metrics::new();
    let mut supervisor = Supervisor::new();
    if let Some(server) = http {
        let ui = args.ui.config(ctx, &server);
        let server = server
            .mount(crate::ui::router_traced(&pool, ui, tracer.clone()))
            .with_metrics(metrics.clone());
        supervisor.spawn(RoleName::Http, server.run(supervisor.token()));
    }
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
        supervisor.spawn_role(
            scheduler
                .reload_on(reload_rx)
                .with_metrics(metrics.clone())
                .with_tracer(tracer.clone()),
        );
    }
    if wants(RoleName::Reaper) {
        supervisor.spawn_role(Reaper::new(pool.clone(), reaper).with_metrics(metrics.clone()));
    }
    if wants(RoleName::Janitor) {
        supervisor.spawn_role(Janitor::new(pool.clone(), janitor).with_metrics(metrics.clone()));
    }
    if wants(RoleName::Metrics) {
        supervisor
            .spawn_role(Collector::new(pool.clone(), collector).with_metrics(metrics.clone()));
    }
    for publisher in publishers {
        supervisor.spawn_role(
            Relay::new(pool.clone(), publisher, relay.clone())
                .with_metrics(metrics.clone())
                .with_tracer(tracer.clone()),
        );
    }
    let names: Vec<&str> = roles.iter().map(|r| r.as_str()).collect();
    tracing::info!(roles = %names.join(","), "almanac running");
    let result = supervisor.run_until_signal().await;
    super::flush_spans(&tracer).await;
    Ok(result?)
}
