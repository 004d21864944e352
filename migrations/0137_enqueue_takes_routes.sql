-- `almanac.enqueue` and `almanac.enqueue_many` take their jobs' routes
-- themselves, once per kind, instead of leaving it to the insert trigger
-- `jobs_take_route`, which runs once per row (issue #24: the functions must
-- add nothing measurable to enqueue). In a `perf` profile of batches of
-- 1,000 the trigger was about half the database's CPU; in `pgbench` a batch
-- through the function that reads the route once ran at about 1.7 times the
-- rate of one the trigger routes row by row.
--
-- What stays the same, and why it is safe:
--
-- - **Ordered against `almanac route set` as the trigger is.** For each
--   distinct kind (in sorted order) the function takes the kind's route lock
--   shared, the lock the trigger takes and `route set` and `ordering set`
--   take exclusively, and then reads `routes` in a new statement: under READ
--   COMMITTED its snapshot is taken after the lock, so it sees the last
--   committed change. The lock is held to the end of the transaction, as the
--   trigger's is. (Under REPEATABLE READ the snapshot is older, as it is for
--   the trigger; the relays' reconcile heals that case, see relay::routes.)
-- - **Ordering stays the trigger's.** A job with an ordering key, or of a
--   kind that is ordered, is routed (and held or not) by the trigger, as
--   before: the function then leaves the whole call to it.
-- - **Only the function's own insert skips the trigger.** The trigger now
--   runs unless the setting `almanac.routes_taken` holds the current
--   transaction's id; the function sets it (transaction-local) just before
--   its insert and clears it just after. An error in between rolls back the
--   transaction or the caller's savepoint, and the setting with it. Any
--   other insert, a hand-written one in the same transaction included, is
--   routed by the trigger; a value set in postgresql.conf or by
--   `ALTER ... SET` names no transaction and skips nothing.
--
-- The one-job path of `enqueue_many` (a scheduler's run, or a job
-- `almanac.enqueue` doubts) stays on the trigger.
SET LOCAL lock_timeout = '10s';

DROP TRIGGER jobs_take_route ON almanac.jobs;
CREATE TRIGGER jobs_take_route BEFORE INSERT ON almanac.jobs
    FOR EACH ROW
    WHEN (current_setting('almanac.routes_taken', true) IS DISTINCT FROM pg_current_xact_id()::text)
    EXECUTE FUNCTION almanac.jobs_take_route();

CREATE OR REPLACE FUNCTION almanac.enqueue(
    kind text,
    payload jsonb DEFAULT '{}',
    run_at timestamptz DEFAULT NULL,
    max_attempts integer DEFAULT NULL,
    idempotency_key text DEFAULT NULL,
    priority integer DEFAULT 0,
    ordering_key text DEFAULT NULL,
    traceparent text DEFAULT NULL,
    OUT id bigint,
    OUT created boolean)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_route text;
    v_routed boolean := false;
BEGIN
    -- enqueue_many's checks for one job, as one expression. A job that
    -- fails one (or that this expression only suspects) is enqueued by
    -- enqueue_many, which names the problem and refuses it (SQLSTATE
    -- 22023), or enqueues it: its checks are the only authority. A NULL
    -- value takes its default and is no problem.
    IF enqueue.kind IS NULL OR enqueue.kind !~ '[^[:space:]]'
       OR enqueue.max_attempts < 1
       OR enqueue.priority NOT BETWEEN 0 AND 9
       OR enqueue.idempotency_key = ''
       OR enqueue.ordering_key = ''
       OR NOT almanac.traceparent_ok(enqueue.traceparent)
    THEN
        SELECT e.id, e.created INTO enqueue.id, enqueue.created
        FROM almanac.enqueue_many(
            kinds => ARRAY[enqueue.kind],
            payloads => ARRAY[enqueue.payload],
            run_ats => ARRAY[enqueue.run_at],
            max_attempts => ARRAY[enqueue.max_attempts],
            idempotency_keys => ARRAY[enqueue.idempotency_key],
            priorities => ARRAY[enqueue.priority],
            ordering_keys => ARRAY[enqueue.ordering_key],
            traceparents => ARRAY[enqueue.traceparent]) AS e;
        RETURN;
    END IF;
    -- The route (0137): the kind's lock, then a new statement reads it.
    IF enqueue.ordering_key IS NULL THEN
        PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || enqueue.kind));
        SELECT coalesce(r.mode, 'db'), o.kind IS NULL INTO v_route, v_routed
        FROM (SELECT enqueue.kind AS kind) AS k
        LEFT JOIN almanac.routes AS r ON r.kind = k.kind
        LEFT JOIN almanac.kind_ordering AS o ON o.kind = k.kind;
    END IF;
    IF v_routed THEN
        PERFORM set_config('almanac.routes_taken', pg_current_xact_id()::text, true);
    END IF;
    -- enqueue_many's one-job insert, with scalars for the arrays' elements
    -- (a test compares what the two store and refuse).
    INSERT INTO almanac.jobs AS j
        (kind, payload, run_at, max_attempts, idempotency_key, priority, ordering_key, traceparent,
         route)
    VALUES (enqueue.kind,
            coalesce(enqueue.payload, '{}'),
            coalesce(enqueue.run_at, now()),
            coalesce(enqueue.max_attempts, 5),
            enqueue.idempotency_key,
            coalesce(enqueue.priority, 0),
            enqueue.ordering_key,
            enqueue.traceparent,
            coalesce(v_route, 'db'))
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING j.id INTO enqueue.id;
    enqueue.created := FOUND;
    IF v_routed THEN
        PERFORM set_config('almanac.routes_taken', '', true);
    END IF;
    IF enqueue.created THEN
        -- Workers hear of the kind when the transaction commits.
        PERFORM pg_notify('almanac_jobs', enqueue.kind);
        RETURN;
    END IF;
    -- The key was taken: a fresh statement finds its holder (under READ
    -- COMMITTED, also one committed while the insert waited on the key).
    enqueue.id := (SELECT j.id FROM almanac.jobs AS j WHERE j.idempotency_key = enqueue.idempotency_key);
    IF enqueue.id IS NULL THEN
        RAISE EXCEPTION 'idempotency key `%` conflicted but its job is not visible to this transaction; retry',
            enqueue.idempotency_key USING ERRCODE = 'serialization_failure';
    END IF;
