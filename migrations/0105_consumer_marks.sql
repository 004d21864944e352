-- Re-drive does not amplify lag (issue #20 item 4).
--
-- When consumers last saw each partition of a destination drained: every
-- message published there before `drained_at` had been taken (Kafka: the
-- consumer group's committed offset had reached the partition's end;
-- RabbitMQ, one queue, partition 0: the queue had no ready message).
-- Running consumers check about once a second and keep the latest instant
-- (database time). The relay re-drives a destination's stranded jobs only
-- when it has no marks at all (no consumer that records them) or every
-- partition was drained within `redrive_after`, so a message that is only
-- waiting for a consumer is never copied again. `almanac::consumer::marks`
-- writes the rows; `almanac::queue::routing::redrive` reads them.
--
-- As in 0101-0103: a bounded wait for locks (a new table takes none that
-- others hold, but the rule is kept for every migration).
SET LOCAL lock_timeout = '10s';
CREATE TABLE almanac.consumer_marks (
    sink        text        NOT NULL,
    destination text        NOT NULL,
    partition   int         NOT NULL,
    drained_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sink, destination, partition)
);
