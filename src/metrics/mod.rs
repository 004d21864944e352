//! Prometheus metrics: a [`Metrics`] handle (one registry and its families,
//! cheap to clone) that the process creates and hands to each role it runs
//! and to [`crate::http`], which renders it at `/metrics` with
//! `prometheus-client` (never hand-formatted). A leaf: it knows no role, no
//! table and no other module of almanac; roles call its `record_*` methods.
//! A role given no handle counts into one of its own, which nobody renders
//! (a test hands its own and reads exact values).
//!
//! Two kinds of figures, and where each comes from:
//!
//! - **Process counters and histograms** (`almanac_jobs_completed_total`,
//!   `almanac_job_duration_seconds`, relay and reaper counters, leadership):
//!   incremented by the role that did the work, through the `record_*`
//!   functions below, one per outcome. They count what *this* process did, so
//!   sum them across processes.
//! - **Database figures** (`almanac_jobs`, oldest due ready age, expired leases,
//!   outbox backlog, schedule lag, overdue and missing runs): set by the [`crate::stats::Collector`] role from a few
//!   cheap queries on the partial indexes, at most every few seconds, never
//!   one query per scrape. A label that disappears from the database (a kind
//!   with no ready jobs left) is set to 0, not left at its last value.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLimitLabel {
    pub kind: String,
    /// `global`, `per_key`, `rate_per_second` or `burst`.
    pub limit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindStatusLabel {
    pub kind: String,
    pub status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindSinkLabel {
    pub kind: String,
    pub sink: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindDestinationLabel {
    pub kind: String,
    pub destination: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SinkLabel {
    pub sink: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScheduleLabel {
    pub schedule: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScheduleReasonLabel {
    pub schedule: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScheduleOutcomeLabel {
    pub schedule: String,
    pub outcome: String,
}

/// A family of gauges with labels `L` (values set from the database).
pub type Gauges<L> = Family<L, Gauge<f64, std::sync::atomic::AtomicU64>>;
type Histograms = Family<KindLabel, Histogram, fn() -> Histogram>;

/// Every metric family almanac exports; clones share the registry and the
/// values.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    // From the database (the collector).
    pub jobs: Gauges<KindStatusLabel>,
    pub oldest_ready_age: Gauges<KindLabel>,
    pub expired_leases: Gauge,
    pub outbox_backlog: Gauges<SinkLabel>,
    pub outbox_oldest_age: Gauges<SinkLabel>,
    pub outbox_failed: Gauges<SinkLabel>,
    pub schedule_lag: Gauges<ScheduleLabel>,
    pub schedule_last_run: Gauges<ScheduleLabel>,
    pub schedule_overdue: Gauges<ScheduleLabel>,
    pub schedule_missing: Gauges<ScheduleLabel>,
    pub schedule_last_success: Gauges<ScheduleLabel>,
    pub schedule_success_late: Gauges<ScheduleLabel>,
    pub schedule_skipped: Gauges<ScheduleReasonLabel>,
    // From the process.
    pub completed: Family<KindLabel, Counter>,
    pub retried: Family<KindLabel, Counter>,
    pub dead: Family<KindLabel, Counter>,
    pub lease_lost: Family<KindLabel, Counter>,
    pub cancelled: Family<KindLabel, Counter>,
    pub snoozed: Family<KindLabel, Counter>,
    pub duration: Histograms,
    pub wait: Histograms,
    pub reaper_recovered: Counter,
    pub janitor_deleted: Family<KindLabel, Counter>,
    pub relay_published: Family<SinkLabel, Counter>,
    pub relay_failed: Family<SinkLabel, Counter>,
    pub scheduler_leader: Gauge,
    /// 1 when the collector's last refresh read whole counters; from the database.
    pub counts_whole: Gauge,
    pub scheduler_last_tick: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub schedule_runs: Family<ScheduleOutcomeLabel, Counter>,
    pub consumer_other_kind: Family<KindDestinationLabel, Counter>,
    pub route_unserved: Gauges<KindSinkLabel>,
    /// 1 while a routed kind's destination's running consumers do not run it.
    pub route_unconsumed: Gauges<KindSinkLabel>,
    /// 1 while a kind (or `*`) is paused; from the database.
    pub kind_paused: Gauges<KindLabel>,
    /// A limited kind's limits, one series per limit it has; from the database.
    pub kind_limit: Gauges<KindLimitLabel>,
    /// A limited kind's running jobs as its limits count them; from the database.
    pub kind_limit_running: Gauges<KindLabel>,
    pub relay_notifications: Family<SinkLabel, Counter>,
    pub relay_blocked: Family<SinkLabel, Gauge>,
    pub held_by_limit: Family<KindLabel, Counter>,
}

fn seconds_histogram() -> Histogram {
    // 1 ms to ~33 min, doubling: handler durations and queue waits alike.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 22,
    ))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every family at zero.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("almanac");
        let jobs = Gauges::<KindStatusLabel>::default();
        registry.register(
            "jobs",
            "Jobs by kind and status (ready, running, dead), from the database",
            jobs.clone(),
        );
        let oldest_ready_age = Gauges::<KindLabel>::default();
        registry.register(
            "oldest_ready_age_seconds",
            "Age of the oldest due ready job per kind (0 when none), from the database",
            oldest_ready_age.clone(),
        );
        let expired_leases = Gauge::default();
        registry.register(
            "expired_leases",
            "Running jobs whose lease has expired and that no reaper has taken back yet",
            expired_leases.clone(),
        );
        let outbox_backlog = Gauges::<SinkLabel>::default();
        registry.register(
            "outbox_backlog",
            "Unpublished outbox rows per sink, from the database",
            outbox_backlog.clone(),
        );
        let outbox_oldest_age = Gauges::<SinkLabel>::default();
        registry.register(
            "outbox_oldest_unpublished_age_seconds",
            "Age of the oldest unpublished outbox row per sink (0 when none)",
            outbox_oldest_age.clone(),
        );
        let outbox_failed = Gauges::<SinkLabel>::default();
        registry.register(
            "outbox_failed",
            "Outbox rows per sink that the relay gave up on, from the database",
            outbox_failed.clone(),
        );
        let schedule_lag = Gauges::<ScheduleLabel>::default();
        registry.register(
            "schedule_lag_seconds",
            "Now minus the fire time of the latest due run with no ledger row (0 when none)",
            schedule_lag.clone(),
        );
        let schedule_last_run = Gauges::<ScheduleLabel>::default();
        registry.register(
            "schedule_last_run_timestamp_seconds",
            "Fire time (Unix seconds) of the latest run in the ledger per schedule",
            schedule_last_run.clone(),
        );
        let schedule_overdue = Gauges::<ScheduleLabel>::default();
        registry.register(
            "schedule_overdue_runs",
            "Emitted runs in the calendar window whose deadline has passed and whose job is not done (a dead job counts)",
            schedule_overdue.clone(),
        );
        let schedule_missing = Gauges::<ScheduleLabel>::default();
        registry.register(
            "schedule_missing_runs",
            "Runs in the calendar window missing from the ledger: what `almanac gaps` reports over it",
            schedule_missing.clone(),
        );
        let schedule_last_success = Gauges::<ScheduleLabel>::default();
        registry.register(
            "schedule_last_success_timestamp_seconds",
            "Fire time (Unix seconds) of the latest run in the calendar window whose job is done; 0 when none",
            schedule_last_success.clone(),
        );
        let schedule_success_late = Gauges::<ScheduleLabel>::default();
        registry.register(
            "schedule_success_late_seconds",
            "Seconds since the deadline of the latest run expected to have succeeded, while no run since has; 0 otherwise or without a deadline",
            schedule_success_late.clone(),
        );
        let schedule_skipped = Gauges::<ScheduleReasonLabel>::default();
        registry.register(
            "schedule_skipped_runs",
            "Runs in the calendar window recorded skipped, by reason (catchup, overlap, disabled, paused)",
            schedule_skipped.clone(),
        );
        let completed = Family::<KindLabel, Counter>::default();
        registry.register(
            "jobs_completed",
            "Jobs this process completed",
            completed.clone(),
        );
        let retried = Family::<KindLabel, Counter>::default();
        registry.register(
            "jobs_retried",
            "Failed attempts this process scheduled for retry",
            retried.clone(),
        );
        let dead = Family::<KindLabel, Counter>::default();
        registry.register(
            "jobs_dead",
            "Jobs this process buried (permanent failure or attempts used up)",
            dead.clone(),
        );
        let lease_lost = Family::<KindLabel, Counter>::default();
        registry.register(
            "lease_lost",
            "Executions whose lease was lost before their outcome was recorded",
            lease_lost.clone(),
        );
        let cancelled = Family::<KindLabel, Counter>::default();
        registry.register(
            "jobs_cancelled",
            "Running jobs this process stopped on an operator's cancel request (recorded cancelled)",
            cancelled.clone(),
        );
        let snoozed = Family::<KindLabel, Counter>::default();
        registry.register(
            "jobs_snoozed",
            "Executions whose handler put the job back for later without using an attempt",
            snoozed.clone(),
        );
        let duration: Histograms = Family::new_with_constructor(seconds_histogram);
        registry.register(
            "job_duration_seconds",
            "Handler run time per kind",
            duration.clone(),
        );
        let wait: Histograms = Family::new_with_constructor(seconds_histogram);
        registry.register(
            "job_wait_seconds",
            "Time from a job being due (run_at) to its handler starting",
            wait.clone(),
        );
        let reaper_recovered = Counter::default();
        registry.register(
            "reaper_recovered",
            "Expired leases this process's reaper returned to ready or buried",
            reaper_recovered.clone(),
        );
        let janitor_deleted = Family::<KindLabel, Counter>::default();
        registry.register(
            "janitor_deleted",
            "Rows this process's janitor deleted, by what they were (done, dead, outbox)",
            janitor_deleted.clone(),
        );
        let relay_published = Family::<SinkLabel, Counter>::default();
        registry.register(
            "relay_published",
            "Outbox rows this process published and marked",
            relay_published.clone(),
        );
        let relay_failed = Family::<SinkLabel, Counter>::default();
        registry.register(
            "relay_failed",
            "Outbox publish attempts that failed in this process",
            relay_failed.clone(),
        );
        let scheduler_leader = Gauge::default();
        registry.register(
            "scheduler_leader",
            "1 while this process leads the scheduler, else 0",
            scheduler_leader.clone(),
        );
        let counts_whole = Gauge::default();
        registry.register(
            "counts_whole",
            "1 when the last refresh read the job counts from the counters (migration 0128); 0 when they were not whole (lost in a crash or failover, broken, on a standby) and the rows were counted",
            counts_whole.clone(),
        );
        let scheduler_last_tick = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "scheduler_last_tick_timestamp_seconds",
            "Database time (Unix seconds) of this process's latest completed scheduler tick while leading; 0 before its first",
            scheduler_last_tick.clone(),
        );
        let schedule_runs = Family::<ScheduleOutcomeLabel, Counter>::default();
        registry.register(
            "schedule_runs",
            "Logical runs this process recorded in the ledger, by outcome",
            schedule_runs.clone(),
        );
        let consumer_other_kind = Family::<KindDestinationLabel, Counter>::default();
        registry.register(
            "consumer_unhandled_kind",
            "Messages this process's consumers could not run (no handler for the job's kind) and gave back unacknowledged",
            consumer_other_kind.clone(),
        );
        let route_unserved = Gauges::<KindSinkLabel>::default();
        registry.register(
            "route_unserved",
            "1 while a kind is routed (dual or broker) to a sink no relay serves (its outbox rows wait), else 0; from the database",
            route_unserved.clone(),
        );
        let route_unconsumed = Gauges::<KindSinkLabel>::default();
        registry.register(
            "route_unconsumed",
            "1 while a kind is routed (dual or broker) to a destination where no running consumer has a handler for it, or whose consumers gave its messages back unrun in the last 5 minutes, else 0; from the database",
            route_unconsumed.clone(),
        );
        let kind_paused = Gauges::<KindLabel>::default();
        registry.register(
            "kind_paused",
            "1 while a kind is paused (almanac kinds pause; kind=\"*\" pauses every kind), else 0; from the database",
            kind_paused.clone(),
        );
        let kind_limit = Gauges::<KindLimitLabel>::default();
        registry.register(
            "kind_limit",
            "A kind's limit (almanac limits set), by limit: global and per_key (jobs running at once), rate_per_second, burst; a limit the kind does not have has no series; from the database",
            kind_limit.clone(),
        );
        let kind_limit_running = Gauges::<KindLabel>::default();
        registry.register(
            "kind_limit_running",
            "Running jobs (unexpired leases, as limits count them) of a kind that has limits; no series once its limits are cleared; from the database",
            kind_limit_running.clone(),
        );
        let relay_notifications = Family::<SinkLabel, Counter>::default();
        registry.register(
            "relay_notifications",
            "Outbox notifications this process's relays read (they are read even while a sink fails)",
            relay_notifications.clone(),
        );
        let relay_blocked = Family::<SinkLabel, Gauge>::default();
        registry.register(
            "relay_broker_blocked",
            "1 while the broker blocks this process's relay from publishing (RabbitMQ connection.blocked: a memory or disk alarm), else 0",
            relay_blocked.clone(),
        );
        let held_by_limit = Family::<KindLabel, Counter>::default();
        registry.register(
            "consumer_held_by_limit",
            "Times this process's consumers held a message back, unacknowledged and with no attempt used, because its kind was at one of its limits (almanac limits)",
            held_by_limit.clone(),
        );
        Metrics {
            registry: Arc::new(registry),
            jobs,
            oldest_ready_age,
            expired_leases,
            outbox_backlog,
            outbox_oldest_age,
            outbox_failed,
            schedule_lag,
            schedule_last_run,
            schedule_overdue,
            schedule_missing,
            schedule_last_success,
            schedule_success_late,
            schedule_skipped,
            completed,
            retried,
            dead,
            lease_lost,
            cancelled,
            snoozed,
            duration,
            wait,
            reaper_recovered,
            janitor_deleted,
            relay_published,
            relay_failed,
            scheduler_leader,
            counts_whole,
            scheduler_last_tick,
            schedule_runs,
            consumer_other_kind,
            route_unserved,
            route_unconsumed,
            kind_paused,
            kind_limit,
            kind_limit_running,
            relay_notifications,
            relay_blocked,
            held_by_limit,
        }
    }

    /// The Prometheus text exposition of every family.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

fn kind(kind: &str) -> KindLabel {
    KindLabel {
        kind: kind.to_string(),
    }
}

fn sink(sink: &str) -> SinkLabel {
    SinkLabel {
        sink: sink.to_string(),
    }
}

/// What became of one execution, as the metrics count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    Retried,
    Dead,
    LeaseLost,
    /// Stopped on an operator's cancel request.
    Cancelled,
    /// Put back for later by its handler.
    Snoozed,
}

impl Metrics {
    /// A handler started: how long the job waited since it was due.
    pub fn record_started(&self, job_kind: &str, waited: Duration) {
        self.wait
            .get_or_create(&kind(job_kind))
            .observe(waited.as_secs_f64());
    }

    /// A job's outcome was recorded (or given up), with the handler's run time.
    pub fn record_outcome(&self, job_kind: &str, outcome: Outcome, ran: Duration) {
        let m = self;
        let label = kind(job_kind);
        m.duration.get_or_create(&label).observe(ran.as_secs_f64());
        let family = match outcome {
            Outcome::Completed => &m.completed,
            Outcome::Retried => &m.retried,
            Outcome::Dead => &m.dead,
            Outcome::LeaseLost => &m.lease_lost,
            Outcome::Cancelled => &m.cancelled,
            Outcome::Snoozed => &m.snoozed,
        };
        family.get_or_create(&label).inc();
    }

    pub fn record_reaped(&self, rows: u64) {
        self.reaper_recovered.inc_by(rows);
    }

    pub fn record_janitor_deleted(&self, what: &str, rows: u64) {
        self.janitor_deleted.get_or_create(&kind(what)).inc_by(rows);
    }

    pub fn record_published(&self, sink_name: &str, rows: u64) {
        self.relay_published
            .get_or_create(&sink(sink_name))
            .inc_by(rows);
    }

    pub fn record_publish_failed(&self, sink_name: &str, rows: u64) {
        self.relay_failed
            .get_or_create(&sink(sink_name))
            .inc_by(rows);
    }

    pub fn record_leadership(&self, leading: bool) {
        self.scheduler_leader.set(i64::from(leading));
    }

    /// An outbox notification a relay of `sink_name` read.
    pub fn record_relay_notification(&self, sink_name: &str) {
        self.relay_notifications
            .get_or_create(&SinkLabel {
                sink: sink_name.to_string(),
            })
            .inc();
    }

    /// Whether the broker blocks the relay of `sink_name` from publishing.
    pub fn record_relay_blocked(&self, sink_name: &str, blocked: bool) {
        self.relay_blocked
            .get_or_create(&sink(sink_name))
            .set(i64::from(blocked));
    }

    /// A message of `kind` on `destination` that a consumer had no handler for.
    /// A consumer held a message back because its kind was at a limit.
    pub fn record_held_by_limit(&self, kind: &str) {
        self.held_by_limit
            .get_or_create(&KindLabel {
                kind: kind.to_string(),
            })
            .inc();
    }

    pub fn record_unhandled_kind(&self, kind: &str, destination: &str) {
        self.consumer_other_kind
            .get_or_create(&KindDestinationLabel {
                kind: kind.to_string(),
                destination: destination.to_string(),
            })
            .inc();
    }

    /// The leader completed a tick planned at database time `at`: the
    /// liveness an alert reads (a leader whose ticker stalls while its lock
    /// session and process live shows an ever older value).
    pub fn record_tick(&self, at: chrono::DateTime<chrono::Utc>) {
        self.scheduler_last_tick
            .set(at.timestamp_millis() as f64 / 1000.0);
    }

    /// Ledger rows written for `schedule` with `outcome` (emitted, skipped_catchup,
    /// skipped_overlap, skipped_disabled, skipped_paused).
    pub fn record_schedule_runs(&self, schedule: &str, outcome: &str, rows: u64) {
        self.schedule_runs
            .get_or_create(&ScheduleOutcomeLabel {
                schedule: schedule.to_string(),
                outcome: outcome.to_string(),
            })
            .inc_by(rows);
    }
}
