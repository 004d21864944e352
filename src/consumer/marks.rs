//! Drain marks: when a destination was last seen drained, for the relay's
//! re-drive gate ([`crate::queue::routing::redrive`]).
//!
//! A mark says: every message published to this partition before
//! `drained_at` has been taken. Every [`CHECK_EVERY`] a running consumer asks
//! its broker, and writes a row for **every** partition of its destination,
//! drained or not: a partition not found drained keeps its mark, or gets
//! `'-infinity'` if it has none, so the gate's `min(drained_at)` covers a
//! partition that never drained instead of ignoring it. A drain is either
//! an instant of no lag or a **watermark** passed, so a consumer that is
//! never idle (always a few messages behind) still records marks that
//! trail by about one check plus its lag:
//!
//! - **Kafka:** the group's committed offset (none: the partition's first
//!   offset) has reached the end the broker reported for the partition, at
//!   `T`, in this check (`drained_at = T`, zero lag) or in an earlier one
//!   whose end `E` the checker remembered: once the committed offset reaches
//!   `E`, every message published before `T` was handled, so
//!   `drained_at = T`, and the check's own end and instant become the next
//!   watermark. A consumer commits a message's offset only once its job was
//!   handled, so this says *handled*, for the whole group, partitions of
//!   departed members included.
//! - **RabbitMQ** (one queue, partition 0): a passive declare sent at `T`
//!   reports no ready message (`drained_at = T`), or it reported `N` ready
//!   and this consumer has since received at least `N + prefetch` first
//!   deliveries (`redelivered` unset), counted from when the declare
//!   answered. The rule leans on the queue's order: messages ready at `T`
//!   are ahead of those published later, so the `N` first deliveries after
//!   them include every one of them or one published later, behind them.
//!   Deliveries the broker had sent before it counted but that reach this
//!   consumer only after (at most its prefetch, unacked meanwhile) are made
//!   up by the `+ prefetch`; redeliveries (a requeued message, which can
//!   go back ahead of others) are not counted at all, nor are other
//!   consumers' deliveries, so the count only errs late. It says
//!   *delivered*, not handled (as the no-ready-message rule does), and holds
//!   for the plain FIFO queues almanac declares, not for priority queues.
//!   The watermark lasts one session (a reconnect starts a new count).
//!
//! A drain is written as that instant in the database's time (`now()` less
//! the time since), one statement a check, never one a message; the latest
//! instant is kept. A consumer that cannot reach its broker or database
//! writes nothing, so its destination's marks go stale and re-drive holds
//! it back.
//!
//! **Limit: marks are not keyed by consumer group.** On Kafka, a drain by
//! any group that reads the topic counts: a second group's drains can open
//! the gate while the group that runs the jobs is down.
//!
//! Why the broker is asked, and librdkafka's partition EOF
//! (`enable.partition.eof`) is not used: EOF is emitted once per end offset,
//! so a consumer idle at the end sees no new one, and a message lost while
//! its destination is quiet would never be re-driven; nor does it say when
//! the end was reached (it can wait behind a long job). Likewise a RabbitMQ
//! consumer that merely received nothing for a while may be on a dead
//! connection; a passive declare that answers is the broker's own word.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::Channel;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::PgPool;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::broker::{SinkError, SinkKind};

/// How often a running consumer checks whether its destination is drained.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Every partition of a destination, each with the instant as of which a
/// check found it drained (`None`: not drained as far as it can tell).
pub type Seen = Vec<(i32, Option<Instant>)>;

/// Records one check of `destination`: a partition drained as of an
/// instant keeps the later of that and its mark; one not drained keeps its
/// mark, or gets `'-infinity'` if it has none.
pub async fn record(
    pool: &PgPool,
    sink: SinkKind,
    destination: &str,
    seen: &[(i32, Option<Instant>)],
) -> Result<(), sqlx::Error> {
    let partitions: Vec<i32> = seen.iter().map(|(p, _)| *p).collect();
    let ages: Vec<Option<i64>> = seen
        .iter()
        .map(|(_, at)| at.map(|at| i64::try_from(at.elapsed().as_micros()).unwrap_or(i64::MAX)))
        .collect();
    sqlx::query(
        r#"
        INSERT INTO almanac.consumer_marks AS m (sink, destination, partition, drained_at, updated_at)
        SELECT $1, $2, t.p,
            coalesce(now() - t.age * interval '1 microsecond', '-infinity'::timestamptz), now()
        FROM unnest($3::int[], $4::bigint[]) AS t(p, age)
        ON CONFLICT (sink, destination, partition) DO UPDATE
        SET drained_at = greatest(m.drained_at, excluded.drained_at), updated_at = excluded.updated_at
        "#,
    )
    .bind(sink.as_str())
    .bind(destination)
    .bind(&partitions)
    .bind(&ages)
    .execute(pool)
    .await?;
    Ok(())
}

