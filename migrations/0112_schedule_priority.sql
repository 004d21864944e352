-- A schedule's priority (issue #23): stored with its definition, so a
-- schedule read back from the database (a trigger from the dashboard or
-- the JSON API) emits its jobs at the priority its file gives, as the
-- scheduler does. The table holds one row per schedule: the check scans
-- it, briefly.
SET LOCAL lock_timeout = '10s';
ALTER TABLE almanac.schedules ADD COLUMN priority smallint NOT NULL DEFAULT 0
    CHECK (priority BETWEEN 0 AND 9);
