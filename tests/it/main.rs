//! The integration tests, one binary: one module per area, and the harness
//! they share (polling, the `almanac` launcher, brokers, the TCP proxy,
//! HTTP, scheduler processes). One binary links once, and runs every test in
//! one process, at the same time as others, so what lives in the process is
//! shared:
//!
//! - nothing of the metrics: there is no process-wide registry; a test that
//!   asserts metrics hands its roles a `Metrics` of its own
//!   (`with_metrics`) and reads exact values;
//! - ports: bind 127.0.0.1:0; `almanac` processes start with their HTTP
//!   endpoint off ([`harness::almanac`]), and only the README front-door test
//!   (`ops::the_readme_first_command_serves_until_sigterm`) takes 9797;
//! - the environment and the current directory: no test changes them; set
//!   them on the child's `Command` instead.
//!
//! Run one area with `cargo test --test it queue::`, one test by its name.

mod harness;

mod alerts;
mod api;
mod bench_scale;
mod broker_backlog;
mod bulk;
mod cancel;
mod cli;
mod cli_broker;
mod compose;
mod consumer_faults;
mod consumer_kinds;
mod counts;
mod enqueue_routes;
mod enqueue_sql;
mod exec;
mod exec_faults;
mod leader;
mod leader_faults;
mod ledger_scale;
mod limits;
mod limits_cli;
mod migration;
mod ops;
mod ordering;
mod ordering_chain;
mod pause;
mod priority;
mod queue;
mod redrive_gate;
mod relay;
mod relay_bounds;
mod relay_faults;
mod relay_memory;
mod relay_routes;
mod reprocess;
mod route_backlog;
mod scheduler;
mod schema;
mod slow_tick;
mod snooze;
mod tracing;
mod ui;
mod unserved;
mod worker;
mod worker_faults;
