-- The second half of 0126 (less WAL per job, issue #26 item 3): the
-- idempotency-key constraint goes, now that 0126's partial unique index
-- guards keyed jobs, and with it the NULL entries every keyless job wrote;
-- and `jobs_ready_due_idx` goes (see 0126's comment). Both drops are
-- changes of the catalog under a short exclusive lock: if one cannot be
-- had within the lock timeout, this migration fails alone and the next
-- start tries again; 0126's index stays built.
SET LOCAL lock_timeout = '10s';

DO $$
BEGIN
    -- Never drop the constraint without its replacement in working order.
    IF NOT EXISTS (SELECT 1 FROM pg_index i
                   WHERE i.indexrelid = to_regclass('almanac.jobs_idempotency_key_idx')
                     AND i.indisvalid AND i.indisready AND i.indisunique) THEN
        RAISE EXCEPTION 'almanac.jobs_idempotency_key_idx is missing or not valid; drop it and run `almanac migrate` again';
    END IF;
END $$;

ALTER TABLE almanac.jobs DROP CONSTRAINT IF EXISTS jobs_idempotency_key_key;

DROP INDEX IF EXISTS almanac.jobs_ready_due_idx;
