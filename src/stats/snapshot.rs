//! One read of the figures that come from the database: the queue, the
//! outbox and who leads the scheduler. The collector turns it into gauges;
//! `almanac stats` prints it for a person. Every query is bounded by what is
//! unfinished (partial indexes), never by the history of done jobs.
//!
//! **Per schedule**, what an alert needs is read from the schedule's run
//! calendar ([`history::calendar_at`], the dashboard's), so it is bounded by
//! the calendar's window and by nothing else: the last
//! [`history::CALENDAR_DAYS`] days of a daily schedule, the last
//! [`history::CALENDAR_RUNS`] runs of a sub-daily
//! one. That is one `(schedule, fire_at)` index range of the ledger, the
//! window's jobs by primary key, and the few probes of the missing rule, per
//! enabled schedule. From it, [`RunFigures`]:
//!
//! - **overdue**: emitted runs whose deadline has passed and whose job is not
//!   `done` (`ready`, `running` or `dead`); a retry that succeeds clears it.
//!   A run whose job the janitor deleted is not counted.
//! - **missing**: the calendar's missing cells, which are by construction
//!   what `almanac gaps` reports over the same window at the same instant
//!   (one rule, [`crate::scheduler::backfill::Expected::unrecorded`]).
//! - **last success**: the fire time of the latest run in the window whose
//!   job is `done`.
//! - **success late**: with a deadline, how long ago the deadline of the
//!   latest run that should have succeeded by now passed, while neither it
//!   nor any later run has succeeded: it also sees runs skipped for overlap or
//!   catch-up and missing runs, which are never overdue. Runs skipped while
//!   the schedule was paused or disabled are not expected to succeed.
//! - **skipped**: ledger rows per reason (`catchup`, `overlap`, `disabled`,
//!   `paused`).

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, NaiveDate, Utc};
use serde::Serialize;
use sqlx::PgConnection;

use crate::queue::limits::{self, KindLimits};
use crate::queue::{self, QueueError, Stats};
use crate::relay::outbox::{self, SinkOutboxStats};
use crate::scheduler::backfill::BackfillError;
use crate::scheduler::cron::CronExpr;
use crate::scheduler::history::{self, Cell, CellState};
use crate::scheduler::leader::LEADER_LOCK_KEY;
use crate::scheduler::ledger::LedgerError;
use crate::scheduler::plan::Cursor;
use crate::scheduler::spec::{next_admitted, Schedule};
use crate::scheduler::timeline::Timeline;

#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub jobs: Stats,
    pub outbox: Vec<SinkOutboxStats>,
    /// The session holding the scheduler's leader lock, if any.
    pub leader: Option<Leader>,
    /// Each enabled schedule's latest ledger row and how far planning lags.
    pub schedules: Vec<ScheduleState>,
    /// Kinds routed (dual or broker) to a sink no relay serves right now.
    pub unserved: Vec<Unserved>,
    /// Routed kinds their destination's running consumers do not run.
    pub unconsumed: Vec<crate::consumer::presence::Gap>,
    /// Paused kinds (`*`: every kind), from `almanac kinds pause`.
    pub paused: Vec<crate::control::pause::Pause>,
    /// Kinds with limits (`almanac limits set`) and how many of each run now.
    pub limits: Vec<LimitedKind>,
}

/// A kind's limits as set, and its running jobs as the limits count them
/// (unexpired leases; [`crate::queue::limits`]).
#[derive(Debug, Clone, Serialize)]
pub struct LimitedKind {
    #[serde(flatten)]
    pub limited: KindLimits,
    pub running: i64,
}

/// Every limited kind, by kind, with its running jobs.
pub async fn limited_kinds(conn: &mut PgConnection) -> Result<Vec<LimitedKind>, sqlx::Error> {
    let set = limits::list(&mut *conn).await?;
    let running: HashMap<String, i64> = limits::running(&mut *conn).await?.into_iter().collect();
    Ok(set
        .into_iter()
        .map(|limited| LimitedKind {
            running: running.get(&limited.kind).copied().unwrap_or(0),
            limited,
        })
        .collect())
}

