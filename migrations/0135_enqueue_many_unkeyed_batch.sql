-- A batch in which no job has an idempotency key (`idempotency_keys` NULL,
-- as the Rust API sends it when no job has one and SQL callers by
-- default) cannot conflict on a key: `almanac.enqueue_many` now inserts it
-- without `ON CONFLICT` (PostgreSQL's speculative insertion, about 4% of
-- the database's CPU for a batch of 1,000 in a `perf` profile) and returns
-- its rows straight from the insert, without pairing returned ids with
-- keys (issue #24: the function must add nothing measurable to enqueue).
-- What the batch stores, returns and notifies is what the keyed path gives
-- a batch without keys: every job new, the ids ascending in input order,
-- one notification per kind.
--
-- Like 0126, this edits the function PostgreSQL holds rather than copying
-- its 250 lines: the new path goes before the batch's keyed insert, and
-- the migration refuses to run on a function whose text is not 0126's.
SET LOCAL lock_timeout = '10s';

DO $$
DECLARE
    v_sig constant regprocedure := 'almanac.enqueue_many(text[], jsonb[], timestamptz[], integer[], text[], integer[], text[], text[], text[], text[])'::regprocedure;
    v_def text := pg_get_functiondef(v_sig);
    v_anchor constant text := E'    -- One statement inserts the rows in input order.';
    v_unkeyed constant text := $body$    -- No job has a key (0135): nothing can conflict, so the rows go in
    -- without ON CONFLICT, every job is new, and the ids, drawn as the
    -- rows are inserted in input order, ascend in input order.
    IF enqueue_many.idempotency_keys IS NULL THEN
        RETURN QUERY
        WITH ins AS (
            INSERT INTO almanac.jobs AS j
                (kind, payload, run_at, max_attempts, schedule, logical_run, priority,
                 ordering_key, traceparent)
            SELECT t.kind, coalesce(t.payload, '{}'), coalesce(t.run_at, now()),
                   coalesce(t.max_attempts, 5), t.schedule, t.logical_run, coalesce(t.priority, 0),
                   t.okey, t.tp
            FROM unnest(enqueue_many.kinds, enqueue_many.payloads, enqueue_many.run_ats,
                        enqueue_many.max_attempts, enqueue_many.schedules, enqueue_many.logical_runs,
                        enqueue_many.priorities, enqueue_many.ordering_keys, enqueue_many.traceparents)
                 WITH ORDINALITY AS t(kind, payload, run_at, max_attempts, schedule, logical_run,
                                      priority, okey, tp, i)
            ORDER BY t.i
            RETURNING j.id
        )
        SELECT row_number() OVER (ORDER BY ins.id), ins.id, true FROM ins;
        FOREACH v_kind IN ARRAY (SELECT array_agg(DISTINCT k.kind) FROM unnest(enqueue_many.kinds) AS k(kind)) LOOP
            PERFORM pg_notify('almanac_jobs', v_kind);
        END LOOP;
        RETURN;
    END IF;

$body$;
BEGIN
    IF (length(v_def) - length(replace(v_def, v_anchor, ''))) / length(v_anchor) <> 1
       OR position('ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING' IN v_def) = 0
       OR position('(0135)' IN v_def) > 0 THEN
        RAISE EXCEPTION 'almanac.enqueue_many is not the function 0126 left; restore it first';
    END IF;
    EXECUTE replace(v_def, v_anchor, v_unkeyed || v_anchor);
END $$;
