-- Runtime controls without editing files (issue #21 item 3).
--
-- `almanac schedules pause|resume` keep one row per pause: a spell during
-- which the schedule's runs are recorded `skipped_paused` as they fall due
-- (never caught up, `backfill` can fill them), with who paused it and why.
-- The TOML files stay the source of the definitions; a pause overlays them.
-- `almanac schedules trigger` records its run with source `trigger`; like
-- backfilled rows, triggered rows never move the scheduler's cursor.
-- `almanac::scheduler::controls` states the rules.
CREATE TABLE almanac.schedule_pauses (
    schedule   text        NOT NULL REFERENCES almanac.schedules (name),
    paused_at  timestamptz NOT NULL,
    -- NULL while the schedule is still paused.
    resumed_at timestamptz,
    note       text        NOT NULL DEFAULT '',
    paused_by  text        NOT NULL,
    resumed_by text,
    PRIMARY KEY (schedule, paused_at),
    CHECK (resumed_at IS NULL OR resumed_at >= paused_at)
);

-- At most one open pause per schedule.
CREATE UNIQUE INDEX schedule_pauses_open_idx ON almanac.schedule_pauses (schedule)
    WHERE resumed_at IS NULL;

-- As in 0101: bounded lock waits, no scan of the ledger under the lock
-- (each new check admits everything its old one did).
SET LOCAL lock_timeout = '10s';
ALTER TABLE almanac.schedule_runs
    DROP CONSTRAINT schedule_runs_outcome_check,
    ADD CONSTRAINT schedule_runs_outcome_check
        CHECK (outcome IN ('emitted', 'skipped_catchup', 'skipped_overlap', 'skipped_disabled',
                           'skipped_paused')) NOT VALID,
    DROP CONSTRAINT schedule_runs_source_check,
    ADD CONSTRAINT schedule_runs_source_check
        CHECK (source IN ('tick', 'catchup', 'backfill', 'trigger')) NOT VALID;

-- The scheduler's cursor reads only the rows it planned itself
-- (`source <> 'backfill' AND source <> 'trigger'`), through the partial
-- index `schedule_runs_planned_idx` (`source <> 'backfill'`), kept as it is
-- rather than rebuilt under the lock.
