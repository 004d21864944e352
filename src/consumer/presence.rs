//! Who consumes what (migration 0131): the rows that let `stats`, the
//! dashboard, `route set` and `consume` say at once when a routed kind has
//! no handler among its destination's running consumers.
//!
//! - **Written by each running consumer**, every [`BEAT_EVERY`], one
//!   statement: its sink, destination, the kinds it has handlers for, and
//!   per kind it has none for, how many of its messages it gave back unrun
//!   since it started and when it last did. A clean stop deletes the row; a
//!   row nobody wrote for [`FORGET_AFTER`] is deleted by the next write of
//!   any consumer.
//! - **Running** means written within [`LIVE_FOR`]: a consumer killed,
//!   stopped or cut off from the database stops counting within that. It
//!   means the process runs and reaches the database, not that its broker
//!   session is up: a consumer retrying a broker it cannot reach, or a Kafka
//!   consumer stepped out of its group, still counts (its own log says why
//!   it consumes nothing).
//! - **Its own connection.** The writes go through one connection of their
//!   own whose statements end on the server after [`BEAT_EVERY`] (as the
//!   claims' do), so a lock on the table can delay the rows but never takes
//!   a connection the consumer's jobs need.
//! - **A gap** ([`gaps`]) is a kind routed to a destination (`dual` or
//!   `broker`) whose running consumers include none with a handler for it
//!   (in `dual` mode only when some consumer runs there at all: with none,
//!   the workers run its jobs), or whose messages a consumer of the
//!   destination gave back unrun within [`UNHANDLED_RECENT`]. The counts
//!   are of deliveries (a message given back comes again), since each
//!   consumer started. Values in a row that are not numbers are ignored.
//! - **Limits.** Only almanac's own consumers (`almanac consume`, the Rust
//!   [`super::Consumer`]) write rows; a destination read by other programs
//!   looks unconsumed. The table is unlogged: on a standby it cannot be
//!   read, and the readers report no gap there.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use uuid::Uuid;

use crate::broker::SinkKind;

/// How often a running consumer writes its row.
pub const BEAT_EVERY: Duration = Duration::from_secs(2);
/// A consumer whose row was written within this is running.
pub const LIVE_FOR: Duration = Duration::from_secs(15);
/// Messages given back unrun within this show as a gap.
pub const UNHANDLED_RECENT: Duration = Duration::from_secs(300);
/// A row not written for this long is deleted.
pub const FORGET_AFTER: Duration = Duration::from_secs(3600);

/// One running consumer's row, and what it met since it started.
pub(super) struct Presence {
    /// One connection, its statements bounded on the server.
    pool: PgPool,
    id: Uuid,
    sink: SinkKind,
    destination: String,
    kinds: Vec<String>,
    /// Kind → (messages given back unrun, when the last one was).
    unhandled: Mutex<HashMap<String, (i64, Instant)>>,
}

impl Presence {
    pub(super) fn new(
        pool: &PgPool,
        sink: SinkKind,
        destination: &str,
        mut kinds: Vec<String>,
    ) -> Presence {
        kinds.sort();
        Presence {
            pool: crate::db::bounded_pool(pool, BEAT_EVERY, BEAT_EVERY, 1),
            id: Uuid::new_v4(),
            sink,
            destination: destination.to_string(),
            kinds,
            unhandled: Mutex::default(),
        }
    }

    /// A message of `kind`, which this consumer has no handler for, was given back.
    pub(super) fn gave_back(&self, kind: &str) {
        let mut unhandled = self.unhandled.lock().expect("not poisoned");
        let entry = unhandled
            .entry(kind.to_string())
            .or_insert((0, Instant::now()));
        entry.0 += 1;
        entry.1 = Instant::now();
    }

