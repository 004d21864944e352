//! The outbox relay: publishes outbox rows to Kafka or RabbitMQ and marks
//! them published only after the broker acknowledged them.
//!
//! - **Where rows come from.** A trigger on `almanac.jobs` writes an outbox
//!   row in the same transaction as every transition of a `dual` or `broker`
//!   job to `ready` (enqueue, retry, reaper, release, `route set`), with
//!   `available_at = run_at` (migration `0003_outbox.sql`).
//! - **Claim, publish, mark in one transaction.** A relay locks a batch of due
//!   rows of its sink with `FOR UPDATE SKIP LOCKED` (several relays share the
//!   work), publishes them, waits for every acknowledgement (each under the
//!   ack timeout), and in the same transaction marks the acknowledged rows
//!   published and gives the others `last_error` and a later `available_at`.
//! - **Crash between publish and mark.** The transaction rolls back, the rows
//!   are published again: the message arrives twice, and the consumer's claim
//!   through the job fence makes the second copy a no-op.
//! - **Broker down.** Rows stay unpublished and wait; the relay backs off
//!   and retries; nothing is lost.
//! - **Re-drive.** A `broker` job that stays ready and due longer than
//!   `redrive_after` with no recent outbox row (its message was lost, purged or
//!   skipped) gets a fresh one, so broker mode never strands a job.
//! - LISTEN/NOTIFY (`almanac_outbox`) wakes the relay; polling is the safety net.

pub mod backlog;
pub mod kafka;
pub mod rabbitmq;
pub mod routes;
pub mod sink;

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::time::{sleep, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::queue::Backoff;
pub use sink::{Publisher, SinkConfig, SinkError, SinkKind};

pub const NOTIFY_CHANNEL: &str = "almanac_outbox";

/// One outbox row, as claimed.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OutboxRow {
    pub id: i64,
    pub job_id: i64,
    pub destination: String,
    pub msg_key: String,
    pub payload: serde_json::Value,
    pub headers: serde_json::Value,
    pub attempts: i32,
    pub available_at: DateTime<Utc>,
}

impl OutboxRow {
    /// Header names and values, in name order.
    pub fn headers(&self) -> Vec<(String, String)> {
        let map: BTreeMap<String, serde_json::Value> =
            serde_json::from_value(self.headers.clone()).unwrap_or_default();
        map.into_iter()
            .map(|(k, v)| {
                (
                    k,
                    v.as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| v.to_string()),
                )
            })
            .collect()
    }
}

/// A test hook: stop at a chosen point as a crash would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// After the broker acknowledged the batch, before the rows are marked.
    AfterPublishBeforeMark,
}

#[derive(Debug, Clone)]
pub struct RelayConfig {
    pub batch_size: i64,
    pub poll_interval: Duration,
    /// Delay before a failed row is tried again (doubling per attempt).
    pub retry: Backoff,
    /// Broker-route jobs ready and due this long without a recent outbox row
    /// get a fresh one.
    pub redrive_after: Duration,
    pub failpoint: Option<Failpoint>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch_size: 200,
            poll_interval: Duration::from_secs(1),
            retry: Backoff {
                base: Duration::from_millis(500),
                max: Duration::from_secs(60),
                jitter: 0.25,
            },
            redrive_after: Duration::from_secs(300),
            failpoint: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("failpoint {0:?} reached; the batch was rolled back")]
    Failpoint(Failpoint),
}

/// What one batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelayReport {
    pub published: u64,
    pub failed: u64,
}

pub struct Relay {
    pool: PgPool,
    publisher: Publisher,
    config: RelayConfig,
}

impl Relay {
    pub fn new(pool: PgPool, publisher: Publisher, config: RelayConfig) -> Self {
        Relay {
            pool,
            publisher,
            config,
        }
    }

