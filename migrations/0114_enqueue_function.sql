-- Enqueue as SQL functions (issue #24): `almanac.enqueue_many` is the one
-- implementation of enqueue; `almanac.enqueue` is its one-job form, and the
-- Rust API (`queue::enqueue_many`), the CLI and every other language call
-- them. docs/enqueue.md is their user's guide.
--
-- What a call does, in the caller's transaction (it commits or rolls back
-- with the caller's own rows):
-- - checks every job first (the Rust `NewJob::validate` rules): a bad one
--   fails the whole call with SQLSTATE 22023 and a message that names the
--   value, and nothing is inserted;
-- - inserts the jobs in input order, `ON CONFLICT (idempotency_key) DO
--   NOTHING`: a key already taken, by a row that exists or by a job earlier
--   in the same call, inserts nothing and reports the job holding it
--   (`created` false);
-- - the triggers on almanac.jobs give each new row its kind's route and,
--   for `dual` and `broker` kinds, its outbox row (jobs_take_route,
--   jobs_to_outbox), as for any insert;
-- - `pg_notify('almanac_jobs', kind)` once per kind that got a new row:
--   workers hear it when the transaction commits, never before.
--
-- Later migrations add parameters (an ordering key, a traceparent: issue
-- #24 items 2 and 3) by dropping these functions and creating them anew
-- with the new parameters last and defaulted, so that calls written
-- against this version keep working. (CREATE OR REPLACE cannot add a
-- parameter: it would create a second function beside this one.)
--
-- Parameters are `integer`, not `smallint`, so that `priority => 5`
-- resolves from every driver (an integer literal or an int4 parameter has
-- no implicit cast to smallint); the range is checked here.

CREATE FUNCTION almanac.enqueue_many(
    kinds text[],
    payloads jsonb[] DEFAULT NULL,
    run_ats timestamptz[] DEFAULT NULL,
    max_attempts integer[] DEFAULT NULL,
    idempotency_keys text[] DEFAULT NULL,
    priorities integer[] DEFAULT NULL,
    schedules text[] DEFAULT NULL,
    logical_runs text[] DEFAULT NULL,
    OUT ord bigint,
    OUT id bigint,
    OUT created boolean)
RETURNS SETOF record
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    n integer := cardinality(enqueue_many.kinds);
    v_bad record;
    v_ids bigint[];
    v_keys text[];
    v_kinds text[];
    v_kind text;
    v_key text;
    v_created boolean[];
    v_missing integer;
BEGIN
    -- Every check is first made as one plain expression, which PL/pgSQL
    -- evaluates without a query; only a call that fails one runs the query
    -- that finds and names the culprit. (A query costs more than the rest
    -- of a one-job call.)

    -- The arrays are parallel: element i of each describes job i. A NULL
    -- array (or a NULL element) takes the default.
    IF enqueue_many.kinds IS NULL THEN
        RAISE EXCEPTION 'kinds is NULL; give one kind per job (an empty array enqueues nothing)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF array_ndims(enqueue_many.kinds) > 1
       OR cardinality(enqueue_many.payloads) <> n OR array_ndims(enqueue_many.payloads) > 1
       OR cardinality(enqueue_many.run_ats) <> n OR array_ndims(enqueue_many.run_ats) > 1
       OR cardinality(enqueue_many.max_attempts) <> n OR array_ndims(enqueue_many.max_attempts) > 1
       OR cardinality(enqueue_many.idempotency_keys) <> n OR array_ndims(enqueue_many.idempotency_keys) > 1
       OR cardinality(enqueue_many.priorities) <> n OR array_ndims(enqueue_many.priorities) > 1
       OR cardinality(enqueue_many.schedules) <> n OR array_ndims(enqueue_many.schedules) > 1
       OR cardinality(enqueue_many.logical_runs) <> n OR array_ndims(enqueue_many.logical_runs) > 1
    THEN
        SELECT a.name, a.len, a.dims INTO v_bad
        FROM (VALUES
            ('kinds', cardinality(enqueue_many.kinds), array_ndims(enqueue_many.kinds)),
            ('payloads', cardinality(enqueue_many.payloads), array_ndims(enqueue_many.payloads)),
            ('run_ats', cardinality(enqueue_many.run_ats), array_ndims(enqueue_many.run_ats)),
            ('max_attempts', cardinality(enqueue_many.max_attempts), array_ndims(enqueue_many.max_attempts)),
            ('idempotency_keys', cardinality(enqueue_many.idempotency_keys), array_ndims(enqueue_many.idempotency_keys)),
            ('priorities', cardinality(enqueue_many.priorities), array_ndims(enqueue_many.priorities)),
            ('schedules', cardinality(enqueue_many.schedules), array_ndims(enqueue_many.schedules)),
            ('logical_runs', cardinality(enqueue_many.logical_runs), array_ndims(enqueue_many.logical_runs))
        ) AS a(name, len, dims)
        -- A NULL array has no length; '{}' has length 0 and no dimensions.
        WHERE a.dims > 1 OR a.len <> n
        ORDER BY a.dims > 1 DESC
        LIMIT 1;
        IF v_bad.dims > 1 THEN
            RAISE EXCEPTION '% has % dimensions; give a one-dimensional array, one element per job',
                v_bad.name, v_bad.dims USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RAISE EXCEPTION '% has % element%, kinds has %; give one element per job, or NULL for all defaults',
            v_bad.name, v_bad.len, CASE WHEN v_bad.len = 1 THEN '' ELSE 's' END, n
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;

    -- Every job is checked before anything is inserted: the first bad one
    -- fails the call, naming its value (and its place, in a batch). A kind
    -- of white space only is found in the kinds joined with a separator
    -- (a kind that holds the separator can make this suspect a good call;
    -- the query then finds nothing wrong and the call goes on).
    IF array_position(enqueue_many.kinds, NULL) IS NOT NULL
       OR array_to_string(enqueue_many.kinds, E'\x01', E'\x02') ~ '(^|\x01)\s*(\x01|$)'
       OR 1 > ANY (enqueue_many.max_attempts)
       OR 0 > ANY (enqueue_many.priorities) OR 9 < ANY (enqueue_many.priorities)
       OR '' = ANY (enqueue_many.idempotency_keys)
    THEN
        SELECT t.i, CASE
            WHEN t.kind IS NULL OR t.kind !~ '\S' THEN
                format('the job kind is %s; give the kind its handlers are registered under',
                       CASE WHEN t.kind IS NULL THEN 'NULL' WHEN t.kind = '' THEN 'empty'
                            ELSE quote_literal(t.kind) || ' (white space only)' END)
            WHEN t.max_attempts < 1 THEN
                format('max_attempts is %s; it must be at least 1', t.max_attempts)
            WHEN t.priority NOT BETWEEN 0 AND 9 THEN
                format('priority is %s; it must be 0 (the default) to 9, higher first', t.priority)
            WHEN t.key = '' THEN
                'the idempotency key is empty; omit it or give a value'
            END AS problem
        INTO v_bad
        FROM unnest(enqueue_many.kinds, enqueue_many.max_attempts, enqueue_many.priorities,
                    enqueue_many.idempotency_keys)
             WITH ORDINALITY AS t(kind, max_attempts, priority, key, i)
        WHERE t.kind IS NULL OR t.kind !~ '\S' OR t.max_attempts < 1
           OR t.priority NOT BETWEEN 0 AND 9 OR t.key = ''
        ORDER BY t.i
        LIMIT 1;
        IF FOUND AND n > 1 THEN
            RAISE EXCEPTION '% (job % of %)', v_bad.problem, v_bad.i, n
                USING ERRCODE = 'invalid_parameter_value';
        ELSIF FOUND THEN
            RAISE EXCEPTION '%', v_bad.problem USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;

    IF n = 1 THEN
        -- One job (every almanac.enqueue call): the same insert as below,
        -- of one row of values, which is cheaper than unnest and its
        -- aggregates. Elements are taken by position, whatever an array's
        -- lower bound.
        INSERT INTO almanac.jobs AS j
            (kind, payload, run_at, max_attempts, idempotency_key, schedule, logical_run, priority)
        VALUES (enqueue_many.kinds[array_lower(enqueue_many.kinds, 1)],
                coalesce(enqueue_many.payloads[array_lower(enqueue_many.payloads, 1)], '{}'),
                coalesce(enqueue_many.run_ats[array_lower(enqueue_many.run_ats, 1)], now()),
                coalesce(enqueue_many.max_attempts[array_lower(enqueue_many.max_attempts, 1)], 5),
                enqueue_many.idempotency_keys[array_lower(enqueue_many.idempotency_keys, 1)],
                enqueue_many.schedules[array_lower(enqueue_many.schedules, 1)],
                enqueue_many.logical_runs[array_lower(enqueue_many.logical_runs, 1)],
                coalesce(enqueue_many.priorities[array_lower(enqueue_many.priorities, 1)], 0))
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING j.id, j.kind INTO id, v_kind;
        ord := 1;
        created := FOUND;
        IF created THEN
            PERFORM pg_notify('almanac_jobs', v_kind);
        ELSE
            -- As below: a fresh statement finds the key's holder.
            v_key := enqueue_many.idempotency_keys[array_lower(enqueue_many.idempotency_keys, 1)];
            id := (SELECT j.id FROM almanac.jobs AS j WHERE j.idempotency_key = v_key);
            IF id IS NULL THEN
                RAISE EXCEPTION 'idempotency key `%` conflicted but its job is not visible to this transaction; retry',
                    v_key USING ERRCODE = 'serialization_failure';
            END IF;
        END IF;
        RETURN NEXT;
        RETURN;
    END IF;

    -- One statement inserts the rows in input order. Identity values are
    -- drawn as the rows are inserted, so the new ids ascend in input order.
    WITH ins AS (
        INSERT INTO almanac.jobs AS j
            (kind, payload, run_at, max_attempts, idempotency_key, schedule, logical_run, priority)
        SELECT t.kind, coalesce(t.payload, '{}'), coalesce(t.run_at, now()),
               coalesce(t.max_attempts, 5), t.key, t.schedule, t.logical_run, coalesce(t.priority, 0)
        FROM unnest(enqueue_many.kinds, enqueue_many.payloads, enqueue_many.run_ats,
                    enqueue_many.max_attempts, enqueue_many.idempotency_keys,
                    enqueue_many.schedules, enqueue_many.logical_runs, enqueue_many.priorities)
             WITH ORDINALITY AS t(kind, payload, run_at, max_attempts, key, schedule, logical_run,
                                  priority, i)
        -- Of jobs with the same key in one call, the first is inserted.
        ORDER BY t.i
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING j.id, j.kind, j.idempotency_key
    )
    SELECT array_agg(ins.id ORDER BY ins.id), array_agg(ins.idempotency_key ORDER BY ins.id),
           array_agg(DISTINCT ins.kind)
    INTO v_ids, v_keys, v_kinds
    FROM ins;

    -- Workers hear of each kind that got a new row when the transaction
    -- commits (never before, never after a rollback).
    FOREACH v_kind IN ARRAY coalesce(v_kinds, '{}') LOOP
        PERFORM pg_notify('almanac_jobs', v_kind);
    END LOOP;

    IF cardinality(v_ids) = n THEN
        -- Every job is new; the ids, ascending, are in input order.
        RETURN QUERY SELECT t.i, t.id, true FROM unnest(v_ids) WITH ORDINALITY AS t(id, i) ORDER BY t.i;
        RETURN;
    END IF;

    -- Some jobs were not inserted: their key was taken before this call or
    -- earlier in it. The new rows pair up with their jobs: a keyed row with
    -- the first job of its key, the unkeyed rows with the unkeyed jobs in
    -- order. The others get the holder of their key, read by this fresh
    -- statement, which sees the rows this call inserted and (under READ
    -- COMMITTED) a row another transaction committed while this insert
    -- waited on its key.
    SELECT array_agg(p.id ORDER BY p.i), array_agg(p.created ORDER BY p.i)
    INTO v_ids, v_created
    FROM (
        SELECT t.i, coalesce(n_keyed.id, n_unkeyed.id,
                             (SELECT j.id FROM almanac.jobs AS j WHERE j.idempotency_key = t.key)) AS id,
               coalesce(n_keyed.id, n_unkeyed.id) IS NOT NULL AS created
        FROM (SELECT u.i, u.key,
                     row_number() OVER (PARTITION BY u.key ORDER BY u.i) AS nth,
                     row_number() OVER (PARTITION BY u.key IS NULL ORDER BY u.i) AS unkeyed_nth
              FROM unnest(enqueue_many.idempotency_keys) WITH ORDINALITY AS u(key, i)) AS t
        LEFT JOIN unnest(v_ids, v_keys) AS n_keyed(id, key)
               ON t.key IS NOT NULL AND t.nth = 1 AND n_keyed.key = t.key
        LEFT JOIN (SELECT x.id, row_number() OVER (ORDER BY x.id) AS nth
                   FROM unnest(v_ids, v_keys) AS x(id, key) WHERE x.key IS NULL) AS n_unkeyed
               ON t.key IS NULL AND n_unkeyed.nth = t.unkeyed_nth
    ) AS p;
    v_missing := array_position(v_ids, NULL);
    IF v_missing IS NOT NULL THEN
        -- The row that held the key was deleted since (retention, an
        -- operator): a retry inserts the job, or finds the key's new holder.
        RAISE EXCEPTION 'idempotency key `%` conflicted but its job is not visible to this transaction; retry',
            enqueue_many.idempotency_keys[array_lower(enqueue_many.idempotency_keys, 1) + v_missing - 1]
            USING ERRCODE = 'serialization_failure';
    END IF;
    RETURN QUERY
    SELECT t.i, t.id, t.created
    FROM unnest(v_ids, v_created) WITH ORDINALITY AS t(id, created, i)
    ORDER BY t.i;
END
$$;

COMMENT ON FUNCTION almanac.enqueue_many(text[], jsonb[], timestamptz[], integer[], text[], integer[], text[], text[]) IS
'Enqueues jobs in the caller''s transaction; the one implementation of enqueue (docs/enqueue.md).
Parallel arrays, element i of each describing job i; a NULL array or element takes the default:
payload {}, run_at now(), max_attempts 5, no idempotency key, priority 0 (0 to 9, higher first).
schedules and logical_runs are set by the scheduler for the jobs of schedule runs; leave them NULL.
Returns one row per job, in input order: (ord, id, created); created is false when the
idempotency key was taken (by a row that exists or earlier in the call) and id is that job''s.
Arrays of different lengths and invalid values raise SQLSTATE 22023, inserting nothing.';

CREATE FUNCTION almanac.enqueue(
    kind text,
    payload jsonb DEFAULT '{}',
    run_at timestamptz DEFAULT NULL,
    max_attempts integer DEFAULT NULL,
    idempotency_key text DEFAULT NULL,
    priority integer DEFAULT 0,
    OUT id bigint,
    OUT created boolean)
LANGUAGE plpgsql
AS $$
BEGIN
    -- PL/pgSQL keeps the plan of this statement for the session (a SQL
    -- function would plan it on every call).
    SELECT e.id, e.created INTO enqueue.id, enqueue.created
    FROM almanac.enqueue_many(
        kinds => ARRAY[enqueue.kind],
        payloads => ARRAY[enqueue.payload],
        run_ats => ARRAY[enqueue.run_at],
        max_attempts => ARRAY[enqueue.max_attempts],
        idempotency_keys => ARRAY[enqueue.idempotency_key],
        priorities => ARRAY[enqueue.priority]) AS e;
END
$$;

COMMENT ON FUNCTION almanac.enqueue(text, jsonb, timestamptz, integer, text, integer) IS
'Enqueues one job in the caller''s transaction: SELECT id, created FROM almanac.enqueue(''send_email'',
''{"to": "ada@example.com"}'', idempotency_key => ''welcome:ada''). Defaults: payload {}, run_at now(),
max_attempts 5, no idempotency key, priority 0 (0 to 9, higher first). created is false when the
idempotency key was taken; id is then the existing job''s. Invalid values raise SQLSTATE 22023,
inserting nothing. See almanac.enqueue_many and docs/enqueue.md.';