/// Checks every [`CHECK_EVERY`] (never two at once) and records what
/// `check` finds, until `shutdown`. Failures are told once a spell.
pub async fn watch<F, Fut>(
    pool: PgPool,
    sink: SinkKind,
    destination: String,
    shutdown: CancellationToken,
    mut check: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Seen, String>>,
{
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let round = async {
            let seen = check().await?;
            if seen.is_empty() {
                return Ok(());
            }
            record(&pool, sink, &destination, &seen)
                .await
                .map_err(|e| format!("cannot record the drain: {e}"))
        };
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            result = round => result,
        };
        match result {
            Ok(()) if failing => {
                failing = false;
                info!(%sink, %destination, "checking whether the destination is drained works again");
            }
            Ok(()) => {}
            Err(err) if !failing => {
                failing = true;
                warn!(%sink, %destination, %err, "cannot check whether the destination is drained; until this consumer can, re-drive relies on other consumers' checks and holds the destination back without them");
            }
            Err(_) => {}
        }
    }
}

/// A client that reads `group`'s committed offsets and the ends of
/// partitions; it never joins the group.
pub fn kafka_client(brokers: &str, group: &str) -> Result<Arc<BaseConsumer>, SinkError> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .map(Arc::new)
        .map_err(|e| {
            SinkError::Broker(format!(
                "cannot create a Kafka client for drain checks on {brokers}: {e}"
            ))
        })
}

/// One partition as a check read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KafkaReading {
    pub partition: i32,
    /// The group's committed offset (none: the partition's first offset),
    /// read before `end`.
    pub taken: i64,
    /// The partition's end offset.
    pub end: i64,
    /// When `end` was asked for.
    pub at: Instant,
}

/// Every partition of `topic`: the group's committed offset and the end.
/// Blocking: run it off the async threads.
pub fn kafka_read(
    client: &BaseConsumer,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<KafkaReading>, String> {
    let metadata = client
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| format!("cannot read the partitions of `{topic}`: {e}"))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    if partitions.is_empty() {
        return Ok(Vec::new());
    }
    let mut asked = TopicPartitionList::new();
    for &p in &partitions {
        asked.add_partition(topic, p);
    }
    // Read before the ends: a committed offset only grows, so one that
    // reaches an end read later reached it then too.
    let committed = client
        .committed_offsets(asked, timeout)
        .map_err(|e| format!("cannot read the committed offsets of `{topic}`: {e}"))?;
    let mut readings = Vec::with_capacity(partitions.len());
    for partition in partitions {
        let at = Instant::now();
        let (first, end) = client
            .fetch_watermarks(topic, partition, timeout)
            .map_err(|e| format!("cannot read the end of `{topic}` [{partition}]: {e}"))?;
        let taken = match committed
            .find_partition(topic, partition)
            .map(|e| e.offset())
        {
            Some(Offset::Offset(n)) => n,
            _ => first,
        };
        readings.push(KafkaReading {
            partition,
            taken,
            end,
            at,
        });
    }
    Ok(readings)
}

/// A Kafka checker's watermarks: per partition, an end offset read at an
/// instant, waiting for the committed offset to reach it (module doc).
#[derive(Debug, Default)]
pub struct KafkaWatermarks(HashMap<i32, (i64, Instant)>);

impl KafkaWatermarks {
    /// Every partition read, with the instant as of which it is drained.
    pub fn observe(&mut self, readings: &[KafkaReading]) -> Seen {
        readings
            .iter()
            .map(|r| {
                if r.taken >= r.end {
                    self.0.remove(&r.partition);
                    return (r.partition, Some(r.at));
                }
                let drained = match self.0.get(&r.partition) {
                    Some(&(end, at)) if r.taken >= end => Some(at),
                    Some(_) => return (r.partition, None),
                    None => None,
                };
                self.0.insert(r.partition, (r.end, r.at));
                (r.partition, drained)
            })
            .collect()
    }
}

