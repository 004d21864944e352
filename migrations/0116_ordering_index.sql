-- The lookups of ordering keys (issue #24 item 2): an enqueue of an ordered
-- kind looks for a job of its key that stands before it, a release for the
-- key's lowest held job; and the scheduler's look for a schedule's
-- unfinished jobs finds held ones (`jobs_schedule_unfinished_idx` has only
-- ready and running ones). Only jobs with an ordering key are in them, so
-- a queue that orders nothing pays nothing to maintain them.
--
-- As 0109: building it reads the whole table under a SHARE lock (claims,
-- heartbeats and enqueues wait, about a second per million jobs). On a big
-- table, build it by hand beforehand and this migration does nothing:
--
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_ordering_idx
--       ON almanac.jobs (kind, ordering_key, id)
--       WHERE ordering_key IS NOT NULL AND status IN ('ready', 'running', 'held', 'dead');
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_schedule_held_idx
--       ON almanac.jobs (schedule) WHERE schedule IS NOT NULL AND status = 'held';
SET LOCAL lock_timeout = '10s';
CREATE INDEX IF NOT EXISTS jobs_ordering_idx ON almanac.jobs (kind, ordering_key, id)
    WHERE ordering_key IS NOT NULL AND status IN ('ready', 'running', 'held', 'dead');
CREATE INDEX IF NOT EXISTS jobs_schedule_held_idx ON almanac.jobs (schedule)
    WHERE schedule IS NOT NULL AND status = 'held';
