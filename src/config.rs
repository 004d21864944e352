//! `almanac.toml`, overridden by `ALMANAC_*` environment variables and flags.
//!
//! Precedence, highest first: a command-line flag, its environment variable
//! (clap reads both), the config file, the built-in default. The file is
//! optional: `almanac.toml` in the working directory when present, or the path
//! given by `--config` / `ALMANAC_CONFIG` (which must exist). Unknown keys are
//! rejected with the file, line and column, so a typo never silently falls
//! back to a default. `database_url` may hold a password; it is never logged.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/almanac";
pub const DEFAULT_CONFIG_FILE: &str = "almanac.toml";

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub database_url: Option<String>,
    pub log_format: Option<LogFormat>,
    /// Roles `almanac run` runs; default: all that apply.
    pub roles: Option<Vec<crate::role::RoleName>>,
    pub schedules_dir: Option<PathBuf>,
    /// HTTP endpoint (`/healthz`, `/readyz`, `/metrics`): HOST:PORT or `off`.
    pub http_addr: Option<HttpAddr>,
    /// `USER:PASSWORD` guarding the HTTP endpoint; never logged.
    pub http_basic_auth: Option<String>,
    /// Let the dashboard and the JSON API act: retry and cancel jobs, pause
    /// and resume kinds, pause, resume or trigger schedules
    /// (`--ui-actions`); default read-only.
    pub ui_actions: Option<bool>,
    #[serde(default)]
    pub worker: WorkerSection,
    #[serde(default)]
    pub scheduler: SchedulerSection,
    #[serde(default)]
    pub janitor: JanitorSection,
    #[serde(default)]
    pub metrics: MetricsSection,
    #[serde(default)]
    pub reaper: ReaperSection,
    #[serde(default)]
    pub relay: RelaySection,
    #[serde(default)]
    pub tracing: TracingSection,
}

