//! Job counts per kind and status at a cost that does not grow with the
//! table (migration 0128; issue #26).
//!
//! - **Exact and transactional.** Every statement that inserts, updates,
//!   deletes or truncates jobs adds, in its own transaction, one row per
//!   (kind, status) whose count it changed to the unlogged
//!   `almanac.job_counts` (statement triggers over the transition tables,
//!   so a batch of 500 claims writes two rows, not 500). A reader sums the
//!   rows ([`read`]): it sees the counts of exactly the changes its
//!   snapshot sees, like a `count(*)` would.
//! - **Bounded.** A read costs the rows written since the last fold:
//!   [`fold`] sums them into one per (kind, status). The reaper folds at
//!   every sweep, the metrics collector before every refresh and `almanac
//!   stats` before it reads, so a read costs tens of rows, whatever the
//!   table holds. Folds never run two at a time (an advisory lock), and
//!   each of their statements sees every change whose delta rows it folds.
//! - **Rebuilt when lost.** The table writes no WAL (a job's WAL is held
//!   under 1,000 bytes): a crash or a failover empties it, and so its row
//!   `('', '*')`, which says the counts are whole. Without that row, or with
//!   a negative count (a statement ran with triggers off, e.g.
//!   `session_replication_role = replica`), readers count the jobs
//!   themselves (O(jobs), as before the counters), and the next fold counts
//!   them once and writes the row again. On a standby the table cannot be
//!   read: readers count there.
//! - **Limit.** A bulk load or delete with triggers off that keeps every
//!   count non-negative goes unseen: run `almanac stats --recount` after
//!   one ([`fold`] with `recount`).
//! - **Cost.** A statement that changes jobs pays one trigger call (about
//!   30 µs in `psql` on the 2-core test machine, most of it the call, not
//!   the rows); see docs/speed.md.

use sqlx::{PgConnection, PgExecutor};

use super::{JobStatus, KindStatusCount};

/// The counts per kind and status, done included (kinds and statuses with
/// none are absent); `None` when they are not whole (after a crash, on a
/// standby, or with a negative count): count the jobs then.
pub async fn read(conn: &mut PgConnection) -> Result<Option<Vec<KindStatusCount>>, sqlx::Error> {
    let rows: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT kind, status, count FROM almanac.job_counts_read() ORDER BY 1, 2")
            .fetch_all(conn)
            .await?;
    let mut whole = false;
    let mut counts = Vec::with_capacity(rows.len());
    for (kind, status, count) in rows {
        if status == "*" {
            whole = true;
            continue;
        }
        let Some(status) = JobStatus::ALL.into_iter().find(|s| s.as_str() == status) else {
            return Ok(None);
        };
        if count < 0 {
            return Ok(None);
        }
        counts.push(KindStatusCount {
            kind,
            status,
            count,
        });
    }
    Ok(whole.then_some(counts))
}

/// What a [`fold`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fold {
    /// Another fold held the lock; nothing done.
    Busy,
    /// The rows summed into one per kind and status.
    Folded,
    /// The jobs counted (the counts were not whole, or `recount` was asked).
    Recounted,
}

/// Folds the counts' rows, or counts the jobs when the counts are not whole
/// (or `recount`). Runs in a transaction of its own under READ COMMITTED
/// (the function refuses any other level): pass a pool or a connection
/// outside a transaction.
pub async fn fold<'e>(db: impl PgExecutor<'e>, recount: bool) -> Result<Fold, sqlx::Error> {
    let done: String = sqlx::query_scalar("SELECT almanac.job_counts_fold($1)")
        .bind(recount)
        .fetch_one(db)
        .await?;
    Ok(match done.as_str() {
        "busy" => Fold::Busy,
        "recounted" => Fold::Recounted,
        _ => Fold::Folded,
    })
}
