//! Drain marks: when a destination was last seen drained, for the relay's
//! re-drive gate ([`crate::queue::routing::redrive`]).
//!
//! Every [`CHECK_EVERY`] a running consumer asks its broker whether every
//! message published to its destination before that moment has been taken:
//!
//! - **Kafka:** for each partition of the topic, the group's committed
//!   offset (none: the partition's first offset) has reached the end the
//!   broker reports for it. A consumer commits a message's offset only once
//!   its job was handled, so this says *handled*, for the whole group,
//!   partitions of departed members included.
//! - **RabbitMQ** (one queue, partition 0): a passive declare reports no
//!   ready message: every message published before was *delivered* to a
//!   consumer.
//!
//! A yes is written as `drained_at` = when the question was sent, in the
//! database's time (`now()` less the time since), one statement a check,
//! never one a message; the latest instant is kept. A consumer that cannot
//! reach its broker or database writes nothing, so its destination's marks
//! go stale and re-drive holds it back.
//!
//! Why the broker is asked, and librdkafka's partition EOF
//! (`enable.partition.eof`) is not used: EOF is emitted once per end offset,
//! so a consumer idle at the end sees no new one, and a message lost while
//! its destination is quiet would never be re-driven; nor does it say when
//! the end was reached (it can wait behind a long job). Likewise a RabbitMQ
//! consumer that merely received nothing for a while may be on a dead
//! connection; a passive declare that answers is the broker's own word.

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

/// Partitions found drained, each with the instant the broker was asked.
type Drained = Vec<(i32, Instant)>;

/// Records that `destination`'s partitions were drained as of the instants
/// given (keeping any later mark).
pub async fn record(
    pool: &PgPool,
    sink: SinkKind,
    destination: &str,
    drained: &[(i32, Instant)],
) -> Result<(), sqlx::Error> {
    let partitions: Vec<i32> = drained.iter().map(|(p, _)| *p).collect();
    let ages: Vec<i64> = drained
        .iter()
        .map(|(_, at)| i64::try_from(at.elapsed().as_micros()).unwrap_or(i64::MAX))
        .collect();
    sqlx::query(
        r#"
        INSERT INTO almanac.consumer_marks AS m (sink, destination, partition, drained_at, updated_at)
        SELECT $1, $2, t.p, now() - t.age * interval '1 microsecond', now()
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
/// `check` finds drained, until `shutdown`. Failures are told once a spell.
pub async fn watch<F, Fut>(
    pool: PgPool,
    sink: SinkKind,
    destination: String,
    shutdown: CancellationToken,
    mut check: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Drained, String>>,
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
            let drained = check().await?;
            if drained.is_empty() {
                return Ok(());
            }
            record(&pool, sink, &destination, &drained)
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

/// The partitions of `topic` whose committed offset (none: the first
/// offset) has reached the end, each as of when its end was asked for.
/// Blocking: run it off the async threads.
pub fn kafka_drained(
    client: &BaseConsumer,
    topic: &str,
    timeout: Duration,
) -> Result<Drained, String> {
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
    let mut drained = Vec::new();
    for p in partitions {
        let at = Instant::now();
        let (first, end) = client
            .fetch_watermarks(topic, p, timeout)
            .map_err(|e| format!("cannot read the end of `{topic}` [{p}]: {e}"))?;
        let taken = match committed.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(n)) => n,
            _ => first,
        };
        if taken >= end {
            drained.push((p, at));
        }
    }
    Ok(drained)
}

/// Partition 0 of `queue` when it has no ready message, as of when the
/// broker was asked.
pub async fn rabbitmq_drained(
    channel: &Channel,
    queue: &str,
    timeout: Duration,
) -> Result<Drained, String> {
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
    Ok(if declared.message_count() == 0 {
        vec![(0, at)]
    } else {
        Vec::new()
    })
}
