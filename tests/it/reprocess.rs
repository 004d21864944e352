//! `almanac backfill --reprocess missing|failed|all [--max-active N]` as a
//! person runs it: real `almanac backfill` and `almanac work` processes on a
//! real database, and an execution log the job commands write.

use std::collections::HashMap;
use std::io::Read as _;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::harness::{self, count, eventually};

/// A scratch directory with one hourly schedule (`hourly`, UTC), an empty
/// execution log and an empty list of runs whose command fails for good.
struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("almanac-reprocess-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("schedules")).unwrap();
        std::fs::write(
            dir.join("schedules/h.toml"),
            "[hourly]\ncron = \"0 * * * *\"\n",
        )
        .unwrap();
        std::fs::write(dir.join("exec.log"), "").unwrap();
        std::fs::write(dir.join("fail"), "").unwrap();
        Scratch { dir }
    }

    fn schedules(&self) -> PathBuf {
        self.dir.join("schedules")
    }

    /// Runs listed here fail for good (exit 65) when executed.
    fn fail(&self, runs: &[String]) {
        let mut text = runs.join("\n");
        text.push('\n');
        std::fs::write(self.dir.join("fail"), text).unwrap();
    }

    /// The job command: logs its start and end (nanoseconds) with its job
    /// id and logical run, taking `seconds` in between.
    fn handler(&self, seconds: &str) -> String {
        let log = self.dir.join("exec.log");
        let fail = self.dir.join("fail");
        let (log, fail) = (log.display(), fail.display());
        format!(
            "hourly=echo \"$ALMANAC_JOB_ID $ALMANAC_LOGICAL_RUN start $(date +%s%N)\" >> {log}; \
             sleep {seconds}; \
             echo \"$ALMANAC_JOB_ID $ALMANAC_LOGICAL_RUN end $(date +%s%N)\" >> {log}; \
             if grep -qxF \"$ALMANAC_LOGICAL_RUN\" {fail}; then echo 'upstream refused' >&2; exit 65; fi"
        )
    }

    /// Every execution: (job id, logical run, start ns, end ns).
    fn executions(&self) -> Vec<(i64, String, i128, i128)> {
        let text = std::fs::read_to_string(self.dir.join("exec.log")).unwrap();
        let mut by_job: HashMap<i64, (String, Option<i128>, Option<i128>)> = HashMap::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (id, run, what, at) = (f[0].parse().unwrap(), f[1], f[2], f[3].parse().unwrap());
            let e = by_job.entry(id).or_insert((run.to_string(), None, None));
            assert!(
                if what == "start" {
                    e.1.replace(at).is_none()
                } else {
                    e.2.replace(at).is_none()
                },
                "job {id} executed twice: {text}"
            );
        }
        let mut out: Vec<_> = by_job
            .into_iter()
            .map(|(id, (run, start, end))| {
                (id, run, start.unwrap(), end.expect("every execution ended"))
            })
            .collect();
        out.sort_by_key(|e| e.2);
        out
    }
}

/// An `almanac work` process, stopped when dropped.
struct Worker(Child);

