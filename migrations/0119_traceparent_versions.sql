-- A traceparent of a later W3C trace context version (issue #24 item 3,
-- after review). 0115's check took only the exact version-00 form for
-- every version; the W3C recommendation says a parser that meets a higher
-- version reads the first four fields and accepts what follows a further
-- `-`. Version 00 stays exact; `ff` stays invalid. The check constraint of
-- 0115 calls this function, so it changes with it (nothing stored is
-- refused by the wider rule).
CREATE OR REPLACE FUNCTION almanac.traceparent_ok(tp text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT tp IS NULL
        OR (tp ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$'
            AND (length(tp) = 55 OR (left(tp, 2) <> '00' AND substr(tp, 56, 1) = '-'))
            AND left(tp, 2) <> 'ff'
            AND substr(tp, 4, 32) <> '00000000000000000000000000000000'
            AND substr(tp, 37, 16) <> '0000000000000000')
$$;
