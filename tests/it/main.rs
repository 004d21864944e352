//! The integration tests, one binary: one module per area, and the harness
//! they share (polling, the `almanac` launcher, brokers, the TCP proxy,
//! HTTP, scheduler processes). One binary links once and runs every test in
//! one process, so state that lives in the process is shared: the metrics
//! registry (`almanac::metrics::global()`), ports, the environment and the
//! current directory. The harness says how each is kept apart.
//!
//! Run one area with `cargo test --test it queue::`, one test by its name.

mod harness;

mod cli;
mod cli_broker;
mod compose;
mod consumer_faults;
mod exec;
mod leader;
mod leader_faults;
mod migration;
mod ops;
mod queue;
mod relay;
mod relay_faults;
mod relay_routes;
mod scheduler;
mod schema;
mod ui;
mod worker;
mod worker_faults;
