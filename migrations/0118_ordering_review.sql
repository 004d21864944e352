-- Order per key (issue #24 item 2), after a cold review of 0115-0117.
-- `src/queue/ordering.rs` states the guarantee; what changes here:
--
-- 1. A key could be left held for good. An operator's cancel of a held job
--    raced a release that had picked that job: the release waited for the
--    row, found it cancelled, released nothing and noted nothing. Now a
--    held job's cancel or deletion notes its key too; the release takes the
--    held rows it picked with SKIP LOCKED and notes the key of every one it
--    could not take (or that was no longer held); and the reaper's sweep
--    also walks the keys that have held jobs, a slice per sweep, releasing
--    any that nothing stands before (`almanac.sweep_held`): a safety net
--    for whatever else leaves a key so (a raw INSERT of a `held` row).
-- 2. A busy key could wait as long as its producers kept enqueueing: once
--    noted, only the reaper released it, trying the lock once per sweep,
--    and producers in a row always held it. Now an enqueue that finds its
--    key with held jobs and nothing before them releases the lowest held
--    job itself (it holds the key's lock and the route lock already), and
--    the sweep waits a little for a busy key.
-- 3. A statement that ended many busy keys could wait 50 ms for each (40
--    keys: 2 s), past a worker's lease. Now one statement waits 50 ms in
--    all, then only tries.
-- 4. `release_held` (operator's retry, `ordering set`) took a key's lock
--    before its kind's route lock, the reverse of an enqueue: a deadlock
--    with `route set` or `ordering set`. Now route locks first.
-- 5. RabbitMQ messages of one key shared an AMQP `message_id` (the
--    ordering key), which deduplicating consumers would drop. The message
--    key is the ordering key for Kafka only (its partition); on RabbitMQ it
--    stays the idempotency key or `almanac:job:<id>`.
-- 6. An ordering key longer than 512 bytes is refused (22023) instead of
--    failing in the index (54000); a key taken from the payload that is
--    '' means no key, as an absent one does.
SET LOCAL lock_timeout = '10s';

-- 1: a held job's cancel or deletion notes its key.
DROP TRIGGER jobs_note_ended_key ON almanac.jobs;
DROP TRIGGER jobs_note_ended_key_on_delete ON almanac.jobs;
CREATE TRIGGER jobs_note_ended_key AFTER UPDATE OF status ON almanac.jobs
    FOR EACH ROW
    WHEN (OLD.ordering_key IS NOT NULL AND OLD.status IN ('ready', 'running', 'dead', 'held')
          AND NEW.status IN ('done', 'cancelled', 'dead') AND NEW.status <> OLD.status)
    EXECUTE FUNCTION almanac.jobs_note_ended_key();
CREATE TRIGGER jobs_note_ended_key_on_delete AFTER DELETE ON almanac.jobs
    FOR EACH ROW
    WHEN (OLD.ordering_key IS NOT NULL AND OLD.status IN ('ready', 'running', 'dead', 'held'))
    EXECUTE FUNCTION almanac.jobs_note_ended_key();

-- Releases the keys `p_kinds[i]`/`p_keys[i]` whose locks the caller holds
-- (each key's lock and its kind's route lock, shared): for each key that
-- nothing stands before, its lowest held job, if the row can be taken now
-- (SKIP LOCKED) and is still held, becomes `ready` with its kind's route;
-- the key of a job it could not take is noted for the reaper. Workers of
-- each kind that got a job are notified. Returns how many jobs it made
-- ready.
CREATE FUNCTION almanac.release_keys(p_kinds text[], p_keys text[]) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_ids bigint[];
    v_taken bigint[];
    v_kind text;
    v_released integer := 0;
BEGIN
    SELECT array_agg(c.id) INTO v_ids
    FROM (SELECT (SELECT h.id FROM almanac.jobs AS h
                  WHERE h.kind = k.kind AND h.ordering_key = k.key AND h.status = 'held'
                  ORDER BY h.id LIMIT 1) AS id
          FROM unnest(p_kinds, p_keys) AS k(kind, key)
          WHERE NOT EXISTS (
              SELECT 1 FROM almanac.jobs AS b
              WHERE b.kind = k.kind AND b.ordering_key = k.key
                AND b.status IN ('ready', 'running', 'dead')
                AND (b.status <> 'dead'
                     OR coalesce((SELECT o.on_dead = 'halt' FROM almanac.kind_ordering AS o
                                  WHERE o.kind = k.kind), false)))) AS c
    WHERE c.id IS NOT NULL;
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
    FOR v_kind IN
        WITH released AS (
            UPDATE almanac.jobs AS j
            SET status = 'ready',
                route = coalesce((SELECT rt.mode FROM almanac.routes AS rt WHERE rt.kind = j.kind), 'db')
            WHERE j.id = ANY (v_taken)
            RETURNING j.kind)
        SELECT released.kind FROM released
    LOOP
        v_released := v_released + 1;
        PERFORM pg_notify('almanac_jobs', v_kind);
    END LOOP;
    RETURN v_released;
END $$;

-- One key, for the callers of 0115's function (the caller holds its locks).
CREATE OR REPLACE FUNCTION almanac.release_key(p_kind text, p_key text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF almanac.release_keys(ARRAY[p_kind], ARRAY[p_key]) > 0 THEN
        RETURN (SELECT j.id FROM almanac.jobs AS j
                WHERE j.kind = p_kind AND j.ordering_key = p_key AND j.status = 'ready'
                ORDER BY j.id LIMIT 1);
    END IF;
    RETURN NULL;
END $$;

-- Takes, for each of `p_kinds[i]`/`p_keys[i]` (sorted by the caller), its
-- kind's route lock (shared) and its own lock: tried first, then waited
-- for until `p_until` in all; returns which it holds, in order. A route
-- lock is only ever tried (it is busy only while `route set` or `ordering
-- set|clear` runs, which take it exclusively).
CREATE FUNCTION almanac.lock_keys(p_kinds text[], p_keys text[], p_until timestamptz)
RETURNS boolean[]
LANGUAGE plpgsql VOLATILE AS $$
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

-- 3: the statement trigger of 0117, with one wait of at most 50 ms for the
-- whole statement, and the release of 1.
CREATE OR REPLACE FUNCTION almanac.jobs_release_keys() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_ended text := current_setting('almanac.ended_keys', true);
    v_kinds text[];
    v_keys text[];
    v_got boolean[];
BEGIN
    IF v_ended IS NULL OR v_ended = '' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('almanac.ended_keys', '', true);
    SELECT array_agg(k.kind ORDER BY k.kind, k.key), array_agg(k.key ORDER BY k.kind, k.key)
    INTO v_kinds, v_keys
    FROM (SELECT DISTINCT e ->> 0 AS kind, e ->> 1 AS key
          FROM unnest(string_to_array(rtrim(v_ended, E'\n'), E'\n')) AS l(line),
               LATERAL (SELECT l.line::json AS e) AS j) AS k;
    v_got := almanac.lock_keys(v_kinds, v_keys, clock_timestamp() + interval '50 milliseconds');
    INSERT INTO almanac.ordering_recheck (kind, ordering_key)
    SELECT k.kind, k.key FROM unnest(v_kinds, v_keys, v_got) AS k(kind, key, got)
    WHERE NOT k.got
    ON CONFLICT DO NOTHING;
    PERFORM almanac.release_keys(
        ARRAY(SELECT k.kind FROM unnest(v_kinds, v_keys, v_got) WITH ORDINALITY AS k(kind, key, got, i)
              WHERE k.got ORDER BY k.i),
        ARRAY(SELECT k.key FROM unnest(v_kinds, v_keys, v_got) WITH ORDINALITY AS k(kind, key, got, i)
              WHERE k.got ORDER BY k.i));
    RETURN NULL;
END $$;

-- 2: the reaper's sweep of noted keys waits up to 200 ms in all for busy
-- ones (noted again past that).
CREATE OR REPLACE FUNCTION almanac.recheck_keys(p_limit integer) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
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

-- 1: the safety net. Walks up to `p_limit` keys with held jobs after
-- (`p_after_kind`, `p_after_key`) (NULL: from the start), in key order
-- through jobs_ordering_status_idx, and releases those that nothing stands
-- before (their locks tried, never waited for). Returns the last key
-- walked (NULL once the walk has reached the end: start again) and how
-- many jobs it made ready.
CREATE FUNCTION almanac.sweep_held(p_after_kind text, p_after_key text, p_limit integer,
                                   OUT last_kind text, OUT last_key text, OUT released integer)
LANGUAGE plpgsql VOLATILE AS $$
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

-- 4: route locks before key locks.
CREATE OR REPLACE FUNCTION almanac.release_held(p_ids bigint[]) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
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

-- 2 and 6: an enqueue releases its key when held jobs wait with nothing
-- before them; a long key is refused; a key from the payload that is ''
-- is no key. Otherwise as 0117's.
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

-- 5: the ordering key is the message key on Kafka only. Otherwise as 0115's.
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
