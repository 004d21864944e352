-- `almanac.enqueue` inserts its one job itself (issue #24: the function
-- must add nothing measurable to enqueue). Until now it called
-- `almanac.enqueue_many` with arrays of one element: a second PL/pgSQL
-- call, returning its row through a set (a tuplestore), and the batch's
-- checks over ten arrays. In `pgbench` (2 clients, CPU-bound) that nested
-- call cost about a tenth of a one-job transaction.
--
-- What stays one implementation: every refusal. A job that fails any check
-- below is handed to `almanac.enqueue_many`, which names the problem and
-- raises it (SQLSTATE 22023), exactly as before; the expression here only
-- decides that one is there, and is the same test as enqueue_many's (a
-- test in tests/it/enqueue_sql.rs feeds both functions the same values
-- and compares what each stores and refuses). The INSERT is enqueue_many's
-- one-job INSERT with scalars in place of the arrays' first elements, and
-- without the scheduler's `schedule` and `logical_run`, which this
-- function never took.
--
-- Same signature, so CREATE OR REPLACE keeps the function's grants and its
-- comment.
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
BEGIN
    -- A NULL value takes its default, as in enqueue_many; a NULL in this
    -- expression (a defaulted value) is no problem.
    IF enqueue.kind IS NULL OR enqueue.kind !~ '\S'
       OR enqueue.max_attempts < 1
       OR enqueue.priority NOT BETWEEN 0 AND 9
       OR enqueue.idempotency_key = ''
       OR enqueue.ordering_key = ''
       OR NOT almanac.traceparent_ok(enqueue.traceparent)
    THEN
        PERFORM almanac.enqueue_many(
            kinds => ARRAY[enqueue.kind],
            max_attempts => ARRAY[enqueue.max_attempts],
            idempotency_keys => ARRAY[enqueue.idempotency_key],
            priorities => ARRAY[enqueue.priority],
            ordering_keys => ARRAY[enqueue.ordering_key],
            traceparents => ARRAY[enqueue.traceparent]);
        -- Unreachable while the two tests agree; should they ever not,
        -- the error takes the job enqueue_many inserted down with it.
        RAISE EXCEPTION 'almanac.enqueue found a problem with job kind % that almanac.enqueue_many did not; report this',
            quote_nullable(enqueue.kind) USING ERRCODE = 'internal_error';
    END IF;

    INSERT INTO almanac.jobs AS j
        (kind, payload, run_at, max_attempts, idempotency_key, priority, ordering_key, traceparent)
    VALUES (enqueue.kind,
            coalesce(enqueue.payload, '{}'),
            coalesce(enqueue.run_at, now()),
            coalesce(enqueue.max_attempts, 5),
            enqueue.idempotency_key,
            coalesce(enqueue.priority, 0),
            enqueue.ordering_key,
            enqueue.traceparent)
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING j.id INTO enqueue.id;
    enqueue.created := FOUND;
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
