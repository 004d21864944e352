//! Kafka clients: the relay's producer, the admin client that creates
//! topics, and what a producer error means ([`classify`]).

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::FromClientConfigAndContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::FutureProducer;
use rdkafka::util::Timeout;
use rdkafka::ClientConfig;

use super::{Plain, PublishError, SinkError};

/// An idempotent producer with `acks=all`. Deliveries time out after
/// `ack_timeout`; messages over `max_message_bytes` are refused by the client
/// before they leave. `linger.ms` lets a batch of the relay's sends share
/// produce requests.
pub fn producer(
    brokers: &str,
    ack_timeout: Duration,
    max_message_bytes: usize,
) -> Result<FutureProducer, SinkError> {
    producer_with(
        brokers,
        ack_timeout,
        max_message_bytes,
        DefaultClientContext,
    )
}

/// [`producer`]'s settings, for a producer of type `P` whose `context`
/// receives the delivery reports (the relay's batches: `relay::kafka`).
pub fn producer_with<C: ClientContext, P: FromClientConfigAndContext<C>>(
    brokers: &str,
    ack_timeout: Duration,
    max_message_bytes: usize,
    context: C,
) -> Result<P, SinkError> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.timeout.ms", ack_timeout.as_millis().to_string())
        .set("message.max.bytes", max_message_bytes.max(1000).to_string())
        .set("linger.ms", "2")
        .set("batch.num.messages", "10000")
        .set("queue.buffering.max.messages", "200000")
        .create_with_context(context)
        .map_err(|e| {
            SinkError::Broker(format!("cannot create a Kafka producer for {brokers}: {e}"))
        })
}

pub fn admin(brokers: &str) -> Result<AdminClient<DefaultClientContext>, SinkError> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| {
            SinkError::Broker(format!(
                "cannot create a Kafka admin client for {brokers}: {e}"
            ))
        })
}

/// Creates `topic` unless it exists. A topic the broker refuses to create
/// (bad name, policy, not authorised, impossible settings) is
/// [`PublishError::Unroutable`]; anything else (unreachable, timed out) is
/// [`PublishError::Retriable`], so an outage never fails a row.
pub async fn ensure_topic(
    admin: &AdminClient<DefaultClientContext>,
    topic: &str,
    partitions: i32,
    replication: i32,
    timeout: Duration,
) -> Result<(), PublishError> {
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(replication));
    let options = AdminOptions::new()
        .operation_timeout(Some(Timeout::After(timeout)))
        .request_timeout(Some(Timeout::After(timeout)));
    let results = admin
        .create_topics([&new], &options)
        .await
        .map_err(|e| PublishError::retriable(format!("cannot create Kafka topic `{topic}`"), e))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => {
                let context = format!("Kafka refused to create topic `{name}`");
                return Err(match code {
                    RDKafkaErrorCode::InvalidTopic
                    | RDKafkaErrorCode::TopicAuthorizationFailed
                    | RDKafkaErrorCode::ClusterAuthorizationFailed
                    | RDKafkaErrorCode::PolicyViolation
                    | RDKafkaErrorCode::InvalidPartitions
                    | RDKafkaErrorCode::InvalidReplicationFactor
                    | RDKafkaErrorCode::InvalidConfig
                    | RDKafkaErrorCode::InvalidRequest => {
                        PublishError::unroutable(context, Plain(code.to_string()))
                    }
                    _ => PublishError::retriable(context, Plain(code.to_string())),
                });
            }
        }
    }
    Ok(())
}

/// What a failed delivery of one message means.
pub fn classify(topic: &str, error: KafkaError) -> PublishError {
    let code = error.rdkafka_error_code();
    match code {
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidMessage
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::InvalidTopic
            | RDKafkaErrorCode::TopicAuthorizationFailed,
        ) => PublishError::fatal(format!("Kafka refused the message for `{topic}`"), error),
        Some(
            RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::UnknownPartition,
        ) => PublishError::unroutable(format!("Kafka has no topic `{topic}`"), error),
        _ => PublishError::retriable(
            format!("Kafka delivery to `{topic}` failed (maybe sent)"),
            error,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(code: RDKafkaErrorCode) -> &'static str {
        classify("t", KafkaError::MessageProduction(code)).kind()
    }

    #[test]
    fn delivery_errors_are_classified_by_what_they_mean_for_the_row() {
        assert_eq!(kind(RDKafkaErrorCode::MessageSizeTooLarge), "fatal");
        assert_eq!(kind(RDKafkaErrorCode::InvalidTopic), "fatal");
        assert_eq!(
            kind(RDKafkaErrorCode::UnknownTopicOrPartition),
            "unroutable"
        );
        assert_eq!(kind(RDKafkaErrorCode::MessageTimedOut), "retriable");
        assert_eq!(kind(RDKafkaErrorCode::AllBrokersDown), "retriable");
        assert_eq!(
            classify("t", KafkaError::Canceled).kind(),
            "retriable",
            "a dropped producer means maybe sent"
        );
    }
}
