//! Job commands whose worker cannot act, with real `almanac work` processes:
//! a worker SIGSTOPped mid-job (its command must end before the lease can
//! run out, and never overlap the next worker's run of the job), and one
//! SIGKILLed (its command ends with it). The watchdog of
//! src/worker/watchdog.rs does both.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use almanac::maintenance::{Reaper, ReaperConfig};
use almanac::queue::{self, JobStatus, NewJob};
use almanac::role::{Role, Settings};
use almanac::worker::{lease_margin, watchdog};
use chrono::{DateTime, TimeDelta, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::scheduler_proc::Proc;
use crate::harness::{self, eventually};

fn scratch(test: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("almanac-exec-faults-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `almanac work` running `command` for kind `writer`, one job at a time.
fn worker(pool: &PgPool, command: &str, lease: &str) -> Proc {
    let mut cmd = harness::almanac();
    cmd.args(["work", "--handler"])
        .arg(format!("writer={command}"))
        .args(["--lease", lease, "--concurrency", "1"])
        .args(["--poll-interval", "100ms", "--shutdown-deadline", "2s"])
        .env("DATABASE_URL", harness::database_url(pool))
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null());
    Proc::spawn(cmd)
}

/// The lines `ATTEMPT SECONDS.NANOS` a command appended to `log`, by attempt.
fn writes(log: &Path) -> Vec<(i32, DateTime<Utc>)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let (attempt, at) = line.split_once(' ')?;
            let (secs, nanos) = at.split_once('.')?;
            let at = DateTime::from_timestamp(secs.parse().ok()?, nanos.parse().ok()?)?;
            Some((attempt.parse().ok()?, at))
        })
        .collect()
}

