-- Fixes to 0137, found in review before it was released:
--
-- 1. The functions' marker held for their whole INSERT statement, so a job
--    inserted by a trigger that statement fired (a user's trigger on
--    almanac.jobs that fans one job out into others, say) skipped the route
--    trigger too: it got route `db` whatever its kind's route, no outbox
--    row, no ordering key from its kind's payload pointer, and no route
--    lock. The marker now also names the trigger depth of the function's
--    insert (`<xid>:<pg_trigger_depth()>`). The trigger's WHEN clause is
--    evaluated at the depth of the statement inserting the row, so only the
--    function's own rows match; a row inserted one trigger level down is
--    routed by the trigger. The functions restore the value they found
--    instead of clearing it, so an enqueue nested in such a trigger leaves
--    the outer call's marker as it was.
-- 2. The trigger is replaced with CREATE OR REPLACE TRIGGER (PostgreSQL 14
--    on), which takes SHARE ROW EXCLUSIVE on almanac.jobs where DROP TRIGGER
--    took ACCESS EXCLUSIVE: claims and reads go on while it waits.
--
-- The marker is the functions' own: a session that sets it by hand skips
-- routing for its inserts, which is not supported (docs/enqueue.md).
SET LOCAL lock_timeout = '10s';

CREATE OR REPLACE TRIGGER jobs_take_route BEFORE INSERT ON almanac.jobs
    FOR EACH ROW
    WHEN (current_setting('almanac.routes_taken', true)
          IS DISTINCT FROM pg_current_xact_id()::text || ':' || pg_trigger_depth())
    EXECUTE FUNCTION almanac.jobs_take_route();

-- Both functions edited in place, as in 0126 and 0135-0137; the migration
-- refuses a function whose text is not the one 0137 left.
DO $$
DECLARE
    v_fn regprocedure;
    v_def text;
    -- (function, old text, new text, how many times the old text is there)
    v_edits constant text[][] := ARRAY[
        ['enqueue', E'    v_routed boolean := false;\n',
         E'    v_routed boolean := false;\n    v_marker text;\n', '1'],
        ['enqueue', $e$PERFORM set_config('almanac.routes_taken', pg_current_xact_id()::text, true);$e$,
         $e$v_marker := current_setting('almanac.routes_taken', true);
        PERFORM set_config('almanac.routes_taken', pg_current_xact_id()::text || ':' || pg_trigger_depth(), true);$e$, '1'],
        ['enqueue', $e$PERFORM set_config('almanac.routes_taken', '', true);$e$,
         $e$PERFORM set_config('almanac.routes_taken', coalesce(v_marker, ''), true);$e$, '1'],
        ['enqueue_many', E'    v_routed boolean := false;\n',
         E'    v_routed boolean := false;\n    v_marker text;\n', '1'],
        ['enqueue_many', $e$PERFORM set_config('almanac.routes_taken', pg_current_xact_id()::text, true);$e$,
         $e$v_marker := current_setting('almanac.routes_taken', true);
        PERFORM set_config('almanac.routes_taken', pg_current_xact_id()::text || ':' || pg_trigger_depth(), true);$e$, '1'],
        ['enqueue_many', $e$PERFORM set_config('almanac.routes_taken', '', true);$e$,
         $e$PERFORM set_config('almanac.routes_taken', coalesce(v_marker, ''), true);$e$, '2']];
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
                RAISE EXCEPTION 'almanac.% is not the function 0137 left (% is not there % times); restore it first',
                    v_name, v_edits[i][2], v_edits[i][4];
            END IF;
            v_def := replace(v_def, v_edits[i][2], v_edits[i][3]);
        END LOOP;
        EXECUTE v_def;
    END LOOP;
END $$;
