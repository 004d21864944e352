-- Order per key (issue #24 item 2): the completion that claims released
-- jobs (0130) costs less database CPU. Nothing it does changes.
--
-- 1. `almanac.complete_claiming` returned each completed row as
--    `(jsonb_populate_record(done.j, '{"payload": {}}')).*`, and PostgreSQL
--    expands `(f(x)).*` into one call of `f` per column: 22 calls of
--    `jsonb_populate_record` per completed job. In `psql`, 20,000 rows took
--    370 ms that way and 60 ms with the function called once in `FROM`.
-- 2. The release's statements are planned once per session, not on every
--    call (below).
-- 3. `release_keys` claims released jobs through a plan that holds for
--    any number of them (below).
SET LOCAL lock_timeout = '10s';

CREATE OR REPLACE FUNCTION almanac.complete_claiming(p_ids bigint[], p_tokens uuid[], p_lease_ms bigint,
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
        SELECT r.* FROM done CROSS JOIN LATERAL jsonb_populate_record(done.j, '{"payload": {}}') AS r;
    PERFORM set_config('almanac.claim_successors', '', true);
    v_claimed := current_setting('almanac.claimed_successors', true);
    PERFORM set_config('almanac.claimed_successors', '', true);
    IF coalesce(v_claimed, '') <> '' THEN
        RETURN QUERY SELECT j.* FROM almanac.jobs AS j
                     WHERE j.id = ANY (string_to_array(v_claimed, ',')::bigint[]);
    END IF;
END $$;

-- A completion's statements, and those of the release its trigger runs,
-- are planned once per session, not on every call: the setting holds for
-- the call and everything it calls. PL/pgSQL keeps each statement's plan,
-- but the plan cache went on making a custom plan on every call (its
-- generic plan's estimate for arrays of unknown length never looked
-- cheaper): in one `almanac bench --ordering-only` run, planning took
-- about 3 of the 15 seconds the completions of 150,000 ordered jobs spent
-- in the database (pg_stat_statements, `track = all`). Their generic plans
-- are the custom ones: index probes by id, and by kind and key, for each
-- element of the completion's arrays (at most its batch). Only this call
-- forces them: `release_keys` also runs for statements that end tens of
-- thousands of keys at once (a bulk cancel), where a custom plan's
-- constant arrays are hashed and a generic plan's parameters are scanned
-- per row. The trigger's look at its transition tables stays planned on
-- every call (an EXECUTE, see 0129).
ALTER FUNCTION almanac.complete_claiming(bigint[], uuid[], bigint, text[])
    SET plan_cache_mode = force_generic_plan;

-- 0130's `release_keys`, its claim of released jobs (which runs only
-- under `complete_claiming`) written so that the generic plan drives the
-- update from the released ids, an index probe each: written as a join of
-- the table to the ids with the table's own `id = ANY (...)` beside it,
-- that plan scanned the ids once per row it updated. (The remaining
-- `u.id = ANY (v_taken)` is a scan of v_taken per released id: 1.7 ms for
-- a completion of 1,000 keys in `psql`, against about 75 ms for the
-- completion.) The rest is 0130's.
CREATE OR REPLACE FUNCTION almanac.release_keys(p_kinds text[], p_keys text[], p_after uuid[]) RETURNS integer
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
            FROM (SELECT u.id, u.after FROM unnest(v_ids, v_after) AS u(id, after)
                  WHERE u.after IS NOT NULL AND u.id = ANY (v_taken)) AS s
            WHERE j.id = s.id
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
