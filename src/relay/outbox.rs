//! Every statement on `almanac.outbox` and `almanac.outbox_batches`: the
//! relay's claim and marks, the
//! re-addressing that keeps pending rows on their kind's current route, and
//! the per-sink figures for `almanac stats` and the metrics. (Outbox rows are
//! written by the trigger in the baseline migration through `almanac.write_outbox`.)
//!
//! **Asynchronous commit.** The claim and the marks that bury no job set
//! `synchronous_commit = off` for their own transaction (inside their one
//! statement; per transaction, not as a connection option, so it works
//! through PgBouncer): their commit does not wait for the WAL to reach the
//! disk. That is safe there and only there: a commit that a PostgreSQL crash
//! loses (at most the last few hundred milliseconds) undoes a claim or a
//! mark, and the rows are published once more, which the relay already
//! allows for (a second copy is harmless: consumers claim through the job
//! fence). Nothing is lost and no job runs twice. Marks that bury jobs
//! commit synchronously.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgExecutor, PgPool};

use crate::queue::routing;
use uuid::Uuid;

use crate::broker::SinkKind;

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// One outbox row, as claimed: the body is the payload's JSON text, headers
/// are name/value pairs in name order.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub id: i64,
    pub job_id: i64,
    pub destination: String,
    pub msg_key: String,
    /// The body; empty when it was not loaded: over the claim's
    /// [`ClaimLimits::max_message_bytes`] (the row is to be marked failed),
    /// or dropped once handed to the broker.
    pub payload: String,
    /// The body's size in bytes, as the database measured it
    /// (whether or not `payload` holds it): what the size limit reads.
    pub bytes: usize,
    pub header_names: Vec<String>,
    pub header_values: Vec<String>,
    /// Tries so far, this one included.
    pub attempts: i32,
}

impl Claimed {
    /// Frees the payloads (kept: [`OutboxRow::bytes`]): once the broker
    /// client has its own copy, what is left of a batch (acknowledgements,
    /// its mark) needs none.
    pub fn drop_payloads(&mut self) {
        for row in &mut self.rows {
            row.payload = String::new();
        }
    }
}

impl OutboxRow {
    /// Header names and values, in name order.
    pub fn headers(&self) -> Vec<(String, String)> {
        self.header_names
            .iter()
            .cloned()
            .zip(self.header_values.iter().cloned())
            .collect()
    }
}

/// A claimed batch: its rows, in id order, and the token its marks name.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub token: Uuid,
    pub rows: Vec<OutboxRow>,
    /// Where the batch ends in claim order (due time, then id): a later
    /// claim can start after it ([`claim_after`]). `None` when empty.
    pub last: Option<ClaimPosition>,
    /// Whether the claim started from the start of the due rows.
    pub from_start: bool,
    /// Whether the claim may have stopped at one of its limits rather than
    /// at the end of the due rows: it has its most rows, or its payloads
    /// come within `max_message_bytes` of its byte budget (the next row
    /// might not have fitted). More may be due after it.
    pub full: bool,
    /// When the batch's in-flight lease ends at the latest, on this
    /// process's clock: the claim was sent no earlier than `lease` before
    /// (the database starts the lease when it runs the claim, later).
    pub lease_ends: tokio::time::Instant,
}

/// A place in the order claims take rows in: `available_at`, then id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClaimPosition {
    pub available_at: DateTime<Utc>,
    pub id: i64,
}

/// The first key of the transaction-level advisory lock claims of one sink
/// take (the second is the sink's number); "almanac outbox claim", so it
/// does not collide with an application's locks by accident.
const CLAIM_LOCK: i32 = 0x616c_6f63;

/// The second key of a sink's claim lock ([`readdress`] takes every sink's).
fn claim_lock(sink: SinkKind) -> i32 {
    match sink {
        SinkKind::Kafka => 0,
        SinkKind::Rabbitmq => 1,
    }
}

