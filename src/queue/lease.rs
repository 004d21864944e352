//! Claim and every write that the lease fence guards. See the module doc of
//! [`crate::queue`] for the guarantee.

use std::collections::HashMap;
use std::time::Duration;

use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::{Job, JobStatus, QueueError};

/// The result of a fenced write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced<T> {
    /// The caller still held the lease; the write happened.
    Held(T),
    /// The lease was lost (expired, reaped, or the job was claimed again);
    /// nothing was written.
    Lost,
}

impl<T> Fenced<T> {
    pub fn is_held(&self) -> bool {
        matches!(self, Fenced::Held(_))
    }
}

/// What to claim.
#[derive(Debug, Clone)]
pub struct Claim<'a> {
    /// Only these kinds (the handlers the caller has).
    pub kinds: &'a [String],
    /// At most this many: the caller's free slots, never more.
    pub limit: i64,
    pub lease: Duration,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// [`claim`]'s statement: `$1` kinds, `$2` limit, `$3` lease in milliseconds.
///
/// - Per kind, an ordered walk of `jobs_ready_kind_idx` that stops at the
///   limit; then the earliest across kinds. (One scan with `kind = ANY($1)`
///   would sort every ready row of those kinds.) Rows locked but not picked
///   are released when this one-statement transaction commits.
/// - Paused kinds ([`crate::control::pause`]) are not walked: two
///   primary-key probes of `almanac.kind_pauses` per kind.
/// - Kinds routed to the broker are not walked. A job still on the broker
///   route of a kind that is not (only between a route change and the
///   reconcile sweep after an enqueue under an older snapshot) is passed
///   over in the walk, taking no slot.
/// - The walk is a range of `jobs_ready_kind_idx`, `(kind, run_at, id)` from
///   `(k, -infinity, 0)` up to `(kind, run_at) = (k, now())`, with the
///   equivalent `kind = k AND run_at <= now()` beside it (the range alone
///   does not stop the scan at the first row past `now()`, only at the next
///   kind, so it read every future job of the kind): with the range, `ORDER
///   BY kind, run_at, id` is an order only that index gives, and a skewed
///   table (one kind's backlog, few rows of the others) cannot make the
///   planner walk `jobs_ready_due_idx` past other kinds' rows or sort the
///   kind's rows. The route is tested as `coalesce(route, '') <> 'broker'`
///   (`route` is never NULL): an expression without statistics, so the
///   share of broker rows in the whole table does not make the planner
///   expect a long walk.
/// - The update takes the picked ids as an array: primary-key lookups
///   whatever the estimates (the generic plan, not knowing the limit,
///   hash-joined a scan of the whole table).
///
/// Keep the text short: `pg_stat_activity` shows its first 1,024 bytes, and
/// tests find a waiting claim there by its `SKIP LOCKED`.
pub const CLAIM_SQL: &str = r#"
WITH picked AS (
    SELECT c.id FROM (
        SELECT u.kind FROM unnest($1::text[]) AS u(kind)
        WHERE NOT EXISTS (SELECT 1 FROM almanac.routes r WHERE r.kind = u.kind AND r.mode = 'broker')
          AND NOT EXISTS (SELECT 1 FROM almanac.kind_pauses p WHERE p.kind IN (u.kind, '*'))
    ) AS k
    CROSS JOIN LATERAL (
        SELECT id, run_at FROM almanac.jobs
        WHERE status = 'ready'
          AND (kind, run_at, id) >= (k.kind, '-infinity'::timestamptz, 0)
          AND (kind, run_at) <= (k.kind, now())
          AND kind = k.kind AND run_at <= now()
          AND coalesce(route, '') <> 'broker'
        ORDER BY kind, run_at, id
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    ) AS c
    ORDER BY c.run_at, c.id
    LIMIT $2
)
UPDATE almanac.jobs AS j
SET status = 'running',
    attempts = j.attempts + 1,
    lease_token = gen_random_uuid(),
    lease_until = clock_timestamp() + $3 * interval '1 millisecond'
WHERE j.id = ANY (ARRAY(SELECT id FROM picked))
RETURNING j.*
"#;

