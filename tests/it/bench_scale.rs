//! `almanac bench --scale` as a person runs it: every figure at every size
//! in its JSON, a size that does not fit the disk refused before anything
//! is written, and the scratch database dropped on success, refusal and
//! SIGINT.

use std::process::Stdio;
use std::time::Duration;

use sqlx::PgPool;

use crate::harness::{self, eventually};

/// Whether the scratch database of the bench process `pid` exists.
async fn scratch_exists(pool: &PgPool, pid: u32) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(format!("almanac_bench_{pid}"))
        .fetch_one(pool)
        .await
        .unwrap()
}

fn bench(pool: &PgPool, args: &[&str]) -> std::process::Child {
    harness::almanac()
        .arg("bench")
        .args(args)
        .env("DATABASE_URL", harness::database_url(pool))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Runs `almanac bench ARGS` to its end: its pid, exit code, stdout and
/// stderr.
async fn run_bench(pool: &PgPool, args: &[&str]) -> (u32, Option<i32>, Vec<u8>, String) {
    let child = bench(pool, args);
    let pid = child.id();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    (pid, out.status.code(), out.stdout, stderr)
}

/// Small enough for a test: 2,000 jobs per burn-down.
const SMALL: [&str; 8] = [
    "--jobs",
    "2000",
    "--latency-jobs",
    "50",
    "--enqueue-jobs",
    "500",
    "--connections",
    "2",
];

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn every_figure_is_reported_at_every_size(pool: PgPool) {
    let mut args = vec!["--scale", "0,20000", "--json"];
    args.extend(SMALL);
    let (pid, code, stdout, stderr) = run_bench(&pool, &args).await;
    assert_eq!(code, Some(0), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    assert_eq!(report["sizes"], serde_json::json!([0, 20000]));
    assert_eq!(report["ledger_rows"], serde_json::json!([0, 2000]));
    let figures = report["figures"].as_array().unwrap();
    let value = |name: &str| -> Vec<f64> {
        let figure = figures
            .iter()
            .find(|f| f["name"] == name)
            .unwrap_or_else(|| panic!("no figure {name:?} in {report}"));
        figure["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    for name in [
        "enqueue, one job per transaction",
        "enqueue, batches of 1000",
        "raw claim + complete",
        "worker runtime claim + complete",
        "worker runtime / raw",
        "LISTEN latency p50",
        "LISTEN latency p99",
        "page /",
        "page /jobs",
        "page /jobs?status=ready",
        "page /dead",
        "page /schedules",
        "page /schedules/scale-0",
        "page /routes",
        "page /audit",
        "stats snapshot",
        "collector refresh",
        "reaper sweep (1000 expired)",
        "re-drive sweep (rabbitmq)",
        "reconcile sweep",
        "reconcile sweep, every kind looked at",
        "janitor deletion (done past retention)",
        "almanac.jobs table bytes",
        "almanac.jobs index bytes",
        "almanac.outbox table bytes",
        "almanac.outbox index bytes",
        "almanac.schedule_runs table bytes",
        "almanac.schedule_runs index bytes",
    ] {
        let values = value(name);
        assert_eq!(values.len(), 2, "{name}: {values:?}");
        assert!(
            values.iter().all(|v| v.is_finite() && *v > 0.0),
            "{name}: {values:?}"
        );
    }
    // Each figure beside its value on empty tables, with the ratio.
    for figure in figures {
        assert_eq!(figure["values"].as_array().unwrap().len(), 2, "{figure}");
    }
    let jobs = value("almanac.jobs table bytes");
    assert!(jobs[1] > jobs[0] * 10.0, "20,000 jobs take room: {jobs:?}");
    assert!(
        !scratch_exists(&pool, pid).await,
        "the scratch database is dropped"
    );
    // The ready jobs of the broker kind have their outbox rows.
    let outbox = value("almanac.outbox table bytes");
    assert!(outbox[1] > outbox[0], "{outbox:?}");
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_size_that_does_not_fit_the_disk_is_refused_before_anything_is_written(pool: PgPool) {
    let (pid, code, stdout, stderr) = run_bench(&pool, &["--scale", "0,1000000000000"]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("--scale up to 1000000000000 jobs needs about 645002.1 GB of disk")
            && stderr.contains("GB of disk")
            && stderr.contains("free"),
        "{stderr}"
    );
    assert!(stdout.is_empty());
    assert!(!scratch_exists(&pool, pid).await);

    let (_, code, _, stderr) = run_bench(&pool, &["--scale", "0,lots"]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("`lots` is not a number of jobs"),
        "{stderr}"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn sigint_mid_fill_drops_the_scratch_database(pool: PgPool) {
    let mut args = vec!["--scale", "0,5000000"];
    args.extend(SMALL);
    let child = bench(&pool, &args);
    let pid = child.id();
    eventually(
        "the scratch database to exist",
        Duration::from_secs(30),
        || scratch_exists(&pool, pid),
    )
    .await;
    // SAFETY: kill(2) on the child we spawned and have not reaped.
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("stopped by SIGINT"), "{stderr}");
    assert!(!scratch_exists(&pool, pid).await);
}
