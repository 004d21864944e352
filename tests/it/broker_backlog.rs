//! Claim cost does not grow with the broker backlog (issue #20, item 3): a
//! worker polling for a kind whose jobs wait for broker consumers reads none
//! of them. The table is built with `generate_series` (100,000 due broker
//! jobs here; 1,000,000 in the ignored test), and the claim is explained
//! with `EXPLAIN (ANALYZE, BUFFERS)` as a prepared statement, with the custom
//! and the generic plan.

use std::time::Duration;

use almanac::queue::{self, Claim, NewJob};
use sqlx::PgPool;

use crate::harness;

/// `n` due jobs of `lagging`, routed to the broker (as after `route set
/// lagging --mode broker`), and `n` jobs of `local` due tomorrow (retries
/// waiting out their backoff, jobs enqueued for later), written in bulk with
/// the triggers off (their outbox rows do not matter here); one `local` job
/// left on the broker route, the oldest of all (an enqueue under a snapshot
/// older than a route change, until the relay's reconcile moves it); and 20
/// due jobs of `local` (db).
async fn fill(pool: &PgPool, n: i64) {
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql(&format!(
        "INSERT INTO almanac.routes (kind, mode, sink, destination) \
             VALUES ('lagging', 'broker', 'rabbitmq', 'lagging');
         SET session_replication_role = replica;
         INSERT INTO almanac.jobs (kind, run_at, route)
             SELECT 'lagging', now() - interval '1 hour' + g * interval '1 millisecond', 'broker'
             FROM generate_series(1, {n}) AS g;
         INSERT INTO almanac.jobs (kind, run_at, route)
             SELECT 'local', now() + interval '1 day' + g * interval '1 millisecond', 'db'
             FROM generate_series(1, {n}) AS g;
         INSERT INTO almanac.jobs (kind, run_at, route)
             VALUES ('local', now() - interval '2 hours', 'broker');
         SET session_replication_role = origin;
         ANALYZE almanac.jobs;"
    ))
    .execute(&mut *conn)
    .await
    .unwrap();
    for _ in 0..20 {
        queue::enqueue(&mut conn, &NewJob::new("local"))
            .await
            .unwrap();
    }
}

async fn a_claim_reads_none_of_the_broker_backlog(pool: PgPool, n: i64) {
    fill(&pool, n).await;
    for (mode, buffers, plan) in harness::claim_buffers(&pool, "{lagging,local}").await {
        // The local kind's 10 rows and their index pages, the routes lookup:
        // a few dozen buffers. Walking the backlog (or the kind's future
        // jobs) cost about 1,500 per 100,000 jobs.
        assert!(
            buffers < 200,
            "{mode}: {buffers} buffers for a claim of 10:\n{plan:#}"
        );
        let mut scans = Vec::new();
        harness::seq_scans(&plan[0]["Plan"], &mut scans);
        assert!(!scans.contains(&"jobs".to_string()), "{mode}: {plan:#}");
    }
    // And the claim itself: the local jobs, none of the broker's.
    let claimed = queue::claim(
        &pool,
        &Claim {
            kinds: &["lagging".to_string(), "local".to_string()],
            limit: 10,
            lease: Duration::from_secs(30),
        },
    )
    .await
    .unwrap();
    assert_eq!(
        claimed.len(),
        10,
        "the stale broker-route job takes no slot"
    );
    assert!(claimed.iter().all(|j| j.kind == "local" && j.route == "db"));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_claim_reads_none_of_a_100k_broker_backlog(pool: PgPool) {
    a_claim_reads_none_of_the_broker_backlog(pool, 100_000).await;
}

/// The figure: `cargo test --test it -- --ignored broker_backlog::`.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
#[ignore = "builds 1,000,000 jobs (about a minute); run with --ignored"]
async fn a_claim_reads_none_of_a_1m_broker_backlog(pool: PgPool) {
    a_claim_reads_none_of_the_broker_backlog(pool, 1_000_000).await;
}
