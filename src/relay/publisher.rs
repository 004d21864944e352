//! A publisher that speaks to either sink and says, per row, whether the
//! broker acknowledged it. One row's trouble stays that row's: a message over
//! the size limit or a destination that cannot be prepared fails only the
//! rows concerned; the others of the batch go out.
//!
//! Every wait on a broker (connecting, declaring or creating a destination,
//! writing, acknowledgements) ends at the sooner of `ack_timeout` from its
//! start and the batch's [`Deadline`]: a broker that stops answering, or
//! blocks publishers, never holds a batch past its in-flight lease.

use std::collections::HashMap;
use std::time::Duration;

use futures::future::join_all;
use tokio::time::Instant;

use super::kafka::{KafkaInFlight, KafkaPublisher};
use super::rabbitmq::{self, RabbitPublisher};
use super::OutboxRow;
use crate::broker::{Plain, PublishError, SinkConfig, SinkError, SinkKind};

pub struct Publisher {
    inner: Inner,
    max_message_bytes: usize,
}

enum Inner {
    Kafka(KafkaPublisher),
    Rabbit(Box<RabbitPublisher>),
}

impl Publisher {
    pub fn new(sink: SinkKind, config: &SinkConfig) -> Result<Publisher, SinkError> {
        let inner = match sink {
            SinkKind::Kafka => {
                Inner::Kafka(KafkaPublisher::new(config.kafka()?.to_string(), config)?)
            }
            SinkKind::Rabbitmq => {
                let url = config.amqp()?.to_string();
                Inner::Rabbit(Box::new(RabbitPublisher::new(url, config)))
            }
        };
        Ok(Publisher {
            inner,
            max_message_bytes: config.max_message_bytes,
        })
    }

    pub fn sink(&self) -> SinkKind {
        match self.inner {
            Inner::Kafka(_) => SinkKind::Kafka,
            Inner::Rabbit(_) => SinkKind::Rabbitmq,
        }
    }

    /// Whether the broker blocks this publisher (RabbitMQ's
    /// `connection.blocked`, sent on a memory or disk alarm): nothing is
    /// written until it lifts, and batches fail retriable at once.
    pub fn blocked(&self) -> bool {
        match &self.inner {
            Inner::Kafka(_) => false,
            Inner::Rabbit(p) => p.blocked(),
        }
    }

    /// Makes sure the destination exists (topic; exchange, queue and
    /// binding), within `ack_timeout`.
    pub async fn ensure(&mut self, destination: &str) -> Result<(), PublishError> {
        self.ensure_by(destination, Deadline::none()).await
    }

    /// [`Publisher::ensure`], giving up at `by` if sooner.
    pub async fn ensure_by(&mut self, destination: &str, by: Deadline) -> Result<(), PublishError> {
        match &mut self.inner {
            Inner::Kafka(p) => p.ensure(destination, by).await,
            Inner::Rabbit(p) => p.ensure(destination, by).await,
        }
    }

    /// One result per row, in order: `Ok` only for an acknowledged publish.
    /// Rows over `max_message_bytes` fail [`PublishError::Fatal`] without
    /// being sent. Each wait on the broker is bounded by `ack_timeout` only.
    pub async fn publish(&mut self, rows: &[OutboxRow]) -> Vec<Result<(), PublishError>> {
        self.publish_by(rows, Deadline::none()).await
    }

    /// [`Publisher::publish`], done with the broker by `by`: rows not
    /// acknowledged by then are [`PublishError::Retriable`] (maybe sent).
    pub async fn publish_by(
        &mut self,
        rows: &[OutboxRow],
        by: Deadline,
    ) -> Vec<Result<(), PublishError>> {
        let in_flight = self.send(rows, by).await;
        let results = in_flight.acks(rows).await;
        self.settle(rows, &results);
        results
    }

    /// Prepares the destinations and hands `rows` to the broker without
    /// waiting for acknowledgements: those come with [`InFlight::acks`], and
    /// another batch may be sent meanwhile. Call [`Publisher::settle`] with
    /// the results. Nothing here or in [`InFlight::acks`] waits past `by`:
    /// rows whose destination is not ready by then are not sent, and
    /// acknowledgements still missing then count as "maybe sent".
    pub async fn send(&mut self, rows: &[OutboxRow], by: Deadline) -> InFlight {
        let max_message_bytes = self.max_message_bytes;
        let mut early: Vec<Option<Result<(), PublishError>>> = vec![None; rows.len()];
        let mut prepared: HashMap<&str, Result<(), PublishError>> = HashMap::new();
        let mut to_send = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            if row.payload.len() > max_message_bytes {
                early[i] = Some(Err(too_large(row, max_message_bytes)));
                continue;
            }
            if !prepared.contains_key(row.destination.as_str()) {
                let result = if by.passed() {
                    Err(by.missed("not sent"))
                } else {
                    self.ensure_by(&row.destination, by).await
                };
                prepared.insert(&row.destination, result);
            }
            match &prepared[row.destination.as_str()] {
                Ok(()) => to_send.push(i),
                Err(e) => early[i] = Some(Err(e.clone())),
            }
        }
        let batch: Vec<&OutboxRow> = to_send.iter().map(|&i| &rows[i]).collect();
        let acks = match &mut self.inner {
            _ if batch.is_empty() => Acks::Nothing,
            _ if by.passed() => {
                let missed = by.missed("not sent");
                for &i in &to_send {
                    early[i] = Some(Err(missed.clone()));
                }
                to_send.clear();
                Acks::Nothing
            }
            Inner::Kafka(p) => Acks::Kafka(p.send(&batch, by).await),
            Inner::Rabbit(p) => Acks::Rabbit(p.send(&batch, by).await),
        };
        InFlight {
            early,
            sent: to_send,
            acks,
        }
    }

    /// The publisher's own bookkeeping once a batch's results are in
    /// (reconnect, recreate the producer, declare again).
    pub fn settle(&mut self, rows: &[OutboxRow], results: &[Result<(), PublishError>]) {
        match &mut self.inner {
            Inner::Kafka(p) => p.settle(results),
            Inner::Rabbit(p) => {
                let rows: Vec<&OutboxRow> = rows.iter().collect();
                p.settle(&rows, results)
            }
        }
    }

    /// Waits for anything in flight (Kafka) before shutdown.
    pub async fn flush(&mut self) {
        match &mut self.inner {
            Inner::Kafka(p) => p.flush().await,
            Inner::Rabbit(p) => p.close().await,
        }
    }
}

