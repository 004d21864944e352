//! The exec handler end to end: payload on stdin, environment, each exit
//! code, timeouts, and the kill when a lease is lost.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use almanac::queue::{self, JobStatus, NewJob};
use almanac::worker::exec::ExecHandler;
use almanac::worker::{Worker, WorkerConfig};
use common::eventually;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("almanac-exec-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn config() -> WorkerConfig {
    WorkerConfig {
        concurrency: 4,
        lease: Duration::from_millis(900),
        poll_interval: Duration::from_millis(50),
        backoff: almanac::queue::Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_millis(200),
            jitter: 0.2,
        },
        ..WorkerConfig::default()
    }
}

async fn status_is(pool: &PgPool, id: i64, status: JobStatus) -> bool {
    queue::get(pool, id).await.unwrap().status == status
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn commands_get_the_payload_and_environment_and_exit_codes_decide_the_outcome(pool: PgPool) {
    let dir = scratch("codes");
    let out = dir.display();
    let mut conn = pool.acquire().await.unwrap();
    let mut ok = NewJob::new("ok")
        .payload(json!({"order": 42, "note": "ünïcode"}))
        .idempotency_key("order:42");
    ok.logical_run = Some("2026-11-30".into());
    ok.schedule = Some("nightly".into());
    let ok = queue::enqueue(&mut conn, &ok).await.unwrap().id();
    let bad = queue::enqueue(&mut conn, &NewJob::new("bad").max_attempts(5))
        .await
        .unwrap()
        .id();
    let flaky = queue::enqueue(&mut conn, &NewJob::new("flaky").max_attempts(3))
        .await
        .unwrap()
        .id();
    let slow = queue::enqueue(&mut conn, &NewJob::new("slow").max_attempts(1))
        .await
        .unwrap()
        .id();

    let worker = Worker::new(pool.clone(), config())
        .register(
            "ok",
            ExecHandler::new(format!(
                "cat > {out}/stdin.json; env | grep ^ALMANAC_ | sort > {out}/env"
            )),
        )
        .register(
            "bad",
            ExecHandler::new("echo 'field \"email\" is missing' >&2; exit 65"),
        )
        .register(
            "flaky",
            ExecHandler::new(format!(
                "echo run >> {out}/flaky; echo 'connection refused' >&2; exit 3"
            )),
        )
        .register(
            "slow",
            ExecHandler::new("sleep 30").timeout(Some(Duration::from_millis(300))),
        );
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    for id in [bad, flaky, slow] {
        eventually("the failing jobs to die", Duration::from_secs(30), || {
            status_is(&pool, id, JobStatus::Dead)
        })
        .await;
    }
    eventually("the ok job to be done", Duration::from_secs(30), || {
        status_is(&pool, ok, JobStatus::Done)
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();

    let stdin: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("stdin.json")).unwrap()).unwrap();
    assert_eq!(stdin, json!({"order": 42, "note": "ünïcode"}));
    let env = std::fs::read_to_string(dir.join("env")).unwrap();
    for line in [
        format!("ALMANAC_JOB_ID={ok}"),
        "ALMANAC_KIND=ok".into(),
        "ALMANAC_ATTEMPT=1".into(),
        "ALMANAC_IDEMPOTENCY_KEY=order:42".into(),
        "ALMANAC_LOGICAL_RUN=2026-11-30".into(),
        "ALMANAC_SCHEDULE=nightly".into(),
    ] {
        assert!(env.lines().any(|l| l == line), "missing {line} in:\n{env}");
    }

    let bad = queue::get(&pool, bad).await.unwrap();
    assert_eq!(bad.attempts, 1, "exit 65 is permanent: no retry");
    assert_eq!(
        bad.last_error.as_deref(),
        Some("command exited with status 65; stderr: field \"email\" is missing")
    );

    let flaky = queue::get(&pool, flaky).await.unwrap();
    assert_eq!(flaky.attempts, 3);
    assert_eq!(
        std::fs::read_to_string(dir.join("flaky"))
            .unwrap()
            .lines()
            .count(),
        3
    );
    assert_eq!(
        flaky.last_error.as_deref(),
        Some("command exited with status 3; stderr: connection refused")
    );

    let slow = queue::get(&pool, slow).await.unwrap();
    assert!(slow
        .last_error
        .unwrap()
        .contains("ran past its timeout of 300ms"));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_command_whose_lease_is_lost_is_killed_with_its_children(pool: PgPool) {
    let dir = scratch("lost");
    let pidfile = dir.join("pid");
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("long"))
        .await
        .unwrap()
        .id();
    // The shell starts a child `sleep` and records its pid.
    let command = format!("sleep 60 & echo $! > {}; wait", pidfile.display());
    let worker = Worker::new(pool.clone(), config()).register("long", ExecHandler::new(command));
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually("the command to start", Duration::from_secs(15), || async {
        std::fs::read_to_string(&pidfile)
            .map(|s| s.trim().parse::<i32>().is_ok())
            .unwrap_or(false)
    })
    .await;
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    sqlx::query("UPDATE almanac.jobs SET lease_token = gen_random_uuid() WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    eventually(
        "the child process to be killed",
        Duration::from_secs(10),
        || async {
            // SAFETY: signal 0 only checks that the process exists.
            let alive = unsafe { libc::kill(pid, 0) } == 0;
            let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| s.contains(") Z"))
                .unwrap_or(false);
            !alive || zombie
        },
    )
    .await;
    stop.cancel();
    let report = running.await.unwrap().unwrap();
    assert_eq!(report.lost, 1);
}
