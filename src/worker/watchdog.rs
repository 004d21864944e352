//! The watchdog: a small process beside every job command that kills the
//! command's process group when the worker stops renewing its lease, even
//! when the worker itself can no longer do it.
//!
//! The [`executor`](super::executor) cancels a handler at its local lease
//! deadline, and the exec handler then kills the command's group; but a
//! worker that is stopped (SIGSTOP, a debugger, a paused container) runs
//! none of that, and one that died kills nothing. So each command gets a
//! watchdog that is not the worker:
//!
//! - **Shape.** The exec handler starts `almanac __watchdog DEADLINE GRACE
//!   JOB` as the leader of a new process group, then `sh -c COMMAND` in that
//!   same group: the group lives as long as its watchdog, so the watchdog
//!   signals exactly the command's group (`kill(0, ...)`), never a reused
//!   process group id. The worker still spawns, feeds and waits for `sh`
//!   itself: stdin, stdout, stderr and the exit status are untouched. When
//!   `sh` ends, the worker kills the group, watchdog included, as before.
//! - **What it enforces.** The executor's local lease deadline,
//!   `sent + lease - margin` ([`super::JobContext::deadlines`]): the worker
//!   writes each new deadline to the watchdog's stdin, one line per renewal.
//!   When that deadline passes without a newer one, or the pipe closes (the
//!   worker exited or was killed), the watchdog sends SIGTERM to the group,
//!   waits [`grace`] (half the lease margin, at most a second) and sends
//!   SIGKILL, which ends the watchdog too. So a command is dead by
//!   `sent + lease - margin / 2` at the latest: half a margin or more (0.5 s
//!   with a 5 s lease, 5 s with the default 30 s) before the lease can
//!   expire on the database's clock and the reaper hand the job to another
//!   worker. The two runs do not overlap.
//! - **Absolute deadlines.** A line carries the deadline as an instant on
//!   the watchdog clock (milliseconds of `CLOCK_BOOTTIME` on Linux, which
//!   keeps counting while the machine is suspended; `CLOCK_MONOTONIC`
//!   elsewhere), not as "time left": a worker stopped between computing a
//!   line and writing it delivers a deadline already past, never a fresh
//!   extension. The watchdog looks at least every [`TICK`], so a machine
//!   woken from suspend past the deadline kills within that.
//! - **Small.** It is the almanac binary itself (no separate file to
//!   install), dispatched in `main` before any runtime starts: one thread
//!   reading lines, one waiting on a channel. Its cost is a process start
//!   per job (about 4 ms of CPU for a debug build) and a few megabytes of
//!   private memory while the command runs (6 MB for a debug build; its
//!   code pages are the worker's, shared).
//!
//! **Where it stops.**
//! - A process that leaves the group (`setsid`, a double fork into a new
//!   group) is out of its reach, as it is out of the worker's.
//! - Whatever stops the worker and the watchdog together: a frozen cgroup
//!   (`docker pause`), a paused VM, a stopped machine. Then nothing on that
//!   machine runs, the command included, until it resumes; what protects
//!   the job then is the database: the lease expires, the reaper hands the
//!   job on, and the old run's writes are refused wherever they are fenced
//!   with its lease token (`ALMANAC_LEASE_TOKEN`). On resume the watchdog
//!   kills at once (the deadline has passed on its clock), but the command
//!   may get a few instructions in first.
//! - A watchdog killed by someone else: the worker notices (its exit ends
//!   the job's run with an error and the group is killed) while the worker
//!   runs; a worker stopped at the same time is the case above.
//! - A wall clock that jumps does not move the deadline (both clocks here
//!   are monotonic); a database whose clock jumps forward can expire a lease
//!   early, which no local measure prevents.

use std::ffi::OsString;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{mpsc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

/// The hidden subcommand the watchdog runs under: `almanac __watchdog ...`.
pub const SUBCOMMAND: &str = "__watchdog";

/// The longest the watchdog waits before looking at its clock again.
pub const TICK: Duration = Duration::from_millis(200);

/// How long the group gets between SIGTERM and SIGKILL: half the lease
/// margin, so the command is dead half a margin before the lease can
/// expire; at most a second.
pub fn grace(margin: Duration) -> Duration {
    (margin / 2).min(Duration::from_secs(1))
}

#[cfg(target_os = "linux")]
const CLOCK: libc::clockid_t = libc::CLOCK_BOOTTIME;
#[cfg(not(target_os = "linux"))]
const CLOCK: libc::clockid_t = libc::CLOCK_MONOTONIC;

/// The watchdog clock now, in milliseconds.
fn clock_ms() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass and nothing else.
    unsafe { libc::clock_gettime(CLOCK, &mut now) };
    let (secs, nanos) = (now.tv_sec.max(0) as u64, now.tv_nsec.max(0) as u64);
    secs.saturating_mul(1000).saturating_add(nanos / 1_000_000)
}

/// `at` as milliseconds on the watchdog clock (now, when `at` has passed);
/// rounded down, so never later than `at`.
pub fn on_clock(at: Instant) -> u64 {
    let left = at.saturating_duration_since(Instant::now());
    clock_ms().saturating_add(u64::try_from(left.as_millis()).unwrap_or(u64::MAX))
}

