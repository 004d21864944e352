-- Fixes to 0137-0138, found in review before they were released: a user's
-- BEFORE trigger on almanac.jobs that sorts ahead of `jobs_take_route` and
-- changes the row (its kind, or an ordering key) was trusted. The
-- functions decide the route from the kind they were given, so a job whose
-- kind such a trigger rewrote kept the route (and skipped the route lock)
-- of the kind asked for, and a key such a trigger set was neither refused
-- on an unordered kind nor ordered on an ordered one.
--
-- The route trigger now runs for a row unless the marker names the
-- transaction, the trigger depth and the row's kind as it reaches the
-- trigger (a BEFORE trigger's WHEN clause sees the row as the triggers
-- before it left it), and the row has no ordering key. So the functions
-- take the fast path for calls of one kind only: a batch of several kinds
-- is routed by the trigger, as before 0137.
--
-- CREATE OR REPLACE TRIGGER leaves the trigger enabled in the default mode
-- (ENABLE), as the DROP and CREATE of 0137 did: an `ENABLE ALWAYS` or
-- `ENABLE REPLICA` set on it by hand is to be set again.
SET LOCAL lock_timeout = '10s';

CREATE OR REPLACE TRIGGER jobs_take_route BEFORE INSERT ON almanac.jobs
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL
          OR current_setting('almanac.routes_taken', true)
             IS DISTINCT FROM pg_current_xact_id()::text || ':' || pg_trigger_depth() || ':' || NEW.kind)
    EXECUTE FUNCTION almanac.jobs_take_route();

-- Both functions edited in place, as in 0126 and 0135-0138; the migration
-- refuses a function whose text is not the one 0138 left.
DO $$
DECLARE
    v_fn regprocedure;
    v_def text;
    -- (function, old text, new text, how many times the old text is there)
    v_edits constant text[][] := ARRAY[
        ['enqueue',
         $e$pg_current_xact_id()::text || ':' || pg_trigger_depth(), true);$e$,
         $e$pg_current_xact_id()::text || ':' || pg_trigger_depth() || ':' || enqueue.kind, true);$e$, '1'],
        ['enqueue_many',
         $e$        LEFT JOIN almanac.kind_ordering AS o ON o.kind = k.kind;
    END IF;$e$,
         $e$        LEFT JOIN almanac.kind_ordering AS o ON o.kind = k.kind;
        -- One kind only (0139): the marker names it.
        v_routed := v_routed AND cardinality(v_rkinds) = 1;
    END IF;$e$, '1'],
        ['enqueue_many',
         $e$pg_current_xact_id()::text || ':' || pg_trigger_depth(), true);$e$,
         $e$pg_current_xact_id()::text || ':' || pg_trigger_depth() || ':' || v_rkinds[1], true);$e$, '1']];
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
                RAISE EXCEPTION 'almanac.% is not the function 0138 left (% is not there % times); restore it first',
                    v_name, v_edits[i][2], v_edits[i][4];
            END IF;
            v_def := replace(v_def, v_edits[i][2], v_edits[i][3]);
        END LOOP;
        EXECUTE v_def;
    END LOOP;
END $$;
