-- A claim returns its batch as one row of arrays, not a row per message.
--
-- The relay decoded each claimed row through sqlx's row stream (a message,
-- a row and eight decoded columns per outbox row: about a third of the
-- relay process's own CPU), and PostgreSQL wrote each row into the
-- function's result store and out again (about 6% of its time under a busy
-- relay). `claim_outbox_batch` claims as `claim_outbox` did (0014 documents
-- it, 0015 added the start position) and returns one row: the claimed rows'
-- columns as arrays, in claim order (NULL arrays when nothing was due).
-- `claim_outbox` keeps its signature and result, unnested from it, for
-- relays of the previous release during an upgrade.
--
-- One row of arrays is one value for PostgreSQL, which caps a value at
-- 1 GB: a batch stops before its payloads pass 64 MB (always at least one
-- row), and says so (`cut`), so the relay goes on claiming at once.
SET LOCAL lock_timeout = '10s';

CREATE FUNCTION almanac.claim_outbox_batch(
    p_sink text, p_lock_class int, p_lock_key int, p_limit bigint, p_token uuid, p_lease_ms bigint,
    p_after_at timestamptz, p_after_id bigint)
RETURNS TABLE (ids bigint[], job_ids bigint[], destinations text[], msg_keys text[],
               payloads text[], headers text[], attempts int[], available_at timestamptz[],
               cut boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now timestamptz;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'almanac.claim_outbox_batch needs READ COMMITTED, not %',
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
    WITH due AS (
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
    ), sized AS (
        SELECT d.*, sum(octet_length(d.payload)) OVER (ORDER BY d.available_at, d.id) AS bytes,
            row_number() OVER (ORDER BY d.available_at, d.id) AS n
        FROM due AS d
    ), picked AS (
        SELECT s.id, s.job_id, s.destination, s.msg_key, s.payload, s.headers, s.attempts,
            s.available_at
        FROM sized AS s WHERE s.n = 1 OR s.bytes <= 64 * 1024 * 1024
    ), batch AS (
        INSERT INTO almanac.outbox_batches (token, sink, ids, claimed_at, lease_until)
        SELECT p_token, p_sink, array_agg(picked.id ORDER BY picked.id), v_now,
            v_now + p_lease_ms * interval '1 millisecond'
        FROM picked HAVING count(*) > 0
    )
    -- One aggregation: every array lists the rows in the same order.
    SELECT array_agg(p.id), array_agg(p.job_id), array_agg(p.destination), array_agg(p.msg_key),
        array_agg(p.payload), array_agg(p.headers), array_agg(p.attempts), array_agg(p.available_at),
        count(*) < (SELECT count(*) FROM due)
    FROM picked AS p;
END
$$;

CREATE OR REPLACE FUNCTION almanac.claim_outbox(
    p_sink text, p_lock_class int, p_lock_key int, p_limit bigint, p_token uuid, p_lease_ms bigint,
    p_after_at timestamptz, p_after_id bigint)
RETURNS TABLE (id bigint, job_id bigint, destination text, msg_key text, payload text,
               headers text, attempts int, available_at timestamptz)
LANGUAGE sql VOLATILE AS $$
    SELECT u.*
    FROM almanac.claim_outbox_batch($1, $2, $3, $4, $5, $6, $7, $8) AS c,
        unnest(c.ids, c.job_ids, c.destinations, c.msg_keys, c.payloads, c.headers, c.attempts,
               c.available_at) AS u
$$;