/// Claims due ready jobs in `(run_at, id)` order in one statement: rows locked
/// by a concurrent claim are skipped, not waited for. The cost depends on the
/// batch size and the number of kinds, not on how many jobs are waiting. Each job gets its own
/// fresh lease token. Jobs routed to the broker are left to broker consumers,
/// and a kind routed to the broker is not walked at all (a primary-key read
/// of `almanac.routes`): its ready jobs are the broker consumers' backlog, and
/// a worker polling past them on every NOTIFY would turn consumer lag into
/// database load. (A job of such a kind still on the `db` route, enqueued
/// under a snapshot older than the route change, waits for the relay's
/// reconcile sweep, which moves it to the broker.)
pub async fn claim<'e>(db: impl PgExecutor<'e>, claim: &Claim<'_>) -> Result<Vec<Job>, QueueError> {
    if claim.limit <= 0 || claim.kinds.is_empty() {
        return Ok(Vec::new());
    }
    let jobs = sqlx::query_as::<_, Job>(CLAIM_SQL)
        .bind(claim.kinds)
        .bind(claim.limit)
        .bind(millis(claim.lease))
        .fetch_all(db)
        .await?;
    Ok(jobs)
}

/// What a broker consumer's claim of one job found.
#[derive(Debug)]
pub enum ClaimById {
    /// The job is this consumer's to run now, under the returned lease.
    Claimed(Box<Job>),
    /// The job is due and waits for a consumer, but its kind is not one this
    /// consumer runs: the message must not be acknowledged (another
    /// consumer, or this one's operator, has to act).
    OtherKind(String),
    /// The job is due and of a kind this consumer runs, but the kind is
    /// paused: hold the message, unacknowledged, until it is resumed.
    Paused(String),
    /// Someone else claimed it first, it finished, it is not due, or it left
    /// the broker route: the message is done with (acked and skipped).
    Skip,
}

/// Claims one job by id for a broker consumer, through the same fence as
/// [`claim`]: only a due `ready` job of a handled kind on a `dual` or
/// `broker` route, of a kind not paused. A job that would be claimable but
/// for its kind, or for a pause, is told apart ([`ClaimById::OtherKind`],
/// [`ClaimById::Paused`]), never skipped.
pub async fn claim_by_id(
    db: &mut PgConnection,
    id: i64,
    kinds: &[String],
    lease: Duration,
) -> Result<ClaimById, QueueError> {
    let claimed = sqlx::query_as::<_, Job>(
        r#"
        UPDATE almanac.jobs
        SET status = 'running',
            attempts = attempts + 1,
            lease_token = gen_random_uuid(),
            lease_until = clock_timestamp() + $3 * interval '1 millisecond'
        WHERE id = $1 AND status = 'ready' AND run_at <= now() AND kind = ANY($2)
          AND route IN ('dual', 'broker')
          AND NOT EXISTS (SELECT 1 FROM almanac.kind_pauses p WHERE p.kind IN (almanac.jobs.kind, '*'))
        RETURNING *
        "#,
    )
    .bind(id)
    .bind(kinds)
    .bind(millis(lease))
    .fetch_optional(&mut *db)
    .await?;
    if let Some(job) = claimed {
        return Ok(ClaimById::Claimed(Box::new(job)));
    }
    // Not claimed: was it only the kind, or a pause? (A primary-key read,
    // on misses only.)
    let waiting: Option<(String, bool)> = sqlx::query_as(
        r#"
        SELECT kind, EXISTS (SELECT 1 FROM almanac.kind_pauses p WHERE p.kind IN (j.kind, '*'))
        FROM almanac.jobs j
        WHERE id = $1 AND status = 'ready' AND run_at <= now() AND route IN ('dual', 'broker')
        "#,
    )
    .bind(id)
    .fetch_optional(db)
    .await?;
    Ok(match waiting {
        Some((kind, _)) if !kinds.contains(&kind) => ClaimById::OtherKind(kind),
        Some((kind, true)) => ClaimById::Paused(kind),
        // Claimed, finished or made ready-not-due since the update looked.
        _ => ClaimById::Skip,
    })
}

/// Marks one job done if its lease is still held and unexpired (waiting
/// for its row if another transaction holds it).
pub async fn complete<'e>(
    db: impl PgExecutor<'e>,
    id: i64,
    token: Uuid,
) -> Result<Fenced<()>, QueueError> {
    let done = sqlx::query(
        r#"
        UPDATE almanac.jobs
        SET status = 'done', lease_token = NULL, lease_until = NULL, finished_at = clock_timestamp()
        WHERE id = $1 AND lease_token = $2 AND lease_until > clock_timestamp()
        "#,
    )
    .bind(id)
    .bind(token)
    .execute(db)
    .await?;
    Ok(if done.rows_affected() == 1 {
        Fenced::Held(())
    } else {
        Fenced::Lost
    })
}

/// What a batched fenced write did with each lease of its batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Written {
    /// Written: the lease was held.
    pub ids: Vec<i64>,
    /// Not written because another transaction held the job's row at that
    /// moment (the lease looked held): try again. Ids in neither list lost
    /// their lease.
    pub busy: Vec<i64>,
    /// Leases in either list whose job an operator asked to cancel (filled
    /// by [`heartbeat_many`]): the holder stops their handlers, so a lost
    /// `NOTIFY` still stops them within one renewal.
    pub cancels: Vec<super::CancelRequest>,
}

