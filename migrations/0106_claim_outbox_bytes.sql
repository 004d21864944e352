-- The relay's memory is bounded in bytes (issue #20 item 7).
--
-- Each outbox row records the size of its payload as the JSON text the
-- relay sends (`bytes`), measured once, when `almanac.write_outbox` writes
-- the row (the enqueue's transaction, where producers spread the cost),
-- instead of by the relay's claim, which is serialised per sink and is the
-- relay's critical path. Rows written before this migration have no size;
-- the claim measures theirs.
--
-- `almanac.claim_outbox_bytes` claims as the baseline's
-- `almanac.claim_outbox` does (same lock, lease, fence, position and one
-- statement; its comment there holds for this one) and also bounds the
-- batch in bytes: it takes candidates in claim order while the running
-- total of their sizes stays within `p_budget_bytes`, and always the first
-- row with a payload, so a row larger than the budget goes out on its own.
-- A row whose payload is over `p_max_bytes` comes back with its size in
-- `bytes` and no payload (NULL), costs nothing against the budget, and the
-- relay marks it failed with its reason through its usual marks: the relay
-- never receives a payload over the limit. The claim turns into text only
-- the payloads it returns. `almanac::relay::outbox::claim` documents the
-- caller's side.
--
-- The baseline's `almanac.claim_outbox` stays as it is: relays of the
-- previous release call it while a fleet is upgraded one process at a
-- time, and a release's migrations add, they do not remove
-- (`almanac::db::schema`). It can be dropped by a release after the one
-- that stops calling it.
--
-- As in 0101 to 0103: a bounded wait for locks. Adding a nullable column
-- with no default only touches the catalog (no table rewrite).
SET LOCAL lock_timeout = '10s';
ALTER TABLE almanac.outbox ADD COLUMN bytes bigint;

CREATE OR REPLACE FUNCTION almanac.write_outbox(j almanac.jobs) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r almanac.routes%ROWTYPE;
BEGIN
    SELECT * INTO r FROM almanac.routes WHERE kind = j.kind;
    IF r.sink IS NULL THEN
        RAISE EXCEPTION 'job % of kind % is routed to %, but the kind has no sink; run `almanac route set`', j.id, j.kind, j.route;
    END IF;
    INSERT INTO almanac.outbox (job_id, sink, destination, msg_key, payload, headers, available_at, bytes)
    VALUES (
        j.id, r.sink, r.destination,
        coalesce(j.idempotency_key, 'almanac:job:' || j.id),
        j.payload,
        jsonb_build_object(
            'almanac-job-id', j.id::text,
            'almanac-kind', j.kind,
            'almanac-attempt', (j.attempts + 1)::text,
            'almanac-logical-run', coalesce(j.logical_run, '')),
        j.run_at,
        octet_length(j.payload::text));
    PERFORM pg_notify('almanac_outbox', r.sink);
END $$;

CREATE FUNCTION almanac.claim_outbox_bytes(
    p_sink text, p_lock_class int, p_lock_key int, p_limit bigint, p_token uuid, p_lease_ms bigint,
    p_after_at timestamptz, p_after_id bigint, p_max_bytes bigint, p_budget_bytes bigint)
RETURNS TABLE (id bigint, job_id bigint, destination text, msg_key text, payload text,
               headers text, attempts int, available_at timestamptz, bytes bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now timestamptz;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'almanac.claim_outbox_bytes needs READ COMMITTED, not %',
            current_setting('transaction_isolation') USING ERRCODE = 'ALM01';
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM set_config('lock_timeout', '10s', true);
    PERFORM pg_advisory_xact_lock(p_lock_class, p_lock_key);
    v_now := clock_timestamp();
    DELETE FROM almanac.outbox_batches AS b
    WHERE b.token IN (SELECT e.token FROM almanac.outbox_batches AS e
                      WHERE e.sink = p_sink AND e.published_at IS NULL AND e.lease_until <= v_now
                      FOR UPDATE SKIP LOCKED);
    RETURN QUERY
    WITH candidates AS MATERIALIZED (
        SELECT o.id, o.job_id, o.destination, o.msg_key, o.payload, o.headers, o.attempts,
            o.available_at, coalesce(o.bytes, octet_length(o.payload::text)) AS size
        FROM almanac.outbox AS o
        WHERE o.sink = p_sink AND o.published_at IS NULL AND o.failed_at IS NULL
          AND o.available_at <= v_now
          -- Always an index condition (a generic plan keeps it): the start
          -- of the index when no position is given.
          AND (o.available_at, o.id) > (coalesce(p_after_at, '-infinity'), coalesce(p_after_id, 0))
          AND o.id NOT IN (SELECT unnest(b.ids) FROM almanac.outbox_batches AS b
                           WHERE b.sink = p_sink AND b.published_at IS NULL
                             AND b.lease_until > v_now)
        ORDER BY o.available_at, o.id
        LIMIT p_limit
    ), picked AS MATERIALIZED (
        -- The running total of the sizes sent (an oversized row sends none)
        -- only grows, so the rows kept are a prefix of the candidates.
        SELECT * FROM (
            SELECT c.*, c.size > p_max_bytes AS oversized,
                sum(CASE WHEN c.size > p_max_bytes THEN 0 ELSE c.size END)
                    OVER (ORDER BY c.available_at, c.id) AS total
            FROM candidates AS c) AS t
        WHERE t.total <= p_budget_bytes
           -- The first row with a payload, however large.
           OR (NOT t.oversized AND t.total = t.size)
    ), batch AS (
        INSERT INTO almanac.outbox_batches (token, sink, ids, claimed_at, lease_until)
        SELECT p_token, p_sink, array_agg(p.id ORDER BY p.id), v_now,
            v_now + p_lease_ms * interval '1 millisecond'
        FROM picked AS p HAVING count(*) > 0
    )
    SELECT p.id, p.job_id, p.destination, p.msg_key,
        CASE WHEN p.oversized THEN NULL ELSE p.payload::text END,
        p.headers::text, p.attempts + 1, p.available_at, p.size
    FROM picked AS p
    ORDER BY p.available_at, p.id;
END
$$;
