//! The statements on `almanac.jobs` that routes and the relay run: moving a
//! kind's ready jobs to its route, window by window, the reconcile that repairs jobs whose
//! route disagrees with `almanac.routes`, re-drive of stranded broker jobs,
//! and burying the job of an outbox row the broker rejected for good.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{PgConnection, PgExecutor};

/// The advisory lock key of `kind`'s route: every insert of a job takes it
/// shared (the `jobs_take_route` trigger and, for their own inserts, the
/// enqueue functions of migration 0137, whose text must match), `almanac
/// route set` exclusively, so an enqueue is ordered against a route change.
pub fn route_lock_key(kind: &str) -> String {
    format!("almanac.route:{kind}")
}

/// Of `kinds`, those whose route lock is busy right now (held exclusively
/// by `almanac route set`, or wanted by it); the others are locked shared
/// for the rest of the caller's transaction, as the insert trigger would
/// lock them, but without waiting. The scheduler's leader defers the busy
/// kinds' runs instead of waiting behind them.
pub async fn busy_kinds(tx: &mut PgConnection, kinds: &[&str]) -> Result<Vec<String>, sqlx::Error> {
    let keys: Vec<String> = kinds.iter().map(|k| route_lock_key(k)).collect();
    let busy: Vec<i64> = sqlx::query_scalar(
        "SELECT i FROM unnest($1::text[]) WITH ORDINALITY AS t(key, i) \
         WHERE NOT pg_try_advisory_xact_lock_shared(hashtext(key))",
    )
    .bind(&keys)
    .fetch_all(tx)
    .await?;
    Ok(busy
        .into_iter()
        .map(|i| kinds[i as usize - 1].to_string())
        .collect())
}

/// Where a walk of a kind's ready jobs stands: after this `(run_at, id)`.
pub type WalkCursor = (DateTime<Utc>, i64);

/// Which of a kind's ready jobs a [`move_window`] looks at.
#[derive(Debug, Clone, Copy)]
pub enum Window<'a> {
    /// The next `limit` after the cursor (`None`: from the start), in
    /// `(run_at, id)` order: an ordered range of `jobs_ready_kind_idx`, so a
    /// window costs its own rows, not the backlog before it.
    After(Option<WalkCursor>, i64),
    /// These jobs (those a window skipped), when still ready.
    Ids(&'a [i64]),
}

/// What one [`move_window`] did.
#[derive(Debug, Clone, Default)]
pub struct Moved {
    /// The ready jobs it looked at.
    pub ids: Vec<i64>,
    /// How many it moved to the kind's route.
    pub moved: u64,
    /// Jobs off the route it could not lock (another transaction held
    /// them): look again once the walk is over.
    pub skipped: Vec<i64>,
    /// Where the next window of an [`Window::After`] walk starts; `None`
    /// once it is over.
    pub next: Option<WalkCursor>,
}

/// One window of a walk over `kind`'s ready jobs: those whose route is not
/// the kind's route now are moved to it (the outbox trigger writes rows for
/// jobs leaving `db`). Rows another transaction holds (a worker claiming
/// them) are skipped, not waited for, and returned ([`Moved::skipped`]); the
/// lock taken is `FOR NO KEY UPDATE`, so the key-share lock an outbox
/// insert's foreign key takes on its job does not make a row look busy.
/// Running jobs are never touched, so no worker's heartbeat or outcome
/// waits behind a route change; a claimed job takes the route when it is
/// ready again (`almanac.route_of`, migration 0107).
pub async fn move_window(
    conn: &mut PgConnection,
    kind: &str,
    window: Window<'_>,
) -> Result<Moved, sqlx::Error> {
    let (after, limit, ids) = match window {
        Window::After(after, limit) => (after, limit, None),
        Window::Ids(ids) => (None, ids.len() as i64, Some(ids)),
    };
    type Row = (Vec<i64>, i64, Vec<i64>, Option<DateTime<Utc>>, Option<i64>);
    let (ids, moved, skipped, run_at, id): Row = sqlx::query_as(
        r#"
        WITH w AS MATERIALIZED (
            SELECT id, run_at FROM almanac.jobs
            WHERE status = 'ready' AND kind = $1
              AND (run_at, id) > (coalesce($2, '-infinity'::timestamptz), coalesce($3, 0))
              AND ($5::bigint[] IS NULL OR id = ANY($5))
            ORDER BY kind, run_at, id
            LIMIT $4
        ), mode AS MATERIALIZED (
            SELECT coalesce((SELECT mode FROM almanac.routes WHERE kind = $1), 'db') AS m
        ), off AS MATERIALIZED (
            SELECT j.id FROM almanac.jobs j
            WHERE j.id = ANY (ARRAY(SELECT id FROM w)) AND j.status = 'ready'
              AND j.route <> (SELECT m FROM mode)
        ), locked AS MATERIALIZED (
            SELECT j.id FROM almanac.jobs j
            WHERE j.id = ANY (ARRAY(SELECT id FROM off)) AND j.status = 'ready'
              AND j.route <> (SELECT m FROM mode)
            FOR NO KEY UPDATE SKIP LOCKED
        ), moved AS (
            UPDATE almanac.jobs j SET route = (SELECT m FROM mode)
            WHERE j.id = ANY (ARRAY(SELECT id FROM locked))
            RETURNING j.id
        ), last AS (
            SELECT run_at, id FROM w ORDER BY run_at DESC, id DESC LIMIT 1
        )
        SELECT ARRAY(SELECT id FROM w), (SELECT count(*) FROM moved),
            ARRAY(SELECT id FROM off EXCEPT SELECT id FROM locked),
            (SELECT run_at FROM last WHERE (SELECT count(*) FROM w) = $4),
            (SELECT id FROM last WHERE (SELECT count(*) FROM w) = $4)
        "#,
    )
    .bind(kind)
    .bind(after.map(|c| c.0))
    .bind(after.map(|c| c.1))
    .bind(limit)
    .bind(ids)
    .fetch_one(conn)
    .await?;
    Ok(Moved {
        ids,
        moved: moved as u64,
        skipped,
        next: run_at
            .zip(id)
            .filter(|_| matches!(window, Window::After(..))),
    })
}

