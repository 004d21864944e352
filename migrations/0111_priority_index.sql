-- The claim's walk of a kind's due jobs of one priority (issue #23): only
-- jobs with a priority above 0 are in it, so a queue that uses no
-- priorities pays nothing to maintain it.
--
-- As 0109: building it reads the whole table under a SHARE lock (claims,
-- heartbeats and enqueues wait, about a second per million jobs). On a big
-- table, build it by hand beforehand and this migration does nothing:
--
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_ready_priority_idx
--       ON almanac.jobs (kind, priority, run_at, id)
--       WHERE status = 'ready' AND priority > 0;
SET LOCAL lock_timeout = '10s';
CREATE INDEX IF NOT EXISTS jobs_ready_priority_idx ON almanac.jobs (kind, priority, run_at, id)
    WHERE status = 'ready' AND priority > 0;
