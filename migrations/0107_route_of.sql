-- A job coming back to `ready` takes its kind's route through the
-- statement that makes it ready, not a trigger (issue #20 item 2, after
-- review).
--
-- 0104's `jobs_retake_route` was a BEFORE UPDATE row trigger. PostgreSQL
-- locks each row a BEFORE UPDATE row trigger may see before it tests the
-- trigger's WHEN clause, so every claim, completion and lease renewal paid
-- a second row lock (about 13% more WAL per job, measured). The trigger is
-- dropped; the statements that make a job ready (a retry after a failure,
-- the reaper, a release or unclaim at shutdown, an operator's retry) set
-- `route = almanac.route_of(kind)`, which takes the kind's route lock
-- shared, as an insert does (`jobs_take_route`), so it is ordered against
-- `almanac route set`, and then reads the route with a snapshot taken
-- after the lock (a VOLATILE function under READ COMMITTED).
--
-- As in 0101 to 0103: a bounded wait for the table lock dropping a trigger
-- takes.
SET LOCAL lock_timeout = '10s';
DROP TRIGGER jobs_retake_route ON almanac.jobs;

CREATE FUNCTION almanac.route_of(p_kind text) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || p_kind));
    RETURN coalesce((SELECT mode FROM almanac.routes WHERE kind = p_kind), 'db');
END $$;