/// What one claim may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimLimits {
    /// Most rows.
    pub rows: i64,
    /// Most bytes of payload: the claim stops before the row that would
    /// take the batch past it, and takes the first row with a payload
    /// whatever its size (up to `max_message_bytes`).
    pub bytes: i64,
    /// Rows whose payload is larger come back with their size and no
    /// payload, cost nothing against `bytes`, and are to be marked failed.
    pub max_message_bytes: i64,
}

impl ClaimLimits {
    /// A claim bounded in rows only (tools and tests): every payload loaded.
    pub fn rows(rows: i64) -> ClaimLimits {
        ClaimLimits {
            rows,
            bytes: i64::MAX,
            max_message_bytes: i64::MAX,
        }
    }
}

/// Claims up to `limit` due rows of `sink` in one statement (its own short
/// transaction, `almanac.claim_outbox_bytes` in migration 0106, which
/// bounds in bytes what the baseline's `almanac.claim_outbox` claimed; its
/// history is in `tests/fixtures/pre_baseline/0014_*` and `0015_*`): a row in `almanac.outbox_batches`
/// with a fresh token, the rows' ids and an in-flight lease of `lease` (the
/// rows come due again when it ends). The outbox rows themselves are not
/// written (the baseline says why). Rows named by another batch in flight are
/// skipped (a hashed `NOT IN`); claims of one sink take an advisory lock for
/// their transaction, so two relays never pick the same rows, and each first
/// drops the batches whose lease ended, which fences out their relays'
/// marks. `attempts` of each row counts this try. Claims from the start of
/// the due rows; [`claim_after`] starts later and bounds the batch in bytes
/// too.
pub async fn claim(
    pool: &PgPool,
    sink: SinkKind,
    limit: i64,
    lease: Duration,
) -> Result<Claimed, sqlx::Error> {
    claim_after(pool, sink, ClaimLimits::rows(limit), lease, None).await
}

