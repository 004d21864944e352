//! A route to a sink no relay serves is visible (issue #20, item 10): in
//! `almanac stats`, in `/metrics` (through the collector) and on the
//! dashboard's routes page, and it clears once a relay for the sink runs.

use std::time::Duration;

use almanac::metrics::{KindSinkLabel, Metrics};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{Publisher, Relay, SinkKind};
use almanac::role::{Periodic, Role, Settings, Valid};
use almanac::stats::snapshot::Snapshot;
use almanac::stats::Collector;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::brokers::{self, unique};
use crate::harness::{self, eventually};

async fn unserved(pool: &PgPool) -> Vec<String> {
    let mut conn = pool.acquire().await.unwrap();
    Snapshot::read(&mut conn)
        .await
        .unwrap()
        .unserved
        .into_iter()
        .map(|u| u.kind)
        .collect()
}

/// One refresh of `collector`, then the gauge for `mailer` on RabbitMQ.
async fn gauge(collector: &Collector, metrics: &Metrics) -> f64 {
    collector.run_once(&CancellationToken::new()).await.unwrap();
    metrics
        .route_unserved
        .get_or_create(&KindSinkLabel {
            kind: "mailer".into(),
            sink: "rabbitmq".into(),
        })
        .get()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_route_to_a_sink_no_relay_serves_shows_until_a_relay_runs(pool: PgPool) {
    let url = harness::database_url(&pool);
    let destination = unique("unserved");
    let mut conn = pool.acquire().await.unwrap();
    routes::set(
        &mut conn,
        "mailer",
        RouteMode::Broker,
        Some(SinkKind::Rabbitmq),
        Some(&destination),
    )
    .await
    .unwrap();
    routes::set(&mut conn, "local", RouteMode::Db, None, None)
        .await
        .unwrap();
    drop(conn);
    assert_eq!(unserved(&pool).await, vec!["mailer".to_string()]);
    let metrics = Metrics::new();
    let collector = Collector::new(pool.clone(), Valid::default()).with_metrics(metrics.clone());
    assert_eq!(gauge(&collector, &metrics).await, 1.0);
    let out = harness::almanac()
        .args(["stats"])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("mailer:")
            && text.contains("no relay for rabbitmq is running")
            && text.contains("nothing runs them"),
        "{text}"
    );

    let stop = CancellationToken::new();
    let relay = Relay::new(
        pool.clone(),
        Publisher::new(SinkKind::Rabbitmq, &brokers::sinks()).unwrap(),
        brokers::relay_config().validated().unwrap(),
    );
    let relay = tokio::spawn(relay.run(stop.clone()));
    eventually(
        "the relay counted as serving rabbitmq",
        Duration::from_secs(30),
        || async { unserved(&pool).await.is_empty() },
    )
    .await;
    assert_eq!(
        gauge(&collector, &metrics).await,
        0.0,
        "the series drops to 0"
    );
    stop.cancel();
    relay.await.unwrap().unwrap();
}
