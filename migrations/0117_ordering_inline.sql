-- Order per key (issue #24 item 2), after measuring 0115 and 0116: a
-- release cost 0.3 ms, so a worker's batch of 200 completions of ordered
-- jobs spent 64 ms in the release trigger, which capped an ordered kind at
-- about 2,800 jobs a second (0.10 of the same jobs unordered). Three
-- causes, three changes:
--
-- - the look for a job that stands before a held one read every held job
--   of the key: 0116's index is on (kind, ordering_key, id), so `status IN
--   ('ready', 'running')` was a filter over the key's whole backlog. The
--   index here has the status as a key column: each look (the key's ready
--   or running jobs, its dead ones, its lowest held one) is a seek;
-- - that look was a SQL function (`almanac.key_blocked`) called from
--   PL/pgSQL, planned on every call (a body with a subquery is never
--   inlined). It is written out in the functions that make it, whose
--   statements keep their plans for the session;
-- - each ended job released its key with an UPDATE of its own; now one
--   UPDATE per statement releases every key the statement ended (below).
--
-- Behaviour is unchanged; `src/queue/ordering.rs` states it.
--
-- As 0109: building the index reads the whole table under a SHARE lock
-- (claims, heartbeats and enqueues wait, about a second per million jobs).
-- On a big table, build it by hand beforehand and this migration only
-- swaps the functions:
--
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_ordering_status_idx
--       ON almanac.jobs (kind, ordering_key, status, id)
--       WHERE ordering_key IS NOT NULL AND status IN ('ready', 'running', 'held', 'dead');
SET LOCAL lock_timeout = '10s';
CREATE INDEX IF NOT EXISTS jobs_ordering_status_idx ON almanac.jobs (kind, ordering_key, status, id)
    WHERE ordering_key IS NOT NULL AND status IN ('ready', 'running', 'held', 'dead');
DROP INDEX almanac.jobs_ordering_idx;

-- As 0115's: makes the key's lowest held job `ready` unless a job still
-- stands before it (ready, running, or dead when the kind halts on one),
-- now in one statement. The caller holds the key's lock and the kind's
-- route lock (shared), so the route is read as it stands. (The sweep of
-- noted keys, an operator's retry and `ordering set` call it; an ending
-- job's release is the statement trigger below.)
CREATE OR REPLACE FUNCTION almanac.release_key(p_kind text, p_key text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id bigint;
BEGIN
    UPDATE almanac.jobs AS j
    SET status = 'ready',
        route = coalesce((SELECT r.mode FROM almanac.routes AS r WHERE r.kind = p_kind), 'db')
    WHERE j.id = (SELECT h.id FROM almanac.jobs AS h
                  WHERE h.kind = p_kind AND h.ordering_key = p_key AND h.status = 'held'
                  ORDER BY h.id LIMIT 1)
      AND j.status = 'held'
      AND NOT EXISTS (
          SELECT 1 FROM almanac.jobs AS b
          WHERE b.kind = p_kind AND b.ordering_key = p_key
            AND b.status IN ('ready', 'running', 'dead')
            AND (b.status <> 'dead'
                 OR coalesce((SELECT o.on_dead = 'halt' FROM almanac.kind_ordering AS o
                              WHERE o.kind = p_kind), false)))
    RETURNING j.id INTO v_id;
    IF v_id IS NOT NULL THEN
        PERFORM pg_notify('almanac_jobs', p_kind);
    END IF;
    RETURN v_id;
END $$;

-- The release, once per statement instead of once per row. A row trigger
-- (0115's WHEN clauses: only a job with an ordering key that could stand
-- before others, ending or deleted) notes the job's key in a setting local
-- to the transaction; a statement trigger after it releases every noted key
-- with one UPDATE. An UPDATE of one row costs about 85 us here whatever it
-- changes (the executor opens the table's 13 indexes), so one per key was
-- most of a batch's time; the statement's UPDATE of 200 rows costs about
-- what two of them did. Measured on a batch of 200 completions of ordered
-- jobs: 64 ms in the release trigger under 0115, about 10 ms now.
--
-- The locks are 0115's: each key's lock is tried, then waited for at most
-- 50 ms (in a block of its own, so that the timeout can be caught; nothing
-- is written in it, so it costs no subtransaction id), and the kind's
-- route lock tried shared; a key whose locks are busy is noted in
-- almanac.ordering_recheck for the reaper. Keys are taken in one order.
-- The setting is transaction-local (set_config(..., true)), so a statement
-- or savepoint that rolls back takes its notes with it; the statement
-- trigger of every UPDATE of `status` and every DELETE on almanac.jobs
-- reads it (an empty setting returns at once), and clears it before its
-- own UPDATE, whose statement trigger then finds nothing.
CREATE FUNCTION almanac.jobs_note_ended_key() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('almanac.ended_keys',
                       coalesce(current_setting('almanac.ended_keys', true), '')
                       || json_build_array(OLD.kind, OLD.ordering_key)::text || E'\n', true);
    RETURN NULL;
END $$;

CREATE FUNCTION almanac.jobs_release_keys() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_ended text := current_setting('almanac.ended_keys', true);
    r record;
    v_kinds text[] := '{}';
    v_keys text[] := '{}';
    v_locked boolean;
    v_timeout text;
    v_kind text;
BEGIN
    IF v_ended IS NULL OR v_ended = '' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('almanac.ended_keys', '', true);
    FOR r IN
        SELECT DISTINCT k.e ->> 0 AS kind, k.e ->> 1 AS key
        FROM unnest(string_to_array(rtrim(v_ended, E'\n'), E'\n')) AS t(line),
             LATERAL (SELECT t.line::json AS e) AS k
        ORDER BY 1, 2
    LOOP
        v_locked := pg_try_advisory_xact_lock(almanac.ordering_lock_id(r.kind, r.key));
        IF NOT v_locked THEN
            v_timeout := current_setting('lock_timeout');
            PERFORM set_config('lock_timeout', '50ms', true);
            BEGIN
                PERFORM pg_advisory_xact_lock(almanac.ordering_lock_id(r.kind, r.key));
                v_locked := true;
            EXCEPTION WHEN lock_not_available THEN
                v_locked := false;
            END;
            PERFORM set_config('lock_timeout', v_timeout, true);
        END IF;
        IF v_locked AND pg_try_advisory_xact_lock_shared(hashtext('almanac.route:' || r.kind)) THEN
            v_kinds := v_kinds || r.kind;
            v_keys := v_keys || r.key;
        ELSE
            INSERT INTO almanac.ordering_recheck (kind, ordering_key) VALUES (r.kind, r.key)
            ON CONFLICT DO NOTHING;
        END IF;
    END LOOP;
    FOR v_kind IN
        WITH released AS (
            UPDATE almanac.jobs AS j
            SET status = 'ready',
                route = coalesce((SELECT rt.mode FROM almanac.routes AS rt WHERE rt.kind = j.kind), 'db')
            WHERE j.id IN (
                SELECT (SELECT h.id FROM almanac.jobs AS h
                        WHERE h.kind = k.kind AND h.ordering_key = k.key AND h.status = 'held'
                        ORDER BY h.id LIMIT 1)
                FROM unnest(v_kinds, v_keys) AS k(kind, key)
                WHERE NOT EXISTS (
                    SELECT 1 FROM almanac.jobs AS b
                    WHERE b.kind = k.kind AND b.ordering_key = k.key
                      AND b.status IN ('ready', 'running', 'dead')
                      AND (b.status <> 'dead'
                           OR coalesce((SELECT o.on_dead = 'halt' FROM almanac.kind_ordering AS o
                                        WHERE o.kind = k.kind), false))))
              AND j.status = 'held'
            RETURNING j.kind)
        SELECT DISTINCT released.kind FROM released
    LOOP
        PERFORM pg_notify('almanac_jobs', v_kind);
    END LOOP;
    RETURN NULL;
END $$;

-- As 0115's, now taking the kind's route lock (shared) itself, which
-- release_key no longer takes through almanac.route_of.
CREATE OR REPLACE FUNCTION almanac.release_held(p_ids bigint[]) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
    v_released integer := 0;
BEGIN
    FOR r IN
        SELECT DISTINCT j.kind, j.ordering_key FROM almanac.jobs AS j
        WHERE j.id = ANY (p_ids) AND j.status = 'held'
        ORDER BY j.kind, j.ordering_key
    LOOP
        PERFORM pg_advisory_xact_lock(almanac.ordering_lock_id(r.kind, r.ordering_key));
        PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || r.kind));
        IF almanac.release_key(r.kind, r.ordering_key) IS NOT NULL THEN
            v_released := v_released + 1;
        END IF;
    END LOOP;
    RETURN v_released;
END $$;


-- As 0115's, with the look for a job that stands before the new one
-- written out.
CREATE OR REPLACE FUNCTION almanac.jobs_take_route() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_mode text;
    v_ordered boolean;
    v_path text[];
    v_halt boolean;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || NEW.kind));
    SELECT r.mode, o.kind IS NOT NULL, o.key_path, o.on_dead = 'halt'
    INTO v_mode, v_ordered, v_path, v_halt
    FROM (SELECT NEW.kind AS kind) AS k
    LEFT JOIN almanac.routes AS r ON r.kind = k.kind
    LEFT JOIN almanac.kind_ordering AS o ON o.kind = k.kind;
    NEW.route := coalesce(v_mode, 'db');
    IF NOT v_ordered THEN
        IF NEW.ordering_key IS NOT NULL THEN
            RAISE EXCEPTION 'kind % is not ordered, so its job cannot take ordering key %; run `almanac ordering set %` first, or omit the key',
                quote_literal(NEW.kind), quote_literal(NEW.ordering_key), NEW.kind
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.ordering_key IS NULL AND v_path IS NOT NULL THEN
        NEW.ordering_key := NEW.payload #>> v_path;
    END IF;
    IF NEW.ordering_key IS NOT NULL AND NEW.status = 'ready' THEN
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            RAISE EXCEPTION 'a job of ordered kind % is enqueued under READ COMMITTED only, not %; enqueue it in a READ COMMITTED transaction',
                quote_literal(NEW.kind), upper(current_setting('transaction_isolation'))
                USING ERRCODE = 'feature_not_supported';
        END IF;
        PERFORM pg_advisory_xact_lock(almanac.ordering_lock_id(NEW.kind, NEW.ordering_key));
        -- Each status is a seek in jobs_ordering_status_idx.
        IF EXISTS (SELECT 1 FROM almanac.jobs AS j
                   WHERE j.kind = NEW.kind AND j.ordering_key = NEW.ordering_key
                     AND j.status IN ('ready', 'running', 'held', 'dead')
                     AND (j.status <> 'dead' OR v_halt)) THEN
            NEW.status := 'held';
        END IF;
    END IF;
    RETURN NEW;
END $$;

DROP FUNCTION almanac.key_blocked(text, text, boolean, bigint);

-- 0115's row triggers and the functions nothing calls now.
DROP TRIGGER jobs_release_key ON almanac.jobs;
DROP TRIGGER jobs_release_key_on_delete ON almanac.jobs;
CREATE TRIGGER jobs_note_ended_key AFTER UPDATE OF status ON almanac.jobs
    FOR EACH ROW
    WHEN (OLD.ordering_key IS NOT NULL AND OLD.status IN ('ready', 'running', 'dead')
          AND NEW.status IN ('done', 'cancelled', 'dead') AND NEW.status <> OLD.status)
    EXECUTE FUNCTION almanac.jobs_note_ended_key();
CREATE TRIGGER jobs_note_ended_key_on_delete AFTER DELETE ON almanac.jobs
    FOR EACH ROW
    WHEN (OLD.ordering_key IS NOT NULL AND OLD.status IN ('ready', 'running', 'dead'))
    EXECUTE FUNCTION almanac.jobs_note_ended_key();
CREATE TRIGGER jobs_release_keys AFTER UPDATE OF status OR DELETE ON almanac.jobs
    FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_release_keys();
DROP FUNCTION almanac.jobs_release_key();
DROP FUNCTION almanac.release_or_note(text, text);
