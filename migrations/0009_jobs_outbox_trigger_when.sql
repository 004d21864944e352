-- Claims and completions no longer run the outbox trigger. The trigger only
-- ever acts on a row that is `ready` on a dual or broker route, but as a
-- plain row trigger it queued an event and ran its function for every
-- status change: twice per job on the worker's hot path. A WHEN clause is
-- checked as the row is written, and no event is queued when it is false.
-- What the trigger does is unchanged (the function still checks OLD).
-- Replacing it locks the table; behind a long transaction that lock would
-- queue every claim behind it. Give up instead, and name the cause.
SET LOCAL lock_timeout = '10s';
DROP TRIGGER jobs_to_outbox ON almanac.jobs;
CREATE TRIGGER jobs_to_outbox AFTER INSERT OR UPDATE OF status, route ON almanac.jobs
    FOR EACH ROW WHEN (NEW.status = 'ready' AND NEW.route IN ('dual', 'broker'))
    EXECUTE FUNCTION almanac.jobs_to_outbox();
