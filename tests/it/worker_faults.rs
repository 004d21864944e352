//! The executor under faults the way production has them: a worker whose
//! database path freezes (half-open, through tests/it/harness/proxy.rs) while a
//! reaper elsewhere still reaches the database, a freeze just as handlers
//! return, and a handler that ignores cancellation across shutdowns.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use almanac::maintenance::{Reaper, ReaperConfig};
use almanac::queue::{self, Backoff, JobStatus, NewJob};
use almanac::role::{Periodic, Role, Settings, Valid};
use almanac::worker::{HandlerError, JobContext, Worker, WorkerConfig};
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::proxy::Proxy;
use crate::harness::{self, count, eventually};

fn config(lease: Duration, concurrency: usize) -> WorkerConfig {
    WorkerConfig {
        concurrency,
        batch_size: concurrency,
        lease,
        poll_interval: Duration::from_millis(50),
        shutdown_deadline: Duration::from_secs(5),
        backoff: Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(1),
            jitter: 0.2,
        },
        listen: true,
    }
}

/// A pool on the test database that goes through `proxy`.
async fn through(proxy: &Proxy, pool: &PgPool, max_connections: u32) -> PgPool {
    let url = proxy.postgres_url(&harness::database_url(pool));
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max_connections)
        .connect(&url)
        .await
        .unwrap()
}

/// Each execution with its start and end, on the database's clock.
async fn create_runs(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE runs (job_id bigint NOT NULL, worker int NOT NULL, attempt int NOT NULL,
                            started timestamptz NOT NULL DEFAULT clock_timestamp(), ended timestamptz)",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// worker, attempt, started, ended
type Run = (i32, i32, DateTime<Utc>, Option<DateTime<Utc>>);

async fn run_started(log: &PgPool, ctx: &JobContext, worker: i32) {
    sqlx::query("INSERT INTO runs (job_id, worker, attempt) VALUES ($1, $2, $3)")
        .bind(ctx.job.id)
        .bind(worker)
        .bind(ctx.job.attempts)
        .execute(log)
        .await
        .unwrap();
}

async fn run_ended(log: &PgPool, ctx: &JobContext, worker: i32) {
    sqlx::query("UPDATE runs SET ended = clock_timestamp() WHERE job_id = $1 AND worker = $2 AND attempt = $3")
        .bind(ctx.job.id)
        .bind(worker)
        .bind(ctx.job.attempts)
        .execute(log)
        .await
        .unwrap();
}

async fn enqueue(pool: &PgPool, kind: &str, n: usize, max_attempts: i32) -> Vec<i64> {
    let mut conn = pool.acquire().await.unwrap();
    let jobs: Vec<NewJob> = (0..n)
        .map(|i| {
            NewJob::new(kind)
                .idempotency_key(format!("{kind}:{i}"))
                .max_attempts(max_attempts)
        })
        .collect();
    queue::enqueue_many(&mut conn, &jobs)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id())
        .collect()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_worker_frozen_off_the_database_stops_its_handlers_before_its_leases_run_out(
    pool: PgPool,
) {
    create_runs(&pool).await;
    const JOBS: usize = 4;
    // Margin 0.8 s: room for a loaded machine between cancel and the lease end.
    let lease = Duration::from_secs(4);
    let ids = enqueue(&pool, "report", JOBS, 5).await;
    let log = harness::log_pool(&pool, 8).await;
    let proxy = Proxy::postgres().await;

    // Worker 1 reaches the database through the proxy; its handlers run
    // until they are told to stop, and record when they did.
    let frozen_stop = CancellationToken::new();
    let handler_log = log.clone();
    let frozen = Worker::new(
        through(&proxy, &pool, 6).await,
        (config(lease, JOBS)).validated().unwrap(),
    )
    .register("report", move |ctx: JobContext| {
        let log = handler_log.clone();
        async move {
            run_started(&log, &ctx, 1).await;
            ctx.cancelled().await;
            run_ended(&log, &ctx, 1).await;
            Err(HandlerError::retry("stopped: lease could not be kept"))
        }
    });
    let frozen = tokio::spawn(frozen.run(frozen_stop.clone()));
    eventually(
        "worker 1 to run every job",
        Duration::from_secs(30),
        || async {
            count(&pool, "SELECT count(*) FROM runs WHERE worker = 1").await == JOBS as i64
        },
    )
    .await;

    proxy.freeze();
    let frozen_at = Instant::now();
    // Nothing from worker 1 reaches the database any more, so no lease can
    // be renewed past what the database holds now.
    let leases: HashMap<i64, DateTime<Utc>> =
        sqlx::query_as("SELECT id, lease_until FROM almanac.jobs WHERE status = 'running'")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(leases.len(), JOBS);

    // Elsewhere, on direct connections: a reaper and a second worker.
    let stop = CancellationToken::new();
    let reaper = Reaper::new(
        pool.clone(),
        ReaperConfig {
            interval: Duration::from_millis(200),
            batch_size: 100,
        }
        .validated()
        .unwrap(),
    );
    let reaper = tokio::spawn(reaper.run(stop.clone()));
    let handler_log = log.clone();
    let survivor = Worker::new(pool.clone(), (config(lease, JOBS)).validated().unwrap()).register(
        "report",
        move |ctx: JobContext| {
            let log = handler_log.clone();
            async move {
                run_started(&log, &ctx, 2).await;
                run_ended(&log, &ctx, 2).await;
                Ok(())
            }
        },
    );
    let survivor = tokio::spawn(survivor.run(stop.clone()));
    eventually(
        "the survivor to finish every job",
        Duration::from_secs(60),
        || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
            )
            .await
                == JOBS as i64
        },
    )
    .await;
    // The partition lasts three leases in all.
    tokio::time::sleep((lease * 3).saturating_sub(frozen_at.elapsed())).await;
    proxy.thaw();
    frozen_stop.cancel();
    stop.cancel();
    let report = frozen.await.unwrap().unwrap();
    survivor.await.unwrap().unwrap();
    reaper.await.unwrap().unwrap();

    for id in ids {
        let runs: Vec<Run> = sqlx::query_as(
            "SELECT worker, attempt, started, ended FROM runs WHERE job_id = $1 ORDER BY started",
        )
        .bind(id)
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(runs.len(), 2, "job {id}: {runs:?}");
        let (first, second) = (&runs[0], &runs[1]);
        assert_eq!((first.0, first.1, second.0, second.1), (1, 1, 2, 2));
        let first_ended = first.3.expect("the frozen worker's handler was cancelled");
        assert!(
            first_ended < second.2,
            "job {id}: two executions overlapped: {runs:?}"
        );
        assert!(
            first_ended < leases[&id],
            "job {id}: cancelled at {first_ended}, after its lease ran out at {}",
            leases[&id]
        );
    }
    assert_eq!(report.lost, JOBS as u64, "{report:?}");
    assert_eq!(report.completed, 0);
}

