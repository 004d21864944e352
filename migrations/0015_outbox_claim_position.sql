-- Two costs of the relay that grew with what it had already published.
--
-- 1. The claim read `outbox_due_idx` from its start, where every row
--    published since the last VACUUM leaves a dead entry: about 45 ns each,
--    so 4 ms per claim after 100,000 rows, and without bound when
--    autovacuum is off or behind. A claim can now start after a position
--    (`p_after_at`, `p_after_id`: the last row its relay claimed before) and
--    returns each row's `available_at`, from which the relay takes the next
--    position. Rows that become due behind a position (a job enqueued with
--    an earlier `run_at`, a transaction that committed late, a batch handed
--    back or whose lease ended) are found by the relay's next claim from
--    the start, at least once a second (`almanac::relay` says when).
-- 2. A batch's id arrays (4 kB for 500 ids) are over the 2 kB at which
--    PostgreSQL compresses a row's largest values, and its default
--    compressor (pglz) spent about half a millisecond on each: every claim
--    (`ids`) and every mark (`ids` again, `job_ids`), about a sixth of the
--    database's time under a busy relay; sorted ids barely compress anyway.
--    EXTERNAL stores them out of line as they are, and the publish mark
--    keeps the `ids` stored at claim when it publishes the whole batch.
SET LOCAL lock_timeout = '10s';

ALTER TABLE almanac.outbox_batches
    ALTER COLUMN ids SET STORAGE EXTERNAL,
    ALTER COLUMN job_ids SET STORAGE EXTERNAL;

-- As in 0014 (which documents it), with the start position and
-- `available_at` returned. A NULL position claims from the start.
DROP FUNCTION almanac.claim_outbox(text, int, int, bigint, uuid, bigint);
CREATE FUNCTION almanac.claim_outbox(
    p_sink text, p_lock_class int, p_lock_key int, p_limit bigint, p_token uuid, p_lease_ms bigint,
    p_after_at timestamptz, p_after_id bigint)
RETURNS TABLE (id bigint, job_id bigint, destination text, msg_key text, payload text,
               headers text, attempts int, available_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now timestamptz;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'almanac.claim_outbox needs READ COMMITTED, not %',
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
    WITH picked AS (
        SELECT o.id, o.job_id, o.destination, o.msg_key, o.payload::text AS payload,
            o.headers::text AS headers, o.attempts + 1 AS attempts, o.available_at
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
    ), batch AS (
        INSERT INTO almanac.outbox_batches (token, sink, ids, claimed_at, lease_until)
        SELECT p_token, p_sink, array_agg(picked.id ORDER BY picked.id), v_now,
            v_now + p_lease_ms * interval '1 millisecond'
        FROM picked HAVING count(*) > 0
    )
    SELECT * FROM picked;
END
$$;