    /// Writes the row (and deletes forgotten ones nobody else is deleting),
    /// one statement.
    pub(super) async fn beat(&self) -> Result<(), sqlx::Error> {
        let (kinds, messages, ago): (Vec<String>, Vec<i64>, Vec<f64>) = {
            let unhandled = self.unhandled.lock().expect("not poisoned");
            let now = Instant::now();
            let mut k = Vec::new();
            let mut m = Vec::new();
            let mut a = Vec::new();
            for (kind, (n, at)) in unhandled.iter() {
                k.push(kind.clone());
                m.push(*n);
                a.push(now.duration_since(*at).as_secs_f64());
            }
            (k, m, a)
        };
        sqlx::query(
            "WITH forgotten AS (
                 DELETE FROM almanac.consumers WHERE id IN (
                     SELECT f.id FROM almanac.consumers f
                     WHERE f.seen_at < now() - make_interval(secs => $10)
                     FOR UPDATE SKIP LOCKED))
             INSERT INTO almanac.consumers AS c (id, sink, destination, kinds, host, pid, unhandled)
             VALUES ($1, $2, $3, $4, $5, $6,
                     (SELECT coalesce(jsonb_object_agg(u.kind, jsonb_build_object(
                                 'messages', u.n,
                                 'last_at', extract(epoch FROM now()) - u.ago)), '{}')
                      FROM unnest($7::text[], $8::bigint[], $9::float8[]) AS u(kind, n, ago)))
             ON CONFLICT (id) DO UPDATE
             SET seen_at = now(), kinds = excluded.kinds, unhandled = excluded.unhandled",
        )
        .bind(self.id)
        .bind(self.sink.as_str())
        .bind(&self.destination)
        .bind(&self.kinds)
        .bind(host())
        .bind(std::process::id() as i32)
        .bind(&kinds)
        .bind(&messages)
        .bind(&ago)
        .bind(FORGET_AFTER.as_secs_f64())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Writes the row every [`BEAT_EVERY`] until `shutdown`, then deletes
    /// it. A failed write is logged once until one succeeds again.
    pub(super) async fn keep(&self, shutdown: &CancellationToken) {
        let mut failing = false;
        loop {
            match tokio::time::timeout(BEAT_EVERY, self.beat()).await {
                Ok(Ok(())) => {
                    if failing {
                        info!(destination = %self.destination, "consumer presence written again");
                    }
                    failing = false;
                }
                Ok(Err(e)) if !failing => {
                    warn!(destination = %self.destination, error = %e, "cannot write this consumer's presence (almanac.consumers); stats may say its kinds have no consumer");
                    failing = true;
                }
                Err(_) if !failing => {
                    warn!(destination = %self.destination, "writing this consumer's presence (almanac.consumers) timed out; stats may say its kinds have no consumer");
                    failing = true;
                }
                _ => {}
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(BEAT_EVERY) => {}
            }
        }
        let leave = sqlx::query("DELETE FROM almanac.consumers WHERE id = $1")
            .bind(self.id)
            .execute(&self.pool);
        let error = match tokio::time::timeout(BEAT_EVERY, leave).await {
            Ok(Ok(_)) => return,
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_string(),
        };
        warn!(%error, "cannot delete this consumer's presence row; it stops counting as running within 15 s");
    }
}

/// This host's name (as `hostname` prints it), or `unknown`.
fn host() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at
    // most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match (rc, std::str::from_utf8(&buf[..end])) {
        (0, Ok(name)) if !name.is_empty() => name.to_string(),
        _ => "unknown".to_string(),
    }
}

/// A routed kind its destination's running consumers do not run (see the
/// module doc).
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct Gap {
    pub kind: String,
    pub mode: String,
    pub sink: String,
    pub destination: String,
    /// Consumers of the destination running now.
    pub consumers: i64,
    /// Of them, those with a handler for the kind.
    pub handling: i64,
    /// Every kind the running consumers have handlers for.
    pub handled: Vec<String>,
    /// Messages of the kind that consumers of the destination gave back
    /// unrun (counted since each started, of those that gave one back
    /// within [`UNHANDLED_RECENT`]).
    pub unhandled_messages: i64,
    /// Seconds since the last such message, if any came within
    /// [`UNHANDLED_RECENT`].
    pub unhandled_last_seconds: Option<f64>,
}

