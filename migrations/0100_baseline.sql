-- almanac's baseline schema (version 100).
--
-- This file squashes the pre-release migrations 0001-0016 into one; the
-- schema it creates is checked in as `schema.sql`, and tests keep the two
-- equal. It is frozen: change the schema with a new migration (0101 and
-- up), never by editing this file (a test fails when a frozen migration
-- changes). Versions below 100 belong to pre-release builds. A database
-- that applied exactly the last pre-release 0001-0016 has this schema
-- already; `almanac::db::schema` adopts it (records this version beside
-- the old ones) on start.
CREATE SCHEMA IF NOT EXISTS almanac;

-- ----------------------------------------------------------------------
-- Jobs: the queue, its lease fence and its idempotency keys.
-- ----------------------------------------------------------------------
CREATE TABLE almanac.jobs (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind            text        NOT NULL CHECK (kind <> ''),
    payload         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    status          text        NOT NULL DEFAULT 'ready'
                    CHECK (status IN ('ready', 'running', 'done', 'dead')),
    run_at          timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts    integer     NOT NULL DEFAULT 5 CHECK (max_attempts > 0),
    lease_token     uuid,
    lease_until     timestamptz,
    idempotency_key text UNIQUE,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    last_error      text,
    route           text        NOT NULL DEFAULT 'db' CHECK (route IN ('db', 'dual', 'broker')),
    schedule        text,
    logical_run     text,
    -- A running job always holds a lease; nothing else does.
    CHECK ((status = 'running') = (lease_token IS NOT NULL AND lease_until IS NOT NULL))
);

-- Due ready rows in (run_at, id) order: claims across many kinds, and the
-- oldest due job in stats.
CREATE INDEX jobs_ready_due_idx ON almanac.jobs (run_at, id) WHERE status = 'ready';
-- Claims for one kind walk this in order and stop at LIMIT, however many
-- ready rows other kinds or the future hold.
CREATE INDEX jobs_ready_kind_idx ON almanac.jobs (kind, run_at, id) WHERE status = 'ready';
-- Reaper: running rows by lease expiry.
CREATE INDEX jobs_running_lease_idx ON almanac.jobs (lease_until) WHERE status = 'running';
-- Dead jobs per kind without touching done rows.
CREATE INDEX jobs_dead_kind_idx ON almanac.jobs (kind) WHERE status = 'dead';
-- The janitor deletes done and dead jobs by age, each status on its own.
CREATE INDEX jobs_done_finished_idx ON almanac.jobs (finished_at) WHERE status = 'done';
CREATE INDEX jobs_dead_finished_idx ON almanac.jobs (finished_at) WHERE status = 'dead';
-- Overlap checks: a schedule's unfinished jobs.
CREATE INDEX jobs_schedule_unfinished_idx ON almanac.jobs (schedule)
    WHERE schedule IS NOT NULL AND status IN ('ready', 'running');

