//! Operations: the README's first command serves, /healthz and /readyz tell
//! the truth about the database, /metrics moves with real work, the janitor
//! deletes exactly what retention says (in batches) and leaves the ledger
//! whole, and bad operations settings fail the start with the flag named.

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use almanac::http::HttpServer;
use almanac::maintenance::{Janitor, JanitorConfig, Reaper};
use almanac::metrics::Metrics;
use almanac::queue::{self, JobStatus, NewJob};
use almanac::role::{Periodic, Role, Settings, Valid};
use almanac::stats::Collector;
use almanac::worker::{HandlerError, JobContext, Worker, WorkerConfig};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::http::{get, get_with, sample};
use crate::harness::proxy::Proxy;
use crate::harness::{self, almanac, count, eventually};

fn output(mut cmd: Command) -> Output {
    cmd.stdin(Stdio::null()).output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_string()
}

fn sigterm(child: &Child) {
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
}

/// Kills the child if the test ends early (a failed assertion), so no
/// `almanac run` outlives its test and holds port 9797 or the database.
struct KillOnDrop(Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `cargo run --release -- run`, as the README's first line runs it: from the
/// repository root, no flags, no config file, no sink. It must serve (health,
/// readiness, metrics on 127.0.0.1:9797) and still be serving seconds later,
/// then stop cleanly on SIGTERM.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_readme_first_command_serves_until_sigterm(pool: PgPool) {
    let url = harness::database_url(&pool);
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    assert!(
        readme.contains("scripts/services.sh && cargo run --release -- run"),
        "the README's first command is the one this test runs"
    );
    let mut cmd = almanac();
    // The only test that takes the default port: no ALMANAC_* variable at all.
    cmd.env_remove("ALMANAC_HTTP_ADDR")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg("run")
        .env("DATABASE_URL", &url)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let child = std::sync::Mutex::new(KillOnDrop(Some(cmd.spawn().unwrap())));
    let exited = || {
        child
            .lock()
            .unwrap()
            .0
            .as_mut()
            .unwrap()
            .try_wait()
            .unwrap()
    };
    let addr = "127.0.0.1:9797";
    eventually(
        "almanac run to answer /healthz on 127.0.0.1:9797",
        Duration::from_secs(60),
        || async {
            if let Some(status) = exited() {
                panic!("almanac run exited with {status} before serving (is port 9797 taken?)");
            }
            matches!(get(addr, "/healthz").await, Ok(r) if r.status == 200)
        },
    )
    .await;
    eventually("the scheduler to lead", Duration::from_secs(30), || async {
        count(
            &pool,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .await
            == 1
    })
    .await;
    let ready = get(addr, "/readyz").await.unwrap();
    assert_eq!((ready.status, ready.body.trim()), (200, "ready"));
    // Still serving a few seconds later: no role ended or failed.
    let since = std::time::Instant::now();
    eventually("3 s of serving", Duration::from_secs(30), || async {
        assert!(exited().is_none(), "almanac run exited while serving");
        since.elapsed() > Duration::from_secs(3)
    })
    .await;
    // The collector reports the example schedules once they are synced.
    eventually(
        "schedule gauges for the example schedules",
        Duration::from_secs(30),
        || async {
            let body = get(addr, "/metrics")
                .await
                .map(|r| r.body)
                .unwrap_or_default();
            sample(
                &body,
                "almanac_schedule_lag_seconds",
                &[("schedule", "nightly-report")],
            )
            .is_some_and(|lag| lag < 120.0)
        },
    )
    .await;
    let metrics = get(addr, "/metrics").await.unwrap();
    assert_eq!(metrics.status, 200);
    assert_eq!(
        sample(&metrics.body, "almanac_scheduler_leader", &[]),
        Some(1.0),
        "{}",
        metrics.body
    );
    assert!(metrics.body.contains("# TYPE almanac_jobs gauge"));
    let child = child.into_inner().unwrap().0.take().unwrap();
    sigterm(&child);
    let status = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        status.status.success(),
        "exit {:?}: {}",
        status.status,
        text(&status.stderr)
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn readyz_is_503_while_the_database_is_unreachable_and_200_when_it_is_back(pool: PgPool) {
    let mut proxy = Proxy::postgres().await;
    let options = (*pool.connect_options()).clone().port(proxy.port);
    let server = HttpServer::bind("127.0.0.1:0".parse().unwrap(), None, &options)
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    let stop = CancellationToken::new();
    let serving = tokio::spawn(server.run(stop.clone()));

    let ready = get(&addr, "/readyz").await.unwrap();
    assert_eq!((ready.status, ready.body.trim()), (200, "ready"));

    proxy.cut();
    proxy.closed().await;
    let reply = get(&addr, "/readyz").await.unwrap();
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert!(
        reply.body.starts_with("the database does not answer"),
        "{}",
        reply.body
    );
    assert_eq!(
        reply.body.trim().lines().count(),
        1,
        "one line: {}",
        reply.body
    );
    let health = get(&addr, "/healthz").await.unwrap();
    assert_eq!(
        health.status, 200,
        "liveness does not depend on the database"
    );

    proxy.restore().await;
    eventually(
        "/readyz to be 200 again",
        Duration::from_secs(20),
        || async {
            get(&addr, "/readyz")
                .await
                .map(|r| r.status == 200)
                .unwrap_or(false)
        },
    )
    .await;

    // Frozen (half-open): the probe gives up within its deadline.
    proxy.freeze();
    let frozen = get(&addr, "/readyz").await.unwrap();
    assert_eq!(frozen.status, 503, "{}", frozen.body);
    proxy.thaw();

    stop.cancel();
    serving.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn metrics_require_basic_auth_when_configured_but_probes_stay_open(pool: PgPool) {
    let auth = "ops:s3cret".parse().unwrap();
    let server = HttpServer::bind(
        "127.0.0.1:0".parse().unwrap(),
        Some(auth),
        &pool.connect_options(),
    )
    .await
    .unwrap();
    let addr = server.local_addr().to_string();
    let stop = CancellationToken::new();
    let serving = tokio::spawn(server.run(stop.clone()));
    assert_eq!(get(&addr, "/metrics").await.unwrap().status, 401);
    assert_eq!(get(&addr, "/healthz").await.unwrap().status, 200);
    // ops:s3cret
    let ok = get_with(&addr, "/metrics", Some("Basic b3BzOnMzY3JldA=="))
        .await
        .unwrap();
    assert_eq!(ok.status, 200);
    stop.cancel();
    serving.await.unwrap().unwrap();
}

/// Real work moves the metric families: completions, retries, deaths,
/// reaper recoveries and the database gauges the collector sets.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn metric_families_move_after_real_work(pool: PgPool) {
    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let ok = format!("ok_{tag}");
    let flaky = format!("flaky_{tag}");
    let doomed = format!("doomed_{tag}");
    let stuck = format!("stuck_{tag}");
    let mut conn = pool.acquire().await.unwrap();
    for _ in 0..3 {
        queue::enqueue(&mut conn, &NewJob::new(ok.as_str()))
            .await
            .unwrap();
    }
    queue::enqueue(&mut conn, &NewJob::new(flaky.as_str()).max_attempts(2))
        .await
        .unwrap();
    queue::enqueue(&mut conn, &NewJob::new(doomed.as_str()))
        .await
        .unwrap();
    let stuck_id = queue::enqueue(&mut conn, &NewJob::new(stuck.as_str()).max_attempts(3))
        .await
        .unwrap()
        .id();
    // A lease that expires: claimed by a "worker" that then vanishes.
    let kinds = [stuck.clone()];
    let claimed = queue::claim(
        &pool,
        &queue::Claim {
            kinds: &kinds,
            limit: 1,
            lease: Duration::from_millis(200),
        },
    )
    .await
    .unwrap();
    assert_eq!(claimed.len(), 1);

    let config = WorkerConfig {
        poll_interval: Duration::from_millis(50),
        ..WorkerConfig::default()
    };
    // The registry this test hands its roles: it counts their work alone.
    let metrics = Metrics::new();
    let worker = Worker::new(pool.clone(), config.validated().unwrap())
        .with_metrics(metrics.clone())
        .register(ok.clone(), |_ctx: JobContext| async { Ok(()) })
        .register(flaky.clone(), |_ctx: JobContext| async {
            Err(HandlerError::retry_after("not yet", Duration::ZERO))
        })
        .register(doomed.clone(), |_ctx: JobContext| async {
            Err(HandlerError::permanent("never"))
        });
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually("ok, flaky and doomed jobs to finish", Duration::from_secs(30), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status IN ('done', 'dead') AND kind NOT LIKE 'stuck%'",
        )
        .await
            == 5
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();

    let reaper = Reaper::new(pool.clone(), Valid::default()).with_metrics(metrics.clone());
    eventually(
        "the stuck lease to be reaped",
        Duration::from_secs(20),
        || async {
            reaper.run_once(&CancellationToken::new()).await.unwrap();
            queue::get(&pool, stuck_id).await.unwrap().status == JobStatus::Ready
        },
    )
    .await;

    Collector::new(pool.clone(), Valid::default())
        .with_metrics(metrics.clone())
        .run_once(&CancellationToken::new())
        .await
        .unwrap();
    let text = metrics.render();
    let value = |name: &str, labels: &[(&str, &str)]| sample(&text, name, labels).unwrap_or(0.0);
    assert_eq!(
        value("almanac_jobs_completed_total", &[("kind", &ok)]),
        3.0,
        "{text}"
    );
    assert_eq!(
        value("almanac_jobs_retried_total", &[("kind", &flaky)]),
        1.0
    );
    assert_eq!(value("almanac_jobs_dead_total", &[("kind", &flaky)]), 1.0);
    assert_eq!(value("almanac_jobs_dead_total", &[("kind", &doomed)]), 1.0);
    assert_eq!(value("almanac_reaper_recovered_total", &[]), 1.0);
    assert_eq!(
        value("almanac_job_duration_seconds_count", &[("kind", &ok)]),
        3.0
    );
    assert_eq!(
        value("almanac_job_wait_seconds_count", &[("kind", &ok)]),
        3.0
    );
    // From the database, through the collector.
    assert_eq!(
        value("almanac_jobs", &[("kind", &doomed), ("status", "dead")]),
        1.0
    );
    assert_eq!(
        value("almanac_jobs", &[("kind", &flaky), ("status", "dead")]),
        1.0
    );
    assert_eq!(
        value("almanac_jobs", &[("kind", &stuck), ("status", "ready")]),
        1.0
    );
    assert_eq!(
        value("almanac_jobs", &[("kind", &ok), ("status", "ready")]),
        0.0
    );
    assert!(value("almanac_oldest_ready_age_seconds", &[("kind", &stuck)]) > 0.0);
    assert_eq!(value("almanac_expired_leases", &[]), 0.0);
}

async fn finished_job(pool: &PgPool, kind: &str, status: &str, days_ago: i64) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO almanac.jobs (kind, status, attempts, finished_at, run_at)
         VALUES ($1, $2, 1, now() - make_interval(days => $3::int), now() - make_interval(days => $3::int))
         RETURNING id",
    )
    .bind(kind)
    .bind(status)
    .bind(days_ago as i32)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Retention deletes exactly what is past it, in batches, and never a ledger
/// row: the logical run of a deleted job stays recorded.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_janitor_deletes_exactly_what_retention_says_in_batches(pool: PgPool) {
    let mut old_done = Vec::new();
    for _ in 0..5 {
        old_done.push(finished_job(&pool, "report", "done", 8).await);
    }
    let recent_done = finished_job(&pool, "report", "done", 6).await;
    let old_dead = finished_job(&pool, "report", "dead", 31).await;
    let recent_dead = finished_job(&pool, "report", "dead", 29).await;
    // Cancelled jobs are kept as long as dead ones.
    let old_cancelled = finished_job(&pool, "report", "cancelled", 31).await;
    let recent_cancelled = finished_job(&pool, "report", "cancelled", 29).await;
    let ready = queue::enqueue(&mut pool.acquire().await.unwrap(), &NewJob::new("report"))
        .await
        .unwrap()
        .id();
    // A ledger row pointing at an old done job.
    sqlx::query(
        "INSERT INTO almanac.schedules (name, cron, timezone, kind, payload, catchup, catchup_window,
                                        overlap, max_attempts, enabled, definition_hash)
         VALUES ('nightly', '0 2 * * *', 'UTC', 'report', '{}', 'all', '7 days', 'allow', 5, true, 'h')",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO almanac.schedule_runs (schedule, logical_run, fire_at, job_id, source, outcome)
         VALUES ('nightly', '2026-01-01', now() - interval '8 days', $1, 'tick', 'emitted')",
    )
    .bind(old_done[0])
    .execute(&pool)
    .await
    .unwrap();
    // Outbox rows: published long ago, recently, and never.
    sqlx::query("INSERT INTO almanac.routes (kind, mode, sink, destination) VALUES ('report', 'dual', 'rabbitmq', 'q')")
        .execute(&pool)
        .await
        .unwrap();
    for (age, published) in [
        ("2 days", true),
        ("2 days", true),
        ("1 hour", true),
        ("3 days", false),
    ] {
        sqlx::query(&format!(
            "INSERT INTO almanac.outbox (job_id, sink, destination, msg_key, payload, headers, available_at, published_at)
             VALUES ($1, 'rabbitmq', 'q', 'k', '{{}}', '{{}}', now(), {})",
            if published { format!("now() - interval '{age}'") } else { "NULL".to_string() }
        ))
        .bind(recent_done)
        .execute(&pool)
        .await
        .unwrap();
    }

    // Records of published batches: one from two days ago (three rows),
    // one from an hour ago.
    sqlx::query(
        "INSERT INTO almanac.outbox_batches (token, sink, ids, job_ids, job_span, lease_until, published_at)
         VALUES (gen_random_uuid(), 'rabbitmq', '{1,2,3}', '{1,2,3}', '[1,3]', now(), now() - interval '2 days'),
                (gen_random_uuid(), 'rabbitmq', '{4}', '{4}', '[4,4]', now(), now() - interval '1 hour')",
    )
    .execute(&pool)
    .await
    .unwrap();

    let janitor = Janitor::new(
        pool.clone(),
        JanitorConfig {
            batch_size: 2,
            pause: Duration::from_millis(1),
            ..JanitorConfig::default()
        }
        .validated()
        .unwrap(),
    );
    let report = janitor.run_once(&CancellationToken::new()).await.unwrap();
    assert_eq!(
        (report.done, report.dead, report.cancelled, report.outbox),
        (5, 1, 1, 5)
    );
    // done: 2 + 2 + 1 (short) = 3 batches; dead: 1 (short); cancelled: 1
    // (short); outbox: 3 rows of a published batch and 2 published rows,
    // then 0 = 2.
    assert_eq!(report.batches, 7);

    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM almanac.jobs ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    let mut expected = vec![recent_done, old_dead, recent_dead, recent_cancelled, ready];
    expected.retain(|id| *id != old_dead && *id != old_cancelled);
    expected.sort();
    assert_eq!(left, expected);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.outbox WHERE published_at IS NULL"
        )
        .await,
        1,
        "unpublished rows are never deleted"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.outbox").await, 2);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.outbox_batches").await,
        1,
        "the batch published an hour ago stays"
    );
    let (runs, job): (i64, Option<i64>) =
        sqlx::query_as("SELECT count(*), max(job_id) FROM almanac.schedule_runs")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (runs, job),
        (1, None),
        "the ledger row stays, without its job"
    );

    // A second pass finds nothing.
    let again = janitor.run_once(&CancellationToken::new()).await.unwrap();
    assert_eq!((again.done, again.dead, again.outbox), (0, 0, 0));
}

