-- Order per key (issue #24 item 2), the release measured again: a batch of
-- 200 completions of ordered jobs spent about 1 ms in the row trigger that
-- notes each ended key (a plpgsql call per row, each rewriting a
-- transaction-local setting that grows by one key a row: quadratic, so one
-- statement ending 80,000 ordered jobs took 63 s), and most of the
-- release's time in a loop that sent one NOTIFY per released job through
-- its own SPI call (PostgreSQL keeps one of identical notifications of a
-- transaction anyway).
--
-- Now the ended keys come from the statement's transition tables, which
-- the counters' triggers (0128) already have PostgreSQL keep for every
-- statement on almanac.jobs, and the release notifies once per kind.
-- Behaviour is 0118's and 0120's: the same keys are released, under the
-- same locks and waits, and workers hear the same notifications.
--
-- Transition tables cannot go with a column list (`UPDATE OF status`) or
-- with two events, so there is one trigger for UPDATE and one for DELETE,
-- and the UPDATE one fires for every UPDATE of jobs (heartbeats too): it
-- first looks for an old row with an ordering key, and for a new row that
-- ended, and returns when either is missing (a scan of the statement's rows,
-- as the counters make).
SET LOCAL lock_timeout = '10s';

CREATE OR REPLACE FUNCTION almanac.release_keys(p_kinds text[], p_keys text[]) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_ids bigint[];
    v_taken bigint[];
    v_kind text;
    v_n integer;
    v_released integer := 0;
BEGIN
    SELECT array_agg(h.id) INTO v_ids
    FROM unnest(p_kinds, p_keys) AS k(kind, key)
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

-- The keys a statement ended, as 0118's row trigger noted them: a job
-- that could stand before others (ready, running, dead, held) that ended
-- (done, cancelled, dead: a new status) or was deleted.
CREATE FUNCTION almanac.jobs_release_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_kinds text[];
    v_keys text[];
    v_got boolean[];
BEGIN
    IF NOT EXISTS (SELECT 1 FROM ended_old AS o
                   WHERE o.ordering_key IS NOT NULL
                     AND o.status IN ('ready', 'running', 'dead', 'held')) THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        -- Claims, heartbeats and releases of ordered jobs end none.
        IF NOT EXISTS (SELECT 1 FROM ended_new AS n
                       WHERE n.status IN ('done', 'cancelled', 'dead')) THEN
            RETURN NULL;
        END IF;
        -- EXECUTE: planned on every call. A plan kept for the session
        -- would keep the first call's row counts (a claim of one job: a
        -- nested loop), and a later statement of 20,000 rows on the same
        -- connection would join them in 33 s instead of 0.15. (Rows are
        -- paired by id: nothing changes a job's id.)
        EXECUTE $q$
            SELECT array_agg(k.kind ORDER BY k.kind, k.key), array_agg(k.key ORDER BY k.kind, k.key)
            FROM (SELECT DISTINCT o.kind, o.ordering_key AS key
                  FROM ended_old AS o JOIN ended_new AS n ON n.id = o.id
                  WHERE o.ordering_key IS NOT NULL
                    AND o.status IN ('ready', 'running', 'dead', 'held')
                    AND n.status IN ('done', 'cancelled', 'dead')
                    AND n.status <> o.status) AS k $q$
        INTO v_kinds, v_keys;
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
              WHERE k.got ORDER BY k.i));
    RETURN NULL;
END $$;

DROP TRIGGER jobs_note_ended_key ON almanac.jobs;
DROP TRIGGER jobs_note_ended_key_on_delete ON almanac.jobs;
DROP TRIGGER jobs_release_keys ON almanac.jobs;
DROP FUNCTION almanac.jobs_note_ended_key();
DROP FUNCTION almanac.jobs_release_keys();

CREATE TRIGGER jobs_release_ended_update AFTER UPDATE ON almanac.jobs
    REFERENCING OLD TABLE AS ended_old NEW TABLE AS ended_new
    FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_release_ended();
CREATE TRIGGER jobs_release_ended_delete AFTER DELETE ON almanac.jobs
    REFERENCING OLD TABLE AS ended_old
    FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_release_ended();
