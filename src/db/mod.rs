//! Connecting to PostgreSQL and applying the schema.
//!
//! [`connect`] creates the database named in the URL when it does not exist
//! yet, so `almanac migrate` works on a fresh server. Errors name the host,
//! port, database and user, never the password: [`Target`] is the only form in
//! which a connection string reaches a message or a log line.

use std::fmt;
use std::str::FromStr;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

pub mod schema;

pub use schema::SchemaState;

/// The migrations in `migrations/`, embedded in the binary: the frozen
/// baseline and the migrations after it ([`schema`] says how they are
/// judged; start-up runs them through [`schema::migrator`]).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Where a connection goes, without its secrets.
#[derive(Debug, Clone)]
pub struct Target {
    pub host: String,
    pub port: u16,
    pub database: String,
    pub user: String,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "database \"{}\" on {}:{} as user \"{}\"",
            self.database, self.host, self.port, self.user
        )
    }
}

impl Target {
    pub fn of(options: &PgConnectOptions) -> Self {
        Target {
            host: options.get_host().to_string(),
            port: options.get_port(),
            database: options.get_database().unwrap_or("(default)").to_string(),
            user: options.get_username().to_string(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("DATABASE_URL is not a valid PostgreSQL URL ({reason}); expected postgres://USER[:PASSWORD]@HOST:PORT/DATABASE")]
    BadUrl { reason: String },
    #[error("cannot connect to {target} ({source}); is PostgreSQL running there, and is DATABASE_URL (or --database-url) right?")]
    Connect {
        target: Target,
        #[source]
        source: sqlx::Error,
    },
    #[error("{target} does not exist and could not be created: {source}")]
    Create {
        target: Target,
        #[source]
        source: sqlx::Error,
    },
    #[error("{target}: {reason}")]
    Schema { target: Target, reason: String },
    #[error("applying migrations to {target} failed: {source}")]
    Migrate {
        target: Target,
        #[source]
        source: Box<sqlx::migrate::MigrateError>,
    },
}

/// Parses a URL; the error never repeats the URL (it may hold a password).
pub fn parse_url(url: &str) -> Result<PgConnectOptions, DbError> {
    PgConnectOptions::from_str(url).map_err(|e| DbError::BadUrl {
        reason: crate::redact::redact_in(&e.to_string(), url),
    })
}

/// Connects a pool, creating the database first when it does not exist.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, DbError> {
    connect_with(parse_url(url)?.application_name("almanac"), max_connections).await
}

/// As [`connect`], from parsed options.
pub async fn connect_with(
    options: PgConnectOptions,
    max_connections: u32,
) -> Result<PgPool, DbError> {
    let target = Target::of(&options);
    ensure_database(&options, &target).await?;
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(|source| DbError::Connect { target, source })
}

/// Connects and applies every pending migration.
pub async fn connect_and_migrate(url: &str, max_connections: u32) -> Result<PgPool, DbError> {
    let pool = connect(url, max_connections).await?;
    migrate(&pool).await?;
    Ok(pool)
}

/// Applies every pending migration, after recording a pre-release schema as
/// the baseline; refuses, naming the reason, a database this build cannot
/// stand on ([`schema`]), and applies nothing then. A database a newer
/// release migrated is used as it is, with a warning.
pub async fn migrate(pool: &PgPool) -> Result<(), DbError> {
    let target = || Target::of(&pool.connect_options());
    let checked = |source: sqlx::Error| DbError::Migrate {
        target: target(),
        source: Box::new(sqlx::migrate::MigrateError::Execute(source)),
    };
    schema::adopt(pool).await.map_err(checked)?;
    let state = schema::state(pool).await.map_err(checked)?;
    match &state {
        SchemaState::Foreign { reason } => {
            return Err(DbError::Schema {
                target: target(),
                reason: reason.clone(),
            })
        }
        SchemaState::Ahead { .. } => {
            if let Some(warning) = state.warning() {
                tracing::warn!(target = %target(), "{warning}");
            }
            return Ok(());
        }
        _ => {}
    }
    schema::migrator()
        .run(pool)
        .await
        .map_err(|source| DbError::Migrate {
            target: target(),
            source: Box::new(source),
        })
}

async fn ensure_database(options: &PgConnectOptions, target: &Target) -> Result<(), DbError> {
    match options.connect().await {
        Ok(conn) => {
            let _ = conn.close().await;
            Ok(())
        }
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("3D000") => {
            let name = options.get_database().unwrap_or_default().to_string();
            let maintenance = options.clone().database("postgres");
            let mut conn = PgConnection::connect_with(&maintenance)
                .await
                .map_err(|source| DbError::Connect {
                    target: Target::of(&maintenance),
                    source,
                })?;
            let sql = format!("CREATE DATABASE \"{}\"", name.replace('"', "\"\""));
            let created = sqlx::query(&sql).execute(&mut conn).await;
            let _ = conn.close().await;
            match created {
                Ok(_) => {
                    tracing::info!(database = %name, "created database");
                    Ok(())
                }
                // Another process created it between our two connections.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => Ok(()),
                Err(source) => Err(DbError::Create {
                    target: target.clone(),
                    source,
                }),
            }
        }
        Err(source) => Err(DbError::Connect {
            target: target.clone(),
            source,
        }),
    }
}

/// A connection of its own, outside any pool, kept across statements by a
/// loop that runs one statement after another (the worker's claims, the
/// outcome recorder's writes). A statement sent through a sqlx pool pays a
/// ping when the connection is taken and another when it is given back, so
/// on these paths a pool would triple the round trips per statement.
///
/// After an error, or a statement abandoned half-way (a timeout), call
/// [`Held::discard`]: the connection's state is unknown, and the next
/// [`Held::get`] connects afresh.
///
/// The server ends a statement of this connection after `deadline` (and a
/// wait for a lock likewise), and drops the connection when the network
/// stays silent that long: the caller gives up on a statement after the
/// same deadline, so a statement it abandoned (a claim stuck behind a lock,
/// say) rolls back on the server instead of committing leases nobody holds,
/// and abandoned connections do not pile up.
///
/// Each statement is planned for its own values (`plan_cache_mode =
/// force_custom_plan`), never by a generic plan kept for the connection's
/// life. A generic plan is made once, from the statistics of that moment:
/// a worker that started on an empty `almanac.jobs` completed its batches
/// with a sequential scan of the table and a hash join, which stayed the
/// plan as the table grew (5,000 jobs a second fell to 180 within two
/// minutes of inserts at 10,000 a second; `almanac bench
/// --retention-only`). The worker's claim connection is the exception
/// ([`Held::generic_index_plans`]): planning the claim for every batch cost
/// about a fifth of the runtime's throughput and doubled LISTEN latency
/// (p50 2.7-3.2 ms against 1.2-1.3 ms, `almanac bench --scale 0,1000000`),
/// and its generic plan alone read the grown table too (936 sequential
/// scans in `tests/it/worker.rs`), so it keeps generic plans with
/// sequential scans off.
pub struct Held {
    options: PgConnectOptions,
    deadline: Duration,
    lock_wait: Duration,
    custom_plans: bool,
    conn: Option<PgConnection>,
}

impl Held {
    /// Connects lazily with the pool's own options (same server, user,
    /// database and application name).
    pub fn of(pool: &PgPool, deadline: Duration) -> Self {
        Held {
            options: (*pool.connect_options()).clone(),
            deadline,
            lock_wait: deadline,
            custom_plans: true,
            conn: None,
        }
    }