/// A janitor that is behind does not pause: 5,000 done jobs that came due
/// hours ago go in one pass of full batches with no pause between them,
/// though the pause is an hour (issue #26 item 2: a queue finishing more
/// jobs a second than a batch per pause would otherwise outgrow its
/// retention for good). Jobs that came due within the last interval are
/// left to pauses as before: the pass stops after their first batch.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_janitor_that_is_behind_deletes_without_pausing(pool: PgPool) {
    sqlx::query(
        "INSERT INTO almanac.jobs (kind, status, finished_at)
         SELECT 'report', 'done', now() - interval '3 hours' + g * interval '1 millisecond'
         FROM generate_series(1, 5000) AS g",
    )
    .execute(&pool)
    .await
    .unwrap();
    let janitor = Janitor::new(
        pool.clone(),
        JanitorConfig {
            batch_size: 1000,
            pause: Duration::from_secs(3600),
            interval: Duration::from_secs(60),
            done_retention: Duration::from_secs(3600),
            ..JanitorConfig::default()
        }
        .validated()
        .unwrap(),
    );
    let report = tokio::time::timeout(
        Duration::from_secs(120),
        janitor.run_once(&CancellationToken::new()),
    )
    .await
    .expect("a janitor behind by hours paused between its batches")
    .unwrap();
    assert_eq!((report.done, report.batches), (5000, 9));
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 0);

    // Due for 30 s, less than the 60 s interval: not behind, so after a
    // full batch the pass pauses (an hour), and stops here when shut down.
    sqlx::query(
        "INSERT INTO almanac.jobs (kind, status, finished_at)
         SELECT 'report', 'done', now() - interval '3630 seconds'
         FROM generate_series(1, 1500)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let shutdown = CancellationToken::new();
    let pass = janitor.run_once(&shutdown);
    tokio::pin!(pass);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while count(&pool, "SELECT count(*) FROM almanac.jobs").await != 500 {
        assert!(
            std::time::Instant::now() < deadline,
            "the first batch never went"
        );
        // The pass runs meanwhile; it must not end (it pauses for an hour).
        if let Ok(report) = tokio::time::timeout(Duration::from_millis(50), &mut pass).await {
            panic!("the pass ended without pausing: {report:?}");
        }
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut pass)
            .await
            .is_err(),
        "a janitor not behind pauses after a full batch"
    );
    shutdown.cancel();
    let report = pass.await.unwrap();
    assert_eq!(report.done, 1000);
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 500);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn janitor_once_prints_what_it_deleted(pool: PgPool) {
    finished_job(&pool, "report", "done", 10).await;
    finished_job(&pool, "report", "done", 1).await;
    let mut cmd = almanac();
    cmd.args(["janitor", "--once", "--done-retention", "2d"])
        .env("DATABASE_URL", harness::database_url(&pool));
    let out = output(cmd);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "deleted 1 done job, 0 dead jobs, 0 cancelled jobs and 0 published outbox rows (4 batches)"
    );
}

