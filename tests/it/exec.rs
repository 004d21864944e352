//! The exec handler end to end: payload on stdin, environment, each exit
//! code, timeouts, and the kill when a lease is lost.

use std::path::PathBuf;
use std::time::Duration;

use almanac::queue::{self, JobStatus, NewJob};
use almanac::role::{Role, Settings};
use almanac::worker::exec::ExecHandler;
use almanac::worker::{Worker, WorkerConfig};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::{self, eventually};

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

    let worker = Worker::new(pool.clone(), config().validated().unwrap())
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
    let var = |name: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("missing {name} in:\n{env}"))
            .to_string()
    };
    uuid::Uuid::parse_str(&var("ALMANAC_LEASE_TOKEN")).unwrap();
    chrono::DateTime::parse_from_rfc3339(&var("ALMANAC_LEASE_DEADLINE")).unwrap();
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
    let worker = Worker::new(pool.clone(), config().validated().unwrap())
        .register("long", ExecHandler::new(command));
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

/// Whether `pid` has ended (gone, or a zombie waiting for its parent).
fn gone(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z"))
        .unwrap_or(false);
    !alive || zombie
}

fn read_pid(path: &std::path::Path) -> i32 {
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_command_ends_when_its_shell_ends_background_children_included(pool: PgPool) {
    let dir = scratch("background");
    let (left, timed, group) = (dir.join("left"), dir.join("timed"), dir.join("group"));
    let mut conn = pool.acquire().await.unwrap();
    let quick = queue::enqueue(&mut conn, &NewJob::new("leaves_child"))
        .await
        .unwrap()
        .id();
    let slow = queue::enqueue(&mut conn, &NewJob::new("times_out").max_attempts(1))
        .await
        .unwrap()
        .id();
    // The background `sleep` holds the stderr pipe open: reading stderr to
    // EOF would wait ten minutes.
    let worker = Worker::new(pool.clone(), config().validated().unwrap())
        .register(
            "leaves_child",
            // Field 5 of /proc/PID/stat: the process group, led by the watchdog.
            ExecHandler::new(format!(
                "cut -d' ' -f5 /proc/$$/stat > {}; sleep 600 & echo $! > {}; exit 0",
                group.display(),
                left.display()
            )),
        )
        .register(
            "times_out",
            ExecHandler::new(format!(
                "sleep 600 & echo $! > {}; sleep 30",
                timed.display()
            ))
            .timeout(Some(Duration::from_millis(500))),
        );
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually("the job to be done", Duration::from_secs(10), || {
        status_is(&pool, quick, JobStatus::Done)
    })
    .await;
    eventually("the timed-out job to die", Duration::from_secs(10), || {
        status_is(&pool, slow, JobStatus::Dead)
    })
    .await;
    let watchdog = read_pid(&group);
    assert_ne!(watchdog, read_pid(&left), "the group is the watchdog's");
    for pidfile in [&left, &timed, &group] {
        let pid = read_pid(pidfile);
        eventually(
            "the background child and the watchdog to be killed",
            Duration::from_secs(5),
            || async move { gone(pid) },
        )
        .await;
    }
    stop.cancel();
    let report = running.await.unwrap().unwrap();
    assert_eq!((report.completed, report.dead), (1, 1));
    assert!(queue::get(&pool, slow)
        .await
        .unwrap()
        .last_error
        .unwrap()
        .contains("ran past its timeout of 500ms"));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_child_that_escapes_the_process_group_cannot_hold_the_job(pool: PgPool) {
    let dir = scratch("escape");
    let pidfile = dir.join("pid");
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("escape").max_attempts(1))
        .await
        .unwrap()
        .id();
    // A new session keeps the stderr pipe open past the group kill.
    let command = format!(
        "setsid sh -c 'echo $$ > {0}; exec sleep 600' & while [ ! -s {0} ]; do sleep 0.01; done; \
         echo 'could not reach the API' >&2; exit 3",
        pidfile.display()
    );
    let worker = Worker::new(pool.clone(), config().validated().unwrap())
        .register("escape", ExecHandler::new(command));
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually("the job to die", Duration::from_secs(15), || {
        status_is(&pool, id, JobStatus::Dead)
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    // SAFETY: kills the escaped process this test's command started.
    unsafe { libc::kill(read_pid(&pidfile), libc::SIGKILL) };
    assert_eq!(
        queue::get(&pool, id).await.unwrap().last_error.as_deref(),
        Some("command exited with status 3; stderr: could not reach the API")
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn commands_get_a_clean_environment_and_no_password_reaches_last_error_or_logs(pool: PgPool) {
    // Trust authentication ignores the password, so a URL may carry one.
    let plain = harness::database_url(&pool);
    let (scheme, rest) = plain.split_once("://").unwrap();
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let url = format!("{scheme}://postgres:pgS3cretPw@{host}");
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("leak").max_attempts(1))
        .await
        .unwrap()
        .id();
    let child = harness::almanac()
        .args([
            "work",
            "--handler",
            "leak=env >&2; exit 3",
            "--pass-env",
            "REPORT_BUCKET",
            "--poll-interval",
            "50ms",
        ])
        .env("DATABASE_URL", &url)
        .env(
            "ALMANAC_AMQP_URL",
            "amqp://guest:amqpS3cretPw@127.0.0.1:1/%2f",
        )
        .env("REPORT_BUCKET", "s3://reports")
        .env("UNLISTED_SETTING", "not-for-commands")
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    eventually("the job to die", Duration::from_secs(30), || {
        status_is(&pool, id, JobStatus::Dead)
    })
    .await;
    // SAFETY: signals the child this test spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let logs = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let error = queue::get(&pool, id).await.unwrap().last_error.unwrap();
    for secret in [
        "pgS3cretPw",
        "amqpS3cretPw",
        "DATABASE_URL",
        "not-for-commands",
    ] {
        assert!(!error.contains(secret), "{secret} in last_error: {error}");
        assert!(
            !logs.contains(secret) || secret == "DATABASE_URL",
            "{secret} in logs:\n{logs}"
        );
    }
    for expected in [
        "REPORT_BUCKET=s3://reports".to_string(),
        format!("ALMANAC_JOB_ID={id}"),
        "ALMANAC_KIND=leak".to_string(),
        "PATH=".to_string(),
    ] {
        assert!(error.contains(&expected), "{expected} missing from {error}");
    }
    assert!(logs.contains("job failed for good"), "{logs}");
}

#[test]
fn pass_env_takes_names_not_assignments() {
    let out = harness::almanac()
        .args([
            "work",
            "--handler",
            "k=true",
            "--pass-env",
            "API_TOKEN=abc123",
        ])
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--pass-env")
            && stderr.contains("`API_TOKEN=abc123` is not an environment variable name")
            && stderr.contains("give the name only, e.g. --pass-env API_TOKEN"),
        "{stderr}"
    );
}
