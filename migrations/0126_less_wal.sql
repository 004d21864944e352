-- Less WAL per job (issue #26 item 3): 1,381 bytes per job through
-- enqueue, claim and complete before this migration (`almanac bench`).
-- Where they went (pg_walinspect over 20,000 jobs): ten B-tree leaf
-- inserts a job (about 660 bytes), two non-HOT updates that each carried
-- the whole new row to another page (about 360), the row's insert (150),
-- and a lock record for each update that had to leave its page (110).
--
-- 1. Free room on each page (fillfactor 60): claim and completion write
--    the row's new version on its own page, so the update's WAL record
--    carries only the bytes that changed (PostgreSQL's prefix and suffix
--    compression applies only within a page) and no lock record goes
--    first. The status change still touches every index (status is in
--    the partial indexes' predicates, so no update of it is HOT). Applies
--    to pages written from now on; `VACUUM FULL` or `pg_repack` re-packs
--    old ones, and nothing needs that.
-- 2. Only keyed jobs in the idempotency index: a job without a key had a
--    NULL entry there, written again by the claim and by the completion
--    (three leaf inserts a job for nothing). The unique constraint becomes
--    a partial unique index; `INSERT ... ON CONFLICT (idempotency_key)`
--    must now say `WHERE idempotency_key IS NOT NULL` to find it, so the
--    enqueue functions are redefined here with that clause (each other
--    change to them stays in 0114 and 0115), and 0127 drops the
--    constraint; applications enqueue through
--    `almanac.enqueue` (docs/enqueue.md), and one still writing its own
--    INSERT adds the clause (docs/operations.md, upgrading).
-- 3. No index of ready jobs by due time alone: `jobs_ready_due_idx`
--    (run_at, id) took an entry per enqueue, and every statement on ready
--    jobs names their kind, which `jobs_ready_kind_idx` (kind, run_at, id)
--    serves (the claim's walk is written so that the planner could not
--    pick the other; lease.rs).
--
-- This migration builds the index and points the enqueue functions at it
-- (with the old constraint still in place, both arbiters match); 0127
-- drops what is no longer needed. Apart, so that the build commits on its
-- own: the drops need an exclusive lock, and if they time out waiting for
-- one, the build is not thrown away with them.
--
-- As 0109: building the index reads the whole table under a SHARE lock
-- (claims, heartbeats and enqueues wait, about a second per million jobs).
-- On a big table, build it by hand beforehand, and this migration finds
-- it (an index of that name left invalid by a failed concurrent build is
-- dropped and built again here):
--
--   CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS jobs_idempotency_key_idx
--       ON almanac.jobs (idempotency_key) WHERE idempotency_key IS NOT NULL;
SET LOCAL lock_timeout = '10s';

ALTER TABLE almanac.jobs SET (fillfactor = 60);

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index i
               WHERE i.indexrelid = to_regclass('almanac.jobs_idempotency_key_idx')
                 AND NOT (i.indisvalid AND i.indisready AND i.indisunique
                          AND pg_get_indexdef(i.indexrelid) =
                              'CREATE UNIQUE INDEX jobs_idempotency_key_idx ON almanac.jobs '
                              'USING btree (idempotency_key) WHERE (idempotency_key IS NOT NULL)')) THEN
        DROP INDEX almanac.jobs_idempotency_key_idx;
    END IF;
END $$;

CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency_key_idx ON almanac.jobs (idempotency_key)
    WHERE idempotency_key IS NOT NULL;

DO $$
DECLARE
    v_def text := pg_get_functiondef('almanac.enqueue_many(text[], jsonb[], timestamptz[], integer[], text[], integer[], text[], text[], text[], text[])'::regprocedure);
    v_old constant text := 'ON CONFLICT (idempotency_key) DO NOTHING';
    v_new constant text := 'ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING';
BEGIN
    -- Both inserts (one job; a batch), and nothing else, change.
    IF (length(v_def) - length(replace(v_def, v_old, ''))) / length(v_old) <> 2 THEN
        RAISE EXCEPTION 'almanac.enqueue_many is not the function 0115 defined; restore it first';
    END IF;
    EXECUTE replace(v_def, v_old, v_new);
END $$;