    /// Claims, publishes and marks one batch.
    pub async fn run_once(&mut self) -> Result<RelayReport, RelayError> {
        let sink = self.publisher.sink();
        let mut tx = self.pool.begin().await?;
        let rows: Vec<OutboxRow> = sqlx::query_as(
            r#"
            SELECT id, job_id, destination, msg_key, payload, headers, attempts, available_at
            FROM almanac.outbox
            WHERE published_at IS NULL AND sink = $1 AND available_at <= now()
            ORDER BY available_at, id
            LIMIT $2
            FOR UPDATE SKIP LOCKED
            "#,
        )
        .bind(sink.as_str())
        .bind(self.config.batch_size)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(RelayReport::default());
        }
        let results = self.publisher.publish(&rows).await;
        if let Some(point) = self.config.failpoint {
            return Err(RelayError::Failpoint(point));
        }
        let mut published = Vec::new();
        let (mut failed_ids, mut errors, mut delays) = (Vec::new(), Vec::new(), Vec::new());
        for (row, result) in rows.iter().zip(results) {
            match result {
                Ok(()) => published.push(row.id),
                Err(error) => {
                    failed_ids.push(row.id);
                    delays.push(self.config.retry.delay(row.attempts + 1).as_millis() as i64);
                    errors.push(error);
                }
            }
        }
        sqlx::query("UPDATE almanac.outbox SET published_at = now(), attempts = attempts + 1, last_error = NULL WHERE id = ANY($1)")
            .bind(&published)
            .execute(&mut *tx)
            .await?;
        if !failed_ids.is_empty() {
            sqlx::query(
                r#"
                UPDATE almanac.outbox AS o
                SET attempts = o.attempts + 1, last_error = f.error,
                    available_at = now() + f.delay_ms * interval '1 millisecond'
                FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS f(id, error, delay_ms)
                WHERE o.id = f.id
                "#,
            )
            .bind(&failed_ids)
            .bind(&errors)
            .bind(&delays)
            .execute(&mut *tx)
            .await?;
            warn!(%sink, failed = failed_ids.len(), error = %errors[0], "publishing failed; rows stay unpublished and will be retried");
        }
        tx.commit().await?;
        crate::metrics::record_published(sink.as_str(), published.len() as u64);
        crate::metrics::record_publish_failed(sink.as_str(), failed_ids.len() as u64);
        Ok(RelayReport {
            published: published.len() as u64,
            failed: failed_ids.len() as u64,
        })
    }

    /// Gives stranded broker-route jobs a fresh outbox row; returns how many.
    pub async fn redrive(&self) -> Result<u64, RelayError> {
        redrive(&self.pool, self.publisher.sink(), self.config.redrive_after).await
    }

    pub async fn run(mut self, shutdown: CancellationToken) {
        let sink = self.publisher.sink();
        info!(%sink, "relay started");
        let mut listener = listen(&self.pool).await;
        let mut failures = 0u32;
        let mut next_redrive =
            Instant::now() + self.config.redrive_after.min(Duration::from_secs(60));
        while !shutdown.is_cancelled() {
            if listener.is_none() {
                // Polling covers for it meanwhile; try LISTEN again each round.
                listener = listen(&self.pool).await;
            }
            if Instant::now() >= next_redrive {
                match self.redrive().await {
                    Ok(0) => {}
                    Ok(n) => {
                        warn!(%sink, jobs = n, "re-drove stranded broker jobs with fresh outbox rows")
                    }
                    Err(err) => warn!(%sink, %err, "re-drive failed"),
                }
                next_redrive =
                    Instant::now() + self.config.redrive_after.min(Duration::from_secs(60));
            }
            let pause = match self.run_once().await {
                Ok(r) if r.failed == 0 && r.published as i64 == self.config.batch_size => {
                    failures = 0;
                    continue;
                }
                Ok(r) if r.failed > 0 => {
                    failures += 1;
                    self.config.retry.delay(failures as i32)
                }
                Ok(_) => {
                    failures = 0;
                    self.config.poll_interval
                }
                Err(err) => {
                    failures += 1;
                    warn!(%sink, %err, "relay batch failed");
                    self.config.retry.delay(failures as i32)
                }
            };
            let woken = async {
                match listener.as_mut() {
                    Some(l) => {
                        if l.recv().await.is_err() {
                            sleep(pause).await;
                        }
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = sleep(pause) => {}
                _ = woken, if failures == 0 => {}
            }
        }
        self.publisher.flush().await;
        info!(%sink, "relay stopped");
    }
}

async fn listen(pool: &PgPool) -> Option<PgListener> {
    let own = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with((*pool.connect_options()).clone());
    let mut listener = PgListener::connect_with(&own).await.ok()?;
    listener.listen(NOTIFY_CHANNEL).await.ok()?;
    Some(listener)
}

/// See [`Relay::redrive`].
pub async fn redrive(pool: &PgPool, sink: SinkKind, after: Duration) -> Result<u64, RelayError> {
    let n: Option<i64> = sqlx::query_scalar(
        r#"
        WITH stranded AS (
            SELECT j FROM almanac.jobs j JOIN almanac.routes r ON r.kind = j.kind
            WHERE j.status = 'ready' AND j.route = 'broker' AND r.sink = $1
              AND j.run_at <= now() - $2 * interval '1 millisecond'
              AND NOT EXISTS (
                  SELECT 1 FROM almanac.outbox o WHERE o.job_id = j.id
                    AND (o.published_at IS NULL OR o.published_at > now() - $2 * interval '1 millisecond'))
            LIMIT 1000
        )
        SELECT count(almanac.write_outbox(j)) FROM stranded
        "#,
    )
    .bind(sink.as_str())
    .bind(after.as_millis() as i64)
    .fetch_one(pool)
    .await?;
    Ok(n.unwrap_or(0) as u64)
}
