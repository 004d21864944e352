//! Re-drive does not amplify lag (issue #20, item 4), against the real
//! brokers: while a destination's consumers are away its messages are not
//! copied again however many re-drive periods pass, and once consumers
//! drain it a job whose message is truly gone is re-driven and runs once.
//! (A destination no consumer records drains for is re-driven as before:
//! `relay_faults::a_broker_job_whose_message_was_lost_is_redriven` and the
//! others there.)

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use almanac::consumer::{Consumer, ConsumerConfig};
use almanac::worker::{HandlerError, JobContext, WorkerConfig};

use almanac::queue::routing;
use almanac::queue::{self, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{outbox, Publisher, Relay, RelayConfig, SinkKind};
use almanac::role::{Role, Settings};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::brokers::{self, unique};
use crate::harness::{self, count, eventually};

/// How long a job's message may wait before re-drive looks at it.
const REDRIVE_AFTER: Duration = Duration::from_secs(2);

fn relay_config() -> RelayConfig {
    RelayConfig {
        redrive_after: REDRIVE_AFTER,
        ..brokers::relay_config()
    }
}

fn new_relay(pool: &PgPool, sink: SinkKind) -> Relay {
    Relay::new(
        pool.clone(),
        Publisher::new(sink, &brokers::sinks()).unwrap(),
        relay_config().validated().unwrap(),
    )
}

/// A fresh destination on `sink` (topic or queue created), with kind
/// `task` routed there, broker only.
async fn destination(pool: &PgPool, sink: SinkKind, name: &str) -> String {
    let destination = unique(name);
    let mut publisher = Publisher::new(sink, &brokers::sinks()).unwrap();
    publisher.ensure(&destination).await.unwrap();
    publisher.flush().await;
    routes::set(
        &mut pool.acquire().await.unwrap(),
        "task",
        RouteMode::Broker,
        Some(sink),
        Some(&destination),
    )
    .await
    .unwrap();
    destination
}

async fn enqueue(pool: &PgPool, prefix: &str, n: usize) {
    let mut conn = pool.acquire().await.unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let batch: Vec<NewJob> = chunk
            .iter()
            .map(|i| NewJob::new("task").idempotency_key(format!("{prefix}:{i}")))
            .collect();
        queue::enqueue_many(&mut conn, &batch).await.unwrap();
    }
}

/// Partitions of `destination` with a drain mark newer than `within`.
async fn fresh_marks(pool: &PgPool, destination: &str, within: Duration) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM almanac.consumer_marks \
         WHERE destination = $1 AND drained_at > now() - $2 * interval '1 millisecond'",
    )
    .bind(destination)
    .bind(within.as_millis() as i64)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// How many partitions the harness gives a destination.
fn partitions(sink: SinkKind) -> i64 {
    match sink {
        SinkKind::Kafka => i64::from(brokers::sinks().kafka_partitions),
        SinkKind::Rabbitmq => 1,
    }
}

async fn all_done(pool: &PgPool, n: i64) -> Result<(), String> {
    let states: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM almanac.jobs GROUP BY 1 ORDER BY 1")
            .fetch_all(pool)
            .await
            .unwrap();
    if states == [("done".to_string(), n)] {
        Ok(())
    } else {
        Err(format!("{states:?}"))
    }
}

/// Copies of each job's message in `destination`, read to its end.
async fn copies_per_job(sink: SinkKind, destination: &str) -> HashMap<String, usize> {
    let mut copies = HashMap::new();
    for message in brokers::read_to_end(sink, destination, Duration::from_secs(120)).await {
        let id = message
            .headers
            .get(almanac::consumer::JOB_ID_HEADER)
            .cloned();
        *copies.entry(id.expect("a job id header")).or_default() += 1;
    }
    copies
}

