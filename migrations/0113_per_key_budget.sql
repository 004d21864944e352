-- A per-key limit that cannot bind costs what a global limit costs (issue
-- #23): `claim_budgets` as in 0110, but a kind's running jobs are counted
-- per key only when a key could reach its limit in this claim, that is
-- when the kind's running jobs plus the claim's limit exceed the per-key
-- limit. Otherwise `key_running` is NULL: no key can reach the limit,
-- and CLAIM_SQL walks the kind as if it had no per-key limit (a claim
-- that still reads `key_running` finds no key at its limit, which is
-- true). Same signature and guarantees as in 0110: the counts are taken
-- after the kind's row is locked, with a snapshot of their own.
CREATE OR REPLACE FUNCTION almanac.claim_budgets(p_kinds text[], p_limit bigint)
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
               CASE WHEN l.global_limit IS NOT NULL OR l.per_key_limit IS NOT NULL THEN (
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
           CASE WHEN b.key_path IS NOT NULL AND b.running + p_limit > b.per_key_limit THEN coalesce((
               SELECT jsonb_object_agg(r.key, r.n) FROM (
                   SELECT coalesce('v' || (j.payload #>> b.key_path), 'n') AS key, count(*) AS n
                   FROM almanac.jobs j
                   WHERE j.status = 'running' AND j.kind = b.kind
                     AND j.lease_until > clock_timestamp()
                   GROUP BY 1) r), '{}'::jsonb) END,
           b.tokens, clock_timestamp()
    FROM b;
END $$;
