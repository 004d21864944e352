-- Order per key and a trace per job (issue #24 items 2 and 3): the
-- columns, the kind setting, the triggers that keep one job per key
-- running, and the enqueue functions with their two new parameters.
-- `src/queue/ordering.rs` states the ordering guarantee and why it holds;
-- docs/ordering.md is the user's guide.
--
-- As in 0101-0110: a bounded wait for the locks the ALTERs take. Every
-- change here is to the catalog: new columns without a default, checks
-- added NOT VALID (every existing row holds NULL, which passes them). The
-- index the triggers' lookups use is built by 0116.
SET LOCAL lock_timeout = '10s';

-- `held`: a job of an ordered kind waiting for the earlier jobs of its
-- ordering key. It is not claimable and has no outbox row; the trigger
-- below makes the key's lowest held job `ready` when the one before it
-- ends. A superset of the old values, so added NOT VALID (as 0108).
ALTER TABLE almanac.jobs DROP CONSTRAINT jobs_status_check;
ALTER TABLE almanac.jobs ADD CONSTRAINT jobs_status_check
    CHECK (status IN ('ready', 'running', 'done', 'dead', 'cancelled', 'held')) NOT VALID;

-- A W3C trace context `traceparent` (version 00 form), as a tracer writes
-- it: NULL passes.
CREATE FUNCTION almanac.traceparent_ok(tp text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT tp IS NULL
        OR (tp ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
            AND left(tp, 2) <> 'ff'
            AND substr(tp, 4, 32) <> '00000000000000000000000000000000'
            AND substr(tp, 37, 16) <> '0000000000000000')
$$;

-- `ordering_key`: jobs of one kind and key run one at a time, in enqueue
-- order (the kind must be in almanac.kind_ordering). `traceparent`: the
-- trace the job was enqueued in; the relay sends it as a message header and
-- execution spans join it.
ALTER TABLE almanac.jobs
    ADD COLUMN ordering_key text,
    ADD COLUMN traceparent  text;
ALTER TABLE almanac.jobs ADD CONSTRAINT jobs_traceparent_check
    CHECK (almanac.traceparent_ok(traceparent)) NOT VALID;

-- Ordered kinds (`almanac ordering set`). A job's key is the one given at
-- enqueue, else the payload's value at `key_pointer` (RFC 6901; `key_path`
-- is it split for `#>>`), else it has none and is not ordered. `on_dead`:
-- what a dead job does to the jobs after it: `halt` keeps them held until
-- the dead job is retried (then it runs first) or cancelled; `skip` lets
-- the next one run.
CREATE TABLE almanac.kind_ordering (
    kind        text        PRIMARY KEY CHECK (kind <> '' AND kind <> '*'),
    key_pointer text,
    key_path    text[],
    on_dead     text        NOT NULL DEFAULT 'halt' CHECK (on_dead IN ('halt', 'skip')),
    set_at      timestamptz NOT NULL DEFAULT now(),
    set_by      text        NOT NULL,
    CHECK ((key_pointer IS NULL) = (key_path IS NULL))
);

-- Keys whose head ended while another transaction held the key's lock (an
-- enqueue of the key still open): the reaper releases them
-- (`almanac.recheck_keys`) instead of the ending job's transaction waiting
-- for that lock.
CREATE TABLE almanac.ordering_recheck (
    kind         text        NOT NULL,
    ordering_key text        NOT NULL,
    noted_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, ordering_key)
);

