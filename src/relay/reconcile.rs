//! The relays' reconcile sweep: jobs whose route disagrees with
//! `almanac.routes`, and pending outbox rows addressed where their kind no
//! longer goes, are put right (see `routes.rs` for how they arise).
//!
//! **A kind is looked at until it has settled, not forever.** Looking means
//! reading every ready job of the kind and every pending outbox row (1.9 s
//! at 10,000,000 jobs, docs/speed.md), so a sweep looks only at kinds whose
//! route may still have strays:
//!
//! - A kind is *unsettled* when this relay first sees its route, and again
//!   whenever the `routes` row changes (its `xmin` and `updated_at`: every
//!   `route set` writes both). The sweep that notices records the
//!   transactions then open in this database: their virtual transaction ids
//!   (`pg_locks`, readable by any role) and the prepared transactions
//!   (`pg_prepared_xacts`, which keep no virtual id once prepared).
//! - Strays come from transactions that cannot see the route: an enqueue or
//!   a job made ready again under a snapshot older than the change (a
//!   REPEATABLE READ transaction), and `route set`'s own walk cut short or
//!   skipping rows other transactions held. Every snapshot older than the
//!   change belongs to a transaction open when the change committed, so
//!   once none of the recorded transactions is open, no stray can be
//!   written any more; autovacuum workers and other databases' sessions
//!   are left out (they cannot write these tables). Not covered: a
//!   transaction that imports, with `SET TRANSACTION SNAPSHOT`, a snapshot
//!   exported before the change, and writers that do not take the route
//!   through `almanac.route_of` (almanac before migration 0107, a
//!   hand-written `UPDATE ... SET status = 'ready'`): their strays wait for
//!   the hourly look.
//! - A kind settles at the first sweep that starts after that and finds it
//!   clean: no ready job off its route, no pending row addressed elsewhere
//!   whatever its job's state (the rows of running, dead and cancelled
//!   jobs are left alone, and become a ready job's stray when the job is
//!   made ready again; done jobs' rows are left out, since nothing makes a
//!   done job ready again), and nothing held. Until then every sweep looks
//!   at it, as before; a kind still unsettled ten minutes on is logged
//!   once, with how many of the recorded transactions are still open.
//! - A settled kind is looked at again every [`RECHECK`] (an hour), and on
//!   every relay start: the safety net for a stray from a path nobody
//!   foresaw, bounded to one full look an hour. A stray found at a recheck
//!   is repaired and logged as a warning.
//!
//! So a quiet cluster's sweep reads the `routes` table and `pg_locks`, and
//! a route change costs full looks only until the transactions that could
//! miss it have ended.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgConnection;
use tokio::time::Instant;

use super::outbox;
use super::routes::{walk, Persist, Reconciled};
use crate::queue::routing;

/// How often a settled kind is looked at again.
pub const RECHECK: Duration = Duration::from_secs(3600);
/// How long a kind may stay unsettled before it is logged.
const SLOW_TO_SETTLE: Duration = Duration::from_secs(600);

/// What this relay knows of one kind's route.
#[derive(Debug, Clone)]
enum Known {
    /// The route changed (or was first seen) at `version`, noticed at
    /// `since`; strays may still be written by the transactions open then.
    Unsettled {
        version: String,
        open: Arc<HashSet<String>>,
        since: Instant,
        logged: bool,
    },
    /// Found clean after every transaction that could miss `version` ended.
    Settled { version: String, at: Instant },
}

fn unsettled(version: String, open: &Arc<HashSet<String>>, now: Instant) -> Known {
    Known::Unsettled {
        version,
        open: open.clone(),
        since: now,
        logged: false,
    }
}

/// The reconcile sweep's memory of which kinds have settled (see the
/// module doc). One per relay.
#[derive(Debug)]
pub struct Reconciler {
    known: HashMap<String, Known>,
    recheck: Duration,
    looked_at: usize,
}

impl Default for Reconciler {
    fn default() -> Self {
        Reconciler::new(RECHECK)
    }
}

impl Reconciler {
    /// A reconciler that looks again at a settled kind every `recheck`.
    pub fn new(recheck: Duration) -> Self {
        Reconciler {
            known: HashMap::new(),
            recheck,
            looked_at: 0,
        }
    }

    /// How many kinds the last sweep looked at.
    pub fn looked_at(&self) -> usize {
        self.looked_at
    }

    /// Kinds settled now, sorted.
    pub fn settled(&self) -> Vec<String> {
        let mut kinds: Vec<String> = self
            .known
            .iter()
            .filter(|(_, k)| matches!(k, Known::Settled { .. }))
            .map(|(kind, _)| kind.clone())
            .collect();
        kinds.sort_unstable();
        kinds
    }

