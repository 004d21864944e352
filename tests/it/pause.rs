//! Pause and resume a kind (issue #22 items 1 and 7), with the CLI as an
//! operator runs it, against workers and the real brokers' consumers: while
//! `p` is paused no job of it starts anywhere (the kind beside it, `q`,
//! keeps running on the same route), nothing is lost or buried, broker
//! messages are held unacknowledged; resuming starts every `p` job once.
//! The worker polls once a minute, so only the resume's wake-up can start
//! its jobs within the test's deadline.

use std::process::Output;
use std::time::{Duration, Instant};

use almanac::metrics::Metrics;
use almanac::queue::{self, Backoff, NewJob};
use almanac::relay::routes::RouteMode;
use almanac::relay::{Publisher, Relay, SinkKind};
use almanac::role::{Periodic, Role, Settings, Valid};
use almanac::stats::Collector;
use almanac::worker::{Worker, WorkerConfig};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::brokers;
use crate::harness::http::sample;
use crate::harness::{self, count, eventually, text};

fn cli(pool: &PgPool, args: &[&str]) -> Output {
    harness::operator(pool, args)
}

/// A worker that claims only when woken (its poll is a minute).
fn sleepy_worker(pool: &PgPool, log: &PgPool) -> Worker {
    let config = WorkerConfig {
        concurrency: 4,
        batch_size: 4,
        lease: Duration::from_secs(10),
        poll_interval: Duration::from_secs(60),
        shutdown_deadline: Duration::from_secs(5),
        backoff: Backoff::default(),
        listen: true,
    };
    ["p", "q"].iter().fold(
        Worker::new(pool.clone(), config.validated().unwrap()),
        |worker, kind| worker.register(*kind, harness::logging_handler(log.clone(), 0)),
    )
}

async fn ran(pool: &PgPool, kind: &str) -> i64 {
    count(
        pool,
        &format!(
            "SELECT count(*) FROM exec_log l JOIN almanac.jobs j ON j.id = l.job_id WHERE j.kind = '{kind}'"
        ),
    )
    .await
}