impl Worker {
    fn start(url: &str, handler: &str) -> Worker {
        Worker(
            harness::almanac()
                .args([
                    "work",
                    "--handler",
                    handler,
                    "--concurrency",
                    "8",
                    "--poll-interval",
                    "100ms",
                ])
                .env("DATABASE_URL", url)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: signals a child process this test spawned.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

fn backfill(
    url: &str,
    scratch: &Scratch,
    range: (DateTime<Utc>, DateTime<Utc>),
    extra: &[&str],
) -> Command {
    let mut cmd = harness::almanac();
    cmd.args([
        "backfill",
        "hourly",
        "--from",
        &range.0.to_rfc3339(),
        "--to",
        &range.1.to_rfc3339(),
    ])
    .arg("--schedules")
    .arg(scratch.schedules())
    .args(extra)
    .env("DATABASE_URL", url);
    cmd
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn succeeded(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}: {}{}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn report(out: &Output) -> serde_json::Value {
    let line = succeeded(out);
    serde_json::from_str::<serde_json::Value>(&line).unwrap()["report"].clone()
}

/// `n` hourly runs in the past: the range and the logical runs.
async fn hours(pool: &PgPool, n: i64) -> ((DateTime<Utc>, DateTime<Utc>), Vec<String>) {
    let first: DateTime<Utc> =
        sqlx::query_scalar("SELECT date_trunc('hour', now()) - interval '300 hours'")
            .fetch_one(pool)
            .await
            .unwrap();
    let runs = (0..n)
        .map(|k| {
            (first + chrono::Duration::hours(k))
                .format("%Y-%m-%dT%H:%MZ")
                .to_string()
        })
        .collect();
    ((first, first + chrono::Duration::hours(n - 1)), runs)
}

async fn unfinished(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM almanac.jobs WHERE status IN ('ready', 'running')",
    )
    .await
}

async fn all_finished(pool: &PgPool, jobs: i64) -> Result<(), String> {
    let (total, open): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE status IN ('ready', 'running')) FROM almanac.jobs",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    if total == jobs && open == 0 {
        Ok(())
    } else {
        Err(format!("{total} jobs, {open} unfinished"))
    }
}

/// No logical run was executing twice at one instant.
fn assert_no_overlap(executions: &[(i64, String, i128, i128)]) {
    let mut by_run: HashMap<&str, Vec<(i128, i128, i64)>> = HashMap::new();
    for (id, run, start, end) in executions {
        by_run.entry(run).or_default().push((*start, *end, *id));
    }
    for (run, mut spans) in by_run {
        spans.sort();
        for pair in spans.windows(2) {
            assert!(
                pair[0].1 <= pair[1].0,
                "run {run}: job {} started before job {} ended",
                pair[1].2,
                pair[0].2
            );
        }
    }
}

/// Most executions in progress at one instant.
fn most_at_once(executions: &[(i64, String, i128, i128)]) -> usize {
    let mut events: Vec<(i128, i32)> = executions
        .iter()
        .flat_map(|e| [(e.2, 1), (e.3, -1)])
        .collect();
    events.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in events {
        now += d;
        most = most.max(now);
    }
    most as usize
}

fn times_executed(executions: &[(i64, String, i128, i128)]) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for (_, run, _, _) in executions {
        *out.entry(run.clone()).or_default() += 1;
    }
    out
}

