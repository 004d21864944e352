//! The Kafka side of a consumer: one message at a time, offset committed
//! after the job's outcome is recorded (never for a message whose job was in
//! hand when the executor stopped without knowing its outcome).
//!
//! **A kind it cannot run makes it step out of the group.** Kafka hands each
//! partition to one member of a group and has no way to pass a single
//! message to another member, so a consumer that meets a job of a kind it
//! has no handler for commits nothing past it, closes its group session
//! (its partitions go to the other members at once), and rejoins after a
//! pause: 2 s, doubling to 30 s while it keeps meeting such messages. A
//! member that runs the kind takes the message meanwhile; with none, the
//! message waits in the topic (and the error repeats) until one starts.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::ClientConfig;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::marks::KafkaWatermarks;
use super::{Consumer, Handled, JOB_ID_HEADER};
use crate::broker::kafka::{admin, ensure_topic};
use crate::broker::{SinkError, SinkKind};
use crate::retry::Retry;
use crate::telemetry::{TraceContext, TRACEPARENT_HEADER};
use crate::worker::Executor;

pub(super) async fn run(
    consumer: Arc<Consumer>,
    executor: Executor,
    shutdown: CancellationToken,
) -> Result<(), SinkError> {
    let brokers = consumer
        .sinks
        .kafka_brokers
        .clone()
        .ok_or(SinkError::NotConfigured {
            sink: SinkKind::Kafka,
            flag: "--kafka-brokers (or ALMANAC_KAFKA_BROKERS)",
        })?;
    let topic = consumer.config.destination.clone();
    let group = consumer
        .config
        .group
        .clone()
        .unwrap_or_else(|| format!("almanac-{topic}"));
    // Subscribing to a missing topic fails: make sure it exists, waiting out
    // a broker that is not up yet.
    let admin = admin(&brokers)?;
    let mut retry = Retry::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        let sinks = &consumer.sinks;
        match ensure_topic(
            &admin,
            &topic,
            sinks.kafka_partitions,
            sinks.kafka_replication,
            sinks.ack_timeout,
        )
        .await
        {
            Ok(()) => break,
            Err(err) => {
                let told = |pause: Duration| warn!(%err, retry_in_ms = pause.as_millis() as u64, "Kafka consumer cannot start");
                if !retry.pause_told(&shutdown, told).await {
                    return Ok(());
                }
            }
        }
    }
    // Whether the topic is drained, for the re-drive gate (`super::marks`).
    let checks = super::marks::kafka_client(&brokers, &group)?;
    let watching = shutdown.child_token();
    let watcher = {
        let (client, topic, timeout) = (checks.clone(), topic.clone(), consumer.sinks.ack_timeout);
        let watermarks = Arc::new(Mutex::new(KafkaWatermarks::default()));
        tokio::spawn(super::marks::watch(
            consumer.pool.clone(),
            SinkKind::Kafka,
            topic.clone(),
            watching.clone(),
            move || {
                let (client, topic) = (client.clone(), topic.clone());
                let watermarks = watermarks.clone();
                async move {
                    let readings = tokio::task::spawn_blocking(move || {
                        super::marks::kafka_read(&client, &topic, timeout)
                    })
                    .await
                    .map_err(|e| e.to_string())??;
                    Ok(watermarks.lock().expect("not poisoned").observe(&readings))
                }
            },
        ))
    };
    // Sessions in the group: one until shutdown, unless a message of a kind
    // this consumer cannot run makes it step out for a while.
    let mut away = Retry::new(Duration::from_secs(2), Duration::from_secs(30));
    loop {
        let stream = join(&brokers, &group, &topic)?;
        info!(%topic, %group, "Kafka consumer started");
        let joined = tokio::time::Instant::now();
        let ended = session(&consumer, &executor, &stream, &topic, &shutdown).await;
        // Closing leaves the group (it polls until the broker agrees): off
        // the async threads.
        let _ = tokio::task::spawn_blocking(move || drop(stream)).await;
        let Some(kind) = ended else { break };
        if joined.elapsed() > Duration::from_secs(60) {
            away.succeeded();
        }
        let told = |pause: Duration| {
            warn!(
                %kind, %topic, %group, rejoin_in_ms = pause.as_millis() as u64,
                "left the consumer group: a message's job is of a kind this consumer cannot run, and only another member can take it"
            )
        };
        if !away.pause_told(&shutdown, told).await {
            break;
        }
    }
    watching.cancel();
    let _ = watcher.await;
    let _ = tokio::task::spawn_blocking(move || drop(checks)).await;
    // No final "commit what was consumed": the consumed offsets include a
    // message left unhandled at shutdown, which must be delivered again.
    // Each handled message was committed above; one lost in flight comes
    // back and finds its job finished (the fence makes that a no-op).
    info!(%topic, "Kafka consumer stopped");
    Ok(())
}

/// A consumer in `group`, subscribed to `topic`.
fn join(brokers: &str, group: &str, topic: &str) -> Result<StreamConsumer, SinkError> {
    let stream: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .create()
        .map_err(|e| {
            SinkError::Broker(format!("cannot create a Kafka consumer for {brokers}: {e}"))
        })?;
    stream.subscribe(&[topic]).map_err(|e| {
        SinkError::Broker(format!("cannot subscribe to Kafka topic `{topic}`: {e}"))
    })?;
    Ok(stream)
}

/// Handles messages until shutdown (`None`) or a message of a kind this
/// consumer cannot run (`Some(kind)`), whose offset is not committed.
async fn session(
    consumer: &Consumer,
    executor: &Executor,
    stream: &StreamConsumer,
    topic: &str,
    shutdown: &CancellationToken,
) -> Option<String> {
    let mut retry = Retry::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => return None,
            message = stream.recv() => message,
        };
        let message = match message {
            Ok(message) => {
                retry.succeeded();
                message
            }
            Err(err) => {
                warn!(%err, %topic, "Kafka receive failed; retrying");
                if retry.pause(shutdown).await {
                    continue;
                }
                return None;
            }
        };
        let job_id = message.headers().and_then(|headers| {
            headers
                .iter()
                .find(|h| h.key == JOB_ID_HEADER)
                .and_then(|h| h.value)
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|v| v.parse::<i64>().ok())
        });
        let via = consumer.via(|| {
            let headers = message.headers()?;
            headers
                .iter()
                .find(|h| h.key == TRACEPARENT_HEADER)
                .and_then(|h| h.value)
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(TraceContext::parse)
        });
        // Runs to its outcome even after `shutdown`: the executor's own
        // shutdown bounds it by the deadline.
        // A paused kind's message is held for as long as the pause lasts:
        // nothing past it may be committed.
        match consumer
            .handle_until_done(executor, job_id, via, shutdown, None)
            .await
        {
            None | Some(Handled::Paused(_) | Handled::Limited(_)) => return None,
            Some(Handled::OtherKind(kind)) => return Some(kind),
            Some(_) => {}
        }
        if let Err(err) = stream.commit_message(&message, CommitMode::Async) {
            warn!(%err, %topic, "Kafka offset commit failed; the message may be delivered again");
        }
    }
}
