-- The job table: the queue, its lease fence and its idempotency keys.
CREATE SCHEMA IF NOT EXISTS almanac;

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
-- Janitor and listings of finished work.
CREATE INDEX jobs_finished_idx ON almanac.jobs (finished_at) WHERE status IN ('done', 'dead');