    /// Row and other lock waits end after `wait` instead of the deadline:
    /// for writers that would rather skip a busy row than wait for it.
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait.min(self.deadline);
        self
    }

    /// Statements keep a generic plan (PostgreSQL's default) but never scan
    /// a table sequentially (`enable_seqscan = off`): for a connection whose
    /// every statement is a walk of index ranges with a limit (the worker's
    /// claim), so no plan made from an empty table's statistics reads the
    /// grown table, and the statement is not planned for every batch.
    pub fn generic_index_plans(mut self) -> Self {
        self.custom_plans = false;
        self
    }

    /// The connection, connecting first if there is none.
    pub async fn get(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        if self.conn.is_none() {
            let mut conn = PgConnection::connect_with(&self.options).await?;
            bound_by(&mut conn, self.deadline, self.lock_wait, self.custom_plans).await?;
            self.conn = Some(conn);
        }
        Ok(self.conn.as_mut().expect("connected above"))
    }

    /// Drops the connection; the next [`Held::get`] reconnects.
    pub fn discard(&mut self) {
        self.conn = None;
    }
}

/// Gives a session the server-side limits [`Held`] describes: statements
/// end after `deadline`, lock waits after `lock_wait`, and a silent network
/// drops the connection after `deadline`. Set after connecting, not as
/// startup options: poolers such as PgBouncer refuse those.
async fn bound_by(
    conn: &mut PgConnection,
    deadline: Duration,
    lock_wait: Duration,
    custom_plans: bool,
) -> Result<(), sqlx::Error> {
    let ms = deadline.as_millis().max(1);
    let idle = (deadline.as_secs() / 3).max(1);
    sqlx::query(
        "SELECT set_config('statement_timeout', $1, false), \
                set_config('lock_timeout', $3, false), \
                set_config('tcp_user_timeout', $1, false), \
                set_config('tcp_keepalives_idle', $2, false), \
                set_config('tcp_keepalives_interval', $2, false), \
                set_config('tcp_keepalives_count', '3', false), \
                set_config('plan_cache_mode', CASE WHEN $4 THEN 'force_custom_plan' ELSE current_setting('plan_cache_mode') END, false), \
                set_config('enable_seqscan', CASE WHEN $4 THEN current_setting('enable_seqscan') ELSE 'off' END, false)",
    )
    .bind(ms.to_string())
    .bind(idle.to_string())
    .bind(lock_wait.as_millis().max(1).to_string())
    .bind(custom_plans)
    .execute(conn)
    .await?;
    Ok(())
}

/// A pool of up to `max` connections like `pool`'s (same server, user,
/// database, application name), each bound by `deadline` as [`Held`]'s is,
/// and waited for at most `acquire`: for statements whose caller gives up
/// some time after `deadline` (a broker consumer's claims), so a statement
/// it abandoned has already rolled back on the server.
pub fn bounded_pool(pool: &PgPool, deadline: Duration, acquire: Duration, max: u32) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max.max(1))
        .acquire_timeout(acquire)
        .after_connect(move |conn, _| Box::pin(bound_by(conn, deadline, deadline, true)))
        .connect_lazy_with((*pool.connect_options()).clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_url_error_never_shows_the_password() {
        let err = parse_url("postgres://app:hunter2@db:notaport/x").unwrap_err();
        let text = err.to_string();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("DATABASE_URL"), "{text}");
    }

    #[test]
    fn target_names_host_database_and_user_only() {
        let options = parse_url("postgres://app:hunter2@db.internal:6543/orders").unwrap();
        let text = Target::of(&options).to_string();
        assert_eq!(
            text,
            "database \"orders\" on db.internal:6543 as user \"app\""
        );
    }
}
