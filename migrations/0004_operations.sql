-- Operations: cheap figures for /metrics and `almanac stats`, and the janitor.
-- Dead jobs per kind without touching done rows (the finished index holds both).
CREATE INDEX jobs_dead_kind_idx ON almanac.jobs (kind) WHERE status = 'dead';
-- The janitor deletes done and dead jobs by age, each status on its own.
CREATE INDEX jobs_done_finished_idx ON almanac.jobs (finished_at) WHERE status = 'done';
CREATE INDEX jobs_dead_finished_idx ON almanac.jobs (finished_at) WHERE status = 'dead';
DROP INDEX almanac.jobs_finished_idx;
