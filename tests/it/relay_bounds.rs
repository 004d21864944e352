//! What bounds the relay whatever the broker does (issue #20): a RabbitMQ
//! that blocks publishers cannot hang it, and a batch never outlives its
//! in-flight lease.

use std::collections::HashMap;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use almanac::queue::{self, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{Publisher, Relay, RelayConfig, SinkConfig, SinkKind};
use almanac::role::Settings;
use sqlx::PgPool;

use crate::harness::brokers::{self, unique, MemoryAlarm};
use crate::harness::http::{get, sample};
use crate::harness::proxy::Proxy;
use crate::harness::{self, count, eventually};

/// Jobs recorded by a published batch (each once, unless marked twice).
async fn published_jobs(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT coalesce(sum(cardinality(job_ids)), 0)::bigint FROM almanac.outbox_batches WHERE published_at IS NOT NULL",
    )
    .await
}

/// Jobs named by more than one published batch record.
async fn marked_twice(pool: &PgPool) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT j FROM almanac.outbox_batches, unnest(job_ids) AS j WHERE published_at IS NOT NULL GROUP BY j HAVING count(*) > 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn enqueue(pool: &PgPool, kind: &str, prefix: &str, n: usize) {
    let mut conn = pool.acquire().await.unwrap();
    for i in 0..n {
        // One transaction each: one notification each.
        queue::enqueue(
            &mut conn,
            &NewJob::new(kind).idempotency_key(format!("{prefix}:{i}")),
        )
        .await
        .unwrap();
    }
}

/// Messages per key in what `queue` holds.
async fn copies(queue: &str) -> HashMap<String, usize> {
    let mut copies = HashMap::new();
    for m in brokers::read_to_end(SinkKind::Rabbitmq, queue, Duration::from_secs(60)).await {
        *copies.entry(m.key).or_insert(0) += 1;
    }
    copies
}

/// Waits until every outbox row is published and `jobs` jobs are recorded
/// published.
async fn all_published(pool: &PgPool, jobs: i64, what: &str) {
    eventually(what, Duration::from_secs(60), || async {
        let unpublished = count(pool, "SELECT count(*) FROM almanac.outbox").await;
        let published = published_jobs(pool).await;
        if unpublished == 0 && published == jobs {
            Ok(())
        } else {
            Err(format!("{published} published, {unpublished} rows left"))
        }
    })
    .await;
}

/// Asserts `queue` holds each of `keys` once or twice, and nothing else.
async fn at_most_one_extra_copy(queue: &str, keys: &[String]) {
    let copies = copies(queue).await;
    for key in keys {
        let n = copies.get(key).copied().unwrap_or(0);
        assert!(
            (1..=2).contains(&n),
            "job {key} arrived {n} times (at most one extra copy): {copies:?}"
        );
    }
    assert_eq!(copies.len(), keys.len(), "{copies:?}");
}

fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// `almanac run --roles relay` for RabbitMQ with its HTTP endpoint on `http`.
fn relay_process(pool: &PgPool, http: &str) -> Child {
    harness::almanac()
        .args([
            "run",
            "--roles",
            "relay",
            "--amqp-url",
            &brokers::amqp_url(),
            "--ack-timeout",
            "2s",
            "--reconcile-interval",
            "1s",
            "--http-addr",
            http,
        ])
        .env("DATABASE_URL", harness::database_url(pool))
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

async fn metric(http: &str, name: &str) -> Option<f64> {
    let body = get(http, "/metrics").await.ok()?.body;
    sample(&body, name, &[("sink", "rabbitmq")])
}

/// Issue #20, item 5. RabbitMQ's memory alarm blocks every publisher
/// (`connection.blocked`). A relay process caught by it keeps answering:
/// it reads its notifications, reconciles routes, says it is blocked on
/// `/metrics`, and stops cleanly on SIGTERM during the alarm. Once the
/// alarm is gone every job is delivered, none with more than one extra
/// copy, and no job is recorded published twice.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_rabbitmq_alarm_blocks_the_relay_without_hanging_it(pool: PgPool) {
    brokers::rabbitmq_alone();
    let queue_name =
        brokers::route_to_fresh(&pool, "alarm", RouteMode::Broker, SinkKind::Rabbitmq).await;
    // A job of a kind not routed yet, so its route will disagree with
    // the one inserted below, which `route set` would have moved with it.
    queue::enqueue(
        &mut pool.acquire().await.unwrap(),
        &NewJob::new("stray").idempotency_key("stray"),
    )
    .await
    .unwrap();
    enqueue(&pool, "alarm", "before", 20).await;
    let http = free_addr();
    let mut relay = relay_process(&pool, &http);
    eventually(
        "the jobs enqueued before the alarm published",
        Duration::from_secs(30),
        || async { published_jobs(&pool).await == 20 },
    )
    .await;

    let alarm = MemoryAlarm::raise();
    let notified = metric(&http, "almanac_relay_notifications_total")
        .await
        .unwrap_or(0.0);
    enqueue(&pool, "alarm", "during", 20).await;
    eventually(
        "/metrics to say the relay is blocked",
        Duration::from_secs(30),
        || async {
            let blocked = metric(&http, "almanac_relay_broker_blocked").await;
            if blocked == Some(1.0) {
                Ok(())
            } else {
                Err(format!("almanac_relay_broker_blocked = {blocked:?}"))
            }
        },
    )
    .await;
    eventually(
        "the relay reading its notifications while blocked",
        Duration::from_secs(15),
        || async {
            let n = metric(&http, "almanac_relay_notifications_total")
                .await
                .unwrap_or(0.0);
            n - notified >= 20.0
        },
    )
    .await;
    // Reconcile goes on: a job whose route disagrees with its kind's is
    // moved (and gets its outbox row).
    sqlx::query(
        "INSERT INTO almanac.routes (kind, mode, sink, destination) VALUES ('stray', 'broker', 'rabbitmq', $1)",
    )
    .bind(&queue_name)
    .execute(&pool)
    .await
    .unwrap();
    eventually(
        "the relay's reconcile to move the stray job while blocked",
        Duration::from_secs(15),
        || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.jobs j JOIN almanac.outbox o ON o.job_id = j.id WHERE j.kind = 'stray' AND j.route = 'broker'",
            )
            .await
                == 1
        },
    )
    .await;
    assert_eq!(
        get(&http, "/healthz").await.unwrap().status,
        200,
        "the process answers while blocked"
    );
    assert_eq!(
        published_jobs(&pool).await,
        20,
        "nothing published while blocked"
    );

    // SIGTERM during the alarm: a clean exit, before the supervisor's 30 s
    // grace would abort it.
    let asked = Instant::now();
    // SAFETY: signals a child process this test spawned.
    unsafe { libc::kill(relay.id() as i32, libc::SIGTERM) };
    let mut status = None;
    eventually("the relay to exit", Duration::from_secs(40), || {
        status = relay.try_wait().unwrap();
        std::future::ready(status.is_some())
    })
    .await;
    assert_eq!(
        status.unwrap().code(),
        Some(0),
        "a clean exit during the alarm"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(15),
        "the relay took {:?} to stop",
        asked.elapsed()
    );

    drop(alarm);
    let mut relay = relay_process(&pool, &free_addr());
    all_published(&pool, 41, "every job published after the alarm").await;
    // SAFETY: as above.
    unsafe { libc::kill(relay.id() as i32, libc::SIGTERM) };
    assert_eq!(relay.wait().unwrap().code(), Some(0));
    assert_eq!(marked_twice(&pool).await, Vec::<i64>::new());

    let keys: Vec<String> = (0..20)
        .flat_map(|i| [format!("before:{i}"), format!("during:{i}")])
        .chain(["stray".to_string()])
        .collect();
    at_most_one_extra_copy(&queue_name, &keys).await;
}

