//! Every statement on `almanac.outbox`: the relay's claim and marks, the
//! re-addressing that keeps pending rows on their kind's current route, and
//! the per-sink figures for `almanac stats` and the metrics. (Outbox rows are
//! written by the trigger in `0003_outbox.sql` through `almanac.write_outbox`.)

use std::time::Duration;

use serde::Serialize;
use sqlx::{PgConnection, PgExecutor, PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::broker::SinkKind;

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A transaction with asynchronous commit (`SET LOCAL synchronous_commit =
/// off`): its commit does not wait for the WAL to reach the disk. The relay
/// claims, marks published and hands back rows this way, and nothing else.
/// That is safe there and only there: a commit that a PostgreSQL crash loses
/// (at most the last few hundred milliseconds) undoes a claim or a mark, and
/// the row is published once more, which the relay already allows for (a
/// second copy is harmless: consumers claim through the job fence). Nothing
/// is lost and no job runs twice. Marks that bury jobs commit synchronously.
/// (`SET LOCAL`, not a connection option, so it works through PgBouncer.)
pub async fn begin_async_commit(
    pool: &PgPool,
) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL synchronous_commit = off")
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}

/// One outbox row, as claimed: the body is the payload's JSON text, headers
/// are name/value pairs in name order.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub id: i64,
    pub job_id: i64,
    pub destination: String,
    pub msg_key: String,
    pub payload: String,
    pub header_names: Vec<String>,
    pub header_values: Vec<String>,
    /// Tries so far, this one included.
    pub attempts: i32,
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
}

/// Claims up to `limit` due rows of `sink` in one statement (its own short
/// transaction): `FOR UPDATE SKIP LOCKED`, then an in-flight lease of
/// `lease` in `lease_until` (the row comes due again when it ends), a fresh
/// token, and `attempts + 1`. Only columns no index covers change, so the
/// update is HOT (migration `0013_outbox_hot_claim.sql`): rows in flight keep
/// their place in `outbox_due_idx` and the scan steps over them.
pub async fn claim(
    pool: &PgPool,
    sink: SinkKind,
    limit: i64,
    lease: Duration,
) -> Result<Claimed, sqlx::Error> {
    let token = Uuid::new_v4();
    let mut tx = begin_async_commit(pool).await?;
    // `id = ANY(ARRAY(...))` walks the primary key for the picked rows; a
    // join with a CTE would hash the whole table.
    let raw: Vec<RawRow> = sqlx::query_as(
        r#"
        UPDATE almanac.outbox AS o
        SET lease_until = now() + $3 * interval '1 millisecond',
            lease_token = $4,
            attempts = o.attempts + 1
        WHERE o.id = ANY(ARRAY(
            SELECT id FROM almanac.outbox
            WHERE sink = $1 AND published_at IS NULL AND failed_at IS NULL
              AND available_at <= now() AND (lease_until IS NULL OR lease_until <= now())
            ORDER BY available_at, id
            LIMIT $2
            FOR UPDATE SKIP LOCKED))
        RETURNING o.id, o.job_id, o.destination, o.msg_key, o.payload::text AS payload,
            o.headers::text AS headers, o.attempts
        "#,
    )
    .bind(sink.as_str())
    .bind(limit)
    .bind(millis(lease))
    .bind(token)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    let mut rows: Vec<OutboxRow> = raw.into_iter().map(OutboxRow::from).collect();
    rows.sort_unstable_by_key(|r| r.id);
    Ok(Claimed { token, rows })
}

#[derive(sqlx::FromRow)]
struct RawRow {
    id: i64,
    job_id: i64,
    destination: String,
    msg_key: String,
    payload: String,
    headers: String,
    attempts: i32,
}

