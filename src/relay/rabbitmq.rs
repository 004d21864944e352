//! RabbitMQ: persistent messages to the destination's durable exchange
//! (declared by [`crate::broker::rabbitmq::declare`]) with `message_id` =
//! idempotency key and the job facts in headers; `mandatory`, so an
//! unroutable message comes back, and an ack that carries a returned message
//! counts as [`PublishError::Unroutable`]. The whole batch is written to the
//! channel at once and its publisher confirms are awaited together, under one
//! deadline (`ack_timeout`), while the relay writes the next batch. Any channel error drops the connection; the next
//! batch reconnects.

use std::collections::HashSet;
use std::time::Duration;

use futures::future::join_all;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use tracing::warn;

use super::OutboxRow;
use crate::broker::rabbitmq::{connect, declare_destination};
use crate::broker::{Plain, PublishError, SinkConfig, SinkError};

/// A message handed to the broker, resolving with its acknowledgement.
pub type Pending = futures::future::BoxFuture<'static, Result<(), PublishError>>;

pub struct RabbitPublisher {
    url: String,
    link: Option<(Connection, Channel)>,
    ack_timeout: Duration,
    ensured: HashSet<String>,
}

impl RabbitPublisher {
    pub fn new(url: String, config: &SinkConfig) -> Self {
        RabbitPublisher {
            url,
            link: None,
            ack_timeout: config.ack_timeout,
            ensured: HashSet::new(),
        }
    }

    async fn channel(&mut self) -> Result<Channel, PublishError> {
        if let Some((conn, channel)) = &self.link {
            if conn.status().connected() && channel.status().connected() {
                return Ok(channel.clone());
            }
        }
        self.link = None;
        self.ensured.clear();
        let (conn, channel) = connect(&self.url, self.ack_timeout)
            .await
            .map_err(|e| match e {
                SinkError::Publish(e) => e,
                other => {
                    PublishError::retriable("RabbitMQ is unreachable", Plain(other.to_string()))
                }
            })?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| PublishError::retriable("RabbitMQ refused publisher confirms", e))?;
        self.link = Some((conn, channel.clone()));
        Ok(channel)
    }

    fn broken(&mut self, why: &str) {
        if self.link.take().is_some() {
            warn!(
                reason = why,
                "RabbitMQ link dropped; reconnecting on the next batch"
            );
        }
        self.ensured.clear();
    }

    pub async fn ensure(&mut self, destination: &str) -> Result<(), PublishError> {
        if self.ensured.contains(destination) {
            return Ok(());
        }
        let channel = self.channel().await?;
        if let Err(e) = declare_destination(&channel, destination).await {
            // A refused declare closes the channel too.
            self.broken("declare failed");
            return Err(e);
        }
        self.ensured.insert(destination.to_string());
        Ok(())
    }

    /// Writes `rows` (whose destinations are prepared) to the channel, in
    /// order; one future per row resolves with its publisher confirm, all
    /// under one deadline (`ack_timeout` from now).
    pub async fn send(&mut self, rows: &[&OutboxRow]) -> Vec<Pending> {
        let channel = match self.channel().await {
            Ok(channel) => channel,
            Err(e) => {
                return rows
                    .iter()
                    .map(|_| Box::pin(std::future::ready(Err(e.clone()))) as Pending)
                    .collect()
            }
        };
        let ack_timeout = self.ack_timeout;
        let deadline = tokio::time::Instant::now() + ack_timeout;
        let options = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        // Polled in order, so frames and delivery tags follow the rows.
        let publishes = rows.iter().map(|row| {
            let mut headers = FieldTable::default();
            for (key, value) in row.header_names.iter().zip(&row.header_values) {
                headers.insert(
                    ShortString::from(key.as_str()),
                    AMQPValue::LongString(LongString::from(value.as_str())),
                );
            }
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type(ShortString::from("application/json"))
                .with_message_id(ShortString::from(row.msg_key.as_str()))
                .with_headers(headers);
            channel.basic_publish(
                &row.destination,
                &row.destination,
                options,
                row.payload.as_bytes(),
                properties,
            )
        });
        join_all(publishes)
            .await
            .into_iter()
            .map(|published| -> Pending {
                let confirm = match published {
                    Ok(confirm) => confirm,
                    Err(e) => {
                        return Box::pin(std::future::ready(Err(link_error(
                            "RabbitMQ publish failed",
                            e,
                        ))))
                    }
                };
                Box::pin(async move {
                    match tokio::time::timeout_at(deadline, confirm).await {
                        Err(_) => Err(PublishError::retriable(
                            "no publisher confirm in time (maybe sent)",
                            Plain(format!("waited {ack_timeout:?}")),
                        )),
                        Ok(Err(e)) => Err(link_error("RabbitMQ confirm failed", e)),
                        Ok(Ok(Confirmation::Ack(None))) => Ok(()),
                        Ok(Ok(Confirmation::Ack(Some(returned))))
                        | Ok(Ok(Confirmation::Nack(Some(returned)))) => {
                            Err(PublishError::unroutable(
                                format!(
                                    "RabbitMQ returned the message as unroutable ({} {})",
                                    returned.reply_code, returned.reply_text
                                ),
                                Plain(format!(
                                    "is a queue bound to exchange `{}`?",
                                    returned.delivery.exchange
                                )),
                            ))
                        }
                        Ok(Ok(Confirmation::Nack(None))) => Err(PublishError::retriable(
                            "RabbitMQ nacked the message",
                            Plain("the broker could not take it now".into()),
                        )),
                        Ok(Ok(Confirmation::NotRequested)) => Err(PublishError::retriable(
                            "publisher confirms are off on this channel",
                            Plain("reconnecting".into()),
                        )),
                    }
                })
            })
            .collect()
    }

    /// Bookkeeping after a batch's confirms settled: the link is dropped
    /// after retriable failures, destinations whose messages came back are
    /// declared again before the next try.
    pub fn settle(&mut self, rows: &[&OutboxRow], results: &[Result<(), PublishError>]) {
        if results
            .iter()
            .any(|r| matches!(r, Err(PublishError::Retriable { .. })))
        {
            self.broken("publish or confirm failed");
        }
        for (row, result) in rows.iter().zip(results) {
            if let Err(PublishError::Unroutable { .. }) = result {
                self.ensured.remove(&row.destination);
            }
        }
    }

    pub async fn close(&mut self) {
        if let Some((conn, _)) = self.link.take() {
            let _ = conn.close(200, "almanac relay stopping").await;
        }
    }
}

/// A publish or confirm that failed with the channel: the message may or may
/// not have arrived, and the rest of the batch shares the fate, so it is
/// retried whatever the broker said.
fn link_error(context: &str, error: lapin::Error) -> PublishError {
    PublishError::retriable(context, error)
}