fn of_attempt(writes: &[(i32, DateTime<Utc>)], attempt: i32) -> Vec<DateTime<Utc>> {
    writes
        .iter()
        .filter(|(a, _)| *a == attempt)
        .map(|(_, at)| *at)
        .collect()
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

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_stopped_worker_s_command_ends_before_its_lease_and_never_overlaps_the_next_run(
    pool: PgPool,
) {
    let lease = Duration::from_secs(3);
    let dir = scratch("stopped");
    let (log, pids) = (dir.join("log"), dir.join("pid"));
    // The first attempt writes for 20 s, far past its lease; the second for 1 s.
    let command = format!(
        "echo $$ > {pids}.$ALMANAC_ATTEMPT; n=10; [ \"$ALMANAC_ATTEMPT\" = 1 ] && n=200; i=0; \
         while [ $i -lt $n ]; do echo \"$ALMANAC_ATTEMPT $(date +%s.%N)\" >> {log}; i=$((i+1)); sleep 0.1; done",
        pids = pids.display(),
        log = log.display(),
    );
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("writer").max_attempts(3))
        .await
        .unwrap()
        .id();
    let first = worker(&pool, &command, "3s");

    // Running for more than a lease: renewals reach the watchdog.
    eventually(
        "the first command to run past its first lease",
        Duration::from_secs(30),
        || async {
            let first = of_attempt(&writes(&log), 1);
            match (first.first(), first.last()) {
                (Some(a), Some(b)) => (*b - *a).to_std().unwrap() > lease + lease / 6,
                _ => false,
            }
        },
    )
    .await;
    let sh = read_pid(&dir.join("pid.1")).unwrap();
    first.signal(libc::SIGSTOP);

    eventually(
        "the watchdog to kill the stopped worker's command",
        lease * 2,
        || async move { gone(sh) },
    )
    .await;
    // The worker is stopped: nothing renews this lease any more.
    let (status, lease_until): (String, DateTime<Utc>) =
        sqlx::query_as("SELECT status, lease_until FROM almanac.jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(status, "running");
    let last = *of_attempt(&writes(&log), 1).last().unwrap();
    // Dead by `sent + lease - margin + grace`, and `lease_until >= sent +
    // lease`: half a margin (300 ms) before `lease_until`; 200 ms of it for
    // scheduling.
    let bound = lease_margin(lease) - watchdog::grace(lease_margin(lease));
    let before = (lease_until - last).to_std().unwrap_or_default();
    eprintln!(
        "the stopped worker's command wrote last {before:?} before lease_until (bound {bound:?})"
    );
    assert!(
        last < lease_until - TimeDelta::milliseconds(100),
        "last write {last}, lease_until {lease_until}"
    );

    // Elsewhere: a reaper, and a second worker that takes the job over.
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
    let second = worker(&pool, &command, "3s");
    eventually(
        "the second run to finish the job",
        Duration::from_secs(30),
        || async { queue::get(&pool, id).await.unwrap().status == JobStatus::Done },
    )
    .await;
    let all = writes(&log);
    let (ran1, ran2) = (of_attempt(&all, 1), of_attempt(&all, 2));
    assert_eq!(
        ran2.len(),
        10,
        "the second run wrote all its lines: {all:?}"
    );
    assert!(
        ran1.last().unwrap() < ran2.first().unwrap(),
        "the runs overlap: first until {}, second from {}",
        ran1.last().unwrap(),
        ran2.first().unwrap()
    );
    assert!(first.said(&format!(
        "almanac watchdog: job {id}: the lease deadline passed without a renewal"
    )));

    // The stopped worker resumes, finds its lease lost, records nothing, and
    // shuts down cleanly.
    first.signal(libc::SIGCONT);
    eventually(
        "the resumed worker to see its lease lost",
        Duration::from_secs(20),
        || async { first.said("lease lost") },
    )
    .await;
    first.signal(libc::SIGTERM);
    second.signal(libc::SIGTERM);
    let log1 = first.log();
    assert_eq!(first.exit_code().await, Some(0), "{log1}");
    assert_eq!(second.exit_code().await, Some(0));
    stop.cancel();
    reaper.await.unwrap().unwrap();
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!((job.status, job.attempts), (JobStatus::Done, 2));
    assert_eq!(of_attempt(&writes(&log), 1).len(), ran1.len());
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_killed_worker_s_command_ends_with_it(pool: PgPool) {
    let dir = scratch("killed");
    let (log, sh, child) = (dir.join("log"), dir.join("sh"), dir.join("child"));
    // A background child too: the whole group ends.
    let command = format!(
        "echo $$ > {sh}; sleep 600 & echo $! > {child}; \
         while :; do echo \"1 $(date +%s.%N)\" >> {log}; sleep 0.1; done",
        sh = sh.display(),
        child = child.display(),
        log = log.display(),
    );
    let mut conn = pool.acquire().await.unwrap();
    queue::enqueue(&mut conn, &NewJob::new("writer"))
        .await
        .unwrap();
    // The default lease: its deadline is 24 s away, so only the closed pipe
    // can end the command in time.
    let lease = Duration::from_secs(30);
    let running = worker(&pool, &command, "30s");
    eventually("the command to write", Duration::from_secs(30), || async {
        writes(&log).len() >= 3 && read_pid(&child).is_some()
    })
    .await;
    let (sh, child) = (read_pid(&sh).unwrap(), read_pid(&child).unwrap());
    running.signal(libc::SIGKILL);
    let killed_at = Utc::now();
    let grace = watchdog::grace(lease_margin(lease));
    eventually(
        "the command and its child to end",
        grace + Duration::from_secs(5),
        || async move { gone(sh) && gone(child) },
    )
    .await;
    let last = *of_attempt(&writes(&log), 1).last().unwrap();
    eprintln!(
        "the killed worker's command wrote last {:?} after the kill (bound {grace:?})",
        (last - killed_at).to_std().unwrap_or_default()
    );
    assert!(
        last <= killed_at + TimeDelta::from_std(grace).unwrap() + TimeDelta::milliseconds(250),
        "last write {last}, worker killed at {killed_at}"
    );
    assert!(
        running.said("the worker closed the pipe"),
        "{}",
        running.log()
    );
    assert_eq!(running.exit_code().await, None, "killed by SIGKILL");
}
