-- The janitor deletes cancelled jobs by age, as done and dead ones
-- (issue #22; after review, apart from 0108 so that 0108 holds its
-- exclusive lock only for changes of the catalog).
--
-- Building it reads the whole table under a SHARE lock: reads go on, but
-- claims, heartbeats and enqueues wait for the build (about a second per
-- million jobs). On a big table, build it by hand beforehand, without
-- blocking anything, and this migration finds it and does nothing:
--
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_cancelled_finished_idx
--       ON almanac.jobs (finished_at) WHERE status = 'cancelled';
--
-- (Not CONCURRENTLY here: a concurrent build waits for every open
-- transaction, and a second process starting at the same moment waits in
-- one for the migration lock this one holds: a deadlock.)
SET LOCAL lock_timeout = '10s';
CREATE INDEX IF NOT EXISTS jobs_cancelled_finished_idx ON almanac.jobs (finished_at)
    WHERE status = 'cancelled';
