//! Helpers shared by the integration tests: polling with a deadline, the
//! `almanac` binary in a clean environment, an execution log table, and the
//! URL of a `#[sqlx::test]` database.

pub mod brokers;
pub mod http;
pub mod proxy;
pub mod scheduler_proc;

use std::future::Future;
use std::process::Command;
use std::time::{Duration, Instant};

use sqlx::PgPool;

/// Polls `check` until it holds; panics naming `what` after `deadline`. The
/// pause between checks grows from 10 ms to 250 ms so that a long wait does
/// not load the database it is watching. `check` answers `true`/`false`, or
/// `Ok(())`/`Err(why not yet)`: the last `why` is in the panic message.
pub async fn eventually<F, Fut>(what: &str, deadline: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future,
    Fut::Output: Condition,
{
    let start = Instant::now();
    let mut pause = Duration::from_millis(10);
    loop {
        let why_not = match check().await.holds() {
            Ok(()) => return,
            Err(why_not) => why_not,
        };
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}{}",
            if why_not.is_empty() {
                String::new()
            } else {
                format!(": {why_not}")
            }
        );
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}

/// What an [`eventually`] check answers.
pub trait Condition {
    fn holds(self) -> Result<(), String>;
}

impl Condition for bool {
    fn holds(self) -> Result<(), String> {
        if self {
            Ok(())
        } else {
            Err(String::new())
        }
    }
}

impl Condition for Result<(), String> {
    fn holds(self) -> Result<(), String> {
        self
    }
}

/// The `almanac` binary, as every test starts it: none of the test
/// process's `ALMANAC_*` variables (a developer's exported settings, or
/// `ALMANAC_TEST_*`) reaches it, it logs at `RUST_LOG=warn`, and its HTTP
/// endpoint is off (`ALMANAC_HTTP_ADDR=off`). All tests run in one process,
/// at the same time: only the README front-door test (tests/it/ops.rs)
/// takes the default port 127.0.0.1:9797, by removing that variable; a test
/// that wants the endpoint passes `--http-addr` (a flag beats the variable).
/// Tests add their own arguments and variables, `RUST_LOG` included.
pub fn almanac() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_almanac"));
    for (key, _) in std::env::vars_os() {
        let key_text = key.to_string_lossy();
        if key_text.starts_with("ALMANAC_") || key_text.starts_with("OTEL_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("RUST_LOG", "warn").env("ALMANAC_HTTP_ADDR", "off");
    cmd
}

/// Runs the `almanac` CLI on `pool`'s database as the OS user `night-ops`
/// (the actor its audit rows name), with no terminal on stdin.
pub fn operator(pool: &PgPool, args: &[&str]) -> std::process::Output {
    almanac()
        .args(args)
        .env("DATABASE_URL", database_url(pool))
        .env("USER", "night-ops")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

/// A TCP port free on 127.0.0.1 when asked.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A command's output as a person reads it: UTF-8, trimmed.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_string()
}

/// A table where handlers record each execution, to prove exactly-once.
pub async fn create_exec_log(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE exec_log (job_id bigint NOT NULL, attempt int NOT NULL, worker int NOT NULL DEFAULT 0,
                                at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(pool)
    .await
    .unwrap();
}

pub async fn log_exec(pool: &PgPool, job_id: i64, attempt: i32, worker: i32) {
    sqlx::query("INSERT INTO exec_log (job_id, attempt, worker) VALUES ($1, $2, $3)")
        .bind(job_id)
        .bind(attempt)
        .bind(worker)
        .execute(pool)
        .await
        .unwrap();
}

pub async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// The URL of the database behind a `#[sqlx::test]` pool, for child processes.
pub fn database_url(pool: &PgPool) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL is set by .cargo/config.toml");
    let options = pool.connect_options();
    let db = options.get_database().expect("test database name");
    let (prefix, _) = base
        .rsplit_once('/')
        .expect("DATABASE_URL has a database path");
    format!("{prefix}/{db}")
}

/// A pool of its own on the same test database.
pub async fn another_pool(pool: &PgPool, max_connections: u32) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap()
}

/// A pool for the test's own bookkeeping (the execution log): commits skip the
/// WAL flush wait, which is the test's cost, not the queue's.
pub async fn log_pool(pool: &PgPool, max_connections: u32) -> PgPool {
    let options = (*pool.connect_options())
        .clone()
        .options([("synchronous_commit", "off")]);
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .unwrap()
}

