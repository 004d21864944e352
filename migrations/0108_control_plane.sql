-- The operator's control plane (issue #22): a `cancelled` status, cancel
-- requests on running jobs, paused kinds, and the audit log.
--
-- As in 0101-0107: a bounded wait for the locks the ALTERs take.
SET LOCAL lock_timeout = '10s';

-- `cancelled`: an operator stopped the job; counted apart from `dead` (a
-- job that failed). Terminal, like `done` and `dead`: nothing runs it again
-- unless an operator retries it.
--
-- The new check admits every value the old one did, so every existing row
-- passes it: it is added NOT VALID (enforced for every write from now on)
-- instead of validated by a scan of the whole table under this migration's
-- exclusive lock.
ALTER TABLE almanac.jobs DROP CONSTRAINT jobs_status_check;
ALTER TABLE almanac.jobs ADD CONSTRAINT jobs_status_check
    CHECK (status IN ('ready', 'running', 'done', 'dead', 'cancelled')) NOT VALID;

-- Who cancelled a job (or asked to) and why. On a running job,
-- `cancel_requested_at` is the request: the job keeps its lease, the
-- process holding it stops the handler and records `cancelled` under the
-- fence; should that process be gone, the reaper records `cancelled` when
-- the lease runs out, never `ready`. Every statement that would make a
-- running job `ready` or `dead` makes it `cancelled` when a request is set.
-- Cleared when an operator retries the job.
ALTER TABLE almanac.jobs
    ADD COLUMN cancel_requested_at timestamptz,
    ADD COLUMN cancelled_by        text,
    ADD COLUMN cancel_reason       text;

-- (The janitor's index of cancelled jobs is built by 0109, concurrently:
-- built here it would read the whole table under this transaction's
-- exclusive lock.)

-- Paused kinds: no worker claims, and no broker consumer starts, a job of a
-- paused kind; `*` pauses every kind. A running job is not stopped (cancel
-- it). Resuming deletes the row.
CREATE TABLE almanac.kind_pauses (
    kind      text        PRIMARY KEY CHECK (kind <> ''),
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text        NOT NULL,
    note      text
);

-- One row per operator action, from the CLI, the dashboard or the JSON API,
-- written in the action's own transaction: an action that rolled back
-- leaves no row, one that committed always has one.
CREATE TABLE almanac.audit_log (
    id     bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT now(),
    -- The basic-auth user, or the OS user of the CLI.
    actor  text        NOT NULL,
    source text        NOT NULL CHECK (source IN ('cli', 'dashboard', 'api')),
    action text        NOT NULL,
    -- What it acted on: `job 42`, `kind report`, a bulk filter.
    target text        NOT NULL,
    -- How many rows it changed.
    count  bigint      NOT NULL CHECK (count >= 0),
    note   text
);
