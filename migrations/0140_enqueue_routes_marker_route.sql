-- A fix to 0137-0139, found in review before they were released: a user's
-- BEFORE trigger on almanac.jobs that sorts ahead of `jobs_take_route` and
-- sets the row's `route` was obeyed for the functions' own rows (a
-- `broker` kind's job stored as `db`, with no outbox row), where the route
-- trigger overwrites it for every other insert. The marker now also names
-- the route the function chose (`<xid>:<depth>:<route>:<kind>`; a route
-- holds no colon), and the trigger runs for a row whose route is not that
-- one.
SET LOCAL lock_timeout = '10s';

CREATE OR REPLACE TRIGGER jobs_take_route BEFORE INSERT ON almanac.jobs
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL
          OR current_setting('almanac.routes_taken', true)
             IS DISTINCT FROM pg_current_xact_id()::text || ':' || pg_trigger_depth()
                              || ':' || NEW.route || ':' || NEW.kind)
    EXECUTE FUNCTION almanac.jobs_take_route();

-- Both functions edited in place, as in 0126 and 0135-0139; the migration
-- refuses a function whose text is not the one 0139 left.
DO $$
DECLARE
    v_fn regprocedure;
    v_def text;
    -- (function, old text, new text, how many times the old text is there)
    v_edits constant text[][] := ARRAY[
        ['enqueue',
         $e$pg_trigger_depth() || ':' || enqueue.kind, true);$e$,
         $e$pg_trigger_depth() || ':' || v_route || ':' || enqueue.kind, true);$e$, '1'],
        ['enqueue_many',
         $e$pg_trigger_depth() || ':' || v_rkinds[1], true);$e$,
         $e$pg_trigger_depth() || ':' || v_rmodes[1] || ':' || v_rkinds[1], true);$e$, '1']];
    v_name text;
    i integer;
BEGIN
    FOREACH v_name IN ARRAY ARRAY['enqueue', 'enqueue_many'] LOOP
        v_fn := CASE v_name
            WHEN 'enqueue' THEN 'almanac.enqueue(text, jsonb, timestamptz, integer, text, integer, text, text)'::regprocedure
            ELSE 'almanac.enqueue_many(text[], jsonb[], timestamptz[], integer[], text[], integer[], text[], text[], text[], text[])'::regprocedure
        END;
        v_def := pg_get_functiondef(v_fn);
        FOR i IN 1 .. array_length(v_edits, 1) LOOP
            CONTINUE WHEN v_edits[i][1] <> v_name;
            IF (length(v_def) - length(replace(v_def, v_edits[i][2], ''))) / length(v_edits[i][2])
               <> v_edits[i][4]::integer THEN
                RAISE EXCEPTION 'almanac.% is not the function 0139 left (% is not there % times); restore it first',
                    v_name, v_edits[i][2], v_edits[i][4];
            END IF;
            v_def := replace(v_def, v_edits[i][2], v_edits[i][3]);
        END LOOP;
        EXECUTE v_def;
    END LOOP;
END $$;