-- ----------------------------------------------------------------------
-- Schedules as last synced from the TOML files, and the run ledger.
-- ----------------------------------------------------------------------
CREATE TABLE almanac.schedules (
    name            text PRIMARY KEY,
    cron            text        NOT NULL,
    timezone        text        NOT NULL,
    kind            text        NOT NULL,
    payload         jsonb       NOT NULL,
    catchup         text        NOT NULL CHECK (catchup IN ('all', 'latest', 'none')),
    catchup_window  interval    NOT NULL,
    start           date,
    overlap         text        NOT NULL CHECK (overlap IN ('allow', 'skip')),
    max_attempts    integer     NOT NULL CHECK (max_attempts > 0),
    enabled         boolean     NOT NULL,
    definition_hash text        NOT NULL,
    -- First sync: a new schedule catches up nothing from before it existed.
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- One row per logical run that came due or was backfilled, emitted or skipped
-- with its reason. It outlives job retention (job_id becomes NULL), so a run
-- is never emitted twice.
CREATE TABLE almanac.schedule_runs (
    schedule    text        NOT NULL REFERENCES almanac.schedules (name),
    logical_run text        NOT NULL,
    fire_at     timestamptz NOT NULL,
    job_id      bigint      REFERENCES almanac.jobs (id) ON DELETE SET NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    source      text        NOT NULL CHECK (source IN ('tick', 'catchup', 'backfill')),
    outcome     text        NOT NULL CHECK (outcome IN ('emitted', 'skipped_catchup', 'skipped_overlap')),
    PRIMARY KEY (schedule, logical_run)
);

CREATE INDEX schedule_runs_fire_idx ON almanac.schedule_runs (schedule, fire_at DESC);
CREATE INDEX schedule_runs_job_idx ON almanac.schedule_runs (job_id) WHERE job_id IS NOT NULL;
-- The scheduler's own cursor: the latest run a tick or catch-up planned per
-- schedule. Backfilled rows do not move it, so the lookup skips them.
CREATE INDEX schedule_runs_planned_idx ON almanac.schedule_runs (schedule, fire_at DESC)
    WHERE source <> 'backfill';

-- ----------------------------------------------------------------------
-- Routes per job kind, the outbox the relay drains into Kafka or RabbitMQ,
-- and the relay's batches (in flight, then records of what was published).
-- `almanac::relay::outbox` documents the claim and the marks.
-- ----------------------------------------------------------------------
CREATE TABLE almanac.routes (
    kind        text PRIMARY KEY,
    mode        text        NOT NULL CHECK (mode IN ('db', 'dual', 'broker')),
    sink        text        CHECK (sink IN ('kafka', 'rabbitmq')),
    destination text,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CHECK (mode = 'db' OR (sink IS NOT NULL AND destination IS NOT NULL AND destination <> ''))
);

-- A row the broker rejects for good gets `failed_at` and its reason in
-- `last_error`; it is never retried and no longer counts as backlog.
-- Published rows are deleted by the mark (their batch is the record);
-- `published_at` is kept for readers of rows published row by row.
CREATE TABLE almanac.outbox (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id       bigint      NOT NULL REFERENCES almanac.jobs (id) ON DELETE CASCADE,
    sink         text        NOT NULL CHECK (sink IN ('kafka', 'rabbitmq')),
    destination  text        NOT NULL,
    msg_key      text        NOT NULL,
    payload      jsonb       NOT NULL,
    headers      jsonb       NOT NULL,
    available_at timestamptz NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    attempts     integer     NOT NULL DEFAULT 0,
    last_error   text,
    failed_at    timestamptz,
    CHECK (published_at IS NULL OR failed_at IS NULL)
);

CREATE INDEX outbox_job_idx ON almanac.outbox (job_id);
CREATE INDEX outbox_published_idx ON almanac.outbox (published_at) WHERE published_at IS NOT NULL;
CREATE INDEX outbox_due_idx ON almanac.outbox (sink, available_at, id)
    WHERE published_at IS NULL AND failed_at IS NULL;
CREATE INDEX outbox_failed_idx ON almanac.outbox (sink, failed_at) WHERE failed_at IS NOT NULL;

-- A claim is one row here: the batch's token, its outbox ids and a lease.
-- Rows named by a batch in flight are skipped by other claims. Marking
-- deletes the published outbox rows and turns the batch into a record of
-- what was published: `published_at`, the jobs, and their span (lowest to
-- highest job id, written by the mark) under a GiST index, one entry per
-- batch, through which re-drive and the job page find a job's records.
-- The id arrays are stored EXTERNAL: sorted ids barely compress, and pglz
-- spent about half a millisecond on each 4 kB array.
CREATE TABLE almanac.outbox_batches (
    token        uuid PRIMARY KEY,
    sink         text        NOT NULL CHECK (sink IN ('kafka', 'rabbitmq')),
    -- The outbox rows claimed; once published, only those published.
    ids          bigint[]    NOT NULL,
    -- Empty while in flight; once published, the jobs of the rows published.
    job_ids      bigint[]    NOT NULL DEFAULT '{}',
    claimed_at   timestamptz NOT NULL DEFAULT now(),
    lease_until  timestamptz NOT NULL,
    published_at timestamptz,
    -- NULL while the batch is in flight.
    job_span     int8range
);
ALTER TABLE almanac.outbox_batches
    ALTER COLUMN ids SET STORAGE EXTERNAL,
    ALTER COLUMN job_ids SET STORAGE EXTERNAL;

CREATE INDEX outbox_batches_in_flight_idx ON almanac.outbox_batches (sink)
    WHERE published_at IS NULL;
CREATE INDEX outbox_batches_published_idx ON almanac.outbox_batches (published_at)
    WHERE published_at IS NOT NULL;
CREATE INDEX outbox_batches_job_span_idx ON almanac.outbox_batches USING gist (job_span)
    WHERE published_at IS NOT NULL;

-- Lowest to highest of `ids`, bounds included; NULL when empty.
CREATE FUNCTION almanac.id_span(ids bigint[]) RETURNS int8range
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN count(*) > 0 THEN int8range(min(x), max(x), '[]') END
    FROM unnest(ids) AS x
$$;

-- The one place an outbox row is built from a job: the trigger below and the
-- relay's re-drive both call it.
CREATE FUNCTION almanac.write_outbox(j almanac.jobs) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r almanac.routes%ROWTYPE;
BEGIN
    SELECT * INTO r FROM almanac.routes WHERE kind = j.kind;
    IF r.sink IS NULL THEN
        RAISE EXCEPTION 'job % of kind % is routed to %, but the kind has no sink; run `almanac route set`', j.id, j.kind, j.route;
    END IF;
    INSERT INTO almanac.outbox (job_id, sink, destination, msg_key, payload, headers, available_at)
    VALUES (
        j.id, r.sink, r.destination,
        coalesce(j.idempotency_key, 'almanac:job:' || j.id),
        j.payload,
        jsonb_build_object(
            'almanac-job-id', j.id::text,
            'almanac-kind', j.kind,
            'almanac-attempt', (j.attempts + 1)::text,
            'almanac-logical-run', coalesce(j.logical_run, '')),
        j.run_at);
    PERFORM pg_notify('almanac_outbox', r.sink);
END $$;

-- A new job takes its kind's route. The shared advisory lock orders the
-- insert against `almanac route set`, which takes the same key exclusively.
CREATE FUNCTION almanac.jobs_take_route() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('almanac.route:' || NEW.kind));
    NEW.route := coalesce((SELECT mode FROM almanac.routes WHERE kind = NEW.kind), 'db');
    RETURN NEW;
