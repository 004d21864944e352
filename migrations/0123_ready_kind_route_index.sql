-- The reconcile sweep's look for kinds with a ready job off their route
-- (`queue::routing::kinds_off_route`, issue #26): without this index it read
-- every ready job of every routed kind (190 ms at 128,000 ready jobs in a
-- table of 1,000,000, growing with them), because "route differs from the
-- kind's mode" is no range of any index. With it, each routed kind costs
-- two probes for the two other modes (0.05 ms), however many jobs wait.
-- Only ready rows are in it, as in jobs_ready_kind_idx.
--
-- As 0109: building it reads the whole table under a SHARE lock (claims,
-- heartbeats and enqueues wait, about a second per million jobs). On a big
-- table, build it by hand beforehand and this migration does nothing:
--
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_ready_kind_route_idx
--       ON almanac.jobs (kind, route) WHERE status = 'ready';
SET LOCAL lock_timeout = '10s';
CREATE INDEX IF NOT EXISTS jobs_ready_kind_route_idx ON almanac.jobs (kind, route)
    WHERE status = 'ready';
