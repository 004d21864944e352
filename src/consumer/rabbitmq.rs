//! The RabbitMQ side of a consumer: up to `concurrency` deliveries at once
//! (the prefetch), each acked after its job's outcome is recorded; an
//! explicit reconnect loop with backoff.
//!
//! A delivery whose job is of a kind this consumer cannot run is held
//! [`super::OTHER_KIND_HOLD`], then published again to the tail of its queue
//! (the same body and headers; the channel is in confirm mode) and, once the
//! broker confirmed the copy, held as long again and acknowledged (while the
//! original is held, this consumer's prefetch stays taken, so the copy goes
//! to a consumer with room rather than straight back here). A plain `nack` with requeue would
//! put it back at the head, where the same consumer takes it again at once
//! and never reaches the messages behind it; at the tail, the queue's
//! consumers take turns with it. If the copy is not confirmed, the original
//! is rejected with requeue instead: one of the two always stays queued.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::Channel;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::marks::RabbitmqWatermark;
use super::{Consumer, Handled, JOB_ID_HEADER, OTHER_KIND_HOLD};
use crate::broker::rabbitmq::{connect, declare};
use crate::broker::{SinkError, SinkKind};
use crate::redact::redact_url;
use crate::retry::Retry;
use crate::telemetry::{TraceContext, TRACEPARENT_HEADER};
use crate::worker::Executor;

fn job_id(headers: &Option<FieldTable>) -> Option<i64> {
    let value = headers.as_ref()?.inner().get(JOB_ID_HEADER)?;
    match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().parse().ok(),
        AMQPValue::LongLongInt(n) => Some(*n),
        _ => None,
    }
}

fn traceparent(headers: &Option<FieldTable>) -> Option<TraceContext> {
    match headers.as_ref()?.inner().get(TRACEPARENT_HEADER)? {
        AMQPValue::LongString(s) => TraceContext::parse(std::str::from_utf8(s.as_bytes()).ok()?),
        AMQPValue::ShortString(s) => TraceContext::parse(s.as_str()),
        _ => None,
    }
}

