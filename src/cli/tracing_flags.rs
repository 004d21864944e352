//! The tracing flags `run`, `work`, `consume`, `backfill` and `schedules
//! trigger` share (docs/tracing.md):
//! the OTLP endpoint and the sampling ratio, with OpenTelemetry's own
//! variables as their environment.

use crate::telemetry::{ExportConfig, Tracer};

#[derive(Debug, Clone, clap::Args)]
pub struct TracingFlags {
    /// OTLP/HTTP collector, http://HOST:PORT; spans go to its /v1/traces. May hold a password (sent as basic auth, never logged) [default: off, nothing traced].
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", hide_env_values = true)]
    pub otlp_endpoint: Option<String>,
    /// Share of new traces sampled, 0 to 1; a span with a parent follows its parent's sampled flag [default: 1]. Read only when an endpoint is set.
    #[arg(long, env = "OTEL_TRACES_SAMPLER_ARG")]
    pub trace_sample_ratio: Option<String>,
}

impl TracingFlags {
    /// [`TracingFlags::tracer`] for a one-shot command (`backfill`,
    /// `schedules trigger`): settings that cannot make a tracer (an
    /// `OTEL_*` variable left for another program, say) are a warning and
    /// no tracing, never a command that does not run.
    pub fn tracer_or_off(&self, ctx: &super::Ctx) -> Tracer {
        self.tracer(ctx).unwrap_or_else(|e| {
            tracing::warn!("tracing is off for this command: {e:#}");
            Tracer::off()
        })
    }

    /// The tracer these flags (or `[tracing]`) configure; off without an
    /// endpoint. `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the traces path
    /// itself) wins over both, `OTEL_SERVICE_NAME` names the service.
    pub fn tracer(&self, ctx: &super::Ctx) -> anyhow::Result<Tracer> {
        let file = &ctx.config.tracing;
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let (endpoint, traces_path_given) = match var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            Some(url) => (url, true),
            // An empty variable (a compose file's `${VAR}`) is no endpoint.
            None => match self
                .otlp_endpoint
                .clone()
                .filter(|v| !v.trim().is_empty())
                .or(file.otlp_endpoint.clone())
            {
                Some(url) => (url, false),
                None => return Ok(Tracer::off()),
            },
        };
        let mut config = ExportConfig::new(endpoint);
        config.traces_path_given = traces_path_given;
        // Parsed only now, tracing being on: an OTEL_TRACES_SAMPLER_ARG set
        // for another SDK's sampler never stops a start with tracing off.
        let flag_ratio = match self.trace_sample_ratio.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(text) => Some(text.parse::<f64>().map_err(|_| {
                anyhow::anyhow!(
                    "--trace-sample-ratio (OTEL_TRACES_SAMPLER_ARG) is `{text}`; give a number from 0 to 1"
                )
            })?),
        };
        config.ratio = flag_ratio.or(file.sample_ratio).unwrap_or(1.0);
        if let Some(name) = var("OTEL_SERVICE_NAME") {
            config.service_name = name;
        }
        let shown = crate::redact::redact_userinfo(&config.endpoint);
        let tracer = Tracer::otlp(config)?;
        tracing::info!(endpoint = %shown, "tracing: exporting spans by OTLP/HTTP");
        Ok(tracer)
    }
}
