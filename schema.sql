--
-- PostgreSQL database dump
--



SET statement_timeout = 0;
SET lock_timeout = 0;
SET idle_in_transaction_session_timeout = 0;
SET client_encoding = 'UTF8';
SET standard_conforming_strings = on;
SELECT pg_catalog.set_config('search_path', '', false);
SET check_function_bodies = false;
SET xmloption = content;
SET client_min_messages = warning;
SET row_security = off;

--
-- Name: almanac; Type: SCHEMA; Schema: -; Owner: -
--

CREATE SCHEMA almanac;


--
-- Name: claim_budgets(text[], bigint); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.claim_budgets(p_kinds text[], p_limit bigint) RETURNS TABLE(kind text, budget bigint, limited boolean, key_path text[], per_key_limit integer, key_running jsonb, tokens double precision, at timestamp with time zone)
    LANGUAGE plpgsql
    AS $$
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


--
-- Name: claim_outbox(text, integer, integer, bigint, uuid, bigint, timestamp with time zone, bigint); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.claim_outbox(p_sink text, p_lock_class integer, p_lock_key integer, p_limit bigint, p_token uuid, p_lease_ms bigint, p_after_at timestamp with time zone, p_after_id bigint) RETURNS TABLE(id bigint, job_id bigint, destination text, msg_key text, payload text, headers text, attempts integer, available_at timestamp with time zone)
    LANGUAGE plpgsql
    AS $$
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
            o.headers::text AS headers, o.attempts + 1 AS attempts, o.available_at
        FROM almanac.outbox AS o
        WHERE o.sink = p_sink AND o.published_at IS NULL AND o.failed_at IS NULL
          AND o.available_at <= v_now
          -- Always an index condition (a generic plan keeps it): the start
          -- of the index when no position is given.
          AND (o.available_at, o.id) > (coalesce(p_after_at, '-infinity'), coalesce(p_after_id, 0))
          AND o.id NOT IN (SELECT unnest(b.ids) FROM almanac.outbox_batches AS b
                           WHERE b.sink = p_sink AND b.published_at IS NULL
                             AND b.lease_until > v_now)
        ORDER BY o.available_at, o.id
        LIMIT p_limit
    ), batch AS (
        INSERT INTO almanac.outbox_batches (token, sink, ids, claimed_at, lease_until)
        SELECT p_token, p_sink, array_agg(picked.id ORDER BY picked.id), v_now,
            v_now + p_lease_ms * interval '1 millisecond'
        FROM picked HAVING count(*) > 0
    )
    SELECT * FROM picked;
END
$$;


--
-- Name: claim_outbox_bytes(text, integer, integer, bigint, uuid, bigint, timestamp with time zone, bigint, bigint, bigint); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.claim_outbox_bytes(p_sink text, p_lock_class integer, p_lock_key integer, p_limit bigint, p_token uuid, p_lease_ms bigint, p_after_at timestamp with time zone, p_after_id bigint, p_max_bytes bigint, p_budget_bytes bigint) RETURNS TABLE(id bigint, job_id bigint, destination text, msg_key text, payload text, headers text, attempts integer, available_at timestamp with time zone, bytes bigint)
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_now timestamptz;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'almanac.claim_outbox_bytes needs READ COMMITTED, not %',
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
    WITH candidates AS MATERIALIZED (
        SELECT o.id, o.job_id, o.destination, o.msg_key, o.payload, o.headers, o.attempts,
            o.available_at, coalesce(o.bytes, octet_length(o.payload::text)) AS size
        FROM almanac.outbox AS o
        WHERE o.sink = p_sink AND o.published_at IS NULL AND o.failed_at IS NULL
          AND o.available_at <= v_now
          -- Always an index condition (a generic plan keeps it): the start
          -- of the index when no position is given.
          AND (o.available_at, o.id) > (coalesce(p_after_at, '-infinity'), coalesce(p_after_id, 0))
          AND o.id NOT IN (SELECT unnest(b.ids) FROM almanac.outbox_batches AS b
                           WHERE b.sink = p_sink AND b.published_at IS NULL
                             AND b.lease_until > v_now)
        ORDER BY o.available_at, o.id
        LIMIT p_limit
    ), picked AS MATERIALIZED (
        -- The running total of the sizes sent (an oversized row sends none)
        -- only grows, so the rows kept are a prefix of the candidates.
        SELECT * FROM (
            SELECT c.*, c.size > p_max_bytes AS oversized,
                sum(CASE WHEN c.size > p_max_bytes THEN 0 ELSE c.size END)
                    OVER (ORDER BY c.available_at, c.id) AS total
            FROM candidates AS c) AS t
        WHERE t.total <= p_budget_bytes
           -- The first row with a payload, however large.
           OR (NOT t.oversized AND t.total = t.size)
    ), batch AS (
        INSERT INTO almanac.outbox_batches (token, sink, ids, claimed_at, lease_until)
        SELECT p_token, p_sink, array_agg(p.id ORDER BY p.id), v_now,
            v_now + p_lease_ms * interval '1 millisecond'
        FROM picked AS p HAVING count(*) > 0
    )
    SELECT p.id, p.job_id, p.destination, p.msg_key,
        CASE WHEN p.oversized THEN NULL ELSE p.payload::text END,
        p.headers::text, p.attempts + 1, p.available_at, p.size
    FROM picked AS p
    ORDER BY p.available_at, p.id;
END
$$;


SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: jobs; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.jobs (
    id bigint NOT NULL,
    kind text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    status text DEFAULT 'ready'::text NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer DEFAULT 5 NOT NULL,
    lease_token uuid,
    lease_until timestamp with time zone,
    idempotency_key text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    last_error text,
    route text DEFAULT 'db'::text NOT NULL,
    schedule text,
    logical_run text,
    cancel_requested_at timestamp with time zone,
    cancelled_by text,
    cancel_reason text,
    priority smallint DEFAULT 0 NOT NULL,
    ordering_key text,
    traceparent text,
    CONSTRAINT jobs_attempts_check CHECK ((attempts >= 0)),
    CONSTRAINT jobs_check CHECK (((status = 'running'::text) = ((lease_token IS NOT NULL) AND (lease_until IS NOT NULL)))),
    CONSTRAINT jobs_kind_check CHECK ((kind <> ''::text)),
    CONSTRAINT jobs_max_attempts_check CHECK ((max_attempts > 0)),
    CONSTRAINT jobs_route_check CHECK ((route = ANY (ARRAY['db'::text, 'dual'::text, 'broker'::text])))
)
WITH (fillfactor='60');


--
-- Name: complete_claiming(bigint[], uuid[], bigint, text[]); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.complete_claiming(p_ids bigint[], p_tokens uuid[], p_lease_ms bigint, p_kinds text[]) RETURNS SETOF almanac.jobs
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    v_claimed text;
BEGIN
    PERFORM set_config('almanac.claimed_successors', '', true);
    PERFORM set_config('almanac.claim_successors_kinds', p_kinds::text, true);
    PERFORM set_config('almanac.claim_successors', p_lease_ms::text, true);
    RETURN QUERY
        WITH done AS (
            UPDATE almanac.jobs AS j
            SET status = 'done', lease_token = NULL, lease_until = NULL, finished_at = clock_timestamp()
            FROM unnest(p_ids, p_tokens) AS c(id, token)
            WHERE j.id = c.id AND j.lease_token = c.token AND j.lease_until > clock_timestamp()
            RETURNING j)
        SELECT r.* FROM done CROSS JOIN LATERAL jsonb_populate_record(done.j, '{"payload": {}}') AS r;
    PERFORM set_config('almanac.claim_successors', '', true);
    v_claimed := current_setting('almanac.claimed_successors', true);
    PERFORM set_config('almanac.claimed_successors', '', true);
    IF coalesce(v_claimed, '') <> '' THEN
        RETURN QUERY SELECT j.* FROM almanac.jobs AS j
                     WHERE j.id = ANY (string_to_array(v_claimed, ',')::bigint[]);
    END IF;
END $$;


--
-- Name: counts_fold(boolean); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.counts_fold(recount boolean DEFAULT false) RETURNS text
    LANGUAGE plpgsql
    AS $$
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


--
-- Name: counts_read(text[]); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.counts_read(scopes text[]) RETURNS TABLE(scope text, kind text, status text, count bigint)
    LANGUAGE plpgsql STABLE
    AS $$
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


--
-- Name: edit_function(regprocedure, text[], text); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.edit_function(p_fn regprocedure, p_edits text[], p_from text) RETURNS void
    LANGUAGE plpgsql
    AS $$
-- Replaces, in the definition PostgreSQL holds for p_fn, each p_edits[i][1]
-- with p_edits[i][2], after checking the old text is there exactly
-- p_edits[i][3] times; refuses (naming p_from, the migration that left the
-- expected text) a function that is not as expected, so a migration never
-- half-applies an edit.
DECLARE
    v_def text := pg_get_functiondef(p_fn);
    i integer;
BEGIN
    FOR i IN 1 .. array_length(p_edits, 1) LOOP
        IF (length(v_def) - length(replace(v_def, p_edits[i][1], ''))) / length(p_edits[i][1])
           <> p_edits[i][3]::integer THEN
            RAISE EXCEPTION '% is not the function % left (% is not there % times); restore it first',
                p_fn, p_from, p_edits[i][1], p_edits[i][3];
        END IF;
        v_def := replace(v_def, p_edits[i][1], p_edits[i][2]);
    END LOOP;
    EXECUTE v_def;
END $$;


--
-- Name: enqueue(text, jsonb, timestamp with time zone, integer, text, integer, text, text); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.enqueue(kind text, payload jsonb DEFAULT '{}'::jsonb, run_at timestamp with time zone DEFAULT NULL::timestamp with time zone, max_attempts integer DEFAULT NULL::integer, idempotency_key text DEFAULT NULL::text, priority integer DEFAULT 0, ordering_key text DEFAULT NULL::text, traceparent text DEFAULT NULL::text, OUT id bigint, OUT created boolean) RETURNS record
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_route text;
    v_routed boolean := false;
    v_marker text;
