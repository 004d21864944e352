//! Leadership: one scheduler emits at a time, and the server decides when a
//! silent leader is gone.
//!
//! The leader holds `pg_try_advisory_lock(LEADER_LOCK_KEY)` on a dedicated
//! connection (the **lock session**) for the whole of its leadership, and
//! emits through that same connection: when the session ends, the lock is
//! gone and so is the leader's ability to write. Standbys retry the lock
//! every `standby_retry`.
//!
//! **The lock session is the leader's only voice, and PostgreSQL judges it.**
//! With `timeout` = T (`--leader-timeout`, default 10 s) the session starts
//! with
//!
//! - `idle_session_timeout` = T and `idle_in_transaction_session_timeout` = T:
//!   the server ends the session once the leader has said nothing for T,
//!   whether it froze between statements or inside a transaction (which is
//!   rolled back);
//! - `statement_timeout` = T: no statement of the leader runs longer;
//! - `tcp_user_timeout` = T and TCP keepalives (idle T/3, interval T/9,
//!   3 probes): a peer that vanished from the network is dropped in about T
//!   even while the server has something to send.
//!
//! The leader speaks at least every `min(max_sleep, T/3)`: each tick starts
//! with [`Leadership::heartbeat`], which reads the database's `now()` (the
//! only clock the scheduler plans by), and checks that the same backend still
//! holds the lock. Every statement on the session also runs under a client
//! timeout of T (a tick's recording step, several statements each bounded
//! on the server by T/4, under one of 2T: see [`super::ticker`]), so a leader on a frozen or partitioned connection gives up
//! on its own within T: any failure or timeout ends the leadership at once
//! (the connection is dropped, nothing more is written) and the scheduler
//! goes back to standing by.
//!
//! **Takeover time.** A leader that goes silent (SIGSTOP, a hung host, a
//! half-open network) has its session ended by the server at most T after its
//! last statement finished, or at most 2T after the freeze if a statement was
//! in flight (it may run for T, then the idle timeout runs). The next standby
//! try then wins: takeover within **T + `standby_retry`** in the usual case
//! and **2T + `standby_retry`** at worst (plus a connection set-up), i.e.
//! about 12 s and at most 22 s with the defaults. A killed process or a
//! terminated backend (`pg_terminate_backend`) frees the lock at once, so
//! takeover is within `standby_retry`. The old leader, meanwhile, stops
//! emitting as soon as a statement fails or times out, at most T later; even
//! if its bytes reach the server after a thaw, they arrive on a session the
//! server has already ended.
//!
//! **Limit.** Session advisory locks need a session: behind PgBouncer in
//! transaction-pooling mode, consecutive statements may run on different
//! server connections and the lock means nothing. The heartbeat detects this
//! (the backend pid changes between statements) and refuses to lead; point
//! the scheduler at PostgreSQL directly or at a session-pooling port (PgBouncer
//! must also pass the startup `options` through, or refuse the connection).
//! PostgreSQL 14 or later is needed for `idle_session_timeout`. Even with two
//! leaders no run could be emitted twice: emission is keyed by logical run in
//! the ledger (see [`super::ledger`]).

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

/// "almanac" in ASCII, then 01.
pub const LEADER_LOCK_KEY: i64 = 0x616c_6d61_6e61_6301;

/// The `application_name` of the lock session (and of standbys' tries).
pub const APPLICATION_NAME: &str = "almanac-scheduler";

#[derive(Debug, thiserror::Error)]
pub enum LeaderLost {
    #[error("the leader connection failed: {0}")]
    Connection(#[from] sqlx::Error),
    #[error("the leader connection did not answer within {0:?}; treating it as gone")]
    Timeout(Duration),
    #[error("statements ran on backend {now} after the lock was taken on backend {then}: a transaction-pooling proxy (PgBouncer?) sits in between, and session advisory locks do not work through it; connect the scheduler to PostgreSQL directly or through session pooling")]
    BackendChanged { then: i32, now: i32 },
    #[error("the advisory lock is no longer held by this session")]
    LockGone,
}

/// Runs `fut` under the client-side timeout `limit`.
pub async fn within<T, E>(
    limit: Duration,
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, LeaderLost>
where
    LeaderLost: From<E>,
{
    match tokio::time::timeout(limit, fut).await {
        Ok(result) => result.map_err(LeaderLost::from),
        Err(_) => Err(LeaderLost::Timeout(limit)),
    }
}

/// The lock session's settings for a silence timeout of `timeout`.
pub fn session_options(options: &PgConnectOptions, timeout: Duration) -> PgConnectOptions {
    let ms = timeout.as_millis().max(1).to_string();
    let secs = |fraction: u64| (timeout.as_secs() / fraction).max(1).to_string();
    options.clone().application_name(APPLICATION_NAME).options([
        ("idle_session_timeout", ms.as_str()),
        ("idle_in_transaction_session_timeout", ms.as_str()),
        ("statement_timeout", ms.as_str()),
        ("tcp_user_timeout", ms.as_str()),
        ("tcp_keepalives_idle", secs(3).as_str()),
        ("tcp_keepalives_interval", secs(9).as_str()),
        ("tcp_keepalives_count", "3"),
    ])
}

pub struct Leadership {
    conn: PgConnection,
    pid: i32,
    timeout: Duration,
}

impl Leadership {
    /// Opens a lock session and tries the lock once, all within `timeout`.
    pub async fn try_acquire(
        options: &PgConnectOptions,
        timeout: Duration,
    ) -> Result<Option<Leadership>, LeaderLost> {
        let options = session_options(options, timeout);
        within(timeout, async {
            let mut conn = PgConnection::connect_with(&options).await?;
            let (locked, pid): (bool, i32) =
                sqlx::query_as("SELECT pg_try_advisory_lock($1), pg_backend_pid()")
                    .bind(LEADER_LOCK_KEY)
                    .fetch_one(&mut conn)
                    .await?;
            if locked {
                Ok::<_, sqlx::Error>(Some(Leadership { conn, pid, timeout }))
            } else {
                let _ = conn.close().await;
                Ok(None)
            }
        })
        .await
    }

    /// The backend pid of the lock session (what `pg_stat_activity` and
    /// `pg_locks` show for the leader).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The client-side limit on every statement of the session.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Speaks on the lock session: still the leader (same backend, lock
    /// held, connection alive)? Returns the database's `now()`.
    pub async fn heartbeat(&mut self) -> Result<DateTime<Utc>, LeaderLost> {
        let (pid, held, now): (i32, bool, DateTime<Utc>) = within(
            self.timeout,
            sqlx::query_as(
                r#"
                SELECT pg_backend_pid(), EXISTS (
                    SELECT 1 FROM pg_locks
                    WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
                      AND classid = ($1 >> 32)::oid AND objid = ($1 & 4294967295)::oid
                      AND objsubid = 1), now()
                "#,
            )
            .bind(LEADER_LOCK_KEY)
            .fetch_one(&mut self.conn),
        )
        .await?;
        if pid != self.pid {
            return Err(LeaderLost::BackendChanged {
                then: self.pid,
                now: pid,
            });
        }
        if !held {
            return Err(LeaderLost::LockGone);
        }
        Ok(now)
    }

    /// The connection that holds the lock; the leader writes through it,
    /// each statement under [`within`]`(self.timeout(), ..)`.
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    /// Gives the lock back (at shutdown).
    pub async fn release(mut self) {
        let _ = within(
            self.timeout,
            sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(LEADER_LOCK_KEY)
                .execute(&mut self.conn),
        )
        .await;
        let _ = tokio::time::timeout(self.timeout, self.conn.close()).await;
    }
}
