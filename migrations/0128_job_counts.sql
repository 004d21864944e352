-- Job counts that cost the same at ten million jobs as at none (issue #26):
-- `stats`, the metrics collector and the dashboard's overview counted the
-- ready, running, held, dead and cancelled jobs per kind on every read,
-- O(those rows): 417-447 ms at 10,000,000 jobs (1,400,000 of them ready
-- in the future, 500,000 dead) against 12-14 ms at none.
--
-- Instead every statement that inserts, updates or deletes jobs adds one
-- row per (kind, status) whose count it changed to `almanac.job_counts`,
-- in its own transaction (a statement trigger over its transition
-- tables), and readers sum the rows. Maintenance folds the rows into one
-- per (kind, status) every few seconds (src/queue/counts.rs states the
-- guarantee and its limits).
--
-- The table is UNLOGGED: the counts write no WAL (a job's WAL is held to
-- 1,000 bytes, issue #26 item 3), and a crash empties the table. The row
-- with status '*' says the counts are whole: without it (after a crash,
-- a failover, or `almanac stats --recount`) readers count the jobs
-- instead, and the next fold counts them once and writes the row again.
--
-- No count is taken here (it would hold every writer of almanac.jobs
-- for O(jobs)): the table starts without its '*' row, and the first fold
-- (the reaper's next sweep, or `almanac stats`) counts the jobs once
-- without blocking anyone. Every change that commits after this
-- migration fires the triggers, so that count and the rows after it
-- miss nothing.
SET LOCAL lock_timeout = '10s';

CREATE UNLOGGED TABLE almanac.job_counts (
    kind   text   NOT NULL,
    status text   NOT NULL,
    n      bigint NOT NULL
);

CREATE FUNCTION almanac.jobs_count() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO almanac.job_counts (kind, status, n)
        SELECT kind, status, count(*) FROM counted_new GROUP BY 1, 2;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO almanac.job_counts (kind, status, n)
        SELECT kind, status, sum(n)
          FROM (SELECT kind, status, -count(*) AS n FROM counted_old GROUP BY 1, 2
                UNION ALL
                SELECT kind, status, count(*) FROM counted_new GROUP BY 1, 2) AS moved
         GROUP BY 1, 2
        HAVING sum(n) <> 0;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO almanac.job_counts (kind, status, n)
        SELECT kind, status, -count(*) FROM counted_old GROUP BY 1, 2;
    ELSE -- TRUNCATE: no job is left; the counts stay whole. After any
         -- fold in progress (the folders' lock), so none writes back rows
         -- of jobs that are gone.
        PERFORM pg_advisory_xact_lock(1634495841, 1668248942);
        DELETE FROM almanac.job_counts WHERE status <> '*';
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

-- The counts per (kind, status), with the row ('', '*', 0) when they are
-- whole. Nothing (no '*' row) on a standby, where an unlogged table cannot
-- be read: readers count the jobs there.
CREATE FUNCTION almanac.job_counts_read()
RETURNS TABLE (kind text, status text, count bigint)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT c.kind, c.status, sum(c.n)::bigint
      FROM almanac.job_counts c
     GROUP BY 1, 2
    HAVING sum(c.n) <> 0 OR c.status = '*';
END $$;

-- Folds the rows into one per (kind, status); counts the jobs instead when
-- the counts are not whole (no '*' row, or a negative count: a statement
-- ran with the triggers off) or when `recount` says so. One folder at a
-- time (the transaction's advisory lock; 'busy' when another holds it),
-- and each step is one statement whose snapshot is taken after the lock:
-- every delta row it sees belongs to a change its count of the jobs sees,
-- and the rows of transactions that commit later stay for the next fold.
CREATE FUNCTION almanac.job_counts_fold(recount boolean DEFAULT false)
RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'almanac.job_counts_fold() needs READ COMMITTED: each of its statements must see what committed before it took its lock';
    END IF;
    IF NOT pg_try_advisory_xact_lock(1634495841, 1668248942) THEN
        RETURN 'busy';
    END IF;
    IF NOT recount THEN
        SELECT NOT EXISTS (SELECT 1 FROM almanac.job_counts WHERE status = '*')
               OR EXISTS (SELECT 1 FROM almanac.job_counts_read() r WHERE r.count < 0)
          INTO recount;
    END IF;
    IF recount THEN
        WITH gone AS (DELETE FROM almanac.job_counts)
        INSERT INTO almanac.job_counts (kind, status, n)
        SELECT j.kind, j.status, count(*) FROM almanac.jobs j GROUP BY 1, 2
        UNION ALL
        SELECT '', '*', 0;
        RETURN 'recounted';
    END IF;
    WITH gone AS (DELETE FROM almanac.job_counts RETURNING kind, status, n)
    INSERT INTO almanac.job_counts (kind, status, n)
    SELECT g.kind, g.status, sum(g.n) FROM gone g GROUP BY 1, 2
    HAVING sum(g.n) <> 0 OR g.status = '*';
    RETURN 'folded';
END $$;
