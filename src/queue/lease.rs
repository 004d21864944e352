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

/// A kind's due jobs in claim order, at most `$limit` ($lock: the row
/// locks to take; `$key`: an expression of the job `j` to return beside
/// its id and order): the walk of `jobs_ready_kind_idx` in `(run_at, id)`
/// order, and one walk per priority of `jobs_ready_priority_idx` (only
/// when the kind has a ready job with a priority: one probe otherwise),
/// ordered by `run_at - priority * PRIORITY_STEP`. The first `n` of that
/// order are always among the first `n` of the walks: a job of priority 0
/// is ordered by its due time, which no job due before it exceeds, and a
/// job of priority p comes after every job of priority p due before it.
macro_rules! due_walk {
    ($limit:literal, $lock:literal, $key:literal) => {
        concat!(
            "SELECT w.id, w.run_at - w.priority * interval '5 minutes' AS ord, w.key FROM (
        SELECT * FROM (SELECT j.id, j.run_at, j.priority, ", $key, " AS key FROM almanac.jobs j
        WHERE j.status = 'ready'
          AND (j.kind, j.run_at, j.id) >= (k.kind, '-infinity'::timestamptz, 0)
          AND (j.kind, j.run_at) <= (k.kind, now())
          AND j.kind = k.kind AND j.run_at <= now() AND coalesce(j.route, '') <> 'broker'
        ORDER BY j.kind, j.run_at, j.id LIMIT ", $limit, " ", $lock, ") AS d
        UNION
        SELECT p.* FROM generate_series(1, 9) AS lv(n) CROSS JOIN LATERAL (
            SELECT j.id, j.run_at, j.priority, ", $key, " AS key FROM almanac.jobs j
            WHERE j.status = 'ready' AND j.priority > 0
              AND (j.kind, j.priority, j.run_at, j.id) >= (k.kind, lv.n::smallint, '-infinity'::timestamptz, 0)
              AND (j.kind, j.priority, j.run_at) <= (k.kind, lv.n::smallint, now())
              AND j.kind = k.kind AND j.priority = lv.n AND j.run_at <= now()
              AND coalesce(j.route, '') <> 'broker'
            ORDER BY j.kind, j.priority, j.run_at, j.id LIMIT ", $limit, " ", $lock, ") AS p
        WHERE EXISTS (SELECT 1 FROM almanac.jobs e
                      WHERE e.status = 'ready' AND e.priority > 0 AND e.kind = k.kind)
    ) AS w ORDER BY ord, w.id LIMIT ", $limit
        )
    };
}

/// What every claim writes on a job it takes (`$3`: the lease in
/// milliseconds): running, one more attempt, a fresh lease token.
macro_rules! claim_set {
    () => {
        "SET status = 'running', attempts = attempts + 1, lease_token = gen_random_uuid(),
        lease_until = clock_timestamp() + $3 * interval '1 millisecond'"
    };
}

