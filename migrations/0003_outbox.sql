-- Routes per job kind, and the outbox the relay drains into Kafka or RabbitMQ.
CREATE TABLE almanac.routes (
    kind        text PRIMARY KEY,
    mode        text        NOT NULL CHECK (mode IN ('db', 'dual', 'broker')),
    sink        text        CHECK (sink IN ('kafka', 'rabbitmq')),
    destination text,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CHECK (mode = 'db' OR (sink IS NOT NULL AND destination IS NOT NULL AND destination <> ''))
);

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
    last_error   text
);

CREATE INDEX outbox_due_idx ON almanac.outbox (sink, available_at, id) WHERE published_at IS NULL;
CREATE INDEX outbox_job_idx ON almanac.outbox (job_id);
CREATE INDEX outbox_published_idx ON almanac.outbox (published_at) WHERE published_at IS NOT NULL;

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
-- row in the same transaction.
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
    FOR EACH ROW EXECUTE FUNCTION almanac.jobs_to_outbox();