/// Of `kinds`, those with a route that have ready jobs on another route: a
/// walk of [`move_window`]s that was cut short (a `route set` interrupted),
/// a row a worker held when the walk passed it, or an enqueue whose
/// REPEATABLE READ snapshot predates the last `route set`.
pub async fn kinds_off_route<'e>(
    db: impl PgExecutor<'e>,
    kinds: &[String],
) -> Result<Vec<String>, sqlx::Error> {
    // Reads every ready job of the kinds (no index leads with the route;
    // one would cost every enqueue an entry: docs/speed.md). The relays'
    // reconcile asks only about kinds whose route changed lately
    // (`relay/reconcile.rs`).
    sqlx::query_scalar(
        r#"
        SELECT r.kind FROM almanac.routes AS r
        WHERE r.kind = ANY($1) AND EXISTS (
            SELECT 1 FROM almanac.jobs AS j
            WHERE j.kind = r.kind AND j.status = 'ready' AND j.route <> r.mode)
        ORDER BY r.kind
        "#,
    )
    .bind(kinds)
    .fetch_all(db)
    .await
}

/// Where a re-drive sweep stands: candidates due by `until` (fixed when the
/// sweep starts, so a sweep ends even while jobs keep coming due), after the
/// `(run_at, id)` of the last one looked at. `None`: a new sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedriveCursor {
    pub until: DateTime<Utc>,
    pub after: (DateTime<Utc>, i64),
}

/// A destination whose stranded jobs re-drive holds back: its consumers
/// record drains (`almanac.consumer_marks`) and some partition has not been
/// drained within `redrive_after`, so a message may still wait there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub destination: String,
    /// The kinds routed there (sorted).
    pub kinds: Vec<String>,
    /// The oldest of its partitions' last drains; `None`: some partition
    /// was never seen drained.
    pub drained_at: Option<DateTime<Utc>>,
}

/// What one step of a re-drive sweep did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedriveStep {
    /// Jobs given a fresh outbox row.
    pub redriven: u64,
    /// Where the next step goes on; `None` once the candidates ran out.
    pub next: Option<RedriveCursor>,
    /// Destinations held back ([`Held`]), in order, whether or not they
    /// have candidates.
    pub held: Vec<Held>,
}

