-- Short relay transactions and per-row outcomes.
--
-- A relay claims a batch by giving its rows an in-flight lease and commits:
-- `lease_token` names the claim, and `available_at` is pushed to the end of
-- the lease, so a relay that dies before marking leaves rows that come due
-- again by themselves. Marks name the token: a relay whose lease ran out (or
-- whose rows were re-addressed by `route set`) changes nothing.
--
-- A row the broker rejects for good gets `failed_at` and its reason in
-- `last_error`; it is never retried and no longer counts as backlog.
ALTER TABLE almanac.outbox
    ADD COLUMN lease_token uuid,
    ADD COLUMN failed_at   timestamptz,
    ADD CHECK (published_at IS NULL OR failed_at IS NULL);

DROP INDEX almanac.outbox_due_idx;
CREATE INDEX outbox_due_idx ON almanac.outbox (sink, available_at, id)
    WHERE published_at IS NULL AND failed_at IS NULL;
CREATE INDEX outbox_failed_idx ON almanac.outbox (sink, failed_at) WHERE failed_at IS NOT NULL;
