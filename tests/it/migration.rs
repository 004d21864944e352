//! A kind moves db -> dual -> broker while jobs flow: nothing lost, nothing
//! run twice, and workers stop taking the kind once it is broker.

use std::time::Duration;

use almanac::consumer::{Consumer, ConsumerConfig};
use almanac::queue::{self, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{Publisher, Relay, RelayConfig, SinkKind};
use almanac::role::{Role, Settings};
use almanac::worker::{Worker, WorkerConfig};
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::brokers::{self, unique};
use crate::harness::{self, count, eventually};

const WORKER: i32 = 0;
const CONSUMER: i32 = 1;

async fn switching_routes_while_jobs_flow(pool: PgPool, sink: SinkKind) {
    harness::create_exec_log(&pool).await;
    let sinks = brokers::sinks();
    let destination = unique("migrate");
    let mut publisher = Publisher::new(sink, &sinks).unwrap();
    publisher.ensure(&destination).await.unwrap();
    let config = WorkerConfig {
        concurrency: 4,
        batch_size: 4,
        poll_interval: Duration::from_millis(20),
        ..WorkerConfig::default()
    };
    let log = harness::log_pool(&pool, 6).await;
    let stop = CancellationToken::new();
    let worker = Worker::new(pool.clone(), config.clone().validated().unwrap())
        .register("task", harness::logging_handler(log.clone(), WORKER));
    let worker = tokio::spawn(worker.run(stop.clone()));
    let relay_config = RelayConfig {
        poll_interval: Duration::from_millis(20),
        ..RelayConfig::default()
    };
    let relay = tokio::spawn(
        Relay::new(pool.clone(), publisher, relay_config.validated().unwrap()).run(stop.clone()),
    );
    let consumer_config = ConsumerConfig {
        sink,
        destination: destination.clone(),
        group: None,
        worker: config.validated().unwrap(),
    };
    let consumer = Consumer::new(pool.clone(), sinks.clone(), consumer_config)
        .register("task", harness::logging_handler(log.clone(), CONSUMER));
    let consumer = tokio::spawn(consumer.run(stop.clone()));

    // A producer enqueues 1,500 jobs in small transactions while the route changes.
    let producer = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            for i in 0..300 {
                let batch: Vec<NewJob> = (0..5)
                    .map(|j| NewJob::new("task").idempotency_key(format!("m:{i}:{j}")))
                    .collect();
                queue::enqueue_many(&mut conn, &batch).await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let enqueued = |n: i64| {
        let pool = pool.clone();
        async move {
            eventually("enqueues", Duration::from_secs(60), || async {
                count(&pool, "SELECT count(*) FROM almanac.jobs").await >= n
            })
            .await;
        }
    };
    enqueued(300).await;
    routes::set(
        &mut pool.acquire().await.unwrap(),
        "task",
        RouteMode::Dual,
        Some(sink),
        Some(&destination),
    )
    .await
    .unwrap();
    enqueued(800).await;
    let change = routes::set(
        &mut pool.acquire().await.unwrap(),
        "task",
        RouteMode::Broker,
        None,
        None,
    )
    .await
    .unwrap();
    let broker_since: DateTime<Utc> = change.route.updated_at;
    // Any enqueue whose transaction starts after this saw the switch
    // committed; one that overlapped it may still have taken the dual route.
    let switched: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&pool)
        .await
        .unwrap();
    producer.await.unwrap();

    eventually("all 1,500 jobs done", Duration::from_secs(180), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
        )
        .await
            == 1500
    })
    .await;
    stop.cancel();
    worker.await.unwrap().unwrap();
    let consumed = consumer.await.unwrap().unwrap();
    relay.await.unwrap().unwrap();

    assert_eq!(
        count(&pool, "SELECT count(*) FROM exec_log").await,
        1500,
        "a job ran twice"
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT job_id) FROM exec_log").await,
        1500
    );
    // Workers took nothing claimed after the switch to broker (their last
    // claims, made before it, may still have been running for a moment).
    let late: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM exec_log WHERE worker = $1 AND at > $2 + interval '2 seconds'",
    )
    .bind(WORKER)
    .bind(broker_since)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(late, 0, "workers kept taking a broker kind");
    // Jobs enqueued after the switch committed are on the broker route, and
    // consumers ran them. (One whose transaction overlapped the switch may
    // have taken the dual route and been run by a worker.)
    let routes: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT route FROM almanac.jobs WHERE created_at > $1")
            .bind(switched)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(routes, vec!["broker"]);
    let after_switch: i64 =
        sqlx::query_scalar("SELECT count(*) FROM almanac.jobs WHERE created_at > $1")
            .bind(switched)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(after_switch > 0, "the test must enqueue after the switch");
    assert!(
        consumed.executed as i64 >= after_switch,
        "consumers ran every job enqueued after the switch"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn kafka_db_dual_broker_migration_loses_nothing_and_runs_nothing_twice(pool: PgPool) {
    switching_routes_while_jobs_flow(pool, SinkKind::Kafka).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rabbitmq_db_dual_broker_migration_loses_nothing_and_runs_nothing_twice(pool: PgPool) {
    switching_routes_while_jobs_flow(pool, SinkKind::Rabbitmq).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rolling_a_broker_kind_back_to_db_hands_its_ready_jobs_to_workers(pool: PgPool) {
    use almanac::queue::Claim;
    let mut conn = pool.acquire().await.unwrap();
    routes::set(
        &mut conn,
        "task",
        RouteMode::Broker,
        Some(SinkKind::Rabbitmq),
        Some("tasks"),
    )
    .await
    .unwrap();
    let batch: Vec<NewJob> = (0..5)
        .map(|i| NewJob::new("task").idempotency_key(format!("back:{i}")))
        .collect();
    queue::enqueue_many(&mut conn, &batch).await.unwrap();
    let kinds = vec!["task".to_string()];
    let claim = Claim {
        kinds: &kinds,
        limit: 10,
        lease: Duration::from_secs(30),
    };
    assert!(
        queue::claim(&pool, &claim).await.unwrap().is_empty(),
        "workers do not take a broker kind"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.outbox").await, 5);

    let change = routes::set(&mut conn, "task", RouteMode::Db, None, None)
        .await
        .unwrap();
    assert_eq!(change.jobs_moved, 5);
    assert_eq!(
        (
            change.rows_dropped,
            count(&pool, "SELECT count(*) FROM almanac.outbox").await
        ),
        (5, 0),
        "their pending messages are dropped: workers run the jobs"
    );
    assert_eq!(
        queue::claim(&pool, &claim).await.unwrap().len(),
        5,
        "back on the database path at once"
    );
    // The messages still queued would find their jobs claimed: the fence skips them.
    assert!(matches!(
        queue::claim_by_id(
            &mut pool.acquire().await.unwrap(),
            1,
            &kinds,
            Duration::from_secs(30)
        )
        .await
        .unwrap(),
        queue::ClaimById::Skip
    ));
}
