//! One read of the figures that come from the database: the queue, the
//! outbox and who leads the scheduler. The collector turns it into gauges;
//! `almanac stats` prints it for a person. Every query is bounded by what is
//! unfinished (partial indexes), never by the history of done jobs.

use serde::Serialize;
use sqlx::PgConnection;

use crate::queue::{self, QueueError, Stats};
use crate::relay::backlog::{self, SinkBacklog};
use crate::scheduler::leader::LEADER_LOCK_KEY;

#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub jobs: Stats,
    pub outbox: Vec<SinkBacklog>,
    /// The session holding the scheduler's leader lock, if any.
    pub leader: Option<Leader>,
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
        let outbox = backlog::backlog(&mut *conn).await?;
        let leader = leader(&mut *conn).await?;
        Ok(Snapshot {
            jobs,
            outbox,
            leader,
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
