-- The ledger at scale (issue #26 item 4): each schedule's latest emitted
-- run (the dashboard's schedule list and page, `almanac schedules list`)
-- was found by walking `schedule_runs_fire_idx` back from the newest run
-- past every skipped one: a minutely schedule paused or overlapping for
-- 100,000 runs cost 55 ms per look, a million of them half a second. Only
-- emitted runs are in this one, so the look is one probe however many
-- skipped runs came since.
--
-- Building it reads the whole ledger under a SHARE lock (the leader's
-- ticks wait, about a second per million ledger rows). On a big ledger,
-- build it by hand beforehand and this migration does nothing:
--
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS schedule_runs_emitted_idx
--       ON almanac.schedule_runs (schedule, fire_at DESC) WHERE outcome = 'emitted';
SET LOCAL lock_timeout = '10s';
CREATE INDEX IF NOT EXISTS schedule_runs_emitted_idx
    ON almanac.schedule_runs (schedule, fire_at DESC) WHERE outcome = 'emitted';
