-- Fixes to 0134 and 0135, found in review before they were released:
--
-- 1. PL/pgSQL parses the string literals of a function's statements with
--    the calling session's `standard_conforming_strings`. With it off (an
--    old application's setting), `'\S'` is the pattern `S`, so 0134's
--    check found a problem with every kind without a capital S, handed the
--    job to `enqueue_many`, which accepted it, and the call then failed on
--    its "unreachable" error. The checks now say `[^[:space:]]` and
--    `[[:space:]]` (what `\S` and `\s` mean), with no backslash, in
--    `almanac.enqueue` and in `almanac.enqueue_many` (whose own checks, since
--    0115, refused a kind like 'sss' as "white space only" in such a
--    session). The batch check's separators are E'' literals, read the same
--    in every session.
-- 2. Should the two functions' checks ever disagree again, a job
--    `almanac.enqueue` doubts goes through `almanac.enqueue_many` with every
--    argument, and its answer is returned (what `almanac.enqueue` did before
--    0134): a disagreement costs speed, never a refused good job.
-- 3. 0135's unkeyed batch returns its rows ordered by `ord`, as the other
--    paths do (callers that read the rows without ORDER BY get them in
--    input order).
SET LOCAL lock_timeout = '10s';

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

    -- enqueue_many's one-job insert, with scalars for the arrays' elements
    -- (a test compares what the two store and refuse).
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

DO $$
DECLARE
    v_sig constant regprocedure := 'almanac.enqueue_many(text[], jsonb[], timestamptz[], integer[], text[], integer[], text[], text[], text[], text[])'::regprocedure;
    v_def text := pg_get_functiondef(v_sig);
    -- (old text, new text, how many times the old text is there)
    v_edits constant text[][] := ARRAY[
        [$e$~ '(^|\x01)\s*(\x01|$)'$e$, $e$~ E'(^|\\x01)[[:space:]]*(\\x01|$)'$e$, '1'],
        [$e$!~ '\S'$e$, $e$!~ '[^[:space:]]'$e$, '2'],
        [$e$SELECT row_number() OVER (ORDER BY ins.id), ins.id, true FROM ins;$e$,
         $e$SELECT row_number() OVER (ORDER BY ins.id), ins.id, true FROM ins ORDER BY 1;$e$, '1'],
        [$e$-- One job (every almanac.enqueue call): the same insert as below,$e$,
         $e$-- One job (almanac.enqueue has its own copy, 0134): the same insert as below,$e$, '1']];
    i integer;
BEGIN
    FOR i IN 1 .. array_length(v_edits, 1) LOOP
        IF (length(v_def) - length(replace(v_def, v_edits[i][1], ''))) / length(v_edits[i][1])
           <> v_edits[i][3]::integer THEN
            RAISE EXCEPTION 'almanac.enqueue_many is not the function 0135 left (% is not there % times); restore it first',
                v_edits[i][1], v_edits[i][3];
        END IF;
        v_def := replace(v_def, v_edits[i][1], v_edits[i][2]);
    END LOOP;
    EXECUTE v_def;
END $$;
