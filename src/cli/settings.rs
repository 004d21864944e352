//! Every setting, defined once: its flag (with its environment variable, its
//! documentation line and its `[default: ...]`) is the clap argument in the
//! subcommand's file; [`SETTINGS`] ties each `almanac.toml` key to that flag.
//! From the two come the settings reference in `docs/operations.md`
//! ([`reference`], kept equal by a test) and the flag named in a refused
//! setting ([`invalid`]: the roles' checks name the file key, a person at the
//! command line reads the flag too).

use clap::CommandFactory as _;

use super::Cli;
use crate::role::InvalidSetting;

/// An `almanac.toml` key (`[section] key`, or `key` at the top) and the flag
/// that overrides it.
pub struct Setting {
    pub key: &'static str,
    pub flag: &'static str,
}

const fn s(key: &'static str, flag: &'static str) -> Setting {
    Setting { key, flag }
}

/// Every key of `almanac.toml`, in the order the reference lists them.
pub const SETTINGS: &[Setting] = &[
    s("database_url", "--database-url"),
    s("log_format", "--log-format"),
    s("schedules_dir", "--schedules"),
    s("roles", "--roles"),
    s("http_addr", "--http-addr"),
    s("http_basic_auth", "--http-basic-auth"),
    s("ui_actions", "--ui-actions"),
    s("[worker] concurrency", "--concurrency"),
    s("[worker] batch_size", "--batch-size"),
    s("[worker] lease", "--lease"),
    s("[worker] poll_interval", "--poll-interval"),
    s("[worker] shutdown_deadline", "--shutdown-deadline"),
    s("[worker] timeout", "--timeout"),
    s("[scheduler] standby_retry", "--standby-retry"),
    s("[scheduler] leader_timeout", "--leader-timeout"),
    s("[reaper] interval", "--reaper-interval"),
    s("[reaper] batch_size", "--reaper-batch-size"),
    s("[janitor] interval", "--janitor-interval"),
    s("[janitor] done_retention", "--done-retention"),
    s("[janitor] dead_retention", "--dead-retention"),
    s("[janitor] outbox_retention", "--outbox-retention"),
    s("[janitor] batch_size", "--janitor-batch"),
    s("[janitor] pause", "--janitor-pause"),
    s("[metrics] interval", "--metrics-interval"),
    s("[relay] kafka_brokers", "--kafka-brokers"),
    s("[relay] amqp_url", "--amqp-url"),
    s("[relay] kafka_partitions", "--kafka-partitions"),
    s("[relay] kafka_replication", "--kafka-replication"),
    s("[relay] ack_timeout", "--ack-timeout"),
    s("[relay] redrive_after", "--redrive-after"),
    s("[relay] max_message_bytes", "--max-message-bytes"),
    s("[relay] max_publish_attempts", "--max-publish-attempts"),
    s("[relay] in_flight_lease", "--in-flight-lease"),
    s("[relay] reconcile_interval", "--reconcile-interval"),
    s("[relay] batch_size", "--relay-batch-size"),
    s("[relay] batch_bytes", "--relay-batch-bytes"),
    s("[tracing] otlp_endpoint", "--otlp-endpoint"),
    s("[tracing] sample_ratio", "--trace-sample-ratio"),
];

/// A setting's error as a person at the command line reads it: the flag,
/// then the file key, then the rule.
pub(crate) fn invalid(err: InvalidSetting) -> anyhow::Error {
    match SETTINGS.iter().find(|s| s.key == err.setting) {
        Some(s) => anyhow::anyhow!("{} ({}) {}", s.flag, err.setting, err.problem),
        None => anyhow::Error::new(err),
    }
}

/// What clap knows of a flag: the subcommands that take it, its variable
/// and its documentation line.
struct Described {
    commands: Vec<String>,
    env: Option<String>,
    help: String,
}

fn describe(flag: &str) -> Option<Described> {
    fn walk(cmd: &clap::Command, path: &str, flag: &str, out: &mut Option<Described>) {
        for arg in cmd.get_arguments() {
            if arg.get_long().map(|l| format!("--{l}")).as_deref() != Some(flag) {
                continue;
            }
            let d = out.get_or_insert_with(|| Described {
                commands: Vec::new(),
                env: arg.get_env().map(|e| e.to_string_lossy().into_owned()),
                help: arg.get_help().map(|h| h.to_string()).unwrap_or_default(),
            });
            if arg.is_global_set() {
                d.commands = vec!["every command".into()];
            } else if !path.is_empty() && !d.commands.iter().any(|c| c == "every command") {
                d.commands.push(format!("`{path}`"));
            }
        }
        for sub in cmd.get_subcommands() {
            let path = if path.is_empty() {
                sub.get_name().to_string()
            } else {
                format!("{path} {}", sub.get_name())
            };
            walk(sub, &path, flag, out);
        }
    }
    let mut out = None;
    walk(&Cli::command(), "", flag, &mut out);
    out.map(|mut d| {
        d.commands.dedup();
        d
    })
}