impl From<RawRow> for OutboxRow {
    fn from(raw: RawRow) -> Self {
        // Header values are strings (write_outbox builds them); anything
        // else is sent as its JSON text.
        let map: std::collections::BTreeMap<String, serde_json::Value> =
            serde_json::from_str(&raw.headers).unwrap_or_default();
        let (header_names, header_values) = map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .unzip();
        OutboxRow {
            id: raw.id,
            job_id: raw.job_id,
            destination: raw.destination,
            msg_key: raw.msg_key,
            payload: raw.payload,
            header_names,
            header_values,
            attempts: raw.attempts,
        }
    }
}

/// Marks rows of a claim published; returns how many still held the claim.
pub async fn mark_published<'e>(
    db: impl PgExecutor<'e>,
    token: Uuid,
    ids: &[i64],
) -> Result<u64, sqlx::Error> {
    if ids.is_empty() {
        return Ok(0);
    }
    Ok(sqlx::query(
        "UPDATE almanac.outbox SET published_at = now(), last_error = NULL, lease_token = NULL, \
         lease_until = NULL \
         WHERE id = ANY($1) AND lease_token = $2",
    )
    .bind(ids)
    .bind(token)
    .execute(db)
    .await?
    .rows_affected())
}

/// Hands back rows of a claim that were never sent (claimed ahead, then not
/// needed): they are due again at once, and the try is not counted.
pub async fn release(pool: &PgPool, token: Uuid, ids: &[i64]) -> Result<u64, sqlx::Error> {
    if ids.is_empty() {
        return Ok(0);
    }
    let mut tx = begin_async_commit(pool).await?;
    let released = sqlx::query(
        "UPDATE almanac.outbox SET lease_token = NULL, lease_until = NULL, attempts = attempts - 1 \
         WHERE id = ANY($1) AND lease_token = $2",
    )
    .bind(ids)
    .bind(token)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(released)
}

/// Gives rows of a claim their error and a later `available_at`; returns how
/// many still held the claim.
pub async fn mark_retry<'e>(
    db: impl PgExecutor<'e>,
    token: Uuid,
    ids: &[i64],
    errors: &[String],
    delays: &[Duration],
) -> Result<u64, sqlx::Error> {
    if ids.is_empty() {
        return Ok(0);
    }
    let delays: Vec<i64> = delays.iter().copied().map(millis).collect();
    Ok(sqlx::query(
        r#"
        UPDATE almanac.outbox AS o
        SET last_error = f.error, lease_token = NULL, lease_until = NULL,
            available_at = now() + f.delay_ms * interval '1 millisecond'
        FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS f(id, error, delay_ms)
        WHERE o.id = f.id AND o.lease_token = $4
        "#,
    )
    .bind(ids)
    .bind(errors)
    .bind(&delays)
    .bind(token)
    .execute(db)
    .await?
    .rows_affected())
}

/// A row marked failed, with the job it was for.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct FailedRow {
    pub id: i64,
    pub job_id: i64,
    pub destination: String,
    pub error: String,
}

/// Marks rows of a claim failed for good with their reasons; returns those
/// that still held the claim.
pub async fn mark_failed(
    conn: &mut PgConnection,
    token: Uuid,
    ids: &[i64],
    errors: &[String],
) -> Result<Vec<FailedRow>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_as(
        r#"
        UPDATE almanac.outbox AS o
        SET failed_at = now(), last_error = f.error, lease_token = NULL, lease_until = NULL
        FROM unnest($1::bigint[], $2::text[]) AS f(id, error)
        WHERE o.id = f.id AND o.lease_token = $3
        RETURNING o.id, o.job_id, o.destination, f.error
        "#,
    )
    .bind(ids)
    .bind(errors)
    .bind(token)
    .fetch_all(conn)
    .await
}