END $$;

CREATE TRIGGER jobs_take_route BEFORE INSERT ON almanac.jobs
    FOR EACH ROW EXECUTE FUNCTION almanac.jobs_take_route();

-- Every transition of a dual or broker job to ready (enqueue, retry, reaper,
-- release, operator retry, a route change away from db) writes its outbox
-- row in the same transaction. The WHEN clause keeps claims and completions
-- from queuing a trigger event at all.
CREATE FUNCTION almanac.jobs_to_outbox() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'ready' AND NEW.route IN ('dual', 'broker')
       AND (TG_OP = 'INSERT' OR OLD.status <> 'ready' OR OLD.route = 'db') THEN
        PERFORM almanac.write_outbox(NEW);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_to_outbox AFTER INSERT OR UPDATE OF status, route ON almanac.jobs
    FOR EACH ROW WHEN (NEW.status = 'ready' AND NEW.route IN ('dual', 'broker'))
    EXECUTE FUNCTION almanac.jobs_to_outbox();

-- The relay's claim, in one round trip (`almanac::relay::outbox::claim`
-- documents it). A VOLATILE function takes a fresh snapshot for each
-- statement under READ COMMITTED, so the claim sees every batch committed
-- before it got the sink's lock; under REPEATABLE READ the snapshot would
-- predate the lock, so the function refuses (SQLSTATE ALM01) and the caller
-- runs it in a READ COMMITTED transaction. Times are read after the lock, so
-- a claim that waited gets its whole lease. It waits at most 10 s for a
-- lock. A batch whose lease ended but whose mark is under way (row locked)
-- is not waited for: its rows are claimed again, a second copy the job fence
-- absorbs. Commits asynchronously: a claim lost in a crash only means its
-- rows are published again; call it in its own transaction.
--
-- A claim can start after a position (`p_after_at`, `p_after_id`: the last
-- row its relay claimed before; NULL claims from the start), so it does not
-- step over the dead index entries of everything published since the last
-- VACUUM; it returns each row's `available_at`, from which the relay takes
-- the next position. Rows that become due behind a position are found by
-- the relay's next claim from the start (`almanac::relay` says when).
CREATE FUNCTION almanac.claim_outbox(
    p_sink text, p_lock_class int, p_lock_key int, p_limit bigint, p_token uuid, p_lease_ms bigint,
    p_after_at timestamptz, p_after_id bigint)
RETURNS TABLE (id bigint, job_id bigint, destination text, msg_key text, payload text,
               headers text, attempts int, available_at timestamptz)
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