/// [`claim`], taking only rows after `after` in claim order (the whole
/// order when `None`). A claim that starts after the previous batch does
/// not step over the index entries rows published since the last VACUUM
/// leave behind (`tests/fixtures/pre_baseline/0015_*` says what they cost); rows that come due behind the
/// position are taken by the next claim from the start.
///
/// **Bounded in bytes** (`almanac.claim_outbox_bytes`, migration 0106): each
/// row's payload size is recorded when the row is written (measured by the
/// claim for rows older than 0106), and the batch stops before the row that
/// would take its payloads past `limits.bytes` (it always has its first
/// row); rows over `limits.max_message_bytes` come back with their
/// [`OutboxRow::bytes`] and an empty payload, so this process never holds
/// more than about `max(limits.bytes, limits.max_message_bytes)` of
/// payload per batch.
pub async fn claim_after(
    pool: &PgPool,
    sink: SinkKind,
    limits: ClaimLimits,
    lease: Duration,
    after: Option<ClaimPosition>,
) -> Result<Claimed, sqlx::Error> {
    let token = Uuid::new_v4();
    let lease_ends = tokio::time::Instant::now() + lease;
    let query = || {
        sqlx::query_as::<_, RawRow>(
            "SELECT * FROM almanac.claim_outbox_bytes($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(sink.as_str())
        .bind(CLAIM_LOCK)
        .bind(claim_lock(sink))
        .bind(limits.rows)
        .bind(token)
        .bind(millis(lease))
        .bind(after.map(|p| p.available_at))
        .bind(after.map(|p| p.id))
        .bind(limits.max_message_bytes)
        .bind(limits.bytes)
    };
    let raw = match query().fetch_all(pool).await {
        // The session's default isolation is above READ COMMITTED (the
        // function refuses: its snapshot would predate the lock).
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("ALM01") => {
            let mut tx = pool
                .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await?;
            let raw = query().fetch_all(&mut *tx).await?;
            tx.commit().await?;
            raw
        }
        other => other?,
    };
    let last = raw
        .iter()
        .map(|r| ClaimPosition {
            available_at: r.7,
            id: r.0,
        })
        .max();
    let mut rows: Vec<OutboxRow> = raw.into_iter().map(outbox_row).collect();
    rows.sort_unstable_by_key(|r| r.id);
    let loaded: i64 = rows.iter().map(|r| r.payload.len() as i64).sum();
    // Full: the claim may have stopped before rows that are due (its row
    // limit, or its byte budget, which it can meet only once it holds more
    // than the budget minus one message; any batch at all when the budget
    // is below the message limit). An empty claim is never full.
    let full = rows.len() as i64 >= limits.rows
        || (!rows.is_empty()
            && (limits.bytes <= limits.max_message_bytes
                || loaded > limits.bytes - limits.max_message_bytes));
    Ok(Claimed {
        token,
        rows,
        last,
        from_start: after.is_none(),
        full,
        lease_ends,
    })
}

/// A claimed row as `almanac.claim_outbox_bytes` returns it, decoded by
/// position (by name, sqlx looks each column up in a map: about 6% of the
/// relay process's CPU in a profile): id, job, destination, key, payload
/// (none when over the size limit), headers, attempts, available_at, the
/// payload's size.
type RawRow = (
    i64,
    i64,
    String,
    String,
    Option<String>,
    String,
    i32,
    DateTime<Utc>,
    i64,
);

fn outbox_row(raw: RawRow) -> OutboxRow {
    let (id, job_id, destination, msg_key, payload, headers, attempts, _, bytes) = raw;
    let (header_names, header_values) = parse_headers(&headers).into_iter().unzip();
    OutboxRow {
        id,
        job_id,
        destination,
        msg_key,
        payload: payload.unwrap_or_default(),
        bytes: usize::try_from(bytes).unwrap_or(usize::MAX),
        header_names,
        header_values,
        attempts,
    }
}

/// A row's headers (a JSON object; `write_outbox` builds it), as name/value
/// pairs in name order. Values are strings; anything else is sent as its
/// JSON text. Text that is not an object gives no headers.
fn parse_headers(json: &str) -> Vec<(String, String)> {
    let map: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_str(json).unwrap_or_default();
    map.into_iter()
        .map(|(name, value)| match value {
            serde_json::Value::String(s) => (name, s),
            other => (name, other.to_string()),
        })
        .collect()
}

/// A claimed batch's outcome, row by row.
#[derive(Debug, Default)]
pub struct Outcomes {
    /// Rows the broker acknowledged, with their jobs.
    pub published: Vec<(i64, i64)>,
    /// Rows to try again: id, error, delay.
    pub retry: Vec<(i64, String, Duration)>,
    /// Rows rejected for good: id, reason.
    pub failed: Vec<(i64, String)>,
}

impl Outcomes {
    /// Every row of a claim acknowledged.
    pub fn all_published(rows: &[OutboxRow]) -> Self {
        Outcomes {
            published: rows.iter().map(|r| (r.id, r.job_id)).collect(),
            ..Outcomes::default()
        }
    }
}

/// What [`mark`] changed.
#[derive(Debug, Default)]
pub struct Marked {
    /// Published rows deleted from the outbox.
    pub published: u64,
    pub retried: u64,
    pub failed: Vec<FailedRow>,
    /// Jobs of failed rows that went `dead` with the reason.
    pub buried: Vec<i64>,
}

/// Records a claimed batch's outcome (`outcomes` names every row of the
/// claim) if the batch still holds its rows and its lease has not ended;
/// otherwise (its lease ran out, whether or not another relay claimed them
/// again, or `route set` re-addressed them) marks nothing: the rows come
/// due again and go out once more. Published rows are deleted
/// and the batch becomes the record of their publication (re-drive reads
/// it); a batch with nothing published is deleted. Rows to retry get their
/// error and a later `available_at`, failed rows `failed_at` and their
/// reason, both counting the try in `attempts`; the jobs of failed rows are
/// buried ([`routing::bury_unpublishable`]). One statement, committed
/// asynchronously, when every row was published (the common case); one
/// transaction otherwise, committed synchronously when it buries jobs.
pub async fn mark(pool: &PgPool, token: Uuid, outcomes: &Outcomes) -> Result<Marked, sqlx::Error> {
    if outcomes.retry.is_empty() && outcomes.failed.is_empty() {
        let mut conn = pool.acquire().await?;
        let published = mark_batch(&mut conn, token, outcomes).await?;
        return Ok(Marked {
            published: published.unwrap_or(0),
            ..Marked::default()
        });
    }
    let mut tx = pool.begin().await?;
    let Some(published) = mark_batch(&mut tx, token, outcomes).await? else {
        return Ok(Marked::default());
    };
    let mut marked = Marked {
        published,
        ..Marked::default()
    };
    if !outcomes.retry.is_empty() {
        let ids: Vec<i64> = outcomes.retry.iter().map(|r| r.0).collect();
        let errors: Vec<&str> = outcomes.retry.iter().map(|r| r.1.as_str()).collect();
        let delays: Vec<i64> = outcomes.retry.iter().map(|r| millis(r.2)).collect();
        marked.retried = sqlx::query(MARK_RETRY_SQL)
            .bind(&ids)
            .bind(&errors)
            .bind(&delays)
            .execute(&mut *tx)
            .await?
            .rows_affected();
    }
    if !outcomes.failed.is_empty() {
        let (ids, errors): (Vec<i64>, Vec<&str>) =
            outcomes.failed.iter().map(|f| (f.0, f.1.as_str())).unzip();
        marked.failed = sqlx::query_as(MARK_FAILED_SQL)
            .bind(&ids)
            .bind(&errors)
            .fetch_all(&mut *tx)
            .await?;
        let (jobs, reasons): (Vec<i64>, Vec<String>) = marked
            .failed
            .iter()
            .map(|f| (f.job_id, f.error.clone()))
            .unzip();
        marked.buried = routing::bury_unpublishable(&mut tx, &jobs, &reasons).await?;
    }
    tx.commit().await?;
    Ok(marked)
}

// The marks look rows up by id and test `failed_at` alone: rows of a batch
// are never published row by row, and naming both columns would match
// `outbox_due_idx`'s predicate, and tempt the planner into scanning the
// whole backlog through it for each mark (seen: 30 times slower). `o.id =
// ANY($1)` beside the join with `unnest` gives the planner the primary key
// (without it, it hashed the whole outbox). The plans are checked in
// `tests/it/relay.rs`.

/// The batch part of a mark: `$1` token, `$2` published ids, `$3` their
/// jobs, `$4` asynchronous commit, `$5` every claimed row published (the
/// batch keeps its stored `ids`: not written again), `$6` and `$7` the
/// lowest and highest job (the record's `job_span`; the baseline migration
/// says why a span). A batch whose in-flight lease has ended is not marked,
/// whether or not a claim took its rows again: the lease is the whole time
/// a batch may take, so a relay that comes back late records nothing and
/// its rows go out once more, by whoever claims them next. (Left: a mark
/// that starts before the lease ends and commits after a claim read the
/// rows again; the relay starts its marks [`super::mark_reserve`] before.)
pub const MARK_BATCH_SQL: &str = r#"
        WITH commit_mode AS (
            SELECT set_config('synchronous_commit', CASE WHEN $4 THEN 'off' ELSE 'on' END, true)
        ), published AS (
            UPDATE almanac.outbox_batches
            SET published_at = now(), ids = CASE WHEN $5 THEN ids ELSE $2 END, job_ids = $3,
                job_span = int8range($6, $7, '[]')
            WHERE token = $1 AND published_at IS NULL AND lease_until > clock_timestamp()
              AND cardinality($2::bigint[]) > 0
            RETURNING token
        ), dropped AS (
            DELETE FROM almanac.outbox_batches
            WHERE token = $1 AND published_at IS NULL AND lease_until > clock_timestamp()
              AND cardinality($2::bigint[]) = 0
            RETURNING token
        ), deleted AS (
            DELETE FROM almanac.outbox AS o USING published
            WHERE o.id = ANY($2) AND o.failed_at IS NULL
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM deleted) FROM commit_mode
        WHERE EXISTS (SELECT 1 FROM published UNION ALL SELECT 1 FROM dropped)
        "#;

/// Rows to retry: `$1` ids, `$2` errors, `$3` delays in milliseconds.
pub const MARK_RETRY_SQL: &str = r#"
    UPDATE almanac.outbox AS o
    SET last_error = f.error, attempts = o.attempts + 1,
        available_at = now() + f.delay_ms * interval '1 millisecond'
    FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS f(id, error, delay_ms)
    WHERE o.id = ANY($1) AND o.id = f.id AND o.failed_at IS NULL
    "#;

/// Rows failed for good: `$1` ids, `$2` reasons.
pub const MARK_FAILED_SQL: &str = r#"
    UPDATE almanac.outbox AS o
    SET failed_at = now(), last_error = f.error, attempts = o.attempts + 1
    FROM unnest($1::bigint[], $2::text[]) AS f(id, error)
    WHERE o.id = ANY($1) AND o.id = f.id AND o.failed_at IS NULL
    RETURNING o.id, o.job_id, o.destination, f.error
    "#;

/// The batch part of [`mark`], in one statement: takes the batch (its row
/// lock orders this against claims and `route set`) and deletes the
/// published rows; `None` when the batch is gone. Sets `synchronous_commit
/// = off` for the transaction it runs in unless rows failed (their jobs are
/// buried); keeps the batch's stored ids when every row was published.
async fn mark_batch(
    conn: &mut PgConnection,
    token: Uuid,
    outcomes: &Outcomes,
) -> Result<Option<u64>, sqlx::Error> {
    let asynchronous = outcomes.failed.is_empty();
    let whole_batch = asynchronous && outcomes.retry.is_empty();
    let (ids, jobs): (Vec<i64>, Vec<i64>) = outcomes.published.iter().copied().unzip();
    let deleted: Option<i64> = sqlx::query_scalar(MARK_BATCH_SQL)
        .bind(token)
        .bind(&ids)
        .bind(&jobs)
        .bind(asynchronous)
        .bind(whole_batch)
        .bind(jobs.iter().min())
        .bind(jobs.iter().max())
        .fetch_optional(&mut *conn)
        .await?;
    Ok(deleted.map(|n| n as u64))
}

/// Hands back a batch whose rows were never sent (claimed ahead, then not
/// needed): they are due again at once, and the try is not counted.
pub async fn release(pool: &PgPool, token: Uuid) -> Result<u64, sqlx::Error> {
    Ok(
        sqlx::query("DELETE FROM almanac.outbox_batches WHERE token = $1 AND published_at IS NULL")
            .bind(token)
            .execute(pool)
            .await?
            .rows_affected(),
    )
}

/// A row marked failed, with the job it was for.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct FailedRow {
    pub id: i64,
    pub job_id: i64,
    pub destination: String,
    pub error: String,
}

