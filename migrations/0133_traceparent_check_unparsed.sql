-- `almanac.traceparent_ok` is PL/pgSQL and STRICT. As an inlinable SQL
-- function in the jobs table's check constraint (0115, 0119), its body was
-- parsed, analysed and folded anew for every statement that writes a job
-- (PostgreSQL prepares a table's check constraints once per statement and
-- inlines SQL functions while doing so): in a `perf` profile of one job
-- enqueued per transaction, check constraints were about a fifth of the
-- database's CPU, parsing included. Now nothing is parsed, and a job
-- without a traceparent (NULL) skips the call: a STRICT function is not
-- called for a NULL argument, and the constraint takes the NULL as
-- satisfied. What the function accepts is unchanged; for NULL it now
-- answers NULL instead of true, which the constraint and the enqueue
-- functions' checks take the same way (no refusal).
SET LOCAL lock_timeout = '10s';

CREATE OR REPLACE FUNCTION almanac.traceparent_ok(tp text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    RETURN tp ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$'
        AND (length(tp) = 55 OR (left(tp, 2) <> '00' AND substr(tp, 56, 1) = '-'))
        AND left(tp, 2) <> 'ff'
        AND substr(tp, 4, 32) <> '00000000000000000000000000000000'
        AND substr(tp, 37, 16) <> '0000000000000000';
END $$;
