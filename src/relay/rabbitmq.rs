//! RabbitMQ: persistent messages to the destination's durable exchange
//! (declared by [`crate::broker::rabbitmq::declare`]) with `message_id` =
//! idempotency key and the job facts in headers; `mandatory`, so an
//! unroutable message comes back, and an ack that carries a returned message
//! counts as [`PublishError::Unroutable`]. The whole batch is written to the
//! channel at once and its publisher confirms are awaited together, under one
//! deadline (`ack_timeout`, or the batch's [`Deadline`] if sooner), while
//! the relay writes the next batch. Any channel error drops the connection;
//! the next batch reconnects.
//!
//! **A blocked broker.** On a memory or disk alarm RabbitMQ sends
//! `connection.blocked` and stops reading from publishing connections;
//! lapin then writes nothing (heartbeats and closes included) until
//! `connection.unblocked`. Every wait here has a deadline, so a batch that
//! was being written or confirmed when the alarm came fails retriable
//! ("maybe sent": frames still in lapin's buffer go out when the alarm
//! lifts). While the connection is blocked nothing more is written: a
//! batch fails retriable at once, naming the alarm, and the connection is
//! kept (a new one would be blocked at its first publish, with a batch in
//! its buffer). So after an alarm a row has at most one extra copy.

use std::collections::HashSet;
use std::time::Duration;

use futures::future::join_all;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use tokio::time::{timeout_at, Instant};
use tracing::warn;

use super::publisher::Deadline;
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

    /// Whether RabbitMQ told this publisher's connection that it blocks
    /// publishers (`connection.blocked`). A connection that broke while
    /// blocked keeps lapin's flag: it does not count (the next batch
    /// reconnects).
    pub fn blocked(&self) -> bool {
        self.link.as_ref().is_some_and(|(conn, _)| {
            let status = conn.status();
            status.connected() && status.blocked()
        })
    }

    async fn channel(&mut self, by: Deadline) -> Result<Channel, PublishError> {
        if let Some((conn, channel)) = &self.link {
            if conn.status().connected() && channel.status().connected() {
                if conn.status().blocked() {
                    return Err(blocked("not sent"));
                }
                return Ok(channel.clone());
            }
        }
        self.link = None;
        self.ensured.clear();
        if by.passed() {
            return Err(by.missed("not sent"));
        }
        let limit = by
            .wait(self.ack_timeout)
            .saturating_duration_since(Instant::now());
        let (conn, channel) = connect(&self.url, limit).await.map_err(|e| match e {
            _ if by.passed() => by.missed("not sent"),
            SinkError::Publish(e) => e,
            other => PublishError::retriable("RabbitMQ is unreachable", Plain(other.to_string())),
        })?;
        match timeout_at(
            by.wait(self.ack_timeout),
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(PublishError::retriable(
                    "RabbitMQ refused publisher confirms",
                    e,
                ))
            }
            Err(_) => {
                return Err(by.timed_out(
                    "RabbitMQ did not turn on publisher confirms",
                    self.ack_timeout,
                    "not sent",
                ))
            }
        }
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

    pub async fn ensure(&mut self, destination: &str, by: Deadline) -> Result<(), PublishError> {
        if self.ensured.contains(destination) {
            return Ok(());
        }
        let channel = self.channel(by).await?;
        match timeout_at(
            by.wait(self.ack_timeout),
            declare_destination(&channel, destination),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                // A refused declare closes the channel too.
                self.broken("declare failed");
                return Err(e);
            }
            Err(_) if self.blocked() => return Err(blocked("not sent")),
            Err(_) => {
                self.broken("declare timed out");
                return Err(by.timed_out(
                    &format!("RabbitMQ did not declare `{destination}`"),
                    self.ack_timeout,
                    "not sent",
                ));
            }
        }
        self.ensured.insert(destination.to_string());
        Ok(())
    }

    /// Writes `rows` (whose destinations are prepared) to the channel, in
    /// order; one future per row resolves with its publisher confirm. The
    /// writes and the confirms share one deadline: `ack_timeout` from now,
    /// or `by` if sooner.
    pub async fn send(&mut self, rows: &[&OutboxRow], by: Deadline) -> Vec<Pending> {
        let fail_all = |e: PublishError| -> Vec<Pending> {
            rows.iter()
                .map(|_| Box::pin(std::future::ready(Err(e.clone()))) as Pending)
                .collect()
        };
        let channel = match self.channel(by).await {
            Ok(channel) => channel,
            Err(e) => return fail_all(e),
        };
        let status = match &self.link {
            Some((conn, _)) => conn.status().clone(),
            None => return fail_all(blocked("not sent")),
        };
        let ack_timeout = self.ack_timeout;
        let deadline = by.wait(ack_timeout);
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
        // lapin queues each message's frames when its future is first
        // polled; the await is for their writing, which a blocked
        // connection holds back: what is not written by the deadline goes
        // out when (if) the connection can write again.
        let Ok(written) = timeout_at(deadline, join_all(publishes)).await else {
            return fail_all(if status.blocked() {
                blocked("maybe sent")
            } else {
                by.timed_out("RabbitMQ did not take the batch", ack_timeout, "maybe sent")
            });
        };
        written
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
                let status = status.clone();
                Box::pin(async move {
                    match timeout_at(deadline, confirm).await {
                        Err(_) if status.blocked() => Err(blocked("maybe sent")),
                        Err(_) => Err(by.timed_out(
                            "no publisher confirm in time",
                            ack_timeout,
                            "maybe sent",
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
    /// after retriable failures (unless RabbitMQ blocks it: it is not
    /// broken, and a new one would be blocked too, with a batch written into
    /// it), destinations whose messages came back are declared again before
    /// the next try.
    pub fn settle(&mut self, rows: &[&OutboxRow], results: &[Result<(), PublishError>]) {
        if !self.blocked()
            && results
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

    /// Closes the connection, within `ack_timeout`. A blocked connection
    /// cannot write its close: it is dropped instead.
    pub async fn close(&mut self) {
        if let Some((conn, _)) = self.link.take() {
            if conn.status().blocked() {
                return;
            }
            let close = conn.close(200, "almanac relay stopping");
            let _ = tokio::time::timeout(self.ack_timeout, close).await;
        }
    }
}

/// What a batch meets while RabbitMQ blocks publishers.
/// `what`: "not sent" or "maybe sent".
fn blocked(what: &str) -> PublishError {
    PublishError::retriable(
        format!("RabbitMQ blocks publishers (connection.blocked: a memory or disk alarm; {what})"),
        Plain(
            "the rows wait and are tried again once the alarm clears; `rabbitmqctl status` lists the alarm"
                .into(),
        ),
    )
}

/// A publish or confirm that failed with the channel: the message may or may
/// not have arrived, and the rest of the batch shares the fate, so it is
/// retried whatever the broker said.
fn link_error(context: &str, error: lapin::Error) -> PublishError {
    PublishError::retriable(context, error)
}
