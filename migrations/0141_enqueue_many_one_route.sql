-- `almanac.enqueue_many` reads its batch's route as one value. Since 0139
-- only a batch of one kind takes the fast path, yet the function still
-- locked and read the route of every distinct kind into two arrays and
-- joined them into its inserts: for a batch of several kinds that was a
-- wasted query (the trigger locks and reads each row's kind again), and
-- for a batch of one kind a join where a value will do. Now the batch's
-- kinds are compared with its first by one expression, and only a batch of
-- one kind without ordering keys takes the kind's lock and reads its route,
-- as `almanac.enqueue` does for its one job. What is stored is unchanged
-- (tests/it/enqueue_routes.rs).
--
-- The text edits go through `almanac.edit_function`, created here for this
-- and later migrations (0126 and 0135-0140 each carried their own copy of
-- its loop).
SET LOCAL lock_timeout = '10s';

CREATE FUNCTION almanac.edit_function(p_fn regprocedure, p_edits text[], p_from text)
RETURNS void
LANGUAGE plpgsql AS $$
-- Replaces, in the definition PostgreSQL holds for p_fn, each p_edits[i][1]
-- with p_edits[i][2], after checking the old text is there exactly
-- p_edits[i][3] times; refuses (naming p_from, the migration that left the
-- expected text) a function that is not as expected, so a migration never
-- half-applies an edit.
DECLARE
    v_def text := pg_get_functiondef(p_fn);
    i integer;
BEGIN
    FOR i IN 1 .. array_length(p_edits, 1) LOOP
        IF (length(v_def) - length(replace(v_def, p_edits[i][1], ''))) / length(p_edits[i][1])
           <> p_edits[i][3]::integer THEN
            RAISE EXCEPTION '% is not the function % left (% is not there % times); restore it first',
                p_fn, p_from, p_edits[i][1], p_edits[i][3];
        END IF;
        v_def := replace(v_def, p_edits[i][1], p_edits[i][2]);
    END LOOP;
    EXECUTE v_def;
END $$;

SELECT almanac.edit_function(
    'almanac.enqueue_many(text[], jsonb[], timestamptz[], integer[], text[], integer[], text[], text[], text[], text[])'::regprocedure,
    ARRAY[
        [E'    v_rkinds text[];\n    v_rmodes text[];\n',
         E'    v_one_kind text;\n    v_route text;\n', '1'],
        [$e$    -- The batch's routes (0137), once per kind: each kind's route lock,
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
        -- One kind only (0139): the marker names it.
        v_routed := v_routed AND cardinality(v_rkinds) = 1;
    END IF;$e$,
         $e$    -- The batch's route (0137; 0139, 0141): a batch of one kind without
    -- ordering keys takes the kind's route lock, then a new statement reads
    -- its route, as almanac.enqueue does. A batch of several kinds, with an
    -- ordering key, or of an ordered kind is routed by the trigger.
    v_one_kind := enqueue_many.kinds[array_lower(enqueue_many.kinds, 1)];
    IF v_one_kind = ALL (enqueue_many.kinds)
       AND coalesce(num_nonnulls(VARIADIC enqueue_many.ordering_keys), 0) = 0 THEN
        PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || v_one_kind));
        SELECT coalesce(r.mode, 'db'), o.kind IS NULL INTO v_route, v_routed
        FROM (SELECT v_one_kind AS kind) AS k
        LEFT JOIN almanac.routes AS r ON r.kind = k.kind
        LEFT JOIN almanac.kind_ordering AS o ON o.kind = k.kind;
    END IF;$e$, '1'],
        [$e$|| ':' || v_rmodes[1] || ':' || v_rkinds[1], true);$e$,
         $e$|| ':' || v_route || ':' || v_one_kind, true);$e$, '1'],
        [$e$t.okey, t.tp, coalesce(r.mode, 'db')$e$, $e$t.okey, t.tp, coalesce(v_route, 'db')$e$, '2'],
        [E'\n            LEFT JOIN unnest(v_rkinds, v_rmodes) AS r(kind, mode) ON r.kind = t.kind', '', '1'],
        [E'\n        LEFT JOIN unnest(v_rkinds, v_rmodes) AS r(kind, mode) ON r.kind = t.kind', '', '1']],
    '0140');
