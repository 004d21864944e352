//! The tracing flags `run`, `work` and `consume` share (docs/tracing.md):
//! the OTLP endpoint and the sampling ratio, with OpenTelemetry's own
//! variables as their environment.

use crate::telemetry::{ExportConfig, Tracer};

#[derive(Debug, Clone, clap::Args)]
pub struct TracingFlags {
    /// OTLP/HTTP collector, http://HOST:PORT; spans go to its /v1/traces. May hold a password (sent as basic auth, never logged) [default: off, nothing traced].
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Share of new traces sampled, 0 to 1; a span with a parent follows its parent's sampled flag [default: 1].
    #[arg(long, env = "OTEL_TRACES_SAMPLER_ARG")]
    pub trace_sample_ratio: Option<f64>,
}

impl TracingFlags {
    /// The tracer these flags (or `[tracing]`) configure; off without an
    /// endpoint. `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the traces path
    /// itself) wins over both, `OTEL_SERVICE_NAME` names the service.
    pub fn tracer(&self, ctx: &super::Ctx) -> anyhow::Result<Tracer> {
        let file = &ctx.config.tracing;
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let (endpoint, traces_path_given) = match var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            Some(url) => (url, true),
            None => match self.otlp_endpoint.clone().or(file.otlp_endpoint.clone()) {
                Some(url) => (url, false),
                None => return Ok(Tracer::off()),
            },
        };
        let mut config = ExportConfig::new(endpoint);
        config.traces_path_given = traces_path_given;
        config.ratio = self.trace_sample_ratio.or(file.sample_ratio).unwrap_or(1.0);
        if let Some(name) = var("OTEL_SERVICE_NAME") {
            config.service_name = name;
        }
        let shown = crate::redact::redact_url(&config.endpoint);
        let tracer = Tracer::otlp(config)?;
        tracing::info!(endpoint = %shown, "tracing: exporting spans by OTLP/HTTP");
        Ok(tracer)
    }
}
