//! The queue API against a real PostgreSQL: the fence, retries, the reaper,
//! transactional and idempotent enqueue, operator actions.

use std::time::Duration;

use almanac::maintenance::{Reaper, ReaperConfig};
use almanac::queue::{self, Claim, Enqueued, Failure, Fenced, JobStatus, NewJob, QueueError};
use almanac::role::{Periodic, Settings};
use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::{Connection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::harness::{self, eventually};

fn kinds(k: &str) -> Vec<String> {
    vec![k.to_string()]
}

async fn claim_one(pool: &PgPool, kind: &str, lease: Duration) -> queue::Job {
    let jobs = queue::claim(
        pool,
        &Claim {
            kinds: &kinds(kind),
            limit: 1,
            lease,
        },
    )
    .await
    .unwrap();
    assert_eq!(jobs.len(), 1, "expected one claimable {kind} job");
    jobs.into_iter().next().unwrap()
}

async fn lease_expired(pool: &PgPool, id: i64) -> bool {
    sqlx::query_scalar("SELECT lease_until < clock_timestamp() FROM almanac.jobs WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_stale_lease_token_changes_nothing_and_reports_the_loss(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("mail"))
        .await
        .unwrap()
        .id();

    // A token that never held the lease.
    let first = claim_one(&pool, "mail", Duration::from_millis(400)).await;
    let (_, token1) = first.lease().unwrap();
    assert_eq!(
        queue::complete(&pool, id, Uuid::new_v4()).await.unwrap(),
        Fenced::Lost
    );
    let fail = Failure::Permanent {
        error: "stale".into(),
    };
    assert_eq!(
        queue::fail(&pool, id, Uuid::new_v4(), &fail).await.unwrap(),
        Fenced::Lost
    );
    assert_eq!(
        queue::get(&pool, id).await.unwrap().status,
        JobStatus::Running
    );

    // The lease expires: the rightful token can no longer complete either.
    eventually("the lease to expire", Duration::from_secs(10), || {
        lease_expired(&pool, id)
    })
    .await;
    assert_eq!(
        queue::complete(&pool, id, token1).await.unwrap(),
        Fenced::Lost
    );
    assert_eq!(
        queue::heartbeat_many(
            &mut pool.acquire().await.unwrap(),
            &[(id, token1)],
            Duration::from_secs(30)
        )
        .await
        .unwrap(),
        queue::Written::default()
    );

    // The reaper hands it back; a second claim gets a new token; the first
    // worker, coming back late, cannot overwrite the second attempt.
    let reaped = queue::reap_expired(&pool, 100).await.unwrap();
    assert_eq!((reaped.requeued, reaped.buried), (1, 0));
    let second = claim_one(&pool, "mail", Duration::from_secs(30)).await;
    let (_, token2) = second.lease().unwrap();
    assert_ne!(token1, token2);
    assert_eq!(second.attempts, 2);
    assert_eq!(
        queue::complete(&pool, id, token1).await.unwrap(),
        Fenced::Lost
    );
    assert_eq!(
        queue::fail(&pool, id, token1, &fail).await.unwrap(),
        Fenced::Lost
    );
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!(
        (job.status, job.lease_token),
        (JobStatus::Running, Some(token2))
    );

    assert_eq!(
        queue::complete(&pool, id, token2).await.unwrap(),
        Fenced::Held(())
    );
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!(job.status, JobStatus::Done);
    assert!(job.finished_at.is_some() && job.lease_token.is_none());
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn retryable_failures_back_off_longer_each_time_then_bury_with_last_error(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("sync").max_attempts(3))
        .await
        .unwrap()
        .id();
    let backoff = queue::Backoff::default();
    let mut delays = Vec::new();
    for attempt in 1..=3 {
        // Make it due again without waiting out the backoff.
        sqlx::query("UPDATE almanac.jobs SET run_at = now() WHERE id = $1")
            .bind(id)
            .execute(&pool)
            .await
            .unwrap();
        let job = claim_one(&pool, "sync", Duration::from_secs(30)).await;
        assert_eq!(job.attempts, attempt);
        let failure = Failure::Retry {
            delay: backoff.delay(attempt),
            error: format!("upstream 503 on attempt {attempt}"),
        };
        let status = queue::fail(&pool, id, job.lease_token.unwrap(), &failure)
            .await
            .unwrap();
        let job = queue::get(&pool, id).await.unwrap();
        if attempt < 3 {
            assert_eq!(status, Fenced::Held(JobStatus::Ready));
            let wait: f64 = sqlx::query_scalar("SELECT extract(epoch FROM run_at - clock_timestamp())::float8 FROM almanac.jobs WHERE id = $1")
                .bind(id).fetch_one(&pool).await.unwrap();
            delays.push(wait);
        } else {
            assert_eq!(status, Fenced::Held(JobStatus::Dead));
            assert_eq!(job.last_error.as_deref(), Some("upstream 503 on attempt 3"));
            assert!(job.finished_at.is_some());
        }
    }
    assert!(delays[1] > delays[0], "delays must grow: {delays:?}");
    assert!(
        delays[0] > 0.5,
        "the first retry waits about a second: {delays:?}"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_permanent_failure_buries_the_job_at_once(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("parse"))
        .await
        .unwrap()
        .id();
    let job = claim_one(&pool, "parse", Duration::from_secs(30)).await;
    let status = queue::fail(
        &pool,
        id,
        job.lease_token.unwrap(),
        &Failure::Permanent {
            error: "bad input".into(),
        },
    )
    .await
    .unwrap();
    assert_eq!(status, Fenced::Held(JobStatus::Dead));
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!(
        (job.attempts, job.last_error.as_deref()),
        (1, Some("bad input"))
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn an_enqueue_rolled_back_with_its_transaction_never_exists(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("CREATE TABLE orders (id int)")
        .execute(&mut *tx)
        .await
        .unwrap();
    queue::enqueue(&mut tx, &NewJob::new("ship").idempotency_key("order:1"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(
        harness::count(&pool, "SELECT count(*) FROM almanac.jobs").await,
        0
    );
    let none = queue::claim(
        &pool,
        &Claim {
            kinds: &kinds("ship"),
            limit: 10,
            lease: Duration::from_secs(30),
        },
    )
    .await
    .unwrap();
    assert!(none.is_empty());

    // Committed with the business row, it exists exactly once.
    let mut tx = pool.begin().await.unwrap();
    let id = queue::enqueue(&mut tx, &NewJob::new("ship").idempotency_key("order:1"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(matches!(id, Enqueued::New(_)));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_duplicate_idempotency_key_reports_the_existing_job_and_adds_no_row(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let job = NewJob::new("invoice")
        .payload(json!({"n": 1}))
        .idempotency_key("invoice:2026-11");
    let first = queue::enqueue(&mut conn, &job).await.unwrap();
    let again = queue::enqueue(&mut conn, &job.clone().payload(json!({"n": 2})))
        .await
        .unwrap();
    assert!(matches!(first, Enqueued::New(_)));
    assert_eq!(again, Enqueued::Existing(first.id()));

    // Batches: duplicates inside the batch and against the table; unkeyed rows keep order.
    let batch = vec![
        NewJob::new("invoice").payload(json!({"i": 0})),
        NewJob::new("invoice").idempotency_key("invoice:2026-11"),
        NewJob::new("invoice").idempotency_key("invoice:2026-12"),
        NewJob::new("invoice").payload(json!({"i": 3})),
        NewJob::new("invoice").idempotency_key("invoice:2026-12"),
    ];
    let out = queue::enqueue_many(&mut conn, &batch).await.unwrap();
    assert_eq!(out[1], Enqueued::Existing(first.id()));
    assert!(matches!(out[2], Enqueued::New(_)));
    assert_eq!(out[4], Enqueued::Existing(out[2].id()));
    for (i, n) in [(0, 0), (3, 3)] {
        let payload = queue::get(&pool, out[i].id()).await.unwrap().payload;
        assert_eq!(payload, json!({"i": n}));
    }
    assert_eq!(
        harness::count(&pool, "SELECT count(*) FROM almanac.jobs").await,
        4
    );
    let stored = queue::get(&pool, first.id()).await.unwrap();
    assert_eq!(
        stored.payload,
        json!({"n": 1}),
        "a duplicate never overwrites"
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_reaper_buries_an_expired_job_whose_attempts_are_used_up(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let retry = queue::enqueue(&mut conn, &NewJob::new("r").max_attempts(2))
        .await
        .unwrap()
        .id();
    let last = queue::enqueue(&mut conn, &NewJob::new("r").max_attempts(1))
        .await
        .unwrap()
        .id();
    let claimed = queue::claim(
        &pool,
        &Claim {
            kinds: &kinds("r"),
            limit: 5,
            lease: Duration::from_millis(300),
        },
    )
    .await
    .unwrap();
    assert_eq!(claimed.len(), 2);
    for id in [retry, last] {
        eventually("leases to expire", Duration::from_secs(10), || {
            lease_expired(&pool, id)
        })
        .await;
    }
    let reaper = Reaper::new(
        pool.clone(),
        ReaperConfig {
            interval: Duration::from_secs(1),
            batch_size: 1,
        }
        .validated()
        .unwrap(),
    );
    let report = reaper.run_once(&CancellationToken::new()).await.unwrap();
    assert_eq!((report.requeued, report.buried), (1, 1));
    assert_eq!(
        queue::get(&pool, retry).await.unwrap().status,
        JobStatus::Ready
    );
    let dead = queue::get(&pool, last).await.unwrap();
    assert_eq!(dead.status, JobStatus::Dead);
    assert!(dead
        .last_error
        .unwrap()
        .contains("lease expired during attempt 1 of 1"));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn operators_retry_dead_jobs_and_cancel_ready_ones_and_are_told_otherwise(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("x").max_attempts(1))
        .await
        .unwrap()
        .id();
    let err = queue::retry(&mut conn, id).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("job {id} is ready; retry applies only to dead or cancelled jobs")
    );

    // A running job gets a request; its failure then ends it `cancelled`,
    // not `ready` or `dead`.
    let job = claim_one(&pool, "x", Duration::from_secs(30)).await;
    let mut tx = conn.begin().await.unwrap();
    let requested = queue::cancel_in(&mut tx, id, "ops (cli)", Some("stuck"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(matches!(requested, queue::Cancel::Requested(ref j) if j.status == JobStatus::Running));
    let failed = queue::fail(
        &pool,
        id,
        job.lease_token.unwrap(),
        &Failure::Retry {
            delay: Duration::ZERO,
            error: "killed".into(),
        },
    )
    .await
    .unwrap();
    assert_eq!(failed, Fenced::Held(JobStatus::Cancelled));

    let retried = queue::retry(&mut conn, id).await.unwrap();
    assert_eq!((retried.status, retried.attempts), (JobStatus::Ready, 0));
    assert_eq!(retried.cancel_requested_at, None);
    let mut tx = conn.begin().await.unwrap();
    let cancelled = queue::cancel_in(&mut tx, id, "ops (cli)", None)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(
        matches!(cancelled, queue::Cancel::Cancelled(ref j) if j.status == JobStatus::Cancelled)
    );
    assert!(matches!(
        queue::get(&pool, 987_654).await,
        Err(QueueError::NotFound(987_654))
    ));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn stats_count_by_kind_and_status_and_see_expired_leases(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    // The oldest ready job fell due 90 seconds ago (on the database's clock).
    let due: DateTime<Utc> = sqlx::query_scalar("SELECT now() - interval '90 seconds'")
        .fetch_one(&pool)
        .await
        .unwrap();
    queue::enqueue(&mut conn, &NewJob::new("a").run_at(due))
        .await
        .unwrap();
    for kind in ["a", "b"] {
        queue::enqueue(&mut conn, &NewJob::new(kind)).await.unwrap();
    }
    let job = claim_one(&pool, "b", Duration::from_millis(300)).await;
    eventually("the lease to expire", Duration::from_secs(10), || {
        lease_expired(&pool, job.id)
    })
    .await;
    let stats = queue::stats(&mut conn).await.unwrap();
    let counts: Vec<(String, JobStatus, i64)> = stats
        .by_kind_status
        .iter()
        .map(|c| (c.kind.clone(), c.status, c.count))
        .collect();
    assert_eq!(
        counts,
        vec![
            ("a".into(), JobStatus::Ready, 2),
            ("b".into(), JobStatus::Running, 1)
        ]
    );
    assert_eq!(stats.expired_leases, 1);
    // Its wait: at least the 90 seconds, at most what has passed since
    // `due` by the time the stats were read.
    let since_due: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now() - $1)::float8")
        .bind(due)
        .fetch_one(&pool)
        .await
        .unwrap();
    let waited = stats.oldest_due_ready_seconds;
    assert!(
        (90.0..=since_due).contains(&waited),
        "oldest due ready job waited {waited}s; 90s to {since_due}s expected"
    );
    // Per kind: only `a` has a due ready job (`b`'s is running), with that wait.
    let per_kind: Vec<(&str, f64)> = stats
        .oldest_due_ready
        .iter()
        .map(|k| (k.kind.as_str(), k.seconds))
        .collect();
    assert_eq!(per_kind, [("a", waited)]);
}

/// A job handed back unstarted (its claimant shutting down) gets its attempt
/// back: with `max_attempts = 1` it is ready again, not dead; workers hear
/// of it at once.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn an_unstarted_job_handed_back_keeps_its_attempts(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let id = queue::enqueue(&mut conn, &NewJob::new("once").max_attempts(1))
        .await
        .unwrap()
        .id();
    let job = claim_one(&pool, "once", Duration::from_secs(30)).await;
    assert_eq!(job.attempts, 1);
    let token = job.lease_token.unwrap();
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
        .await
        .unwrap();
    listener.listen(queue::NOTIFY_CHANNEL).await.unwrap();
    assert!(queue::unclaim(&pool, id, token).await.unwrap());
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!((job.status, job.attempts), (JobStatus::Ready, 0));
    let woken = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("workers are notified of the kind handed back")
        .unwrap();
    assert_eq!(woken.payload(), "once");
    // The fence: a second hand-back under the old token changes nothing.
    assert!(!queue::unclaim(&pool, id, token).await.unwrap());
}

/// Many jobs handed back in one statement (a worker's shutdown): each
/// still held gets its attempt back, a stale token changes nothing, and
/// workers hear of the kind at once.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn unstarted_jobs_handed_back_together_keep_their_attempts_and_wake_workers(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    for _ in 0..2 {
        queue::enqueue(&mut conn, &NewJob::new("once").max_attempts(1))
            .await
            .unwrap();
    }
    let a = claim_one(&pool, "once", Duration::from_secs(30)).await;
    let b = claim_one(&pool, "once", Duration::from_secs(30)).await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
        .await
        .unwrap();
    listener.listen(queue::NOTIFY_CHANNEL).await.unwrap();
    let leases = [a.lease().unwrap(), (b.id, Uuid::new_v4())];
    assert_eq!(queue::unclaim_many(&pool, &leases).await.unwrap(), 1);
    let a = queue::get(&pool, a.id).await.unwrap();
    assert_eq!((a.status, a.attempts), (JobStatus::Ready, 0));
    let b = queue::get(&pool, b.id).await.unwrap();
    assert_eq!(
        (b.status, b.attempts),
        (JobStatus::Running, 1),
        "a stale token is fenced off"
    );
    let woken = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("workers are notified of the kind")
        .unwrap();
    assert_eq!(woken.payload(), "once");
    // The fence: the same hand-back again changes nothing.
    assert_eq!(queue::unclaim_many(&pool, &leases).await.unwrap(), 0);
}

async fn outbox_rows(pool: &PgPool, job: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM almanac.outbox WHERE job_id = $1")
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The outbox trigger (with its `WHEN` clause) writes a row
/// for every transition of a `dual` job to `ready` and for no other: enqueue,
/// a retry after a failure, the reaper, a release at shutdown, an operator
/// retry; never a claim, a completion or a death.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_dual_job_gets_an_outbox_row_for_each_return_to_ready_and_no_other(pool: PgPool) {
    sqlx::query(
        "INSERT INTO almanac.routes (kind, mode, sink, destination) VALUES ('twin', 'dual', 'kafka', 'twins')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let id = match queue::enqueue(&mut conn, &NewJob::new("twin").max_attempts(10))
        .await
        .unwrap()
    {
        Enqueued::New(id) => id,
        other => panic!("{other:?}"),
    };
    assert_eq!(outbox_rows(&pool, id).await, 1, "enqueue");

    let job = claim_one(&pool, "twin", Duration::from_secs(30)).await;
    assert_eq!(outbox_rows(&pool, id).await, 1, "a claim writes no row");
    let retry = Failure::Retry {
        delay: Duration::ZERO,
        error: "try again".into(),
    };
    queue::fail(&pool, id, job.lease_token.unwrap(), &retry)
        .await
        .unwrap();
    assert_eq!(outbox_rows(&pool, id).await, 2, "a retry after a failure");

    // The reaper: a lease that expired.
    let job = claim_one(&pool, "twin", Duration::from_millis(1)).await;
    eventually("the lease expires", Duration::from_secs(5), || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT lease_until < clock_timestamp() FROM almanac.jobs WHERE id = $1",
        )
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap()
    })
    .await;
    queue::reap_expired(&pool, 10).await.unwrap();
    assert_eq!(outbox_rows(&pool, id).await, 3, "the reaper");
    drop(job);

    let job = claim_one(&pool, "twin", Duration::from_secs(30)).await;
    queue::release(&pool, &[job.lease().unwrap()], "shutting down")
        .await
        .unwrap();
    assert_eq!(outbox_rows(&pool, id).await, 4, "a release at shutdown");

    let job = claim_one(&pool, "twin", Duration::from_secs(30)).await;
    let bury = Failure::Permanent { error: "no".into() };
    queue::fail(&pool, id, job.lease_token.unwrap(), &bury)
        .await
        .unwrap();
    assert_eq!(outbox_rows(&pool, id).await, 4, "death writes no row");
    queue::retry(&mut conn, id).await.unwrap();
    assert_eq!(outbox_rows(&pool, id).await, 5, "an operator retry");

    let job = claim_one(&pool, "twin", Duration::from_secs(30)).await;
    queue::complete(&pool, id, job.lease_token.unwrap())
        .await
        .unwrap();
    assert_eq!(outbox_rows(&pool, id).await, 5, "completion writes no row");
}

/// Enqueue wakes listening workers: one notification per kind that got a
/// new row, none when every row was a duplicate.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn enqueue_notifies_each_kind_with_a_new_row_and_no_other(pool: PgPool) {
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
        .await
        .unwrap();
    listener.listen(queue::NOTIFY_CHANNEL).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let batch = [
        NewJob::new("ping").idempotency_key("p:1"),
        NewJob::new("ping").idempotency_key("p:2"),
        NewJob::new("pong").idempotency_key("q:1"),
    ];
    queue::enqueue_many(&mut conn, &batch).await.unwrap();
    let mut kinds = Vec::new();
    for _ in 0..2 {
        let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
            .await
            .expect("a notification per new kind")
            .unwrap();
        kinds.push(n.payload().to_string());
    }
    kinds.sort();
    assert_eq!(kinds, ["ping", "pong"]);
    // Duplicates only: no new row, no notification. A later new job's
    // notification is the next one to arrive.
    queue::enqueue_many(&mut conn, &batch).await.unwrap();
    queue::enqueue(&mut conn, &NewJob::new("late"))
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("the late job's notification")
        .unwrap();
    assert_eq!(n.payload(), "late");
}