BEGIN
    -- enqueue_many's checks for one job, as one expression. A job that
    -- fails one (or that this expression only suspects) is enqueued by
    -- enqueue_many, which names the problem and refuses it (SQLSTATE
    -- 22023), or enqueues it: its checks are the only authority. A NULL
    -- value takes its default and is no problem.
    IF enqueue.kind IS NULL OR enqueue.kind !~ '[^[:space:]]'
       OR enqueue.max_attempts < 1
       OR enqueue.priority NOT BETWEEN 0 AND 9
       OR enqueue.idempotency_key = ''
       OR enqueue.ordering_key = ''
       OR NOT almanac.traceparent_ok(enqueue.traceparent)
    THEN
        SELECT e.id, e.created INTO enqueue.id, enqueue.created
        FROM almanac.enqueue_many(
            kinds => ARRAY[enqueue.kind],
            payloads => ARRAY[enqueue.payload],
            run_ats => ARRAY[enqueue.run_at],
            max_attempts => ARRAY[enqueue.max_attempts],
            idempotency_keys => ARRAY[enqueue.idempotency_key],
            priorities => ARRAY[enqueue.priority],
            ordering_keys => ARRAY[enqueue.ordering_key],
            traceparents => ARRAY[enqueue.traceparent]) AS e;
        RETURN;
    END IF;
    -- The route (0137): the kind's lock, then a new statement reads it.
    IF enqueue.ordering_key IS NULL THEN
        PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || enqueue.kind));
        SELECT coalesce(r.mode, 'db'), o.kind IS NULL INTO v_route, v_routed
        FROM (SELECT enqueue.kind AS kind) AS k
        LEFT JOIN almanac.routes AS r ON r.kind = k.kind
        LEFT JOIN almanac.kind_ordering AS o ON o.kind = k.kind;
    END IF;
    IF v_routed THEN
        v_marker := current_setting('almanac.routes_taken', true);
        PERFORM set_config('almanac.routes_taken', pg_current_xact_id()::text || ':' || pg_trigger_depth() || ':' || v_route || ':' || enqueue.kind, true);
    END IF;
    -- enqueue_many's one-job insert, with scalars for the arrays' elements
    -- (a test compares what the two store and refuse).
    INSERT INTO almanac.jobs AS j
        (kind, payload, run_at, max_attempts, idempotency_key, priority, ordering_key, traceparent,
         route)
    VALUES (enqueue.kind,
            coalesce(enqueue.payload, '{}'),
            coalesce(enqueue.run_at, now()),
            coalesce(enqueue.max_attempts, 5),
            enqueue.idempotency_key,
            coalesce(enqueue.priority, 0),
            enqueue.ordering_key,
            enqueue.traceparent,
            coalesce(v_route, 'db'))
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING j.id INTO enqueue.id;
    enqueue.created := FOUND;
    IF v_routed THEN
        PERFORM set_config('almanac.routes_taken', coalesce(v_marker, ''), true);
    END IF;
    IF enqueue.created THEN
        -- Workers hear of the kind when the transaction commits.
        PERFORM pg_notify('almanac_jobs', enqueue.kind);
        RETURN;
    END IF;
    -- The key was taken: a fresh statement finds its holder (under READ
    -- COMMITTED, also one committed while the insert waited on the key).
    enqueue.id := (SELECT j.id FROM almanac.jobs AS j WHERE j.idempotency_key = enqueue.idempotency_key);
    IF enqueue.id IS NULL THEN
        RAISE EXCEPTION 'idempotency key `%` conflicted but its job is not visible to this transaction; retry',
            enqueue.idempotency_key USING ERRCODE = 'serialization_failure';
    END IF;
END
$$;


--
-- Name: FUNCTION enqueue(kind text, payload jsonb, run_at timestamp with time zone, max_attempts integer, idempotency_key text, priority integer, ordering_key text, traceparent text, OUT id bigint, OUT created boolean); Type: COMMENT; Schema: almanac; Owner: -
--

COMMENT ON FUNCTION almanac.enqueue(kind text, payload jsonb, run_at timestamp with time zone, max_attempts integer, idempotency_key text, priority integer, ordering_key text, traceparent text, OUT id bigint, OUT created boolean) IS 'Enqueues one job in the caller''s transaction: SELECT id, created FROM almanac.enqueue(''send_email'',
''{"to": "ada@example.com"}'', idempotency_key => ''welcome:ada''). Defaults: payload {}, run_at now(),
max_attempts 5, no idempotency key, priority 0 (0 to 9, higher first), no ordering key, no
traceparent. created is false when the
idempotency key was taken; id is then the existing job''s. Invalid values raise SQLSTATE 22023,
inserting nothing. See almanac.enqueue_many and docs/enqueue.md.';


--
-- Name: enqueue_many(text[], jsonb[], timestamp with time zone[], integer[], text[], integer[], text[], text[], text[], text[]); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.enqueue_many(kinds text[], payloads jsonb[] DEFAULT NULL::jsonb[], run_ats timestamp with time zone[] DEFAULT NULL::timestamp with time zone[], max_attempts integer[] DEFAULT NULL::integer[], idempotency_keys text[] DEFAULT NULL::text[], priorities integer[] DEFAULT NULL::integer[], schedules text[] DEFAULT NULL::text[], logical_runs text[] DEFAULT NULL::text[], ordering_keys text[] DEFAULT NULL::text[], traceparents text[] DEFAULT NULL::text[], OUT ord bigint, OUT id bigint, OUT created boolean) RETURNS SETOF record
    LANGUAGE plpgsql
    AS $_$
#variable_conflict use_column
DECLARE
    n integer := cardinality(enqueue_many.kinds);
    v_bad record;
    v_ids bigint[];
    v_keys text[];
    v_kinds text[];
    v_kind text;
    v_key text;
    v_created boolean[];
    v_missing integer;
    v_one_kind text;
    v_route text;
    v_routed boolean := false;
    v_marker text;
