//! RabbitMQ: connecting (within a timeout, never naming the password) and
//! declaring a destination: a durable direct exchange and a durable queue,
//! both named after it, bound with the destination as routing key.

use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

use super::{PublishError, SinkError};
use crate::redact::{redact_in, redact_url};

/// Opens a connection and a channel, within `timeout`.
pub async fn connect(url: &str, timeout: Duration) -> Result<(Connection, Channel), SinkError> {
    let fail = |e: String| {
        SinkError::Broker(format!(
            "cannot reach RabbitMQ at {}: {}",
            redact_url(url),
            redact_in(&e, url)
        ))
    };
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

/// [`declare`], classified: a broker that refuses (a different exchange type
/// already has the name, access refused) makes the destination
/// [`PublishError::Unroutable`]; a broken link is [`PublishError::Retriable`].
pub async fn declare_destination(channel: &Channel, destination: &str) -> Result<(), PublishError> {
    declare(channel, destination).await.map_err(|e| {
        let context = format!("cannot declare RabbitMQ exchange and queue `{destination}`");
        if refused(&e) {
            PublishError::unroutable(context, e)
        } else {
            PublishError::retriable(context, e)
        }
    })
}

/// The broker answered and said no (a channel-level refusal: 403 access
/// refused, 404 not found, 406 precondition failed), as opposed to a link
/// that broke.
pub fn refused(error: &lapin::Error) -> bool {
    match error {
        lapin::Error::ProtocolError(e) => {
            matches!(e.get_id(), 403..=406)
        }
        _ => false,
    }
}