/// Bad operations settings: a clear error naming the setting, a non-zero
/// exit, and nothing started (no migration applied, no port bound).
#[sqlx::test(migrations = false)]
async fn bad_operations_settings_fail_the_start_with_the_setting_named(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = tempdir();
    std::fs::create_dir_all(dir.join("none")).unwrap();
    let run = |args: &[&str], config: Option<&str>| {
        let mut cmd = almanac();
        cmd.current_dir(&dir)
            .arg("run")
            .args(args)
            .env("DATABASE_URL", &url);
        let path = dir.join("almanac.toml");
        match config {
            Some(text) => std::fs::write(&path, text).unwrap(),
            None => {
                let _ = std::fs::remove_file(&path);
            }
        }
        cmd.arg("--schedules").arg(dir.join("none"));
        output(cmd)
    };
    let cases: [(&[&str], Option<&str>, &str); 12] = [
        (
            &["--http-addr", "nowhere"],
            None,
            "`nowhere` is not an address to listen on",
        ),
        (
            &["--http-addr", "127.0.0.1:0", "--done-retention", "0s"],
            None,
            "--done-retention ([janitor] done_retention) must be longer than 0s",
        ),
        (
            &["--http-addr", "127.0.0.1:0"],
            Some("[reaper]\nbatch_size = 0\n"),
            "--reaper-batch-size ([reaper] batch_size) must be at least 1, got 0",
        ),
        (
            &["--http-addr", "127.0.0.1:0"],
            Some("[reaper]\ninterval = \"0s\"\n"),
            "--reaper-interval ([reaper] interval) must be longer than 0s",
        ),
        (
            &["--http-addr", "127.0.0.1:0", "--janitor-batch=-5"],
            None,
            "--janitor-batch ([janitor] batch_size) must be at least 1, got -5",
        ),
        (
            &["--http-addr", "0.0.0.0:0"],
            None,
            "--http-addr 0.0.0.0:0 is reachable beyond this machine; set --http-basic-auth",
        ),
        (
            &[
                "--http-addr",
                "127.0.0.1:0",
                "--amqp-url",
                "amqp://guest:s3cret@127.0.0.1:5672/%2f",
                "--max-message-bytes",
                "0",
            ],
            None,
            "--max-message-bytes ([relay] max_message_bytes) must be at least 1024, got 0",
        ),
        (
            &[
                "--http-addr",
                "127.0.0.1:0",
                "--kafka-brokers",
                "127.0.0.1:9092",
                "--ack-timeout",
                "0s",
            ],
            None,
            "--ack-timeout ([relay] ack_timeout) must be at least 100ms",
        ),
        // The relay's own keys of the config file reach the same checks.
        (
            &[
                "--http-addr",
                "127.0.0.1:0",
                "--kafka-brokers",
                "127.0.0.1:9092",
            ],
            Some("[relay]\nin_flight_lease = \"5s\"\n"),
            "--in-flight-lease (5s) must be longer than 40s with --ack-timeout 10s",
        ),
        (
            &[
                "--http-addr",
                "127.0.0.1:0",
                "--kafka-brokers",
                "127.0.0.1:9092",
            ],
            Some("[relay]\nredrive_after = \"0s\"\n"),
            "--redrive-after ([relay] redrive_after) must be longer than 0s",
        ),
        (
            &[
                "--http-addr",
                "127.0.0.1:0",
                "--kafka-brokers",
                "127.0.0.1:9092",
                "--relay-batch-size",
                "0",
            ],
            None,
            "--relay-batch-size ([relay] batch_size) is 0; it must be between 1 and 10000",
        ),
        (
            &[
                "--http-addr",
                "127.0.0.1:0",
                "--kafka-brokers",
                "127.0.0.1:9092",
            ],
            Some("[relay]\nbatch_size = 20000\n"),
            "--relay-batch-size ([relay] batch_size) is 20000; it must be between 1 and 10000",
        ),
    ];
    for (args, config, expected) in cases {
        let out = run(args, config);
        assert!(!out.status.success(), "{args:?} must fail");
        let err = text(&out.stderr);
        assert!(err.contains(expected), "{args:?}: {err}");
        assert!(!err.contains("s3cret"), "no password in errors: {err}");
    }
    // A port already in use.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = run(&["--http-addr", &addr], None);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("cannot listen on --http-addr {addr}")),
        "{err}"
    );
    // Nothing ran: the database never got the schema.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'almanac'"
        )
        .await,
        0
    );
}