/// Marks a batch done; returns the ids whose lease was held. The others
/// were lost and are left as they are, or their rows were busy.
///
/// The batched fenced writes (this, [`heartbeat_many`], [`release`]) match
/// on the token alone, without `status = 'running'`: a row holds a token
/// only while it is running (a CHECK constraint), so the fence is the same,
/// and without the status the planner cannot pick the partial index of
/// running rows. It did, for a generic plan: a walk of every running row
/// (and every dead index entry of rows that were running) for each id in
/// the batch, three times the cost of primary-key lookups at 100 in flight,
/// and growing with the backlog.
///
/// **One locked row never holds up the batch.** The plain statement runs
/// first (no row-lock records: the cheapest write); when it gives up
/// waiting for a row lock (`lock_timeout` on the connection, which the
/// worker keeps short), the batch is written again skipping locked rows,
/// which come back as [`Written::busy`].
pub async fn complete_many(
    conn: &mut PgConnection,
    leases: &[(i64, Uuid)],
) -> Result<Written, QueueError> {
    if leases.is_empty() {
        return Ok(Written::default());
    }
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = leases.iter().copied().unzip();
    let plain = sqlx::query_scalar(
        r#"
        UPDATE almanac.jobs AS j
        SET status = 'done', lease_token = NULL, lease_until = NULL, finished_at = clock_timestamp()
        FROM unnest($1::bigint[], $2::uuid[]) AS c(id, token)
        WHERE j.id = c.id AND j.lease_token = c.token
          AND j.lease_until > clock_timestamp()
        RETURNING j.id
        "#,
    )
    .bind(&ids)
    .bind(&tokens)
    .fetch_all(&mut *conn)
    .await;
    match plain {
        Ok(ids) => Ok(Written {
            ids,
            ..Written::default()
        }),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
            skipping_locked(conn, COMPLETE_SKIPPING_LOCKED, &ids, &tokens, None).await
        }
        Err(e) => Err(e.into()),
    }
}

/// `lock_not_available`: a lock wait ran past `lock_timeout`.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// [`complete_many`]'s write when a row was busy.
const COMPLETE_SKIPPING_LOCKED: &str =
    "SET status = 'done', lease_token = NULL, lease_until = NULL, finished_at = clock_timestamp()";
/// [`heartbeat_many`]'s write (`$3`: the lease in milliseconds).
const RENEW: &str = "SET lease_until = clock_timestamp() + $3 * interval '1 millisecond'";

/// A batched fenced write that skips rows another transaction holds:
/// `set` is the `SET` clause. The leases held when the statement started
/// and not written are the busy ones (one that was lost meanwhile shows as
/// busy once, then as lost).
async fn skipping_locked(
    conn: &mut PgConnection,
    set: &str,
    ids: &[i64],
    tokens: &[Uuid],
    lease: Option<i64>,
) -> Result<Written, QueueError> {
    let sql = format!(
        r#"
        WITH c AS MATERIALIZED (
            SELECT * FROM unnest($1::bigint[], $2::uuid[]) AS c(id, token)
        ), locked AS MATERIALIZED (
            SELECT j.id FROM almanac.jobs j JOIN c ON j.id = c.id AND j.lease_token = c.token
            WHERE j.lease_until > clock_timestamp()
            FOR NO KEY UPDATE OF j SKIP LOCKED
        ), written AS (
            UPDATE almanac.jobs AS j {set}
            WHERE j.id = ANY (ARRAY(SELECT id FROM locked))
            RETURNING j.id
        )
        SELECT c.id, c.id IN (SELECT id FROM written),
               j.cancel_requested_at IS NOT NULL, j.cancelled_by, j.cancel_reason
        FROM c JOIN almanac.jobs j ON j.id = c.id AND j.lease_token = c.token
        WHERE j.lease_until > clock_timestamp() OR c.id IN (SELECT id FROM written)
        "#
    );
    type Row = (i64, bool, bool, Option<String>, Option<String>);
    let mut query = sqlx::query_as::<_, Row>(&sql).bind(ids).bind(tokens);
    if let Some(lease) = lease {
        query = query.bind(lease);
    }
    let rows = query.fetch_all(conn).await?;
    let mut out = Written::default();
    for (id, written, requested, by, reason) in rows {
        if written {
            out.ids.push(id);
        } else {
            out.busy.push(id);
        }
        if requested {
            out.cancels.push(super::CancelRequest { id, by, reason });
        }
    }
    Ok(out)
}