BEGIN
    -- Every check is first made as one plain expression, which PL/pgSQL
    -- evaluates without a query; only a call that fails one runs the query
    -- that finds and names the culprit. (A query costs more than the rest
    -- of a one-job call.)

    -- The arrays are parallel: element i of each describes job i. A NULL
    -- array (or a NULL element) takes the default.
    IF enqueue_many.kinds IS NULL THEN
        RAISE EXCEPTION 'kinds is NULL; give one kind per job (an empty array enqueues nothing)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF array_ndims(enqueue_many.kinds) > 1
       OR cardinality(enqueue_many.payloads) <> n OR array_ndims(enqueue_many.payloads) > 1
       OR cardinality(enqueue_many.run_ats) <> n OR array_ndims(enqueue_many.run_ats) > 1
       OR cardinality(enqueue_many.max_attempts) <> n OR array_ndims(enqueue_many.max_attempts) > 1
       OR cardinality(enqueue_many.idempotency_keys) <> n OR array_ndims(enqueue_many.idempotency_keys) > 1
       OR cardinality(enqueue_many.priorities) <> n OR array_ndims(enqueue_many.priorities) > 1
       OR cardinality(enqueue_many.schedules) <> n OR array_ndims(enqueue_many.schedules) > 1
       OR cardinality(enqueue_many.logical_runs) <> n OR array_ndims(enqueue_many.logical_runs) > 1
       OR cardinality(enqueue_many.ordering_keys) <> n OR array_ndims(enqueue_many.ordering_keys) > 1
       OR cardinality(enqueue_many.traceparents) <> n OR array_ndims(enqueue_many.traceparents) > 1
    THEN
        SELECT a.name, a.len, a.dims INTO v_bad
        FROM (VALUES
            ('kinds', cardinality(enqueue_many.kinds), array_ndims(enqueue_many.kinds)),
            ('payloads', cardinality(enqueue_many.payloads), array_ndims(enqueue_many.payloads)),
            ('run_ats', cardinality(enqueue_many.run_ats), array_ndims(enqueue_many.run_ats)),
            ('max_attempts', cardinality(enqueue_many.max_attempts), array_ndims(enqueue_many.max_attempts)),
            ('idempotency_keys', cardinality(enqueue_many.idempotency_keys), array_ndims(enqueue_many.idempotency_keys)),
            ('priorities', cardinality(enqueue_many.priorities), array_ndims(enqueue_many.priorities)),
            ('schedules', cardinality(enqueue_many.schedules), array_ndims(enqueue_many.schedules)),
            ('logical_runs', cardinality(enqueue_many.logical_runs), array_ndims(enqueue_many.logical_runs)),
            ('ordering_keys', cardinality(enqueue_many.ordering_keys), array_ndims(enqueue_many.ordering_keys)),
            ('traceparents', cardinality(enqueue_many.traceparents), array_ndims(enqueue_many.traceparents))
        ) AS a(name, len, dims)
        -- A NULL array has no length; '{}' has length 0 and no dimensions.
        WHERE a.dims > 1 OR a.len <> n
        ORDER BY a.dims > 1 DESC
        LIMIT 1;
        IF v_bad.dims > 1 THEN
            RAISE EXCEPTION '% has % dimensions; give a one-dimensional array, one element per job',
                v_bad.name, v_bad.dims USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RAISE EXCEPTION '% has % element%, kinds has %; give one element per job, or NULL for all defaults',
            v_bad.name, v_bad.len, CASE WHEN v_bad.len = 1 THEN '' ELSE 's' END, n
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;

    -- Every job is checked before anything is inserted: the first bad one
    -- fails the call, naming its value (and its place, in a batch). A kind
    -- of white space only is found in the kinds joined with a separator
    -- (a kind that holds the separator can make this suspect a good call;
    -- the query then finds nothing wrong and the call goes on).
    IF array_position(enqueue_many.kinds, NULL) IS NOT NULL
       OR array_to_string(enqueue_many.kinds, E'\x01', E'\x02') ~ E'(^|\\x01)[[:space:]]*(\\x01|$)'
       OR 1 > ANY (enqueue_many.max_attempts)
       OR 0 > ANY (enqueue_many.priorities) OR 9 < ANY (enqueue_many.priorities)
       OR '' = ANY (enqueue_many.idempotency_keys)
       OR '' = ANY (enqueue_many.ordering_keys)
       OR (enqueue_many.traceparents IS NOT NULL
           AND NOT (SELECT bool_and(almanac.traceparent_ok(tp)) FROM unnest(enqueue_many.traceparents) AS tp))
    THEN
        SELECT t.i, CASE
            WHEN t.kind IS NULL OR t.kind !~ '[^[:space:]]' THEN
                format('the job kind is %s; give the kind its handlers are registered under',
                       CASE WHEN t.kind IS NULL THEN 'NULL' WHEN t.kind = '' THEN 'empty'
                            ELSE quote_literal(t.kind) || ' (white space only)' END)
            WHEN t.max_attempts < 1 THEN
                format('max_attempts is %s; it must be at least 1', t.max_attempts)
            WHEN t.priority NOT BETWEEN 0 AND 9 THEN
                format('priority is %s; it must be 0 (the default) to 9, higher first', t.priority)
            WHEN t.key = '' THEN
                'the idempotency key is empty; omit it or give a value'
            WHEN t.okey = '' THEN
                'the ordering key is empty; omit it or give a value'
            WHEN NOT almanac.traceparent_ok(t.tp) THEN
                format('traceparent %s is not a W3C trace context header (00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>, '
                       'lowercase, ids not all zeros); pass the header your tracer formats, or omit it',
                       quote_literal(t.tp))
            END AS problem
        INTO v_bad
        FROM unnest(enqueue_many.kinds, enqueue_many.max_attempts, enqueue_many.priorities,
                    enqueue_many.idempotency_keys, enqueue_many.ordering_keys, enqueue_many.traceparents)
             WITH ORDINALITY AS t(kind, max_attempts, priority, key, okey, tp, i)
        WHERE t.kind IS NULL OR t.kind !~ '[^[:space:]]' OR t.max_attempts < 1
           OR t.priority NOT BETWEEN 0 AND 9 OR t.key = '' OR t.okey = ''
           OR NOT almanac.traceparent_ok(t.tp)
        ORDER BY t.i
        LIMIT 1;
        IF FOUND AND n > 1 THEN
            RAISE EXCEPTION '% (job % of %)', v_bad.problem, v_bad.i, n
                USING ERRCODE = 'invalid_parameter_value';
        ELSIF FOUND THEN
            RAISE EXCEPTION '%', v_bad.problem USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;

    IF n = 1 THEN
        -- One job (almanac.enqueue has its own copy, 0134): the same insert as below,
        -- of one row of values, which is cheaper than unnest and its
        -- aggregates. Elements are taken by position, whatever an array's
        -- lower bound.
        INSERT INTO almanac.jobs AS j
            (kind, payload, run_at, max_attempts, idempotency_key, schedule, logical_run, priority,
             ordering_key, traceparent)
        VALUES (enqueue_many.kinds[array_lower(enqueue_many.kinds, 1)],
                coalesce(enqueue_many.payloads[array_lower(enqueue_many.payloads, 1)], '{}'),
                coalesce(enqueue_many.run_ats[array_lower(enqueue_many.run_ats, 1)], now()),
                coalesce(enqueue_many.max_attempts[array_lower(enqueue_many.max_attempts, 1)], 5),
                enqueue_many.idempotency_keys[array_lower(enqueue_many.idempotency_keys, 1)],
                enqueue_many.schedules[array_lower(enqueue_many.schedules, 1)],
                enqueue_many.logical_runs[array_lower(enqueue_many.logical_runs, 1)],
                coalesce(enqueue_many.priorities[array_lower(enqueue_many.priorities, 1)], 0),
                enqueue_many.ordering_keys[array_lower(enqueue_many.ordering_keys, 1)],
                enqueue_many.traceparents[array_lower(enqueue_many.traceparents, 1)])
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING j.id, j.kind INTO id, v_kind;
        ord := 1;
        created := FOUND;
        IF created THEN
            PERFORM pg_notify('almanac_jobs', v_kind);
        ELSE
            -- As below: a fresh statement finds the key's holder.
            v_key := enqueue_many.idempotency_keys[array_lower(enqueue_many.idempotency_keys, 1)];
            id := (SELECT j.id FROM almanac.jobs AS j WHERE j.idempotency_key = v_key);
            IF id IS NULL THEN
                RAISE EXCEPTION 'idempotency key `%` conflicted but its job is not visible to this transaction; retry',
                    v_key USING ERRCODE = 'serialization_failure';
            END IF;
        END IF;
        RETURN NEXT;
        RETURN;
    END IF;

    -- The batch's route (0137; 0139, 0141): a batch of one kind without
    -- ordering keys takes the kind's route lock, then a new statement reads
    -- its route, as almanac.enqueue does. A batch of several kinds, with an
    -- ordering key, or of an ordered kind is routed by the trigger.
    v_one_kind := enqueue_many.kinds[array_lower(enqueue_many.kinds, 1)];
    IF v_one_kind = ALL (enqueue_many.kinds)
       AND coalesce(num_nonnulls(VARIADIC enqueue_many.ordering_keys), 0) = 0 THEN
        PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || v_one_kind));
        SELECT coalesce(r.mode, 'db'), o.kind IS NULL INTO v_route, v_routed
        FROM (SELECT v_one_kind AS kind) AS k
        LEFT JOIN almanac.routes AS r ON r.kind = k.kind
        LEFT JOIN almanac.kind_ordering AS o ON o.kind = k.kind;
    END IF;
    IF v_routed THEN
        v_marker := current_setting('almanac.routes_taken', true);
        PERFORM set_config('almanac.routes_taken', pg_current_xact_id()::text || ':' || pg_trigger_depth() || ':' || v_route || ':' || v_one_kind, true);
    END IF;

    -- No job has a key (0135): nothing can conflict, so the rows go in
    -- without ON CONFLICT, every job is new, and the ids, drawn as the
    -- rows are inserted in input order, ascend in input order.
    IF enqueue_many.idempotency_keys IS NULL THEN
        RETURN QUERY
        WITH ins AS (
            INSERT INTO almanac.jobs AS j
                (kind, payload, run_at, max_attempts, schedule, logical_run, priority,
                 ordering_key, traceparent, route)
            SELECT t.kind, coalesce(t.payload, '{}'), coalesce(t.run_at, now()),
                   coalesce(t.max_attempts, 5), t.schedule, t.logical_run, coalesce(t.priority, 0),
                   t.okey, t.tp, coalesce(v_route, 'db')
            FROM unnest(enqueue_many.kinds, enqueue_many.payloads, enqueue_many.run_ats,
                        enqueue_many.max_attempts, enqueue_many.schedules, enqueue_many.logical_runs,
                        enqueue_many.priorities, enqueue_many.ordering_keys, enqueue_many.traceparents)
                 WITH ORDINALITY AS t(kind, payload, run_at, max_attempts, schedule, logical_run,
                                      priority, okey, tp, i)
            ORDER BY t.i
            RETURNING j.id
        )
        SELECT row_number() OVER (ORDER BY ins.id), ins.id, true FROM ins ORDER BY 1;
        IF v_routed THEN
            PERFORM set_config('almanac.routes_taken', coalesce(v_marker, ''), true);
        END IF;
        FOREACH v_kind IN ARRAY (SELECT array_agg(DISTINCT k.kind) FROM unnest(enqueue_many.kinds) AS k(kind)) LOOP
            PERFORM pg_notify('almanac_jobs', v_kind);
        END LOOP;
        RETURN;
    END IF;

    -- One statement inserts the rows in input order. Identity values are
    -- drawn as the rows are inserted, so the new ids ascend in input order.
    WITH ins AS (
        INSERT INTO almanac.jobs AS j
            (kind, payload, run_at, max_attempts, idempotency_key, schedule, logical_run, priority,
             ordering_key, traceparent, route)
        SELECT t.kind, coalesce(t.payload, '{}'), coalesce(t.run_at, now()),
               coalesce(t.max_attempts, 5), t.key, t.schedule, t.logical_run, coalesce(t.priority, 0),
               t.okey, t.tp, coalesce(v_route, 'db')
        FROM unnest(enqueue_many.kinds, enqueue_many.payloads, enqueue_many.run_ats,
                    enqueue_many.max_attempts, enqueue_many.idempotency_keys,
                    enqueue_many.schedules, enqueue_many.logical_runs, enqueue_many.priorities,
                    enqueue_many.ordering_keys, enqueue_many.traceparents)
             WITH ORDINALITY AS t(kind, payload, run_at, max_attempts, key, schedule, logical_run,
                                  priority, okey, tp, i)
        -- Of jobs with the same key in one call, the first is inserted.
        ORDER BY t.i
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING j.id, j.kind, j.idempotency_key
    )
    SELECT array_agg(ins.id ORDER BY ins.id), array_agg(ins.idempotency_key ORDER BY ins.id),
           array_agg(DISTINCT ins.kind)
    INTO v_ids, v_keys, v_kinds
    FROM ins;
    IF v_routed THEN
        PERFORM set_config('almanac.routes_taken', coalesce(v_marker, ''), true);
    END IF;

    -- Workers hear of each kind that got a new row when the transaction
    -- commits (never before, never after a rollback).
    FOREACH v_kind IN ARRAY coalesce(v_kinds, '{}') LOOP
        PERFORM pg_notify('almanac_jobs', v_kind);
    END LOOP;

    IF cardinality(v_ids) = n THEN
        -- Every job is new; the ids, ascending, are in input order.
        RETURN QUERY SELECT t.i, t.id, true FROM unnest(v_ids) WITH ORDINALITY AS t(id, i) ORDER BY t.i;
        RETURN;
    END IF;

    -- Some jobs were not inserted: their key was taken before this call or
    -- earlier in it. The new rows pair up with their jobs: a keyed row with
    -- the first job of its key, the unkeyed rows with the unkeyed jobs in
    -- order. The others get the holder of their key, read by this fresh
    -- statement, which sees the rows this call inserted and (under READ
    -- COMMITTED) a row another transaction committed while this insert
    -- waited on its key.
    SELECT array_agg(p.id ORDER BY p.i), array_agg(p.created ORDER BY p.i)
    INTO v_ids, v_created
    FROM (
        SELECT t.i, coalesce(n_keyed.id, n_unkeyed.id,
                             (SELECT j.id FROM almanac.jobs AS j WHERE j.idempotency_key = t.key)) AS id,
               coalesce(n_keyed.id, n_unkeyed.id) IS NOT NULL AS created
        FROM (SELECT u.i, u.key,
                     row_number() OVER (PARTITION BY u.key ORDER BY u.i) AS nth,
                     row_number() OVER (PARTITION BY u.key IS NULL ORDER BY u.i) AS unkeyed_nth
              FROM unnest(enqueue_many.idempotency_keys) WITH ORDINALITY AS u(key, i)) AS t
        LEFT JOIN unnest(v_ids, v_keys) AS n_keyed(id, key)
               ON t.key IS NOT NULL AND t.nth = 1 AND n_keyed.key = t.key
        LEFT JOIN (SELECT x.id, row_number() OVER (ORDER BY x.id) AS nth
                   FROM unnest(v_ids, v_keys) AS x(id, key) WHERE x.key IS NULL) AS n_unkeyed
               ON t.key IS NULL AND n_unkeyed.nth = t.unkeyed_nth
    ) AS p;
    v_missing := array_position(v_ids, NULL);
    IF v_missing IS NOT NULL THEN
        -- The row that held the key was deleted since (retention, an
        -- operator): a retry inserts the job, or finds the key's new holder.
        RAISE EXCEPTION 'idempotency key `%` conflicted but its job is not visible to this transaction; retry',
            enqueue_many.idempotency_keys[array_lower(enqueue_many.idempotency_keys, 1) + v_missing - 1]
            USING ERRCODE = 'serialization_failure';
    END IF;
    RETURN QUERY
    SELECT t.i, t.id, t.created
    FROM unnest(v_ids, v_created) WITH ORDINALITY AS t(id, created, i)
    ORDER BY t.i;
