-- The relay's memory is bounded in bytes (issue #20 item 7).
--
-- `almanac.claim_outbox_bytes` claims as the baseline's
-- `almanac.claim_outbox` does (same lock, lease, fence and position; its
-- comment there holds for this one) and also bounds the batch in bytes. It
-- measures each row's payload in the server, as the JSON text the relay
-- sends, one row at a time in claim order, and stops before the row that
-- would take the batch's payloads past `p_budget_bytes`; the first row with
-- a payload is always taken, so a row larger than the budget goes out on
-- its own. A row whose payload is over `p_max_bytes` comes back with its
-- size in `bytes` and no payload (NULL): it costs nothing against the
-- budget, and the relay marks it failed with its reason through its usual
-- marks. So a claim reads at most one payload it does not return, and the
-- relay never receives one over the limit. `almanac::relay::outbox::claim`
-- documents the caller's side.
--
-- The baseline's `almanac.claim_outbox` stays as it is: relays of the
-- previous release call it while a fleet is upgraded one process at a
-- time, and a release's migrations add, they do not remove
-- (`almanac::db::schema`). It can be dropped by a release after the one
-- that stops calling it.
--
-- As in 0101 to 0103: a bounded wait for locks (creating a function takes
-- none on a table).
SET LOCAL lock_timeout = '10s';
CREATE FUNCTION almanac.claim_outbox_bytes(
    p_sink text, p_lock_class int, p_lock_key int, p_limit bigint, p_token uuid, p_lease_ms bigint,
    p_after_at timestamptz, p_after_id bigint, p_max_bytes bigint, p_budget_bytes bigint)
RETURNS TABLE (id bigint, job_id bigint, destination text, msg_key text, payload text,
               headers text, attempts int, available_at timestamptz, bytes bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now timestamptz;
    v_ids bigint[] := '{}';
    v_total bigint := 0;
    v_next bigint;
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
    -- The candidates' ids only: a payload is read when its row's turn comes.
    FOR v_next IN
        SELECT o.id
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
    LOOP
        SELECT o.id, o.job_id, o.destination, o.msg_key, o.payload::text, o.headers::text,
            o.attempts + 1, o.available_at
        INTO id, job_id, destination, msg_key, payload, headers, attempts, available_at
        FROM almanac.outbox AS o
        WHERE o.id = v_next;
        CONTINUE WHEN NOT FOUND;
        bytes := octet_length(payload);
        IF bytes > p_max_bytes THEN
            -- Sent back without its payload, to be marked failed.
            payload := NULL;
        ELSIF v_total > 0 AND v_total + bytes > p_budget_bytes THEN
            EXIT;
        ELSE
            v_total := v_total + bytes;
        END IF;
        v_ids := v_ids || id;
        RETURN NEXT;
    END LOOP;
    IF cardinality(v_ids) > 0 THEN
        INSERT INTO almanac.outbox_batches (token, sink, ids, claimed_at, lease_until)
        SELECT p_token, p_sink, array_agg(x ORDER BY x), v_now,
            v_now + p_lease_ms * interval '1 millisecond'
        FROM unnest(v_ids) AS x;
    END IF;
END
$$;
