//! `almanac run --roles scheduler` as a child process, with its log captured,
//! and the ledger checks the scheduler process tests share (tests/it/leader.rs
//! and tests/it/leader_faults.rs).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use sqlx::PgPool;

pub struct Proc {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    /// A scheduler on `url` with `dir` as its schedules, standbys retrying
    /// every 300 ms, plus `extra` flags and `env`.
    pub fn start_with(url: &str, dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut command = super::almanac();
        command
            .args([
                "run",
                "--roles",
                "scheduler",
                "--standby-retry",
                "300ms",
                "--schedules",
            ])
            .arg(dir)
            .args(extra)
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            command.env(k, v);
        }
        Proc::spawn(command)
    }

    /// Any `almanac` command (see [`super::almanac`]), its stderr captured.
    pub fn spawn(mut command: std::process::Command) -> Proc {
        let mut child = command.stderr(Stdio::piped()).spawn().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let lines = log.clone();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        Proc { child, log }
    }

    pub fn start(url: &str, dir: &Path) -> Proc {
        Proc::start_with(url, dir, &[], &[])
    }

    pub fn said(&self, text: &str) -> bool {
        self.times_said(text) > 0
    }

    pub fn times_said(&self, text: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(text))
            .count()
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: signals a child process this test spawned.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    pub async fn exit_code(mut self) -> Option<i32> {
        tokio::task::spawn_blocking(move || self.child.wait().unwrap().code())
            .await
            .unwrap()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A failed test must not leave a scheduler running (or stopped).
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn dir_with(test: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("almanac-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    dir
}

pub async fn db_now(pool: &PgPool) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT now()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The backend pid holding the leader lock in this test's database, if any.
pub async fn leader_backend(pool: &PgPool) -> Option<i32> {
    sqlx::query_scalar(
        r#"
        SELECT l.pid FROM pg_locks l JOIN pg_database d ON d.oid = l.database
        WHERE d.datname = current_database() AND l.locktype = 'advisory' AND l.granted
          AND l.classid = ($1 >> 32)::oid AND l.objid = ($1 & 4294967295)::oid AND l.objsubid = 1
        "#,
    )
    .bind(almanac::scheduler::leader::LEADER_LOCK_KEY)
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// Runs of `schedule` recorded with `fire_at > after`.
pub async fn runs_after(pool: &PgPool, schedule: &str, after: DateTime<Utc>) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM almanac.schedule_runs WHERE schedule = $1 AND fire_at > $2",
    )
    .bind(schedule)
    .bind(after)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The user's guarantee for a schedule firing every `period_s` seconds:
/// from its first recorded run to its last, every run is in the ledger once,
/// emitted, with exactly one job, and none was emitted before it was due.
pub async fn assert_every_run_once(pool: &PgPool, schedule: &str, period_s: i64) {
    let fires: Vec<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT fire_at FROM almanac.schedule_runs WHERE schedule = $1 ORDER BY fire_at",
    )
    .bind(schedule)
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(fires.len() >= 2, "too few runs to judge: {fires:?}");
    let span = (*fires.last().unwrap() - fires[0]).num_seconds();
    assert_eq!(
        fires.len() as i64,
        span / period_s + 1,
        "every {period_s}-second run from first to last, once: {fires:?}"
    );
    let (not_emitted, early, jobs, distinct, unlinked): (i64, i64, i64, i64, i64) = sqlx::query_as(
        r#"
        SELECT
          (SELECT count(*) FROM almanac.schedule_runs WHERE schedule = $1 AND outcome <> 'emitted'),
          (SELECT count(*) FROM almanac.schedule_runs WHERE schedule = $1 AND recorded_at < fire_at),
          (SELECT count(*) FROM almanac.jobs WHERE schedule = $1),
          (SELECT count(DISTINCT logical_run) FROM almanac.jobs WHERE schedule = $1),
          (SELECT count(*) FROM almanac.schedule_runs r WHERE schedule = $1
             AND NOT EXISTS (SELECT 1 FROM almanac.jobs j WHERE j.id = r.job_id
                             AND j.logical_run = r.logical_run))
        "#,
    )
    .bind(schedule)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(not_emitted, 0, "runs skipped");
    assert_eq!(early, 0, "runs recorded before they were due");
    assert_eq!(
        (jobs, distinct),
        (fires.len() as i64, fires.len() as i64),
        "one job per run"
    );
    assert_eq!(unlinked, 0, "ledger rows without their job");
}
