//! The exec handler: one shell command per job, so almanac is useful without
//! writing Rust.
//!
//! The command runs under `sh -c` in its own process group, with the payload
//! JSON on stdin and a clean environment: only the allow-list [`ALLOWED_ENV`]
//! (`PATH`, `HOME`, `LANG`, `TZ`) taken from the service's own, the names
//! given with [`ExecHandler::pass_env`] (`--pass-env NAME`), and the job's
//! variables:
//!
//! | variable | value |
//! | --- | --- |
//! | `ALMANAC_JOB_ID`, `ALMANAC_KIND` | the job |
//! | `ALMANAC_ATTEMPT`, `ALMANAC_MAX_ATTEMPTS` | this attempt (from 1), and the most it gets |
//! | `ALMANAC_IDEMPOTENCY_KEY` | the key to pass on, so a re-run has no second effect |
//! | `ALMANAC_LOGICAL_RUN`, `ALMANAC_SCHEDULE` | for scheduled jobs only |
//! | `ALMANAC_LEASE_TOKEN` | this attempt's lease token, to fence writes with |
//! | `TRACEPARENT` | the W3C trace context of this attempt's `almanac.execute` span when tracing is on ([`crate::telemetry`]), else the `traceparent` the job was enqueued with; unset when neither exists |
//! | `ALMANAC_LEASE_DEADLINE` | `lease_until` as the claim set it, RFC 3339 UTC on the database's clock; renewals move it every third of the lease, and without them the command is killed a fifth of the lease before it |
//!
//! A command that writes to the job's database fences a write by locking
//! its own lease in the same transaction: `SELECT 1 FROM almanac.jobs WHERE
//! id = $ALMANAC_JOB_ID AND lease_token = $ALMANAC_LEASE_TOKEN AND status =
//! 'running' AND lease_until > clock_timestamp() FOR KEY SHARE` returns no
//! row once the lease is lost, and while it is held the reaper (which locks
//! `FOR UPDATE`) cannot take the job back before the transaction ends. Key
//! share, not share: the worker's lease renewals and completion lock the
//! row `FOR NO KEY UPDATE`, which a share lock would block.
//!
//! The service's connection strings (`DATABASE_URL`, `ALMANAC_AMQP_URL`, ...)
//! never reach a command unless named with `--pass-env`. Its stdout passes
//! through.
//!
//! | the command | the job |
//! | --- | --- |
//! | exits 0 | done |
//! | exits 65 (`EX_DATAERR`) | dead at once |
//! | exits 75 (`EX_TEMPFAIL`) after writing the line `almanac-snooze: 30s` to stderr | snoozed: `ready` again 30 s later, its attempt given back ([`HandlerError::Snooze`]; the delay is a duration as in the config, `500ms`, `5m`, `1h30m`; the last such line counts) |
//! | exits 75 without a valid `almanac-snooze:` line | retried with backoff, with `last_error` saying what was wrong |
//! | exits otherwise, is killed by a signal, or runs past the timeout | retried with backoff, dead after `max_attempts` |
//!
//! An operator's cancel (`almanac jobs cancel`) kills the whole process group
//! at once, and the job ends `cancelled` (`done`, should the command have
//! exited 0 first).
//!
//! **The command ends when its shell ends.** When `sh` exits, whatever it
//! left in its process group (`sleep 600 &`) is killed with it; so is the
//! whole group on a timeout, a lost lease or a shutdown past its deadline. A
//! process that left the group (`setsid`) is out of reach, so stderr is read
//! for at most [`STDERR_GRACE`] after the shell ended. The last few KiB of
//! stderr become `last_error`.
//!
//! **The command cannot outlive its lease, even when the worker can't act.**
//! The group is led by a [`watchdog`] process, started before the command,
//! which the worker tells each renewed local lease deadline. When the
//! deadline passes unrenewed, or the worker's pipe closes because it died,
//! the watchdog kills the group on its own (SIGTERM, SIGKILL after half the
//! lease margin), so a worker that is stopped (SIGSTOP, a debugger) or
//! killed cannot leave its command running into the next worker's run of the
//! job. What stays out of reach (a process that left the group, a machine or
//! container frozen whole) is in the [`watchdog`] module doc. The watchdog is
//! the almanac binary itself ([`ExecHandler::watchdog`]).

use std::convert::Infallible;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use super::{watchdog, Handler, HandlerError, HandlerFuture, JobContext};

