-- Order per key (issue #24 item 2): the worker whose completion frees a
-- key's next job takes that job itself, in the same statement.
--
-- Until now a completion moved each released successor `held -> ready` and
-- notified, and the worker's next claim walked the ready index to move it
-- `ready -> running`: two writes of the row and a second statement per job
-- of a key, one after the other, which kept ordered kinds at about a third
-- of the unordered throughput (docs/speed.md).
--
-- `almanac.complete_claiming` is the batched completion with one more
-- step: while its UPDATE's statement trigger releases the keys it ended,
-- the setting `almanac.claim_successors` (the lease in milliseconds) lets
-- `release_keys` claim a released job at once (`held -> running`, the
-- claim's own write: one more attempt, a lease token and a lease; the
-- token derived from the completed job's, see `release_keys` below)
-- when a claim by that worker would take it anyway:
--
-- - its kind is routed to `db` (a dual or broker kind's job gets its
--   outbox row on the way to `ready`), not paused, and has no limits
--   (a limited kind's claims go through its budget);
-- - it is due;
-- - no due ready job of any kind the worker runs waits (its claim would
--   weigh that one first): so a worker chaining the keys it holds never
--   passes a job that waits, of another key or another kind. (Conservative:
--   a due job that the claim would not take, paused or over a limit, also
--   sends released jobs the usual way.) A kind routed to the broker is not
--   looked at: its ready jobs are the consumers' backlog, which the claim
--   does not walk either, and the look is the claim's walk of
--   `jobs_ready_kind_idx` (a range, so that it stops at the first due job).
--
-- Every other released job goes `held -> ready` and is notified, as before.
-- The claimed ids are handed back through a transaction-local setting and
-- returned beside the completed rows (told apart by status: `done` or
-- `running`). The caller has a slot for each: a key releases at most one
-- job, and only keys that the statement's completions ended are released.
SET LOCAL lock_timeout = '10s';

-- `p_after[i]`: the lease token of the job of key i that ended (NULL when
-- unknown); a job claimed here gets `md5(that token || ':next')` as its
-- token, so a completion whose answer was lost can find the jobs it
-- claimed and give them back (`queue::unclaim_successors`). Keys without
-- one are released the usual way.
CREATE FUNCTION almanac.release_keys(p_kinds text[], p_keys text[], p_after uuid[]) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_ids bigint[];
    v_after uuid[];
    v_taken bigint[];
    v_kind text;
    v_n integer;
    v_released integer := 0;
    v_lease text := current_setting('almanac.claim_successors', true);
    v_worker_kinds text[];
    v_claimed bigint[];
BEGIN
    SELECT array_agg(h.id), array_agg(k.after) INTO v_ids, v_after
    FROM unnest(p_kinds, p_keys, p_after) AS k(kind, key, after)
    CROSS JOIN LATERAL (
        SELECT j.id FROM almanac.jobs AS j
        WHERE j.kind = k.kind AND j.ordering_key = k.key AND j.status = 'held'
        ORDER BY j.id LIMIT 1) AS h
    WHERE (SELECT 1 FROM almanac.jobs AS b
           WHERE b.kind = k.kind AND b.ordering_key = k.key
             AND b.status IN ('ready', 'running', 'dead')
             AND (b.status <> 'dead'
                  OR coalesce((SELECT o.on_dead = 'halt' FROM almanac.kind_ordering AS o
                               WHERE o.kind = k.kind), false))
           LIMIT 1) IS NULL;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    v_taken := ARRAY(SELECT j.id FROM almanac.jobs AS j
                     WHERE j.id = ANY (v_ids) AND j.status = 'held'
                     ORDER BY j.id FOR UPDATE SKIP LOCKED);
    IF cardinality(v_taken) < cardinality(v_ids) THEN
        INSERT INTO almanac.ordering_recheck (kind, ordering_key)
        SELECT DISTINCT j.kind, j.ordering_key FROM almanac.jobs AS j
        WHERE j.id = ANY (v_ids) AND j.id <> ALL (v_taken)
        ON CONFLICT DO NOTHING;
    END IF;
    IF coalesce(v_lease, '') <> '' THEN
        v_worker_kinds := current_setting('almanac.claim_successors_kinds')::text[];
    END IF;
    IF coalesce(v_lease, '') <> ''
       AND NOT EXISTS (SELECT 1 FROM unnest(v_worker_kinds) AS w(kind)
                       WHERE NOT EXISTS (SELECT 1 FROM almanac.routes AS rt
                                         WHERE rt.kind = w.kind AND rt.mode = 'broker')
                         AND EXISTS (SELECT 1 FROM almanac.jobs AS e
                                     WHERE e.status = 'ready'
                                       AND (e.kind, e.run_at, e.id) >= (w.kind, '-infinity'::timestamptz, 0)
                                       AND (e.kind, e.run_at) <= (w.kind, now())
                                       AND e.kind = w.kind AND e.run_at <= now()
                                       AND coalesce(e.route, '') <> 'broker')) THEN
        WITH direct AS (
            SELECT d.kind FROM (SELECT DISTINCT k.kind FROM unnest(p_kinds) AS k(kind)) AS d
            WHERE coalesce((SELECT rt.mode FROM almanac.routes AS rt WHERE rt.kind = d.kind), 'db') = 'db'
              AND NOT EXISTS (SELECT 1 FROM almanac.kind_pauses AS p WHERE p.kind IN (d.kind, '*'))
              AND NOT EXISTS (SELECT 1 FROM almanac.kind_limits AS l WHERE l.kind = d.kind)
              AND d.kind = ANY (v_worker_kinds)
        ), claimed AS (
            UPDATE almanac.jobs AS j
            SET status = 'running', attempts = j.attempts + 1,
                lease_token = md5(s.after::text || ':next')::uuid,
                lease_until = clock_timestamp() + v_lease::bigint * interval '1 millisecond',
                route = 'db'
            FROM unnest(v_ids, v_after) AS s(id, after)
            WHERE j.id = s.id AND s.after IS NOT NULL AND j.id = ANY (v_taken)
              AND j.kind IN (SELECT kind FROM direct) AND j.run_at <= now()
            RETURNING j.id)
        SELECT array_agg(claimed.id) INTO v_claimed FROM claimed;
        IF v_claimed IS NOT NULL THEN
            PERFORM set_config('almanac.claimed_successors',
                               concat_ws(',', nullif(current_setting('almanac.claimed_successors', true), ''),
                                         array_to_string(v_claimed, ',')),
                               true);
            v_released := cardinality(v_claimed);
            v_taken := ARRAY(SELECT t.id FROM unnest(v_taken) AS t(id) WHERE t.id <> ALL (v_claimed));
        END IF;
    END IF;
    IF cardinality(v_taken) = 0 THEN
        RETURN v_released;
    END IF;
    FOR v_kind, v_n IN
        WITH released AS (
            UPDATE almanac.jobs AS j
            SET status = 'ready',
                route = coalesce((SELECT rt.mode FROM almanac.routes AS rt WHERE rt.kind = j.kind), 'db')
            WHERE j.id = ANY (v_taken)
            RETURNING j.kind)
        SELECT released.kind, count(*)::integer FROM released GROUP BY released.kind
    LOOP
        v_released := v_released + v_n;
        PERFORM pg_notify('almanac_jobs', v_kind);
    END LOOP;
    RETURN v_released;
END $$;

CREATE OR REPLACE FUNCTION almanac.release_keys(p_kinds text[], p_keys text[]) RETURNS integer
LANGUAGE sql VOLATILE AS $$
    SELECT almanac.release_keys(p_kinds, p_keys, NULL::uuid[])
$$;

-- 0129's trigger function, passing on the lease token of each key's
-- ended job (an UPDATE's old row: the completed job's token).
CREATE OR REPLACE FUNCTION almanac.jobs_release_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_kinds text[];
    v_keys text[];
    v_after uuid[];
    v_got boolean[];
BEGIN
    IF NOT EXISTS (SELECT 1 FROM ended_old AS o
                   WHERE o.ordering_key IS NOT NULL
                     AND o.status IN ('ready', 'running', 'dead', 'held')) THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        IF NOT EXISTS (SELECT 1 FROM ended_new AS n
                       WHERE n.status IN ('done', 'cancelled', 'dead')) THEN
            RETURN NULL;
        END IF;
        -- EXECUTE: planned on every call (see 0129).
        EXECUTE $q$
            SELECT array_agg(k.kind ORDER BY k.kind, k.key), array_agg(k.key ORDER BY k.kind, k.key),
                   array_agg(k.after ORDER BY k.kind, k.key)
            FROM (SELECT o.kind, o.ordering_key AS key, min(o.lease_token::text)::uuid AS after
                  FROM ended_old AS o JOIN ended_new AS n ON n.id = o.id
                  WHERE o.ordering_key IS NOT NULL
                    AND o.status IN ('ready', 'running', 'dead', 'held')
                    AND n.status IN ('done', 'cancelled', 'dead')
                    AND n.status <> o.status
                  GROUP BY o.kind, o.ordering_key) AS k $q$
        INTO v_kinds, v_keys, v_after;
    ELSE
        SELECT array_agg(k.kind ORDER BY k.kind, k.key), array_agg(k.key ORDER BY k.kind, k.key)
        INTO v_kinds, v_keys
        FROM (SELECT DISTINCT o.kind, o.ordering_key AS key
              FROM ended_old AS o
              WHERE o.ordering_key IS NOT NULL
                AND o.status IN ('ready', 'running', 'dead', 'held')) AS k;
    END IF;
    IF v_kinds IS NULL THEN
        RETURN NULL;
    END IF;
    v_got := almanac.lock_keys(v_kinds, v_keys, clock_timestamp() + interval '50 milliseconds');
    INSERT INTO almanac.ordering_recheck (kind, ordering_key)
    SELECT k.kind, k.key FROM unnest(v_kinds, v_keys, v_got) AS k(kind, key, got)
    WHERE NOT k.got
    ON CONFLICT DO NOTHING;
    PERFORM almanac.release_keys(
        ARRAY(SELECT k.kind FROM unnest(v_kinds, v_keys, v_got) WITH ORDINALITY AS k(kind, key, got, i)
              WHERE k.got ORDER BY k.i),
        ARRAY(SELECT k.key FROM unnest(v_kinds, v_keys, v_got) WITH ORDINALITY AS k(kind, key, got, i)
              WHERE k.got ORDER BY k.i),
        ARRAY(SELECT a.after FROM unnest(v_kinds, v_got, v_after) WITH ORDINALITY AS a(kind, got, after, i)
              WHERE a.got ORDER BY a.i));
    RETURN NULL;
END $$;

-- The batched completion of `queue::complete_many`, claiming the released
-- successors for the caller, a worker of `p_kinds`, under a lease of
-- `p_lease_ms` (see above).
-- Returns the completed rows (status `done`, payload `{}`: the caller has
-- it) and the claimed ones (status `running`, whole).
CREATE FUNCTION almanac.complete_claiming(p_ids bigint[], p_tokens uuid[], p_lease_ms bigint,
                                          p_kinds text[])
RETURNS SETOF almanac.jobs
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_claimed text;
BEGIN
    PERFORM set_config('almanac.claimed_successors', '', true);
    PERFORM set_config('almanac.claim_successors_kinds', p_kinds::text, true);
    PERFORM set_config('almanac.claim_successors', p_lease_ms::text, true);
    RETURN QUERY
        WITH done AS (
            UPDATE almanac.jobs AS j
            SET status = 'done', lease_token = NULL, lease_until = NULL, finished_at = clock_timestamp()
            FROM unnest(p_ids, p_tokens) AS c(id, token)
            WHERE j.id = c.id AND j.lease_token = c.token AND j.lease_until > clock_timestamp()
            RETURNING j)
        SELECT (jsonb_populate_record(done.j, '{"payload": {}}')).* FROM done;
    PERFORM set_config('almanac.claim_successors', '', true);
    v_claimed := current_setting('almanac.claimed_successors', true);
    PERFORM set_config('almanac.claimed_successors', '', true);
    IF coalesce(v_claimed, '') <> '' THEN
        RETURN QUERY SELECT j.* FROM almanac.jobs AS j
                     WHERE j.id = ANY (string_to_array(v_claimed, ',')::bigint[]);
    END IF;
END $$;