/// A kind routed to a sink that no running relay serves: its jobs' outbox
/// rows wait, unpublished (in `broker` mode nothing runs them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Unserved {
    pub kind: String,
    pub mode: String,
    pub sink: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ScheduleState {
    pub name: String,
    /// Fire time of the latest run in the ledger (any source).
    pub last_run: Option<DateTime<Utc>>,
    /// Now minus the fire time of the oldest due run the scheduler has not
    /// planned yet (the first run after its cursor); 0 when none is due.
    pub lag_seconds: f64,
    /// `2h` or `06:00`; none when the schedule has no deadline.
    pub deadline: Option<String>,
    /// Over the calendar window (see the module doc).
    #[serde(flatten)]
    pub runs: RunFigures,
}

/// What a schedule's calendar window says for alerting (the module doc
/// defines each figure).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunFigures {
    pub overdue: u64,
    pub missing: u64,
    pub last_success: Option<DateTime<Utc>>,
    pub success_late_seconds: f64,
    /// Reason (`catchup`, `overlap`, `disabled`, `paused`) → runs.
    pub skipped: BTreeMap<String, u64>,
}

/// The reasons a run is recorded skipped for, as [`RunFigures::skipped`]
/// names them.
pub const SKIP_REASONS: [&str; 4] = ["catchup", "overlap", "disabled", "paused"];

impl RunFigures {
    /// The figures of `cells` (a calendar of `schedule`, oldest first) at
    /// the instant `now`.
    pub fn of(schedule: &Schedule, cells: &[Cell], now: DateTime<Utc>) -> RunFigures {
        let mut f = RunFigures::default();
        let passed = |cell: &Cell| {
            schedule
                .deadline_of(cell.run.fire_at)
                .filter(|due| *due <= now)
        };
        // The latest run whose deadline passed and that was expected to succeed.
        let mut expected: Option<(&Cell, DateTime<Utc>)> = None;
        for cell in cells {
            match &cell.state {
                CellState::Emitted { .. } | CellState::Failed { .. } => {
                    f.overdue += u64::from(passed(cell).is_some());
                }
                CellState::Done { .. } => f.last_success = Some(cell.run.fire_at),
                CellState::Missing => f.missing += 1,
                CellState::Skipped { reason } => {
                    *f.skipped.entry(reason.clone()).or_default() += 1;
                }
                _ => {}
            }
            let counts = match &cell.state {
                CellState::BeforeHistory | CellState::Disabled | CellState::Due => false,
                CellState::Skipped { reason } => reason != "paused" && reason != "disabled",
                _ => true,
            };
            if let Some(due) = passed(cell).filter(|_| counts) {
                expected = Some((cell, due));
            }
        }
        if let Some((cell, due)) = expected {
            let succeeded = cell.state == CellState::JobDeleted
                || f.last_success.is_some_and(|s| s >= cell.run.fire_at);
            if !succeeded {
                f.success_late_seconds = (now - due).num_milliseconds() as f64 / 1000.0;
            }
        }
        f
    }
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Leader {
    pub pid: i32,
    pub application_name: String,
    /// The leader's address as PostgreSQL sees it (None over a Unix socket).
    pub client_addr: Option<String>,
    /// Seconds since the leader's session started.
    pub session_seconds: f64,
}

impl Snapshot {
    pub async fn read(conn: &mut PgConnection) -> Result<Snapshot, QueueError> {
        let jobs = queue::stats(&mut *conn).await?;
        let outbox = outbox::stats(&mut *conn).await?;
        let leader = leader(&mut *conn).await?;
        let schedules = schedules(&mut *conn).await?;
        let unserved = unserved_routes(&mut *conn).await?;
        let unconsumed = crate::consumer::presence::gaps(&mut *conn).await?;
        let paused = crate::control::pause::list(&mut *conn).await?;
        let limits = limited_kinds(&mut *conn).await?;
        Ok(Snapshot {
            jobs,
            outbox,
            leader,
            schedules,
            unserved,
            unconsumed,
            paused,
            limits,
        })
    }
}

/// The routes (`dual` or `broker`) whose sink no relay serves: no session
/// of this database has the relay's LISTEN `application_name` for it
/// ([`crate::relay::relay_application_name`]). A relay that cannot hold its
/// LISTEN connection (it polls meanwhile) counts as absent too.
pub async fn unserved_routes(conn: &mut PgConnection) -> Result<Vec<Unserved>, sqlx::Error> {
    sqlx::query_as(
        r#"
        SELECT r.kind, r.mode, r.sink FROM almanac.routes r
        WHERE r.mode IN ('dual', 'broker')
          AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                          WHERE a.datname = current_database()
                            AND a.application_name = $1 || r.sink)
        ORDER BY r.kind
        "#,
    )
    .bind(crate::relay::RELAY_APPLICATION_PREFIX)
    .fetch_all(conn)
    .await
}

