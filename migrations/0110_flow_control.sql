-- Flow control (issue #23): per-kind limits that hold across every process
-- that starts jobs (workers, broker consumers, `dual` mode at once), and
-- job priorities. `src/queue/limits.rs` states the guarantees.
--
-- As in 0101-0109: a bounded wait for the locks the ALTERs take.
SET LOCAL lock_timeout = '10s';

-- A job's priority, 0 (the default) to 9: among a kind's due jobs a claim
-- takes the highest first, each step worth a fixed time of waiting, so a
-- low one is never starved (CLAIM_SQL says how). Adding a column with a
-- constant default rewrites nothing; the range check is added NOT VALID
-- (every existing row holds 0), so no scan runs under this lock.
ALTER TABLE almanac.jobs ADD COLUMN priority smallint NOT NULL DEFAULT 0;
ALTER TABLE almanac.jobs ADD CONSTRAINT jobs_priority_check
    CHECK (priority BETWEEN 0 AND 9) NOT VALID;

-- Per-kind limits, changed live (`almanac limits set`). A kind without a
-- row is unlimited. Every column is one limit; NULL means none.
CREATE TABLE almanac.kind_limits (
    kind           text        PRIMARY KEY CHECK (kind <> '' AND kind <> '*'),
    -- At most this many jobs of the kind running at once, cluster-wide.
    global_limit   integer     CHECK (global_limit > 0),
    -- At most `per_key_limit` running per value of the payload at
    -- `key_pointer` (RFC 6901); `key_path` is the pointer split for `#>>`.
    key_pointer    text,
    key_path       text[],
    per_key_limit  integer     CHECK (per_key_limit > 0),
    -- At most `rate + burst` starts in any window of `rate_period_ms`
    -- (a token bucket of `greatest(burst, 1)` tokens refilled at
    -- `rate` per period).
    rate           integer     CHECK (rate > 0),
    rate_period_ms bigint      CHECK (rate_period_ms > 0),
    burst          integer     NOT NULL DEFAULT 0 CHECK (burst >= 0),
    -- The bucket: tokens left at `refilled_at` (NULL: full).
    tokens         double precision,
    refilled_at    timestamptz,
    set_at         timestamptz NOT NULL DEFAULT now(),
    set_by         text        NOT NULL,
    CHECK ((key_pointer IS NULL) = (per_key_limit IS NULL)
           AND (key_pointer IS NULL) = (key_path IS NULL)),
    CHECK ((rate IS NULL) = (rate_period_ms IS NULL)),
    CHECK (global_limit IS NOT NULL OR per_key_limit IS NOT NULL OR rate IS NOT NULL)
);

-- The budget of one claim, per kind of `p_kinds`: how many of the kind it
-- may start (at most `p_limit`), and for a per-key limit how many run per
-- key now. Called first thing by a claim's statement (CLAIM_SQL, and a
-- broker consumer's claim of a limited kind).
--
-- **Why this holds across processes.** Claims of a limited kind are made
-- one at a time: this function locks the kind's `kind_limits` row and holds
-- it until the claim commits. A row another claim holds is skipped, not
-- waited for: that kind gets a budget of 0 in this claim (the claim holding
-- it is taking the kind's jobs), and the claim's other kinds are never
-- held up. It counts the running jobs after taking the lock, with a
-- snapshot of its own (a VOLATILE function under READ COMMITTED takes one
-- per statement), so it sees every claim that committed before it. The
-- claim's own statement keeps its older snapshot, but it only ever takes
-- fewer jobs than the budget, and only jobs still claimable: every row it
-- picks is locked and re-checked (ready, due, not on the broker route) on
-- its latest version, so a row another claim took, or that a retry made
-- due later, is skipped.
--
-- A running job holds its slot while its lease is unexpired: a process
-- that dies gives its slots back when its leases run out, without waiting
-- for the reaper.
--
-- A kind whose limit was set after the locks were taken gets a budget of 0
-- (its next claim honours the limit).
--
-- Per-key counts come as a JSON object of key -> running jobs, the key
-- spelled `v<value>`, or `n` for jobs whose payload has no value at the
-- pointer (they share one bucket of their own).
CREATE FUNCTION almanac.claim_budgets(p_kinds text[], p_limit bigint)
RETURNS TABLE (kind text, budget bigint, limited boolean, key_path text[],
               per_key_limit integer, key_running jsonb, tokens double precision,
               at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_locked text[];
BEGIN
    SELECT array_agg(l.kind) INTO v_locked FROM (
        SELECT l.kind FROM almanac.kind_limits l WHERE l.kind = ANY (p_kinds)
        ORDER BY l.kind FOR UPDATE SKIP LOCKED) AS l;
    IF v_locked IS NULL AND NOT EXISTS (
        SELECT 1 FROM almanac.kind_limits l WHERE l.kind = ANY (p_kinds)) THEN
        RETURN QUERY SELECT u.kind, p_limit, false, NULL::text[], NULL::integer,
                            NULL::jsonb, NULL::double precision, NULL::timestamptz
                     FROM unnest(p_kinds) AS u(kind);
        RETURN;
    END IF;
    RETURN QUERY
    WITH b AS (
        SELECT u.kind, l.kind IS NOT NULL AS limited, coalesce(u.kind = ANY (v_locked), false) AS locked,
               l.global_limit, l.key_path,
               l.per_key_limit,
               CASE WHEN l.rate IS NOT NULL THEN least(
                   greatest(l.burst, 1)::double precision,
                   coalesce(l.tokens, greatest(l.burst, 1))
                   + greatest(extract(epoch FROM clock_timestamp() - coalesce(l.refilled_at, clock_timestamp())), 0)
                     * 1000.0 / l.rate_period_ms * l.rate)
               END AS tokens,
               CASE WHEN l.global_limit IS NOT NULL THEN (
                   SELECT count(*) FROM almanac.jobs r
                   WHERE r.status = 'running' AND r.kind = u.kind
                     AND r.lease_until > clock_timestamp()) END AS running
        FROM unnest(p_kinds) AS u(kind)
        LEFT JOIN almanac.kind_limits l ON l.kind = u.kind
    )
    SELECT b.kind,
           CASE WHEN NOT b.limited THEN p_limit
                -- Limited since this claim took its locks: next claim.
                WHEN NOT b.locked THEN 0
                ELSE greatest(least(
               p_limit,
               coalesce(b.global_limit - b.running, p_limit),
               coalesce(floor(b.tokens)::bigint, p_limit)), 0) END,
           b.limited, b.key_path, b.per_key_limit,
           CASE WHEN b.key_path IS NOT NULL THEN coalesce((
               SELECT jsonb_object_agg(r.key, r.n) FROM (
                   SELECT coalesce('v' || (j.payload #>> b.key_path), 'n') AS key, count(*) AS n
                   FROM almanac.jobs j
                   WHERE j.status = 'running' AND j.kind = b.kind
                     AND j.lease_until > clock_timestamp()
                   GROUP BY 1) r), '{}'::jsonb) END,
           b.tokens, clock_timestamp()
    FROM b;
END $$;