/// A batch handed to the broker, its acknowledgements still to come.
pub struct InFlight {
    /// Results known before sending (too large, destination not prepared).
    early: Vec<Option<Result<(), PublishError>>>,
    /// The rows handed to the broker, by index.
    sent: Vec<usize>,
    acks: Acks,
}

enum Acks {
    /// No row was handed to the broker.
    Nothing,
    Kafka(KafkaInFlight),
    Rabbit(Vec<rabbitmq::Pending>),
}

impl InFlight {
    /// One result per row of `rows` (the batch sent), in order, once every
    /// acknowledgement is in (or its deadline passed).
    pub async fn acks(self, rows: &[OutboxRow]) -> Vec<Result<(), PublishError>> {
        let mut results = self.early;
        let acked = match self.acks {
            Acks::Nothing => Vec::new(),
            Acks::Kafka(in_flight) => {
                let topics = self.sent.iter().map(|&i| rows[i].destination.as_str());
                in_flight.results(topics).await
            }
            Acks::Rabbit(pending) => join_all(pending).await,
        };
        for (&i, result) in self.sent.iter().zip(acked) {
            results[i] = Some(result);
        }
        results
            .into_iter()
            .map(|r| r.expect("every row has a result"))
            .collect()
    }
}

/// When a batch must be done with the broker: its in-flight lease, less
/// the time its mark needs. Past it the batch is given up (its rows are
/// retried), so a batch is never held past its lease, whatever the broker
/// does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline(pub Instant);

impl Deadline {
    /// No deadline of the batch's own: each wait is bounded by its timeout.
    pub fn none() -> Deadline {
        // About 30 years: far enough, and `Instant` arithmetic stays in range.
        Deadline(Instant::now() + Duration::from_secs(86_400 * 365 * 30))
    }

    /// The end of one wait on the broker that may take `timeout`.
    pub fn wait(self, timeout: Duration) -> Instant {
        self.0.min(Instant::now() + timeout)
    }

    pub fn passed(self) -> bool {
        Instant::now() >= self.0
    }

    /// The error for rows the deadline cut short (`what`: "not sent",
    /// "maybe sent").
    pub fn missed(self, what: &str) -> PublishError {
        PublishError::retriable(
            format!("gave the batch up at its deadline ({what})"),
            Plain(
                "its in-flight lease was running out: the broker was too slow or did not answer"
                    .into(),
            ),
        )
    }

    /// The error for a wait on the broker that ended at [`Deadline::wait`]
    /// of `timeout`: the batch's deadline, or the timeout.
    pub fn timed_out(self, context: &str, timeout: Duration, what: &str) -> PublishError {
        if self.passed() {
            self.missed(what)
        } else {
            PublishError::retriable(
                format!("{context} ({what})"),
                Plain(format!("no answer within {timeout:?}")),
            )
        }
    }
}

fn too_large(row: &OutboxRow, limit: usize) -> PublishError {
    PublishError::fatal(
        format!(
            "the message for `{}` is {} bytes, over the {limit}-byte limit",
            row.destination,
            row.payload.len()
        ),
        Plain(
            "raise --max-message-bytes (and the broker's own limit) or send a smaller payload"
                .into(),
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_ends_at_its_timeout_or_the_deadline_whichever_comes_first() {
        let now = Instant::now();
        let soon = Deadline(now + Duration::from_secs(1));
        assert!(soon.wait(Duration::from_secs(10)) <= now + Duration::from_secs(1));
        let later = Deadline::none();
        assert!(later.wait(Duration::from_secs(10)) > now + Duration::from_secs(9));
        assert!(!later.passed());
    }

    #[test]
    fn a_wait_cut_short_by_the_deadline_says_so() {
        let passed = Deadline(Instant::now());
        assert!(passed.passed());
        assert_eq!(
            passed
                .timed_out("no publisher confirm in time", Duration::from_secs(10), "maybe sent")
                .reason(),
            "gave the batch up at its deadline (maybe sent): its in-flight lease was running out: the broker was too slow or did not answer"
        );
        let timed_out = Deadline::none().timed_out(
            "no publisher confirm in time",
            Duration::from_secs(10),
            "maybe sent",
        );
        assert!(matches!(timed_out, PublishError::Retriable { .. }));
        assert_eq!(
            timed_out.reason(),
            "no publisher confirm in time (maybe sent): no answer within 10s"
        );
    }
}
