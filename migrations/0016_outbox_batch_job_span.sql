-- A publication record is found by the span of its jobs, not a GIN index.
--
-- Re-drive ("was this job published to its sink recently?") and the job
-- page found a job's publication records through a GIN index on
-- `outbox_batches.job_ids`. Each job id is its own key there, so every mark
-- added 500 keys (one per row published): 1-1.8 ms of a 2.6-3.3 ms mark of
-- 500 rows, measured in one session, a third of the relay's time in
-- PostgreSQL. A record now carries the span of its jobs (lowest to highest
-- id, written by the mark) under a GiST index: one entry per batch. A lookup
-- takes the records whose span holds the job and checks their `job_ids`.
-- (A generated column computed by `id_span` cost the mark a planned SQL
-- function call, about as much again as the span saved; the relay computes
-- the span it writes.)
--
-- The span is tight when jobs are published in about the order they were
-- created; jobs delayed by different amounts (`run_at`) widen it, and then a
-- lookup reads more records (re-drive still reads only those published
-- within `--redrive-after`). `almanac::queue::routing::redrive` says more.
SET LOCAL lock_timeout = '10s';

-- Lowest to highest of `ids`, bounds included; NULL when empty.
CREATE FUNCTION almanac.id_span(ids bigint[]) RETURNS int8range
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN count(*) > 0 THEN int8range(min(x), max(x), '[]') END
    FROM unnest(ids) AS x
$$;

-- NULL while the batch is in flight.
ALTER TABLE almanac.outbox_batches ADD COLUMN job_span int8range;
UPDATE almanac.outbox_batches SET job_span = almanac.id_span(job_ids)
WHERE published_at IS NOT NULL;

DROP INDEX almanac.outbox_batches_jobs_idx;
CREATE INDEX outbox_batches_job_span_idx ON almanac.outbox_batches USING gist (job_span)
    WHERE published_at IS NOT NULL;
