//! A Rust application embedding an almanac worker.
//!
//! It enqueues a welcome email in the same transaction as the user row it
//! belongs to, then runs a worker for `send_welcome` until Ctrl-C.
//!
//! ```sh
//! cargo run --example email_worker
//! ```

use std::time::Duration;

use almanac::queue::{self, NewJob};
use almanac::role::{Role, Settings};
use almanac::worker::{HandlerError, JobContext, Worker, WorkerConfig};
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| almanac::config::DEFAULT_DATABASE_URL.into());
    let pool = almanac::db::connect_and_migrate(&url, 5).await?;

    // The business write and its job commit together, or not at all.
    let mut tx = pool.begin().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS users (id bigint PRIMARY KEY, email text NOT NULL)")
        .execute(&mut *tx)
        .await?;
    sqlx::query("INSERT INTO users VALUES (1, 'ada@example.com') ON CONFLICT DO NOTHING")
        .execute(&mut *tx)
        .await?;
    let job = NewJob::new("send_welcome")
        .payload(json!({"user_id": 1}))
        .idempotency_key("welcome:user:1");
    let enqueued = queue::enqueue(&mut tx, &job).await?;
    tx.commit().await?;
    println!("enqueued {enqueued:?}");

    let worker = Worker::new(
        pool.clone(),
        WorkerConfig {
            concurrency: 4,
            ..Default::default()
        }
        .validated()?,
    )
    .register("send_welcome", |ctx: JobContext| async move {
        let user = ctx.job.payload["user_id"]
            .as_i64()
            .ok_or_else(|| HandlerError::permanent("payload has no numeric user_id"))?;
        // Pass the idempotency key to the mail API so a re-run sends nothing twice.
        println!(
            "sending welcome mail to user {user} (key {})",
            ctx.idempotency_key()
        );
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(100)) => Ok(()),
            _ = ctx.cancelled() => Err(HandlerError::retry("lease lost before the mail went out")),
        }
    });

    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        signal.cancel();
    });
    let report = worker.run(shutdown).await?;
    println!("{report:?}");
    Ok(())
}