    /// One sweep: moves ready jobs whose route disagrees with
    /// `almanac.routes` onto it and points their pending outbox rows at
    /// their kind's current sink and destination, for the kinds not settled
    /// (a walk of each such kind, window by window; a window whose locks are
    /// not free within a second ends the kind's walk until the next sweep).
    pub async fn sweep(&mut self, conn: &mut PgConnection) -> Result<Reconciled, sqlx::Error> {
        let routes: Vec<(String, String)> = sqlx::query_as(
            "SELECT kind, xmin::text || ' ' || updated_at::text FROM almanac.routes",
        )
        .fetch_all(&mut *conn)
        .await?;
        let open: Arc<HashSet<String>> = Arc::new(
            sqlx::query_scalar::<_, String>(OPEN_SQL)
                .fetch_all(&mut *conn)
                .await?
                .into_iter()
                .collect(),
        );
        let now = Instant::now();
        let routed: HashSet<&str> = routes.iter().map(|(k, _)| k.as_str()).collect();
        self.known.retain(|kind, _| routed.contains(kind.as_str()));
        // Kinds to look at, and whether a clean look settles each.
        let mut look: Vec<(String, bool)> = Vec::new();
        for (kind, version) in routes {
            match self.known.get_mut(&kind) {
                Some(Known::Settled { version: v, at })
                    if *v == version && now.duration_since(*at) < self.recheck => {}
                Some(Known::Settled { version: v, .. }) if *v == version => {
                    look.push((kind, true));
                }
                Some(Known::Unsettled {
                    version: v,
                    open: was,
                    since,
                    logged,
                }) if *v == version => {
                    let still = was.iter().filter(|x| open.contains(*x)).count();
                    if !*logged && now.duration_since(*since) >= SLOW_TO_SETTLE {
                        *logged = true;
                        tracing::info!(
                            kind,
                            transactions = still,
                            "the kind's route changed ten minutes ago or more and has not settled, so reconcile goes on reading its ready jobs every sweep: either transactions open at the change are still open (end long transactions, pg_stat_activity.xact_start) or pending outbox rows of its dead or cancelled jobs are addressed where it no longer goes (run a relay for their sink until they are published)"
                        );
                    }
                    look.push((kind, still == 0));
                }
                _ => {
                    self.known
                        .insert(kind.clone(), unsettled(version, &open, now));
                    look.push((kind, false));
                }
            }
        }
        self.looked_at = look.len();
        let mut done = Reconciled::default();
        if look.is_empty() {
            return Ok(done);
        }
        let kinds: Vec<String> = look.iter().map(|(k, _)| k.clone()).collect();
        let mut to_walk = routing::kinds_off_route(&mut *conn, &kinds).await?;
        let mut dirty: HashSet<String> = to_walk.iter().cloned().collect();
        for m in outbox::misaddressed_kinds(&mut *conn, &kinds).await? {
            if m.ready {
                to_walk.push(m.kind.clone());
            }
            dirty.insert(m.kind);
        }
        to_walk.sort_unstable();
        to_walk.dedup();
        for kind in &to_walk {
            let walked = match walk(conn, kind, Persist::GiveUp).await {
                Ok(walked) => walked,
                Err((walked, sqlx::Error::Database(e)))
                    if matches!(e.code().as_deref(), Some("40P01" | "55P03")) =>
                {
                    walked
                }
                Err((_, e)) => return Err(e),
            };
            done.jobs_moved += walked.jobs_moved;
            done.rows_readdressed += walked.rows_readdressed;
            done.rows_dropped += walked.rows_dropped;
            done.jobs_held += walked.jobs_held;
        }
        for (kind, settles) in look {
            let clean = !dirty.contains(&kind);
            let Some(known) = self.known.get_mut(&kind) else {
                continue;
            };
            match known {
                Known::Settled { at, .. } if clean => *at = now,
                Known::Settled { version, .. } => {
                    tracing::warn!(
                        kind,
                        "reconcile's hourly look at a settled kind found ready jobs off its route or pending outbox rows addressed elsewhere (a writer that does not take the route through almanac.route_of?); ready jobs' are repaired now"
                    );
                    *known = unsettled(std::mem::take(version), &open, now);
                }
                Known::Unsettled { version, .. } if clean && settles => {
                    tracing::debug!(kind, "the kind's route settled");
                    *known = Known::Settled {
                        version: std::mem::take(version),
                        at: now,
                    };
                }
                Known::Unsettled { .. } => {}
            }
        }
        Ok(done)
    }
}

/// The transactions open now in this database, but this session's and
/// autovacuum's: virtual transaction ids, and prepared transactions (which
/// hold none) by their transaction id.
const OPEN_SQL: &str = r#"
    SELECT l.virtualxid
    FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE l.locktype = 'virtualxid' AND l.granted
      AND l.pid IS DISTINCT FROM pg_backend_pid()
      AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
      AND (a.datid IS NULL
           OR a.datid = (SELECT oid FROM pg_database WHERE datname = current_database()))
    UNION ALL
    SELECT 'prepared ' || transaction::text FROM pg_prepared_xacts
    WHERE database = current_database()
"#;