END
$_$;


--
-- Name: FUNCTION enqueue_many(kinds text[], payloads jsonb[], run_ats timestamp with time zone[], max_attempts integer[], idempotency_keys text[], priorities integer[], schedules text[], logical_runs text[], ordering_keys text[], traceparents text[], OUT ord bigint, OUT id bigint, OUT created boolean); Type: COMMENT; Schema: almanac; Owner: -
--

COMMENT ON FUNCTION almanac.enqueue_many(kinds text[], payloads jsonb[], run_ats timestamp with time zone[], max_attempts integer[], idempotency_keys text[], priorities integer[], schedules text[], logical_runs text[], ordering_keys text[], traceparents text[], OUT ord bigint, OUT id bigint, OUT created boolean) IS 'Enqueues jobs in the caller''s transaction; the one implementation of enqueue (docs/enqueue.md).
Parallel arrays, element i of each describing job i; a NULL array or element takes the default:
payload {}, run_at now(), max_attempts 5, no idempotency key, priority 0 (0 to 9, higher first).
schedules and logical_runs are set by the scheduler for the jobs of schedule runs; leave them NULL.
ordering_keys: jobs of one key of an ordered kind run one at a time, in enqueue order (almanac ordering set).
traceparents: the W3C traceparent of the enqueuing request; the job''s spans join its trace.
Returns one row per job, in input order: (ord, id, created); created is false when the
idempotency key was taken (by a row that exists or earlier in the call) and id is that job''s.
Arrays of different lengths and invalid values raise SQLSTATE 22023, inserting nothing.';


--
-- Name: id_span(bigint[]); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.id_span(ids bigint[]) RETURNS int8range
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT CASE WHEN count(*) > 0 THEN int8range(min(x), max(x), '[]') END
    FROM unnest(ids) AS x
$$;


--
-- Name: jobs_count(); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.jobs_count() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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


--
-- Name: jobs_release_ended(); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.jobs_release_ended() RETURNS trigger
    LANGUAGE plpgsql
    AS $_$
DECLARE
    v_kinds text[];
    v_keys text[];
    v_after uuid[];
    v_got boolean[];
BEGIN
    IF NOT EXISTS (SELECT 1 FROM ended_old AS o
                   WHERE o.ordering_key IS NOT NULL
                     AND o.status IN ('ready', 'running', 'dead', 'held')) THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        IF NOT EXISTS (SELECT 1 FROM ended_new AS n
                       WHERE n.status IN ('done', 'cancelled', 'dead')) THEN
            RETURN NULL;
        END IF;
        -- EXECUTE: planned on every call (see 0129).
        EXECUTE $q$
            SELECT array_agg(k.kind ORDER BY k.kind, k.key), array_agg(k.key ORDER BY k.kind, k.key),
                   array_agg(k.after ORDER BY k.kind, k.key)
            FROM (SELECT o.kind, o.ordering_key AS key, min(o.lease_token::text)::uuid AS after
                  FROM ended_old AS o JOIN ended_new AS n ON n.id = o.id
                  WHERE o.ordering_key IS NOT NULL
                    AND o.status IN ('ready', 'running', 'dead', 'held')
                    AND n.status IN ('done', 'cancelled', 'dead')
                    AND n.status <> o.status
                  GROUP BY o.kind, o.ordering_key) AS k $q$
        INTO v_kinds, v_keys, v_after;
    ELSE
        SELECT array_agg(k.kind ORDER BY k.kind, k.key), array_agg(k.key ORDER BY k.kind, k.key)
        INTO v_kinds, v_keys
        FROM (SELECT DISTINCT o.kind, o.ordering_key AS key
              FROM ended_old AS o
              WHERE o.ordering_key IS NOT NULL
                AND o.status IN ('ready', 'running', 'dead', 'held')) AS k;
    END IF;
    IF v_kinds IS NULL THEN
        RETURN NULL;
    END IF;
    v_got := almanac.lock_keys(v_kinds, v_keys, clock_timestamp() + interval '50 milliseconds');
    INSERT INTO almanac.ordering_recheck (kind, ordering_key)
    SELECT k.kind, k.key FROM unnest(v_kinds, v_keys, v_got) AS k(kind, key, got)
    WHERE NOT k.got
    ON CONFLICT DO NOTHING;
    PERFORM almanac.release_keys(
        ARRAY(SELECT k.kind FROM unnest(v_kinds, v_keys, v_got) WITH ORDINALITY AS k(kind, key, got, i)
              WHERE k.got ORDER BY k.i),
        ARRAY(SELECT k.key FROM unnest(v_kinds, v_keys, v_got) WITH ORDINALITY AS k(kind, key, got, i)
              WHERE k.got ORDER BY k.i),
        ARRAY(SELECT a.after FROM unnest(v_kinds, v_got, v_after) WITH ORDINALITY AS a(kind, got, after, i)
              WHERE a.got ORDER BY a.i));
    RETURN NULL;
END $_$;


