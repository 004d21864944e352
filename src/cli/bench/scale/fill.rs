//! The background of `bench --scale` (the mix is in the parent module's
//! doc), grown in place from size to size with `INSERT ... SELECT FROM
//! generate_series`.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// Rows per INSERT statement.
const CHUNK: u64 = 1_000_000;
/// Schedules the ledger rows are spread over (`scale-0` ... `scale-9`,
/// every minute).
const SCHEDULES: u64 = 10;
/// Ledger rows younger than this many (six days of runs of every
/// schedule) have their job; older ones' jobs went to retention.
const WITH_JOB: u64 = 6 * 24 * 60 * SCHEDULES;
/// The kind routed `broker` (RabbitMQ) among the eight.
pub const BROKER_KIND: &str = "scale.h";

pub struct Background {
    /// Runs are counted back from the minute of this instant.
    anchor: DateTime<Utc>,
    jobs: u64,
    /// Mix rows so far (the next row's number).
    mixed: u64,
    ledger: u64,
    floor: i64,
}

impl Background {
    /// The route and the schedules the rows refer to.
    pub async fn start(pool: &PgPool) -> anyhow::Result<Background> {
        sqlx::query(
            "INSERT INTO almanac.routes (kind, mode, sink, destination)
             VALUES ($1, 'broker', 'rabbitmq', 'scale')",
        )
        .bind(BROKER_KIND)
        .execute(pool)
        .await?;
        sqlx::query(
            "INSERT INTO almanac.schedules (name, cron, timezone, kind, payload, catchup,
                 catchup_window, overlap, max_attempts, enabled, definition_hash, created_at)
             SELECT 'scale-' || s, '* * * * *', 'UTC', 'scale.sched', '{}', 'none',
                    '1 hour', 'allow', 5, true, 'bench', now() - interval '400 days'
             FROM generate_series(0, $1 - 1) AS s",
        )
        .bind(SCHEDULES as i64)
        .execute(pool)
        .await?;
        let anchor = sqlx::query_scalar("SELECT now()").fetch_one(pool).await?;
        Ok(Background {
            anchor,
            jobs: 0,
            mixed: 0,
            ledger: 0,
            floor: 0,
        })
    }

    /// The largest background job id: the measurements' jobs are above it.
    pub fn floor(&self) -> i64 {
        self.floor
    }

    pub fn ledger_rows(&self) -> u64 {
        self.ledger
    }

    /// Adds rows until the table holds `size` jobs and `size / 10` ledger
    /// rows, then `VACUUM ANALYZE`.
    pub async fn grow(&mut self, pool: &PgPool, size: u64) -> anyhow::Result<()> {
        let ledger = (size / 10).max(self.ledger);
        let scheduled = ledger.min(WITH_JOB).saturating_sub(self.ledger);
        if ledger > self.ledger {
            self.grow_ledger(pool, ledger).await?;
        }
        self.jobs += scheduled;
        let mut left = size.saturating_sub(self.jobs);
        while left > 0 {
            let n = left.min(CHUNK);
            self.grow_mix(pool, n).await?;
            self.jobs += n;
            left -= n;
        }
        for table in ["jobs", "outbox", "schedule_runs"] {
            sqlx::query(&format!("VACUUM ANALYZE almanac.{table}"))
                .execute(pool)
                .await?;
        }
        self.floor = sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM almanac.jobs")
            .fetch_one(pool)
            .await?;
        Ok(())
    }

    /// Ledger rows up to `to`: run `g` is schedule `g % 10`'s run `g / 10 + 1`
    /// minutes before the anchor; the young ones with their `done` job,
    /// written together as the scheduler does.
    async fn grow_ledger(&mut self, pool: &PgPool, to: u64) -> anyhow::Result<()> {
        sqlx::query(
            r#"
            WITH runs AS (
                SELECT g, 'scale-' || (g % $4) AS schedule,
                       date_trunc('minute', $3::timestamptz)
                           - ((g / $4) + 1) * interval '1 minute' AS fire_at
                FROM generate_series($1::bigint, $2::bigint - 1) AS g
            ), named AS (
                SELECT g, schedule, fire_at,
                       to_char(fire_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI"Z"') AS logical_run
                FROM runs
            ), jobs AS (
                INSERT INTO almanac.jobs (kind, status, attempts, schedule, logical_run,
                                          idempotency_key, run_at, created_at, finished_at)
                SELECT 'scale.sched', 'done', 1, schedule, logical_run,
                       'schedule:' || schedule || ':' || logical_run,
                       fire_at, fire_at, fire_at + interval '1 second'
                FROM named WHERE g < $5
                RETURNING id, schedule, logical_run
            )
            INSERT INTO almanac.schedule_runs (schedule, logical_run, fire_at, job_id, source, outcome)
            SELECT n.schedule, n.logical_run, n.fire_at, j.id, 'tick', 'emitted'
            FROM named n LEFT JOIN jobs j USING (schedule, logical_run)
            "#,
        )
        .bind(self.ledger as i64)
        .bind(to as i64)
        .bind(self.anchor)
        .bind(SCHEDULES as i64)
        .bind(WITH_JOB as i64)
        .execute(pool)
        .await?;
        self.ledger = to;
        Ok(())
    }

    /// `n` more rows of the mix: by `g % 100`, 0-79 `done` (finished within
    /// six days), 80-93 `ready` one to eight days ahead, 94-98 `dead`
    /// (within twenty days, seven distinct errors), 99 `done` but one in
    /// 10,000 `running` on a lease a day long; kind `scale.a` ... `scale.h`
    /// by `g / 100`.
    async fn grow_mix(&mut self, pool: &PgPool, n: u64) -> anyhow::Result<()> {
        sqlx::query(
            r#"
            INSERT INTO almanac.jobs (kind, payload, status, run_at, created_at, attempts,
                                      max_attempts, lease_token, lease_until, finished_at, last_error)
            SELECT 'scale.' || chr(97 + ((g / 100) % 8)::int),
                   jsonb_build_object('n', g, 'customer', g % 1000),
                   st, run_at, least(run_at, now()), attempts, 5,
                   CASE WHEN st = 'running' THEN gen_random_uuid() END,
                   CASE WHEN st = 'running' THEN now() + interval '1 day' END,
                   finished, CASE WHEN st = 'dead' THEN 'exit status ' || (g % 7) END
            FROM generate_series($1::bigint, $2::bigint - 1) AS g,
            LATERAL (SELECT CASE WHEN g % 100 < 80 THEN 'done'
                                 WHEN g % 100 < 94 THEN 'ready'
                                 WHEN g % 100 < 99 THEN 'dead'
                                 WHEN g % 10000 = 9999 THEN 'running'
                                 ELSE 'done' END AS st) AS s,
            LATERAL (SELECT CASE st WHEN 'done' THEN now() - (g % 518400) * interval '1 second'
                                    WHEN 'dead' THEN now() - (g % 1728000) * interval '1 second'
                            END AS finished) AS f,
            LATERAL (SELECT CASE st WHEN 'ready'
                                    THEN now() + interval '1 day' + (g % 604800) * interval '1 second'
                                    WHEN 'running' THEN now() - interval '1 minute'
                                    ELSE finished - interval '1 second' END AS run_at,
                            CASE st WHEN 'ready' THEN 0 WHEN 'dead' THEN 5 ELSE 1 END AS attempts) AS r
            "#,
        )
        .bind(self.mixed as i64)
        .bind((self.mixed + n) as i64)
        .execute(pool)
        .await?;
        self.mixed += n;
        Ok(())
    }
}
