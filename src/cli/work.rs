//! `almanac work --handler KIND='COMMAND' [--handler ...] [--concurrency N]`

use anyhow::bail;

use super::Ctx;
use crate::config::{pick, HumanDuration};
use crate::http::{HttpAddr, HttpServer};
use crate::metrics::Metrics;
use crate::role::{Role, RoleName, Settings, Valid};
use crate::supervisor::Supervisor;
use crate::worker::exec::{parse_env_name, parse_handler_spec, ExecHandler};
use crate::worker::{Worker, WorkerConfig};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// KIND=COMMAND; repeat for more kinds. COMMAND runs with `sh -c`, the
    /// payload on stdin. In ALMANAC_HANDLERS, one KIND=COMMAND per line.
    #[arg(long = "handler", env = "ALMANAC_HANDLERS", value_delimiter = '\n', required = true, value_parser = parse_handler_spec)]
    handlers: Vec<(String, String)>,
    #[command(flatten)]
    worker: WorkerFlags,
    #[command(flatten)]
    http: super::ops::HttpFlags,
    #[command(flatten)]
    tracing: super::tracing_flags::TracingFlags,
}

/// Worker settings shared by every command that runs handlers.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerFlags {
    /// Commands running at once [default: 4 per core, at least 4; CPU-heavy
    /// commands: the number of cores].
    #[arg(long, env = "ALMANAC_CONCURRENCY")]
    pub concurrency: Option<usize>,
    /// Most jobs per claim statement [default: half of --concurrency].
    #[arg(long, env = "ALMANAC_BATCH_SIZE")]
    pub batch_size: Option<usize>,
    /// Lease length; renewed every third of it while a handler runs [default: 30s].
    #[arg(long, env = "ALMANAC_LEASE")]
    pub lease: Option<HumanDuration>,
    /// Poll interval behind LISTEN/NOTIFY [default: 1s].
    #[arg(long, env = "ALMANAC_POLL_INTERVAL")]
    pub poll_interval: Option<HumanDuration>,
    /// How long running handlers get to finish on SIGTERM [default: 30s].
    #[arg(long, env = "ALMANAC_SHUTDOWN_DEADLINE")]
    pub shutdown_deadline: Option<HumanDuration>,
    /// Kill a command and retry its job after this long [default: none].
    #[arg(long, env = "ALMANAC_TIMEOUT")]
    pub timeout: Option<HumanDuration>,
    /// Pass this variable of almanac's environment on to commands; repeat
    /// for more (comma-separated in ALMANAC_PASS_ENV). Commands otherwise get
    /// only PATH, HOME, LANG, TZ and the job's ALMANAC_* variables.
    #[arg(long = "pass-env", value_name = "NAME", env = "ALMANAC_PASS_ENV", value_delimiter = ',', value_parser = parse_env_name)]
    pub pass_env: Vec<String>,
}

impl WorkerFlags {
    pub fn resolve(&self, ctx: &Ctx) -> anyhow::Result<Valid<WorkerConfig>> {
        let file = &ctx.config.worker;
        let defaults = WorkerConfig::for_commands();
        let concurrency = self
            .concurrency
            .or(file.concurrency)
            .unwrap_or(defaults.concurrency);
        let config = WorkerConfig {
            concurrency,
            batch_size: self
                .batch_size
                .or(file.batch_size)
                .unwrap_or(WorkerConfig::half_batch(concurrency)),
            lease: pick(self.lease, file.lease, defaults.lease),
            poll_interval: pick(
                self.poll_interval,
                file.poll_interval,
                defaults.poll_interval,
            ),
            shutdown_deadline: pick(
                self.shutdown_deadline,
                file.shutdown_deadline,
                defaults.shutdown_deadline,
            ),
            ..defaults
        };
        config.validated().map_err(super::invalid)
    }

    pub fn command_timeout(&self, ctx: &Ctx) -> Option<std::time::Duration> {
        self.timeout.or(ctx.config.worker.timeout).map(|d| d.0)
    }

    /// The exec handler for `command` with these settings.
    pub fn exec_handler(&self, ctx: &Ctx, command: String) -> ExecHandler {
        ExecHandler::new(command)
            .watchdog(crate::worker::watchdog::this_executable())
            .timeout(self.command_timeout(ctx))
            .pass_env(self.pass_env.iter().cloned())
    }

    /// Warns about `--pass-env` names that are not set (nothing to pass).
    pub fn warn_unset_pass_env(&self) {
        for name in self
            .pass_env
            .iter()
            .filter(|n| std::env::var_os(n).is_none())
        {
            tracing::warn!(name = %name, "--pass-env names a variable that is not set; commands will not get it");
        }
    }
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    let config = args.worker.resolve(ctx)?;
    // Handlers get the shutdown deadline; the rest gets 15 s more.
    let grace = config.shutdown_deadline + std::time::Duration::from_secs(15);
    args.worker.warn_unset_pass_env();
    let mut kinds: Vec<&str> = args.handlers.iter().map(|(k, _)| k.as_str()).collect();
    kinds.sort_unstable();
    if let Some(pair) = kinds.windows(2).find(|w| w[0] == w[1]) {
        bail!(
            "--handler names kind `{}` twice; give each kind one command",
            pair[0]
        );
    }
    // Off unless set, so several workers can share a host.
    let http = args.http.bind(ctx, HttpAddr::OFF).await?;
    // Before the database too: a bad endpoint or ratio fails the start.
    let tracer = args.tracing.tracer(ctx)?;
    let pool = ctx.migrated_pool(4).await?;
    let metrics = Metrics::new();
    let mut worker = Worker::new(pool, config)
        .with_metrics(metrics.clone())
        .with_tracer(tracer.clone());
    for (kind, command) in args.handlers {
        worker = worker.register(kind, args.worker.exec_handler(ctx, command));
    }
    run_with_http(worker, http, metrics, tracer, grace).await
}

/// Runs `role` (a worker or a consumer), and the HTTP endpoint rendering
/// `metrics` when there is one, until SIGINT/SIGTERM; logs what the role
/// reports when it stops.
pub(super) async fn run_with_http<R: Role>(
    role: R,
    http: Option<HttpServer>,
    metrics: Metrics,
    tracer: crate::telemetry::Tracer,
    grace: std::time::Duration,
) -> anyhow::Result<()>
where
    R::Output: std::fmt::Debug,
{
    let mut supervisor = Supervisor::new().grace(grace);
    if let Some(server) = http {
        let server = server.with_metrics(metrics);
        supervisor.spawn(RoleName::Http, server.run(supervisor.token()));
    }
    let token = supervisor.token();
    supervisor.spawn(R::NAME, async move {
        let report = role.run(token).await?;
        tracing::info!(role = %R::NAME, ?report, "stopped");
        Ok::<_, anyhow::Error>(())
    });
    let result = supervisor.run_until_signal().await;
    super::flush_spans(&tracer).await;
    Ok(result?)
}
