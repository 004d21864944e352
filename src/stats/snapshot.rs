//! One read of the figures that come from the database: the queue, the
//! outbox and who leads the scheduler. The collector turns it into gauges;
//! `almanac stats` prints it for a person. Every query is bounded by what is
//! unfinished (partial indexes), never by the history of done jobs.

use chrono::{DateTime, NaiveDate, Utc};
use serde::Serialize;
use sqlx::PgConnection;

use crate::queue::{self, QueueError, Stats};
use crate::relay::outbox::{self, SinkOutboxStats};
use crate::scheduler::cron::CronExpr;
use crate::scheduler::leader::LEADER_LOCK_KEY;
use crate::scheduler::plan::Cursor;
use crate::scheduler::spec::next_admitted;
use crate::scheduler::timeline::Timeline;

#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub jobs: Stats,
    pub outbox: Vec<SinkOutboxStats>,
    /// The session holding the scheduler's leader lock, if any.
    pub leader: Option<Leader>,
    /// Each enabled schedule's latest ledger row and how far planning lags.
    pub schedules: Vec<ScheduleState>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ScheduleState {
    pub name: String,
    /// Fire time of the latest run in the ledger (any source).
    pub last_run: Option<DateTime<Utc>>,
    /// Now minus the fire time of the oldest due run the scheduler has not
    /// planned yet (the first run after its cursor); 0 when none is due.
    pub lag_seconds: f64,
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
        Ok(Snapshot {
            jobs,
            outbox,
            leader,
            schedules,
        })
    }
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
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(name, cron, tz, start, first_seen, last_run, cursor, now)| {
                let lag_seconds = lag(&cron, &tz, start, first_seen, cursor, now).unwrap_or(0.0);
                ScheduleState {
                    name,
                    last_run,
                    lag_seconds,
                }
            },
        )
        .collect())
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