async fn status_counts(pool: &PgPool, kind: &str) -> Vec<(String, i64, i64)> {
    sqlx::query_as(
        "SELECT status, count(*), sum(attempts) FROM almanac.jobs WHERE kind = $1 GROUP BY 1 ORDER BY 1",
    )
    .bind(kind)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// `route`: `None` for the database queue, else the mode and sink both
/// kinds are routed with.
async fn a_paused_kind_starts_nowhere_until_resumed(
    pool: PgPool,
    route: Option<(RouteMode, SinkKind)>,
) {
    harness::create_exec_log(&pool).await;
    let log = harness::log_pool(&pool, 4).await;
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    if let Some((mode, sink)) = route {
        let destination = brokers::route_to_fresh(&pool, "p", mode, sink).await;
        // A Kafka consumer holds a paused kind's message in its partition
        // (nothing past it may be committed), so what shares the partition
        // waits too: in broker mode `q` gets a topic of its own.
        let q_destination = if sink == SinkKind::Kafka && mode == RouteMode::Broker {
            brokers::route_to_fresh(&pool, "q", mode, sink).await
        } else {
            almanac::relay::routes::set(
                &mut pool.acquire().await.unwrap(),
                "q",
                mode,
                Some(sink),
                Some(&destination),
            )
            .await
            .unwrap();
            destination.clone()
        };
        if q_destination != destination {
            let consumer = brokers::consumer(&pool, sink, &q_destination, &["q"], log.clone());
            let consumer_stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                consumer.run(consumer_stop).await.unwrap();
            }));
        }
        let relay = Relay::new(
            pool.clone(),
            Publisher::new(sink, &brokers::sinks()).unwrap(),
            brokers::relay_config().validated().unwrap(),
        );
        let relay_stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            relay.run(relay_stop).await.unwrap();
        }));
        let consumer = brokers::consumer(&pool, sink, &destination, &["p", "q"], log.clone());
        let consumer_stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            consumer.run(consumer_stop).await.unwrap();
        }));
    }
    if route.is_none_or(|(mode, _)| mode != RouteMode::Broker) {
        let worker = sleepy_worker(&pool, &log);
        let worker_stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            worker.run(worker_stop).await.unwrap();
        }));
    }

    let paused = cli(&pool, &["kinds", "pause", "p", "--note", "bad deploy"]);
    assert!(paused.status.success(), "{}", text(&paused.stderr));
    assert_eq!(
        text(&paused.stdout),
        "kind p is paused: no job of it starts until `almanac kinds resume p`"
    );

    let mut conn = pool.acquire().await.unwrap();
    for i in 0..20 {
        let kind = if i % 2 == 0 { "p" } else { "q" };
        queue::enqueue(&mut conn, &NewJob::new(kind)).await.unwrap();
    }
    // `q` runs on the same route meanwhile: the system is live, and the `p`
    // jobs, enqueued between them, had every chance to start.
    eventually("every q job done", Duration::from_secs(30), || async {
        ran(&pool, "q").await == 10
    })
    .await;
    if route.is_some() {
        // Every `p` message reached the broker, so its consumers had them.
        eventually("every p job published", Duration::from_secs(30), || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.outbox o JOIN almanac.jobs j ON j.id = o.job_id \
                 WHERE j.kind = 'p' AND o.published_at IS NULL",
            )
            .await
                == 0
        })
        .await;
    }
    assert_eq!(ran(&pool, "p").await, 0, "a paused kind's job ran");
    assert_eq!(
        status_counts(&pool, "p").await,
        vec![("ready".to_string(), 10, 0)],
        "a paused kind's job left `ready` or used an attempt"
    );

    let stats = text(&cli(&pool, &["stats"]).stdout);
    assert!(
        stats.contains("paused p:") && stats.contains("by night-ops (cli): bad deploy"),
        "{stats}"
    );

    let started = Instant::now();
    let resumed = cli(&pool, &["kinds", "resume", "p"]);
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    assert_eq!(text(&resumed.stdout), "kind p is resumed");
    eventually(
        "every p job done after the resume",
        Duration::from_secs(20),
        || async { ran(&pool, "p").await == 10 },
    )
    .await;
    eprintln!("resume to the last p job done: {:?}", started.elapsed());
    stop.cancel();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM exec_log").await,
        20,
        "a job ran twice"
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT job_id) FROM exec_log").await,
        20
    );
    let audit: Vec<(String, String, String, String, i64)> = sqlx::query_as(
        "SELECT actor, source, action, target, count FROM almanac.audit_log ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        vec![
            (
                "night-ops".into(),
                "cli".into(),
                "pause".into(),
                "kind p".into(),
                1
            ),
            (
                "night-ops".into(),
                "cli".into(),
                "resume".into(),
                "kind p".into(),
                1
            ),
        ]
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_paused_kind_waits_in_the_database_queue(pool: PgPool) {
    a_paused_kind_starts_nowhere_until_resumed(pool, None).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_paused_kind_waits_in_dual_mode_on_rabbitmq(pool: PgPool) {
    a_paused_kind_starts_nowhere_until_resumed(pool, Some((RouteMode::Dual, SinkKind::Rabbitmq)))
        .await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_paused_kind_waits_in_dual_mode_on_kafka(pool: PgPool) {
    a_paused_kind_starts_nowhere_until_resumed(pool, Some((RouteMode::Dual, SinkKind::Kafka)))
        .await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_paused_kind_is_held_by_rabbitmq_consumers(pool: PgPool) {
    a_paused_kind_starts_nowhere_until_resumed(pool, Some((RouteMode::Broker, SinkKind::Rabbitmq)))
        .await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_paused_kind_is_held_by_kafka_consumers(pool: PgPool) {
    a_paused_kind_starts_nowhere_until_resumed(pool, Some((RouteMode::Broker, SinkKind::Kafka)))
        .await;
}

/// `*` pauses every kind: claims find nothing, a broker consumer's claim
/// says "paused"; a kind's own pause outlives resuming `*`.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn pausing_every_kind_and_the_answers_an_operator_reads(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let p = queue::enqueue(&mut conn, &NewJob::new("p"))
        .await
        .unwrap()
        .id();
    queue::enqueue(&mut conn, &NewJob::new("q")).await.unwrap();
    let kinds = vec!["p".to_string(), "q".to_string()];
    let claim = queue::Claim {
        kinds: &kinds,
        limit: 10,
        lease: Duration::from_secs(10),
    };

    let all = cli(&pool, &["kinds", "pause", "*"]);
    assert_eq!(
        text(&all.stdout),
        "every kind is paused: no job starts until `almanac kinds resume '*'`"
    );
    let own = cli(&pool, &["kinds", "pause", "p", "--note", "disk full"]);
    assert!(own.status.success());
    let again = cli(&pool, &["kinds", "pause", "p"]);
    assert!(again.status.success());
    assert!(
        text(&again.stdout).starts_with("kind p was already paused (by night-ops (cli) at "),
        "{}",
        text(&again.stdout)
    );
    assert!(queue::claim(&pool, &claim).await.unwrap().is_empty());
    brokers::route_to_fresh(&pool, "p", RouteMode::Dual, SinkKind::Rabbitmq).await;
    assert!(matches!(
        queue::claim_by_id(&mut conn, p, &kinds, Duration::from_secs(10))
            .await
            .unwrap(),
        queue::ClaimById::Paused(kind) if kind == "p"
    ));

    let listed = text(&cli(&pool, &["kinds", "list"]).stdout);
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 3, "{listed}");
    assert!(
        lines[1].starts_with("* ") && lines[2].starts_with("p "),
        "{listed}"
    );
    assert!(lines[2].ends_with("disk full"), "{listed}");

    let resumed = cli(&pool, &["kinds", "resume", "*"]);
    assert!(resumed.status.success());
    // `p` keeps its own pause: only `q` is claimed.
    let claimed = queue::claim(&pool, &claim).await.unwrap();
    assert_eq!(
        claimed.iter().map(|j| j.kind.as_str()).collect::<Vec<_>>(),
        vec!["q"]
    );

    let not_paused = cli(&pool, &["kinds", "resume", "q"]);
    assert_eq!(not_paused.status.code(), Some(1));
    assert_eq!(
        text(&not_paused.stderr),
        "error: kind q is not paused; paused kinds: p"
    );
    let empty = cli(&pool, &["kinds", "pause", " "]);
    assert_eq!(empty.status.code(), Some(1));
    assert_eq!(
        text(&empty.stderr),
        "error: a kind name is required (`*` pauses every kind)"
    );
    // Refusals leave no audit row: pause *, pause p, pause p (a no-op, count
    // 0), resume *.
    let audit: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT action, target, count FROM almanac.audit_log ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        audit,
        vec![
            ("pause".into(), "kind *".into(), 1),
            ("pause".into(), "kind p".into(), 1),
            ("pause".into(), "kind p".into(), 0),
            ("resume".into(), "kind *".into(), 1),
        ]
    );
}

/// `/metrics` shows a paused kind (1, then 0 once resumed) and cancelled
/// jobs counted apart from dead ones, from the collector's database read.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn metrics_show_paused_kinds_and_cancelled_jobs(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("report"))
        .await
        .unwrap()
        .id();
    assert!(cli(&pool, &["jobs", "cancel", &id.to_string()])
        .status
        .success());
    assert!(cli(&pool, &["kinds", "pause", "report"]).status.success());
    let metrics = Metrics::new();
    let collector = Collector::new(pool.clone(), Valid::default()).with_metrics(metrics.clone());
    collector.run_once(&CancellationToken::new()).await.unwrap();
    let paused = metrics.render();
    assert_eq!(
        sample(&paused, "almanac_kind_paused", &[("kind", "report")]),
        Some(1.0),
        "{paused}"
    );
    assert_eq!(
        sample(
            &paused,
            "almanac_jobs",
            &[("kind", "report"), ("status", "cancelled")]
        ),
        Some(1.0),
        "{paused}"
    );
    assert_eq!(
        sample(
            &paused,
            "almanac_jobs",
            &[("kind", "report"), ("status", "dead")]
        ),
        Some(0.0)
    );
    assert!(cli(&pool, &["kinds", "resume", "report"]).status.success());
    collector.run_once(&CancellationToken::new()).await.unwrap();
    let resumed = metrics.render();
    assert_eq!(
        sample(&resumed, "almanac_kind_paused", &[("kind", "report")]),
        Some(0.0),
        "{resumed}"
    );
}
