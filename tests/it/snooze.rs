//! Snooze: a handler puts its job back for later without using an attempt
//! (a Rust handler with `HandlerError::Snooze`, a command with exit 75 and
//! an `almanac-snooze: DELAY` line); it runs again after the delay; a
//! snooze after a cancel request ends the job `cancelled`; a command that
//! exits 75 without a valid delay line is a failed attempt that says why.

use std::process::Stdio;
use std::time::Duration;

use almanac::control::{Actor, Source};
use almanac::queue::{self, Claim, Fenced, JobStatus, NewJob};
use almanac::role::{Role, Settings};
use almanac::worker::{HandlerError, JobContext, Worker, WorkerConfig};
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::cancel::scratch;
use crate::harness::scheduler_proc::{db_now, Proc};
use crate::harness::{self, count, eventually};

fn config() -> almanac::role::Valid<WorkerConfig> {
    WorkerConfig {
        concurrency: 2,
        batch_size: 2,
        lease: Duration::from_secs(10),
        poll_interval: Duration::from_millis(50),
        shutdown_deadline: Duration::from_secs(2),
        ..WorkerConfig::default()
    }
    .validated()
    .unwrap()
}

async fn runs_of(pool: &PgPool, id: i64) -> i64 {
    count(
        pool,
        &format!("SELECT count(*) FROM exec_log WHERE job_id = {id}"),
    )
    .await
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_rust_handler_snoozes_without_using_an_attempt_and_runs_again_after_the_delay(
    pool: PgPool,
) {
    harness::create_exec_log(&pool).await;
    let log = harness::log_pool(&pool, 2).await;
    let mut conn = pool.acquire().await.unwrap();
    // One attempt only: a snooze that used it would leave nothing to run.
    let id = queue::enqueue(&mut conn, &NewJob::new("later").max_attempts(1))
        .await
        .unwrap()
        .id();
    let worker = Worker::new(pool.clone(), config()).register("later", move |ctx: JobContext| {
        let log = log.clone();
        async move {
            let before: i64 = sqlx::query_scalar("SELECT count(*) FROM exec_log")
                .fetch_one(&log)
                .await
                .unwrap();
            harness::log_exec(&log, ctx.job.id, ctx.job.attempts, 0).await;
            if before == 0 {
                return Err(HandlerError::snooze(Duration::from_secs(2)));
            }
            Ok(())
        }
    });
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually("the first run", Duration::from_secs(10), || async {
        runs_of(&pool, id).await == 1
    })
    .await;
    eventually(
        "the snooze to be recorded",
        Duration::from_secs(10),
        || async { queue::get(&pool, id).await.unwrap().status == JobStatus::Ready },
    )
    .await;
    let job = queue::get(&pool, id).await.unwrap();
    let now = db_now(&pool).await;
    assert_eq!(job.attempts, 0);
    assert!(job.run_at > now, "run_at {} is not after {now}", job.run_at);
    assert_eq!(job.last_error, None);

    eventually(
        "the second run, after the delay",
        Duration::from_secs(15),
        || async { queue::get(&pool, id).await.unwrap().status == JobStatus::Done },
    )
    .await;
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!((job.attempts, job.max_attempts), (1, 1));
    let ats: Vec<(i32, DateTime<Utc>)> =
        sqlx::query_as("SELECT attempt, at FROM exec_log WHERE job_id = $1 ORDER BY at")
            .bind(id)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(ats.iter().map(|(a, _)| *a).collect::<Vec<_>>(), vec![1, 1]);
    let gap = (ats[1].1 - ats[0].1).to_std().unwrap();
    assert!(
        gap >= Duration::from_millis(1900),
        "ran again after {gap:?}"
    );
    stop.cancel();
    let report = running.await.unwrap().unwrap();
    assert_eq!(
        (report.snoozed, report.completed, report.retried),
        (1, 1, 0)
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_snooze_after_a_cancel_request_ends_the_job_cancelled(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("later"))
        .await
        .unwrap()
        .id();
    let job = queue::claim(
        &mut *conn,
        &Claim {
            kinds: &["later".to_string()],
            limit: 1,
            lease: Duration::from_secs(30),
        },
    )
    .await
    .unwrap()
    .remove(0);
    let (_, token) = job.lease().unwrap();
    let actor = Actor::new("carol", Source::Dashboard);
    almanac::control::jobs::cancel(&mut conn, &actor, id, None)
        .await
        .unwrap();
    assert_eq!(
        queue::snooze(&pool, id, token, Duration::from_secs(60))
            .await
            .unwrap(),
        Fenced::Held(JobStatus::Cancelled)
    );
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!((job.status, job.attempts), (JobStatus::Cancelled, 1));
    assert!(job.finished_at.is_some());
    // The fence: a stale token snoozes nothing.
    assert_eq!(
        queue::snooze(&pool, id, token, Duration::from_secs(1))
            .await
            .unwrap(),
        Fenced::Lost
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_command_snoozes_with_exit_75_and_a_delay_line(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = scratch("snooze-exec");
    let mut conn = pool.acquire().await.unwrap();
    let later = queue::enqueue(&mut conn, &NewJob::new("later").max_attempts(1))
        .await
        .unwrap()
        .id();
    let vague = queue::enqueue(&mut conn, &NewJob::new("vague").max_attempts(3))
        .await
        .unwrap()
        .id();
    let d = dir.display();
    let later_cmd = format!(
        "echo run >> {d}/later; [ -f {d}/snoozed ] && exit 0; touch {d}/snoozed; \
         echo 'busy upstream' >&2; echo 'almanac-snooze: 2s' >&2; exit 75"
    );
    let mut cmd = harness::almanac();
    cmd.args(["work", "--handler"])
        .arg(format!("later={later_cmd}"))
        .args(["--handler", "vague=echo 'try later' >&2; exit 75"])
        .args(["--poll-interval", "100ms", "--shutdown-deadline", "2s"])
        .env("DATABASE_URL", &url)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null());
    let work = Proc::spawn(cmd);

    eventually(
        "the snooze to be recorded",
        Duration::from_secs(30),
        || async {
            dir.join("snoozed").exists()
                && queue::get(&pool, later).await.unwrap().status == JobStatus::Ready
        },
    )
    .await;
    let job = queue::get(&pool, later).await.unwrap();
    assert_eq!(job.attempts, 0);
    assert!(job.run_at > db_now(&pool).await);
    eventually(
        "the job to run again and be done",
        Duration::from_secs(15),
        || async { queue::get(&pool, later).await.unwrap().status == JobStatus::Done },
    )
    .await;
    let job = queue::get(&pool, later).await.unwrap();
    assert_eq!((job.attempts, job.max_attempts), (1, 1));
    let ran = std::fs::read_to_string(dir.join("later")).unwrap();
    assert_eq!(ran.lines().count(), 2, "{ran}");
    assert!(work.said("job snoozed"), "{}", work.log());

    // Exit 75 without a delay line: a failed attempt that says what to write.
    eventually(
        "the vague job's first failure",
        Duration::from_secs(30),
        || async {
            queue::get(&pool, vague).await.unwrap().attempts >= 1
                && queue::get(&pool, vague).await.unwrap().status != JobStatus::Running
        },
    )
    .await;
    let job = queue::get(&pool, vague).await.unwrap();
    assert!(
        matches!(job.status, JobStatus::Ready | JobStatus::Dead),
        "{:?}",
        job.status
    );
    assert_eq!(
        job.last_error.as_deref(),
        Some("command exited with status 75 (snooze) but no `almanac-snooze: DELAY` line on stderr, so it counts as a failed attempt; to snooze, write e.g. `almanac-snooze: 30s` to stderr before exiting 75; stderr: try later")
    );
    work.signal(libc::SIGTERM);
    assert_eq!(work.exit_code().await, Some(0));
}
