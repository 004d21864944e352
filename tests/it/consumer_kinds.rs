//! A consumer never drops a job it cannot run (issue #20, item 1), against
//! the real brokers: kinds `a` and `b` are routed to one destination, a
//! consumer with only `a` runs first and meets 20 jobs of `b`; it must not
//! acknowledge them as done, and must say so. Then a consumer with `a` and
//! `b` starts: every job runs exactly once, within a minute.

use std::time::Duration;

use almanac::metrics::{KindDestinationLabel, Metrics};
use almanac::queue::{self, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{Publisher, Relay, SinkKind};
use almanac::role::{Role, Settings};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::brokers::{self, unique};
use crate::harness::{self, count, eventually};

async fn jobs(pool: &PgPool, kind: &str, status: &str) -> i64 {
    count(
        pool,
        &format!("SELECT count(*) FROM almanac.jobs WHERE kind = '{kind}' AND status = '{status}'"),
    )
    .await
}

async fn a_consumer_never_drops_a_kind_it_cannot_run(pool: PgPool, sink: SinkKind) {
    harness::create_exec_log(&pool).await;
    let log = harness::log_pool(&pool, 4).await;
    let destination = unique("kinds");
    let mut publisher = Publisher::new(sink, &brokers::sinks()).unwrap();
    publisher.ensure(&destination).await.unwrap();
    publisher.flush().await;
    let mut conn = pool.acquire().await.unwrap();
    for kind in ["a", "b"] {
        routes::set(
            &mut conn,
            kind,
            RouteMode::Broker,
            Some(sink),
            Some(&destination),
        )
        .await
        .unwrap();
    }
    for i in 0..25 {
        let kind = if i < 20 { "b" } else { "a" };
        queue::enqueue(&mut conn, &NewJob::new(kind)).await.unwrap();
    }
    let stop = CancellationToken::new();
    let relay = Relay::new(
        pool.clone(),
        Publisher::new(sink, &brokers::sinks()).unwrap(),
        brokers::relay_config().validated().unwrap(),
    );
    let relay = tokio::spawn(relay.run(stop.clone()));

    let metrics = Metrics::new();
    let only_a = brokers::consumer(&pool, sink, &destination, &["a"], log.clone())
        .with_metrics(metrics.clone());
    let only_a = tokio::spawn(only_a.run(stop.clone()));
    let unhandled = || {
        metrics
            .consumer_other_kind
            .get_or_create(&KindDestinationLabel {
                kind: "b".into(),
                destination: destination.clone(),
            })
            .get()
    };
    // RabbitMQ gives every `b` message back to the queue, where the
    // `a`-only consumer meets each again; Kafka's consumer steps out of the
    // group at the first. Either way: counted, and none acknowledged as run.
    let seen = if sink == SinkKind::Rabbitmq { 20 } else { 1 };
    eventually(
        "the a-only consumer meets the b jobs",
        Duration::from_secs(60),
        || async { unhandled() >= seen },
    )
    .await;
    assert_eq!(
        jobs(&pool, "b", "ready").await,
        20,
        "a b job left the ready state"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE kind = 'b' AND attempts > 0"
        )
        .await,
        0,
        "a b job used an attempt in a consumer that cannot run it"
    );
    // Within seconds an operator reading `almanac stats` sees the kind, the
    // destination, that no running consumer has a handler for it, and what
    // to do.
    let wanted = format!(
        "kind b is routed (broker) to {sink} `{destination}`, \
         but none of the 1 consumer running there has a handler for it (they handle a); "
    );
    eventually("stats names b", Duration::from_secs(10), || async {
        let out = harness::operator(&pool, &["stats"]);
        let printed = harness::text(&out.stdout);
        let line = printed
            .lines()
            .find_map(|l| l.strip_prefix("consumers b:"))
            .map(str::trim_start);
        match line {
            Some(line)
                if line.starts_with(&wanted)
                    && line.contains("; consumers without one gave its messages back unrun (")
                    && line.ends_with(
                        "with a handler for b, or route the kind elsewhere (almanac route set)",
                    ) =>
            {
                Ok(())
            }
            _ => Err(printed),
        }
    })
    .await;
    let printed = harness::text(&harness::operator(&pool, &["stats"]).stdout);
    assert!(
        !printed.contains("consumers a:"),
        "a has its consumer:\n{printed}"
    );

    // The newcomer runs both kinds, as in a rolling deploy that adds `b`:
    // RabbitMQ's `a`-only consumer puts each `b` message back at the tail of
    // the queue, where the newcomer takes it; Kafka's steps out of the group
    // and the newcomer takes its partitions.
    let with_b = brokers::consumer(&pool, sink, &destination, &["a", "b"], log.clone());
    let with_b = tokio::spawn(with_b.run(stop.clone()));
    eventually(
        "every job done once a b consumer runs",
        Duration::from_secs(60),
        || async {
            let states: Vec<(String, String, i64)> = sqlx::query_as(
                "SELECT kind, status, count(*) FROM almanac.jobs GROUP BY 1, 2 ORDER BY 1, 2",
            )
            .fetch_all(&pool)
            .await
            .unwrap();
            let done = |kind: &str| {
                states.iter().any(|s| {
                    s.0 == kind && s.1 == "done" && s.2 == if kind == "a" { 5 } else { 20 }
                })
            };
            if done("a") && done("b") {
                Ok(())
            } else {
                Err(format!("{states:?}"))
            }
        },
    )
    .await;
    // Both consumers are counted; the messages given back stay on the
    // record for a few minutes, now beside a consumer that handles b.
    let gaps = almanac::consumer::presence::gaps(&mut conn).await.unwrap();
    let gap = gaps
        .iter()
        .find(|g| g.kind == "b")
        .expect("b's given-back messages");
    assert_eq!((gap.consumers, gap.handling), (2, 1), "{gap:?}");
    // (The rows trail the consumer's own count by up to a beat, 2 s.)
    assert!(gap.unhandled_messages >= 1, "{gap:?}");
    assert!(
        gap.describe()
            .contains("and 1 of the 2 consumers running there handle it"),
        "{}",
        gap.describe()
    );
    stop.cancel();
    for consumer in [only_a, with_b] {
        consumer.await.unwrap().unwrap();
    }
    // A consumer that stops leaves no row: none counts as running.
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.consumers").await,
        0,
        "a stopped consumer still counts as running"
    );
    relay.await.unwrap().unwrap();
    assert_eq!(
        count(&pool, "SELECT count(*) FROM exec_log").await,
        25,
        "a job ran twice"
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT job_id) FROM exec_log").await,
        25
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn kafka_consumer_never_drops_a_kind_it_cannot_run(pool: PgPool) {
    a_consumer_never_drops_a_kind_it_cannot_run(pool, SinkKind::Kafka).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rabbitmq_consumer_never_drops_a_kind_it_cannot_run(pool: PgPool) {
    a_consumer_never_drops_a_kind_it_cannot_run(pool, SinkKind::Rabbitmq).await;
}

/// The rules `stats`, `/routes`, the metric and `route set` read the
/// consumers' rows by (`almanac::consumer::presence`), on rows as consumers
/// leave them: one killed 20 s ago, one with a value no consumer writes.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn presence_rows_count_only_live_consumers_and_skip_bad_values(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    for (kind, mode, destination) in [
        ("nobody", RouteMode::Broker, "q1"),
        ("dual_nobody", RouteMode::Dual, "q1"),
        ("killed", RouteMode::Broker, "q2"),
        ("served", RouteMode::Broker, "q3"),
    ] {
        routes::set(
            &mut conn,
            kind,
            mode,
            Some(SinkKind::Rabbitmq),
            Some(destination),
        )
        .await
        .unwrap();
    }
    sqlx::query(
        "INSERT INTO almanac.consumers (id, sink, destination, kinds, host, pid, seen_at, unhandled) VALUES
           (gen_random_uuid(), 'rabbitmq', 'q2', '{killed}', 'h', 1, now() - interval '20 seconds', '{}'),
           (gen_random_uuid(), 'rabbitmq', 'q3', '{served}', 'h', 2, now(),
            '{\"served\": {\"messages\": \"many\", \"last_at\": \"soon\"}, \"other\": [1]}')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let gaps = almanac::consumer::presence::gaps(&mut conn).await.unwrap();
    let described: Vec<(String, i64, i64, i64)> = gaps
        .iter()
        .map(|g| {
            (
                g.kind.clone(),
                g.consumers,
                g.handling,
                g.unhandled_messages,
            )
        })
        .collect();
    // A broker route with no consumer, and one whose only consumer is gone;
    // a dual route without consumers is no gap (workers run it), nor is a
    // served kind whose row holds values no consumer writes.
    assert_eq!(
        described,
        [
            ("killed".to_string(), 0, 0, 0),
            ("nobody".to_string(), 0, 0, 0)
        ]
    );
    assert!(
        gaps[0]
            .describe()
            .starts_with("kind killed is routed (broker) to rabbitmq `q2`, but no almanac consumer of it is running: nothing runs its jobs."),
        "{}",
        gaps[0].describe()
    );
    let out = harness::operator(&pool, &["stats"]);
    assert!(out.status.success(), "{}", harness::text(&out.stderr));
    let printed = harness::text(&out.stdout);
    let lines: Vec<&str> = printed
        .lines()
        .filter(|l| l.starts_with("consumers "))
        .collect();
    assert_eq!(lines.len(), 2, "{printed}");
}