/// One step of a re-drive sweep ([`redrive`]): `$1` sink, `$2`
/// `redrive_after` in milliseconds, `$3`, `$4` the cursor's `(run_at, id)`,
/// `$5` its `until` (all three NULL: a new sweep). Its look for records of
/// publication reads the records that hold a candidate, not those published
/// within `redrive_after` (`tests/it/ledger_scale.rs` holds the plan at 10
/// million published jobs).
pub const REDRIVE_SQL: &str = r#"
    WITH gates AS MATERIALIZED (
        -- Each destination of this sink's broker routes, with the oldest
        -- of its partitions' last drains (NULL: no marks, always open).
        SELECT d.destination, d.kinds,
            (SELECT min(m.drained_at) FROM almanac.consumer_marks m
             WHERE m.sink = $1 AND m.destination = d.destination) AS drained
        FROM (SELECT destination, array_agg(kind ORDER BY kind) AS kinds
              FROM almanac.routes WHERE mode = 'broker' AND sink = $1
              GROUP BY destination) d
    ), open AS MATERIALIZED (
        SELECT destination FROM gates
        WHERE drained IS NULL OR drained > now() - $2 * interval '1 millisecond'
    ), candidates AS MATERIALIZED (
        -- Per routed kind, an ordered walk of `jobs_ready_kind_idx` from
        -- the cursor that stops at 1,000 candidates (the kind's equality
        -- and `(run_at, id)` past the cursor: a row comparison over the
        -- whole key beside the equality started the scan at the kind's
        -- first entry, reading every entry before the cursor), then the
        -- earliest across kinds: a step reads its own rows, not every
        -- candidate left (one scan over the join sorted them all, and a
        -- sweep over a million jobs took minutes per 100,000).
        SELECT c.id, c.run_at FROM (
            SELECT r.kind, r.sink, r.destination FROM almanac.routes r
            WHERE r.mode = 'broker' AND r.sink = $1
              AND r.destination IN (SELECT destination FROM open)
              -- A paused kind's messages are held or cycled by its
              -- consumers, not lost: never copied again.
              AND NOT EXISTS (SELECT 1 FROM almanac.kind_pauses p
                              WHERE p.kind IN (r.kind, '*'))
        ) AS r
        CROSS JOIN LATERAL (
            SELECT j.id, j.run_at FROM almanac.jobs j
            WHERE j.status = 'ready' AND j.kind = r.kind
              AND (j.run_at, j.id)
                  > (coalesce($3, '-infinity'::timestamptz), coalesce($4, 0))
              AND j.run_at <= coalesce($5, now() - $2 * interval '1 millisecond')
              AND j.route = 'broker'
              -- The job's own outbox rows, found by `outbox_job_idx` alone
              -- (`OFFSET 0` keeps the other conditions out of the scan:
              -- without statistics the planner ANDed in a scan of every
              -- pending row of the sink, once per job, and a step over
              -- 150,000 jobs with pending rows ran for minutes).
              AND NOT EXISTS (
                  SELECT 1 FROM (SELECT o.sink, o.destination, o.published_at, o.failed_at
                                 FROM almanac.outbox o WHERE o.job_id = j.id OFFSET 0) AS o
                  WHERE o.sink = r.sink AND o.destination = r.destination
                    AND ((o.published_at IS NULL AND o.failed_at IS NULL)
                         OR o.published_at > now() - $2 * interval '1 millisecond'))
            ORDER BY j.kind, j.run_at, j.id
            LIMIT 1000
        ) AS c
        ORDER BY c.run_at, c.id
        LIMIT 1000
    ), batches AS MATERIALIZED (
        -- Recent records of this sink whose span of jobs holds one of
        -- the candidates: one scan of the span's GiST index with the
        -- candidates' ids as a multirange of points, which descends
        -- only into entries that hold one (the lowest-to-highest span
        -- of all the candidates, which this was before, overlaps every
        -- record between a job stranded long ago and a recent one: all
        -- 100,000 records of 10 million published jobs). Their jobs are
        -- read once, hashed below.
        SELECT b.job_ids FROM almanac.outbox_batches b
        WHERE b.sink = $1 AND b.published_at > now() - $2 * interval '1 millisecond'
          AND b.job_span && (SELECT range_agg(int8range(id, id, '[]')) FROM candidates)
    ), published AS MATERIALIZED (
        SELECT x.id FROM batches b, unnest(b.job_ids) AS x(id)
        WHERE x.id IN (SELECT id FROM candidates)
    ), redriven AS MATERIALIZED (
        SELECT count(almanac.write_outbox(j)) AS n FROM almanac.jobs j
        WHERE j.id IN (SELECT id FROM candidates) AND j.id NOT IN (SELECT id FROM published)
    ), last AS (
        SELECT run_at, id FROM candidates ORDER BY run_at DESC, id DESC LIMIT 1
    ), held AS (
        SELECT destination, to_jsonb(kinds) AS kinds,
            nullif(drained, '-infinity'::timestamptz) AS drained FROM gates
        WHERE destination NOT IN (SELECT destination FROM open)
    )
    SELECT (SELECT n FROM redriven),
        coalesce($5, now() - $2 * interval '1 millisecond'),
        (SELECT run_at FROM last WHERE (SELECT count(*) FROM candidates) = 1000),
        (SELECT id FROM last WHERE (SELECT count(*) FROM candidates) = 1000),
        array(SELECT destination FROM held ORDER BY destination),
        array(SELECT kinds FROM held ORDER BY destination),
        array(SELECT drained FROM held ORDER BY destination)
    "#;