/// The exit status that buries a job at once (sysexits' `EX_DATAERR`).
pub const EXIT_PERMANENT: i32 = 65;
/// The exit status that snoozes a job (sysexits' `EX_TEMPFAIL`), with a
/// [`SNOOZE_PREFIX`] line on stderr naming the delay.
pub const EXIT_SNOOZE: i32 = 75;
/// The stderr line that names a snooze's delay: `almanac-snooze: 30s`.
pub const SNOOZE_PREFIX: &str = "almanac-snooze:";
const STDERR_TAIL: usize = 4096;
/// How long stderr is read after the command's process group is gone.
pub const STDERR_GRACE: Duration = Duration::from_secs(1);
/// The service's variables every command gets (when they are set).
pub const ALLOWED_ENV: [&str; 4] = ["PATH", "HOME", "LANG", "TZ"];

#[derive(Debug, Clone)]
pub struct ExecHandler {
    command: String,
    timeout: Option<Duration>,
    pass_env: Arc<[String]>,
    watchdog: Option<PathBuf>,
}

impl ExecHandler {
    pub fn new(command: impl Into<String>) -> Self {
        ExecHandler {
            command: command.into(),
            timeout: None,
            pass_env: Arc::new([]),
            watchdog: None,
        }
    }

    /// The almanac binary that runs each command's watchdog
    /// ([`watchdog`]); by default [`watchdog::default_program`]: this
    /// process when it is almanac, else an `almanac` beside it or on `PATH`.
    pub fn watchdog(mut self, almanac: impl Into<PathBuf>) -> Self {
        self.watchdog = Some(almanac.into());
        self
    }

    /// Kill the command and retry the job when it runs longer than this.
    pub fn timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// Passes these variables of the service's environment on to the
    /// command, besides [`ALLOWED_ENV`].
    pub fn pass_env(mut self, names: impl IntoIterator<Item = String>) -> Self {
        self.pass_env = names.into_iter().collect();
        self
    }

    async fn run(self, ctx: JobContext) -> Result<(), HandlerError> {
        let job = &ctx.job;
        let program: &Path = match &self.watchdog {
            Some(program) => program,
            None => watchdog::default_program()
                .ok_or_else(|| HandlerError::retry(ExecError::NoWatchdog))?,
        };
        // The watchdog first, as the leader of the group the command joins,
        // so the command never runs unwatched.
        let mut deadlines = ctx.deadlines();
        let first = *deadlines.borrow_and_update();
        let mut watcher = start_watchdog(program, first, &ctx)
            .map_err(|e| HandlerError::retry(ExecError::Watchdog(e.to_string())))?;
        let mut renewals = watcher.stdin.take().expect("the watchdog's stdin is piped");
        // Declared after the pipe, so dropped (the group killed) before the
        // pipe closes, even when this future is dropped half-way: the
        // watchdog never takes our own ending for a dead worker.
        let group = GroupKill::of(&watcher)?;

        let mut command = Command::new("sh");
        command.env_clear();
        for name in ALLOWED_ENV
            .iter()
            .copied()
            .chain(self.pass_env.iter().map(String::as_str))
        {
            if let Some(value) = std::env::var_os(name) {
                command.env(name, value);
            }
        }
        command
            .arg("-c")
            .arg(&self.command)
            .stdin(Stdio::piped())
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .env("ALMANAC_JOB_ID", job.id.to_string())
            .env("ALMANAC_KIND", &job.kind)
            .env("ALMANAC_ATTEMPT", job.attempts.to_string())
            .env("ALMANAC_MAX_ATTEMPTS", job.max_attempts.to_string())
            .env("ALMANAC_IDEMPOTENCY_KEY", job.effective_idempotency_key())
            .process_group(group.0)
            .kill_on_drop(true);
        let lease = [
            (
                "ALMANAC_LEASE_TOKEN",
                job.lease_token.map(|t| t.to_string()),
            ),
            (
                "ALMANAC_LEASE_DEADLINE",
                job.lease_until
                    .map(|at| at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)),
            ),
        ];
        for (name, value) in [
            ("ALMANAC_LOGICAL_RUN", job.logical_run.clone()),
            ("ALMANAC_SCHEDULE", job.schedule.clone()),
            (crate::telemetry::TRACEPARENT_ENV, ctx.traceparent()),
        ]
        .into_iter()
        .chain(lease)
        {
            if let Some(value) = value {
                command.env(name, value);
            }
        }
        let mut child = command
            .spawn()
            .map_err(|e| HandlerError::retry(ExecError::Spawn(e.to_string())))?;