/// The ids of the pending rows of the jobs `$1` that [`readdress`]
/// changes: on the `db` route (dropped), or addressed to another sink or
/// destination than their kind's route (re-addressed). Driven from the job
/// ids through `outbox_job_idx` (a lateral lookup per job): the pending
/// test is written so the partial index of pending rows cannot be used,
/// since while a walk writes many rows that index's statistics are stale
/// and a plan through it read every pending row for each window.
const MISADDRESSED_ROWS: &str = r#"
    SELECT o.id FROM unnest($1::bigint[]) AS x(id)
    CROSS JOIN LATERAL (
        SELECT o.id, o.sink, o.destination FROM almanac.outbox AS o
        WHERE o.job_id = x.id AND coalesce(o.published_at, o.failed_at) IS NULL) AS o
    JOIN almanac.jobs AS j ON j.id = x.id
    LEFT JOIN almanac.routes AS r ON r.kind = j.kind
    WHERE (j.route = 'db' AND j.status IN ('ready', 'running'))
       OR (j.route <> 'db' AND r.mode <> 'db'
           AND (o.sink, o.destination) IS DISTINCT FROM (r.sink, r.destination))
"#;

/// Points the pending rows of the jobs `job_ids` (a window of one kind's
/// ready jobs, see [`crate::queue::routing::move_window`]) at their kind's
/// current sink and destination when they name others; batches in flight
/// that name them are dropped (a relay still publishing them marks nothing,
/// and their other rows come due again) and the rows come due at their
/// job's `run_at` with a fresh count of attempts. Rows of jobs now on the
/// `db` route are deleted: workers run those jobs. Returns (re-addressed,
/// deleted). Run it in a READ COMMITTED transaction: its statements must see
/// batches claimed before it took the claim locks (held until the
/// transaction ends, so keep the window short).
pub async fn readdress(
    conn: &mut PgConnection,
    job_ids: &[i64],
) -> Result<(u64, u64), sqlx::Error> {
    if job_ids.is_empty() {
        return Ok((0, 0));
    }
    // Most windows of a route walk have nothing to re-address (a change of
    // mode alone: the rows the move wrote carry the new address): those
    // leave the claim locks alone, so the relays' claims go on meanwhile. A
    // row misaddressed by a statement that commits after this look is
    // found by the relays' reconcile ([`misaddressed_kinds`]).
    let rows: Vec<i64> = sqlx::query_scalar(MISADDRESSED_ROWS)
        .bind(job_ids)
        .fetch_all(&mut *conn)
        .await?;
    if rows.is_empty() {
        return Ok((0, 0));
    }
    // Claims of both sinks wait until this transaction ends, so none picks
    // a row about to move; in-flight batches naming such a row are dropped,
    // so their relays mark nothing. (Batch before rows, as in `mark`.)
    // Always in the same order (`SinkKind::ALL`), so two never deadlock.
    sqlx::query("SELECT pg_advisory_xact_lock($1, k) FROM unnest($2::int[]) AS k")
        .bind(CLAIM_LOCK)
        .bind(SinkKind::ALL.map(claim_lock).to_vec())
        .execute(&mut *conn)
        .await?;
    sqlx::query("DELETE FROM almanac.outbox_batches WHERE published_at IS NULL AND ids && $1")
        .bind(&rows)
        .execute(&mut *conn)
        .await?;
    // Primary-key lookups of those rows, each condition tested again (a
    // relay may have published one meanwhile).
    let moved = sqlx::query(
        r#"
        UPDATE almanac.outbox AS o
        SET sink = r.sink, destination = r.destination, available_at = j.run_at,
            attempts = 0, last_error = NULL
        FROM almanac.jobs AS j, almanac.routes AS r
        WHERE o.id = ANY($1) AND j.id = o.job_id AND r.kind = j.kind
          AND o.published_at IS NULL AND o.failed_at IS NULL
          AND j.route <> 'db' AND r.mode <> 'db'
          AND (o.sink, o.destination) IS DISTINCT FROM (r.sink, r.destination)
        "#,
    )
    .bind(&rows)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    let dropped = sqlx::query(
        r#"
        DELETE FROM almanac.outbox AS o
        USING almanac.jobs AS j
        WHERE o.id = ANY($1) AND j.id = o.job_id AND j.route = 'db'
          AND j.status IN ('ready', 'running')
          AND o.published_at IS NULL AND o.failed_at IS NULL
        "#,
    )
    .bind(&rows)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if moved > 0 {
        sqlx::query("SELECT pg_notify('almanac_outbox', s) FROM unnest($1::text[]) AS s")
            .bind(SinkKind::ALL.map(SinkKind::as_str).to_vec())
            .execute(&mut *conn)
            .await?;
    }
    Ok((moved, dropped))
}