--
-- Name: jobs_take_route(); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.jobs_take_route() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_mode text;
    v_ordered boolean;
    v_path text[];
    v_halt boolean;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || NEW.kind));
    SELECT r.mode, o.kind IS NOT NULL, o.key_path, o.on_dead = 'halt'
    INTO v_mode, v_ordered, v_path, v_halt
    FROM (SELECT NEW.kind AS kind) AS k
    LEFT JOIN almanac.routes AS r ON r.kind = k.kind
    LEFT JOIN almanac.kind_ordering AS o ON o.kind = k.kind;
    NEW.route := coalesce(v_mode, 'db');
    IF NOT v_ordered THEN
        IF NEW.ordering_key IS NOT NULL THEN
            RAISE EXCEPTION 'kind % is not ordered, so its job cannot take ordering key %; run `almanac ordering set %` first, or omit the key',
                quote_literal(NEW.kind), quote_literal(NEW.ordering_key), NEW.kind
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.ordering_key IS NULL AND v_path IS NOT NULL THEN
        NEW.ordering_key := nullif(NEW.payload #>> v_path, '');
    END IF;
    IF octet_length(NEW.ordering_key) > 512 THEN
        RAISE EXCEPTION 'the ordering key of a job of kind % is % bytes long; at most 512',
            quote_literal(NEW.kind), octet_length(NEW.ordering_key)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NEW.ordering_key IS NOT NULL AND NEW.status = 'ready' THEN
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            RAISE EXCEPTION 'a job of ordered kind % is enqueued under READ COMMITTED only, not %; enqueue it in a READ COMMITTED transaction',
                quote_literal(NEW.kind), upper(current_setting('transaction_isolation'))
                USING ERRCODE = 'feature_not_supported';
        END IF;
        PERFORM pg_advisory_xact_lock(almanac.ordering_lock_id(NEW.kind, NEW.ordering_key));
        IF EXISTS (SELECT 1 FROM almanac.jobs AS j
                   WHERE j.kind = NEW.kind AND j.ordering_key = NEW.ordering_key
                     AND j.status IN ('ready', 'running', 'dead')
                     AND (j.status <> 'dead' OR v_halt)) THEN
            NEW.status := 'held';
        ELSIF EXISTS (SELECT 1 FROM almanac.jobs AS j
                      WHERE j.kind = NEW.kind AND j.ordering_key = NEW.ordering_key
                        AND j.status = 'held') THEN
            -- Held jobs with nothing before them (their key's release is
            -- noted, waiting for the reaper): the first runs now, this one
            -- after them.
            PERFORM almanac.release_keys(ARRAY[NEW.kind], ARRAY[NEW.ordering_key]);
            NEW.status := 'held';
        END IF;
    END IF;
    RETURN NEW;
END $$;


--
-- Name: jobs_to_outbox(); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.jobs_to_outbox() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF NEW.status = 'ready' AND NEW.route IN ('dual', 'broker')
       AND (TG_OP = 'INSERT' OR OLD.status <> 'ready' OR OLD.route = 'db') THEN
        PERFORM almanac.write_outbox(NEW);
    END IF;
    RETURN NULL;
END $$;


--
-- Name: lock_keys(text[], text[], timestamp with time zone); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.lock_keys(p_kinds text[], p_keys text[], p_until timestamp with time zone) RETURNS boolean[]
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_got boolean[];
    v_timeout text := current_setting('lock_timeout');
    v_left interval;
    i integer;
BEGIN
    v_got := ARRAY(SELECT pg_try_advisory_xact_lock_shared(hashtext('almanac.route:' || k.kind))
                          AND pg_try_advisory_xact_lock(almanac.ordering_lock_id(k.kind, k.key))
                   FROM unnest(p_kinds, p_keys) WITH ORDINALITY AS k(kind, key, i)
                   ORDER BY k.i);
    FOR i IN 1 .. coalesce(cardinality(v_got), 0) LOOP
        CONTINUE WHEN v_got[i];
        v_left := p_until - clock_timestamp();
        CONTINUE WHEN v_left <= interval '0'
                   OR NOT pg_try_advisory_xact_lock_shared(hashtext('almanac.route:' || p_kinds[i]));
        PERFORM set_config('lock_timeout',
                           greatest(1, floor(extract(epoch FROM v_left) * 1000))::bigint || 'ms', true);
        -- A block of its own, so that the timeout can be caught; it writes
        -- nothing, so it costs no subtransaction id.
        BEGIN
            PERFORM pg_advisory_xact_lock(almanac.ordering_lock_id(p_kinds[i], p_keys[i]));
            v_got[i] := true;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
        PERFORM set_config('lock_timeout', v_timeout, true);
    END LOOP;
    RETURN v_got;
END $$;


--
-- Name: ordering_lock_id(text, text); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.ordering_lock_id(p_kind text, p_key text) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT hashtextextended('almanac.order:' || p_kind || ':' || p_key, 0)
$$;


--
-- Name: outbox_count(); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.outbox_count() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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


--
-- Name: outbox_state(timestamp with time zone, timestamp with time zone); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.outbox_state(failed_at timestamp with time zone, published_at timestamp with time zone) RETURNS text
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT CASE WHEN failed_at IS NOT NULL THEN 'failed'
                WHEN published_at IS NOT NULL THEN 'published'
                ELSE 'pending' END
$$;


--
-- Name: recheck_keys(integer); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.recheck_keys(p_limit integer) RETURNS integer
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_kinds text[];
    v_keys text[];
    v_got boolean[];
BEGIN
    WITH taken AS (
        DELETE FROM almanac.ordering_recheck AS c
        WHERE (c.kind, c.ordering_key) IN (
            SELECT n.kind, n.ordering_key FROM almanac.ordering_recheck AS n
            ORDER BY n.noted_at LIMIT p_limit FOR UPDATE SKIP LOCKED)
        RETURNING c.kind, c.ordering_key)
    SELECT array_agg(t.kind ORDER BY t.kind, t.ordering_key),
           array_agg(t.ordering_key ORDER BY t.kind, t.ordering_key)
    INTO v_kinds, v_keys
    FROM taken AS t;
    IF v_kinds IS NULL THEN
        RETURN 0;
    END IF;
    v_got := almanac.lock_keys(v_kinds, v_keys, clock_timestamp() + interval '200 milliseconds');
    INSERT INTO almanac.ordering_recheck (kind, ordering_key)
    SELECT k.kind, k.key FROM unnest(v_kinds, v_keys, v_got) AS k(kind, key, got)
    WHERE NOT k.got
    ON CONFLICT DO NOTHING;
    RETURN almanac.release_keys(
        ARRAY(SELECT k.kind FROM unnest(v_kinds, v_keys, v_got) WITH ORDINALITY AS k(kind, key, got, i)
              WHERE k.got ORDER BY k.i),
        ARRAY(SELECT k.key FROM unnest(v_kinds, v_keys, v_got) WITH ORDINALITY AS k(kind, key, got, i)
              WHERE k.got ORDER BY k.i));
END $$;


--
-- Name: release_held(bigint[]); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.release_held(p_ids bigint[]) RETURNS integer
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_kinds text[];
    v_keys text[];
    v_kind text;
    i integer;
BEGIN
    SELECT array_agg(k.kind ORDER BY k.kind, k.ordering_key),
           array_agg(k.ordering_key ORDER BY k.kind, k.ordering_key)
    INTO v_kinds, v_keys
    FROM (SELECT DISTINCT j.kind, j.ordering_key FROM almanac.jobs AS j
          WHERE j.id = ANY (p_ids) AND j.status = 'held') AS k;
    IF v_kinds IS NULL THEN
        RETURN 0;
    END IF;
    FOR v_kind IN SELECT DISTINCT u FROM unnest(v_kinds) AS u ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || v_kind));
    END LOOP;
    FOR i IN 1 .. cardinality(v_kinds) LOOP
        PERFORM pg_advisory_xact_lock(almanac.ordering_lock_id(v_kinds[i], v_keys[i]));
    END LOOP;
    RETURN almanac.release_keys(v_kinds, v_keys);
END $$;


--
-- Name: release_key(text, text); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.release_key(p_kind text, p_key text) RETURNS bigint
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF almanac.release_keys(ARRAY[p_kind], ARRAY[p_key]) > 0 THEN
        RETURN (SELECT j.id FROM almanac.jobs AS j
                WHERE j.kind = p_kind AND j.ordering_key = p_key AND j.status = 'ready'
                ORDER BY j.id LIMIT 1);
    END IF;
    RETURN NULL;
END $$;


--
-- Name: release_keys(text[], text[]); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.release_keys(p_kinds text[], p_keys text[]) RETURNS integer
    LANGUAGE sql
    AS $$
    SELECT almanac.release_keys(p_kinds, p_keys, NULL::uuid[])
$$;


--
-- Name: release_keys(text[], text[], uuid[]); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.release_keys(p_kinds text[], p_keys text[], p_after uuid[]) RETURNS integer
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_ids bigint[];
    v_after uuid[];
    v_taken bigint[];
    v_kind text;
    v_n integer;
    v_released integer := 0;
    v_lease text := current_setting('almanac.claim_successors', true);
    v_worker_kinds text[];
    v_claimed bigint[];
BEGIN
    SELECT array_agg(h.id), array_agg(k.after) INTO v_ids, v_after
    FROM unnest(p_kinds, p_keys, p_after) AS k(kind, key, after)
    CROSS JOIN LATERAL (
        SELECT j.id FROM almanac.jobs AS j
        WHERE j.kind = k.kind AND j.ordering_key = k.key AND j.status = 'held'
        ORDER BY j.id LIMIT 1) AS h
    WHERE (SELECT 1 FROM almanac.jobs AS b
           WHERE b.kind = k.kind AND b.ordering_key = k.key
             AND b.status IN ('ready', 'running', 'dead')
             AND (b.status <> 'dead'
                  OR coalesce((SELECT o.on_dead = 'halt' FROM almanac.kind_ordering AS o
                               WHERE o.kind = k.kind), false))
           LIMIT 1) IS NULL;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    v_taken := ARRAY(SELECT j.id FROM almanac.jobs AS j
                     WHERE j.id = ANY (v_ids) AND j.status = 'held'
                     ORDER BY j.id FOR UPDATE SKIP LOCKED);
    IF cardinality(v_taken) < cardinality(v_ids) THEN
        INSERT INTO almanac.ordering_recheck (kind, ordering_key)
        SELECT DISTINCT j.kind, j.ordering_key FROM almanac.jobs AS j
        WHERE j.id = ANY (v_ids) AND j.id <> ALL (v_taken)
        ON CONFLICT DO NOTHING;
    END IF;
    IF coalesce(v_lease, '') <> '' THEN
        v_worker_kinds := current_setting('almanac.claim_successors_kinds')::text[];
    END IF;
    IF coalesce(v_lease, '') <> ''
       AND NOT EXISTS (SELECT 1 FROM unnest(v_worker_kinds) AS w(kind)
                       WHERE NOT EXISTS (SELECT 1 FROM almanac.routes AS rt
                                         WHERE rt.kind = w.kind AND rt.mode = 'broker')
                         AND EXISTS (SELECT 1 FROM almanac.jobs AS e
                                     WHERE e.status = 'ready'
                                       AND (e.kind, e.run_at, e.id) >= (w.kind, '-infinity'::timestamptz, 0)
                                       AND (e.kind, e.run_at) <= (w.kind, now())
                                       AND e.kind = w.kind AND e.run_at <= now()
                                       AND coalesce(e.route, '') <> 'broker')) THEN
        WITH direct AS (
            SELECT d.kind FROM (SELECT DISTINCT k.kind FROM unnest(p_kinds) AS k(kind)) AS d
            WHERE coalesce((SELECT rt.mode FROM almanac.routes AS rt WHERE rt.kind = d.kind), 'db') = 'db'
              AND NOT EXISTS (SELECT 1 FROM almanac.kind_pauses AS p WHERE p.kind IN (d.kind, '*'))
              AND NOT EXISTS (SELECT 1 FROM almanac.kind_limits AS l WHERE l.kind = d.kind)
              AND d.kind = ANY (v_worker_kinds)
        ), claimed AS (
            UPDATE almanac.jobs AS j
            SET status = 'running', attempts = j.attempts + 1,
                lease_token = md5(s.after::text || ':next')::uuid,
                lease_until = clock_timestamp() + v_lease::bigint * interval '1 millisecond',
                route = 'db'
            FROM (SELECT u.id, u.after FROM unnest(v_ids, v_after) AS u(id, after)
                  WHERE u.after IS NOT NULL AND u.id = ANY (v_taken)) AS s
            WHERE j.id = s.id
              AND j.kind IN (SELECT kind FROM direct) AND j.run_at <= now()
            RETURNING j.id)
        SELECT array_agg(claimed.id) INTO v_claimed FROM claimed;
        IF v_claimed IS NOT NULL THEN
            PERFORM set_config('almanac.claimed_successors',
                               concat_ws(',', nullif(current_setting('almanac.claimed_successors', true), ''),
                                         array_to_string(v_claimed, ',')),
                               true);
            v_released := cardinality(v_claimed);
            v_taken := ARRAY(SELECT t.id FROM unnest(v_taken) AS t(id) WHERE t.id <> ALL (v_claimed));
        END IF;
    END IF;
    IF cardinality(v_taken) = 0 THEN
        RETURN v_released;
    END IF;
    FOR v_kind, v_n IN
        WITH released AS (
            UPDATE almanac.jobs AS j
            SET status = 'ready',
                route = coalesce((SELECT rt.mode FROM almanac.routes AS rt WHERE rt.kind = j.kind), 'db')
            WHERE j.id = ANY (v_taken)
            RETURNING j.kind)
        SELECT released.kind, count(*)::integer FROM released GROUP BY released.kind
    LOOP
        v_released := v_released + v_n;
        PERFORM pg_notify('almanac_jobs', v_kind);
    END LOOP;
    RETURN v_released;