        let mut stdin = child.stdin.take().expect("stdin is piped");
        let payload = serde_json::to_vec(&job.payload).unwrap_or_default();
        // A command that never reads stdin closes the pipe: that is fine.
        let feed = tokio::spawn(async move {
            let _ = stdin.write_all(&payload).await;
        });
        let mut stderr = child.stderr.take().expect("stderr is piped");
        // The tail is shared so that what arrived is kept even when reading
        // is cut short.
        let tail = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut reader = tokio::spawn({
            let tail = tail.clone();
            async move {
                let mut buf = [0u8; 8192];
                while let Ok(n) = stderr.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    let mut tail = tail.lock().expect("stderr tail lock");
                    tail.extend_from_slice(&buf[..n]);
                    if tail.len() > STDERR_TAIL {
                        let excess = tail.len() - STDERR_TAIL;
                        tail.drain(..excess);
                    }
                }
            }
        });
        // Each renewal's deadline goes to the watchdog. The pipe stays open
        // after the last one: its closing tells the watchdog to kill.
        let forward = async {
            while deadlines.changed().await.is_ok() {
                let at = watchdog::on_clock(*deadlines.borrow_and_update());
                if renewals
                    .write_all(format!("{at}\n").as_bytes())
                    .await
                    .is_err()
                {
                    break;
                }
            }
            std::future::pending::<Infallible>().await
        };
        tokio::pin!(forward);

        let timeout = async {
            match self.timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        let ended = tokio::select! {
            status = child.wait() => status.map_err(|e| ExecError::Spawn(e.to_string())),
            _ = ctx.cancelled() => Err(if ctx.cancel_requested() {
                ExecError::CancelRequested
            } else {
                ExecError::Cancelled
            }),
            _ = timeout => Err(ExecError::TimedOut(self.timeout.unwrap_or_default())),
            status = watcher.wait() => Err(ExecError::Watchdog(match status {
                Ok(status) => format!("it ended ({status}) before the command"),
                Err(e) => e.to_string(),
            })),
            never = &mut forward => match never {},
        };
        // The shell is gone or is to go: so is everything in its group, the
        // watchdog included.
        drop(group);
        feed.abort();
        if ended.is_err() {
            let _ = child.wait().await;
        }
        reap(watcher).await;
        if tokio::time::timeout(STDERR_GRACE, &mut reader)
            .await
            .is_err()
        {
            // A process outside the group still holds the pipe.
            reader.abort();
        }
        let stderr = {
            let tail = tail.lock().expect("stderr tail lock");
            String::from_utf8_lossy(&tail).trim().to_string()
        };
        match ended {
            Ok(status) => classify(status, stderr),
            Err(reason) => Err(HandlerError::retry(reason)),
        }
    }
}

/// Starts the watchdog of `ctx`'s command, armed with its first deadline, as
/// the leader of a new process group.
fn start_watchdog(
    program: &Path,
    first: tokio::time::Instant,
    ctx: &JobContext,
) -> std::io::Result<Child> {
    Command::new(program)
        .arg0("almanac")
        .arg(watchdog::SUBCOMMAND)
        .arg(watchdog::on_clock(first).to_string())
        .arg(watchdog::grace(ctx.lease_margin()).as_millis().to_string())
        .arg(ctx.job.id.to_string())
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
}

/// Waits for the killed watchdog, briefly: until it is reaped its pid, the
/// group's id, cannot be reused, which is why this comes after the group
/// kill. (One that does not go at once is reaped by tokio in the background.)
async fn reap(mut watchdog: Child) {
    let _ = tokio::time::timeout(STDERR_GRACE, watchdog.wait()).await;
}

fn classify(status: ExitStatus, stderr: String) -> Result<(), HandlerError> {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(0), _) => Ok(()),
        (Some(EXIT_PERMANENT), _) => Err(HandlerError::permanent(ExecError::Exit {
            code: EXIT_PERMANENT,
            stderr,
        })),
        (Some(EXIT_SNOOZE), _) => match snooze_delay(&stderr) {
            Ok(after) => Err(HandlerError::snooze(after)),
            Err(problem) => Err(HandlerError::retry(ExecError::BadSnooze {
                problem,
                stderr,
            })),
        },
        (Some(code), _) => Err(HandlerError::retry(ExecError::Exit { code, stderr })),
        (None, signal) => Err(HandlerError::retry(ExecError::Signal {
            signal: signal.unwrap_or(0),
            stderr,
        })),
    }
}

/// The delay named by the last [`SNOOZE_PREFIX`] line of `stderr`.
fn snooze_delay(stderr: &str) -> Result<Duration, String> {
    let line = stderr
        .lines()
        .rev()
        .find_map(|line| line.trim().strip_prefix(SNOOZE_PREFIX))
        .ok_or_else(|| format!("no `{SNOOZE_PREFIX} DELAY` line on stderr"))?;
    line.trim()
        .parse::<crate::config::HumanDuration>()
        .map(|d| d.0)
        .map_err(|e| format!("bad `{SNOOZE_PREFIX}` line: {e}"))
}

impl Handler for ExecHandler {
    fn call(&self, ctx: JobContext) -> HandlerFuture {
        Box::pin(self.clone().run(ctx))
    }
}

/// Kills the command's whole process group when dropped: `sh -c` may have
/// children that a kill of `sh` alone would leave running, and a command that
/// ends leaves nothing behind. The group is the watchdog's (its leader).
struct GroupKill(i32);