/// 100 runs, 5 of them dead: `failed` emits exactly those 5 (two at once
/// still 5 in all), again while they are active emits nothing, retrying an
/// earlier dead job of a reprocessed run is refused, and the new jobs run.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn failed_reemits_exactly_the_dead_runs_once_however_often_it_is_run(pool: PgPool) {
    let url = harness::database_url(&pool);
    let scratch = Scratch::new("failed");
    let (range, runs) = hours(&pool, 100).await;
    let dead: Vec<String> = [7, 23, 42, 64, 88]
        .iter()
        .map(|&k| runs[k].clone())
        .collect();
    scratch.fail(&dead);

    let out = succeeded(&backfill(&url, &scratch, range, &[]).output().unwrap());
    assert!(out.contains("100 runs in range; emitted 100 new"), "{out}");
    {
        let _worker = Worker::start(&url, &scratch.handler("0"));
        eventually("the 100 jobs finished", Duration::from_secs(60), || {
            all_finished(&pool, 100)
        })
        .await;
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'dead'"
        )
        .await,
        5
    );
    scratch.fail(&[]);
    let old_dead: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM almanac.jobs WHERE status = 'dead' ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();

    // Two at once: 5 in all, one job per dead run.
    let a = backfill(&url, &scratch, range, &["--reprocess", "failed", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let b = backfill(&url, &scratch, range, &["--reprocess", "failed", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let (a, b) = (report(&a), report(&b));
    assert_eq!(
        a["reemitted_dead"].as_u64().unwrap() + b["reemitted_dead"].as_u64().unwrap(),
        5,
        "{a} {b}"
    );
    assert_eq!(a["reemitted_done"], 0);
    assert_eq!(a["emitted"], 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 105);
    assert_eq!(unfinished(&pool).await, 5);
    // The ledger points at the new jobs, keyed by run and job id; the dead
    // ones stay as history.
    let rows: Vec<(String, i64, String, String)> = sqlx::query_as(
        "SELECT r.logical_run, j.id, j.idempotency_key, j.status FROM almanac.schedule_runs r \
         JOIN almanac.jobs j ON j.id = r.job_id WHERE j.status <> 'done' ORDER BY r.logical_run",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 5);
    for ((run, id, key, status), want) in rows.iter().zip(&dead) {
        assert_eq!(run, want);
        assert_eq!(key, &format!("schedule:hourly:{run}#{id}"));
        assert_eq!(status, "ready");
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'dead'"
        )
        .await,
        5
    );

    // Again while they are active: nothing, said plainly.
    let out = succeeded(
        &backfill(&url, &scratch, range, &["--reprocess", "failed"])
            .output()
            .unwrap(),
    );
    assert!(out.contains("100 runs in range (--reprocess failed); nothing to reprocess (no run whose job is dead)"), "{out}");
    assert!(
        out.contains("100 with a job left as they were (5 still ready or running)"),
        "{out}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 105);

    // An earlier job of a reprocessed run is history: retrying it would
    // make two jobs of the run active.
    let retry = harness::almanac()
        .args(["jobs", "retry", &old_dead[0].to_string()])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert_eq!(retry.status.code(), Some(1));
    let err = text(&retry.stderr);
    assert!(
        err.contains(&format!("job {} is an earlier job of run {} of schedule `hourly`, which was reprocessed since (its job now is ", old_dead[0], dead[0]))
            && err.contains("--reprocess failed"),
        "{err}"
    );
    // The dashboard's "retry all" of the group leaves them dead too.
    let group = almanac::queue::browse::DeadFilter {
        kind: Some("hourly".into()),
        error: None,
    };
    let mut conn = pool.acquire().await.unwrap();
    let retried = almanac::queue::browse::retry_dead_matching(&mut conn, &group)
        .await
        .unwrap();
    assert_eq!(retried, 0);
    assert_eq!(unfinished(&pool).await, 5);

    let _worker = Worker::start(&url, &scratch.handler("0"));
    eventually("the 5 new jobs done", Duration::from_secs(60), || {
        all_finished(&pool, 105)
    })
    .await;
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.schedule_runs r JOIN almanac.jobs j ON j.id = r.job_id WHERE j.status = 'done'").await,
        100
    );
    let executions = scratch.executions();
    assert_no_overlap(&executions);
    let times = times_executed(&executions);
    assert_eq!(times.len(), 100);
    for run in &runs {
        assert_eq!(times[run], if dead.contains(run) { 2 } else { 1 }, "{run}");
    }
    let out = succeeded(
        &backfill(&url, &scratch, range, &["--reprocess", "failed"])
            .output()
            .unwrap(),
    );
    assert!(out.contains("nothing to reprocess"), "{out}");
}

/// `all` with a worker running: every run executes once more (including
/// one whose job retention deleted), never two executions of one run at
/// once; two `all` at once still never overlap a run's executions.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn all_runs_every_run_once_more_and_never_two_jobs_of_a_run_at_once(pool: PgPool) {
    let url = harness::database_url(&pool);
    let scratch = Scratch::new("all");
    let (range, runs) = hours(&pool, 30).await;
    let _worker = Worker::start(&url, &scratch.handler("0.05"));
    succeeded(&backfill(&url, &scratch, range, &[]).output().unwrap());
    eventually("the 30 jobs done", Duration::from_secs(60), || {
        all_finished(&pool, 30)
    })
    .await;
    // Retention deletes one run's job; the ledger keeps the run.
    sqlx::query("DELETE FROM almanac.jobs WHERE logical_run = $1")
        .bind(&runs[3])
        .execute(&pool)
        .await
        .unwrap();

    let r = report(
        &backfill(&url, &scratch, range, &["--reprocess", "all", "--json"])
            .output()
            .unwrap(),
    );
    assert_eq!(
        (
            r["reemitted_done"].as_u64(),
            r["reemitted_deleted"].as_u64(),
            r["emitted"].as_u64()
        ),
        (Some(29), Some(1), Some(0)),
        "{r}"
    );
    eventually("the 30 new jobs done", Duration::from_secs(60), || {
        all_finished(&pool, 59)
    })
    .await;
    let executions = scratch.executions();
    assert_no_overlap(&executions);
    let times = times_executed(&executions);
    for run in &runs {
        assert_eq!(times[run], 2, "{run} executed once more");
    }

    // Two at once, while the worker runs what the first emits.
    let a = backfill(&url, &scratch, range, &["--reprocess", "all", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let b = backfill(&url, &scratch, range, &["--reprocess", "all", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (a, b) = (
        report(&a.wait_with_output().unwrap()),
        report(&b.wait_with_output().unwrap()),
    );
    let again = |r: &serde_json::Value| {
        r["reemitted_done"].as_u64().unwrap() + r["reemitted_dead"].as_u64().unwrap()
    };
    let jobs = 59 + again(&a) + again(&b);
    eventually("every job done", Duration::from_secs(60), || {
        all_finished(&pool, jobs as i64)
    })
    .await;
    let executions = scratch.executions();
    assert_no_overlap(&executions);
    assert_eq!(
        executions.len() as u64,
        jobs + 1,
        "every job executed once (and the deleted one)"
    );
    let times = times_executed(&executions);
    for run in &runs {
        assert!((3..=4).contains(&times[run]), "{run}: {}", times[run]);
    }
    // The ledger points at each run's newest job.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.schedule_runs r WHERE r.job_id <> \
             (SELECT max(id) FROM almanac.jobs j WHERE j.schedule = r.schedule AND j.logical_run = r.logical_run)"
        )
        .await,
        0
    );
}

/// `--max-active 3`, with a worker that could run 8 at once: never more
/// than 3 of the range's jobs ready or running, in `missing` and `all`.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn max_active_caps_the_jobs_ready_or_running_at_once(pool: PgPool) {
    let url = harness::database_url(&pool);
    let scratch = Scratch::new("max-active");
    let (range, runs) = hours(&pool, 15).await;
    let _worker = Worker::start(&url, &scratch.handler("0.2"));
    for (mode, jobs) in [("missing", 15), ("all", 30)] {
        let mut child = backfill(
            &url,
            &scratch,
            range,
            &["--reprocess", mode, "--max-active", "3"],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let said = std::thread::spawn(move || {
            let mut s = String::new();
            stderr.read_to_string(&mut s).unwrap();
            s
        });
        let most = Arc::new(Mutex::new(0i64));
        let child = Arc::new(Mutex::new(child));
        eventually("the backfill to end", Duration::from_secs(90), || {
            let (pool, most, child) = (pool.clone(), most.clone(), child.clone());
            async move {
                let active = unfinished(&pool).await;
                let mut m = most.lock().unwrap();
                *m = (*m).max(active);
                child.lock().unwrap().try_wait().unwrap().is_some()
            }
        })
        .await;
        let status = child.lock().unwrap().wait().unwrap();
        let said = said.join().unwrap();
        assert!(status.success(), "{said}");
        assert!(
            *most.lock().unwrap() <= 3,
            "{mode}: {} active at once",
            most.lock().unwrap()
        );
        assert!(
            said.contains("waiting: 3 of at most 3 jobs ready or running (next run "),
            "{said}"
        );
        eventually("every job done", Duration::from_secs(60), || {
            all_finished(&pool, jobs)
        })
        .await;
        let executions = scratch.executions();
        assert_eq!(executions.len() as i64, jobs);
        let at_once = most_at_once(&executions);
        assert!(
            (1..=3).contains(&at_once),
            "{mode}: {at_once} executions at once"
        );
        assert_no_overlap(&executions);
    }
    let times = times_executed(&scratch.executions());
    assert!(runs.iter().all(|r| times[r] == 2));
}

/// Ctrl-C while waiting for a free slot: it says how far it got, exits
/// 130, and the same command run again emits the rest.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn an_interrupted_backfill_leaves_the_rest_and_the_same_command_continues(pool: PgPool) {
    let url = harness::database_url(&pool);
    let scratch = Scratch::new("interrupt");
    let (range, _) = hours(&pool, 6).await;
    let mut child = backfill(&url, &scratch, range, &["--max-active", "2"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let said = Arc::new(Mutex::new(Vec::new()));
    let sink = said.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    let waiting = || text(&said.lock().unwrap()).contains("waiting: 2 of at most 2");
    eventually(
        "the backfill waiting for a free slot",
        Duration::from_secs(30),
        || async { waiting() },
    )
    .await;
    // SAFETY: signals a child process this test spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    reader.join().unwrap();
    let said = text(&said.lock().unwrap());
    assert_eq!(status.code(), Some(130), "{said}");
    assert!(said.contains("hourly: interrupted after 2 of 6 runs; the rest were not emitted. Run the same command again to continue"), "{said}");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.schedule_runs").await,
        2
    );

    let _worker = Worker::start(&url, &scratch.handler("0"));
    let out = succeeded(
        &backfill(&url, &scratch, range, &["--max-active", "2"])
            .output()
            .unwrap(),
    );
    assert!(
        out.contains(
            "6 runs in range; emitted 4 new, emitted 0 previously skipped; 2 already emitted"
        ),
        "{out}"
    );
    eventually("6 jobs done", Duration::from_secs(60), || {
        all_finished(&pool, 6)
    })
    .await;
    assert_eq!(scratch.executions().len(), 6);
}

/// Bad flags are refused before anything is written, naming the fix.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn bad_reprocess_flags_are_refused_and_write_nothing(pool: PgPool) {
    let url = harness::database_url(&pool);
    let scratch = Scratch::new("bad");
    let (range, _) = hours(&pool, 3).await;
    let out = backfill(&url, &scratch, range, &["--reprocess", "sometimes"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("invalid value 'sometimes' for '--reprocess <REPROCESS>'")
            && err.contains("[possible values: missing, failed, all]"),
        "{err}"
    );
    for n in ["0", "many"] {
        let out = backfill(&url, &scratch, range, &["--max-active", n])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        let err = text(&out.stderr);
        assert!(
            err.contains(&format!("`{n}` is not a number of jobs; give 1 or more")),
            "{err}"
        );
    }
    for table in ["schedules", "schedule_runs", "jobs"] {
        assert_eq!(
            count(&pool, &format!("SELECT count(*) FROM almanac.{table}")).await,
            0,
            "{table}"
        );
    }
    // A dry run says what it would do and writes nothing either.
    let out = succeeded(
        &backfill(
            &url,
            &scratch,
            range,
            &["--reprocess", "failed", "--dry-run"],
        )
        .output()
        .unwrap(),
    );
    assert!(
        out.contains("dry run: hourly: 3 runs in range (--reprocess failed); nothing to reprocess"),
        "{out}"
    );
    assert!(
        out.contains("3 without a job (missing or skipped: --reprocess missing or all emits them)"),
        "{out}"
    );
}

/// Backends of this test's database waiting for a lock.
async fn waiting_for_a_lock(pool: &PgPool) -> bool {
    count(
        pool,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .await
        > 0
}

/// The lock protocol with the real functions on both sides, each held
/// mid-way inside an open transaction: a retry waits for a reprocess of
/// its run and is then refused (the run has a new job); a reprocess waits
/// for a retry of its run's job and then leaves the run alone (its job is
/// active again). Either way one job of the run is active.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_retry_and_a_reprocess_of_one_run_never_both_revive_it(pool: PgPool) {
    use almanac::scheduler::reprocess::{self, Options, Reprocess};
    use almanac::scheduler::{backfill, spec};
    use sqlx::Connection as _;

    let schedule =
        spec::load_sources(&[("h.toml".into(), "[hourly]\ncron = \"0 * * * *\"\n".into())])
            .unwrap()
            .remove(0);
    let ((from, to), _) = hours(&pool, 2).await;
    let range = backfill::Range {
        from,
        to: to + chrono::Duration::seconds(1),
        dry_run: false,
        allow_future: false,
    };
    let mut conn = pool.acquire().await.unwrap();
    backfill::backfill(&mut conn, &schedule, range, |_, _| {})
        .await
        .unwrap();
    let die = "UPDATE almanac.jobs SET status = 'dead', finished_at = now(), last_error = 'boom'";
    sqlx::query(die).execute(&pool).await.unwrap();
    let planned: Vec<almanac::scheduler::timeline::Run> =
        almanac::scheduler::plan::runs_in(&schedule, range.from, range.to, 10);
    let first: i64 =
        sqlx::query_scalar("SELECT job_id FROM almanac.schedule_runs ORDER BY fire_at LIMIT 1")
            .fetch_one(&pool)
            .await
            .unwrap();

    // A reprocess holds the first run's row: the retry waits, then is refused.
    let mut held = pool.acquire().await.unwrap();
    let mut tx = held.begin().await.unwrap();
    let replaced = reprocess::replace(
        &mut tx,
        &schedule,
        Reprocess::Failed,
        &[&planned[0]],
        &almanac::telemetry::Tracer::off(),
    )
    .await
    .unwrap();
    assert_eq!(replaced.dead, 1);
    let retry = tokio::spawn({
        let pool = pool.clone();
        async move { almanac::queue::retry(&mut pool.acquire().await.unwrap(), first).await }
    });
    eventually(
        "the retry waiting for the run's lock",
        Duration::from_secs(10),
        || waiting_for_a_lock(&pool),
    )
    .await;
    tx.commit().await.unwrap();
    match retry.await.unwrap() {
        Err(almanac::queue::QueueError::Superseded { id, current, .. }) => {
            assert_eq!(id, first);
            assert!(current.is_some_and(|c| c != first));
        }
        other => panic!("the retry of a superseded job went through: {other:?}"),
    }

    // A retry holds the second run's row: the reprocess waits, then leaves it.
    let second: i64 =
        sqlx::query_scalar("SELECT job_id FROM almanac.schedule_runs ORDER BY fire_at OFFSET 1")
            .fetch_one(&pool)
            .await
            .unwrap();
    let mut tx = held.begin().await.unwrap();
    almanac::queue::retry(&mut tx, second).await.unwrap();
    let reprocessing = tokio::spawn({
        let (pool, schedule) = (pool.clone(), schedule.clone());
        async move {
            let options = Options {
                reprocess: Reprocess::Failed,
                ..Default::default()
            };
            reprocess::run(
                &mut pool.acquire().await.unwrap(),
                &schedule,
                range,
                options,
                &almanac::telemetry::Tracer::off(),
                |_| {},
            )
            .await
        }
    });
    eventually(
        "the reprocess waiting for the run's lock",
        Duration::from_secs(10),
        || waiting_for_a_lock(&pool),
    )
    .await;
    tx.commit().await.unwrap();
    let report = reprocessing.await.unwrap().unwrap();
    assert_eq!(
        (
            report.reemitted_dead,
            report.already_emitted,
            report.still_active
        ),
        (0, 2, 1)
    );
    let active: Vec<(String, i64)> = sqlx::query_as(
        "SELECT logical_run, count(*) FROM almanac.jobs WHERE status IN ('ready', 'running') GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(active.len(), 2, "{active:?}");
    assert!(active.iter().all(|(_, n)| *n == 1), "{active:?}");
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 3);
}

/// The nodes of a JSON plan that scan a table of the queue sequentially.
fn seq_scans(plan: &serde_json::Value, out: &mut Vec<String>) {
    match plan {
        serde_json::Value::Object(node) => {
            if node.get("Node Type").and_then(|t| t.as_str()) == Some("Seq Scan") {
                let table = node
                    .get("Relation Name")
                    .and_then(|t| t.as_str())
                    .unwrap_or("");
                if table == "jobs" || table == "schedule_runs" {
                    out.push(table.to_string());
                }
            }
            node.values().for_each(|v| seq_scans(v, out));
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| seq_scans(v, out)),
        _ => {}
    }
}

/// Every statement a reprocess runs reads the ledger and the jobs through
/// an index, on 100,000 runs with done jobs: its cost follows the range,
/// not the history.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn reprocess_statements_use_indexes_on_a_long_history(pool: PgPool) {
    use almanac::scheduler::reprocess::{ACTIVE_IN_RANGE, FOUND_BETWEEN, LOCK_RUNS, REPLACE};
    let schedule = almanac::scheduler::spec::load_sources(&[(
        "h.toml".into(),
        "[big]\ncron = \"0 * * * *\"\n".into(),
    )])
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    almanac::scheduler::ledger::sync(&mut conn, &schedule, false)
        .await
        .unwrap();
    sqlx::raw_sql(
        r#"
        WITH j AS (
            INSERT INTO almanac.jobs (kind, status, finished_at, schedule, logical_run, idempotency_key)
            SELECT 'big', 'done', now(), 'big', 'r' || g, 'schedule:big:r' || g
              FROM generate_series(1, 100000) g
            RETURNING id, logical_run
        )
        INSERT INTO almanac.schedule_runs (schedule, logical_run, fire_at, job_id, source, outcome)
        SELECT 'big', logical_run, '2000-01-01T00:00:00Z'::timestamptz + substr(logical_run, 2)::int * interval '1 hour',
               id, 'tick', 'emitted'
          FROM j;
        ANALYZE almanac.jobs;
        ANALYZE almanac.schedule_runs;
        "#,
    )
    .execute(&pool)
    .await
    .unwrap();
    let runs: Vec<String> = (500..550).map(|g| format!("r{g}")).collect();
    let keys: Vec<String> = runs.iter().map(|r| format!("schedule:big:{r}")).collect();
    let from: DateTime<Utc> = "2000-01-21T20:00:00Z".parse().unwrap();
    let to = from + chrono::Duration::hours(50);
    let explain = |sql: &str| format!("EXPLAIN (FORMAT JSON) {sql}");
    let plans: Vec<(&str, serde_json::Value)> = vec![
        (
            "FOUND_BETWEEN",
            sqlx::query_scalar(&explain(FOUND_BETWEEN))
                .bind("big")
                .bind(from)
                .bind(to)
                .fetch_one(&pool)
                .await
                .unwrap(),
        ),
        (
            "ACTIVE_IN_RANGE",
            sqlx::query_scalar(&explain(ACTIVE_IN_RANGE))
                .bind("big")
                .bind(from)
                .bind(to)
                .fetch_one(&pool)
                .await
                .unwrap(),
        ),
        (
            "LOCK_RUNS",
            sqlx::query_scalar(&explain(LOCK_RUNS))
                .bind("big")
                .bind(&runs)
                .fetch_one(&pool)
                .await
                .unwrap(),
        ),
        (
            "REPLACE",
            sqlx::query_scalar(&explain(REPLACE))
                .bind("big")
                .bind(&runs)
                .bind(&keys)
                .bind(["dead", "done", "deleted"])
                .bind("big")
                .bind(serde_json::json!({}))
                .bind(5)
                .bind("almanac_jobs")
                .bind(0_i16)
                .bind(Vec::<Option<String>>::new())
                .fetch_one(&pool)
                .await
                .unwrap(),
        ),
    ];
    for (name, plan) in plans {
        let mut scans = Vec::new();
        seq_scans(&plan, &mut scans);
        assert!(
            scans.is_empty(),
            "{name} scans {scans:?} sequentially: {plan:#}"
        );
    }
}

/// A run whose job an operator cancelled is not a failure: `failed` leaves
/// it, `all` replaces it (and says so), once.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_cancelled_run_is_replaced_by_all_only(pool: PgPool) {
    let url = harness::database_url(&pool);
    let scratch = Scratch::new("cancelled");
    let (range, _runs) = hours(&pool, 4).await;
    succeeded(&backfill(&url, &scratch, range, &[]).output().unwrap());
    // Of the four jobs: one cancelled, one dead, two done.
    sqlx::raw_sql(
        "UPDATE almanac.jobs SET status = 'done', finished_at = now();
         UPDATE almanac.jobs SET status = 'cancelled', cancelled_by = 'ops (cli)'
          WHERE id = (SELECT min(id) FROM almanac.jobs);
         UPDATE almanac.jobs SET status = 'dead'
          WHERE id = (SELECT max(id) FROM almanac.jobs);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let failed = report(
        &backfill(&url, &scratch, range, &["--reprocess", "failed", "--json"])
            .output()
            .unwrap(),
    );
    assert_eq!(
        (
            failed["reemitted_dead"].as_u64(),
            failed["reemitted_cancelled"].as_u64()
        ),
        (Some(1), Some(0))
    );
    let all = report(
        &backfill(&url, &scratch, range, &["--reprocess", "all", "--json"])
            .output()
            .unwrap(),
    );
    assert_eq!(
        (
            all["reemitted_cancelled"].as_u64(),
            all["reemitted_done"].as_u64(),
            all["still_active"].as_u64()
        ),
        (Some(1), Some(2), Some(1)),
        "{all}"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'ready'"
        )
        .await,
        4,
        "one active job per run"
    );
}