/// How many messages `queue` holds ready, and when the broker was asked.
pub async fn rabbitmq_ready(
    channel: &Channel,
    queue: &str,
    timeout: Duration,
) -> Result<(u32, Instant), String> {
    let at = Instant::now();
    let passive = QueueDeclareOptions {
        passive: true,
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let declared = tokio::time::timeout(
        timeout,
        channel.queue_declare(queue, passive, FieldTable::default()),
    )
    .await
    .map_err(|_| {
        format!("RabbitMQ did not say within {timeout:?} how many messages `{queue}` holds")
    })?
    .map_err(|e| format!("cannot ask RabbitMQ how many messages `{queue}` holds: {e}"))?;
    Ok((declared.message_count(), at))
}

/// A RabbitMQ checker's watermark: `ready` messages at `at`, when this
/// consumer had received `delivered` first deliveries (module doc).
#[derive(Debug)]
pub struct RabbitmqWatermark {
    prefetch: u64,
    pending: Option<(u64, u64, Instant)>,
}

impl RabbitmqWatermark {
    pub fn new(prefetch: u16) -> Self {
        RabbitmqWatermark {
            prefetch: u64::from(prefetch),
            pending: None,
        }
    }

    /// A check: `ready` messages as of `at`, and this consumer's first
    /// deliveries counted once the broker answered. The instant as of which
    /// the queue is drained, if it is.
    pub fn observe(&mut self, ready: u32, at: Instant, delivered: u64) -> Option<Instant> {
        if ready == 0 {
            self.pending = None;
            return Some(at);
        }
        let drained = match self.pending {
            Some((n, since, then)) if delivered.saturating_sub(since) >= n + self.prefetch => {
                Some(then)
            }
            Some(_) => return None,
            None => None,
        };
        self.pending = Some((u64::from(ready), delivered, at));
        drained
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(partition: i32, taken: i64, end: i64, at: Instant) -> KafkaReading {
        KafkaReading {
            partition,
            taken,
            end,
            at,
        }
    }

    /// A group always a few messages behind records drains that trail by a
    /// check, not none; a partition that does not move records none.
    #[test]
    fn kafka_watermarks_advance_under_constant_lag() {
        let t0 = Instant::now();
        let t = |s: u64| t0 + Duration::from_secs(s);
        let mut marks = KafkaWatermarks::default();
        // Partition 0 stays 5 behind an end growing by 10 a check;
        // partition 1 is drained; partition 2 is stuck at 0.
        assert_eq!(
            marks.observe(&[
                reading(0, 5, 10, t(0)),
                reading(1, 7, 7, t(0)),
                reading(2, 0, 3, t(0))
            ]),
            [(0, None), (1, Some(t(0))), (2, None)]
        );
        assert_eq!(
            marks.observe(&[
                reading(0, 15, 20, t(1)),
                reading(1, 7, 9, t(1)),
                reading(2, 0, 4, t(1))
            ]),
            [(0, Some(t(0))), (1, None), (2, None)]
        );
        // Not yet at 20 (the end read at t(1)): nothing, and the watermark stays.
        assert_eq!(
            marks.observe(&[
                reading(0, 19, 30, t(2)),
                reading(1, 8, 9, t(2)),
                reading(2, 0, 5, t(2))
            ]),
            [(0, None), (1, None), (2, None)]
        );
        assert_eq!(
            marks.observe(&[
                reading(0, 25, 40, t(3)),
                reading(1, 9, 12, t(3)),
                reading(2, 0, 6, t(3))
            ]),
            [(0, Some(t(1))), (1, Some(t(1))), (2, None)]
        );
        assert_eq!(
            marks.observe(&[reading(0, 40, 50, t(4))]),
            [(0, Some(t(3)))]
        );
    }

    /// A queue never empty: drained as of a check once this consumer has
    /// had as many first deliveries since as were ready then, plus its
    /// prefetch (deliveries it may not have seen yet).
    #[test]
    fn rabbitmq_watermark_needs_the_ready_count_plus_prefetch() {
        let t0 = Instant::now();
        let t = |s: u64| t0 + Duration::from_secs(s);
        let mut mark = RabbitmqWatermark::new(4);
        assert_eq!(mark.observe(0, t(0), 0), Some(t(0)));
        assert_eq!(mark.observe(10, t(1), 3), None);
        // 13 since t(1): not 10 + 4.
        assert_eq!(mark.observe(12, t(2), 16), None);
        assert_eq!(mark.observe(12, t(3), 17), Some(t(1)));
        // The next watermark counts from 17.
        assert_eq!(mark.observe(9, t(4), 30), None);
        assert_eq!(mark.observe(9, t(5), 33), Some(t(3)));
        // Empty at last: drained now, whatever the count.
        assert_eq!(mark.observe(0, t(6), 33), Some(t(6)));
        assert_eq!(mark.observe(5, t(7), 33), None);
    }

    /// The gate covers partitions that never drained: a check writes every
    /// partition, `'-infinity'` for one without a mark, and keeps the mark of
    /// one not drained this time.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn a_partition_that_never_drained_holds_redrive_back(pool: PgPool) {
        use crate::queue::{self, routing, NewJob};
        use crate::relay::outbox;
        use crate::relay::routes::{self, RouteMode};

        let after = Duration::from_secs(60);
        routes::set(
            &mut pool.acquire().await.unwrap(),
            "task",
            RouteMode::Broker,
            Some(SinkKind::Kafka),
            Some("lagging"),
        )
        .await
        .unwrap();
        queue::enqueue_many(
            &mut pool.acquire().await.unwrap(),
            &[NewJob::new("task").idempotency_key("stranded")],
        )
        .await
        .unwrap();
        let claimed = outbox::claim(&pool, SinkKind::Kafka, 10, after)
            .await
            .unwrap();
        let outcomes = outbox::Outcomes::all_published(&claimed.rows);
        outbox::mark(&pool, claimed.token, &outcomes).await.unwrap();
        for backdate in [
            "UPDATE almanac.jobs SET run_at = now() - interval '10 minutes'",
            "UPDATE almanac.outbox_batches SET published_at = now() - interval '10 minutes'",
        ] {
            sqlx::query(backdate).execute(&pool).await.unwrap();
        }
        let marks = || async {
            let rows: Vec<(i32, String)> = sqlx::query_as(
                "SELECT partition, CASE WHEN drained_at = '-infinity' THEN 'never' \
                 WHEN drained_at > now() - interval '1 minute' THEN 'fresh' ELSE 'old' END \
                 FROM almanac.consumer_marks WHERE destination = 'lagging' ORDER BY partition",
            )
            .fetch_all(&pool)
            .await
            .unwrap();
            rows.into_iter()
                .map(|(p, s)| format!("{p}:{s}"))
                .collect::<Vec<_>>()
        };
        let held = || async {
            let step = routing::redrive(&pool, "kafka", after, None).await.unwrap();
            (step.redriven, step.held.len())
        };
        // Partitions 0 and 1 drain at every check; 2 never does.
        let now = Instant::now();
        for _ in 0..3 {
            let seen = [(0, Some(now)), (1, Some(now)), (2, None)];
            record(&pool, SinkKind::Kafka, "lagging", &seen)
                .await
                .unwrap();
        }
        assert_eq!(marks().await, ["0:fresh", "1:fresh", "2:never"]);
        assert_eq!(
            held().await,
            (0, 1),
            "re-drive copied a message partition 2 may hold"
        );
        // A partition that drained once, long ago, and not since keeps that mark.
        sqlx::query(
            "UPDATE almanac.consumer_marks SET drained_at = now() - interval '20 minutes' \
             WHERE partition = 2",
        )
        .execute(&pool)
        .await
        .unwrap();
        record(
            &pool,
            SinkKind::Kafka,
            "lagging",
            &[(0, Some(now)), (1, None), (2, None)],
        )
        .await
        .unwrap();
        assert_eq!(marks().await, ["0:fresh", "1:fresh", "2:old"]);
        assert_eq!(held().await, (0, 1));
        // Partition 2 drains: the job is truly stranded and re-driven.
        record(
            &pool,
            SinkKind::Kafka,
            "lagging",
            &[(0, None), (1, None), (2, Some(now))],
        )
        .await
        .unwrap();
        assert_eq!(marks().await, ["0:fresh", "1:fresh", "2:fresh"]);
        assert_eq!(held().await, (1, 0));
    }
}