END $$;


--
-- Name: retry_status(text, text); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.retry_status(p_kind text, p_key text) RETURNS text
    LANGUAGE sql STABLE
    AS $$
    SELECT CASE WHEN p_key IS NOT NULL
                     AND EXISTS (SELECT 1 FROM almanac.kind_ordering AS o WHERE o.kind = p_kind)
                THEN 'held' ELSE 'ready' END
$$;


--
-- Name: route_of(text); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.route_of(p_kind text) RETURNS text
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || p_kind));
    RETURN coalesce((SELECT mode FROM almanac.routes WHERE kind = p_kind), 'db');
END $$;


--
-- Name: sweep_held(text, text, integer); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.sweep_held(p_after_kind text, p_after_key text, p_limit integer, OUT last_kind text, OUT last_key text, OUT released integer) RETURNS record
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_kinds text[];
    v_keys text[];
    v_got boolean[];
    v_kind text := p_after_kind;
    v_key text := p_after_key;
    n integer := 0;
BEGIN
    v_kinds := '{}';
    v_keys := '{}';
    -- A loose walk: each step is one seek to the next key with a held job.
    LOOP
        EXIT WHEN n >= p_limit;
        IF v_kind IS NULL THEN
            SELECT j.kind, j.ordering_key INTO v_kind, v_key
            FROM almanac.jobs AS j
            WHERE j.ordering_key IS NOT NULL AND j.status = 'held'
            ORDER BY j.kind, j.ordering_key
            LIMIT 1;
        ELSE
            SELECT j.kind, j.ordering_key INTO v_kind, v_key
            FROM almanac.jobs AS j
            WHERE j.ordering_key IS NOT NULL AND j.status = 'held'
              AND (j.kind, j.ordering_key) > (v_kind, v_key)
            ORDER BY j.kind, j.ordering_key
            LIMIT 1;
        END IF;
        EXIT WHEN NOT FOUND;
        v_kinds := v_kinds || v_kind;
        v_keys := v_keys || v_key;
        n := n + 1;
    END LOOP;
    IF n < p_limit THEN
        last_kind := NULL;
        last_key := NULL;
    ELSE
        last_kind := v_kind;
        last_key := v_key;
    END IF;
    v_got := almanac.lock_keys(v_kinds, v_keys, clock_timestamp());
    released := almanac.release_keys(
        ARRAY(SELECT k.kind FROM unnest(v_kinds, v_keys, v_got) WITH ORDINALITY AS k(kind, key, got, i)
              WHERE k.got ORDER BY k.i),
        ARRAY(SELECT k.key FROM unnest(v_kinds, v_keys, v_got) WITH ORDINALITY AS k(kind, key, got, i)
              WHERE k.got ORDER BY k.i));
END $$;


--
-- Name: traceparent_ok(text); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.traceparent_ok(tp text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    AS $_$
BEGIN
    RETURN tp ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$'
        AND (length(tp) = 55 OR (left(tp, 2) <> '00' AND substr(tp, 56, 1) = '-'))
        AND left(tp, 2) <> 'ff'
        AND substr(tp, 4, 32) <> '00000000000000000000000000000000'
        AND substr(tp, 37, 16) <> '0000000000000000';
END $_$;


--
-- Name: write_outbox(almanac.jobs); Type: FUNCTION; Schema: almanac; Owner: -
--

CREATE FUNCTION almanac.write_outbox(j almanac.jobs) RETURNS void
    LANGUAGE plpgsql
    AS $$
DECLARE
    r almanac.routes%ROWTYPE;
BEGIN
    SELECT * INTO r FROM almanac.routes WHERE kind = j.kind;
    IF r.sink IS NULL THEN
        RAISE EXCEPTION 'job % of kind % is routed to %, but the kind has no sink; run `almanac route set`', j.id, j.kind, j.route;
    END IF;
    INSERT INTO almanac.outbox (job_id, sink, destination, msg_key, payload, headers, available_at, bytes)
    VALUES (
        j.id, r.sink, r.destination,
        CASE WHEN r.sink = 'kafka'
             THEN coalesce(j.ordering_key, j.idempotency_key, 'almanac:job:' || j.id)
             ELSE coalesce(j.idempotency_key, 'almanac:job:' || j.id) END,
        j.payload,
        jsonb_strip_nulls(jsonb_build_object(
            'almanac-job-id', j.id::text,
            'almanac-kind', j.kind,
            'almanac-attempt', (j.attempts + 1)::text,
            'almanac-logical-run', coalesce(j.logical_run, ''),
            'almanac-ordering-key', j.ordering_key,
            'traceparent', j.traceparent)),
        j.run_at,
        octet_length(j.payload::text));
    PERFORM pg_notify('almanac_outbox', r.sink);
END $$;


--
-- Name: audit_log; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.audit_log (
    id bigint NOT NULL,
    at timestamp with time zone DEFAULT now() NOT NULL,
    actor text NOT NULL,
    source text NOT NULL,
    action text NOT NULL,
    target text NOT NULL,
    count bigint NOT NULL,
    note text,
    CONSTRAINT audit_log_count_check CHECK ((count >= 0)),
    CONSTRAINT audit_log_source_check CHECK ((source = ANY (ARRAY['cli'::text, 'dashboard'::text, 'api'::text])))
);


--
-- Name: audit_log_id_seq; Type: SEQUENCE; Schema: almanac; Owner: -
--

ALTER TABLE almanac.audit_log ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME almanac.audit_log_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);


--
-- Name: consumer_marks; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.consumer_marks (
    sink text NOT NULL,
    destination text NOT NULL,
    partition integer NOT NULL,
    drained_at timestamp with time zone NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
);


--
-- Name: consumers; Type: TABLE; Schema: almanac; Owner: -
--

CREATE UNLOGGED TABLE almanac.consumers (
    id uuid NOT NULL,
    sink text NOT NULL,
    destination text NOT NULL,
    kinds text[] NOT NULL,
    host text NOT NULL,
    pid integer NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    seen_at timestamp with time zone DEFAULT now() NOT NULL,
    unhandled jsonb DEFAULT '{}'::jsonb NOT NULL
);


--
-- Name: counts; Type: TABLE; Schema: almanac; Owner: -
--

CREATE UNLOGGED TABLE almanac.counts (
    scope text NOT NULL,
    kind text NOT NULL,
    status text NOT NULL,
    n bigint NOT NULL
)
WITH (vacuum_truncate='false');


--
-- Name: jobs_id_seq; Type: SEQUENCE; Schema: almanac; Owner: -
--

ALTER TABLE almanac.jobs ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME almanac.jobs_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);


--
-- Name: kind_limits; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.kind_limits (
    kind text NOT NULL,
    global_limit integer,
    key_pointer text,
    key_path text[],
    per_key_limit integer,
    rate integer,
    rate_period_ms bigint,
    burst integer DEFAULT 0 NOT NULL,
    tokens double precision,
    refilled_at timestamp with time zone,
    set_at timestamp with time zone DEFAULT now() NOT NULL,
    set_by text NOT NULL,
    CONSTRAINT kind_limits_burst_check CHECK ((burst >= 0)),
    CONSTRAINT kind_limits_check CHECK ((((key_pointer IS NULL) = (per_key_limit IS NULL)) AND ((key_pointer IS NULL) = (key_path IS NULL)))),
    CONSTRAINT kind_limits_check1 CHECK (((rate IS NULL) = (rate_period_ms IS NULL))),
    CONSTRAINT kind_limits_check2 CHECK (((global_limit IS NOT NULL) OR (per_key_limit IS NOT NULL) OR (rate IS NOT NULL))),
    CONSTRAINT kind_limits_global_limit_check CHECK ((global_limit > 0)),
    CONSTRAINT kind_limits_kind_check CHECK (((kind <> ''::text) AND (kind <> '*'::text))),
    CONSTRAINT kind_limits_per_key_limit_check CHECK ((per_key_limit > 0)),
    CONSTRAINT kind_limits_rate_check CHECK ((rate > 0)),
    CONSTRAINT kind_limits_rate_period_ms_check CHECK ((rate_period_ms > 0))
);


