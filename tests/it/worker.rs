//! The worker runtime against a real PostgreSQL: exactly-once under
//! concurrency, crash recovery through the reaper, retries, shutdown.

use std::sync::Arc;
use std::time::Duration;

use almanac::maintenance::Reaper;
use almanac::queue::{self, Backoff, JobStatus, NewJob};
use almanac::role::{Periodic, Role, Settings, Valid};
use almanac::worker::{HandlerError, JobContext, Worker, WorkerConfig};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::{self, count, eventually, log_exec};

fn fast(concurrency: usize) -> WorkerConfig {
    WorkerConfig {
        concurrency,
        batch_size: concurrency,
        lease: Duration::from_secs(10),
        poll_interval: Duration::from_millis(50),
        shutdown_deadline: Duration::from_secs(5),
        backoff: Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(2),
            jitter: 0.25,
        },
        listen: true,
    }
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn eight_workers_burn_down_20000_jobs_each_exactly_once(pool: PgPool) {
    harness::create_exec_log(&pool).await;
    const JOBS: usize = 20_000;
    let mut conn = pool.acquire().await.unwrap();
    for chunk in 0..(JOBS / 5000) {
        let batch: Vec<NewJob> = (0..5000)
            .map(|i| NewJob::new("burn").idempotency_key(format!("burn:{}", chunk * 5000 + i)))
            .collect();
        queue::enqueue_many(&mut conn, &batch).await.unwrap();
    }
    drop(conn);

    let shared = harness::another_pool(&pool, 12).await;
    let stop = CancellationToken::new();
    let mut workers = Vec::new();
    for w in 0..8 {
        let worker = Worker::new(shared.clone(), fast(8).validated().unwrap())
            .register("burn", harness::logging_handler(shared.clone(), w));
        workers.push(tokio::spawn(worker.run(stop.clone())));
    }
    eventually("every job to be done", Duration::from_secs(240), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
        )
        .await
            == JOBS as i64
    })
    .await;
    stop.cancel();
    let mut completed = 0;
    for w in workers {
        let report = w.await.unwrap().unwrap();
        assert_eq!(
            (report.lost, report.retried, report.dead, report.released),
            (0, 0, 0, 0)
        );
        completed += report.completed;
    }
    assert_eq!(completed, JOBS as u64);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM exec_log").await,
        JOBS as i64
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT job_id) FROM exec_log").await,
        JOBS as i64,
        "a job ran twice"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status <> 'done' OR attempts <> 1"
        )
        .await,
        0
    );
    let busy = count(&pool, "SELECT count(DISTINCT worker) FROM exec_log").await;
    assert!(busy >= 2, "the work should spread over workers, got {busy}");
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_job_whose_worker_died_mid_run_is_reaped_and_finished_by_another(pool: PgPool) {
    harness::create_exec_log(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("report"))
        .await
        .unwrap()
        .id();

    // Worker 1 runs in a runtime of its own, which we drop mid-job: no
    // completion, no release, no more heartbeats, as when a process dies.
    let options = (*pool.connect_options()).clone();
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (die_tx, die_rx) = std::sync::mpsc::channel::<()>();
    let doomed = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.spawn(async move {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(3)
                .connect_with(options)
                .await
                .unwrap();
            let config = WorkerConfig {
                lease: Duration::from_millis(600),
                ..fast(1)
            };
            let worker = Worker::new(pool, config.validated().unwrap()).register(
                "report",
                move |ctx: JobContext| {
                    let started = started_tx.clone();
                    async move {
                        started.send(ctx.job.attempts).unwrap();
                        std::future::pending::<()>().await;
                        Ok(())
                    }
                },
            );
            let _ = worker.run(CancellationToken::new()).await;
        });
        die_rx.recv().unwrap();
        rt.shutdown_background();
    });
    assert_eq!(started_rx.recv_timeout(Duration::from_secs(30)).unwrap(), 1);
    die_tx.send(()).unwrap();
    doomed.join().unwrap();
    assert_eq!(
        queue::get(&pool, id).await.unwrap().status,
        JobStatus::Running
    );

    let reaper = Reaper::new(pool.clone(), Valid::default());
    eventually(
        "the reaper to take the job back",
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

    let stop = CancellationToken::new();
    let survivor = tokio::spawn(
        Worker::new(pool.clone(), fast(2).validated().unwrap())
            .register("report", harness::logging_handler(pool.clone(), 2))
            .run(stop.clone()),
    );
    eventually(
        "the survivor to finish the job",
        Duration::from_secs(15),
        || async { queue::get(&pool, id).await.unwrap().status == JobStatus::Done },
    )
    .await;
    stop.cancel();
    survivor.await.unwrap().unwrap();
    let runs: Vec<(i32, i32)> =
        sqlx::query_as("SELECT attempt, worker FROM exec_log WHERE job_id = $1")
            .bind(id)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        runs,
        vec![(2, 2)],
        "finished once, by the survivor, on the second attempt"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_failing_handler_retries_with_growing_delays_then_dies_with_last_error(pool: PgPool) {
    harness::create_exec_log(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("flaky").max_attempts(4))
        .await
        .unwrap()
        .id();
    let config = WorkerConfig {
        poll_interval: Duration::from_millis(10),
        ..fast(1)
    };
    let backoff = config.backoff;
    let log_pool = pool.clone();
    let worker = Worker::new(pool.clone(), config.validated().unwrap()).register(
        "flaky",
        move |ctx: JobContext| {
            let pool = log_pool.clone();
            async move {
                log_exec(&pool, ctx.job.id, ctx.job.attempts, 0).await;
                Err(HandlerError::retry(format!(
                    "upstream said 503 (attempt {})",
                    ctx.job.attempts
                )))
            }
        },
    );
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually("the job to die", Duration::from_secs(30), || async {
        queue::get(&pool, id).await.unwrap().status == JobStatus::Dead
    })
    .await;
    stop.cancel();
    let report = running.await.unwrap().unwrap();
    assert_eq!((report.retried, report.dead), (3, 1));

    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!(job.attempts, 4);
    assert_eq!(
        job.last_error.as_deref(),
        Some("upstream said 503 (attempt 4)")
    );
    let gaps: Vec<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM at - lag(at) OVER (ORDER BY attempt))::float8 FROM exec_log ORDER BY attempt OFFSET 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(gaps.len(), 3);
    for (i, gap) in gaps.iter().enumerate() {
        // Never sooner than the shortest jittered delay for that attempt,
        // and that floor doubles each time.
        let floor = backoff.delay_with(i as i32 + 1, 1.0).as_secs_f64();
        assert!(
            *gap >= floor,
            "retry {} came after {gap:.3}s, before its backoff {floor:.3}s",
            i + 1
        );
    }
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_panicking_handler_counts_as_a_retryable_failure(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("boom").max_attempts(1))
        .await
        .unwrap()
        .id();
    let worker = Worker::new(pool.clone(), fast(1).validated().unwrap()).register(
        "boom",
        |_ctx: JobContext| async move {
            if true {
                panic!("index out of range");
            }
            Ok(())
        },
    );
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually("the job to die", Duration::from_secs(15), || async {
        queue::get(&pool, id).await.unwrap().status == JobStatus::Dead
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!(
        job.last_error.as_deref(),
        Some("handler panicked: index out of range")
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn shutdown_lets_handlers_finish_in_time_and_releases_the_rest(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let quick = queue::enqueue(&mut conn, &NewJob::new("quick"))
        .await
        .unwrap()
        .id();
    let stuck = queue::enqueue(&mut conn, &NewJob::new("stuck"))
        .await
        .unwrap()
        .id();
    let started = Arc::new(tokio::sync::Semaphore::new(0));
    let (s1, s2) = (started.clone(), started.clone());
    let finish_quick = Arc::new(tokio::sync::Notify::new());
    let release_quick = finish_quick.clone();
    let config = WorkerConfig {
        shutdown_deadline: Duration::from_millis(800),
        ..fast(4)
    };
    let worker = Worker::new(pool.clone(), config.validated().unwrap())
        .register("quick", move |_ctx: JobContext| {
            let (started, finish) = (s1.clone(), release_quick.clone());
            async move {
                started.add_permits(1);
                finish.notified().await;
                Ok(())
            }
        })
        .register("stuck", move |_ctx: JobContext| {
            let started = s2.clone();
            async move {
                started.add_permits(1);
                // Ignores cancellation entirely: only the abort stops it.
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    let _both = tokio::time::timeout(Duration::from_secs(15), started.acquire_many(2))
        .await
        .unwrap()
        .unwrap();
    stop.cancel();
    // The quick handler finishes inside the deadline, after shutdown began.
    finish_quick.notify_one();
    let report = tokio::time::timeout(Duration::from_secs(15), running)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((report.completed, report.released), (1, 1));
    assert_eq!(
        queue::get(&pool, quick).await.unwrap().status,
        JobStatus::Done
    );
    let released = queue::get(&pool, stuck).await.unwrap();
    assert_eq!(
        (released.status, released.lease_token),
        (JobStatus::Ready, None)
    );
    assert!(released
        .last_error
        .unwrap()
        .contains("released at shutdown"));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_handler_is_told_when_its_lease_is_lost(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("long"))
        .await
        .unwrap()
        .id();
    let (told_tx, told_rx) = tokio::sync::oneshot::channel();
    let told = Arc::new(std::sync::Mutex::new(Some(told_tx)));
    let config = WorkerConfig {
        lease: Duration::from_millis(600),
        ..fast(1)
    };
    let worker = Worker::new(pool.clone(), config.validated().unwrap()).register(
        "long",
        move |ctx: JobContext| {
            let told = told.clone();
            async move {
                ctx.cancelled().await;
                if let Some(tx) = told.lock().unwrap().take() {
                    let _ = tx.send(());
                }
                Err(HandlerError::retry("stopped: lease lost"))
            }
        },
    );
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually("the job to start", Duration::from_secs(15), || async {
        queue::get(&pool, id).await.unwrap().status == JobStatus::Running
    })
    .await;
    // Another claimant takes the lease over (as after a reap and re-claim).
    sqlx::query("UPDATE almanac.jobs SET lease_token = gen_random_uuid() WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), told_rx)
        .await
        .expect("handler was not told")
        .unwrap();
    stop.cancel();
    let report = running.await.unwrap().unwrap();
    assert_eq!(report.lost, 1);
    // The stale worker's failure did not overwrite the new holder's row.
    assert_eq!(
        queue::get(&pool, id).await.unwrap().status,
        JobStatus::Running
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_worker_claims_no_more_jobs_than_it_has_free_slots(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let batch: Vec<NewJob> = (0..20)
        .map(|i| NewJob::new("slow").idempotency_key(format!("slow:{i}")))
        .collect();
    queue::enqueue_many(&mut conn, &batch).await.unwrap();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let started = Arc::new(tokio::sync::Semaphore::new(0));
    let (g, s) = (gate.clone(), started.clone());
    // Three slots, but claims of up to ten: a worker that claimed by batch
    // size alone would hold ten leases for three handlers.
    let config = WorkerConfig {
        concurrency: 3,
        batch_size: 10,
        ..fast(3)
    };
    let worker = Worker::new(pool.clone(), config.validated().unwrap()).register(
        "slow",
        move |_ctx: JobContext| {
            let (gate, started) = (g.clone(), s.clone());
            async move {
                started.add_permits(1);
                gate.acquire().await.unwrap().forget();
                Ok(())
            }
        },
    );
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    let _three = tokio::time::timeout(Duration::from_secs(15), started.acquire_many(3))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'running'"
        )
        .await,
        3
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'ready'"
        )
        .await,
        17
    );
    gate.add_permits(20);
    eventually("all twenty done", Duration::from_secs(30), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
        )
        .await
            == 20
    })
    .await;
    stop.cancel();
    assert_eq!(running.await.unwrap().unwrap().completed, 20);
}

/// A claim stuck behind a table lock (a migration, `VACUUM FULL`) is given
/// up by the worker after a third of the lease, and the server ends it too:
/// it must not commit leases later that nobody holds, and abandoned
/// connections must not pile up while the lock lasts.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_claim_stuck_behind_a_lock_is_rolled_back_not_left_to_commit(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let batch: Vec<NewJob> = (0..50)
        .map(|i| NewJob::new("locked").idempotency_key(format!("locked:{i}")))
        .collect();
    queue::enqueue_many(&mut conn, &batch).await.unwrap();
    drop(conn);
    let mut locker = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE almanac.jobs IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();

    let config = WorkerConfig {
        lease: Duration::from_millis(1500),
        ..fast(10)
    };
    let worker = Worker::new(pool.clone(), config.validated().unwrap())
        .register("locked", |_ctx: JobContext| async move { Ok(()) });
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));

    // The worker gives up on claims and reconnects: wait until four of its
    // connections have queued behind the lock, one after another.
    let waiting = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
                   AND wait_event_type = 'Lock' AND query LIKE '%SKIP LOCKED%'";
    let sampled = std::sync::Mutex::new((std::collections::HashSet::new(), 0));
    eventually(
        "the worker to retry its claim, four times",
        Duration::from_secs(30),
        || async {
            let pids: Vec<i32> = sqlx::query_scalar(waiting).fetch_all(&pool).await.unwrap();
            let (seen, most_at_once) = &mut *sampled.lock().unwrap();
            *most_at_once = pids.len().max(*most_at_once);
            seen.extend(pids);
            seen.len() >= 4
        },
    )
    .await;
    let (_, most_at_once) = sampled.into_inner().unwrap();
    assert!(
        most_at_once <= 2,
        "abandoned claims piled up on the server: {most_at_once} waiting at once"
    );
    locker.commit().await.unwrap();

    // No abandoned claim committed leases nobody holds: every job runs,
    // on its first attempt, with no reaper needed.
    eventually("all fifty done", Duration::from_secs(30), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
        )
        .await
            == 50
    })
    .await;
    assert_eq!(
        count(&pool, "SELECT max(attempts)::bigint FROM almanac.jobs").await,
        1
    );
    stop.cancel();
    running.await.unwrap().unwrap();
}