/// Who holds the advisory lock of [`LEADER_LOCK_KEY`] in this database. A
/// bigint advisory key shows in `pg_locks` as its high half in `classid`, its
/// low half in `objid`, with `objsubid = 1`.
pub async fn leader(conn: &mut PgConnection) -> Result<Option<Leader>, sqlx::Error> {
    sqlx::query_as::<_, Leader>(
        r#"
        SELECT a.pid, a.application_name, host(a.client_addr) AS client_addr,
               extract(epoch FROM now() - a.backend_start)::float8 AS session_seconds
          FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND l.classid = (($1::bigint >> 32) & 4294967295)::oid
           AND l.objid = ($1::bigint & 4294967295)::oid
         LIMIT 1
        "#,
    )
    .bind(LEADER_LOCK_KEY)
    .fetch_optional(conn)
    .await
}

type ScheduleRow = (
    String,
    String,
    String,
    Option<NaiveDate>,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
    DateTime<Utc>,
);

/// Enabled schedules as last synced, with their latest ledger row and their
/// cursor (the latest run a tick or catch-up planned), each one index probe.
pub async fn schedules(conn: &mut PgConnection) -> Result<Vec<ScheduleState>, sqlx::Error> {
    let rows: Vec<ScheduleRow> = sqlx::query_as(concat!(
        "SELECT s.name, s.cron, s.timezone, s.start, s.created_at, \
                    (SELECT r.fire_at FROM almanac.schedule_runs r WHERE r.schedule = s.name \
                      ORDER BY r.fire_at DESC LIMIT 1), ",
        crate::scheduler::ledger::cursor_sql!(),
        ", now() FROM almanac.schedules s WHERE s.enabled ORDER BY s.name"
    ))
    .fetch_all(&mut *conn)
    .await?;
    let mut synced: HashMap<String, Schedule> = history::synced(&mut *conn)
        .await
        .map_err(|e| database(e.into()))?
        .into_iter()
        .filter(|s| s.enabled)
        .filter_map(|s| Some((s.name.clone(), s.schedule().ok()?)))
        .collect();
    let mut out = Vec::with_capacity(rows.len());
    for (name, cron, tz, start, first_seen, last_run, cursor, now) in rows {
        let lag_seconds = lag(&cron, &tz, start, first_seen, cursor, now).unwrap_or(0.0);
        // A row edited by hand into something unparsable has no figures.
        let (deadline, runs) = match synced.remove(&name) {
            Some(schedule) => {
                let calendar = history::calendar_at(&mut *conn, &schedule, now)
                    .await
                    .map_err(database)?;
                (
                    schedule.deadline.as_ref().map(|d| d.to_string()),
                    RunFigures::of(&schedule, &calendar.cells, now),
                )
            }
            None => (None, RunFigures::default()),
        };
        out.push(ScheduleState {
            name,
            last_run,
            lag_seconds,
            deadline,
            runs,
        });
    }
    Ok(out)
}

/// A calendar's error as the database error it is (a calendar reads and
/// never refuses a range).
fn database(err: BackfillError) -> sqlx::Error {
    match err {
        BackfillError::Ledger(LedgerError::Db(e))
        | BackfillError::Ledger(LedgerError::Queue(QueueError::Db(e))) => e,
        other => sqlx::Error::Protocol(other.to_string()),
    }
}

fn lag(
    cron: &str,
    tz: &str,
    start: Option<NaiveDate>,
    first_seen: DateTime<Utc>,
    cursor: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> Option<f64> {
    let timeline = Timeline::new(CronExpr::parse(cron).ok()?, tz.parse().ok()?);
    // The scheduler's own next run: what `plan::next_run` plans from its cursor.
    let cursor = Cursor {
        last_planned: cursor,
        first_seen,
    };
    let pending = next_admitted(
        &timeline,
        start,
        cursor.from() - chrono::Duration::microseconds(1),
    )?;
    (pending.fire_at <= now).then(|| (now - pending.fire_at).num_milliseconds() as f64 / 1000.0)
}
