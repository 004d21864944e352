-- Counts that cost the same at ten million jobs as at none (issue #26):
-- `stats`, the metrics collector and the dashboard counted the ready,
-- running, held, dead and cancelled jobs per kind, and the outbox's
-- pending rows per sink and kind, on every read: O(those rows), 417-447
-- ms at 10,000,000 jobs (1,400,000 of them ready in the future, 500,000
-- dead, 175,000 outbox rows pending) against 12-14 ms at none.
--
-- Instead every statement that inserts, updates or deletes jobs or outbox
-- rows adds one row per (scope, kind, status) whose count it changed to
-- `almanac.counts`, in its own transaction (a statement trigger over its
-- transition tables), and readers sum the rows. The scope is 'jobs', or
-- 'outbox:' and the sink for outbox rows, whose status is 'pending',
-- 'failed' or 'published'. Maintenance folds the rows into one per
-- (scope, kind, status) every few seconds (src/queue/counts.rs states the
-- guarantee and its limits).
--
-- The table is UNLOGGED: the counts write no WAL (a job's WAL is held to
-- 1,000 bytes, issue #26 item 3), and a crash empties the table. The row
-- with scope '*' says the counts are whole: without it (after a crash, a
-- failover, or `almanac stats --recount`) readers count the rows
-- themselves, and the next fold counts them once and writes it again.
--
-- No count is taken here (it would hold every writer of almanac.jobs
-- for O(jobs)): the table starts without its '*' row, and the first fold
-- (the reaper's next sweep, or `almanac stats`) counts once, reading
-- while writers go on. Every change that commits after this migration fires
-- the triggers, so that count and the rows after it miss nothing.
SET LOCAL lock_timeout = '10s';

-- vacuum_truncate off: every fold empties the table's pages, and the
-- exclusive lock a VACUUM takes to cut them off would stall every writer
-- of jobs and outbox rows behind it.
CREATE UNLOGGED TABLE almanac.counts (
    scope  text   NOT NULL,
    kind   text   NOT NULL,
    status text   NOT NULL,
    n      bigint NOT NULL
) WITH (vacuum_truncate = false);

CREATE FUNCTION almanac.jobs_count() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO almanac.counts (scope, kind, status, n)
        SELECT 'jobs', kind, status, count(*) FROM counted_new GROUP BY 2, 3;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO almanac.counts (scope, kind, status, n)
        SELECT 'jobs', kind, status, sum(n)
          FROM (SELECT kind, status, -count(*) AS n FROM counted_old GROUP BY 1, 2
                UNION ALL
                SELECT kind, status, count(*) FROM counted_new GROUP BY 1, 2) AS moved
         GROUP BY 2, 3
        HAVING sum(n) <> 0;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO almanac.counts (scope, kind, status, n)
        SELECT 'jobs', kind, status, -count(*) FROM counted_old GROUP BY 2, 3;
    ELSE -- TRUNCATE: a '*' row of -1, so the counts are not whole (a
         -- negative count) until a fold counts again. Nothing is deleted: a
         -- TRUNCATE under REPEATABLE READ could not see the rows of changes
         -- (or of a recount) committed after its snapshot, whatever it did;
         -- this row counts whatever snapshot anyone reads it in.
        INSERT INTO almanac.counts (scope, kind, status, n) VALUES ('*', '', '', -1);
    END IF;
    RETURN NULL;
END $$;

-- An outbox row's status in the counts (inlined by the planner).
CREATE FUNCTION almanac.outbox_state(failed_at timestamptz, published_at timestamptz)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN failed_at IS NOT NULL THEN 'failed'
                WHEN published_at IS NOT NULL THEN 'published'
                ELSE 'pending' END
$$;

CREATE FUNCTION almanac.outbox_count() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO almanac.counts (scope, kind, status, n)
        SELECT 'outbox:' || sink, coalesce(headers->>'almanac-kind', ''),
               almanac.outbox_state(failed_at, published_at), count(*)
          FROM counted_new GROUP BY 1, 2, 3;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO almanac.counts (scope, kind, status, n)
        SELECT scope, kind, status, sum(n)
          FROM (SELECT 'outbox:' || sink AS scope, coalesce(headers->>'almanac-kind', '') AS kind,
                       almanac.outbox_state(failed_at, published_at) AS status, -1 AS n
                  FROM counted_old
                UNION ALL
                SELECT 'outbox:' || sink, coalesce(headers->>'almanac-kind', ''),
                       almanac.outbox_state(failed_at, published_at), 1
                  FROM counted_new) AS moved
         GROUP BY 1, 2, 3
        HAVING sum(n) <> 0;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO almanac.counts (scope, kind, status, n)
        SELECT 'outbox:' || sink, coalesce(headers->>'almanac-kind', ''),
               almanac.outbox_state(failed_at, published_at), -count(*)
          FROM counted_old GROUP BY 1, 2, 3;
    ELSE -- TRUNCATE: as the jobs' above.
        INSERT INTO almanac.counts (scope, kind, status, n) VALUES ('*', '', '', -1);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_count_insert AFTER INSERT ON almanac.jobs
    REFERENCING NEW TABLE AS counted_new
    FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_count();
CREATE TRIGGER jobs_count_update AFTER UPDATE ON almanac.jobs
    REFERENCING OLD TABLE AS counted_old NEW TABLE AS counted_new
    FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_count();
CREATE TRIGGER jobs_count_delete AFTER DELETE ON almanac.jobs
    REFERENCING OLD TABLE AS counted_old
    FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_count();
CREATE TRIGGER jobs_count_truncate AFTER TRUNCATE ON almanac.jobs
    FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_count();

CREATE TRIGGER outbox_count_insert AFTER INSERT ON almanac.outbox
    REFERENCING NEW TABLE AS counted_new
    FOR EACH STATEMENT EXECUTE FUNCTION almanac.outbox_count();
CREATE TRIGGER outbox_count_update AFTER UPDATE ON almanac.outbox
    REFERENCING OLD TABLE AS counted_old NEW TABLE AS counted_new
    FOR EACH STATEMENT EXECUTE FUNCTION almanac.outbox_count();
CREATE TRIGGER outbox_count_delete AFTER DELETE ON almanac.outbox
    REFERENCING OLD TABLE AS counted_old
    FOR EACH STATEMENT EXECUTE FUNCTION almanac.outbox_count();
CREATE TRIGGER outbox_count_truncate AFTER TRUNCATE ON almanac.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION almanac.outbox_count();

-- Counted under `session_replication_role = replica` too (bulk loads, a
-- logical replication subscriber's apply): only a trigger disabled by
-- name escapes the counts.
ALTER TABLE almanac.jobs
    ENABLE ALWAYS TRIGGER jobs_count_insert, ENABLE ALWAYS TRIGGER jobs_count_update,
    ENABLE ALWAYS TRIGGER jobs_count_delete, ENABLE ALWAYS TRIGGER jobs_count_truncate;
ALTER TABLE almanac.outbox
    ENABLE ALWAYS TRIGGER outbox_count_insert, ENABLE ALWAYS TRIGGER outbox_count_update,
    ENABLE ALWAYS TRIGGER outbox_count_delete, ENABLE ALWAYS TRIGGER outbox_count_truncate;

-- The counts of the scopes asked for, per (scope, kind, status), with the
-- row ('*', '', '') when they are whole. Nothing (no '*' row) on a
-- standby, where an unlogged table cannot be read: readers count there.
CREATE FUNCTION almanac.counts_read(scopes text[])
RETURNS TABLE (scope text, kind text, status text, count bigint)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT c.scope, c.kind, c.status, sum(c.n)::bigint
      FROM almanac.counts c
     WHERE c.scope = ANY(scopes) OR c.scope = '*'
     GROUP BY 1, 2, 3
    HAVING sum(c.n) <> 0 OR c.scope = '*';
END $$;

-- Folds the rows into one per (scope, kind, status); counts the jobs and
-- the outbox rows instead when the counts are not whole (no '*' row, or a
-- negative count: a statement ran with the triggers off) or when
-- `recount` says so; 'skipped' on a standby or in a read-only
-- transaction. One folder at a time (the transaction's advisory lock;
-- 'busy' when another holds it), and each step is one statement
-- whose snapshot is taken after the lock: every delta row it sees belongs
-- to a change its count sees, and the rows of transactions that commit
-- later stay for the next fold.
CREATE FUNCTION almanac.counts_fold(recount boolean DEFAULT false)
RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    -- Nothing to write on a standby or in a read-only transaction.
    IF pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on' THEN
        RETURN 'skipped';
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'almanac.counts_fold() needs READ COMMITTED: each of its statements must see what committed before it took its lock';
    END IF;
    -- One folder at a time: two int4 halves, 'alma' 'coun'.
    IF NOT pg_try_advisory_xact_lock(1634495841, 1668248942) THEN
        RETURN 'busy';
    END IF;
    IF NOT recount THEN
        SELECT NOT EXISTS (SELECT 1 FROM almanac.counts c WHERE c.scope = '*')
               OR EXISTS (SELECT 1 FROM almanac.counts c GROUP BY c.scope, c.kind, c.status
                          HAVING sum(c.n) < 0)
          INTO recount;
    END IF;
    IF recount THEN
        WITH gone AS (DELETE FROM almanac.counts)
        INSERT INTO almanac.counts (scope, kind, status, n)
        SELECT 'jobs', j.kind, j.status, count(*) FROM almanac.jobs j GROUP BY 2, 3
        UNION ALL
        SELECT 'outbox:' || o.sink, coalesce(o.headers->>'almanac-kind', ''),
               almanac.outbox_state(o.failed_at, o.published_at), count(*)
          FROM almanac.outbox o GROUP BY 1, 2, 3
        UNION ALL
        SELECT '*', '', '', 0;
        RETURN 'recounted';
    END IF;
    WITH gone AS (DELETE FROM almanac.counts RETURNING scope, kind, status, n)
    INSERT INTO almanac.counts (scope, kind, status, n)
    SELECT g.scope, g.kind, g.status, sum(g.n) FROM gone g GROUP BY 1, 2, 3
    HAVING sum(g.n) <> 0 OR g.scope = '*';
    RETURN 'folded';
END $$;