impl GroupKill {
    /// The group `watchdog` leads.
    fn of(watchdog: &Child) -> Result<GroupKill, HandlerError> {
        watchdog
            .id()
            .and_then(|pid| i32::try_from(pid).ok())
            .filter(|pid| *pid > 0)
            .map(GroupKill)
            .ok_or_else(|| {
                HandlerError::retry(ExecError::Watchdog("it ended as soon as it started".into()))
            })
    }
}

impl Drop for GroupKill {
    fn drop(&mut self) {
        // SAFETY: kill(2) with a negative pid signals the process group we
        // created with process_group(0) for the watchdog; it touches no memory.
        unsafe {
            libc::kill(-self.0, libc::SIGKILL);
        }
    }
}

#[derive(Debug)]
pub enum ExecError {
    Spawn(String),
    Exit {
        code: i32,
        stderr: String,
    },
    Signal {
        signal: i32,
        stderr: String,
    },
    TimedOut(Duration),
    Cancelled,
    /// An operator cancelled the job.
    CancelRequested,
    /// Exited [`EXIT_SNOOZE`] without a valid delay line.
    BadSnooze {
        problem: String,
        stderr: String,
    },
    /// No almanac binary to run the watchdog with.
    NoWatchdog,
    /// The watchdog could not start, or ended before the command.
    Watchdog(String),
}

impl fmt::Display for ExecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let with_stderr = |f: &mut fmt::Formatter<'_>, stderr: &str| {
            if stderr.is_empty() {
                Ok(())
            } else {
                write!(f, "; stderr: {stderr}")
            }
        };
        match self {
            ExecError::Spawn(e) => write!(f, "could not start the command with sh -c: {e}"),
            ExecError::Exit { code, stderr } => {
                write!(f, "command exited with status {code}")?;
                with_stderr(f, stderr)
            }
            ExecError::Signal { signal, stderr } => {
                write!(f, "command was killed by signal {signal}")?;
                with_stderr(f, stderr)
            }
            ExecError::TimedOut(t) => {
                write!(f, "command ran past its timeout of {t:?} and was killed")
            }
            ExecError::NoWatchdog => write!(
                f,
                "found no almanac binary to run the command's watchdog with; put almanac on PATH or name it with ExecHandler::watchdog"
            ),
            ExecError::Watchdog(e) => write!(
                f,
                "the command's watchdog failed, so the command was killed: {e}"
            ),
            ExecError::Cancelled => {
                write!(
                    f,
                    "command killed: its lease was lost or the worker shut down"
                )
            }
            ExecError::CancelRequested => {
                write!(f, "command killed: an operator cancelled the job")
            }
            ExecError::BadSnooze { problem, stderr } => {
                write!(
                    f,
                    "command exited with status {EXIT_SNOOZE} (snooze) but {problem}, so it counts as a failed attempt; to snooze, write e.g. `{SNOOZE_PREFIX} 30s` to stderr before exiting {EXIT_SNOOZE}"
                )?;
                with_stderr(f, stderr)
            }
        }
    }
}

impl std::error::Error for ExecError {}

/// Checks a name given to `--pass-env`: a variable name, not `NAME=value`.
pub fn parse_env_name(name: &str) -> Result<String, String> {
    let mut chars = name.chars();
    let valid = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if valid {
        Ok(name.to_string())
    } else {
        Err(format!(
            "`{name}` is not an environment variable name; give the name only, e.g. --pass-env API_TOKEN (its value is taken from almanac's environment)"
        ))
    }
}

/// Parses `KIND=COMMAND` as given to `--handler`.
pub fn parse_handler_spec(spec: &str) -> Result<(String, String), String> {
    match spec.split_once('=') {
        Some((kind, command)) if !kind.trim().is_empty() && !command.trim().is_empty() => {
            Ok((kind.trim().to_string(), command.to_string()))
        }
        _ => Err(format!(
            "`{spec}` is not KIND=COMMAND; write e.g. --handler 'send_email=./bin/send-email'"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snooze_names_its_delay_on_its_last_line() {
        assert_eq!(
            snooze_delay("working\nalmanac-snooze: 1h30m\n"),
            Ok(Duration::from_secs(5400))
        );
        assert_eq!(
            snooze_delay("almanac-snooze: 1s\n  almanac-snooze: 250ms  "),
            Ok(Duration::from_millis(250))
        );
        assert_eq!(
            snooze_delay("busy, try later"),
            Err("no `almanac-snooze: DELAY` line on stderr".to_string())
        );
        let bad = snooze_delay("almanac-snooze: soon").unwrap_err();
        assert!(
            bad.starts_with("bad `almanac-snooze:` line: `soon` is not a duration"),
            "{bad}"
        );
    }
}