/// A kind of `kinds` with pending rows addressed where its route no longer
/// goes, and whose jobs those are.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Misaddressed {
    pub kind: String,
    /// Some of those jobs are ready: a walk re-addresses their rows
    /// ([`readdress`]). The rows of jobs in other states are left alone: a
    /// consumer finds a running or finished job taken and skips its
    /// message, and a job made ready again (a failure retried, a dead or
    /// cancelled job retried by an operator) gets a row on its kind's
    /// route, its old row then being the ready case.
    pub ready: bool,
}

/// Of `kinds`, those with pending rows addressed where their route no
/// longer goes ([`Misaddressed`]), of jobs in any state but `done` (no
/// statement makes a done job ready again, so its row can never become a
/// ready job's stray; in `dual` mode a kind keeps many, which a retired
/// sink's relay would never publish).
pub async fn misaddressed_kinds<'e>(
    db: impl PgExecutor<'e>,
    kinds: &[String],
) -> Result<Vec<Misaddressed>, sqlx::Error> {
    sqlx::query_as(
        r#"
        SELECT j.kind, bool_or(j.status = 'ready') AS ready
        FROM almanac.outbox AS o
        JOIN almanac.jobs AS j ON j.id = o.job_id
        LEFT JOIN almanac.routes AS r ON r.kind = j.kind
        WHERE o.published_at IS NULL AND o.failed_at IS NULL AND j.kind = ANY($1)
          AND j.status <> 'done'
          AND (j.route = 'db' OR coalesce(r.mode, 'db') = 'db'
               OR (o.sink, o.destination) IS DISTINCT FROM (r.sink, r.destination))
        GROUP BY j.kind
        ORDER BY j.kind
        "#,
    )
    .bind(kinds)
    .fetch_all(db)
    .await
}