impl Gap {
    /// One line for a person: what is wrong and what to do.
    pub fn describe(&self) -> String {
        let running = |n: i64| {
            if n == 1 {
                "the 1 consumer running there".to_string()
            } else {
                format!("the {n} consumers running there")
            }
        };
        let mut line = format!(
            "kind {} is routed ({}) to {} `{}`, ",
            self.kind, self.mode, self.sink, self.destination
        );
        if self.consumers == 0 {
            line += "but no almanac consumer of it is running";
            if self.mode == "broker" {
                line += ": nothing runs its jobs";
            }
        } else if self.handling == 0 {
            line += &format!(
                "but none of {} has a handler for it (they handle {})",
                running(self.consumers),
                self.handled.join(", ")
            );
        } else {
            line += &format!(
                "and {} of {} handle it",
                self.handling,
                running(self.consumers)
            );
        }
        if let Some(ago) = self.unhandled_last_seconds {
            let n = self.unhandled_messages;
            line += &format!(
                "; consumers without one gave its messages back unrun ({n} deliver{} since they started), the last {ago:.0}s ago",
                if n == 1 { "y" } else { "ies" }
            );
        }
        if self.mode == "dual" {
            line += " (workers still run its jobs)";
        }
        if self.handling == 0 {
            line += &format!(
                ". Start `almanac consume --sink {} --destination {}` with a handler for {}, or route the kind elsewhere (almanac route set)",
                self.sink, self.destination, self.kind
            );
        } else {
            line += ". Every consumer of a destination should run every kind routed to it";
        }
        line
    }
}

/// Every [`Gap`], by kind; none on a standby.
pub async fn gaps(conn: &mut PgConnection) -> Result<Vec<Gap>, sqlx::Error> {
    let standby: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&mut *conn)
        .await?;
    if standby {
        return Ok(Vec::new());
    }
    sqlx::query_as(
        "SELECT g.* FROM (
             SELECT r.kind, r.mode, r.sink, r.destination,
                    (SELECT count(*) FROM almanac.consumers c
                      WHERE c.sink = r.sink AND c.destination = r.destination
                        AND c.seen_at > now() - make_interval(secs => $1)) AS consumers,
                    (SELECT count(*) FROM almanac.consumers c
                      WHERE c.sink = r.sink AND c.destination = r.destination
                        AND c.seen_at > now() - make_interval(secs => $1)
                        AND r.kind = ANY (c.kinds)) AS handling,
                    (SELECT coalesce(array_agg(DISTINCT k ORDER BY k), '{}')
                       FROM almanac.consumers c CROSS JOIN LATERAL unnest(c.kinds) AS k
                      WHERE c.sink = r.sink AND c.destination = r.destination
                        AND c.seen_at > now() - make_interval(secs => $1)) AS handled,
                    u.messages AS unhandled_messages, u.last_seconds AS unhandled_last_seconds
             FROM almanac.routes r
             CROSS JOIN LATERAL (
                 SELECT coalesce(sum(v.messages), 0)::bigint AS messages,
                        (extract(epoch FROM now()) - max(v.last_at))::float8 AS last_seconds
                 FROM almanac.consumers c
                 CROSS JOIN LATERAL (
                     SELECT CASE WHEN jsonb_typeof(c.unhandled -> r.kind -> 'messages') = 'number'
                                 THEN least(greatest(trunc((c.unhandled -> r.kind -> 'messages')::numeric), 0), 1e15)
                            END AS messages,
                            CASE WHEN jsonb_typeof(c.unhandled -> r.kind -> 'last_at') = 'number'
                                 THEN least(greatest((c.unhandled -> r.kind -> 'last_at')::numeric, 0), 1e12)::float8
                            END AS last_at) AS v
                 WHERE c.sink = r.sink AND c.destination = r.destination
                   AND v.last_at > extract(epoch FROM now()) - $2) AS u
             WHERE r.mode IN ('dual', 'broker') AND r.sink IS NOT NULL AND r.destination IS NOT NULL
         ) AS g
         WHERE (g.handling = 0 AND (g.mode = 'broker' OR g.consumers > 0))
            OR g.unhandled_messages > 0
         ORDER BY g.kind",
    )
    .bind(LIVE_FOR.as_secs_f64())
    .bind(UNHANDLED_RECENT.as_secs_f64())
    .fetch_all(conn)
    .await
}

/// The kinds that running consumers of `sink`'s `destination` have
/// handlers for (on a primary: a standby cannot read the table).
pub async fn handled_at(
    conn: &mut PgConnection,
    sink: SinkKind,
    destination: &str,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT DISTINCT k FROM almanac.consumers c CROSS JOIN LATERAL unnest(c.kinds) AS k
         WHERE c.sink = $1 AND c.destination = $2
           AND c.seen_at > now() - make_interval(secs => $3)
         ORDER BY k",
    )
    .bind(sink.as_str())
    .bind(destination)
    .bind(LIVE_FOR.as_secs_f64())
    .fetch_all(conn)
    .await
}