/// Why an attempt failed.
#[derive(Debug, Clone)]
pub enum Failure {
    /// Try again after `delay`, unless the attempts are used up.
    Retry { delay: Duration, error: String },
    /// Never try again.
    Permanent { error: String },
}

impl Failure {
    /// The message kept in `last_error`.
    pub fn error(&self) -> &str {
        match self {
            Failure::Retry { error, .. } | Failure::Permanent { error } => error,
        }
    }
}

/// Records a failed attempt under the fence: `ready` again after the delay,
/// or `dead` when the failure is permanent or `attempts >= max_attempts`,
/// or `cancelled` when an operator asked for the job to stop.
/// `last_error` keeps the message either way. Returns the new status.
pub async fn fail<'e>(
    db: impl PgExecutor<'e>,
    id: i64,
    token: Uuid,
    failure: &Failure,
) -> Result<Fenced<JobStatus>, QueueError> {
    let (permanent, delay, error) = match failure {
        Failure::Retry { delay, error } => (false, *delay, error),
        Failure::Permanent { error } => (true, Duration::ZERO, error),
    };
    let status: Option<(JobStatus,)> = sqlx::query_as(
        r#"
        UPDATE almanac.jobs
        SET status = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled'
                          WHEN $3 OR attempts >= max_attempts THEN 'dead' ELSE 'ready' END,
            run_at = CASE WHEN cancel_requested_at IS NOT NULL OR $3 OR attempts >= max_attempts THEN run_at
                          ELSE clock_timestamp() + $4 * interval '1 millisecond' END,
            finished_at = CASE WHEN cancel_requested_at IS NOT NULL OR $3 OR attempts >= max_attempts
                               THEN clock_timestamp() END,
            route = CASE WHEN cancel_requested_at IS NOT NULL OR $3 OR attempts >= max_attempts THEN route
                         ELSE almanac.route_of(kind) END,
            last_error = $5,
            lease_token = NULL,
            lease_until = NULL
        WHERE id = $1 AND status = 'running' AND lease_token = $2
        RETURNING status
        "#,
    )
    .bind(id)
    .bind(token)
    .bind(permanent)
    .bind(millis(delay))
    .bind(super::storable(error))
    .fetch_optional(db)
    .await?;
    Ok(match status {
        Some((status,)) => Fenced::Held(status),
        None => Fenced::Lost,
    })
}

/// Extends every held, unexpired lease in the batch to `now + lease`.
/// [`Written::ids`] were extended; a lease in neither list was lost, and its
/// handler should stop. A row another transaction holds is skipped
/// ([`Written::busy`]) instead of holding up every other renewal: its lease
/// is still held, and the next renewal tries again.
pub async fn heartbeat_many(
    conn: &mut PgConnection,
    leases: &[(i64, Uuid)],
    lease: Duration,
) -> Result<Written, QueueError> {
    if leases.is_empty() {
        return Ok(Written::default());
    }
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = leases.iter().copied().unzip();
    skipping_locked(conn, RENEW, &ids, &tokens, Some(millis(lease))).await
}

/// Gives held leases back: the jobs are `ready` and due at once, or `dead`
/// when their attempts are used up (the attempt that was cut short counts),
/// so a job that always outlives a shutdown ends dead instead of looping past
/// `max_attempts`. `reason` becomes `last_error`; a buried job's says why it
/// is dead; a job an operator asked to cancel is `cancelled`. Returns each
/// released id with its new status. Used at shutdown
/// for handlers that did not finish in time.
pub async fn release<'e>(
    db: impl PgExecutor<'e>,
    leases: &[(i64, Uuid)],
    reason: &str,
) -> Result<Vec<(i64, JobStatus)>, QueueError> {
    if leases.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = leases.iter().copied().unzip();
    let released: Vec<(i64, JobStatus)> = sqlx::query_as(
        r#"
        UPDATE almanac.jobs AS j
        SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                          WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'ready' END,
            run_at = CASE WHEN j.cancel_requested_at IS NOT NULL OR j.attempts >= j.max_attempts
                          THEN j.run_at ELSE clock_timestamp() END,
            finished_at = CASE WHEN j.cancel_requested_at IS NOT NULL OR j.attempts >= j.max_attempts
                               THEN clock_timestamp() END,
            route = CASE WHEN j.cancel_requested_at IS NOT NULL OR j.attempts >= j.max_attempts
                         THEN j.route ELSE almanac.route_of(j.kind) END,
            last_error = CASE WHEN j.cancel_requested_at IS NULL AND j.attempts >= j.max_attempts
                THEN format('%s; that was attempt %s of %s, so the job is dead',
                            $3::text, j.attempts, j.max_attempts)
                ELSE $3 END,
            lease_token = NULL,
            lease_until = NULL
        FROM unnest($1::bigint[], $2::uuid[]) AS r(id, token)
        WHERE j.id = r.id AND j.lease_token = r.token AND j.lease_until IS NOT NULL
        RETURNING j.id, j.status
        "#,
    )
    .bind(&ids)
    .bind(&tokens)
    .bind(super::storable(reason))
    .fetch_all(db)
    .await?;
    Ok(released)
}