/// The first sentence of a help text and its `[default: ...]`.
fn split_help(help: &str) -> (String, String) {
    let text = help.split_whitespace().collect::<Vec<_>>().join(" ");
    let (text, default) = match text.find("[default: ") {
        Some(at) => {
            let rest = &text[at + "[default: ".len()..];
            let end = rest.rfind(']').unwrap_or(rest.len());
            let tail = rest[end..].trim_start_matches(']').trim();
            (
                format!("{}{}", text[..at].trim_end(), tail),
                rest[..end].to_string(),
            )
        }
        None => (text, String::new()),
    };
    let text = text.trim_end_matches('.').replace('|', "\\|");
    (text, default.replace('|', "\\|"))
}

/// The settings reference, as `docs/operations.md` shows it.
pub fn reference() -> String {
    let mut out = String::from(
        "| `almanac.toml` key | flag | variable | default | commands | what it sets |\n\
         | --- | --- | --- | --- | --- | --- |\n",
    );
    for s in SETTINGS {
        let d = describe(s.flag)
            .unwrap_or_else(|| panic!("{} ({}) is no flag of any command", s.flag, s.key));
        let (text, default) = split_help(&d.help);
        out.push_str(&format!(
            "| `{}` | `{}` | {} | {} | {} | {} |\n",
            s.key,
            s.flag,
            d.env.map_or("—".to_string(), |e| format!("`{e}`")),
            if default.is_empty() {
                "—".to_string()
            } else {
                default
            },
            d.commands.join(", "),
            text
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    use super::*;

    const BEGIN: &str = "<!-- settings reference: generated by `src/cli/settings.rs`; ALMANAC_BLESS_DOCS=1 cargo test --lib settings rewrites it -->\n";
    const END: &str = "<!-- end of settings reference -->";

    fn operations() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md")
    }

    #[test]
    fn the_reference_in_the_docs_is_generated_from_the_flags() {
        let path = operations();
        let text = std::fs::read_to_string(&path).unwrap();
        let start = text
            .find(BEGIN)
            .expect("docs/operations.md has the reference markers");
        let end = text
            .find(END)
            .expect("docs/operations.md has the end marker");
        let now = &text[start + BEGIN.len()..end];
        let want = reference();
        if std::env::var_os("ALMANAC_BLESS_DOCS").is_some() && now != want {
            let updated = format!("{}{BEGIN}{want}{}", &text[..start], &text[end..]);
            std::fs::write(&path, updated).unwrap();
            return;
        }
        assert_eq!(
            now, want,
            "docs/operations.md's settings reference is out of date: run `ALMANAC_BLESS_DOCS=1 cargo test --lib settings`"
        );
    }

    /// The table names exactly the keys of the `almanac.toml` sample in the
    /// docs, which loads (unknown keys are refused), so every key in the
    /// table is real and every documented key has its flag.
    #[test]
    fn every_key_of_the_sample_config_has_its_flag_and_no_other() {
        let text = std::fs::read_to_string(operations()).unwrap();
        let sample = text
            .split("```toml\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("the configuration sample");
        crate::config::Config::parse(Path::new("docs/operations.md"), sample).unwrap();
        let value: toml::Table = sample.parse().unwrap();
        let mut keys = BTreeSet::new();
        for (key, v) in &value {
            match v.as_table() {
                Some(section) => keys.extend(section.keys().map(|k| format!("[{key}] {k}"))),
                None => {
                    keys.insert(key.clone());
                }
            }
        }
        // The sample leaves the basic-auth key commented out (it holds a password).
        keys.insert("http_basic_auth".into());
        let table: BTreeSet<String> = SETTINGS.iter().map(|s| s.key.to_string()).collect();
        assert_eq!(keys, table);
    }

    #[test]
    fn every_flag_has_a_variable_a_documentation_line_and_a_default() {
        for s in SETTINGS {
            let d = describe(s.flag).unwrap_or_else(|| panic!("{} is no flag", s.flag));
            assert!(d.env.is_some(), "{} has no environment variable", s.flag);
            let (text, default) = split_help(&d.help);
            assert!(!text.is_empty(), "{} has no documentation line", s.flag);
            assert!(
                !default.is_empty(),
                "{}'s help names no [default: ...]",
                s.flag
            );
        }
    }

    enum Is {
        Time(std::time::Duration),
        Count(i64),
    }

    /// The value each setting takes when nothing sets it, from the code.
    fn code_defaults() -> Vec<(&'static str, Is)> {
        use crate::broker::SinkConfig;
        use crate::maintenance::{JanitorConfig, ReaperConfig};
        use crate::relay::RelayConfig;
        use crate::scheduler::SchedulerConfig;
        use crate::stats::CollectorConfig;
        use crate::worker::WorkerConfig;

        let (reaper, janitor) = (ReaperConfig::default(), JanitorConfig::default());
        let (relay, sinks) = (RelayConfig::default(), SinkConfig::default());
        let scheduler = SchedulerConfig::default();
        let worker = WorkerConfig::for_commands();
        vec![
            ("[reaper] interval", Is::Time(reaper.interval)),
            ("[reaper] batch_size", Is::Count(reaper.batch_size)),
            ("[janitor] interval", Is::Time(janitor.interval)),
            ("[janitor] done_retention", Is::Time(janitor.done_retention)),
            ("[janitor] dead_retention", Is::Time(janitor.dead_retention)),
            (
                "[janitor] outbox_retention",
                Is::Time(janitor.outbox_retention),
            ),
            ("[janitor] batch_size", Is::Count(janitor.batch_size)),
            ("[janitor] pause", Is::Time(janitor.pause)),
            (
                "[metrics] interval",
                Is::Time(CollectorConfig::default().interval),
            ),
            ("[relay] redrive_after", Is::Time(relay.redrive_after)),
            ("[relay] in_flight_lease", Is::Time(relay.in_flight_lease)),
            (
                "[relay] reconcile_interval",
                Is::Time(relay.reconcile_interval),
            ),
            ("[relay] batch_size", Is::Count(relay.batch_size)),
            ("[relay] batch_bytes", Is::Count(relay.batch_bytes)),
            (
                "[relay] max_publish_attempts",
                Is::Count(relay.max_publish_attempts.into()),
            ),
            (
                "[relay] kafka_partitions",
                Is::Count(sinks.kafka_partitions.into()),
            ),
            (
                "[relay] kafka_replication",
                Is::Count(sinks.kafka_replication.into()),
            ),
            ("[relay] ack_timeout", Is::Time(sinks.ack_timeout)),
            (
                "[relay] max_message_bytes",
                Is::Count(sinks.max_message_bytes as i64),
            ),
            (
                "[scheduler] standby_retry",
                Is::Time(scheduler.standby_retry),
            ),
            (
                "[scheduler] leader_timeout",
                Is::Time(scheduler.leader_timeout),
            ),
            ("[worker] lease", Is::Time(worker.lease)),
            ("[worker] poll_interval", Is::Time(worker.poll_interval)),
            (
                "[worker] shutdown_deadline",
                Is::Time(worker.shutdown_deadline),
            ),
        ]
    }

    /// Every role's defaults keep its rules (`Valid::default` relies on it).
    #[test]
    fn every_roles_defaults_are_valid() {
        use crate::maintenance::{JanitorConfig, ReaperConfig};
        use crate::relay::RelayConfig;
        use crate::role::Settings as _;
        use crate::scheduler::SchedulerConfig;
        use crate::stats::CollectorConfig;
        use crate::worker::WorkerConfig;

        ReaperConfig::default().check().unwrap();
        JanitorConfig::default().check().unwrap();
        CollectorConfig::default().check().unwrap();
        RelayConfig::default().check().unwrap();
        SchedulerConfig::default().check().unwrap();
        WorkerConfig::default().check().unwrap();
        WorkerConfig::for_commands().check().unwrap();
        crate::broker::SinkConfig::default().check().unwrap();
    }

    /// The `[default: ...]` a flag's help states is the value the code
    /// uses when neither the flag, its variable nor the file sets it.
    #[test]
    fn the_documented_defaults_are_the_defaults_the_code_uses() {
        use crate::config::HumanDuration;

        for (key, actual) in code_defaults() {
            let flag = SETTINGS.iter().find(|s| s.key == key).unwrap().flag;
            let (_, documented) = split_help(&describe(flag).unwrap().help);
            let what = format!("{flag} ({key}) documents [default: {documented}]");
            match actual {
                Is::Time(d) => assert_eq!(
                    documented.parse::<HumanDuration>().map(|h| h.0),
                    Ok(d),
                    "{what}"
                ),
                Is::Count(n) => assert_eq!(documented.parse::<i64>(), Ok(n), "{what}"),
            }
        }
    }

    #[test]
    fn a_refused_setting_names_its_flag_and_key() {
        let err =
            InvalidSetting::positive("[reaper] interval", std::time::Duration::ZERO).unwrap_err();
        assert_eq!(
            invalid(err).to_string(),
            "--reaper-interval ([reaper] interval) must be longer than 0s; write a duration such as 500ms, 5s or 1m"
        );
    }
}