/// Issue #20, item 9. A batch never outlives its in-flight lease, whatever
/// the broker does: with the broker link frozen mid-batch and an ack
/// timeout longer than the lease, the relay gives the batch up before its
/// lease ends (the rows are retried, saying why). Another relay then
/// publishes them; when the link thaws, the frozen relay's frames arrive
/// too. No job is lost, none is recorded published twice, none arrives
/// more than twice.
/// Issue #20, item 5, the other way out of an alarm: it clears while the
/// same relay process runs (a batch caught by it was given up at its ack
/// deadline, and is sent again). The relay takes up where it stopped, a
/// destination first routed during the alarm is declared and served, and
/// no job arrives more than twice or is recorded published twice.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_rabbitmq_alarm_that_clears_under_a_running_relay_costs_at_most_one_copy(pool: PgPool) {
    brokers::rabbitmq_alone();
    let queue_name =
        brokers::route_to_fresh(&pool, "alarm", RouteMode::Broker, SinkKind::Rabbitmq).await;
    enqueue(&pool, "alarm", "before", 10).await;
    let http = free_addr();
    let mut relay = relay_process(&pool, &http);
    eventually(
        "the jobs enqueued before the alarm published",
        Duration::from_secs(30),
        || async { published_jobs(&pool).await == 10 },
    )
    .await;

    let alarm = MemoryAlarm::raise();
    enqueue(&pool, "alarm", "during", 20).await;
    // A kind routed during the alarm to a queue nobody declared yet: the
    // relay declares it under its deadline too.
    let late_queue = unique("late");
    sqlx::query(
        "INSERT INTO almanac.routes (kind, mode, sink, destination) VALUES ('late', 'broker', 'rabbitmq', $1)",
    )
    .bind(&late_queue)
    .execute(&pool)
    .await
    .unwrap();
    enqueue(&pool, "late", "late", 5).await;
    eventually(
        "/metrics to say the relay is blocked",
        Duration::from_secs(30),
        || async { metric(&http, "almanac_relay_broker_blocked").await == Some(1.0) },
    )
    .await;
    // A batch caught by the alarm is given up at its ack deadline (2 s)
    // and its rows wait for a retry: the alarm clears after that.
    eventually(
        "a batch given up under the alarm",
        Duration::from_secs(30),
        || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.outbox WHERE attempts > 0",
            )
            .await
                > 0
        },
    )
    .await;
    assert_eq!(
        published_jobs(&pool).await,
        10,
        "nothing published while blocked"
    );
    drop(alarm);

    all_published(
        &pool,
        35,
        "every job published after the alarm, by the same relay",
    )
    .await;
    eventually(
        "/metrics to say the relay is no longer blocked",
        Duration::from_secs(30),
        || async { metric(&http, "almanac_relay_broker_blocked").await == Some(0.0) },
    )
    .await;
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the relay kept running"
    );
    // SAFETY: signals a child process this test spawned.
    unsafe { libc::kill(relay.id() as i32, libc::SIGTERM) };
    assert_eq!(relay.wait().unwrap().code(), Some(0));
    assert_eq!(marked_twice(&pool).await, Vec::<i64>::new());

    for (queue, keys) in [
        (
            &queue_name,
            (0..10)
                .map(|i| format!("before:{i}"))
                .chain((0..20).map(|i| format!("during:{i}")))
                .collect::<Vec<_>>(),
        ),
        (&late_queue, (0..5).map(|i| format!("late:{i}")).collect()),
    ] {
        at_most_one_extra_copy(queue, &keys).await;
    }
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_batch_held_by_a_frozen_broker_is_given_up_within_its_lease(pool: PgPool) {
    let lease = Duration::from_secs(3);
    let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let frozen_link = SinkConfig {
        amqp_url: Some(format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port)),
        ack_timeout: Duration::from_secs(8),
        ..brokers::sinks()
    };
    let config = RelayConfig {
        in_flight_lease: lease,
        ..brokers::relay_config()
    };
    let queue_name = unique("frozen");
    let mut publisher = Publisher::new(SinkKind::Rabbitmq, &frozen_link).unwrap();
    publisher.ensure(&queue_name).await.unwrap();
    routes::set(
        &mut pool.acquire().await.unwrap(),
        "held",
        RouteMode::Broker,
        Some(SinkKind::Rabbitmq),
        Some(&queue_name),
    )
    .await
    .unwrap();
    let mut frozen = Relay::new(pool.clone(), publisher, config.clone().validated().unwrap());
    enqueue(&pool, "held", "warm", 1).await;
    assert_eq!(frozen.run_once().await.unwrap().published, 1);

    proxy.freeze();
    enqueue(&pool, "held", "held", 20).await;
    let started = Instant::now();
    let report = frozen.run_once().await.unwrap();
    let took = started.elapsed();
    assert!(
        took < lease,
        "the batch was held {took:?}, past its {lease:?} lease"
    );
    assert_eq!(
        (report.published, report.retried, report.failed),
        (0, 20, 0)
    );
    let errors: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT last_error FROM almanac.outbox WHERE last_error IS NOT NULL",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].starts_with(
            "gave the batch up at its deadline (maybe sent): its in-flight lease was running out"
        ),
        "{errors:?}"
    );

    let mut direct = Relay::new(
        pool.clone(),
        Publisher::new(SinkKind::Rabbitmq, &brokers::sinks()).unwrap(),
        config.validated().unwrap(),
    );
    let direct = tokio::sync::Mutex::new(&mut direct);
    eventually(
        "another relay to publish the rows given up",
        Duration::from_secs(30),
        || async {
            let _ = direct.lock().await.run_once().await;
            published_jobs(&pool).await == 21
        },
    )
    .await;
    // The frozen relay dropped its link; once it thaws, what it wrote goes
    // through, then the link closes.
    proxy.thaw();
    proxy.closed().await;
    drop(frozen);
    assert_eq!(marked_twice(&pool).await, Vec::<i64>::new());
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.outbox").await, 0);
    let copies = copies(&queue_name).await;
    assert_eq!(copies.get("warm:0"), Some(&1), "{copies:?}");
    for i in 0..20 {
        let n = copies.get(&format!("held:{i}")).copied().unwrap_or(0);
        assert!(
            (1..=2).contains(&n),
            "held:{i} arrived {n} times: {copies:?}"
        );
    }
    assert_eq!(copies.len(), 21, "{copies:?}");
}

/// A mark that comes after its batch's lease marks nothing, even when no
/// claim took the rows again: the lease is the whole time a batch may take.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_mark_after_the_lease_marks_nothing(pool: PgPool) {
    use almanac::relay::outbox;
    routes::set(
        &mut pool.acquire().await.unwrap(),
        "late",
        RouteMode::Broker,
        Some(SinkKind::Kafka),
        Some("late"),
    )
    .await
    .unwrap();
    enqueue(&pool, "late", "late", 3).await;
    let claimed = outbox::claim(&pool, SinkKind::Kafka, 10, Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(claimed.rows.len(), 3);
    eventually("the lease to end", Duration::from_secs(10), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.outbox_batches WHERE lease_until > clock_timestamp()",
        )
        .await
            == 0
    })
    .await;
    let outcomes = outbox::Outcomes::all_published(&claimed.rows);
    let marked = outbox::mark(&pool, claimed.token, &outcomes).await.unwrap();
    assert_eq!(marked.published, 0);
    assert_eq!(published_jobs(&pool).await, 0);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.outbox").await,
        3,
        "the rows wait for the next claim"
    );
    let again = outbox::claim(&pool, SinkKind::Kafka, 10, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(again.rows.len(), 3, "claimed again");
}
