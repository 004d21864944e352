//! Flags for the operations side, shared by `run`, `work`, `consume` and
//! `janitor`: the HTTP endpoint and the janitor's retention.

use anyhow::Context as _;

use super::Ctx;
use crate::config::{pick, HumanDuration};
use crate::http::{BasicAuth, HttpAddr, HttpServer};
use crate::maintenance::JanitorConfig;
use crate::role::{Settings, Valid};

#[derive(Debug, Clone, clap::Args)]
pub struct HttpFlags {
    /// Where /healthz, /readyz, /metrics (and, for `run`, the dashboard) listen, HOST:PORT or `off`
    /// [default: 127.0.0.1:9797 for `run`, off for `work` and `consume`].
    #[arg(long, env = "ALMANAC_HTTP_ADDR", value_name = "ADDR|off")]
    pub http_addr: Option<HttpAddr>,
    /// USER:PASSWORD required by /metrics (and the dashboard); needed to
    /// listen beyond loopback. Prefer the environment variable [default: none].
    #[arg(long, env = "ALMANAC_HTTP_BASIC_AUTH", hide_env_values = true)]
    pub http_basic_auth: Option<BasicAuth>,
}

/// `almanac run`'s dashboard switches.
#[derive(Debug, Clone, clap::Args)]
pub struct UiFlags {
    /// Let the dashboard (POST forms with a CSRF token) and the JSON API
    /// retry and cancel jobs, pause and resume kinds, and pause, resume or
    /// trigger schedules; without it both are read-only [default: off].
    #[arg(long, env = "ALMANAC_UI_ACTIONS", num_args = 0..=1, default_missing_value = "true", value_name = "BOOL",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub ui_actions: Option<bool>,
}

impl UiFlags {
    /// The flag, else `ui_actions` in the config file, else off; for the
    /// dashboard on `server`.
    pub fn config(&self, ctx: &Ctx, server: &HttpServer) -> crate::ui::UiConfig {
        crate::ui::UiConfig {
            actions: self.ui_actions.or(ctx.config.ui_actions).unwrap_or(false),
            any_host: server.has_auth(),
        }
    }
}

impl HttpFlags {
    /// The flag, else `http_addr` in the config file, else `default`.
    pub fn addr(&self, ctx: &Ctx, default: HttpAddr) -> HttpAddr {
        self.http_addr.or(ctx.config.http_addr).unwrap_or(default)
    }

    /// Binds the endpoint (before anything else starts, so a taken port
    /// fails the command at once), or `None` when it is off.
    pub async fn bind(&self, ctx: &Ctx, default: HttpAddr) -> anyhow::Result<Option<HttpServer>> {
        let Some(addr) = self.addr(ctx, default).0 else {
            return Ok(None);
        };
        let auth = match (&self.http_basic_auth, &ctx.config.http_basic_auth) {
            (Some(auth), _) => Some(auth.clone()),
            (None, Some(text)) => Some(
                text.parse::<BasicAuth>()
                    .map_err(|e| anyhow::anyhow!("http_basic_auth in the config file: {e}"))?,
            ),
            (None, None) => None,
        };
        Ok(Some(
            HttpServer::bind(addr, auth, &ctx.connect_options()?).await?,
        ))
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct JanitorFlags {
    /// Delete done jobs finished longer ago than this [default: 7d].
    #[arg(long, env = "ALMANAC_DONE_RETENTION")]
    pub done_retention: Option<HumanDuration>,
    /// Delete dead jobs finished longer ago than this [default: 30d].
    #[arg(long, env = "ALMANAC_DEAD_RETENTION")]
    pub dead_retention: Option<HumanDuration>,
    /// Delete outbox rows published longer ago than this [default: 1d].
    #[arg(long, env = "ALMANAC_OUTBOX_RETENTION")]
    pub outbox_retention: Option<HumanDuration>,
    /// Rows per delete statement [default: 1000].
    #[arg(long, env = "ALMANAC_JANITOR_BATCH")]
    pub janitor_batch: Option<i64>,
    /// Pause between two delete statements [default: 100ms].
    #[arg(long, env = "ALMANAC_JANITOR_PAUSE")]
    pub janitor_pause: Option<HumanDuration>,
    /// How often the janitor starts a pass [default: 30s].
    #[arg(long, env = "ALMANAC_JANITOR_INTERVAL")]
    pub janitor_interval: Option<HumanDuration>,
}

impl JanitorFlags {
    pub fn resolve(&self, ctx: &Ctx) -> anyhow::Result<Valid<JanitorConfig>> {
        let file = &ctx.config.janitor;
        let d = JanitorConfig::default();
        let config = JanitorConfig {
            interval: pick(self.janitor_interval, file.interval, d.interval),
            done_retention: pick(self.done_retention, file.done_retention, d.done_retention),
            dead_retention: pick(self.dead_retention, file.dead_retention, d.dead_retention),
            outbox_retention: pick(
                self.outbox_retention,
                file.outbox_retention,
                d.outbox_retention,
            ),
            batch_size: self
                .janitor_batch
                .or(file.batch_size)
                .unwrap_or(d.batch_size),
            pause: pick(self.janitor_pause, file.pause, d.pause),
        };
        config
            .validated()
            .map_err(super::invalid)
            .context("invalid janitor settings")
    }
}