/// A kind's first `$window` due jobs (see [`due_walk`]) with the per-key
/// verdict on each (`ok`): whether its key has a free slot, counting the
/// running jobs of the key (`k.key_running`) and the jobs of the key
/// before it in the window (see [`CLAIM_SQL`]).
macro_rules! keyed_walk {
    ($window:literal, $lock:literal) => {
        concat!(
            "
        SELECT c.id, c.ord,
               row_number() OVER (PARTITION BY c.key ORDER BY c.ord, c.id)
               + coalesce((k.key_running ->> coalesce('v' || c.key, 'n'))::bigint, 0)
               <= k.per_key_limit AS ok
        FROM (",
            due_walk!($window, $lock, "j.payload #>> k.key_path"),
            ") AS c
    "
        )
    };
}

/// How much waiting one step of priority is worth: a due job of priority
/// p is claimed as if it had become due `p * PRIORITY_STEP` earlier. So a
/// job is never passed by a job of its kind that became due more than
/// `(9 - its priority) * PRIORITY_STEP` after it (45 minutes for priority
/// 0): the bound on starvation. (The literal in [`CLAIM_SQL`] is this.)
pub const PRIORITY_STEP: Duration = Duration::from_secs(5 * 60);

/// How many due jobs a claim looks at, per kind with a per-key limit, to
/// find ones whose key has a free slot: when the first this many all
/// belong to keys at their limit, the claim takes none of the kind.
pub const PER_KEY_WINDOW: i64 = 1000;

/// [`claim`]'s statement: `$1` kinds, `$2` limit, `$3` lease in milliseconds.
///
/// - First the kinds' budgets ([`super::limits`]): `almanac.claim_budgets`
///   locks the limits of the limited kinds among `$1` and says how many of
///   each this claim may start (`$2` for an unlimited kind).
/// - Per kind, an ordered walk of its due jobs that stops at its budget
///   ([`due_walk`]); then the earliest across kinds. (One scan with `kind
///   = ANY($1)` would sort every ready row of those kinds.) Rows locked
///   but not picked are released when this one-statement transaction
///   commits.
/// - A kind with a per-key limit that no key can reach in this claim (its
///   running jobs plus `$2` within the per-key limit: `key_running` is
///   NULL) is walked as if it had none. Otherwise its walk over its budget
///   of due jobs locks them as above and keeps those whose key has a free
///   slot (counting the key's running jobs and its jobs before them in the
///   walk). When that drops any, the kind is walked again, without locks,
///   over its first [`PER_KEY_WINDOW`] due jobs; the ones picked from that
///   are then locked, skipping locked rows, and re-checked on their latest
///   version (ready, due, not on the broker route: a job that failed and
///   was made due later since this statement's snapshot is not taken).
///   Claims of a limited kind run one at a time (the budget's lock), so
///   nothing races the unlocked walk but the writes of other roles, which
///   the lock step skips.
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
///   planner sort the kind's rows (or, before migration 0126 dropped it,
///   walk `jobs_ready_due_idx` past other kinds' rows). The route is
///   tested as `coalesce(route, '') <> 'broker'` (`route` is never
///   NULL): an expression without statistics, so the share of broker rows
///   in the whole table does not make the planner expect a long walk.
/// - The update takes the picked ids as an array: primary-key lookups
///   whatever the estimates (the generic plan, not knowing the limit,
///   hash-joined a scan of the whole table).
/// - A rate-limited kind's bucket is charged in the same statement.
/// - The cost of priorities: while a kind has ready jobs of a priority above
///   0, each of its walks locks up to its budget per priority present, and
///   keeps the rows it does not pick locked until the claim commits (a
///   concurrent claim skips them for that long).
///
/// `pg_stat_activity` shows the first 1,024 bytes of a statement, and
/// tests find a waiting claim there by its `SKIP LOCKED`: it comes first.
pub const CLAIM_SQL: &str = concat!(
    "/* claim: FOR UPDATE SKIP LOCKED */
WITH b AS MATERIALIZED (
    SELECT * FROM almanac.claim_budgets($1::text[], $2::bigint)
), k AS (
    SELECT b.* FROM b
    WHERE b.budget > 0
      AND NOT EXISTS (SELECT 1 FROM almanac.routes r WHERE r.kind = b.kind AND r.mode = 'broker')
      AND NOT EXISTS (SELECT 1 FROM almanac.kind_pauses p WHERE p.kind IN (b.kind, '*'))
), walked AS (
    SELECT k.kind, c.id, c.ord FROM k CROSS JOIN LATERAL (",
    due_walk!("k.budget", "FOR UPDATE SKIP LOCKED", "NULL::text"),
    "
    ) AS c WHERE k.key_running IS NULL
), keyed_first AS (
    SELECT k.kind, c.id, c.ord, c.ok FROM k CROSS JOIN LATERAL (",
    keyed_walk!("k.budget", "FOR UPDATE SKIP LOCKED"),
    ") AS c WHERE k.key_running IS NOT NULL
), short AS (
    SELECT DISTINCT y.kind FROM keyed_first y WHERE NOT y.ok
), keyed_more AS (
    SELECT k.kind, c.id, c.ord FROM k JOIN short USING (kind) CROSS JOIN LATERAL (
        SELECT c.id, c.ord FROM (",
    keyed_walk!("1000", ""),
    ") AS c WHERE c.ok ORDER BY c.ord, c.id LIMIT k.budget
    ) AS c
), keyed AS (
    SELECT y.kind, y.id, y.ord FROM keyed_first y WHERE y.ok AND y.kind NOT IN (SELECT kind FROM short)
    UNION ALL
    SELECT y.kind, y.id, y.ord FROM keyed_more y
    WHERE y.id IN (SELECT j.id FROM almanac.jobs j
                   WHERE j.id IN (SELECT id FROM keyed_more) AND j.status = 'ready'
                     AND j.run_at <= now() AND coalesce(j.route, '') <> 'broker'
                   FOR UPDATE SKIP LOCKED)
), picked AS (
    SELECT kind, id FROM (SELECT * FROM walked UNION ALL SELECT * FROM keyed) AS p
    ORDER BY ord, id LIMIT $2
), claimed AS (
    UPDATE almanac.jobs AS j ",
    claim_set!(),
    "
    WHERE j.id = ANY (ARRAY(SELECT id FROM picked))
    RETURNING j.*
), charged AS (
    UPDATE almanac.kind_limits AS l SET tokens = b.tokens - c.n, refilled_at = b.at
    FROM b JOIN (SELECT kind, count(*) AS n FROM claimed GROUP BY kind) AS c ON c.kind = b.kind
    WHERE l.kind = b.kind AND b.tokens IS NOT NULL
)
SELECT * FROM claimed
"
);

/// Claims due ready jobs in one statement, earliest first by `run_at -
/// priority * PRIORITY_STEP` (so `(run_at, id)` order among jobs of one
/// priority; see [`PRIORITY_STEP`] for the bound on waiting): rows locked
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
    // No claim starts more than 2^31 jobs; the budget's arithmetic stays
    // far from overflow whatever the caller passes.
    let jobs = sqlx::query_as::<_, Job>(CLAIM_SQL)
        .bind(claim.kinds)
        .bind(claim.limit.min(i64::from(i32::MAX)))
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
    /// The job is due and of a kind this consumer runs, but starting it
    /// now would break one of its kind's limits ([`super::limits`]): hold
    /// the message, unacknowledged, and try again shortly.
    Limited(String),
    /// Someone else claimed it first, it finished, it is not due, or it left
    /// the broker route: the message is done with (acked and skipped).
    Skip,
}

/// Claims one job by id for a broker consumer, through the same fence as
/// [`claim`]: only a due `ready` job of a handled kind on a `dual` or
/// `broker` route, of a kind not paused, within its kind's limits. A job
/// that would be claimable but for its kind, a pause or a limit is told
/// apart ([`ClaimById::OtherKind`], [`ClaimById::Paused`],
/// [`ClaimById::Limited`]), never skipped.
pub async fn claim_by_id(
    db: &mut PgConnection,
    id: i64,
    kinds: &[String],
    lease: Duration,
) -> Result<ClaimById, QueueError> {
    let claimed = sqlx::query_as::<_, Job>(concat!(
        "UPDATE almanac.jobs ",
        claim_set!(),
        r#"
        WHERE id = $1 AND status = 'ready' AND run_at <= now() AND kind = ANY($2)
          AND route IN ('dual', 'broker')
          AND NOT EXISTS (SELECT 1 FROM almanac.kind_pauses p WHERE p.kind IN (almanac.jobs.kind, '*'))
          AND NOT EXISTS (SELECT 1 FROM almanac.kind_limits l WHERE l.kind = almanac.jobs.kind)
        RETURNING *
        "#
    ))
    .bind(id)
    .bind(kinds)
    .bind(millis(lease))
    .fetch_optional(&mut *db)
    .await?;
    if let Some(job) = claimed {
        return Ok(ClaimById::Claimed(Box::new(job)));
    }
    // Not claimed: was it only the kind, a pause, or a limit? (Primary-key
    // reads, on misses only.)
    let waiting: Option<(String, bool, bool)> = sqlx::query_as(
        r#"
        SELECT kind, EXISTS (SELECT 1 FROM almanac.kind_pauses p WHERE p.kind IN (j.kind, '*')),
               EXISTS (SELECT 1 FROM almanac.kind_limits l WHERE l.kind = j.kind)
        FROM almanac.jobs j
        WHERE id = $1 AND status = 'ready' AND run_at <= now() AND route IN ('dual', 'broker')
        "#,
    )
    .bind(id)
    .fetch_optional(&mut *db)
    .await?;
    Ok(match waiting {
        Some((kind, _, _)) if !kinds.contains(&kind) => ClaimById::OtherKind(kind),
        Some((kind, true, _)) => ClaimById::Paused(kind),
        Some((kind, false, true)) => match claim_limited_by_id(db, id, &kind, lease).await? {
            Some(job) => ClaimById::Claimed(Box::new(job)),
            None => ClaimById::Limited(kind),
        },
        // Claimed, finished or made ready-not-due since the update looked.
        _ => ClaimById::Skip,
    })
}

/// [`claim_by_id`] of a job of a limited kind: within the budget
/// `almanac.claim_budgets` gives (the kind's limits locked until this
/// statement commits, as a [`claim`]'s are), and for a per-key limit only
/// if the job's key has a free slot; a rate-limited kind's bucket is
/// charged. `None`: the job must wait for a slot or a token (or it was
/// taken, or its limit removed, since: the next try tells).
async fn claim_limited_by_id(
    db: &mut PgConnection,
    id: i64,
    kind: &str,
    lease: Duration,
) -> Result<Option<Job>, QueueError> {
    let job = sqlx::query_as::<_, Job>(concat!(
        r#"
        WITH b AS MATERIALIZED (
            SELECT * FROM almanac.claim_budgets(ARRAY[$2::text], 1)
        ), claimed AS (
            UPDATE almanac.jobs AS j "#,
        claim_set!(),
        r#"
            FROM b
            WHERE j.id = $1 AND j.kind = b.kind AND j.status = 'ready' AND j.run_at <= now()
              AND j.route IN ('dual', 'broker') AND b.limited AND b.budget > 0
              AND j.id IN (SELECT l.id FROM almanac.jobs l WHERE l.id = $1 FOR UPDATE SKIP LOCKED)
              AND NOT EXISTS (SELECT 1 FROM almanac.kind_pauses p WHERE p.kind IN (j.kind, '*'))
              AND (b.per_key_limit IS NULL
                   OR coalesce((b.key_running ->> coalesce('v' || (j.payload #>> b.key_path), 'n'))::bigint, 0)
                      < b.per_key_limit)
            RETURNING j.*
        ), charged AS (
            UPDATE almanac.kind_limits AS l SET tokens = b.tokens - 1, refilled_at = b.at
            FROM b
            WHERE l.kind = b.kind AND b.tokens IS NOT NULL AND EXISTS (SELECT 1 FROM claimed)
        )
        SELECT * FROM claimed
        "#
    ))
    .bind(id)
    .bind(kind)
    .bind(millis(lease))
    .fetch_optional(&mut *db)
    .await?;
    Ok(job)
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
    Ok(complete_batch(conn, leases, None).await?.0)
}

/// [`complete_many`], and the jobs its completions released ([`super::ordering`])
/// claimed for the caller, a worker of `kinds`, under a lease of `lease`
/// when its claim would take them anyway: no due job of those kinds waits
/// (`almanac.complete_claiming`, migration 0130). At
/// most one per completed job, so the caller runs each in the slot of the
/// job whose completion released it. The claim's fence is the claim's: each
/// gets a lease token of its own, derived from its predecessor's. A
/// statement that got no answer may have claimed jobs nobody runs: the
/// retry that finds the completion written gives them back
/// ([`unclaim_successors`]); should that fail too, their leases expire and
/// the reaper takes them back, an attempt spent, as after a claim whose
/// answer was lost.
pub async fn complete_many_claiming(
    conn: &mut PgConnection,
    leases: &[(i64, Uuid)],
    lease: Duration,
    kinds: &[String],
) -> Result<(Written, Vec<Job>), QueueError> {
    complete_batch(conn, leases, Some((lease, kinds))).await
}

async fn complete_batch(
    conn: &mut PgConnection,
    leases: &[(i64, Uuid)],
    claiming: Option<(Duration, &[String])>,
) -> Result<(Written, Vec<Job>), QueueError> {
    if leases.is_empty() {
        return Ok((Written::default(), Vec::new()));
    }
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = leases.iter().copied().unzip();
    let plain = match claiming {
        None => sqlx::query_scalar(
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
        .await
        .map(|ids| (ids, Vec::new())),
        Some((lease, kinds)) => sqlx::query_as::<_, Job>(
            "SELECT * FROM almanac.complete_claiming($1::bigint[], $2::uuid[], $3::bigint, $4::text[])",
        )
        .bind(&ids)
        .bind(&tokens)
        .bind(millis(lease))
        .bind(kinds)
        .fetch_all(&mut *conn)
        .await
        .map(|rows| {
            let (done, claimed): (Vec<Job>, Vec<Job>) =
                rows.into_iter().partition(|j| j.status == JobStatus::Done);
            (done.into_iter().map(|j| j.id).collect(), claimed)
        }),
    };
    match plain {
        Ok((ids, claimed)) => Ok((
            Written {
                ids,
                ..Written::default()
            },
            claimed,
        )),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
            let written =
                skipping_locked(conn, COMPLETE_SKIPPING_LOCKED, &ids, &tokens, None).await?;
            Ok((written, Vec::new()))
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

/// What an unclaim writes ([`unclaim`], [`unclaim_successors`]): `ready`
/// at once with the claim's attempt given back, or `cancelled` if an
/// operator asked for that meanwhile.
macro_rules! unclaim_set {
    () => {
        "SET status = CASE WHEN cancel_requested_at IS NULL THEN 'ready' ELSE 'cancelled' END,
            attempts = greatest(attempts - 1, 0),
            run_at = CASE WHEN cancel_requested_at IS NULL THEN clock_timestamp() ELSE run_at END,
            finished_at = CASE WHEN cancel_requested_at IS NOT NULL THEN clock_timestamp() END,
            route = almanac.route_of(kind), lease_token = NULL, lease_until = NULL"
    };
}

/// Hands back a job that was claimed but never started (its claimant is
/// shutting down): `ready` at once with the attempt the claim took restored,
/// so a job is never buried for attempts it did not get to run (`cancelled`
/// instead, if an operator asked for that meanwhile). Under the fence; its
/// kind is notified, as [`unclaim_many`] does; returns whether the lease was
/// still held.
pub async fn unclaim<'e>(
    db: impl PgExecutor<'e>,
    id: i64,
    token: Uuid,
) -> Result<bool, QueueError> {
    Ok(unclaim_many(db, &[(id, token)]).await? == 1)
}

/// An unclaim ([`unclaim_set`]) of the running jobs that `$matching` picks,
/// notifying their kinds; the statement returns how many it gave back.
macro_rules! unclaim_notifying {
    ($matching:literal) => {
        concat!(
            "WITH given AS (UPDATE almanac.jobs ",
            unclaim_set!(),
            " WHERE status = 'running' AND ",
            $matching,
            " RETURNING kind
            ), told AS (
                SELECT pg_notify('almanac_jobs', d.kind) FROM (SELECT DISTINCT kind FROM given) AS d
            )
            SELECT (SELECT count(*) FROM given), (SELECT count(*) FROM told)"
        )
    };
}

/// [`unclaim`] for many leases in one statement, the kinds given back
/// notified (other workers claim them at once, not at their next poll).
/// Returns how many leases were still held.
pub async fn unclaim_many<'e>(
    db: impl PgExecutor<'e>,
    leases: &[(i64, Uuid)],
) -> Result<u64, QueueError> {
    let (ids, tokens): (Vec<i64>, Vec<Uuid>) = leases.iter().copied().unzip();
    let (given, _notified): (i64, i64) = sqlx::query_as(unclaim_notifying!(
        "(id, lease_token) IN (SELECT c.id, c.token FROM unnest($1::bigint[], $2::uuid[]) AS c(id, token))"
    ))
    .bind(&ids)
    .bind(&tokens)
    .fetch_one(db)
    .await?;
    Ok(u64::try_from(given).unwrap_or(0))
}

/// Gives back, as [`unclaim_many`] does, the jobs that completions of the
/// leases `completed` claimed ([`complete_many_claiming`]) when the
/// completions' answer was lost: nobody runs them, and their leases would
/// otherwise hold their keys, and cost them an attempt, until the reaper
/// took them back. Such a job's token is derived from its predecessor's
/// (migration 0130). Returns how many.
pub async fn unclaim_successors<'e>(
    db: impl PgExecutor<'e>,
    completed: &[Uuid],
) -> Result<u64, QueueError> {
    let (given, _notified): (i64, i64) = sqlx::query_as(unclaim_notifying!(
        "lease_token = ANY (ARRAY(SELECT md5(t::text || ':next')::uuid FROM unnest($1::uuid[]) AS t))"
    ))
    .bind(completed)
    .fetch_one(db)
    .await?;
    Ok(u64::try_from(given).unwrap_or(0))
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
    /// Held jobs made ready by the sweep of ordering keys whose head ended
    /// while the key was busy ([`super::ordering::recheck`]).
    pub released: u64,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The claim's literals are the constants its docs name.
    #[test]
    fn the_claim_uses_the_documented_step_and_window() {
        let step = format!("interval '{} minutes'", PRIORITY_STEP.as_secs() / 60);
        assert_eq!(CLAIM_SQL.matches(&step).count(), 3, "{CLAIM_SQL}");
        let window = format!("LIMIT {PER_KEY_WINDOW} ");
        assert!(CLAIM_SQL.contains(&window), "{CLAIM_SQL}");
        assert!(CLAIM_SQL[..1024].contains("SKIP LOCKED"));
    }
}