/// Hands back a job that was claimed but never started (its claimant is
/// shutting down): `ready` at once with the attempt the claim took restored,
/// so a job is never buried for attempts it did not get to run (`cancelled`
/// instead, if an operator asked for that meanwhile). Under the fence;
/// returns whether the lease was still held.
pub async fn unclaim<'e>(
    db: impl PgExecutor<'e>,
    id: i64,
    token: Uuid,
) -> Result<bool, QueueError> {
    let unclaimed = sqlx::query(
        r#"
        UPDATE almanac.jobs
        SET status = CASE WHEN cancel_requested_at IS NULL THEN 'ready' ELSE 'cancelled' END,
            attempts = greatest(attempts - 1, 0),
            run_at = CASE WHEN cancel_requested_at IS NULL THEN clock_timestamp() ELSE run_at END,
            finished_at = CASE WHEN cancel_requested_at IS NOT NULL THEN clock_timestamp() END,
            route = almanac.route_of(kind), lease_token = NULL, lease_until = NULL
        WHERE id = $1 AND status = 'running' AND lease_token = $2
        "#,
    )
    .bind(id)
    .bind(token)
    .execute(db)
    .await?;
    Ok(unclaimed.rows_affected() == 1)
}

/// The current status of each job that exists among `ids`: how the executor
/// tells whether a write whose answer was lost had committed.
pub async fn statuses<'e>(
    db: impl PgExecutor<'e>,
    ids: &[i64],
) -> Result<HashMap<i64, JobStatus>, QueueError> {
    let rows: Vec<(i64, JobStatus)> =
        sqlx::query_as("SELECT id, status FROM almanac.jobs WHERE id = ANY($1)")
            .bind(ids)
            .fetch_all(db)
            .await?;
    Ok(rows.into_iter().collect())
}

/// What one reaper batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReapReport {
    /// Expired leases returned to `ready`.
    pub requeued: u64,
    /// Expired leases whose attempts were used up, now `dead`.
    pub buried: u64,
    /// Expired leases of jobs an operator asked to cancel, now `cancelled`
    /// (their holder is gone, or stalled past its lease).
    pub cancelled: u64,
}

/// Takes back at most `limit` expired leases in one short statement; rows
/// another reaper holds are skipped. A job with a cancel request is finished
/// as `cancelled`, never made ready again.
pub async fn reap_expired<'e>(
    db: impl PgExecutor<'e>,
    limit: i64,
) -> Result<ReapReport, QueueError> {
    let rows: Vec<(JobStatus,)> = sqlx::query_as(
        r#"
        WITH expired AS (
            SELECT id FROM almanac.jobs
            WHERE status = 'running' AND lease_until < clock_timestamp()
            ORDER BY lease_until
            LIMIT $1
            FOR UPDATE SKIP LOCKED
        )
        UPDATE almanac.jobs AS j
        SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                          WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'ready' END,
            run_at = CASE WHEN j.cancel_requested_at IS NOT NULL OR j.attempts >= j.max_attempts
                          THEN j.run_at ELSE clock_timestamp() END,
            finished_at = CASE WHEN j.cancel_requested_at IS NOT NULL OR j.attempts >= j.max_attempts
                               THEN clock_timestamp() END,
            route = CASE WHEN j.cancel_requested_at IS NOT NULL OR j.attempts >= j.max_attempts
                         THEN j.route ELSE almanac.route_of(j.kind) END,
            last_error = format('lease expired during attempt %s of %s (worker died or stalled)',
                                j.attempts, j.max_attempts),
            lease_token = NULL,
            lease_until = NULL
        FROM expired
        WHERE j.id = expired.id
        RETURNING j.status
        "#,
    )
    .bind(limit)
    .fetch_all(db)
    .await?;
    let mut report = ReapReport::default();
    for (status,) in rows {
        match status {
            JobStatus::Dead => report.buried += 1,
            JobStatus::Cancelled => report.cancelled += 1,
            _ => report.requeued += 1,
        }
    }
    Ok(report)
}
