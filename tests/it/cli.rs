//! The `almanac` binary as a person uses it: what it prints, its exit codes,
//! and that bad input writes nothing.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use almanac::queue::{self, JobStatus};
use sqlx::PgPool;

use crate::harness::{self, count, eventually};

fn almanac(url: &str, args: &[&str]) -> Output {
    harness::almanac()
        .args(args)
        .env("DATABASE_URL", url)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_string()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn enqueue_prints_the_id_and_reports_duplicates_without_failing(pool: PgPool) {
    let url = harness::database_url(&pool);
    let first = almanac(
        &url,
        &[
            "enqueue",
            "mail",
            "--payload",
            r#"{"to": "a@b.c"}"#,
            "--key",
            "welcome:7",
            "--max-attempts",
            "3",
        ],
    );
    assert!(first.status.success(), "{}", text(&first.stderr));
    let id: i64 = text(&first.stdout).parse().unwrap();
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!(
        (
            job.kind.as_str(),
            job.max_attempts,
            job.payload["to"].as_str()
        ),
        ("mail", 3, Some("a@b.c"))
    );

    let again = almanac(&url, &["enqueue", "mail", "--key", "welcome:7"]);
    assert!(again.status.success());
    assert_eq!(text(&again.stdout), id.to_string());
    assert_eq!(
        text(&again.stderr),
        format!(
            "a job with idempotency key `welcome:7` already exists (id {id}); nothing was enqueued"
        )
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 1);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn bad_input_is_refused_with_a_clear_message_and_writes_nothing(pool: PgPool) {
    let url = harness::database_url(&pool);
    let bad_json = almanac(&url, &["enqueue", "mail", "--payload", "{to: 1}"]);
    assert_eq!(bad_json.status.code(), Some(2));
    assert!(
        text(&bad_json.stderr)
            .contains("invalid value '{to: 1}' for '--payload <PAYLOAD>': not valid JSON"),
        "{}",
        text(&bad_json.stderr)
    );

    let bad_time = almanac(&url, &["enqueue", "mail", "--run-at", "tomorrow"]);
    assert_eq!(bad_time.status.code(), Some(2));
    assert!(text(&bad_time.stderr).contains("`tomorrow` is not an RFC 3339 instant"));
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 0);

    let unknown = almanac(&url, &["jobs", "show", "424242"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert_eq!(text(&unknown.stderr), "error: no job with id 424242");

    let id = text(&almanac(&url, &["enqueue", "mail"]).stdout);
    let not_dead = almanac(&url, &["jobs", "retry", &id]);
    assert_eq!(not_dead.status.code(), Some(1));
    assert_eq!(
        text(&not_dead.stderr),
        format!("error: job {id} is ready; retry applies only to dead or cancelled jobs")
    );
    let cancelled = almanac(&url, &["jobs", "cancel", &id, "--reason", "wrong tenant"]);
    assert!(cancelled.status.success());
    assert_eq!(
        text(&cancelled.stdout),
        format!("job {id} (mail) cancelled before it ran")
    );
    let job = queue::get(&pool, id.parse().unwrap()).await.unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.cancel_reason.as_deref(), Some("wrong tenant"));
    let again = almanac(&url, &["jobs", "cancel", &id]);
    assert!(again.status.success());
    assert_eq!(
        text(&again.stdout),
        format!("job {id} (mail) is already cancelled: nothing changed")
    );
}

#[test]
fn an_unreachable_database_is_named_without_its_password() {
    let out = almanac("postgres://app:s3cr3t-pw@127.0.0.1:1/orders", &["stats"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.starts_with(
            "error: cannot connect to database \"orders\" on 127.0.0.1:1 as user \"app\""
        ),
        "{err}"
    );
    assert!(!err.contains("s3cr3t-pw"), "{err}");
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn stats_and_list_show_the_queue(pool: PgPool) {
    let url = harness::database_url(&pool);
    for kind in ["mail", "mail", "sms"] {
        assert!(almanac(&url, &["enqueue", kind]).status.success());
    }
    let stats = almanac(&url, &["stats", "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(
        stats["jobs"]["by_kind_status"][0],
        serde_json::json!({"kind": "mail", "status": "ready", "count": 2})
    );
    assert!(stats["leader"].is_null());
    let human = text(&almanac(&url, &["stats"]).stdout);
    assert!(
        human.contains("mail                     ready             2"),
        "{human}"
    );
    assert!(
        human.contains(
            "outbox rabbitmq:       0 unpublished (0 in flight), oldest 0.0s, 0 failed for good"
        ),
        "{human}"
    );
    assert!(
        human.contains("scheduler leader:       none (no `almanac run` holds the lock)"),
        "{human}"
    );
    let list = almanac(&url, &["jobs", "list", "--kind", "sms", "--json"]);
    let lines: Vec<serde_json::Value> = text(&list.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["kind"], "sms");
    assert!(
        lines[0].get("lease_token").is_none(),
        "the lease token is never printed"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn almanac_work_runs_commands_and_exits_cleanly_on_sigterm(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = std::env::temp_dir().join(format!("almanac-cli-work-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("seen");
    let mut child = harness::almanac()
        .args([
            "work",
            "--handler",
            &format!("greet=cat >> {}; echo >> {}", log.display(), log.display()),
            "--concurrency",
            "2",
        ])
        .env("DATABASE_URL", &url)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    for i in 0..5 {
        let out = almanac(
            &url,
            &["enqueue", "greet", "--payload", &format!(r#"{{"i":{i}}}"#)],
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    eventually("five greetings", Duration::from_secs(30), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
        )
        .await
            == 5
    })
    .await;
    let seen = std::fs::read_to_string(&log).unwrap();
    assert_eq!(seen.lines().count(), 5);
    // SAFETY: sends SIGTERM to the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

#[test]
fn migrate_creates_a_missing_database() {
    let base = std::env::var("DATABASE_URL").unwrap();
    let (prefix, _) = base.rsplit_once('/').unwrap();
    let name = format!("almanac_cli_fresh_{}", std::process::id());
    let out = almanac(&format!("{prefix}/{name}"), &["migrate"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(
        said.starts_with(&format!(
            "schema almanac is at migration {} on database \"{name}\" on ",
            almanac::db::MIGRATOR
                .iter()
                .map(|m| m.version)
                .max()
                .unwrap()
        )),
        "{said}"
    );
    let drop = Command::new("psql")
        .args([
            "-q",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-c",
            &format!("DROP DATABASE \"{name}\""),
            "postgres",
        ])
        .output()
        .unwrap();
    assert!(drop.status.success());
}

/// A directory with one five-minute schedule, `every5`.
fn schedule_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("almanac-cli-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("s.toml"), "[every5]\ncron = \"*/5 * * * *\"\n").unwrap();
    dir
}

fn with_dir(url: &str, dir: &std::path::Path, args: &[&str]) -> Output {
    harness::almanac()
        .args(args)
        .arg("--schedules")
        .arg(dir)
        .env("DATABASE_URL", url)
        .env("USER", "alice")
        .output()
        .unwrap()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn pause_resume_and_trigger_refuse_bad_input_and_write_nothing(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = schedule_dir("controls-bad");
    for args in [
        &["schedules", "pause", "nosuch"][..],
        &["schedules", "resume", "nosuch"],
        &["schedules", "trigger", "nosuch"],
    ] {
        let out = with_dir(&url, &dir, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = text(&out.stderr);
        assert!(err.contains("no schedule named `nosuch`"), "{err}");
        assert!(err.contains("known: every5"), "{err}");
        assert!(err.contains("`almanac schedules list`"), "{err}");
    }
    let out = with_dir(
        &url,
        &dir,
        &[
            "schedules",
            "trigger",
            "every5",
            "--logical-run",
            "2026-03-08",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("`2026-03-08` is not a logical run of `every5`; its runs are named like `"),
        "{err}"
    );
    for table in ["schedules", "schedule_pauses", "schedule_runs", "jobs"] {
        let sql = format!("SELECT count(*) FROM almanac.{table}");
        assert_eq!(count(&pool, &sql).await, 0, "{table}");
    }
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn pause_shows_in_list_until_resumed_and_trigger_twice_emits_once(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = schedule_dir("controls");
    let out = with_dir(
        &url,
        &dir,
        &["schedules", "pause", "every5", "--note", "deploy freeze"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("paused since")
            && text(&out.stdout).contains("by alice (cli): deploy freeze"),
        "{}",
        text(&out.stdout)
    );
    let again = with_dir(&url, &dir, &["schedules", "pause", "every5"]);
    assert!(again.status.success());
    assert!(
        text(&again.stdout).contains("already paused"),
        "{}",
        text(&again.stdout)
    );
    let list = with_dir(&url, &dir, &["schedules", "list"]);
    let listed = text(&list.stdout);
    assert!(listed.contains("PAUSED"), "{listed}");
    assert!(listed.contains("by alice (cli): deploy freeze"), "{listed}");
    let json = with_dir(&url, &dir, &["schedules", "list", "--json"]);
    let row: serde_json::Value = serde_json::from_str(&text(&json.stdout)).unwrap();
    assert_eq!(row["paused"]["note"], "deploy freeze");
    assert_eq!(row["paused"]["by"], "alice (cli)");

    let resumed = with_dir(&url, &dir, &["schedules", "resume", "every5"]);
    assert!(resumed.status.success());
    assert!(
        text(&resumed.stdout).contains("resumed"),
        "{}",
        text(&resumed.stdout)
    );
    let json = with_dir(&url, &dir, &["schedules", "list", "--json"]);
    let row: serde_json::Value = serde_json::from_str(&text(&json.stdout)).unwrap();
    assert!(row["paused"].is_null());
    let not = with_dir(&url, &dir, &["schedules", "resume", "every5"]);
    assert!(not.status.success());
    assert!(text(&not.stdout).contains("not paused"));

    let first = with_dir(&url, &dir, &["schedules", "trigger", "every5"]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert!(
        text(&first.stdout).contains("emitted logical run"),
        "{}",
        text(&first.stdout)
    );
    let second = with_dir(&url, &dir, &["schedules", "trigger", "every5"]);
    assert_eq!(second.status.code(), Some(0));
    assert!(
        text(&second.stdout).contains("already exists (recorded by trigger, job "),
        "{}",
        text(&second.stdout)
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 1);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.schedule_runs WHERE source = 'trigger'"
        )
        .await,
        1
    );
}