/// The outbox of one sink, as `almanac stats` and the metrics show it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct SinkOutboxStats {
    pub sink: String,
    /// Rows waiting to be published (in flight or not, due or not).
    pub backlog: i64,
    /// Of those, rows a relay holds in flight right now.
    pub in_flight: i64,
    /// How long the most overdue row waiting to be published has been due
    /// (since its job's `run_at`, or since a failed publish set its next
    /// try), in seconds; 0 when none is due.
    pub oldest_unpublished_seconds: f64,
    /// Rows the broker rejected for good; their jobs went dead.
    pub failed: i64,
}

/// Backlog, in-flight, oldest unpublished and failed figures per sink (both
/// sinks always listed). The backlog and failed rows are the counters'
/// ([`crate::queue::counts`]; counted through the partial indexes while
/// those are not whole); rows in flight are the relays' batches', and the
/// oldest due row is the first entry of `outbox_due_idx`: the same cost
/// whatever the backlog.
pub async fn stats(conn: &mut PgConnection) -> Result<Vec<SinkOutboxStats>, sqlx::Error> {
    let sinks = SinkKind::ALL.map(SinkKind::as_str).to_vec();
    let counted = crate::queue::counts::outbox(&mut *conn).await?;
    let mut rows: Vec<SinkOutboxStats> = sqlx::query_as(
        r#"
        SELECT s.sink,
            CASE WHEN $2 THEN 0 ELSE (SELECT count(*) FROM almanac.outbox o
              WHERE o.sink = s.sink AND o.published_at IS NULL AND o.failed_at IS NULL) END AS backlog,
            (SELECT count(*) FROM almanac.outbox o
              WHERE o.sink = s.sink AND o.published_at IS NULL AND o.failed_at IS NULL
                AND o.id IN (SELECT unnest(b.ids) FROM almanac.outbox_batches b
                             WHERE b.sink = s.sink AND b.published_at IS NULL
                               AND b.lease_until > now())) AS in_flight,
            coalesce((SELECT greatest(extract(epoch FROM now() - o.available_at), 0)::float8
              FROM almanac.outbox o
              WHERE o.sink = s.sink AND o.published_at IS NULL AND o.failed_at IS NULL
              ORDER BY o.available_at, o.id LIMIT 1), 0)
              AS oldest_unpublished_seconds,
            CASE WHEN $2 THEN 0 ELSE (SELECT count(*) FROM almanac.outbox o
              WHERE o.sink = s.sink AND o.failed_at IS NOT NULL) END AS failed
        FROM unnest($1::text[]) AS s(sink)
        ORDER BY s.sink
        "#,
    )
    .bind(&sinks)
    .bind(counted.is_some())
    .fetch_all(&mut *conn)
    .await?;
    if let Some(counted) = counted {
        for row in &mut rows {
            let sink = row.sink.clone();
            let of = |status: &str| -> i64 {
                counted
                    .iter()
                    .filter(|c| c.scope == sink && c.status == status)
                    .map(|c| c.count)
                    .sum()
            };
            row.backlog = of("pending");
            row.failed = of("failed");
        }
    }
    Ok(rows)
}