/// Points the pending rows of `kind`'s jobs at the kind's current sink and
/// destination when they name others; in-flight leases are voided (a relay
/// still publishing them marks nothing) and the rows come due at their
/// job's `run_at` with a fresh count of attempts. Rows of jobs now on the
/// `db` route are deleted: workers run those jobs. `kind = None` does every
/// kind (the relay's reconcile). Returns (re-addressed, deleted).
pub async fn readdress(
    conn: &mut PgConnection,
    kind: Option<&str>,
) -> Result<(u64, u64), sqlx::Error> {
    let moved = sqlx::query(
        r#"
        UPDATE almanac.outbox AS o
        SET sink = r.sink, destination = r.destination, available_at = j.run_at,
            lease_token = NULL, lease_until = NULL, attempts = 0, last_error = NULL
        FROM almanac.jobs AS j, almanac.routes AS r
        WHERE o.job_id = j.id AND r.kind = j.kind AND ($1::text IS NULL OR j.kind = $1)
          AND o.published_at IS NULL AND o.failed_at IS NULL
          AND j.route <> 'db' AND r.mode <> 'db'
          AND (o.sink, o.destination) IS DISTINCT FROM (r.sink, r.destination)
        "#,
    )
    .bind(kind)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    let dropped = sqlx::query(
        r#"
        DELETE FROM almanac.outbox AS o
        USING almanac.jobs AS j
        WHERE o.job_id = j.id AND ($1::text IS NULL OR j.kind = $1) AND j.route = 'db'
          AND j.status IN ('ready', 'running')
          AND o.published_at IS NULL AND o.failed_at IS NULL
        "#,
    )
    .bind(kind)
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

/// Kinds with pending rows that [`readdress`] would change.
pub async fn misaddressed_kinds<'e>(db: impl PgExecutor<'e>) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        r#"
        SELECT DISTINCT j.kind
        FROM almanac.outbox AS o
        JOIN almanac.jobs AS j ON j.id = o.job_id
        LEFT JOIN almanac.routes AS r ON r.kind = j.kind
        WHERE o.published_at IS NULL AND o.failed_at IS NULL
          AND ((j.route = 'db' AND j.status IN ('ready', 'running'))
               OR (j.route <> 'db' AND r.mode <> 'db'
                   AND (o.sink, o.destination) IS DISTINCT FROM (r.sink, r.destination)))
        "#,
    )
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
    /// Age of the oldest row waiting to be published, in seconds (0 when none).
    pub oldest_unpublished_seconds: f64,
    /// Rows the broker rejected for good; their jobs went dead.
    pub failed: i64,
}

/// Backlog, in-flight, oldest unpublished and failed figures per sink (both sinks
/// always listed). Uses the partial indexes on pending and failed rows.
pub async fn stats<'e>(db: impl PgExecutor<'e>) -> Result<Vec<SinkOutboxStats>, sqlx::Error> {
    sqlx::query_as(
        r#"
        SELECT s.sink,
            (SELECT count(*) FROM almanac.outbox o
              WHERE o.sink = s.sink AND o.published_at IS NULL AND o.failed_at IS NULL) AS backlog,
            (SELECT count(*) FROM almanac.outbox o
              WHERE o.sink = s.sink AND o.published_at IS NULL AND o.failed_at IS NULL
                AND o.lease_token IS NOT NULL
                AND (o.lease_until > now() OR o.available_at > now())) AS in_flight,
            coalesce((SELECT extract(epoch FROM now() - min(o.created_at))::float8
              FROM almanac.outbox o
              WHERE o.sink = s.sink AND o.published_at IS NULL AND o.failed_at IS NULL), 0)
              AS oldest_unpublished_seconds,
            (SELECT count(*) FROM almanac.outbox o
              WHERE o.sink = s.sink AND o.failed_at IS NOT NULL) AS failed
        FROM unnest($1::text[]) AS s(sink)
        ORDER BY s.sink
        "#,
    )
    .bind(SinkKind::ALL.map(SinkKind::as_str).to_vec())
    .fetch_all(db)
    .await
}

/// Deletes at most `limit` outbox rows published more than `older_than` ago,
/// oldest first; returns how many went. Unpublished rows are never touched.
pub async fn delete_published<'e>(
    db: impl sqlx::PgExecutor<'e>,
    older_than: std::time::Duration,
    limit: i64,
) -> Result<u64, sqlx::Error> {
    let deleted = sqlx::query(
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
    Ok(deleted.rows_affected())
}