END
$$;

-- enqueue_many: edited in place, as in 0126, 0135 and 0136; the migration
-- refuses a function whose text is not the one 0136 left.
DO $$
DECLARE
    v_sig constant regprocedure := 'almanac.enqueue_many(text[], jsonb[], timestamptz[], integer[], text[], integer[], text[], text[], text[], text[])'::regprocedure;
    v_def text := pg_get_functiondef(v_sig);
    -- (old text, new text, how many times the old text is there)
    v_edits constant text[][] := ARRAY[
        -- Declarations.
        [E'    v_missing integer;\n',
         E'    v_missing integer;\n    v_rkinds text[];\n    v_rmodes text[];\n    v_routed boolean := false;\n', '1'],
        -- Before both batch inserts: the routes.
        [E'    -- No job has a key (0135)',
         $e$    -- The batch's routes (0137), once per kind: each kind's route lock,
    -- in sorted order, then a new statement reads the routes. A batch with
    -- an ordering key or an ordered kind is routed by the trigger.
    IF coalesce(num_nonnulls(VARIADIC enqueue_many.ordering_keys), 0) = 0 THEN
        v_rkinds := ARRAY(SELECT DISTINCT k.kind FROM unnest(enqueue_many.kinds) AS k(kind) ORDER BY 1);
        PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || k.kind))
        FROM unnest(v_rkinds) AS k(kind);
        SELECT array_agg(coalesce(r.mode, 'db') ORDER BY k.i), bool_and(o.kind IS NULL)
        INTO v_rmodes, v_routed
        FROM unnest(v_rkinds) WITH ORDINALITY AS k(kind, i)
        LEFT JOIN almanac.routes AS r ON r.kind = k.kind
        LEFT JOIN almanac.kind_ordering AS o ON o.kind = k.kind;
    END IF;
    IF v_routed THEN
        PERFORM set_config('almanac.routes_taken', pg_current_xact_id()::text, true);
    END IF;

    -- No job has a key (0135)$e$, '1'],
        -- The unkeyed insert takes the route.
        [E'                 ordering_key, traceparent)\n            SELECT',
         E'                 ordering_key, traceparent, route)\n            SELECT', '1'],
        [E'                   t.okey, t.tp\n            FROM unnest(',
         E'                   t.okey, t.tp, coalesce(r.mode, \'db\')\n            FROM unnest(', '1'],
        [E'                                      priority, okey, tp, i)\n            ORDER BY t.i',
         E'                                      priority, okey, tp, i)\n            LEFT JOIN unnest(v_rkinds, v_rmodes) AS r(kind, mode) ON r.kind = t.kind\n            ORDER BY t.i', '1'],
        [E'        SELECT row_number() OVER (ORDER BY ins.id), ins.id, true FROM ins ORDER BY 1;\n',
         E'        SELECT row_number() OVER (ORDER BY ins.id), ins.id, true FROM ins ORDER BY 1;\n        IF v_routed THEN\n            PERFORM set_config(\'almanac.routes_taken\', \'\', true);\n        END IF;\n', '1'],
        -- The keyed insert takes the route.
        [E'             ordering_key, traceparent)\n        SELECT',
         E'             ordering_key, traceparent, route)\n        SELECT', '1'],
        [E'               t.okey, t.tp\n        FROM unnest(',
         E'               t.okey, t.tp, coalesce(r.mode, \'db\')\n        FROM unnest(', '1'],
        [E'                                  priority, okey, tp, i)\n        -- Of jobs',
         E'                                  priority, okey, tp, i)\n        LEFT JOIN unnest(v_rkinds, v_rmodes) AS r(kind, mode) ON r.kind = t.kind\n        -- Of jobs', '1'],
        [E'    INTO v_ids, v_keys, v_kinds\n    FROM ins;\n',
         E'    INTO v_ids, v_keys, v_kinds\n    FROM ins;\n    IF v_routed THEN\n        PERFORM set_config(\'almanac.routes_taken\', \'\', true);\n    END IF;\n', '1']];
    i integer;
BEGIN
    FOR i IN 1 .. array_length(v_edits, 1) LOOP
        IF (length(v_def) - length(replace(v_def, v_edits[i][1], ''))) / length(v_edits[i][1])
           <> v_edits[i][3]::integer THEN
            RAISE EXCEPTION 'almanac.enqueue_many is not the function 0136 left (% is not there % times); restore it first',
                v_edits[i][1], v_edits[i][3];
        END IF;
        v_def := replace(v_def, v_edits[i][1], v_edits[i][2]);
    END LOOP;
    EXECUTE v_def;
END $$;