--
-- Name: kind_ordering; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.kind_ordering (
    kind text NOT NULL,
    key_pointer text,
    key_path text[],
    on_dead text DEFAULT 'halt'::text NOT NULL,
    set_at timestamp with time zone DEFAULT now() NOT NULL,
    set_by text NOT NULL,
    CONSTRAINT kind_ordering_check CHECK (((key_pointer IS NULL) = (key_path IS NULL))),
    CONSTRAINT kind_ordering_kind_check CHECK (((kind <> ''::text) AND (kind <> '*'::text))),
    CONSTRAINT kind_ordering_on_dead_check CHECK ((on_dead = ANY (ARRAY['halt'::text, 'skip'::text])))
);


--
-- Name: kind_pauses; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.kind_pauses (
    kind text NOT NULL,
    paused_at timestamp with time zone DEFAULT now() NOT NULL,
    paused_by text NOT NULL,
    note text,
    CONSTRAINT kind_pauses_kind_check CHECK ((kind <> ''::text))
);


--
-- Name: ordering_recheck; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.ordering_recheck (
    kind text NOT NULL,
    ordering_key text NOT NULL,
    noted_at timestamp with time zone DEFAULT now() NOT NULL
);


--
-- Name: outbox; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.outbox (
    id bigint NOT NULL,
    job_id bigint NOT NULL,
    sink text NOT NULL,
    destination text NOT NULL,
    msg_key text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb NOT NULL,
    available_at timestamp with time zone NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    published_at timestamp with time zone,
    attempts integer DEFAULT 0 NOT NULL,
    last_error text,
    failed_at timestamp with time zone,
    bytes bigint,
    CONSTRAINT outbox_check CHECK (((published_at IS NULL) OR (failed_at IS NULL))),
    CONSTRAINT outbox_sink_check CHECK ((sink = ANY (ARRAY['kafka'::text, 'rabbitmq'::text])))
);


--
-- Name: outbox_batches; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.outbox_batches (
    token uuid NOT NULL,
    sink text NOT NULL,
    ids bigint[] NOT NULL,
    job_ids bigint[] DEFAULT '{}'::bigint[] NOT NULL,
    claimed_at timestamp with time zone DEFAULT now() NOT NULL,
    lease_until timestamp with time zone NOT NULL,
    published_at timestamp with time zone,
    job_span int8range,
    CONSTRAINT outbox_batches_sink_check CHECK ((sink = ANY (ARRAY['kafka'::text, 'rabbitmq'::text])))
);
ALTER TABLE ONLY almanac.outbox_batches ALTER COLUMN ids SET STORAGE EXTERNAL;
ALTER TABLE ONLY almanac.outbox_batches ALTER COLUMN job_ids SET STORAGE EXTERNAL;


--
-- Name: outbox_id_seq; Type: SEQUENCE; Schema: almanac; Owner: -
--

ALTER TABLE almanac.outbox ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME almanac.outbox_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);


--
-- Name: routes; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.routes (
    kind text NOT NULL,
    mode text NOT NULL,
    sink text,
    destination text,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT routes_check CHECK (((mode = 'db'::text) OR ((sink IS NOT NULL) AND (destination IS NOT NULL) AND (destination <> ''::text)))),
    CONSTRAINT routes_mode_check CHECK ((mode = ANY (ARRAY['db'::text, 'dual'::text, 'broker'::text]))),
    CONSTRAINT routes_sink_check CHECK ((sink = ANY (ARRAY['kafka'::text, 'rabbitmq'::text])))
);


--
-- Name: schedule_disabled; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.schedule_disabled (
    schedule text NOT NULL,
    disabled_at timestamp with time zone NOT NULL,
    enabled_at timestamp with time zone,
    CONSTRAINT schedule_disabled_check CHECK (((enabled_at IS NULL) OR (enabled_at >= disabled_at)))
);


--
-- Name: schedule_pauses; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.schedule_pauses (
    schedule text NOT NULL,
    paused_at timestamp with time zone NOT NULL,
    resumed_at timestamp with time zone,
    note text DEFAULT ''::text NOT NULL,
    paused_by text NOT NULL,
    resumed_by text,
    CONSTRAINT schedule_pauses_check CHECK (((resumed_at IS NULL) OR (resumed_at >= paused_at)))
);


--
-- Name: schedule_runs; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.schedule_runs (
    schedule text NOT NULL,
    logical_run text NOT NULL,
    fire_at timestamp with time zone NOT NULL,
    job_id bigint,
    recorded_at timestamp with time zone DEFAULT now() NOT NULL,
    source text NOT NULL,
    outcome text NOT NULL
);


--
-- Name: schedules; Type: TABLE; Schema: almanac; Owner: -
--

CREATE TABLE almanac.schedules (
    name text NOT NULL,
    cron text NOT NULL,
    timezone text NOT NULL,
    kind text NOT NULL,
    payload jsonb NOT NULL,
    catchup text NOT NULL,
    catchup_window interval NOT NULL,
    start date,
    overlap text NOT NULL,
    max_attempts integer NOT NULL,
    enabled boolean NOT NULL,
    definition_hash text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    deadline text,
    priority smallint DEFAULT 0 NOT NULL,
    CONSTRAINT schedules_catchup_check CHECK ((catchup = ANY (ARRAY['all'::text, 'latest'::text, 'none'::text]))),
    CONSTRAINT schedules_max_attempts_check CHECK ((max_attempts > 0)),
    CONSTRAINT schedules_overlap_check CHECK ((overlap = ANY (ARRAY['allow'::text, 'skip'::text]))),
    CONSTRAINT schedules_priority_check CHECK (((priority >= 0) AND (priority <= 9)))
);


--
-- Name: audit_log audit_log_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.audit_log
    ADD CONSTRAINT audit_log_pkey PRIMARY KEY (id);


--
-- Name: consumer_marks consumer_marks_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.consumer_marks
    ADD CONSTRAINT consumer_marks_pkey PRIMARY KEY (sink, destination, partition);


--
-- Name: consumers consumers_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.consumers
    ADD CONSTRAINT consumers_pkey PRIMARY KEY (id);


--
-- Name: jobs jobs_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.jobs
    ADD CONSTRAINT jobs_pkey PRIMARY KEY (id);


--
-- Name: jobs jobs_priority_check; Type: CHECK CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE almanac.jobs
    ADD CONSTRAINT jobs_priority_check CHECK (((priority >= 0) AND (priority <= 9))) NOT VALID;


--
-- Name: jobs jobs_status_check; Type: CHECK CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE almanac.jobs
    ADD CONSTRAINT jobs_status_check CHECK ((status = ANY (ARRAY['ready'::text, 'running'::text, 'done'::text, 'dead'::text, 'cancelled'::text, 'held'::text]))) NOT VALID;


--
-- Name: jobs jobs_traceparent_check; Type: CHECK CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE almanac.jobs
    ADD CONSTRAINT jobs_traceparent_check CHECK (almanac.traceparent_ok(traceparent)) NOT VALID;


--
-- Name: kind_limits kind_limits_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.kind_limits
    ADD CONSTRAINT kind_limits_pkey PRIMARY KEY (kind);


--
-- Name: kind_ordering kind_ordering_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.kind_ordering
    ADD CONSTRAINT kind_ordering_pkey PRIMARY KEY (kind);


--
-- Name: kind_pauses kind_pauses_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.kind_pauses
    ADD CONSTRAINT kind_pauses_pkey PRIMARY KEY (kind);


--
-- Name: ordering_recheck ordering_recheck_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.ordering_recheck
    ADD CONSTRAINT ordering_recheck_pkey PRIMARY KEY (kind, ordering_key);


--
-- Name: outbox_batches outbox_batches_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.outbox_batches
    ADD CONSTRAINT outbox_batches_pkey PRIMARY KEY (token);


--
-- Name: outbox outbox_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.outbox
    ADD CONSTRAINT outbox_pkey PRIMARY KEY (id);


--
-- Name: routes routes_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.routes
    ADD CONSTRAINT routes_pkey PRIMARY KEY (kind);


--
-- Name: schedule_disabled schedule_disabled_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.schedule_disabled
    ADD CONSTRAINT schedule_disabled_pkey PRIMARY KEY (schedule, disabled_at);


--
-- Name: schedule_pauses schedule_pauses_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.schedule_pauses
    ADD CONSTRAINT schedule_pauses_pkey PRIMARY KEY (schedule, paused_at);


--
-- Name: schedule_runs schedule_runs_outcome_check; Type: CHECK CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE almanac.schedule_runs
    ADD CONSTRAINT schedule_runs_outcome_check CHECK ((outcome = ANY (ARRAY['emitted'::text, 'skipped_catchup'::text, 'skipped_overlap'::text, 'skipped_disabled'::text, 'skipped_paused'::text]))) NOT VALID;


--
-- Name: schedule_runs schedule_runs_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.schedule_runs
    ADD CONSTRAINT schedule_runs_pkey PRIMARY KEY (schedule, logical_run);


--
-- Name: schedule_runs schedule_runs_source_check; Type: CHECK CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE almanac.schedule_runs
    ADD CONSTRAINT schedule_runs_source_check CHECK ((source = ANY (ARRAY['tick'::text, 'catchup'::text, 'backfill'::text, 'trigger'::text]))) NOT VALID;


--
-- Name: schedules schedules_pkey; Type: CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.schedules
    ADD CONSTRAINT schedules_pkey PRIMARY KEY (name);


--
-- Name: consumers_destination_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX consumers_destination_idx ON almanac.consumers USING btree (sink, destination);


