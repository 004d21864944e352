-- Who consumes what (issue #20 item 1): a routed kind that no running
-- consumer of its destination can run must be visible at once, in `stats`,
-- on the dashboard, and to `route set` and `consume`, not only in the log
-- and metrics of the consumer that met its messages.
--
-- Every running consumer keeps one row here, written every couple of
-- seconds (`almanac::consumer::presence` says how, and when a row counts
-- as running): its sink, destination and the kinds it has handlers for,
-- and, per kind it has no handler for, how many of that kind's messages it
-- gave back unrun and when it last did. A consumer deletes its row when it
-- stops cleanly; a row not written for an hour is deleted by the next
-- consumer's write.
--
-- UNLOGGED: the rows are rewritten every few seconds and say only what runs
-- now, so they write no WAL, and a crash, which empties the table, loses
-- nothing the next writes do not restore. On a standby the table cannot be
-- read; the readers say nothing there.
SET LOCAL lock_timeout = '10s';

CREATE UNLOGGED TABLE almanac.consumers (
    id          uuid        PRIMARY KEY,
    sink        text        NOT NULL,
    destination text        NOT NULL,
    kinds       text[]      NOT NULL,
    host        text        NOT NULL,
    pid         integer     NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    seen_at     timestamptz NOT NULL DEFAULT now(),
    -- kind -> {"messages": given back unrun since the consumer started,
    --          "last_at": when the last one was}
    unhandled   jsonb       NOT NULL DEFAULT '{}'
);
CREATE INDEX consumers_destination_idx ON almanac.consumers (sink, destination);
