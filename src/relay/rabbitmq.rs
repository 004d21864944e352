//! RabbitMQ: a durable direct exchange and a durable queue, both named after
//! the destination (bound with the destination as routing key); persistent
//! messages with `message_id` = idempotency key and the job facts in headers;
//! publisher confirms, each awaited under a timeout; `mandatory`, so an
//! unroutable message comes back, and an ack that carries a returned message
//! counts as a failure. Any channel error drops the connection; the next
//! batch reconnects.

use std::collections::HashSet;
use std::time::Duration;

use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tracing::warn;

use super::sink::{SinkConfig, SinkError};
use super::OutboxRow;
use crate::redact::redact_url;

pub struct RabbitPublisher {
    url: String,
    link: Option<(Connection, Channel)>,
    ack_timeout: Duration,
    ensured: HashSet<String>,
}

/// Opens a connection and a channel, within `timeout`.
pub async fn connect(url: &str, timeout: Duration) -> Result<(Connection, Channel), SinkError> {
    let fail =
        |e: String| SinkError::Broker(format!("cannot reach RabbitMQ at {}: {e}", redact_url(url)));
    let connect = async {
        let conn = Connection::connect(url, ConnectionProperties::default()).await?;
        let channel = conn.create_channel().await?;
        Ok::<_, lapin::Error>((conn, channel))
    };
    tokio::time::timeout(timeout, connect)
        .await
        .map_err(|_| fail(format!("no answer within {timeout:?}")))?
        .map_err(|e| fail(e.to_string()))
}

/// Declares the durable exchange, the durable queue and their binding.
pub async fn declare(channel: &Channel, destination: &str) -> Result<(), lapin::Error> {
    channel
        .exchange_declare(
            destination,
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_declare(
            destination,
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            destination,
            destination,
            destination,
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
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

    async fn channel(&mut self) -> Result<Channel, SinkError> {
        if let Some((conn, channel)) = &self.link {
            if conn.status().connected() && channel.status().connected() {
                return Ok(channel.clone());
            }
        }
        self.link = None;
        self.ensured.clear();
        let (conn, channel) = connect(&self.url, self.ack_timeout).await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| SinkError::Broker(format!("RabbitMQ refused publisher confirms: {e}")))?;
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

    pub async fn ensure(&mut self, destination: &str) -> Result<(), SinkError> {
        if self.ensured.contains(destination) {
            return Ok(());
        }
        let channel = self.channel().await?;
        if let Err(e) = declare(&channel, destination).await {
            self.broken("declare failed");
            return Err(SinkError::Broker(format!(
                "cannot declare RabbitMQ exchange and queue `{destination}`: {e}"
            )));
        }
        self.ensured.insert(destination.to_string());
        Ok(())
    }

    pub async fn publish(&mut self, rows: &[OutboxRow]) -> Vec<Result<(), String>> {
        let channel = match self.channel().await {
            Ok(channel) => channel,
            Err(e) => return rows.iter().map(|_| Err(e.to_string())).collect(),
        };
        let mut confirms = Vec::with_capacity(rows.len());
        for row in rows {
            let mut headers = FieldTable::default();
            for (key, value) in row.headers() {
                headers.insert(
                    ShortString::from(key),
                    AMQPValue::LongString(LongString::from(value)),
                );
            }
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type(ShortString::from("application/json"))
                .with_message_id(ShortString::from(row.msg_key.clone()))
                .with_headers(headers);
            let body = serde_json::to_vec(&row.payload).unwrap_or_default();
            let options = BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            };
            confirms.push(
                channel
                    .basic_publish(
                        &row.destination,
                        &row.destination,
                        options,
                        &body,
                        properties,
                    )
                    .await,
            );
        }
        let mut results = Vec::with_capacity(rows.len());
        let mut broken = false;
        for confirm in confirms {
            let result = match confirm {
                Err(e) => {
                    broken = true;
                    Err(format!("RabbitMQ publish failed: {e}"))
                }
                Ok(pending) => match tokio::time::timeout(self.ack_timeout, pending).await {
                    Err(_) => {
                        broken = true;
                        Err(format!(
                            "no publisher confirm within {:?} (maybe sent)",
                            self.ack_timeout
                        ))
                    }
                    Ok(Err(e)) => {
                        broken = true;
                        Err(format!("RabbitMQ confirm failed: {e}"))
                    }
                    Ok(Ok(Confirmation::Ack(None))) => Ok(()),
                    Ok(Ok(Confirmation::Ack(Some(returned))))
                    | Ok(Ok(Confirmation::Nack(Some(returned)))) => {
                        // Declare again before the next try: the queue or binding may be gone.
                        self.ensured.remove(returned.delivery.exchange.as_str());
                        Err(format!(
                        "RabbitMQ returned the message as unroutable ({} {}): is a queue bound to exchange `{}`?",
                        returned.reply_code, returned.reply_text, returned.delivery.exchange
                    ))
                    }
                    Ok(Ok(Confirmation::Nack(None))) => {
                        Err("RabbitMQ nacked the message".to_string())
                    }
                    Ok(Ok(Confirmation::NotRequested)) => {
                        Err("publisher confirms are off on this channel".to_string())
                    }
                },
            };
            results.push(result);
        }
        if broken {
            self.broken("publish or confirm failed");
        }
        results
    }

    pub async fn close(&mut self) {
        if let Some((conn, _)) = self.link.take() {
            let _ = conn.close(200, "almanac relay stopping").await;
        }
    }
}