/// How the database path fails for two seconds.
#[derive(Clone, Copy)]
enum Blip {
    /// Half-open: bytes stop, sockets stay open.
    Freeze,
    /// Connections drop and new ones are refused.
    Cut,
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_two_second_freeze_as_handlers_return_loses_no_outcome(pool: PgPool) {
    a_blip_as_handlers_return_loses_no_outcome(pool, Blip::Freeze).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_two_second_cut_as_handlers_return_loses_no_outcome(pool: PgPool) {
    a_blip_as_handlers_return_loses_no_outcome(pool, Blip::Cut).await;
}

async fn a_blip_as_handlers_return_loses_no_outcome(pool: PgPool, blip: Blip) {
    harness::create_exec_log(&pool).await;
    const JOBS: usize = 20;
    // Renewals every 3 s, local deadline 7.2 s after the last one: a 2 s
    // freeze right after any renewal leaves time to record.
    let lease = Duration::from_secs(9);
    enqueue(&pool, "task", JOBS, 5).await;
    let log = harness::log_pool(&pool, 8).await;
    let mut proxy = Proxy::postgres().await;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let handler_gate = gate.clone();
    let worker = Worker::new(
        through(&proxy, &pool, 8).await,
        (config(lease, JOBS)).validated().unwrap(),
    )
    .register("task", move |ctx: JobContext| {
        let (log, gate) = (log.clone(), handler_gate.clone());
        async move {
            harness::log_exec(&log, ctx.job.id, ctx.job.attempts, 0).await;
            gate.acquire().await.unwrap().forget();
            Ok(())
        }
    });
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually(
        "every handler to start",
        Duration::from_secs(30),
        || async { count(&pool, "SELECT count(*) FROM exec_log").await == JOBS as i64 },
    )
    .await;

    match blip {
        Blip::Freeze => proxy.freeze(),
        Blip::Cut => proxy.cut(),
    }
    gate.add_permits(JOBS);
    // The blip itself: two seconds without a byte through.
    tokio::time::sleep(Duration::from_secs(2)).await;
    match blip {
        Blip::Freeze => proxy.thaw(),
        Blip::Cut => proxy.restore().await,
    }
    eventually("every job to be done", Duration::from_secs(30), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
        )
        .await
            == JOBS as i64
    })
    .await;
    stop.cancel();
    let report = running.await.unwrap().unwrap();
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE attempts <> 1"
        )
        .await,
        0,
        "a job ran again"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM exec_log").await,
        JOBS as i64
    );
    assert_eq!(
        (report.completed, report.lost),
        (JOBS as u64, 0),
        "{report:?}"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_handler_that_ignores_cancellation_ends_dead_after_its_attempts(pool: PgPool) {
    harness::create_exec_log(&pool).await;
    let id = enqueue(&pool, "hang", 1, 2).await[0];
    let config = WorkerConfig {
        shutdown_deadline: Duration::from_millis(300),
        ..config(Duration::from_secs(10), 1)
    };
    let mut reports = Vec::new();
    for stop_number in 1..=3 {
        let log = pool.clone();
        let worker = Worker::new(pool.clone(), config.clone().validated().unwrap())
            .register("hang", move |ctx: JobContext| {
                let log = log.clone();
                async move {
                    harness::log_exec(&log, ctx.job.id, ctx.job.attempts, 0).await;
                    // Deaf to cancellation: only being dropped stops it.
                    std::future::pending::<()>().await;
                    Ok(())
                }
            })
            .register("probe", |_ctx: JobContext| async { Ok(()) });
        let stop = CancellationToken::new();
        let running = tokio::spawn(worker.run(stop.clone()));
        if stop_number < 3 {
            eventually("the handler to start", Duration::from_secs(15), || async {
                count(&pool, "SELECT count(*) FROM exec_log").await == stop_number
            })
            .await;
        } else {
            // The third worker finds nothing to run. It has looked once a
            // job due after the dead one has run: claims take jobs in due
            // order, and its one slot would have gone to a claimable `hang`
            // job first and never come back (the handler never returns).
            let probe = enqueue(&pool, "probe", 1, 1).await[0];
            eventually("the probe job to run", Duration::from_secs(15), || async {
                queue::get(&pool, probe).await.unwrap().status == JobStatus::Done
            })
            .await;
        }
        stop.cancel();
        let report = tokio::time::timeout(Duration::from_secs(15), running)
            .await
            .expect("shutdown is bounded by its deadline")
            .unwrap()
            .unwrap();
        reports.push((report.released, report.dead));
    }
    assert_eq!(reports, vec![(1, 0), (0, 1), (0, 0)]);
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!((job.status, job.attempts), (JobStatus::Dead, 2));
    assert!(job.finished_at.is_some());
    let error = job.last_error.unwrap();
    assert!(
        error.contains("did not finish within the shutdown deadline")
            && error.contains("attempt 2 of 2, so the job is dead"),
        "{error}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM exec_log").await, 2);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_dropped_worker_renews_no_lease(pool: PgPool) {
    let id = enqueue(&pool, "long", 1, 5).await[0];
    let worker = Worker::new(
        pool.clone(),
        (config(Duration::from_millis(900), 1)).validated().unwrap(),
    )
    .register("long", |_ctx: JobContext| async move {
        std::future::pending::<()>().await;
        Ok(())
    });
    // An embedding application gives up on the worker's future.
    let running = tokio::spawn(worker.run(CancellationToken::new()));
    eventually("the job to start", Duration::from_secs(15), || async {
        queue::get(&pool, id).await.unwrap().status == JobStatus::Running
    })
    .await;
    running.abort();
    assert!(running.await.unwrap_err().is_cancelled());
    // Nothing renews the lease any more: it runs out and the reaper takes it.
    let reaper = Reaper::new(pool.clone(), Valid::default());
    eventually(
        "the lease to expire and be reaped",
        Duration::from_secs(15),
        || async {
            reaper
                .run_once(&CancellationToken::new())
                .await
                .unwrap()
                .requeued
                == 1
        },
    )
    .await;
    assert_eq!(
        queue::get(&pool, id).await.unwrap().status,
        JobStatus::Ready
    );
}

/// An error text PostgreSQL cannot store (a NUL byte, as a command may write
/// to stderr) still ends its job: the outcome is written with the byte
/// replaced, the slot is freed, and the worker goes on with the next job.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn an_error_with_a_nul_byte_is_recorded_and_frees_its_slot(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let bad = queue::enqueue(&mut conn, &NewJob::new("nul"))
        .await
        .unwrap()
        .id();
    let good = queue::enqueue(&mut conn, &NewJob::new("ok"))
        .await
        .unwrap()
        .id();
    let worker = Worker::new(
        pool.clone(),
        (config(Duration::from_secs(5), 1)).validated().unwrap(),
    )
    .register("nul", |_ctx: JobContext| async {
        Err(HandlerError::permanent("bad\0byte"))
    })
    .register("ok", |_ctx: JobContext| async { Ok(()) });
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually("both jobs to finish", Duration::from_secs(30), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status IN ('done', 'dead')",
        )
        .await
            == 2
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    let job = queue::get(&pool, bad).await.unwrap();
    assert_eq!(job.status, JobStatus::Dead);
    assert!(job.last_error.unwrap().contains("bad\u{FFFD}byte"));
    assert_eq!(
        queue::get(&pool, good).await.unwrap().status,
        JobStatus::Done
    );
}
