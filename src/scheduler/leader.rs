//! Leadership: one scheduler emits at a time.
//!
//! The leader holds `pg_try_advisory_lock(LEADER_LOCK_KEY)` on a dedicated
//! connection for the whole of its leadership, and emits through that same
//! connection: if the connection fails, the lock is gone and so is the
//! leader's ability to write. Before every tick the leader checks that the
//! connection still answers, from the same backend, holding the lock; if not,
//! it stops emitting at once and goes back to standing by. Standbys retry the
//! lock every few seconds; PostgreSQL drops a killed leader's session lock as
//! soon as it notices the dead connection.
//!
//! **Limit.** Session advisory locks need a session: behind PgBouncer in
//! transaction-pooling mode, consecutive statements may run on different
//! server connections and the lock means nothing. The check detects this (the
//! backend pid changes between statements) and refuses to lead; point the
//! scheduler at PostgreSQL directly or at a session-pooling port. Even then,
//! two leaders could not emit a run twice: emission is keyed by logical run
//! in the ledger (see [`super::ledger`]).

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

/// "almanac" in ASCII, then 01.
pub const LEADER_LOCK_KEY: i64 = 0x616c_6d61_6e61_6301;

#[derive(Debug, thiserror::Error)]
pub enum LeaderLost {
    #[error("the leader connection failed: {0}")]
    Connection(#[from] sqlx::Error),
    #[error("statements ran on backend {now} after the lock was taken on backend {then}: a transaction-pooling proxy (PgBouncer?) sits in between, and session advisory locks do not work through it; connect the scheduler to PostgreSQL directly or through session pooling")]
    BackendChanged { then: i32, now: i32 },
    #[error("the advisory lock is no longer held by this session")]
    LockGone,
}

pub struct Leadership {
    conn: PgConnection,
    pid: i32,
}

impl Leadership {
    /// Opens a dedicated connection and tries the lock once.
    pub async fn try_acquire(
        options: &PgConnectOptions,
    ) -> Result<Option<Leadership>, sqlx::Error> {
        let options = options.clone().application_name("almanac-scheduler");
        let mut conn = PgConnection::connect_with(&options).await?;
        let (locked, pid): (bool, i32) =
            sqlx::query_as("SELECT pg_try_advisory_lock($1), pg_backend_pid()")
                .bind(LEADER_LOCK_KEY)
                .fetch_one(&mut conn)
                .await?;
        if locked {
            Ok(Some(Leadership { conn, pid }))
        } else {
            let _ = conn.close().await;
            Ok(None)
        }
    }

    /// Still the leader? Same backend, lock still held, connection alive.
    pub async fn check(&mut self) -> Result<(), LeaderLost> {
        let (pid, held): (i32, bool) = sqlx::query_as(
            r#"
            SELECT pg_backend_pid(), EXISTS (
                SELECT 1 FROM pg_locks
                WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
                  AND classid = ($1 >> 32)::oid AND objid = ($1 & 4294967295)::oid AND objsubid = 1)
            "#,
        )
        .bind(LEADER_LOCK_KEY)
        .fetch_one(&mut self.conn)
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
        Ok(())
    }

    /// The connection that holds the lock; the leader writes through it.
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    pub async fn release(mut self) {
        let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(LEADER_LOCK_KEY)
            .execute(&mut self.conn)
            .await;
        let _ = self.conn.close().await;
    }
}
