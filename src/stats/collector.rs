//! The metrics collector role: reads a [`Snapshot`] every `interval` and sets
//! the database gauges of the [`Metrics`] it was handed from it, so a scrape never runs a query and a hundred
//! scrapers cost the database nothing more. A kind or sink seen once keeps
//! its series: when it empties, its gauges drop to 0 rather than freezing at
//! their last value. So does a schedule that stops being reported (disabled
//! or removed): its lag, overdue, missing, late and skipped figures drop to 0,
//! so no alert stays firing on a schedule that no longer runs.
//!
//! An overdue run shows at the first refresh after its deadline (within one
//! `interval`), and clears at the first refresh after its job is `done`.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::snapshot::Snapshot;
use super::snapshot::{RunFigures, SKIP_REASONS};
use crate::metrics::{
    KindLabel, KindLimitLabel, KindSinkLabel, KindStatusLabel, Metrics, ScheduleLabel,
    ScheduleReasonLabel, SinkLabel,
};
use crate::queue::QueueError;
use crate::role::{InvalidSetting, Period, Periodic, RoleName, Settings, Valid};

const STATUSES: [&str; 5] = ["ready", "running", "held", "dead", "cancelled"];

#[derive(Debug, Clone)]
pub struct CollectorConfig {
    /// How often the database figures are refreshed.
    pub interval: Duration,
}

impl Default for CollectorConfig {
    fn default() -> Self {
        CollectorConfig {
            interval: Duration::from_secs(5),
        }
    }
}

impl Settings for CollectorConfig {
    fn check(&self) -> Result<(), InvalidSetting> {
        InvalidSetting::positive("[metrics] interval", self.interval).map(|_| ())
    }
}

pub struct Collector {
    pool: PgPool,
    config: Valid<CollectorConfig>,
    metrics: Metrics,
    /// Kinds and sinks seen so far (they keep their series).
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    /// Routes once reported unserved: (kind, sink).
    unserved: BTreeSet<(String, String)>,
    /// Routes once reported unconsumed: (kind, sink).
    unconsumed: BTreeSet<(String, String)>,
    kinds: BTreeSet<String>,
    sinks: BTreeSet<String>,
    schedules: BTreeSet<String>,
    /// Kinds once reported paused.
    paused: BTreeSet<String>,
    /// Kinds once reported limited.
    limited: BTreeSet<String>,
}

impl Collector {
    pub fn new(pool: PgPool, config: Valid<CollectorConfig>) -> Self {
        Collector {
            pool,
            config,
            metrics: Metrics::new(),
            seen: Mutex::default(),
        }
    }

