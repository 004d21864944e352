-- Disabled is not missed (issue #21 item 2).
--
-- Each spell during which a schedule was disabled, as the syncs that
-- disabled and re-enabled it saw it (database time). A run that fell due
-- inside a spell is recorded `skipped_disabled`, never caught up; the
-- scheduler's catch-up policy applies only to runs that fell due while the
-- schedule was enabled. `almanac::scheduler::plan` states the rule; `ledger::sync` keeps the spells.
CREATE TABLE almanac.schedule_disabled (
    schedule    text        NOT NULL REFERENCES almanac.schedules (name),
    disabled_at timestamptz NOT NULL,
    -- NULL while the schedule is still disabled.
    enabled_at  timestamptz,
    PRIMARY KEY (schedule, disabled_at),
    CHECK (enabled_at IS NULL OR enabled_at >= disabled_at)
);

-- At most one open spell per schedule.
CREATE UNIQUE INDEX schedule_disabled_open_idx ON almanac.schedule_disabled (schedule)
    WHERE enabled_at IS NULL;

-- Schedules disabled before this migration: their spell is taken to start at
-- their last definition change (the latest it can have started), so runs
-- before it are caught up as they were before.
INSERT INTO almanac.schedule_disabled (schedule, disabled_at)
SELECT name, updated_at FROM almanac.schedules WHERE NOT enabled;

-- The ledger is never pruned: give up rather than queue every tick behind
-- a long reader, and do not scan it under the table lock. The new check
-- admits everything the old one did, so the rows already there keep it
-- (NOT VALID skips the scan; it still holds for every row written).
SET LOCAL lock_timeout = '10s';
ALTER TABLE almanac.schedule_runs
    DROP CONSTRAINT schedule_runs_outcome_check,
    ADD CONSTRAINT schedule_runs_outcome_check
        CHECK (outcome IN ('emitted', 'skipped_catchup', 'skipped_overlap', 'skipped_disabled'))
        NOT VALID;