/// This process's own executable as a path that keeps working when the file
/// is replaced (an upgrade while workers run): `/proc/self/exe` on Linux.
pub fn this_executable() -> PathBuf {
    let proc = Path::new("/proc/self/exe");
    if proc.exists() {
        return proc.to_path_buf();
    }
    std::env::current_exe().unwrap_or_else(|_| PathBuf::from("almanac"))
}

/// The almanac binary that runs watchdogs when none was named: this
/// process's own executable when it is `almanac`; else an `almanac` beside
/// it or one directory up (cargo's `target/debug/deps/` layout, for tests);
/// else the first on `PATH`. Looked up once.
pub fn default_program() -> Option<&'static Path> {
    static FOUND: OnceLock<Option<PathBuf>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let exe = std::env::current_exe().ok();
            if let Some(exe) = &exe {
                if exe.file_stem().is_some_and(|stem| stem == "almanac") {
                    return Some(this_executable());
                }
                let dir = exe.parent();
                let near = [dir, dir.and_then(Path::parent)];
                if let Some(found) = near
                    .into_iter()
                    .flatten()
                    .map(|d| d.join("almanac"))
                    .find(|p| p.is_file())
                {
                    return Some(found);
                }
            }
            let path = std::env::var_os("PATH")?;
            std::env::split_paths(&path)
                .map(|d| d.join("almanac"))
                .find(|p| p.is_file())
        })
        .as_deref()
}

/// Runs the watchdog when this process was started as one (`almanac
/// __watchdog DEADLINE_MS GRACE_MS JOB`); `None` otherwise. `main` calls it
/// first, before any runtime starts.
pub fn main_if_called() -> Option<ExitCode> {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    if args.first().is_none_or(|a| a != SUBCOMMAND) {
        return None;
    }
    let number = |i: usize| args.get(i).and_then(|a| a.to_str()?.parse::<u64>().ok());
    let (Some(deadline), Some(grace_ms)) = (number(1), number(2)) else {
        eprintln!(
            "almanac {SUBCOMMAND} is started by the exec handler: DEADLINE_MS GRACE_MS JOB, deadlines on stdin"
        );
        return Some(ExitCode::from(2));
    };
    let job = args
        .get(3)
        .map(|a| a.to_string_lossy().into_owned())
        .unwrap_or_default();
    Some(watch(deadline, Duration::from_millis(grace_ms), &job))
}

/// What the reader thread saw on stdin.
enum Line {
    Deadline(u64),
    Garbled,
    Closed,
}

fn watch(mut deadline: u64, grace: Duration, job: &str) -> ExitCode {
    // SAFETY: ignoring SIGTERM (and SIGHUP, should the group be orphaned)
    // only changes this process's dispositions: the watchdog sends SIGTERM
    // to its own group, itself included, and must outlive the grace.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
    let (lines, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let line = match line.map(|l| l.trim().parse::<u64>()) {
                Ok(Ok(at)) => Line::Deadline(at),
                Ok(Err(_)) => Line::Garbled,
                Err(_) => break,
            };
            if lines.send(line).is_err() {
                return;
            }
        }
        let _ = lines.send(Line::Closed);
    });
    let reason = loop {
        let now = clock_ms();
        if now >= deadline {
            break "the lease deadline passed without a renewal (the worker is stopped or stuck)";
        }
        let wait = Duration::from_millis(deadline - now).min(TICK);
        match rx.recv_timeout(wait) {
            Ok(Line::Deadline(at)) => deadline = at,
            Ok(Line::Garbled) => break "a deadline it could not read came from the worker",
            Ok(Line::Closed) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                break "the worker closed the pipe (it exited or was killed)"
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    };
    eprintln!("almanac watchdog: job {job}: {reason}; killing the command's process group");
    signal_group(libc::SIGTERM);
    std::thread::sleep(grace);
    // The watchdog is in the group: this ends it as well.
    signal_group(libc::SIGKILL);
    ExitCode::FAILURE
}

fn signal_group(signal: libc::c_int) {
    // SAFETY: kill(2) with pid 0 signals this process's own group: the
    // command's, which the exec handler made with this process as leader.
    unsafe {
        libc::kill(0, signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grace_is_half_the_margin_and_at_most_a_second() {
        assert_eq!(grace(Duration::from_secs(1)), Duration::from_millis(500));
        assert_eq!(grace(Duration::from_secs(6)), Duration::from_secs(1));
        assert_eq!(grace(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn a_deadline_on_the_watchdog_clock_is_never_later_than_the_instant() {
        let before = clock_ms();
        let at = on_clock(Instant::now() + Duration::from_secs(5));
        let after = clock_ms();
        assert!(
            at >= before + 4_990 && at <= after + 5_000,
            "{before} {at} {after}"
        );
        // A deadline that has passed is now.
        let past = on_clock(Instant::now() - Duration::from_secs(1));
        assert!(past >= after && past <= clock_ms());
    }
}
