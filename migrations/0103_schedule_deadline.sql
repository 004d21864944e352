-- Deadlines and alerting (issue #21 item 4).
--
-- A schedule's `deadline`, as its file writes it (normalised): a duration
-- after each run's fire time (`2h`) or a local time of day in the
-- schedule's zone (`06:00`, the first such time after the fire time).
-- NULL: no deadline. `almanac::scheduler::deadline` states the rule; the
-- metrics collector counts the runs past their deadline whose job is not
-- done. A definition without a deadline hashes as it did before, so this
-- migration rewrites no row and no sync after it does either.
--
-- As in 0101 and 0102: a bounded wait for the table lock. Adding a nullable
-- column with no default only touches the catalog (no table rewrite).
SET LOCAL lock_timeout = '10s';
ALTER TABLE almanac.schedules ADD COLUMN deadline text;
