-- The idempotency key's unique index holds only the rows that have a key.
-- Every claim and completion is an update that moves the row to a new
-- version (status is in the partial indexes' predicates, so it is never a
-- HOT update), and each new version added a NULL entry to the full unique
-- index: three index entries per unkeyed job (enqueue, claim, complete),
-- about 200 bytes of WAL of the 1,320 a job cost.
--
-- Uniqueness is unchanged. `ON CONFLICT` on the key now names the index's
-- predicate: `ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL`.
ALTER TABLE almanac.jobs DROP CONSTRAINT jobs_idempotency_key_key;
CREATE UNIQUE INDEX jobs_idempotency_key_idx ON almanac.jobs (idempotency_key)
    WHERE idempotency_key IS NOT NULL;