/// The `almanac.toml` sample in docs/operations.md loads verbatim and validates.
#[test]
fn the_readme_config_sample_loads_verbatim() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
            .unwrap();
    let section = readme
        .split("\n## Configuration")
        .nth(1)
        .expect("docs/operations.md has a Configuration section");
    let sample = section
        .split("```toml\n")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .expect("the Configuration section has a toml sample");
    let config = almanac::config::Config::parse(std::path::Path::new("docs/operations.md"), sample)
        .unwrap_or_else(|e| panic!("the docs' sample is rejected: {e}"));
    assert!(config.http_addr.is_some() && config.janitor.done_retention.is_some());
    assert!(config.reaper.batch_size.is_some() && config.relay.amqp_url.is_some());
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("almanac-ops-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The relay's counters and the outbox gauges move when it publishes to a
/// real broker (RabbitMQ).
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn relay_metrics_move_when_it_publishes(pool: PgPool) {
    use almanac::relay::routes::{self, RouteMode};
    use almanac::relay::{Publisher, Relay, SinkKind};
    let sinks = harness::brokers::sinks();
    let destination = harness::brokers::unique("metrics");
    let mut publisher = Publisher::new(SinkKind::Rabbitmq, &sinks).unwrap();
    publisher.ensure(&destination).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    routes::set(
        &mut conn,
        "relayed",
        RouteMode::Dual,
        Some(SinkKind::Rabbitmq),
        Some(&destination),
    )
    .await
    .unwrap();
    for _ in 0..3 {
        queue::enqueue(&mut conn, &NewJob::new("relayed"))
            .await
            .unwrap();
    }
    let metrics = Metrics::new();
    let collector = Collector::new(pool.clone(), Valid::default()).with_metrics(metrics.clone());
    collector.run_once(&CancellationToken::new()).await.unwrap();
    let before = metrics.render();
    assert_eq!(
        sample(&before, "almanac_outbox_backlog", &[("sink", "rabbitmq")]),
        Some(3.0)
    );

    let relay = tokio::sync::Mutex::new(
        Relay::new(
            pool.clone(),
            publisher,
            harness::brokers::relay_config().validated().unwrap(),
        )
        .with_metrics(metrics.clone()),
    );
    eventually(
        "the relay to publish 3 rows",
        Duration::from_secs(30),
        || async {
            relay.lock().await.run_once().await.unwrap();
            let published = count(
                &pool,
                "SELECT coalesce(sum(cardinality(job_ids)), 0)::bigint FROM almanac.outbox_batches WHERE published_at IS NOT NULL",
            )
            .await;
            if published == 3 {
                Ok(())
            } else {
                Err(format!("{published} so far"))
            }
        },
    )
    .await;
    collector.run_once(&CancellationToken::new()).await.unwrap();
    let after = metrics.render();
    assert_eq!(
        sample(
            &after,
            "almanac_relay_published_total",
            &[("sink", "rabbitmq")]
        ),
        Some(3.0),
        "{after}"
    );
    assert_eq!(
        sample(&after, "almanac_outbox_backlog", &[("sink", "rabbitmq")]),
        Some(0.0)
    );
}

/// `almanac work --http-addr` serves the probes and the process's counters.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn almanac_work_serves_http_when_asked(pool: PgPool) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut cmd = almanac();
    cmd.args(["work", "--handler", "noop=true", "--poll-interval", "100ms"])
        .args(["--http-addr", &addr])
        .env("DATABASE_URL", harness::database_url(&pool))
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let child = std::sync::Mutex::new(KillOnDrop(Some(cmd.spawn().unwrap())));
    eventually(
        "almanac work to serve /healthz",
        Duration::from_secs(30),
        || async {
            assert!(
                child
                    .lock()
                    .unwrap()
                    .0
                    .as_mut()
                    .unwrap()
                    .try_wait()
                    .unwrap()
                    .is_none(),
                "almanac work exited"
            );
            matches!(get(&addr, "/healthz").await, Ok(r) if r.status == 200)
        },
    )
    .await;
    queue::enqueue(&mut pool.acquire().await.unwrap(), &NewJob::new("noop"))
        .await
        .unwrap();
    eventually(
        "the job's completion to show in /metrics",
        Duration::from_secs(30),
        || async {
            let body = get(&addr, "/metrics")
                .await
                .map(|r| r.body)
                .unwrap_or_default();
            sample(&body, "almanac_jobs_completed_total", &[("kind", "noop")]) == Some(1.0)
        },
    )
    .await;
    let child = child.into_inner().unwrap().0.take().unwrap();
    sigterm(&child);
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// Schedule lag is how far the scheduler's own planning is behind: from the
/// first run after its cursor that is due; backfilled rows do not count.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn schedule_lag_counts_from_the_first_unplanned_due_run(pool: PgPool) {
    sqlx::query(
        "INSERT INTO almanac.schedules (name, cron, timezone, kind, payload, catchup, catchup_window,
                                        overlap, max_attempts, enabled, definition_hash, created_at)
         VALUES ('hourly', '0 * * * *', 'UTC', 'h', '{}', 'all', '7 days', 'allow', 5, true, 'h',
                 date_trunc('hour', now()) - interval '48 hours' + interval '30 minutes')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let lag = |pool: PgPool| async move {
        let mut conn = pool.acquire().await.unwrap();
        let states = almanac::stats::snapshot::schedules(&mut conn)
            .await
            .unwrap();
        assert_eq!(states.len(), 1);
        states[0].lag_seconds
    };
    // Never planned: the first run after the first sync was 47 h 30 m ago (and a bit).
    let never = lag(pool.clone()).await;
    assert!((47.0 * 3600.0..48.0 * 3600.0).contains(&never), "{never}");
    // A backfilled row for the latest hour does not move the cursor.
    sqlx::query(
        "INSERT INTO almanac.schedule_runs (schedule, logical_run, fire_at, source, outcome)
         VALUES ('hourly', 'latest', date_trunc('hour', now()), 'backfill', 'skipped_catchup')",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert!(lag(pool.clone()).await >= never);
    // The scheduler planned up to the latest hour: nothing due is unplanned.
    sqlx::query(
        "INSERT INTO almanac.schedule_runs (schedule, logical_run, fire_at, source, outcome)
         VALUES ('hourly', 'planned', date_trunc('hour', now()), 'tick', 'skipped_catchup')",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(lag(pool.clone()).await, 0.0);
}
