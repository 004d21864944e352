-- Schedules as last synced from the TOML files, and the run ledger.
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
-- Overlap checks: a schedule's unfinished jobs.
CREATE INDEX jobs_schedule_unfinished_idx ON almanac.jobs (schedule)
    WHERE schedule IS NOT NULL AND status IN ('ready', 'running');
