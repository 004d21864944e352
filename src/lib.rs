//! almanac: a scheduler-and-outbox relay on PostgreSQL.
//!
//! The crate is laid out by role; each module's doc states the guarantee it
//! gives and where that guarantee stops.
//!
//! - [`db`]: connecting (creating the database when missing), migrations and
//!   the schema's state ([`db::schema`]); errors name the target, never the
//!   password.
//! - [`queue`]: the job table's state machine and its lease fence: enqueue,
//!   claim, complete, fail, heartbeat, and the operator actions (retry, cancel,
//!   list, stats). Every change of a job's status goes through here.
//! - [`worker`]: the runtime that claims jobs for registered handlers;
//!   [`worker::executor`] runs them (for workers and consumers alike) under
//!   heartbeated leases and a local lease deadline and records their outcome;
//!   [`worker::exec`] is the shell-command handler behind `almanac work`.
//! - [`maintenance`]: the reaper, which returns expired leases to `ready` (or
//!   `dead`), and the janitor, which deletes finished jobs and published outbox
//!   rows past retention; both in short SKIP LOCKED batches.
//! - [`http`] and [`metrics`]: `/healthz`, `/readyz`, `/metrics` (Prometheus);
//!   `metrics` is a leaf handed to every role. [`stats`]: the snapshot of
//!   database figures `almanac stats` prints and the collector role that
//!   sets the gauges from it.
//! - [`config`]: `almanac.toml`, overridden by `ALMANAC_*` variables and flags.
//! - [`cli`]: one file per subcommand; `src/main.rs` only dispatches.
//! - [`scheduler`]: cron, DST timeline, schedule files, run ledger, leader.
//! - [`relay`] and [`consumer`]: the outbox relay to Kafka or RabbitMQ, routes,
//!   and the broker consumers that run jobs through the same fence.
//! - [`broker`]: sinks, connecting, creating topics and queues, and the typed
//!   publish error, shared by the relay and the consumers.
//! - [`redact`]: the one place connection URLs lose their passwords.
//! - [`retry`]: the one pacing helper for reconnect and retry loops.
//! - [`role`]: the one contract every background role keeps (typed name,
//!   validated config, `run(self, shutdown)`, `run_once` where periodic).
//! - [`supervisor`]: runs background roles under one cancellation token.
//! - [`control`]: the operator's levers (pause and resume kinds, cancel,
//!   retry, bulk actions), each acting and writing its audit row in one
//!   transaction, the same code behind the CLI, the dashboard and the API.
//! - [`telemetry`]: one trace per job: W3C trace context, the spans of
//!   schedule runs, publishes and executions, and their OTLP/HTTP export
//!   (off unless configured, nothing built when off).
//! - [`ui`]: the web dashboard `almanac run` serves (read-only unless
//!   `--ui-actions`).

pub mod broker;
pub mod cli;
pub mod config;
pub mod consumer;
pub mod control;
pub mod db;
pub mod http;
pub mod maintenance;
pub mod metrics;
pub mod queue;
pub mod redact;
pub mod relay;
pub mod retry;
pub mod role;
pub mod scheduler;
pub mod stats;
pub mod supervisor;
pub mod telemetry;
pub mod ui;
pub mod worker;