/// The janitor's deletion of publication records: `$1` seconds old, `$2` at
/// most, oldest first. An ordered range of `outbox_batches_published_idx`
/// that stops at `$2`, then each record by its primary key: it reads the
/// records it deletes, however many are kept (`tests/it/ledger_scale.rs`
/// holds the plan at 10 million published jobs).
pub const DELETE_PUBLISHED_SQL: &str = r#"
    WITH gone AS (
        DELETE FROM almanac.outbox_batches WHERE token = ANY(ARRAY(
            SELECT token FROM almanac.outbox_batches
             WHERE published_at < now() - make_interval(secs => $1)
             ORDER BY published_at
             LIMIT $2
             FOR UPDATE SKIP LOCKED))
        RETURNING cardinality(ids) AS n)
    SELECT sum(n)::bigint FROM gone
    "#;

/// Deletes records of publications older than `older_than`: at most
/// `limit` published batches and `limit` rows published row by row (by
/// pre-release builds), oldest first; returns how many rows they covered. Unpublished rows
/// are never touched.
pub async fn delete_published<'e>(
    db: impl sqlx::PgExecutor<'e> + Copy,
    older_than: std::time::Duration,
    limit: i64,
) -> Result<u64, sqlx::Error> {
    let batches: Option<i64> = sqlx::query_scalar(DELETE_PUBLISHED_SQL)
        .bind(older_than.as_secs_f64())
        .bind(limit)
        .fetch_one(db)
        .await?;
    let legacy = sqlx::query(
        r#"
        DELETE FROM almanac.outbox WHERE id = ANY(ARRAY(
            SELECT id FROM almanac.outbox
             WHERE published_at < now() - make_interval(secs => $1)
             ORDER BY published_at
             LIMIT $2
             FOR UPDATE SKIP LOCKED))
        "#,
    )
    .bind(older_than.as_secs_f64())
    .bind(limit)
    .execute(db)
    .await?;
    Ok(batches.unwrap_or(0) as u64 + legacy.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::parse_headers;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn headers_come_in_name_order_with_values_as_sent() {
        // PostgreSQL prints jsonb keys shortest first, not in name order.
        let json = r#"{"almanac-kind": "send_email", "almanac-job-id": "7", "almanac-attempt": "1", "almanac-logical-run": ""}"#;
        assert_eq!(
            parse_headers(json),
            pairs(&[
                ("almanac-attempt", "1"),
                ("almanac-job-id", "7"),
                ("almanac-kind", "send_email"),
                ("almanac-logical-run", ""),
            ])
        );
    }

    #[test]
    fn header_values_that_are_not_strings_are_sent_as_their_json_text() {
        let json = r#"{"n": 3, "flag": true, "none": null, "list": [1, "a"], "s": "x\"y"}"#;
        assert_eq!(
            parse_headers(json),
            pairs(&[
                ("flag", "true"),
                ("list", r#"[1,"a"]"#),
                ("n", "3"),
                ("none", "null"),
                ("s", "x\"y"),
            ])
        );
    }

    #[test]
    fn headers_that_are_not_an_object_give_none() {
        assert!(parse_headers("[]").is_empty());
        assert!(parse_headers("not json").is_empty());
        assert!(parse_headers("{}").is_empty());
    }
}