/// `[tracing]`: OpenTelemetry export (docs/tracing.md); off unless an
/// endpoint is set here or in `OTEL_EXPORTER_OTLP_ENDPOINT`, which wins.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingSection {
    /// `http://HOST:PORT` of an OTLP/HTTP collector; may hold a password
    /// (sent as basic auth), never logged.
    pub otlp_endpoint: Option<String>,
    /// Share of root traces sampled, 0 to 1 (`OTEL_TRACES_SAMPLER_ARG` wins).
    pub sample_ratio: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelaySection {
    pub kafka_brokers: Option<String>,
    /// May hold a password; never logged.
    pub amqp_url: Option<String>,
    pub kafka_partitions: Option<i32>,
    pub kafka_replication: Option<i32>,
    pub ack_timeout: Option<HumanDuration>,
    pub redrive_after: Option<HumanDuration>,
    pub max_message_bytes: Option<usize>,
    pub max_publish_attempts: Option<i32>,
    pub in_flight_lease: Option<HumanDuration>,
    pub reconcile_interval: Option<HumanDuration>,
    pub batch_size: Option<i64>,
    pub batch_bytes: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSection {
    pub concurrency: Option<usize>,
    pub batch_size: Option<usize>,
    pub lease: Option<HumanDuration>,
    pub poll_interval: Option<HumanDuration>,
    pub shutdown_deadline: Option<HumanDuration>,
    /// Per-command timeout of the exec handler.
    pub timeout: Option<HumanDuration>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerSection {
    pub standby_retry: Option<HumanDuration>,
    pub leader_timeout: Option<HumanDuration>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JanitorSection {
    pub interval: Option<HumanDuration>,
    pub done_retention: Option<HumanDuration>,
    pub dead_retention: Option<HumanDuration>,
    pub outbox_retention: Option<HumanDuration>,
    pub batch_size: Option<i64>,
    pub pause: Option<HumanDuration>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsSection {
    /// How often the collector refreshes the database figures.
    pub interval: Option<HumanDuration>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReaperSection {
    pub interval: Option<HumanDuration>,
    pub batch_size: Option<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path} does not exist (named by --config or ALMANAC_CONFIG)")]
    Missing { path: PathBuf },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}:{column}: {message}")]
    Parse {
        path: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
}

impl Config {
    /// Loads `explicit`, or `almanac.toml` when it exists, or the defaults.
    pub fn load(explicit: Option<&Path>) -> Result<Config, ConfigError> {
        let path = match explicit {
            Some(path) if !path.exists() => {
                return Err(ConfigError::Missing {
                    path: path.to_path_buf(),
                })
            }
            Some(path) => path.to_path_buf(),
            None if Path::new(DEFAULT_CONFIG_FILE).exists() => PathBuf::from(DEFAULT_CONFIG_FILE),
            None => return Ok(Config::default()),
        };
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        Self::parse(&path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let (line, column) = line_col(text, e.span().map_or(0, |s| s.start));
            ConfigError::Parse {
                path: path.to_path_buf(),
                line,
                column,
                message: e.message().to_string(),
            }
        })
    }
}

/// `Ok` for a duration above zero; else a message naming the setting.
/// A duration setting: the flag (or its environment variable), else the
/// config file's key, else the default.
pub fn pick(
    flag: Option<HumanDuration>,
    file: Option<HumanDuration>,
    default: Duration,
) -> Duration {
    flag.or(file).map_or(default, |d| d.0)
}

/// Where the HTTP endpoint listens (`--http-addr`, `http_addr`): an
/// address, or `off`. Parsed here with the other setting values; served by
/// [`crate::http`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpAddr(pub Option<SocketAddr>);

impl HttpAddr {
    pub const RUN_DEFAULT: HttpAddr = HttpAddr(Some(SocketAddr::V4(std::net::SocketAddrV4::new(
        std::net::Ipv4Addr::LOCALHOST,
        9797,
    ))));
    pub const OFF: HttpAddr = HttpAddr(None);
}

impl FromStr for HttpAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("off") {
            return Ok(HttpAddr::OFF);
        }
        s.parse::<SocketAddr>().map(|a| HttpAddr(Some(a))).map_err(|_| {
            format!("`{s}` is not an address to listen on; write HOST:PORT with an IP (127.0.0.1:9797, [::1]:9797, 0.0.0.0:9797) or `off`")
        })
    }
}

impl<'de> serde::Deserialize<'de> for HttpAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// 1-based line and column of a byte offset.
pub fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// A duration written as a person would: `500ms`, `30s`, `5m`, `2h`, `7d`,
/// or a combination such as `1h30m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(pub Duration);

impl FromStr for HumanDuration {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            format!("`{s}` is not a duration; write a number with a unit: 500ms, 30s, 5m, 2h, 7d (or 1h30m)")
        };
        let text = s.trim();
        if text.is_empty() {
            return Err(bad());
        }
        let mut total = Duration::ZERO;
        let mut rest = text;
        while !rest.is_empty() {
            let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
            if digits == 0 {
                return Err(bad());
            }
            let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
            rest = &rest[digits..];
            let unit_len = rest
                .find(|c: char| c.is_ascii_digit())
                .unwrap_or(rest.len());
            let unit = match &rest[..unit_len] {
                "ms" => Duration::from_millis(1),
                "s" => Duration::from_secs(1),
                "m" => Duration::from_secs(60),
                "h" => Duration::from_secs(3600),
                "d" => Duration::from_secs(86_400),
                _ => return Err(bad()),
            };
            total += unit
                .checked_mul(u32::try_from(n).map_err(|_| bad())?)
                .ok_or_else(bad)?;
            rest = &rest[unit_len..];
        }
        Ok(HumanDuration(total))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        match ms {
            0 => write!(f, "0s"),
            _ if ms % 86_400_000 == 0 => write!(f, "{}d", ms / 86_400_000),
            _ if ms % 3_600_000 == 0 => write!(f, "{}h", ms / 3_600_000),
            _ if ms % 60_000 == 0 => write!(f, "{}m", ms / 60_000),
            _ if ms % 1000 == 0 => write!(f, "{}s", ms / 1000),
            _ => write!(f, "{ms}ms"),
        }
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// `3d 4h`, `5m 10s`: the two largest units of a span of seconds, for people
/// (`almanac schedules list`, the dashboard).
pub fn coarse_age(seconds: i64) -> String {
    let units = [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)];
    let mut left = seconds.max(0);
    let mut parts = Vec::new();
    for (name, size) in units {
        if left >= size || (parts.is_empty() && size == 1) {
            parts.push(format!("{}{name}", left / size));
            left %= size;
        }
        if parts.len() == 2 {
            break;
        }
    }
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_written() {
        let d = |s: &str| s.parse::<HumanDuration>().map(|h| h.0);
        assert_eq!(d("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(d("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(d("1h30m"), Ok(Duration::from_secs(5400)));
        for bad in ["", "7", "d", "3 days", "-1s", "1.5h"] {
            let err = d(bad).unwrap_err();
            assert!(err.contains("is not a duration"), "{bad}: {err}");
        }
        assert_eq!(HumanDuration(Duration::from_secs(5400)).to_string(), "90m");
    }

    #[test]
    fn unknown_key_names_file_line_and_key() {
        let text = "database_url = \"postgres://x\"\n\n[worker]\nconcurency = 4\n";
        let err = Config::parse(Path::new("almanac.toml"), text)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("almanac.toml:4:1: unknown field `concurency`"),
            "{err}"
        );
    }

    #[test]
    fn bad_duration_in_file_is_reported_at_its_line() {
        let text = "[reaper]\ninterval = \"soon\"\n";
        let err = Config::parse(Path::new("a.toml"), text)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("a.toml:2:"), "{err}");
        assert!(err.contains("`soon` is not a duration"), "{err}");
    }
}