/// One step of a re-drive sweep: looks at the next 1,000 candidates after
/// `from` (`broker` jobs of kinds routed to `sink`, ready and due longer than
/// `after` when the sweep started, with no row pending on their current
/// route, in `(run_at, id)` order) and gives a fresh outbox row to those none was published for
/// within `after`. Returns how many got one, and where the next step goes on
/// (`None` once the candidates ran out). Pending rows addressed elsewhere (a
/// route since changed) do not count. A publication counts when it went to
/// the job's current sink: the record of a published batch
/// (`almanac.outbox_batches`) names jobs, not each row's destination, so
/// after a change of destination alone a job published to the old one
/// within `after` waits out `after` from that publication. A sweep goes on
/// past candidates published recently (waiting for slow consumers), so a
/// lost message behind them is still found. A step reads the records
/// published within `after` whose span of job ids (`job_span`, see the
/// baseline migration) holds one of its candidates, through the span's
/// GiST index: few when jobs are published in about the order they were
/// created, more when jobs delayed by different amounts widen the spans (at
/// worst every record published within `after` whose span is that wide),
/// and as many at 10 million published jobs as at 10,000.
///
/// **The drain gate.** Only destinations with no drain marks at all, or
/// whose every partition was drained within `after`, have candidates: a
/// candidate was last published more than `after` ago, so a drain since
/// proves its message is no longer waiting in the broker, and without one
/// it may be (consumers down or behind) and is not copied again. Consumers
/// write a mark for every partition, `'-infinity'` for one never seen
/// drained, so one lagging partition holds its destination back. The gate
/// reads the marks of this sink's routed destinations once per step (a
/// primary-key range per destination). The others are returned as
/// [`RedriveStep::held`]. Paused kinds ([`crate::control::pause`]) have no
/// candidates: their consumers hold or cycle their messages (a RabbitMQ
/// consumer's copies to the tail even look like a drain), so a copy would
/// only multiply them.
pub async fn redrive<'e>(
    db: impl PgExecutor<'e>,
    sink: &str,
    after: Duration,
    from: Option<RedriveCursor>,
) -> Result<RedriveStep, sqlx::Error> {
    type Step = (
        i64,
        DateTime<Utc>,
        Option<DateTime<Utc>>,
        Option<i64>,
        Vec<String>,
        Vec<Json<Vec<String>>>,
        Vec<Option<DateTime<Utc>>>,
    );
    let (redriven, until, run_at, id, held, kinds, drained): Step = sqlx::query_as(REDRIVE_SQL)
        .bind(sink)
        .bind(i64::try_from(after.as_millis()).unwrap_or(i64::MAX))
        .bind(from.map(|c| c.after.0))
        .bind(from.map(|c| c.after.1))
        .bind(from.map(|c| c.until))
        .fetch_one(db)
        .await?;
    let next = run_at.zip(id).map(|after| RedriveCursor { until, after });
    let held = held
        .into_iter()
        .zip(kinds)
        .zip(drained)
        .map(|((destination, kinds), drained_at)| Held {
            destination,
            kinds: kinds.0,
            drained_at,
        })
        .collect();
    Ok(RedriveStep {
        redriven: redriven as u64,
        next,
        held,
    })
}

/// Buries the jobs of outbox rows the broker rejected for good: a ready job
/// on the `broker` route goes `dead` with the row's reason (nothing else can
/// run it). A `dual` job stays ready for workers; a job already claimed or
/// finished is left alone. Returns the ids buried.
pub async fn bury_unpublishable(
    conn: &mut PgConnection,
    job_ids: &[i64],
    reasons: &[String],
) -> Result<Vec<i64>, sqlx::Error> {
    if job_ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar(
        r#"
        UPDATE almanac.jobs AS j
        SET status = 'dead', finished_at = clock_timestamp(),
            last_error = 'the broker rejected its message for good: ' || f.reason
        FROM unnest($1::bigint[], $2::text[]) AS f(id, reason)
        WHERE j.id = f.id AND j.status = 'ready' AND j.route = 'broker'
        RETURNING j.id
        "#,
    )
    .bind(job_ids)
    .bind(
        reasons
            .iter()
            .map(|r| super::storable(r).into_owned())
            .collect::<Vec<_>>(),
    )
    .fetch_all(conn)
    .await
}