/// A worker started on an empty table keeps planning its statements for
/// the table as it is: after the table grows by 300,000 rows (no ANALYZE,
/// autovacuum off, so the statistics still say empty), the claims and
/// completions of 2,000 more jobs read their own rows, neither by
/// sequential scans nor by a walk of a whole index. A generic plan made on the empty table (the connection's cached
/// plan after five runs of a statement) completed each batch with a
/// sequential scan of the whole table: under sustained inserts the worker
/// fell from 5,000 to 180 jobs a second (issue #26, `bench
/// --retention-only`).
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_worker_started_on_an_empty_table_does_not_scan_it_once_it_grew(pool: PgPool) {
    // Before the worker exists: an ALTER TABLE later would replan it.
    for sql in [
        "ALTER TABLE almanac.jobs SET (autovacuum_enabled = false)",
        "ANALYZE almanac.jobs",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let stop = CancellationToken::new();
    // Counted here, not by asking the table: a count of almanac.jobs would
    // be a sequential scan itself.
    let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = ran.clone();
    let worker = Worker::new(pool.clone(), fast(8).validated().unwrap()).register(
        "grow",
        move |_ctx: JobContext| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Ok(()) }
        },
    );
    let done = |n: usize| {
        let ran = ran.clone();
        move || {
            let ran = ran.clone();
            async move { ran.load(std::sync::atomic::Ordering::SeqCst) >= n }
        }
    };
    let running = tokio::spawn(worker.run(stop.clone()));
    let mut conn = pool.acquire().await.unwrap();
    // Ten rounds, one at a time: the claim and the completion run ten
    // times each on the small table, past the five after which a cached
    // statement may take a generic plan.
    for round in 0..10 {
        let jobs: Vec<NewJob> = (0..4)
            .map(|i| NewJob::new("grow").idempotency_key(format!("small:{round}:{i}")))
            .collect();
        queue::enqueue_many(&mut conn, &jobs).await.unwrap();
        eventually(
            "the round done",
            Duration::from_secs(30),
            done(4 * (round + 1)),
        )
        .await;
    }
    sqlx::query(
        "INSERT INTO almanac.jobs (kind, status, finished_at)
         SELECT 'old', 'done', now() FROM generate_series(1, 300000)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let stats = || async {
        sqlx::query_as::<_, (i64, i64, i64)>(
            "SELECT seq_scan, n_tup_upd, coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables \
             WHERE relid = 'almanac.jobs'::regclass",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    // Statistics reach the view when each backend flushes them: wait for
    // the updates so far to show, then count from there.
    eventually(
        "the small rounds' updates in the statistics",
        Duration::from_secs(60),
        || async { stats().await.1 >= 80 },
    )
    .await;
    let (scans_before, updates_before, fetched_before) = stats().await;
    for chunk in 0..10 {
        let jobs: Vec<NewJob> = (0..200)
            .map(|i| NewJob::new("grow").idempotency_key(format!("big:{chunk}:{i}")))
            .collect();
        queue::enqueue_many(&mut conn, &jobs).await.unwrap();
    }
    eventually("2,000 more jobs run", Duration::from_secs(120), done(2040)).await;
    // Each job's claim and completion: 4,000 updates.
    eventually(
        "their updates in the statistics",
        Duration::from_secs(60),
        || async { stats().await.1 >= updates_before + 4000 },
    )
    .await;
    let (scans_after, _, fetched_after) = stats().await;
    stop.cancel();
    running.await.unwrap().unwrap();
    // Nor through an index: one walk of the whole table would fetch its
    // 300,000 rows; the jobs' own claims, completions and heartbeats fetch
    // a few rows each.
    assert!(
        fetched_after - fetched_before < 100_000,
        "{} rows of almanac.jobs fetched through indexes while 2,000 jobs ran on it",
        fetched_after - fetched_before
    );
    assert!(
        scans_after - scans_before <= 2,
        "{} sequential scans of almanac.jobs while 2,000 jobs ran on it",
        scans_after - scans_before
    );
}
