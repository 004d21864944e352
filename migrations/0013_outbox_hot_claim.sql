-- The relay's claim becomes a HOT update.
--
-- Until now a claim pushed `available_at` (a key of `outbox_due_idx`) to the
-- end of the in-flight lease, so every claimed row got new entries in every
-- index on the table: about 6 WAL records and 660 bytes per row for the claim
-- alone. The lease now lives in `lease_until`, which no index covers, and the
-- claim skips rows whose lease has not ended. A claim writes only unindexed
-- columns; with room left on each page (fillfactor 50: a claim takes every
-- row of a page at once, so a page must fit a second version of each) the
-- new row versions stay on their page and no index is touched (measured: the
-- claim's WAL per 500 rows went from about 3,000 records and 330 kB to 1,000
-- records and 85 kB). Outbox rows are short-lived, so the emptier pages cost
-- little.
--
-- Rows claimed before this migration keep their pushed `available_at` and
-- come due when it passes, as before.
-- Replacing it locks the table; behind a long transaction that lock would
-- queue every claim behind it. Give up instead, and name the cause.
SET LOCAL lock_timeout = '10s';
ALTER TABLE almanac.outbox ADD COLUMN lease_until timestamptz;
ALTER TABLE almanac.outbox SET (fillfactor = 50);
