-- The reconcile sweep's look for kinds with a ready job off their route
-- (`queue::routing::kinds_off_route`, issue #26): without this index it read
-- every ready job of every routed kind (190 ms at 128,000 ready jobs in a
-- table of 1,000,000, growing with them), because "route differs from the
-- kind's mode" is no range of any index. With it, each routed kind costs
-- two probes, one per other mode (0.2 ms), however many jobs wait.
--
-- The route leads, not the kind: an index on (kind, route) was taken by the
-- claim's walk of a kind's due jobs (it read and sorted every ready job of
-- the kind, 100 ms a claim at 1,000,000 jobs, instead of stopping after
-- the batch in jobs_ready_kind_idx); led by the route, it serves only a
-- look that names the route.
--
-- As 0109: building it reads the whole table under a SHARE lock (claims,
-- heartbeats and enqueues wait, about a second per million jobs). On a big
-- table, build it by hand beforehand and this migration does nothing:
--
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_ready_route_kind_idx
--       ON almanac.jobs (route, kind) WHERE status = 'ready';
SET LOCAL lock_timeout = '10s';
CREATE INDEX IF NOT EXISTS jobs_ready_route_kind_idx ON almanac.jobs (route, kind)
    WHERE status = 'ready';