/// A consumer runs (so the destination has drain marks) and stops; `n` jobs
/// are published by a relay re-driving every [`REDRIVE_AFTER`], and no
/// consumer comes for `periods` re-drive periods. The broker must hold at
/// most two copies of each job's message (one: the gate held every
/// re-drive back). Then a consumer starts and every job runs exactly once.
async fn an_outage_is_not_amplified(pool: PgPool, sink: SinkKind, n: usize, periods: u32) {
    harness::create_exec_log(&pool).await;
    let log = harness::log_pool(&pool, 4).await;
    let destination = destination(&pool, sink, "amplify").await;

    let brief = CancellationToken::new();
    let consumer = brokers::consumer(&pool, sink, &destination, &["task"], log.clone());
    let consumer = tokio::spawn(consumer.run(brief.clone()));
    eventually(
        "the consumer records its destination drained",
        Duration::from_secs(60),
        || async {
            fresh_marks(&pool, &destination, Duration::from_secs(60)).await == partitions(sink)
        },
    )
    .await;
    brief.cancel();
    consumer.await.unwrap().unwrap();

    // The outage: jobs are published and nobody consumes them.
    let stop = CancellationToken::new();
    let relay = tokio::spawn(new_relay(&pool, sink).run(stop.clone()));
    enqueue(&pool, "job", n).await;
    eventually("every job published", Duration::from_secs(120), || async {
        count(&pool, "SELECT count(*) FROM almanac.outbox").await == 0
    })
    .await;
    // Not a wait for a condition: the outage itself, during which the
    // relay sweeps for stranded jobs every re-drive period.
    tokio::time::sleep(REDRIVE_AFTER * periods).await;
    let step = routing::redrive(&pool, sink.as_str(), REDRIVE_AFTER, None)
        .await
        .unwrap();
    assert_eq!(
        step.redriven, 0,
        "re-drive copied messages that wait for a consumer"
    );
    assert_eq!(
        step.held
            .iter()
            .map(|h| h.destination.as_str())
            .collect::<Vec<_>>(),
        [destination.as_str()],
        "the destination is held back"
    );
    // The gate is what holds them: without marks, the same step would copy
    // the first 1,000 (rolled back).
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("DELETE FROM almanac.consumer_marks")
        .execute(&mut *tx)
        .await
        .unwrap();
    let ungated = routing::redrive(&mut *tx, sink.as_str(), REDRIVE_AFTER, None)
        .await
        .unwrap();
    assert_eq!(ungated.redriven, n.min(1000) as u64);
    tx.rollback().await.unwrap();

    stop.cancel();
    relay.await.unwrap().unwrap();
    let copies = copies_per_job(sink, &destination).await;
    let mut histogram: Vec<(usize, usize)> = copies
        .values()
        .fold(HashMap::<usize, usize>::new(), |mut h, c| {
            *h.entry(*c).or_default() += 1;
            h
        })
        .into_iter()
        .collect();
    histogram.sort();
    println!(
        "{sink}: {n} jobs, {periods} re-drive periods without a consumer: jobs by copies in the broker {histogram:?}"
    );
    assert_eq!(copies.len(), n, "a job's message is missing");
    assert!(
        copies.values().all(|&c| c <= 2),
        "more than two copies of a job's message: {histogram:?}"
    );

    // Consumers come back. RabbitMQ's queue was emptied by the count above:
    // its jobs are truly stranded now and are re-driven once the consumer
    // drains the queue; Kafka's consumer reads the topic.
    let stop = CancellationToken::new();
    let relay = tokio::spawn(new_relay(&pool, sink).run(stop.clone()));
    let consumer = brokers::consumer(&pool, sink, &destination, &["task"], log.clone());
    let consumer = tokio::spawn(consumer.run(stop.clone()));
    eventually("every job done", Duration::from_secs(300), || {
        all_done(&pool, n as i64)
    })
    .await;
    stop.cancel();
    consumer.await.unwrap().unwrap();
    relay.await.unwrap().unwrap();
    assert_eq!(
        count(&pool, "SELECT count(*) FROM exec_log").await,
        n as i64,
        "a job ran twice"
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT job_id) FROM exec_log").await,
        n as i64
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rabbitmq_outage_is_not_amplified_by_redrive(pool: PgPool) {
    an_outage_is_not_amplified(pool, SinkKind::Rabbitmq, 2_000, 15).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn kafka_outage_is_not_amplified_by_redrive(pool: PgPool) {
    an_outage_is_not_amplified(pool, SinkKind::Kafka, 2_000, 15).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
#[ignore = "10,000 jobs: minutes"]
async fn rabbitmq_outage_over_ten_thousand_jobs_is_not_amplified(pool: PgPool) {
    an_outage_is_not_amplified(pool, SinkKind::Rabbitmq, 10_000, 15).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
#[ignore = "10,000 jobs: minutes"]
async fn kafka_outage_over_ten_thousand_jobs_is_not_amplified(pool: PgPool) {
    an_outage_is_not_amplified(pool, SinkKind::Kafka, 10_000, 15).await;
}

/// With a consumer running and its destination drained, a job whose
/// message never reached the broker (the relay recorded a publication that
/// did not happen) is re-driven and runs once.
async fn a_lost_message_is_redriven_while_consumers_drain(pool: PgPool, sink: SinkKind) {
    harness::create_exec_log(&pool).await;
    let log = harness::log_pool(&pool, 4).await;
    let destination = destination(&pool, sink, "lost").await;
    let stop = CancellationToken::new();
    let consumer = brokers::consumer(&pool, sink, &destination, &["task"], log.clone());
    let consumer = tokio::spawn(consumer.run(stop.clone()));
    eventually(
        "the consumer records its destination drained",
        Duration::from_secs(60),
        || async {
            fresh_marks(&pool, &destination, Duration::from_secs(60)).await == partitions(sink)
        },
    )
    .await;
    enqueue(&pool, "lost", 1).await;
    // Marked published as a relay marks it; no message was sent.
    let claimed = outbox::claim(&pool, sink, 10, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(claimed.rows.len(), 1);
    let outcomes = outbox::Outcomes::all_published(&claimed.rows);
    assert_eq!(
        outbox::mark(&pool, claimed.token, &outcomes)
            .await
            .unwrap()
            .published,
        1
    );
    let relay = tokio::spawn(new_relay(&pool, sink).run(stop.clone()));
    eventually(
        "the lost job is re-driven and done",
        Duration::from_secs(60),
        || all_done(&pool, 1),
    )
    .await;
    stop.cancel();
    consumer.await.unwrap().unwrap();
    relay.await.unwrap().unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM exec_log").await, 1);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rabbitmq_lost_message_is_redriven_once_the_queue_drains(pool: PgPool) {
    a_lost_message_is_redriven_while_consumers_drain(pool, SinkKind::Rabbitmq).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn kafka_lost_message_is_redriven_once_the_topic_drains(pool: PgPool) {
    a_lost_message_is_redriven_while_consumers_drain(pool, SinkKind::Kafka).await;
}

/// The gate itself, without brokers: a destination with marks is re-driven
/// only when every partition was drained within `redrive_after`; one
/// without marks as before.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn redrive_waits_for_every_partition_to_drain(pool: PgPool) {
    let after = Duration::from_secs(60);
    let destination = "gated";
    routes::set(
        &mut pool.acquire().await.unwrap(),
        "task",
        RouteMode::Broker,
        Some(SinkKind::Kafka),
        Some(destination),
    )
    .await
    .unwrap();
    enqueue(&pool, "stranded", 2).await;
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
    let mark = |partition: i32, ago: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO almanac.consumer_marks (sink, destination, partition, drained_at) \
                 VALUES ('kafka', 'gated', $1, now() - $2::interval) \
                 ON CONFLICT (sink, destination, partition) DO UPDATE SET drained_at = excluded.drained_at",
            )
            .bind(partition)
            .bind(ago)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    // Partition 1 was last drained before the jobs were published: their
    // messages may wait there.
    mark(0, "1 second").await;
    mark(1, "20 minutes").await;
    let mut tx = pool.begin().await.unwrap();
    let step = routing::redrive(&mut *tx, "kafka", after, None)
        .await
        .unwrap();
    assert_eq!(step.redriven, 0);
    assert_eq!(step.held.len(), 1);
    assert_eq!(step.held[0].destination, destination);
    assert_eq!(step.held[0].kinds, ["task"]);
    // Without marks: as before.
    sqlx::query("DELETE FROM almanac.consumer_marks")
        .execute(&mut *tx)
        .await
        .unwrap();
    let step = routing::redrive(&mut *tx, "kafka", after, None)
        .await
        .unwrap();
    assert_eq!((step.redriven, step.held.len()), (2, 0));
    tx.rollback().await.unwrap();
    // Drained since on every partition: truly stranded, re-driven once;
    // but not while the kind is paused (its consumers hold its messages),
    // by its own pause or by `*`.
    mark(1, "1 second").await;
    for paused in ["task", "*"] {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("INSERT INTO almanac.kind_pauses (kind, paused_by) VALUES ($1, 'ops')")
            .bind(paused)
            .execute(&mut *tx)
            .await
            .unwrap();
        let step = routing::redrive(&mut *tx, "kafka", after, None)
            .await
            .unwrap();
        assert_eq!(
            step.redriven, 0,
            "a paused kind ({paused}) was copied again"
        );
        tx.rollback().await.unwrap();
    }
    let step = routing::redrive(&pool, "kafka", after, None).await.unwrap();
    assert_eq!((step.redriven, step.held.len()), (2, 0));
    let step = routing::redrive(&pool, "kafka", after, None).await.unwrap();
    assert_eq!(step.redriven, 0, "a fresh row is pending: no second copy");
}

/// Jobs the feeder keeps waiting for a busy consumer.
const BACKLOG: i64 = 50;

/// A consumer whose jobs take `work` each.
fn busy_consumer(pool: &PgPool, sink: SinkKind, destination: &str, log: PgPool) -> Consumer {
    let config = ConsumerConfig {
        sink,
        destination: destination.to_string(),
        group: None,
        worker: WorkerConfig {
            concurrency: 4,
            batch_size: 4,
            lease: Duration::from_secs(10),
            poll_interval: Duration::from_millis(50),
            shutdown_deadline: Duration::from_secs(5),
            ..WorkerConfig::default()
        }
        .validated()
        .unwrap(),
    };
    Consumer::new(pool.clone(), brokers::sinks(), config).register(
        "task",
        move |ctx: JobContext| {
            let log = log.clone();
            Box::pin(async move {
                // The job's work, so that messages wait behind it.
                tokio::time::sleep(Duration::from_millis(5)).await;
                harness::log_exec(&log, ctx.job.id, ctx.job.attempts, 1).await;
                Ok::<(), HandlerError>(())
            }) as Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send>>
        },
    )
}

/// Keeps about [`BACKLOG`] jobs ready (published and waiting for the
/// consumer) until `stop`; returns how many it enqueued.
async fn feed(pool: PgPool, stop: CancellationToken) -> usize {
    let mut fed = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    while !stop.is_cancelled() {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let ready = count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'ready'",
        )
        .await;
        let more = (BACKLOG - ready).max(0) as usize;
        if more > 0 {
            let mut conn = pool.acquire().await.unwrap();
            let batch: Vec<NewJob> = (fed..fed + more)
                .map(|i| NewJob::new("task").idempotency_key(format!("stream:{i}")))
                .collect();
            queue::enqueue_many(&mut conn, &batch).await.unwrap();
            fed += more;
        }
    }
    fed
}

/// A consumer that is never idle (a steady stream keeps messages waiting
/// for it, so its destination is never seen empty for long) still records
/// drains, through watermarks, and a job whose message never reached the
/// broker is re-driven and runs once while the stream goes on.
async fn a_lost_message_is_redriven_while_the_consumer_is_busy(pool: PgPool, sink: SinkKind) {
    let after = Duration::from_secs(5);
    harness::create_exec_log(&pool).await;
    let log = harness::log_pool(&pool, 4).await;
    let destination = destination(&pool, sink, "busy").await;
    let stop = CancellationToken::new();
    let consumer = busy_consumer(&pool, sink, &destination, log.clone());
    let progress = consumer.progress();
    let consumer = tokio::spawn(consumer.run(stop.clone()));
    enqueue(&pool, "lost", 1).await;
    // Marked published as a relay marks it; no message was sent.
    let claimed = outbox::claim(&pool, sink, 10, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(claimed.rows.len(), 1);
    let outcomes = outbox::Outcomes::all_published(&claimed.rows);
    outbox::mark(&pool, claimed.token, &outcomes).await.unwrap();
    let lost: i64 = claimed.rows[0].job_id;

    let feeding = CancellationToken::new();
    let feeder = tokio::spawn(feed(pool.clone(), feeding.clone()));
    let relay = Relay::new(
        pool.clone(),
        Publisher::new(sink, &brokers::sinks()).unwrap(),
        RelayConfig {
            redrive_after: after,
            ..brokers::relay_config()
        }
        .validated()
        .unwrap(),
    );
    let relay = tokio::spawn(relay.run(stop.clone()));
    eventually(
        "the consumer works through the stream",
        Duration::from_secs(60),
        || async { progress.report().executed >= 500 },
    )
    .await;
    eventually(
        "the lost job is re-driven and done while the stream goes on",
        Duration::from_secs(90),
        || async {
            let status: String =
                sqlx::query_scalar("SELECT status FROM almanac.jobs WHERE id = $1")
                    .bind(lost)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            status == "done"
        },
    )
    .await;
    assert_eq!(
        fresh_marks(&pool, &destination, after).await,
        partitions(sink),
        "every partition was drained within redrive_after"
    );
    let fed = feeding_stop(feeding, feeder).await;
    eventually("every job done", Duration::from_secs(120), || {
        all_done(&pool, fed as i64 + 1)
    })
    .await;
    stop.cancel();
    consumer.await.unwrap().unwrap();
    relay.await.unwrap().unwrap();
    println!("{sink}: {fed} jobs streamed past a busy consumer; the lost one re-driven");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM exec_log").await,
        fed as i64 + 1,
        "a job ran twice"
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT job_id) FROM exec_log").await,
        fed as i64 + 1
    );
}

async fn feeding_stop(feeding: CancellationToken, feeder: tokio::task::JoinHandle<usize>) -> usize {
    feeding.cancel();
    feeder.await.unwrap()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rabbitmq_lost_message_is_redriven_while_the_consumer_is_busy(pool: PgPool) {
    a_lost_message_is_redriven_while_the_consumer_is_busy(pool, SinkKind::Rabbitmq).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn kafka_lost_message_is_redriven_while_the_consumer_is_busy(pool: PgPool) {
    a_lost_message_is_redriven_while_the_consumer_is_busy(pool, SinkKind::Kafka).await;
}

/// A re-drive step over a backlog whose messages all wait unpublished (its
/// sink down for longer than `redrive_after`) probes each job's own outbox
/// rows by `outbox_job_idx`, with no statistics on the tables (autovacuum
/// off, or before it analyzed a fresh backlog): the planner once ANDed in a
/// scan of every pending row of the sink per job, and a step over 150,000
/// such jobs ran for minutes while the relay published nothing.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_redrive_step_over_an_unpublished_backlog_probes_each_job_s_own_rows(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO almanac.routes (kind, mode, sink, destination)
             VALUES ('stuck', 'broker', 'rabbitmq', 'stuck');
         INSERT INTO almanac.jobs (kind, run_at)
             SELECT 'stuck', now() - interval '1 hour' + g * interval '1 millisecond'
             FROM generate_series(1, 30000) AS g;",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.outbox WHERE published_at IS NULL"
        )
        .await,
        30_000
    );
    let plans = harness::explain_prepared(
        &mut conn,
        routing::REDRIVE_SQL,
        "text, bigint, timestamptz, bigint, timestamptz",
        "'rabbitmq', 600000, NULL, NULL, NULL",
    )
    .await;
    for (mode, _, plan) in plans {
        let text = plan.to_string();
        assert!(
            text.contains("outbox_job_idx") && !text.contains("outbox_due_idx"),
            "{mode}: the step's outbox probe is not by job:\n{plan:#}"
        );
    }
}