--
-- Name: jobs_cancelled_finished_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX jobs_cancelled_finished_idx ON almanac.jobs USING btree (finished_at) WHERE (status = 'cancelled'::text);


--
-- Name: jobs_dead_finished_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX jobs_dead_finished_idx ON almanac.jobs USING btree (finished_at) WHERE (status = 'dead'::text);


--
-- Name: jobs_dead_kind_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX jobs_dead_kind_idx ON almanac.jobs USING btree (kind) WHERE (status = 'dead'::text);


--
-- Name: jobs_done_finished_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX jobs_done_finished_idx ON almanac.jobs USING btree (finished_at) WHERE (status = 'done'::text);


--
-- Name: jobs_idempotency_key_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE UNIQUE INDEX jobs_idempotency_key_idx ON almanac.jobs USING btree (idempotency_key) WHERE (idempotency_key IS NOT NULL);


--
-- Name: jobs_ordering_status_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX jobs_ordering_status_idx ON almanac.jobs USING btree (kind, ordering_key, status, id) WHERE ((ordering_key IS NOT NULL) AND (status = ANY (ARRAY['ready'::text, 'running'::text, 'held'::text, 'dead'::text])));


--
-- Name: jobs_ready_kind_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX jobs_ready_kind_idx ON almanac.jobs USING btree (kind, run_at, id) WHERE (status = 'ready'::text);


--
-- Name: jobs_ready_priority_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX jobs_ready_priority_idx ON almanac.jobs USING btree (kind, priority, run_at, id) WHERE ((status = 'ready'::text) AND (priority > 0));


--
-- Name: jobs_running_lease_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX jobs_running_lease_idx ON almanac.jobs USING btree (lease_until) WHERE (status = 'running'::text);


--
-- Name: jobs_schedule_held_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX jobs_schedule_held_idx ON almanac.jobs USING btree (schedule) WHERE ((schedule IS NOT NULL) AND (status = 'held'::text));


--
-- Name: jobs_schedule_unfinished_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX jobs_schedule_unfinished_idx ON almanac.jobs USING btree (schedule) WHERE ((schedule IS NOT NULL) AND (status = ANY (ARRAY['ready'::text, 'running'::text])));


--
-- Name: outbox_batches_in_flight_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX outbox_batches_in_flight_idx ON almanac.outbox_batches USING btree (sink) WHERE (published_at IS NULL);


--
-- Name: outbox_batches_job_span_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX outbox_batches_job_span_idx ON almanac.outbox_batches USING gist (job_span) WHERE (published_at IS NOT NULL);


--
-- Name: outbox_batches_published_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX outbox_batches_published_idx ON almanac.outbox_batches USING btree (published_at) WHERE (published_at IS NOT NULL);


--
-- Name: outbox_due_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX outbox_due_idx ON almanac.outbox USING btree (sink, available_at, id) WHERE ((published_at IS NULL) AND (failed_at IS NULL));


--
-- Name: outbox_failed_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX outbox_failed_idx ON almanac.outbox USING btree (sink, failed_at) WHERE (failed_at IS NOT NULL);


--
-- Name: outbox_job_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX outbox_job_idx ON almanac.outbox USING btree (job_id);


--
-- Name: outbox_published_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX outbox_published_idx ON almanac.outbox USING btree (published_at) WHERE (published_at IS NOT NULL);


--
-- Name: schedule_disabled_open_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE UNIQUE INDEX schedule_disabled_open_idx ON almanac.schedule_disabled USING btree (schedule) WHERE (enabled_at IS NULL);


--
-- Name: schedule_pauses_open_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE UNIQUE INDEX schedule_pauses_open_idx ON almanac.schedule_pauses USING btree (schedule) WHERE (resumed_at IS NULL);


--
-- Name: schedule_runs_emitted_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX schedule_runs_emitted_idx ON almanac.schedule_runs USING btree (schedule, fire_at DESC) WHERE (outcome = 'emitted'::text);


--
-- Name: schedule_runs_fire_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX schedule_runs_fire_idx ON almanac.schedule_runs USING btree (schedule, fire_at DESC);


--
-- Name: schedule_runs_job_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX schedule_runs_job_idx ON almanac.schedule_runs USING btree (job_id) WHERE (job_id IS NOT NULL);


--
-- Name: schedule_runs_planned_idx; Type: INDEX; Schema: almanac; Owner: -
--

CREATE INDEX schedule_runs_planned_idx ON almanac.schedule_runs USING btree (schedule, fire_at DESC) WHERE (source <> 'backfill'::text);


--
-- Name: jobs jobs_count_delete; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER jobs_count_delete AFTER DELETE ON almanac.jobs REFERENCING OLD TABLE AS counted_old FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_count();

ALTER TABLE almanac.jobs ENABLE ALWAYS TRIGGER jobs_count_delete;


--
-- Name: jobs jobs_count_insert; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER jobs_count_insert AFTER INSERT ON almanac.jobs REFERENCING NEW TABLE AS counted_new FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_count();

ALTER TABLE almanac.jobs ENABLE ALWAYS TRIGGER jobs_count_insert;


--
-- Name: jobs jobs_count_truncate; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER jobs_count_truncate AFTER TRUNCATE ON almanac.jobs FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_count();

ALTER TABLE almanac.jobs ENABLE ALWAYS TRIGGER jobs_count_truncate;


--
-- Name: jobs jobs_count_update; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER jobs_count_update AFTER UPDATE ON almanac.jobs REFERENCING OLD TABLE AS counted_old NEW TABLE AS counted_new FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_count();

ALTER TABLE almanac.jobs ENABLE ALWAYS TRIGGER jobs_count_update;


--
-- Name: jobs jobs_release_ended_delete; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER jobs_release_ended_delete AFTER DELETE ON almanac.jobs REFERENCING OLD TABLE AS ended_old FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_release_ended();


--
-- Name: jobs jobs_release_ended_update; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER jobs_release_ended_update AFTER UPDATE ON almanac.jobs REFERENCING OLD TABLE AS ended_old NEW TABLE AS ended_new FOR EACH STATEMENT EXECUTE FUNCTION almanac.jobs_release_ended();


--
-- Name: jobs jobs_take_route; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER jobs_take_route BEFORE INSERT ON almanac.jobs FOR EACH ROW WHEN (((new.ordering_key IS NOT NULL) OR (current_setting('almanac.routes_taken'::text, true) IS DISTINCT FROM (((((((pg_current_xact_id())::text || ':'::text) || pg_trigger_depth()) || ':'::text) || new.route) || ':'::text) || new.kind)))) EXECUTE FUNCTION almanac.jobs_take_route();


--
-- Name: jobs jobs_to_outbox; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER jobs_to_outbox AFTER INSERT OR UPDATE OF status, route ON almanac.jobs FOR EACH ROW WHEN (((new.status = 'ready'::text) AND (new.route = ANY (ARRAY['dual'::text, 'broker'::text])))) EXECUTE FUNCTION almanac.jobs_to_outbox();


--
-- Name: outbox outbox_count_delete; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER outbox_count_delete AFTER DELETE ON almanac.outbox REFERENCING OLD TABLE AS counted_old FOR EACH STATEMENT EXECUTE FUNCTION almanac.outbox_count();

ALTER TABLE almanac.outbox ENABLE ALWAYS TRIGGER outbox_count_delete;


--
-- Name: outbox outbox_count_insert; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER outbox_count_insert AFTER INSERT ON almanac.outbox REFERENCING NEW TABLE AS counted_new FOR EACH STATEMENT EXECUTE FUNCTION almanac.outbox_count();

ALTER TABLE almanac.outbox ENABLE ALWAYS TRIGGER outbox_count_insert;


--
-- Name: outbox outbox_count_truncate; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER outbox_count_truncate AFTER TRUNCATE ON almanac.outbox FOR EACH STATEMENT EXECUTE FUNCTION almanac.outbox_count();

ALTER TABLE almanac.outbox ENABLE ALWAYS TRIGGER outbox_count_truncate;


--
-- Name: outbox outbox_count_update; Type: TRIGGER; Schema: almanac; Owner: -
--

CREATE TRIGGER outbox_count_update AFTER UPDATE ON almanac.outbox REFERENCING OLD TABLE AS counted_old NEW TABLE AS counted_new FOR EACH STATEMENT EXECUTE FUNCTION almanac.outbox_count();

ALTER TABLE almanac.outbox ENABLE ALWAYS TRIGGER outbox_count_update;


--
-- Name: outbox outbox_job_id_fkey; Type: FK CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.outbox
    ADD CONSTRAINT outbox_job_id_fkey FOREIGN KEY (job_id) REFERENCES almanac.jobs(id) ON DELETE CASCADE;


--
-- Name: schedule_disabled schedule_disabled_schedule_fkey; Type: FK CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.schedule_disabled
    ADD CONSTRAINT schedule_disabled_schedule_fkey FOREIGN KEY (schedule) REFERENCES almanac.schedules(name);


--
-- Name: schedule_pauses schedule_pauses_schedule_fkey; Type: FK CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.schedule_pauses
    ADD CONSTRAINT schedule_pauses_schedule_fkey FOREIGN KEY (schedule) REFERENCES almanac.schedules(name);


--
-- Name: schedule_runs schedule_runs_job_id_fkey; Type: FK CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.schedule_runs
    ADD CONSTRAINT schedule_runs_job_id_fkey FOREIGN KEY (job_id) REFERENCES almanac.jobs(id) ON DELETE SET NULL;


--
-- Name: schedule_runs schedule_runs_schedule_fkey; Type: FK CONSTRAINT; Schema: almanac; Owner: -
--

ALTER TABLE ONLY almanac.schedule_runs
    ADD CONSTRAINT schedule_runs_schedule_fkey FOREIGN KEY (schedule) REFERENCES almanac.schedules(name);


--
-- PostgreSQL database dump complete
--


