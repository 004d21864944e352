-- The relay claims batches, not rows, and deletes what it published.
--
-- Until now a claim updated every row it took (a lease and a token) and a
-- mark updated every row again (`published_at`, which moved it out of
-- `outbox_due_idx` and into three other indexes). Measured on 500-row
-- batches: about 4 µs per row for the claim's update and 7 µs for the mark,
-- the bulk of the relay's cost in PostgreSQL.
--
-- Now a claim is one row here: the batch's token, its outbox ids and a lease.
-- Rows named by a batch in flight are skipped by other claims; claims of one
-- sink take a transaction-level advisory lock, so two cannot pick the same
-- rows. Marking deletes the published outbox rows (about 1.4 µs per row) and
-- turns the batch into a record of what was published: `published_at` and
-- the jobs, which re-drive's "published recently" reads through the GIN
-- index. A relay whose batch is gone (its lease ran out and another relay
-- claimed the rows again, or `route set` re-addressed them) marks nothing.
--
-- Outbox rows published before this migration keep `published_at`; the
-- janitor and re-drive still read them until the janitor deletes them. New
-- rows never get it.
SET LOCAL lock_timeout = '10s';

CREATE TABLE almanac.outbox_batches (
    token        uuid PRIMARY KEY,
    sink         text        NOT NULL CHECK (sink IN ('kafka', 'rabbitmq')),
    -- The outbox rows claimed; once published, only those published.
    ids          bigint[]    NOT NULL,
    -- Empty while in flight; once published, the jobs of the rows published.
    job_ids      bigint[]    NOT NULL DEFAULT '{}',
    claimed_at   timestamptz NOT NULL DEFAULT now(),
    lease_until  timestamptz NOT NULL,
    published_at timestamptz
);

CREATE INDEX outbox_batches_in_flight_idx ON almanac.outbox_batches (sink)
    WHERE published_at IS NULL;
CREATE INDEX outbox_batches_published_idx ON almanac.outbox_batches (published_at)
    WHERE published_at IS NOT NULL;
-- Every mark adds a batch of jobs to the GIN pending list; a small limit
-- keeps each clean-up (done by the mark that fills it) short.
CREATE INDEX outbox_batches_jobs_idx ON almanac.outbox_batches USING gin (job_ids)
    WITH (gin_pending_list_limit = 256);

-- Per-row leases are gone: a row claimed by an older relay is due again at
-- once (stop older relays before this migration; a second copy of a message
-- is harmless, consumers claim through the job fence).
ALTER TABLE almanac.outbox DROP COLUMN lease_token, DROP COLUMN lease_until;
ALTER TABLE almanac.outbox RESET (fillfactor);

-- The claim, in one round trip (`almanac::relay::outbox::claim` documents
-- it). A VOLATILE function takes a fresh snapshot for each statement under
-- READ COMMITTED, so the claim sees every batch committed before it got the
-- sink's lock; under REPEATABLE READ the snapshot would predate the lock, so
-- the function refuses (SQLSTATE ALM01) and the caller runs it in a READ
-- COMMITTED transaction. Times are read after the lock, so a claim that
-- waited gets its whole lease. It waits at most 10 s for a lock. A batch
-- whose lease ended but whose mark is under way (row locked) is not waited
-- for: its rows are claimed again, a second copy the job fence absorbs.
-- Commits asynchronously: a claim lost in a crash only means its rows are
-- published again (the module doc of `almanac::relay::outbox` says why
-- that is safe); call it in its own transaction.
CREATE FUNCTION almanac.claim_outbox(
    p_sink text, p_lock_class int, p_lock_key int, p_limit bigint, p_token uuid, p_lease_ms bigint)
RETURNS TABLE (id bigint, job_id bigint, destination text, msg_key text, payload text,
               headers text, attempts int)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now timestamptz;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'almanac.claim_outbox needs READ COMMITTED, not %',
            current_setting('transaction_isolation') USING ERRCODE = 'ALM01';
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM set_config('lock_timeout', '10s', true);
    PERFORM pg_advisory_xact_lock(p_lock_class, p_lock_key);
    v_now := clock_timestamp();
    DELETE FROM almanac.outbox_batches AS b
    WHERE b.token IN (SELECT e.token FROM almanac.outbox_batches AS e
                      WHERE e.sink = p_sink AND e.published_at IS NULL AND e.lease_until <= v_now
                      FOR UPDATE SKIP LOCKED);
    RETURN QUERY
    WITH picked AS (
        SELECT o.id, o.job_id, o.destination, o.msg_key, o.payload::text AS payload,
            o.headers::text AS headers, o.attempts + 1 AS attempts
        FROM almanac.outbox AS o
        WHERE o.sink = p_sink AND o.published_at IS NULL AND o.failed_at IS NULL
          AND o.available_at <= v_now
          AND o.id NOT IN (SELECT unnest(b.ids) FROM almanac.outbox_batches AS b
                           WHERE b.sink = p_sink AND b.published_at IS NULL
                             AND b.lease_until > v_now)
        ORDER BY o.available_at, o.id
        LIMIT p_limit
    ), batch AS (
        INSERT INTO almanac.outbox_batches (token, sink, ids, claimed_at, lease_until)
        SELECT p_token, p_sink, array_agg(picked.id), v_now,
            v_now + p_lease_ms * interval '1 millisecond'
        FROM picked HAVING count(*) > 0
    )
    SELECT * FROM picked;
END
$$;
