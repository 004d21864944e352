//! Counts of jobs per kind and status, and of outbox rows per sink, kind
//! and state, at a cost that does not grow with the tables (migration
//! 0128; issue #26).
//!
//! - **Exact and transactional.** Every statement that inserts, updates,
//!   deletes or truncates jobs or outbox rows adds, in its own transaction,
//!   one row per (scope, kind, status) whose count it changed to the
//!   unlogged `almanac.counts` (statement triggers over the transition
//!   tables, so a batch of 500 claims of one kind writes two rows, not
//!   500). The triggers fire under `session_replication_role = replica`
//!   too (`ENABLE ALWAYS`). A reader
//!   sums the rows ([`read`]): it sees the counts of exactly the changes
//!   its snapshot sees, like a `count(*)` would.
//! - **Bounded.** A read costs the rows written since the last fold:
//!   [`fold`] sums them into one per (scope, kind, status). The reaper folds
//!   at every sweep, the metrics collector before every refresh and
//!   `almanac stats` before it reads, so a read costs tens of rows whatever
//!   the tables hold. Folds never run two at a time (an advisory lock), and
//!   each of their statements takes its snapshot after the lock, so every
//!   delta row a fold sums belongs to a change its snapshot sees.
//! - **Rebuilt when lost.** The table writes no WAL (a job's WAL is held
//!   under 1,000 bytes): a crash or a failover empties it, and so its row
//!   with scope `*`, which says the counts are whole. Without that row, or
//!   with a negative count (a statement ran with a count trigger
//!   disabled), readers count the rows
//!   themselves (O(rows), as before the counters), and the next fold counts
//!   them once (without blocking writers) and writes the row again. On a
//!   standby the table cannot be read: readers count there, and folds
//!   skip. A TRUNCATE adds a `*` row of -1, so the counts are not whole
//!   until the next fold (a delete could miss rows its snapshot does not
//!   see; the -1 counts in any snapshot). The collector's
//!   `almanac_counts_whole` gauge says which way its last read went.
//! - **Limits.** A bulk load or delete with the count triggers disabled
//!   (by name, `DISABLE TRIGGER ALL` or `USER`, `pg_restore
//!   --disable-triggers`) that keeps every count non-negative goes unseen:
//!   run `almanac stats --recount` after one ([`fold`] with `recount`). If
//!   nothing folds (no reaper, collector or `stats` runs), the rows pile up
//!   and each read sums them all. A recount reads both tables for seconds
//!   on big ones (4.2 s at 10,000,000 jobs): DDL that needs an exclusive
//!   lock on them waits for it, and writers queue behind that DDL.
//! - **Cost.** A statement that changes jobs or outbox rows pays one
//!   trigger call (about 30 µs in `psql` on the 2-core test machine, most of
//!   it the call, not the rows); docs/speed.md has the figures.

use sqlx::{Connection, PgConnection};

use super::{JobStatus, KindStatusCount};

/// The scope of the jobs' counts.
pub const JOBS: &str = "jobs";
/// The scope of a sink's outbox rows is this and the sink's name.
const OUTBOX: &str = "outbox:";

/// One count: rows of `scope` of `kind` in `status`.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Count {
    pub scope: String,
    pub kind: String,
    pub status: String,
    pub count: i64,
}

/// The counts of `scopes` (scopes, kinds and statuses with none are
/// absent); `None` when they are not whole (after a crash, on a standby, or
/// with a negative count): count the rows then.
pub async fn read(
    conn: &mut PgConnection,
    scopes: &[&str],
) -> Result<Option<Vec<Count>>, sqlx::Error> {
    let rows: Vec<Count> = sqlx::query_as(
        "SELECT scope, kind, status, count FROM almanac.counts_read($1) ORDER BY 1, 2, 3",
    )
    .bind(scopes)
    .fetch_all(conn)
    .await?;
    let whole = rows.iter().any(|c| c.scope == "*");
    if !whole || rows.iter().any(|c| c.count < 0) {
        return Ok(None);
    }
    Ok(Some(rows.into_iter().filter(|c| c.scope != "*").collect()))
}

/// The jobs per kind and status, done included; `None` when the counts are
/// not whole.
pub async fn jobs(conn: &mut PgConnection) -> Result<Option<Vec<KindStatusCount>>, sqlx::Error> {
    let Some(counts) = read(conn, &[JOBS]).await? else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(counts.len());
    for c in counts {
        // The check constraint allows no other status.
        let Some(status) = JobStatus::ALL.into_iter().find(|s| s.as_str() == c.status) else {
            return Ok(None);
        };
        out.push(KindStatusCount {
            kind: c.kind,
            status,
            count: c.count,
        });
    }
    Ok(Some(out))
}

/// The outbox rows per sink, kind and state (`pending`, `failed`,
/// `published`), every sink's: [`Count::scope`] is the sink's name. `None`
/// when the counts are not whole.
pub async fn outbox(conn: &mut PgConnection) -> Result<Option<Vec<Count>>, sqlx::Error> {
    let scopes = crate::broker::SinkKind::ALL.map(|s| format!("{OUTBOX}{}", s.as_str()));
    let scopes: Vec<&str> = scopes.iter().map(String::as_str).collect();
    Ok(read(conn, &scopes).await?.map(|counts| {
        counts
            .into_iter()
            .map(|c| Count {
                scope: c.scope.trim_start_matches(OUTBOX).to_string(),
                ..c
            })
            .collect()
    }))
}

/// What a [`fold`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fold {
    /// Another fold held the lock; nothing done.
    Busy,
    /// A standby or a read-only session: nothing to write; readers count.
    Skipped,
    /// The rows summed into one per scope, kind and status.
    Folded,
    /// The rows counted (the counts were not whole, or `recount` was asked).
    Recounted,
}

/// Folds the counts' rows, or counts the jobs and outbox rows when the
/// counts are not whole (or `recount`), in a READ COMMITTED transaction of
/// its own (whatever the session's default): each of its statements must
/// see what committed before it took the lock. `conn` must not be in a
/// transaction.
pub async fn fold(conn: &mut PgConnection, recount: bool) -> Result<Fold, sqlx::Error> {
    let mut tx = conn.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(&mut *tx)
        .await?;
    let done: String = sqlx::query_scalar("SELECT almanac.counts_fold($1)")
        .bind(recount)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(match done.as_str() {
        "busy" => Fold::Busy,
        "skipped" => Fold::Skipped,
        "recounted" => Fold::Recounted,
        _ => Fold::Folded,
    })
}
