-- The scheduler's own cursor: the latest run a tick or catch-up planned per
-- schedule. Backfilled rows do not move it, so the lookup skips them.
CREATE INDEX schedule_runs_planned_idx ON almanac.schedule_runs (schedule, fire_at DESC)
    WHERE source <> 'backfill';
