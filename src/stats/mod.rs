//! The figures that come from the database, read in one [`Snapshot`]: for
//! `almanac stats`, the dashboard, and the [`Collector`] role that sets the
//! database gauges of a [`crate::metrics::Metrics`] from it on an interval.
//! This module reads the queue, the outbox and the scheduler; `metrics`
//! stays a leaf that knows none of them.

pub mod collector;
pub mod snapshot;

pub use collector::{Collector, CollectorConfig};
pub use snapshot::Snapshot;
