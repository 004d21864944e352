//! almanac: a scheduler-and-outbox relay on PostgreSQL.
//!
//! The crate is laid out by role; each module's doc states the guarantee it
//! gives and where that guarantee stops.
//!
//! - [`db`]: connecting (creating the database when missing), migrations, and
//!   the `DATABASE_URL` redaction every error message goes through.
//! - [`queue`]: the job table's state machine and its lease fence: enqueue,
//!   claim, complete, fail, heartbeat, and the operator actions (retry, cancel,
//!   list, stats). Every SQL statement that touches `almanac.jobs` lives here.
//! - [`worker`]: the runtime that claims jobs for registered handlers, runs them
//!   under heartbeated leases and records their outcome; [`worker::exec`] is the
//!   shell-command handler behind `almanac work`.
//! - [`maintenance`]: the reaper, which returns expired leases to `ready` (or
//!   `dead`), in short SKIP LOCKED batches.
//! - [`config`]: `almanac.toml`, overridden by `ALMANAC_*` variables and flags.
//! - [`cli`]: one file per subcommand; `src/main.rs` only dispatches.
//! - [`supervisor`]: runs background roles under one cancellation token.

pub mod cli;
pub mod config;
pub mod consumer;
pub mod db;
pub mod maintenance;
pub mod queue;
pub mod relay;
pub mod scheduler;
pub mod supervisor;
pub mod worker;
