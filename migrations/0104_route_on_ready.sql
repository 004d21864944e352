-- A job that comes back to `ready` takes its kind's route then (issue #20
-- item 2).
--
-- Until now only an insert took the route (`jobs_take_route`), so `almanac
-- route set` had to move the kind's running jobs too, row-locking them for
-- the whole change while their workers' heartbeats and completions waited
-- behind it. With this trigger a running job's route no longer matters
-- until it is ready again (a retry, the reaper, a release at shutdown, an
-- operator's retry), and then it is the kind's route at that moment, read
-- under the same shared lock an insert takes, so it is ordered against a
-- route change. `route set` moves only ready jobs, in short batches.
--
-- The WHEN clause keeps claims and completions (never to `ready`) from
-- queuing a trigger call at all. The function is the insert trigger's own.
SET LOCAL lock_timeout = '10s';
CREATE TRIGGER jobs_retake_route BEFORE UPDATE OF status ON almanac.jobs
    FOR EACH ROW WHEN (NEW.status = 'ready' AND OLD.status <> 'ready')
    EXECUTE FUNCTION almanac.jobs_take_route();