pub(super) async fn run(
    consumer: Arc<Consumer>,
    executor: Executor,
    shutdown: CancellationToken,
) -> Result<(), SinkError> {
    let url = consumer
        .sinks
        .amqp_url
        .clone()
        .ok_or(SinkError::NotConfigured {
            sink: SinkKind::Rabbitmq,
            flag: "--amqp-url (or ALMANAC_AMQP_URL)",
        })?;
    let queue = consumer.config.destination.clone();
    let prefetch = consumer.config.worker.concurrency.min(u16::MAX as usize) as u16;
    let mut running = JoinSet::new();
    let mut retry = Retry::new(Duration::from_millis(200), Duration::from_secs(10));
    'connect: while !shutdown.is_cancelled() {
        let session = async {
            let (conn, channel) = connect(&url, consumer.sinks.ack_timeout).await?;
            let setup = async {
                declare(&channel, &queue).await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                channel
                    .basic_qos(prefetch, BasicQosOptions::default())
                    .await?;
                channel
                    .basic_consume(
                        &queue,
                        "almanac",
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
            };
            let deliveries = setup.await.map_err(|e| {
                SinkError::Broker(format!("cannot consume RabbitMQ queue `{queue}`: {e}"))
            })?;
            // Drain checks on a channel of their own: a failed check
            // closes only that one.
            let checks = conn.create_channel().await.map_err(|e| {
                SinkError::Broker(format!(
                    "cannot open a RabbitMQ channel for drain checks: {e}"
                ))
            })?;
            Ok::<_, SinkError>((conn, channel, deliveries, checks))
        };
        // Setting up waits on the broker: bounded, and never past shutdown.
        let session = tokio::select! {
            _ = shutdown.cancelled() => break,
            session = tokio::time::timeout(SETUP_DEADLINE, session) => session
                .unwrap_or_else(|_| Err(SinkError::Broker(format!(
                    "RabbitMQ did not set up the consumer of `{queue}` within {SETUP_DEADLINE:?}"
                )))),
        };
        let (conn, channel, mut deliveries, checks) = match session {
            Ok(session) => session,
            Err(err) => {
                let told = |pause: Duration| warn!(%err, retry_in_ms = pause.as_millis() as u64, "RabbitMQ consumer cannot start");
                if !retry.pause_told(&shutdown, told).await {
                    break;
                }
                continue;
            }
        };
        info!(%queue, url = %redact_url(&url), "RabbitMQ consumer started");
        // Whether the queue is drained, for the re-drive gate
        // (`super::marks`), while this session lasts.
        // First deliveries this session, for the watermark.
        let delivered = Arc::new(AtomicU64::new(0));
        let watching = shutdown.child_token();
        let watching_guard = watching.clone().drop_guard();
        tokio::spawn({
            let (checks, name, timeout) = (checks, queue.clone(), consumer.sinks.ack_timeout);
            let delivered = delivered.clone();
            let watermark = Arc::new(Mutex::new(RabbitmqWatermark::new(prefetch)));
            super::marks::watch(
                consumer.pool.clone(),
                SinkKind::Rabbitmq,
                queue.clone(),
                watching,
                move || {
                    let (checks, name) = (checks.clone(), name.clone());
                    let (delivered, watermark) = (delivered.clone(), watermark.clone());
                    async move {
                        let (ready, at) =
                            super::marks::rabbitmq_ready(&checks, &name, timeout).await?;
                        // Counted once the broker answered (module doc).
                        let delivered = delivered.load(Ordering::SeqCst);
                        let drained = watermark
                            .lock()
                            .expect("not poisoned")
                            .observe(ready, at, delivered);
                        Ok(vec![(0, drained)])
                    }
                },
            )
        });
        let started = tokio::time::Instant::now();
        // The pause before reconnecting resets only once a session delivered:
        // a session the broker ends at once (a cancelled consumer, a closed
        // channel) is retried with a growing pause, not in a tight loop.
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => {
                    // Deliveries in hand are acked on this connection once
                    // their jobs end (the executor bounds that by its
                    // shutdown deadline); then it closes.
                    while running.join_next().await.is_some() {}
                    let _ = tokio::time::timeout(SETUP_DEADLINE, conn.close(200, "shutting down")).await;
                    break 'connect;
                }
                next = deliveries.next() => next,
            };
            while running.try_join_next().is_some() {}
            let delivery = match next {
                Some(Ok(delivery)) => {
                    retry.succeeded();
                    if !delivery.redelivered {
                        delivered.fetch_add(1, Ordering::SeqCst);
                    }
                    delivery
                }
                Some(Err(err)) => {
                    warn!(%err, "RabbitMQ delivery failed; reconnecting");
                    break;
                }
                None => {
                    warn!("RabbitMQ consumer stream ended; reconnecting");
                    break;
                }
            };
            let (consumer, executor, shutdown, channel) = (
                consumer.clone(),
                executor.clone(),
                shutdown.clone(),
                channel.clone(),
            );
            let ack_timeout = consumer.sinks.ack_timeout;
            let queue_name = queue.clone();
            running.spawn(async move {
                let id = job_id(delivery.properties.headers());
                let via = consumer.via(|| traceparent(delivery.properties.headers()));
                match consumer.handle_until_done(&executor, id, via, &shutdown, Some(OTHER_KIND_HOLD)).await {
                    None => {}
                    // Still paused after a while: to the tail of the queue,
                    // so the deliveries behind it (other kinds) get their turn.
                    Some(Handled::Paused(_) | Handled::Limited(_)) => {
                        pass_on(&channel, &queue_name, delivery, ack_timeout, id, &shutdown).await;
                    }
                    Some(Handled::OtherKind(_)) => {
                        tokio::select! {
                            _ = shutdown.cancelled() => {}
                            _ = tokio::time::sleep(OTHER_KIND_HOLD) => {}
                        }
                        pass_on(&channel, &queue_name, delivery, ack_timeout, id, &shutdown).await;
                    }
                    Some(_) => {
                        if let Err(err) = delivery.ack(BasicAckOptions::default()).await {
                            warn!(%err, job_id = id, "RabbitMQ ack failed; the message will be delivered again");
                        }
                    }
                }
            });
        }
        drop(watching_guard);
        let _ = tokio::time::timeout(SETUP_DEADLINE, conn.close(200, "reconnecting")).await;
        if started.elapsed() >= SETUP_DEADLINE {
            // A session that lasted was healthy, idle or not.
            retry.succeeded();
        }
        let told = |pause: Duration| {
            debug!(
                retry_in_ms = pause.as_millis() as u64,
                "RabbitMQ consumer reconnecting"
            )
        };
        if !retry.pause_told(&shutdown, told).await {
            break;
        }
    }
    // Deliveries of a connection that broke before shutdown: their jobs end
    // within the executor's deadline; their acks may fail (redelivered).
    while running.join_next().await.is_some() {}
    info!(%queue, "RabbitMQ consumer stopped");
    Ok(())
}

/// Gives a delivery this consumer cannot run back to its queue, at the tail
/// (see the module doc); never drops it.
async fn pass_on(
    channel: &Channel,
    queue: &str,
    delivery: Delivery,
    ack_timeout: Duration,
    job_id: Option<i64>,
    shutdown: &CancellationToken,
) {
    let copy = async {
        let confirm = channel
            .basic_publish(
                queue,
                queue,
                BasicPublishOptions::default(),
                &delivery.data,
                delivery.properties.clone(),
            )
            .await?;
        confirm.await
    };
    let copied = match tokio::time::timeout(ack_timeout, copy).await {
        Ok(Ok(confirmation)) => confirmation.is_ack(),
        _ => false,
    };
    let given_back = if copied {
        // Held a while longer with the copy queued: this consumer's prefetch
        // stays taken, so the copy goes to another consumer of the queue if
        // one has room, rather than straight back here.
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(OTHER_KIND_HOLD) => {}
        }
        delivery.ack(BasicAckOptions::default()).await
    } else {
        let requeue = BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        };
        delivery.nack(requeue).await
    };
    if let Err(err) = given_back {
        warn!(%err, job_id, "RabbitMQ ack or reject failed; the message will be delivered again");
    }
}

/// How long setting up (or closing) a session may wait on the broker.
const SETUP_DEADLINE: Duration = Duration::from_secs(30);
