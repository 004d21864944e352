//! `bench --scale`'s disk check, before anything is written: the bytes the
//! largest size takes (an estimate per job row and per ledger row, indexes
//! included, measured by this bench with a margin, plus room for WAL and
//! the burn-downs) against the free space of the PostgreSQL data directory
//! (`data_directory` from `pg_settings`, `statvfs` of it). The free space
//! is known only when the server runs on this machine (a loopback host or a
//! Unix socket, and the directory visible here); otherwise the check says
//! so and the run goes on.

use anyhow::Context as _;
use serde::Serialize;
use sqlx::postgres::PgConnectOptions;
use sqlx::Connection;

/// Bytes per background job, its indexes and outbox share included
/// (measured: about 240 at 1,000,000; see
/// docs/speed.md), with a margin.
const BYTES_PER_JOB: u64 = 600;
/// Bytes per ledger row with its indexes (measured: about 290), with a
/// margin.
const BYTES_PER_LEDGER_ROW: u64 = 450;
/// WAL written while filling, and the measurements' own jobs.
const HEADROOM: u64 = 2 << 30;

#[derive(Debug, Serialize)]
pub struct Check {
    pub needed_bytes: u64,
    /// None: the data directory is not on this machine, or not readable.
    pub free_bytes: Option<u64>,
    pub data_directory: Option<String>,
}

impl Check {
    pub fn line(&self) -> String {
        match (self.free_bytes, &self.data_directory) {
            (Some(free), Some(dir)) => format!(
                "disk: about {} needed, {} free in {dir}",
                gb(self.needed_bytes),
                gb(free)
            ),
            _ => format!(
                "disk: about {} needed; the free space of the server's data directory could not be known (not on this machine), not checked",
                gb(self.needed_bytes)
            ),
        }
    }
}

fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

/// Refuses a `largest` that does not fit, naming the bytes needed and free.
pub async fn check(base: &PgConnectOptions, largest: u64) -> anyhow::Result<Check> {
    let needed = largest
        .saturating_mul(BYTES_PER_JOB)
        .saturating_add((largest / 10).saturating_mul(BYTES_PER_LEDGER_ROW))
        .saturating_add(HEADROOM);
    let mut conn = sqlx::PgConnection::connect_with(&base.clone().database("postgres"))
        .await
        .context("connecting to the server's `postgres` database (for the disk check and the scratch database)")?;
    let dir: Option<String> =
        sqlx::query_scalar("SELECT setting FROM pg_settings WHERE name = 'data_directory'")
            .fetch_optional(&mut conn)
            .await?;
    conn.close().await.ok();
    let host = base.get_host();
    let local = host.starts_with('/') || matches!(host, "localhost" | "127.0.0.1" | "::1");
    let free = dir.as_deref().filter(|_| local).and_then(free_bytes);
    let check = Check {
        needed_bytes: needed,
        free_bytes: free,
        data_directory: dir,
    };
    if let (Some(free), Some(dir)) = (check.free_bytes, &check.data_directory) {
        anyhow::ensure!(
            needed <= free,
            "--scale up to {largest} jobs needs about {} of disk ({BYTES_PER_JOB} bytes per job, {BYTES_PER_LEDGER_ROW} per ledger row, {} for WAL), but PostgreSQL's data directory {dir} has {} free; give smaller sizes or free space. Nothing was written",
            gb(needed),
            gb(HEADROOM),
            gb(free)
        );
    }
    eprintln!("{}", check.line());
    Ok(check)
}

/// Free bytes for an unprivileged user on the file system of `path`.
fn free_bytes(path: &str) -> Option<u64> {
    let path = std::ffi::CString::new(path).ok()?;
    // SAFETY: `path` is NUL-terminated and outlives the call; `stat` is a
    // plain C struct that statvfs(3) fills in.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut stat) };
    (rc == 0).then(|| (stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}