-- The lock of one ordering key: an enqueue of the key waits for it; the
-- release of a key only tries it.
CREATE FUNCTION almanac.ordering_lock_id(p_kind text, p_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('almanac.order:' || p_kind || ':' || p_key, 0)
$$;

-- Whether a job of the key stands before a held one: one ready (due or
-- waiting to retry) or running, or dead when the kind halts on a dead job.
-- `p_except` is left out (an operator's retry of that job).
CREATE FUNCTION almanac.key_blocked(p_kind text, p_key text, p_halt boolean, p_except bigint)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM almanac.jobs AS j
        WHERE j.kind = p_kind AND j.ordering_key = p_key
          AND j.status IN ('ready', 'running', 'dead')
          AND (j.status <> 'dead' OR p_halt)
          AND j.id IS DISTINCT FROM p_except)
$$;

-- Makes the key's lowest held job `ready` (with the kind's route now, so a
-- dual or broker kind gets its outbox row from jobs_to_outbox) unless a job
-- still stands before it. The caller holds the key's lock and the kind's
-- route lock (shared). Returns the job made ready, or NULL.
CREATE FUNCTION almanac.release_key(p_kind text, p_key text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id bigint;
BEGIN
    IF almanac.key_blocked(p_kind, p_key,
                           coalesce((SELECT o.on_dead = 'halt' FROM almanac.kind_ordering AS o
                                     WHERE o.kind = p_kind), false),
                           NULL) THEN
        RETURN NULL;
    END IF;
    UPDATE almanac.jobs AS j SET status = 'ready', route = almanac.route_of(p_kind)
    WHERE j.id = (SELECT h.id FROM almanac.jobs AS h
                  WHERE h.kind = p_kind AND h.ordering_key = p_key AND h.status = 'held'
                  ORDER BY h.id LIMIT 1)
      AND j.status = 'held'
    RETURNING j.id INTO v_id;
    IF v_id IS NOT NULL THEN
        PERFORM pg_notify('almanac_jobs', p_kind);
    END IF;
    RETURN v_id;
END $$;

-- Releases the key, or notes it for the reaper. Never waits long: the job
-- that ended is in a worker's batch of completions, which no client may
-- hold up. The key's lock is held by an enqueue of the key until that
-- transaction ends; a short one is waited for (at most 50 ms, so a busy key
-- is released at once, not a reaper sweep later), a longer one is not: the
-- key is noted in almanac.ordering_recheck and the reaper releases it. The
-- wait is in a block of its own so that its timeout can be caught; nothing
-- is written inside it, so it costs no subtransaction id. (A deadlock is
-- impossible: an enqueue waiting for a key this batch holds is outwaited by
-- this bounded wait, well under deadlock_timeout.)
CREATE FUNCTION almanac.release_or_note(p_kind text, p_key text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_lock bigint := almanac.ordering_lock_id(p_kind, p_key);
    v_locked boolean;
    v_timeout text;
BEGIN
    v_locked := pg_try_advisory_xact_lock(v_lock);
    IF NOT v_locked THEN
        v_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', '50ms', true);
        BEGIN
            PERFORM pg_advisory_xact_lock(v_lock);
            v_locked := true;
        EXCEPTION WHEN lock_not_available THEN
            v_locked := false;
        END;
        PERFORM set_config('lock_timeout', v_timeout, true);
    END IF;
    IF v_locked AND pg_try_advisory_xact_lock_shared(hashtext('almanac.route:' || p_kind)) THEN
        PERFORM almanac.release_key(p_kind, p_key);
    ELSE
        INSERT INTO almanac.ordering_recheck (kind, ordering_key) VALUES (p_kind, p_key)
        ON CONFLICT DO NOTHING;
    END IF;
END $$;

-- When a job that could stand before a held one ends (done, cancelled,
-- dead) or is deleted, its key's next job is released.
CREATE FUNCTION almanac.jobs_release_key() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM almanac.release_or_note(OLD.kind, OLD.ordering_key);
    RETURN NULL;
END $$;

-- The WHEN clauses keep every job without an ordering key (and every claim,
-- heartbeat and retry) from queuing a trigger call at all.
CREATE TRIGGER jobs_release_key AFTER UPDATE OF status ON almanac.jobs
    FOR EACH ROW
    WHEN (OLD.ordering_key IS NOT NULL AND OLD.status IN ('ready', 'running', 'dead')
          AND NEW.status IN ('done', 'cancelled', 'dead') AND NEW.status <> OLD.status)
    EXECUTE FUNCTION almanac.jobs_release_key();
CREATE TRIGGER jobs_release_key_on_delete AFTER DELETE ON almanac.jobs
    FOR EACH ROW
    WHEN (OLD.ordering_key IS NOT NULL AND OLD.status IN ('ready', 'running', 'dead'))
    EXECUTE FUNCTION almanac.jobs_release_key();

-- The reaper's sweep of noted keys: up to `p_limit` of them, each released
-- if its locks are free now, noted again if not. Returns how many jobs it
-- made ready.
CREATE FUNCTION almanac.recheck_keys(p_limit integer) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
    v_released integer := 0;
BEGIN
    FOR r IN
        DELETE FROM almanac.ordering_recheck AS c
        WHERE (c.kind, c.ordering_key) IN (
            SELECT n.kind, n.ordering_key FROM almanac.ordering_recheck AS n
            ORDER BY n.noted_at LIMIT p_limit FOR UPDATE SKIP LOCKED)
        RETURNING c.kind, c.ordering_key
    LOOP
        IF pg_try_advisory_xact_lock(almanac.ordering_lock_id(r.kind, r.ordering_key))
           AND pg_try_advisory_xact_lock_shared(hashtext('almanac.route:' || r.kind)) THEN
            IF almanac.release_key(r.kind, r.ordering_key) IS NOT NULL THEN
                v_released := v_released + 1;
            END IF;
        ELSE
            INSERT INTO almanac.ordering_recheck (kind, ordering_key)
            VALUES (r.kind, r.ordering_key) ON CONFLICT DO NOTHING;
        END IF;
    END LOOP;
    RETURN v_released;
END $$;

-- An operator's retry of a job of an ordered kind makes it `held`
-- (`retry_status`), then releases its key (`release_held`, after the
-- retry's UPDATE): the key's lowest held job runs next unless a job still
-- stands before it, so a retried job runs after the key's running job and
-- before the key's later jobs, and jobs retried together run in id order.
-- The release waits for each key's lock, as an enqueue does (an operator's
-- action, not a worker's batch), taking them in one order.
CREATE FUNCTION almanac.retry_status(p_kind text, p_key text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN p_key IS NOT NULL
                     AND EXISTS (SELECT 1 FROM almanac.kind_ordering AS o WHERE o.kind = p_kind)
                THEN 'held' ELSE 'ready' END
$$;

--
-- `release_held` releases the keys of the held jobs among `p_ids`; `almanac
-- ordering set` calls it with every held job of the kind. Returns how many
-- jobs it made ready.
CREATE FUNCTION almanac.release_held(p_ids bigint[]) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
    v_released integer := 0;
BEGIN
    FOR r IN
        SELECT DISTINCT j.kind, j.ordering_key FROM almanac.jobs AS j
        WHERE j.id = ANY (p_ids) AND j.status = 'held'
        ORDER BY j.kind, j.ordering_key
    LOOP
        PERFORM pg_advisory_xact_lock(almanac.ordering_lock_id(r.kind, r.ordering_key));
        IF almanac.release_key(r.kind, r.ordering_key) IS NOT NULL THEN
            v_released := v_released + 1;
        END IF;
    END LOOP;
    RETURN v_released;
END $$;

-- A new job takes its kind's route (as before, under the route lock shared:
-- ordered against `almanac route set`, and against `almanac ordering
-- set|clear`, which take it exclusively) and, for an ordered kind, its
-- ordering key; it is `held` when a job of the key stands before it. The
-- key's lock is taken for the rest of the enqueuing transaction, so jobs of
-- one key are numbered in the order their transactions commit, and a held
-- job's predecessor is never one that commits after it.
--
-- That check reads with a snapshot taken after the lock, which only READ
-- COMMITTED gives: an ordered job enqueued under REPEATABLE READ or
-- SERIALIZABLE is refused (SQLSTATE 0A000), since its older snapshot could
-- miss the key's running job and start a second one beside it.
CREATE OR REPLACE FUNCTION almanac.jobs_take_route() RETURNS trigger
LANGUAGE plpgsql AS $$
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
        NEW.ordering_key := NEW.payload #>> v_path;
    END IF;
    IF NEW.ordering_key IS NOT NULL AND NEW.status = 'ready' THEN
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            RAISE EXCEPTION 'a job of ordered kind % is enqueued under READ COMMITTED only, not %; enqueue it in a READ COMMITTED transaction',
                quote_literal(NEW.kind), upper(current_setting('transaction_isolation'))
                USING ERRCODE = 'feature_not_supported';
        END IF;
        PERFORM pg_advisory_xact_lock(almanac.ordering_lock_id(NEW.kind, NEW.ordering_key));
        IF almanac.key_blocked(NEW.kind, NEW.ordering_key, v_halt, NULL)
           OR EXISTS (SELECT 1 FROM almanac.jobs AS j
                      WHERE j.kind = NEW.kind AND j.ordering_key = NEW.ordering_key
                        AND j.status = 'held') THEN
            NEW.status := 'held';
        END IF;
    END IF;
    RETURN NEW;
END $$;

-- An ordered job's message key is its ordering key (the Kafka partition of
-- the key; the AMQP message_id); its trace rides in a `traceparent` header.
-- Otherwise as 0106.
CREATE OR REPLACE FUNCTION almanac.write_outbox(j almanac.jobs) RETURNS void
LANGUAGE plpgsql AS $$
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
        coalesce(j.ordering_key, j.idempotency_key, 'almanac:job:' || j.id),
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

-- The enqueue functions of 0114, with `ordering_keys` and `traceparents`
-- (`ordering_key`, `traceparent`) last and defaulted: calls written against
-- 0114 keep working. Dropped and created anew, as 0114 said.
DROP FUNCTION almanac.enqueue(text, jsonb, timestamptz, integer, text, integer);
DROP FUNCTION almanac.enqueue_many(text[], jsonb[], timestamptz[], integer[], text[], integer[], text[], text[]);

CREATE FUNCTION almanac.enqueue_many(
    kinds text[],
    payloads jsonb[] DEFAULT NULL,
    run_ats timestamptz[] DEFAULT NULL,
    max_attempts integer[] DEFAULT NULL,
    idempotency_keys text[] DEFAULT NULL,
    priorities integer[] DEFAULT NULL,
    schedules text[] DEFAULT NULL,
    logical_runs text[] DEFAULT NULL,
    ordering_keys text[] DEFAULT NULL,
    traceparents text[] DEFAULT NULL,
    OUT ord bigint,
    OUT id bigint,
    OUT created boolean)
RETURNS SETOF record
LANGUAGE plpgsql
AS $$
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
       OR array_to_string(enqueue_many.kinds, E'\x01', E'\x02') ~ '(^|\x01)\s*(\x01|$)'
       OR 1 > ANY (enqueue_many.max_attempts)
       OR 0 > ANY (enqueue_many.priorities) OR 9 < ANY (enqueue_many.priorities)
       OR '' = ANY (enqueue_many.idempotency_keys)
       OR '' = ANY (enqueue_many.ordering_keys)
       OR (enqueue_many.traceparents IS NOT NULL
           AND NOT (SELECT bool_and(almanac.traceparent_ok(tp)) FROM unnest(enqueue_many.traceparents) AS tp))
    THEN
        SELECT t.i, CASE
            WHEN t.kind IS NULL OR t.kind !~ '\S' THEN
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
        WHERE t.kind IS NULL OR t.kind !~ '\S' OR t.max_attempts < 1
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
        -- One job (every almanac.enqueue call): the same insert as below,
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
        ON CONFLICT (idempotency_key) DO NOTHING
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

    -- One statement inserts the rows in input order. Identity values are
    -- drawn as the rows are inserted, so the new ids ascend in input order.
    WITH ins AS (
        INSERT INTO almanac.jobs AS j
            (kind, payload, run_at, max_attempts, idempotency_key, schedule, logical_run, priority,
             ordering_key, traceparent)
        SELECT t.kind, coalesce(t.payload, '{}'), coalesce(t.run_at, now()),
               coalesce(t.max_attempts, 5), t.key, t.schedule, t.logical_run, coalesce(t.priority, 0),
               t.okey, t.tp
        FROM unnest(enqueue_many.kinds, enqueue_many.payloads, enqueue_many.run_ats,
                    enqueue_many.max_attempts, enqueue_many.idempotency_keys,
                    enqueue_many.schedules, enqueue_many.logical_runs, enqueue_many.priorities,
                    enqueue_many.ordering_keys, enqueue_many.traceparents)
             WITH ORDINALITY AS t(kind, payload, run_at, max_attempts, key, schedule, logical_run,
                                  priority, okey, tp, i)
        -- Of jobs with the same key in one call, the first is inserted.
        ORDER BY t.i
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING j.id, j.kind, j.idempotency_key
    )
    SELECT array_agg(ins.id ORDER BY ins.id), array_agg(ins.idempotency_key ORDER BY ins.id),
           array_agg(DISTINCT ins.kind)
    INTO v_ids, v_keys, v_kinds
    FROM ins;

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
$$;

COMMENT ON FUNCTION almanac.enqueue_many(text[], jsonb[], timestamptz[], integer[], text[], integer[], text[], text[], text[], text[]) IS
'Enqueues jobs in the caller''s transaction; the one implementation of enqueue (docs/enqueue.md).
Parallel arrays, element i of each describing job i; a NULL array or element takes the default:
payload {}, run_at now(), max_attempts 5, no idempotency key, priority 0 (0 to 9, higher first).
schedules and logical_runs are set by the scheduler for the jobs of schedule runs; leave them NULL.
ordering_keys: jobs of one key of an ordered kind run one at a time, in enqueue order (almanac ordering set).
traceparents: the W3C traceparent of the enqueuing request; the job''s spans join its trace.
Returns one row per job, in input order: (ord, id, created); created is false when the
idempotency key was taken (by a row that exists or earlier in the call) and id is that job''s.
Arrays of different lengths and invalid values raise SQLSTATE 22023, inserting nothing.';

CREATE FUNCTION almanac.enqueue(
    kind text,
    payload jsonb DEFAULT '{}',
    run_at timestamptz DEFAULT NULL,
    max_attempts integer DEFAULT NULL,
    idempotency_key text DEFAULT NULL,
    priority integer DEFAULT 0,
    ordering_key text DEFAULT NULL,
    traceparent text DEFAULT NULL,
    OUT id bigint,
    OUT created boolean)
LANGUAGE plpgsql
AS $$
BEGIN
    -- PL/pgSQL keeps the plan of this statement for the session (a SQL
    -- function would plan it on every call).
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
END
$$;

COMMENT ON FUNCTION almanac.enqueue(text, jsonb, timestamptz, integer, text, integer, text, text) IS
'Enqueues one job in the caller''s transaction: SELECT id, created FROM almanac.enqueue(''send_email'',
''{"to": "ada@example.com"}'', idempotency_key => ''welcome:ada''). Defaults: payload {}, run_at now(),
max_attempts 5, no idempotency key, priority 0 (0 to 9, higher first), no ordering key, no
traceparent. created is false when the
idempotency key was taken; id is then the existing job''s. Invalid values raise SQLSTATE 22023,
inserting nothing. See almanac.enqueue_many and docs/enqueue.md.';