    /// Sets the gauges of `metrics` (by default, a registry of its own).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    fn publish(&self, s: &Snapshot) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let m = &self.metrics;
        m.counts_whole.set(i64::from(s.jobs.done_exact));
        for schedule in &s.schedules {
            let label = ScheduleLabel {
                schedule: schedule.name.clone(),
            };
            m.schedule_lag
                .get_or_create(&label)
                .set(schedule.lag_seconds);
            if let Some(last) = schedule.last_run {
                m.schedule_last_run
                    .get_or_create(&label)
                    .set(last.timestamp_millis() as f64 / 1000.0);
            }
            self.publish_runs(&schedule.name, &schedule.runs, true);
        }
        let reported: BTreeSet<&String> = s.schedules.iter().map(|s| &s.name).collect();
        for gone in seen.schedules.iter().filter(|n| !reported.contains(n)) {
            m.schedule_lag
                .get_or_create(&ScheduleLabel {
                    schedule: gone.clone(),
                })
                .set(0.0);
            self.publish_runs(gone, &RunFigures::default(), false);
        }
        seen.schedules
            .extend(s.schedules.iter().map(|s| s.name.clone()));
        seen.kinds
            .extend(s.jobs.by_kind_status.iter().map(|c| c.kind.clone()));
        for kind in &seen.kinds {
            for status in STATUSES {
                let count = s
                    .jobs
                    .by_kind_status
                    .iter()
                    .find(|c| &c.kind == kind && c.status.as_str() == status)
                    .map_or(0, |c| c.count);
                m.jobs
                    .get_or_create(&KindStatusLabel {
                        kind: kind.clone(),
                        status: status.to_string(),
                    })
                    .set(count as f64);
            }
            let age = s
                .jobs
                .oldest_due_ready
                .iter()
                .find(|a| &a.kind == kind)
                .map_or(0.0, |a| a.seconds);
            m.oldest_ready_age
                .get_or_create(&KindLabel { kind: kind.clone() })
                .set(age);
        }
        m.expired_leases.set(s.jobs.expired_leases);
        flag_routes(
            &m.route_unserved,
            &mut seen.unserved,
            s.unserved.iter().map(|u| (u.kind.clone(), u.sink.clone())),
        );
        flag_routes(
            &m.route_unconsumed,
            &mut seen.unconsumed,
            s.unconsumed
                .iter()
                .map(|g| (g.kind.clone(), g.sink.clone())),
        );
        seen.paused.extend(s.paused.iter().map(|p| p.kind.clone()));
        for kind in &seen.paused {
            let now = s.paused.iter().any(|p| &p.kind == kind);
            m.kind_paused
                .get_or_create(&KindLabel { kind: kind.clone() })
                .set(if now { 1.0 } else { 0.0 });
        }
        self.publish_limits(&mut seen.limited, s);
        seen.sinks.extend(s.outbox.iter().map(|b| b.sink.clone()));
        for sink in &seen.sinks {
            let row = s.outbox.iter().find(|b| &b.sink == sink);
            let label = SinkLabel { sink: sink.clone() };
            m.outbox_backlog
                .get_or_create(&label)
                .set(row.map_or(0.0, |b| b.backlog as f64));
            m.outbox_oldest_age
                .get_or_create(&label)
                .set(row.map_or(0.0, |b| b.oldest_unpublished_seconds));
            m.outbox_failed
                .get_or_create(&label)
                .set(row.map_or(0.0, |b| b.failed as f64));
        }
    }

    /// Sets each limited kind's limit and running gauges. A limit a kind
    /// does not have (any more) has no series: a 0 would read as a limit
    /// that lets nothing run.
    fn publish_limits(&self, seen: &mut BTreeSet<String>, s: &Snapshot) {
        let m = &self.metrics;
        seen.extend(s.limits.iter().map(|l| l.limited.kind.clone()));
        for kind in seen.iter() {
            let now = s.limits.iter().find(|l| &l.limited.kind == kind);
            let limits = now.map(|l| &l.limited.limits);
            let values = [
                ("global", limits.and_then(|l| l.global).map(f64::from)),
                (
                    "per_key",
                    limits
                        .and_then(|l| l.per_key.as_ref())
                        .map(|p| f64::from(p.limit)),
                ),
                (
                    "rate_per_second",
                    limits
                        .and_then(|l| l.rate)
                        .map(|r| f64::from(r.count) / r.period.as_secs_f64()),
                ),
                (
                    "burst",
                    limits
                        .filter(|l| l.rate.is_some())
                        .map(|l| f64::from(l.burst)),
                ),
            ];
            for (limit, value) in values {
                let label = KindLimitLabel {
                    kind: kind.clone(),
                    limit: limit.to_string(),
                };
                match value {
                    Some(v) => {
                        m.kind_limit.get_or_create(&label).set(v);
                    }
                    None => {
                        m.kind_limit.remove(&label);
                    }
                }
            }
            let label = KindLabel { kind: kind.clone() };
            match now {
                Some(l) => {
                    m.kind_limit_running
                        .get_or_create(&label)
                        .set(l.running as f64);
                }
                None => {
                    m.kind_limit_running.remove(&label);
                }
            }
        }
        seen.retain(|kind| s.limits.iter().any(|l| &l.limited.kind == kind));
    }

    /// Sets one schedule's alerting gauges from its figures (`reported`:
    /// read this time, rather than gone and zeroed).
    fn publish_runs(&self, name: &str, f: &RunFigures, reported: bool) {
        let m = &self.metrics;
        let label = ScheduleLabel {
            schedule: name.to_string(),
        };
        m.schedule_overdue
            .get_or_create(&label)
            .set(f.overdue as f64);
        m.schedule_missing
            .get_or_create(&label)
            .set(f.missing as f64);
        // A timestamp, not a count: a schedule no longer reported keeps its last one.
        if reported {
            m.schedule_last_success.get_or_create(&label).set(
                f.last_success
                    .map_or(0.0, |t| t.timestamp_millis() as f64 / 1000.0),
            );
        }
        m.schedule_success_late
            .get_or_create(&label)
            .set(f.success_late_seconds);
        for reason in SKIP_REASONS {
            m.schedule_skipped
                .get_or_create(&ScheduleReasonLabel {
                    schedule: name.to_string(),
                    reason: reason.to_string(),
                })
                .set(f.skipped.get(reason).copied().unwrap_or(0) as f64);
        }
    }
}

impl Periodic for Collector {
    const NAME: RoleName = RoleName::Metrics;
    type Report = Snapshot;
    type Error = QueueError;

    fn period(&self) -> Period {
        Period::new(self.config.interval).expect("checked by CollectorConfig")
    }

    /// One refresh: read the database, set the gauges.
    async fn run_once(&self, _shutdown: &CancellationToken) -> Result<Snapshot, QueueError> {
        let mut conn = self.pool.acquire().await?;
        // Fold the counters' rows, so the read is of tens of rows
        // ([`crate::queue::counts`]); a fold that fails leaves them to the
        // next one.
        if let Err(err) = crate::queue::counts::fold(&mut conn, false).await {
            tracing::warn!(%err, "folding the counters failed; the next refresh tries again");
        }
        let snapshot = Snapshot::read(&mut conn).await?;
        self.publish(&snapshot);
        Ok(snapshot)
    }

    fn log(&self, _: &Snapshot) {}
}

/// A 0/1 gauge per (kind, sink) ever `seen`: 1 for those reported `now`,
/// 0 for the others (so a cleared condition reads 0, not a stale 1).
fn flag_routes(
    gauges: &crate::metrics::Gauges<KindSinkLabel>,
    seen: &mut BTreeSet<(String, String)>,
    now: impl Iterator<Item = (String, String)>,
) {
    let now: BTreeSet<(String, String)> = now.collect();
    seen.extend(now.iter().cloned());
    for (kind, sink) in seen.iter() {
        let on = now.contains(&(kind.clone(), sink.clone()));
        gauges
            .get_or_create(&KindSinkLabel {
                kind: kind.clone(),
                sink: sink.clone(),
            })
            .set(if on { 1.0 } else { 0.0 });
    }
}
