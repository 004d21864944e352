//! The job counters (`queue::counts`, migration 0128): exact under every
//! kind of change and concurrent folds, rebuilt when lost or broken, and a
//! read of `stats` that does not read the jobs.

use std::collections::BTreeMap;
use std::time::Duration;

use almanac::control::{ordering as control, Actor};
use almanac::queue::counts::{self, Fold};
use almanac::queue::ordering::OnDead;
use almanac::queue::{self, JobStatus, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::SinkKind;
use almanac::role::{Role, Settings};
use almanac::worker::{HandlerError, JobContext, Worker, WorkerConfig};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::{count, eventually};

type Counts = BTreeMap<(String, String), i64>;

/// One fold on a connection of its own.
async fn fold(pool: &PgPool, recount: bool) -> Fold {
    counts::fold(&mut pool.acquire().await.unwrap(), recount)
        .await
        .unwrap()
}

/// Runs `sql` (a bulk fill), then folds, as the reaper would next.
async fn fill(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(sql).execute(pool).await.unwrap();
    fold(pool, false).await;
}

/// The reads of `tables` that this session has not yet reported: rows read
/// by sequential scans, and entries of their indexes read by index scans.
/// Not only this transaction's: PostgreSQL 15 reports a session's counts at
/// most once a second, and `pg_stat_get_xact_*` include a previous
/// transaction's until then (the fill's fold, say, on the same pooled
/// connection). Take them at the start of a transaction and again at its
/// end: the difference is what the transaction read ([`read_since`]).
async fn reads(tx: &mut sqlx::PgConnection, tables: &[&str]) -> (i64, i64) {
    sqlx::query_as(
        "WITH t AS (SELECT unnest($1::text[])::regclass AS r)
         SELECT coalesce((SELECT sum(pg_stat_get_xact_tuples_returned(r)) FROM t), 0)::bigint,
                coalesce((SELECT sum(pg_stat_get_xact_tuples_returned(indexrelid)) FROM pg_index
                  WHERE indrelid IN (SELECT r FROM t)), 0)::bigint",
    )
    .bind(tables)
    .fetch_one(tx)
    .await
    .unwrap()
}

/// What this transaction read of `tables` since `before` ([`reads`] at its start).
async fn read_since(
    tx: &mut sqlx::PgConnection,
    tables: &[&str],
    before: (i64, i64),
) -> (i64, i64) {
    let now = reads(tx, tables).await;
    (now.0 - before.0, now.1 - before.1)
}

/// The jobs counted, per kind and status.
async fn counted(pool: &PgPool) -> Counts {
    let rows: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT kind, status, count(*) FROM almanac.jobs GROUP BY 1, 2")
            .fetch_all(pool)
            .await
            .unwrap();
    rows.into_iter().map(|(k, s, n)| ((k, s), n)).collect()
}

/// The counters' view of the jobs, or `None` when they are not whole.
async fn counters(pool: &PgPool) -> Option<Counts> {
    let mut conn = pool.acquire().await.unwrap();
    counts::jobs(&mut conn).await.unwrap().map(|c| {
        c.into_iter()
            .map(|c| ((c.kind, c.status.as_str().to_string()), c.count))
            .collect()
    })
}

/// The outbox rows counted, per (sink, kind, state).
async fn outbox_counted(pool: &PgPool) -> Vec<(String, String, String, i64)> {
    sqlx::query_as(
        "SELECT sink, headers->>'almanac-kind',
                CASE WHEN failed_at IS NOT NULL THEN 'failed'
                     WHEN published_at IS NOT NULL THEN 'published' ELSE 'pending' END,
                count(*)
           FROM almanac.outbox GROUP BY 1, 2, 3 ORDER BY 1, 2, 3",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The counters' view of the outbox rows.
async fn outbox_counters(pool: &PgPool) -> Option<Vec<(String, String, String, i64)>> {
    let mut conn = pool.acquire().await.unwrap();
    counts::outbox(&mut conn).await.unwrap().map(|c| {
        c.into_iter()
            .map(|c| (c.scope, c.kind, c.status, c.count))
            .collect()
    })
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_counters_equal_a_count_of_the_jobs_through_every_change_and_concurrent_folds(
    pool: PgPool,
) {
    control::set(
        &mut pool.acquire().await.unwrap(),
        &Actor::os_user(),
        "ordered",
        None,
        OnDead::Skip,
    )
    .await
    .unwrap();
    // A kind routed to RabbitMQ, no relay running: its jobs wait in the outbox.
    routes::set(
        &mut pool.acquire().await.unwrap(),
        "routed",
        RouteMode::Broker,
        Some(SinkKind::Rabbitmq),
        Some("routed"),
    )
    .await
    .unwrap();
    // One job in three fails its first attempt (retried at once), one in
    // seven for good (dead); `ordered` jobs are held behind their key's head.
    let failing = |ctx: JobContext| async move {
        if ctx.job.id % 7 == 0 {
            Err(HandlerError::permanent("one in seven dies"))
        } else if ctx.job.id % 3 == 0 && ctx.job.attempts == 1 {
            Err(HandlerError::retry_after(
                "one in three fails once",
                Duration::ZERO,
            ))
        } else {
            Ok(())
        }
    };
    let config = WorkerConfig {
        concurrency: 8,
        batch_size: 8,
        poll_interval: Duration::from_millis(20),
        ..WorkerConfig::default()
    };
    let stop = CancellationToken::new();
    let worker = Worker::new(pool.clone(), config.validated().unwrap())
        .register("plain", failing)
        .register("ordered", failing);
    let worker = tokio::spawn(worker.run(stop.clone()));
    // Two folders, each as fast as it goes, beside the writers.
    let folding: Vec<_> = (0..2)
        .map(|_| {
            let pool = pool.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let (mut folds, mut busy) = (0, 0);
                while !stop.is_cancelled() {
                    match fold(&pool, false).await {
                        Fold::Folded | Fold::Recounted => folds += 1,
                        Fold::Busy => busy += 1,
                        Fold::Skipped => panic!("a fold on the primary skipped"),
                    }
                }
                (folds, busy)
            })
        })
        .collect();
    let mut conn = pool.acquire().await.unwrap();
    for round in 0..20 {
        let jobs: Vec<NewJob> = (0..20)
            .map(|i| {
                let kind = if i % 2 == 0 { "plain" } else { "ordered" };
                let job = NewJob::new(kind).max_attempts(2);
                if kind == "ordered" {
                    job.ordering_key(format!("key-{}", i % 3))
                } else {
                    job
                }
            })
            .collect();
        queue::enqueue_many(&mut conn, &jobs).await.unwrap();
        // A kind no worker runs, one job per transaction, some cancelled.
        let idle = queue::enqueue(&mut conn, &NewJob::new("idle"))
            .await
            .unwrap();
        queue::enqueue(&mut conn, &NewJob::new("routed"))
            .await
            .unwrap();
        if round % 2 == 0 {
            queue::cancel_in(&mut conn, idle.id(), "test", None)
                .await
                .unwrap();
        }
        // The janitor's delete of every done job (ordered ones release
        // their successors in the same statement).
        if round % 5 == 4 {
            queue::delete_finished(&pool, JobStatus::Done, Duration::ZERO, None, 1_000)
                .await
                .unwrap();
        }
    }
    eventually(
        "every runnable job to end",
        Duration::from_secs(60),
        || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.jobs
              WHERE kind IN ('plain', 'ordered') AND status NOT IN ('done', 'dead')",
            )
            .await
                == 0
        },
    )
    .await;
    // What a relay does to outbox rows: publishes (deletes) some, fails
    // some for good (the row kept, its job dead).
    sqlx::raw_sql(
        "DELETE FROM almanac.outbox WHERE id IN (SELECT id FROM almanac.outbox ORDER BY id LIMIT 5);
         UPDATE almanac.outbox SET failed_at = now(), last_error = 'rejected'
          WHERE id IN (SELECT id FROM almanac.outbox ORDER BY id LIMIT 3);",
    )
    .execute(&pool)
    .await
    .unwrap();
    stop.cancel();
    worker.await.unwrap().unwrap();
    let (mut folds, mut busy) = (0, 0);
    for folder in folding {
        let (f, b) = folder.await.unwrap();
        folds += f;
        busy += b;
    }
    assert!(folds > 0, "no fold ran beside the writers");
    eprintln!("{folds} folds, {busy} found the other folding");
    let outbox = outbox_counted(&pool).await;
    assert_eq!(
        outbox,
        vec![
            ("rabbitmq".into(), "routed".into(), "failed".into(), 3),
            ("rabbitmq".into(), "routed".into(), "pending".into(), 12),
        ]
    );
    assert_eq!(outbox_counters(&pool).await, Some(outbox));
    let sinks = almanac::relay::outbox_stats(&pool).await.unwrap();
    let rabbitmq = sinks.iter().find(|s| s.sink == "rabbitmq").unwrap();
    assert_eq!((rabbitmq.backlog, rabbitmq.failed), (12, 3));
    let want = counted(&pool).await;
    assert!(want.contains_key(&("plain".into(), "dead".into())));
    assert!(want.contains_key(&("idle".into(), "cancelled".into())));
    assert_eq!(counters(&pool).await, Some(want.clone()));
    assert_eq!(fold(&pool, false).await, Fold::Folded);
    assert_eq!(counters(&pool).await, Some(want));
    let rows = count(&pool, "SELECT count(*) FROM almanac.counts").await;
    // plain and ordered done and dead, idle ready and cancelled, routed
    // ready, its outbox rows pending and failed, the marker.
    assert_eq!(
        rows, 10,
        "a fold leaves one row per scope, kind and status and the marker"
    );

    // TRUNCATE empties the counts and leaves them to the next fold, which
    // finds nothing.
    sqlx::query("TRUNCATE almanac.jobs CASCADE")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(counters(&pool).await, None);
    assert_eq!(fold(&pool, false).await, Fold::Recounted);
    assert_eq!(counters(&pool).await, Some(Counts::new()));
    assert_eq!(outbox_counters(&pool).await, Some(Vec::new()));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn lost_or_broken_counters_are_counted_around_and_rebuilt_by_the_next_fold(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    for kind in ["a", "a", "b"] {
        queue::enqueue(&mut conn, &NewJob::new(kind)).await.unwrap();
    }
    // A new database's counters are not whole until the first fold counts.
    assert_eq!(counters(&pool).await, None);
    assert_eq!(fold(&pool, false).await, Fold::Recounted);
    assert_eq!(counters(&pool).await, Some(counted(&pool).await));
    assert_eq!(fold(&pool, false).await, Fold::Folded);
    // What a crash does to an unlogged table: it is emptied.
    sqlx::query("TRUNCATE almanac.counts")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(counters(&pool).await, None);
    let stats = queue::stats(&mut conn).await.unwrap();
    let ready: i64 = stats
        .by_kind_status
        .iter()
        .filter(|c| c.status == JobStatus::Ready)
        .map(|c| c.count)
        .sum();
    assert_eq!(
        ready, 3,
        "stats counts the jobs while the counters are lost"
    );
    assert!(!stats.done_exact);
    assert_eq!(fold(&pool, false).await, Fold::Recounted);
    assert_eq!(counters(&pool).await, Some(counted(&pool).await));

    // Under `session_replication_role = replica` the triggers still count.
    sqlx::raw_sql(
        "SET session_replication_role = replica;
         INSERT INTO almanac.jobs (kind) SELECT 'r' FROM generate_series(1, 2);
         SET session_replication_role = origin;",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    assert_eq!(counters(&pool).await, Some(counted(&pool).await));

    // Jobs inserted with the count trigger disabled, then deleted: a count
    // goes negative, readers count around it, and the next fold rebuilds.
    sqlx::raw_sql(
        "ALTER TABLE almanac.jobs DISABLE TRIGGER jobs_count_insert;
         INSERT INTO almanac.jobs (kind) SELECT 'b' FROM generate_series(1, 2);
         ALTER TABLE almanac.jobs ENABLE ALWAYS TRIGGER jobs_count_insert;
         DELETE FROM almanac.jobs WHERE kind = 'b';",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    assert_eq!(counters(&pool).await, None, "b's count is negative");
    assert_eq!(fold(&pool, false).await, Fold::Recounted);
    assert_eq!(counters(&pool).await, Some(counted(&pool).await));

    // A TRUNCATE under REPEATABLE READ whose snapshot predates a job and
    // a fold: it cannot see their rows, and the counts say they are not
    // whole until the next fold counts again.
    let mut old = pool.begin().await.unwrap();
    sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .execute(&mut *old)
        .await
        .unwrap();
    queue::enqueue(&mut conn, &NewJob::new("late"))
        .await
        .unwrap();
    assert_eq!(fold(&pool, false).await, Fold::Folded);
    sqlx::query("TRUNCATE almanac.jobs CASCADE")
        .execute(&mut *old)
        .await
        .unwrap();
    old.commit().await.unwrap();
    assert_eq!(counters(&pool).await, None);
    assert_eq!(fold(&pool, false).await, Fold::Recounted);
    assert_eq!(counters(&pool).await, Some(Counts::new()));

    // A read-only session (as on a standby) folds nothing, and `stats`
    // still answers there.
    let mut read_only = pool.acquire().await.unwrap();
    sqlx::query("SET default_transaction_read_only = on")
        .execute(&mut *read_only)
        .await
        .unwrap();
    assert_eq!(
        counts::fold(&mut read_only, true).await.unwrap(),
        Fold::Skipped
    );
    queue::stats(&mut read_only).await.unwrap();
    sqlx::query("RESET default_transaction_read_only")
        .execute(&mut *read_only)
        .await
        .unwrap();
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn stats_reads_no_job_or_outbox_row_on_200k_jobs_and_150k_pending_outbox_rows(pool: PgPool) {
    fill(
        &pool,
        "INSERT INTO almanac.jobs (kind, run_at)
             SELECT 'k' || (g % 4), now() + interval '1 day' FROM generate_series(1, 150000) g;
         INSERT INTO almanac.jobs (kind, status, attempts, finished_at, last_error)
             SELECT 'k' || (g % 4), 'dead', 1, now(), 'boom' FROM generate_series(1, 50000) g;
         INSERT INTO almanac.outbox (job_id, sink, destination, msg_key, payload, headers, available_at)
             SELECT id, 'rabbitmq', 'q', 'k', '{}', jsonb_build_object('almanac-kind', kind), run_at
               FROM almanac.jobs WHERE status = 'ready';
         ANALYZE almanac.jobs;
         ANALYZE almanac.outbox;",
    )
    .await;
    let tables = ["almanac.jobs", "almanac.outbox"];
    let mut tx = pool.begin().await.unwrap();
    let before = reads(&mut tx, &tables).await;
    let snapshot = almanac::stats::Snapshot::read(&mut tx).await.unwrap();
    let stats = snapshot.jobs.clone();
    let (tuples, index_tuples) = read_since(&mut tx, &tables, before).await;
    tx.rollback().await.unwrap();
    let rabbitmq = snapshot
        .outbox
        .iter()
        .find(|s| s.sink == "rabbitmq")
        .unwrap();
    assert_eq!(rabbitmq.backlog, 150_000);
    assert_eq!(stats.dead, 50_000);
    let ready: i64 = stats
        .by_kind_status
        .iter()
        .filter(|c| c.status == JobStatus::Ready)
        .map(|c| c.count)
        .sum();
    assert_eq!(ready, 150_000);
    assert!(stats.done_exact);
    assert_eq!(tuples, 0, "no sequential read of the jobs or the outbox");
    assert!(
        index_tuples < 20,
        "stats read {index_tuples} index entries of the jobs and the outbox; counting them reads 350,000"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_dead_letter_groups_read_the_newest_10000_dead_jobs_and_count_all(pool: PgPool) {
    use almanac::queue::browse::{self, DeadFilter, DEAD_SAMPLE};
    fill(
        &pool,
        "INSERT INTO almanac.jobs (kind, status, attempts, finished_at, last_error)
             SELECT 'mail', 'dead', 1, now() - interval '2 days', 'old failure' FROM generate_series(1, 20000);
         INSERT INTO almanac.jobs (kind, status, attempts, finished_at, last_error)
             SELECT 'mail', 'dead', 1, now() - g * interval '1 ms', E'new failure\\ndetail'
               FROM generate_series(1, 15000) g;
         ANALYZE almanac.jobs;",
    )
    .await;
    let mut tx = pool.begin().await.unwrap();
    let before = reads(&mut tx, &["almanac.jobs"]).await;
    let groups = browse::dead_groups(&mut *tx, 200).await.unwrap();
    let total = browse::dead_count(&mut tx, &DeadFilter::default())
        .await
        .unwrap();
    let of_kind = browse::dead_count(
        &mut tx,
        &DeadFilter {
            kind: Some("mail".into()),
            error: None,
        },
    )
    .await
    .unwrap();
    let (tuples, index_tuples) = read_since(&mut tx, &["almanac.jobs"], before).await;
    let read = tuples + index_tuples;
    tx.rollback().await.unwrap();
    // The newest 10,000 are all of the new failure; the totals count all.
    assert_eq!(DEAD_SAMPLE, 10_000);
    assert_eq!(groups.len(), 1, "{groups:?}");
    assert_eq!(
        (groups[0].error.as_str(), groups[0].count),
        ("new failure", 10_000)
    );
    assert_eq!((total, of_kind), (35_000, 35_000));
    assert!(
        read <= 10_100,
        "the groups and counts read {read} entries and rows of the jobs \
         ({tuples} by sequential scans); all dead jobs are 35,000"
    );
}

/// `almanac stats --recount`, as an operator runs it after a load made with
/// the count triggers disabled (which no fold can notice: no count goes
/// negative), and the reaper's sweep folding what writers leave.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn stats_recount_repairs_a_load_no_fold_can_notice_and_the_reaper_folds(pool: PgPool) {
    use almanac::maintenance::reaper::{Reaper, ReaperConfig};
    use almanac::role::Periodic;
    let mut conn = pool.acquire().await.unwrap();
    queue::enqueue(&mut conn, &NewJob::new("a")).await.unwrap();
    // The reaper's sweep folds: the first fold counts, the counts are whole.
    let reaper = Reaper::new(pool.clone(), ReaperConfig::default().validated().unwrap());
    reaper.run_once(&CancellationToken::new()).await.unwrap();
    assert_eq!(counters(&pool).await, Some(counted(&pool).await));
    queue::enqueue(&mut conn, &NewJob::new("a")).await.unwrap();
    reaper.run_once(&CancellationToken::new()).await.unwrap();
    let rows = count(&pool, "SELECT count(*) FROM almanac.counts").await;
    assert_eq!(
        rows, 2,
        "one row for a's ready jobs and the marker after a sweep"
    );

    sqlx::raw_sql(
        "ALTER TABLE almanac.jobs DISABLE TRIGGER USER;
         INSERT INTO almanac.jobs (kind) SELECT 'loaded' FROM generate_series(1, 5);
         ALTER TABLE almanac.jobs ENABLE TRIGGER USER;
         ALTER TABLE almanac.jobs ENABLE ALWAYS TRIGGER jobs_count_insert, ENABLE ALWAYS TRIGGER jobs_count_update,
             ENABLE ALWAYS TRIGGER jobs_count_delete, ENABLE ALWAYS TRIGGER jobs_count_truncate;",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    assert_eq!(fold(&pool, false).await, Fold::Folded);
    assert_ne!(
        counters(&pool).await,
        Some(counted(&pool).await),
        "the load is unseen"
    );
    let out = crate::harness::operator(&pool, &["stats", "--recount"]);
    assert!(
        out.status.success(),
        "{}",
        crate::harness::text(&out.stderr)
    );
    let printed = crate::harness::text(&out.stdout);
    assert!(
        printed
            .lines()
            .any(|l| l.starts_with("loaded") && l.trim_end().ends_with(" 5")),
        "stats prints the loaded jobs after the recount:\n{printed}"
    );
    assert_eq!(counters(&pool).await, Some(counted(&pool).await));
}

/// `almanac_counts_whole` says when `/metrics`, `stats` and the dashboard
/// count rows because the counters are not whole: 0 while a crash's loss
/// cannot be rebuilt (here, another session holds the fold's lock), 1 once
/// the collector's own fold has recounted.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_collector_says_when_the_counters_are_not_whole(pool: PgPool) {
    use almanac::metrics::Metrics;
    use almanac::role::{Periodic, Valid};
    use almanac::stats::Collector;

    use crate::harness::http::sample;

    queue::enqueue(&mut pool.acquire().await.unwrap(), &NewJob::new("a"))
        .await
        .unwrap();
    let metrics = Metrics::new();
    let collector = Collector::new(pool.clone(), Valid::default()).with_metrics(metrics.clone());
    let whole = || async {
        collector.run_once(&CancellationToken::new()).await.unwrap();
        sample(&metrics.render(), "almanac_counts_whole", &[])
    };
    assert_eq!(whole().await, Some(1.0), "the collector's fold counts");
    // A crash empties the unlogged table; a fold cannot rebuild it while
    // another session holds the folds' lock.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(1634495841, 1668248942)")
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query("TRUNCATE almanac.counts")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(whole().await, Some(0.0), "counted around, and said so");
    holder.rollback().await.unwrap();
    assert_eq!(whole().await, Some(1.0), "rebuilt by the next refresh");
}