/// A handler that records each execution in `exec_log` as `worker`.
pub fn logging_handler(
    pool: PgPool,
    worker: i32,
) -> impl Fn(
    almanac::worker::JobContext,
) -> std::pin::Pin<
    Box<dyn Future<Output = Result<(), almanac::worker::HandlerError>> + Send>,
> + Send
       + Sync
       + 'static {
    move |ctx: almanac::worker::JobContext| {
        let pool = pool.clone();
        Box::pin(async move {
            log_exec(&pool, ctx.job.id, ctx.job.attempts, worker).await;
            Ok(())
        })
    }
}

/// Shared buffers (hit + read) the claim of `kinds` (a `text[]` literal,
/// `{a,b}`) touches, limit 10, under each plan cache mode, with the plan
/// (`EXPLAIN (ANALYZE, BUFFERS)` of the prepared [`almanac::queue::CLAIM_SQL`]);
/// rolled back.
pub async fn claim_buffers(pool: &PgPool, kinds: &str) -> Vec<(String, i64, serde_json::Value)> {
    let mut conn = pool.acquire().await.unwrap();
    // The budget function's statements are planned on their first call in
    // a session (about 190 buffers of catalog reads, once): a worker's
    // claims after its first.
    sqlx::query(&format!(
        "SELECT * FROM almanac.claim_budgets('{kinds}', 1)"
    ))
    .execute(&mut *conn)
    .await
    .unwrap();
    explain_prepared(
        &mut conn,
        almanac::queue::CLAIM_SQL,
        "text[], bigint, bigint",
        &format!("'{kinds}', 10, 30000"),
    )
    .await
}

/// `sql` prepared with parameter `types` (none: empty) and run with
/// `values` (SQL literals) under `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`,
/// as a custom plan and as the generic plan a prepared statement settles
/// on, each in a transaction rolled back (`ANALYZE` runs a statement that
/// writes): (mode, shared buffers hit + read at the plan's root, which
/// counts every node, plan). One run goes first, rolled back and not
/// counted: the first in a session reads the catalog for what the
/// statement calls (the first UPDATE of almanac.jobs reads its check
/// constraints, an inlined SQL function since 0115, and compiles the
/// statement trigger of 0117: about 60 buffers, once).
pub async fn explain_prepared(
    conn: &mut sqlx::PgConnection,
    sql: &str,
    types: &str,
    values: &str,
) -> Vec<(String, i64, serde_json::Value)> {
    // Its own name: sqlx keeps its prepared statements on the connection.
    let (types, execute) = if types.is_empty() {
        (String::new(), "EXECUTE explained".to_string())
    } else {
        (
            format!("({types})"),
            format!("EXECUTE explained ({values})"),
        )
    };
    sqlx::raw_sql(&format!("PREPARE explained {types} AS {sql}"))
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::raw_sql(&format!("BEGIN; EXPLAIN (ANALYZE) {execute}; ROLLBACK"))
        .execute(&mut *conn)
        .await
        .unwrap();
    let mut out = Vec::new();
    for mode in ["force_custom_plan", "force_generic_plan"] {
        sqlx::raw_sql(&format!("BEGIN; SET LOCAL plan_cache_mode = {mode}"))
            .execute(&mut *conn)
            .await
            .unwrap();
        let plan: serde_json::Value = sqlx::query_scalar(&format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {execute}"
        ))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
        let root = &plan[0]["Plan"];
        let buffers = root["Shared Hit Blocks"].as_i64().unwrap()
            + root["Shared Read Blocks"].as_i64().unwrap();
        out.push((mode.to_string(), buffers, plan));
    }
    // The connection goes back to the pool: the next call prepares again.
    sqlx::raw_sql("DEALLOCATE explained")
        .execute(&mut *conn)
        .await
        .unwrap();
    out
}

/// The relations `node` (a plan node of `EXPLAIN (FORMAT JSON)`) and its
/// children read with a sequential scan.
pub fn seq_scans(node: &serde_json::Value, out: &mut Vec<String>) {
    if node["Node Type"] == "Seq Scan" {
        out.push(node["Relation Name"].as_str().unwrap_or("").to_string());
    }
    for child in node["Plans"].as_array().into_iter().flatten() {
        seq_scans(child, out);
    }
}
