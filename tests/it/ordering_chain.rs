//! A completion that frees a key's next job claims it for the completing
//! worker (migration 0130, `queue::complete_many_claiming`) only when that
//! worker's own claim would take it anyway: its kind on the `db` route, not
//! paused, without limits, the job due, and no due job of the worker's
//! kinds waiting. Otherwise the job becomes `ready` as before. A claimed
//! job carries the claim's fence: running, one attempt more, its own lease.

use std::sync::Arc;
use std::time::Duration;

use almanac::control::{limits as limit_control, ordering as control, pause, Actor};
use almanac::queue::limits::Limits;
use almanac::queue::ordering::OnDead;
use almanac::queue::{self, Claim, Job, JobStatus, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::SinkKind;
use almanac::role::{Role, Settings};
use almanac::worker::{HandlerError, JobContext, Worker, WorkerConfig};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::proxy::Proxy;
use crate::harness::{self, eventually};

const KIND: &str = "chained";
const OTHER: &str = "other";
const LEASE: Duration = Duration::from_secs(30);

async fn enqueue(pool: &PgPool, kind: &str, key: &str) -> i64 {
    let job = NewJob::new(kind).payload(json!({ "k": key }));
    queue::enqueue(&mut pool.acquire().await.unwrap(), &job)
        .await
        .unwrap()
        .id()
}

async fn claim(pool: &PgPool, kinds: &[&str], n: i64) -> Vec<(i64, uuid::Uuid)> {
    let kinds: Vec<String> = kinds.iter().map(|k| k.to_string()).collect();
    let mut claimed: Vec<(i64, uuid::Uuid)> = queue::claim(
        pool,
        &Claim {
            kinds: &kinds,
            limit: n,
            lease: LEASE,
        },
    )
    .await
    .unwrap()
    .iter()
    .map(|j| j.lease().unwrap())
    .collect();
    claimed.sort();
    claimed
}

/// Completes `leases` as a worker of `kinds` does; the completed ids and
/// the jobs claimed on the way.
async fn complete(
    pool: &PgPool,
    leases: &[(i64, uuid::Uuid)],
    kinds: &[&str],
) -> (Vec<i64>, Vec<Job>) {
    let kinds: Vec<String> = kinds.iter().map(|k| k.to_string()).collect();
    let mut conn = pool.acquire().await.unwrap();
    let (written, claimed) = queue::complete_many_claiming(&mut conn, leases, LEASE, &kinds)
        .await
        .unwrap();
    let mut ids = written.ids;
    ids.sort();
    (ids, claimed)
}

async fn status(pool: &PgPool, id: i64) -> JobStatus {
    queue::get(pool, id).await.unwrap().status
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_completion_claims_the_next_job_of_its_key_only_when_nothing_waits(pool: PgPool) {
    let actor = Actor::os_user();
    let mut conn = pool.acquire().await.unwrap();
    control::set(&mut conn, &actor, KIND, Some("/k"), OnDead::Halt)
        .await
        .unwrap();
    let a1 = enqueue(&pool, KIND, "a").await;
    let a2 = enqueue(&pool, KIND, "a").await;
    let a3 = enqueue(&pool, KIND, "a").await;
    let b1 = enqueue(&pool, KIND, "b").await;

    // b1 waits, due: a2 is not claimed past it, it becomes ready.
    let first = claim(&pool, &[KIND], 1).await;
    assert_eq!(first.iter().map(|l| l.0).collect::<Vec<_>>(), vec![a1]);
    let (done, claimed) = complete(&pool, &first, &[KIND]).await;
    assert_eq!(done, vec![a1]);
    assert!(claimed.is_empty(), "nothing is claimed past a waiting job");
    assert_eq!(status(&pool, a2).await, JobStatus::Ready);
    assert_eq!(status(&pool, a3).await, JobStatus::Held);

    // Nothing waits: the completion of a2 claims a3 under a fresh lease.
    let second = claim(&pool, &[KIND], 2).await;
    assert_eq!(second.iter().map(|l| l.0).collect::<Vec<_>>(), vec![a2, b1]);
    let (done, claimed) = complete(&pool, &second, &[KIND]).await;
    assert_eq!(done, vec![a2, b1]);
    assert_eq!(claimed.len(), 1, "one job released, one claimed");
    let next = &claimed[0];
    assert_eq!(next.id, a3);
    assert_eq!(next.status, JobStatus::Running);
    assert_eq!(next.attempts, 1);
    assert_eq!(
        next.payload,
        json!({ "k": "a" }),
        "the claimed job is whole"
    );
    let stored = queue::get(&pool, a3).await.unwrap();
    assert_eq!(stored.status, JobStatus::Running);
    assert_eq!(stored.lease_token, next.lease_token);
    assert!(stored.lease_until.unwrap() > chrono::Utc::now() + chrono::Duration::seconds(20));
    // Its lease is a lease: the fence takes its token, and only its token.
    let (done, claimed) = complete(&pool, &[(a3, uuid::Uuid::new_v4())], &[KIND]).await;
    assert!(done.is_empty() && claimed.is_empty());
    let (done, claimed) = complete(&pool, &[next.lease().unwrap()], &[KIND]).await;
    assert_eq!(done, vec![a3]);
    assert!(claimed.is_empty());
    assert_eq!(status(&pool, a3).await, JobStatus::Done);

    // A due job of another kind the worker runs waits: not passed either.
    let c1 = enqueue(&pool, KIND, "c").await;
    let c2 = enqueue(&pool, KIND, "c").await;
    let o1 = enqueue(&pool, OTHER, "-").await;
    let head = claim(&pool, &[KIND], 1).await;
    assert_eq!(head.iter().map(|l| l.0).collect::<Vec<_>>(), vec![c1]);
    let (_, claimed) = complete(&pool, &head, &[KIND, OTHER]).await;
    assert!(claimed.is_empty());
    assert_eq!(status(&pool, c2).await, JobStatus::Ready);
    // A worker without that kind does not weigh its jobs.
    let c3 = enqueue(&pool, KIND, "c").await;
    let head = claim(&pool, &[KIND], 1).await;
    assert_eq!(head.iter().map(|l| l.0).collect::<Vec<_>>(), vec![c2]);
    let (_, claimed) = complete(&pool, &head, &[KIND]).await;
    assert_eq!(claimed.iter().map(|j| j.id).collect::<Vec<_>>(), vec![c3]);
    assert_eq!(status(&pool, o1).await, JobStatus::Ready);
}

/// An ordered kind `kind` with two jobs of key `x`, the first claimed
/// (`ready` and due unless `later`): its lease and the second's id.
async fn two_of_a_key(pool: &PgPool, kind: &str, later: bool) -> ((i64, uuid::Uuid), i64) {
    let mut conn = pool.acquire().await.unwrap();
    control::set(&mut conn, &Actor::os_user(), kind, Some("/k"), OnDead::Halt)
        .await
        .unwrap();
    let first = enqueue(pool, kind, "x").await;
    let mut second = NewJob::new(kind).payload(json!({ "k": "x" }));
    if later {
        second = second.run_at(chrono::Utc::now() + chrono::Duration::hours(1));
    }
    let second = queue::enqueue(&mut conn, &second).await.unwrap().id();
    let head = claim(pool, &[kind], 1).await;
    assert_eq!(head.len(), 1);
    assert_eq!(head[0].0, first);
    (head[0], second)
}

/// Completes `lease` as a worker of `kind`: what it claimed, and the
/// status of `next` then.
async fn end(pool: &PgPool, kind: &str, lease: (i64, uuid::Uuid), next: i64) -> (usize, JobStatus) {
    let (done, claimed) = complete(pool, &[lease], &[kind]).await;
    assert_eq!(done, vec![lease.0]);
    (claimed.len(), status(pool, next).await)
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_paused_limited_rerouted_or_future_successor_is_released_not_claimed(pool: PgPool) {
    let actor = Actor::os_user();
    let mut conn = pool.acquire().await.unwrap();

    // The control: nothing in the way, the next job is claimed.
    let (head, next) = two_of_a_key(&pool, "plain", false).await;
    assert_eq!(
        end(&pool, "plain", head, next).await,
        (1, JobStatus::Running)
    );

    // Paused while its head ran.
    let (head, next) = two_of_a_key(&pool, "paused", false).await;
    pause::pause(&mut conn, &actor, "paused", None)
        .await
        .unwrap();
    assert_eq!(
        end(&pool, "paused", head, next).await,
        (0, JobStatus::Ready)
    );

    // With limits: the claim's budget decides.
    let (head, next) = two_of_a_key(&pool, "limited", false).await;
    let limits = Limits {
        global: Some(10),
        per_key: None,
        rate: None,
        burst: 0,
    };
    limit_control::set(&mut conn, &actor, "limited", &limits)
        .await
        .unwrap();
    assert_eq!(
        end(&pool, "limited", head, next).await,
        (0, JobStatus::Ready)
    );

    // Routed to dual: the next job takes its outbox row on its way to ready.
    let (head, next) = two_of_a_key(&pool, "dual", false).await;
    routes::set(
        &mut conn,
        "dual",
        RouteMode::Dual,
        Some(SinkKind::Rabbitmq),
        Some("chained"),
    )
    .await
    .unwrap();
    assert_eq!(end(&pool, "dual", head, next).await, (0, JobStatus::Ready));
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM almanac.outbox WHERE job_id = $1")
        .bind(next)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(outbox, 1, "the released dual job has its outbox row");

    // Due later: released, not started early.
    let (head, next) = two_of_a_key(&pool, "later", true).await;
    assert_eq!(end(&pool, "later", head, next).await, (0, JobStatus::Ready));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn jobs_claimed_by_a_completion_whose_answer_was_lost_are_given_back(pool: PgPool) {
    let (head, next) = two_of_a_key(&pool, KIND, false).await;
    let third = enqueue(&pool, KIND, "x").await;
    // The completion commits; say its answer never came back.
    let (_, claimed) = complete(&pool, &[head], &[KIND]).await;
    assert_eq!(claimed.iter().map(|j| j.id).collect::<Vec<_>>(), vec![next]);
    // A token that completed nothing gives back nothing.
    let none = queue::unclaim_successors(&pool, &[uuid::Uuid::new_v4()])
        .await
        .unwrap();
    assert_eq!(none, 0);
    assert_eq!(status(&pool, next).await, JobStatus::Running);
    // The retry finds the completion written: what it claimed goes back,
    // its attempt restored, the key's order kept.
    let given = queue::unclaim_successors(&pool, &[head.1]).await.unwrap();
    assert_eq!(given, 1);
    let back = queue::get(&pool, next).await.unwrap();
    assert_eq!(back.status, JobStatus::Ready);
    assert_eq!(back.attempts, 0);
    assert!(back.lease_token.is_none());
    assert_eq!(status(&pool, third).await, JobStatus::Held);
    // Claimed again, as any ready job.
    let again = claim(&pool, &[KIND], 10).await;
    assert_eq!(again.iter().map(|l| l.0).collect::<Vec<_>>(), vec![next]);
}

/// The worker end to end: its completion of a key's head commits (and
/// claims the next job) while the answer is held on the way back, past the
/// recorder's deadline; its retry finds the head done and gives the next
/// job back, which then runs, its attempt restored, long before its lease
/// (which nobody would renew) could expire. Without the give-back the next
/// job, `max_attempts = 1`, would sit `running` until its lease ran out
/// and then be buried unrun by the reaper.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_worker_gives_back_what_a_completion_claimed_when_its_answer_was_lost(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    control::set(&mut conn, &Actor::os_user(), KIND, Some("/k"), OnDead::Halt)
        .await
        .unwrap();
    let once = |key: &str| {
        NewJob::new(KIND)
            .payload(json!({ "k": key }))
            .max_attempts(1)
    };
    let head = queue::enqueue(&mut conn, &once("x")).await.unwrap().id();
    let next = queue::enqueue(&mut conn, &once("x")).await.unwrap().id();
    // Two jobs of other keys, completed one after the other first, so that
    // both outcome recorders have connected before answers are held (a
    // connection's handshake is an answer too).
    let warm = [
        queue::enqueue(&mut conn, &once("w1")).await.unwrap().id(),
        queue::enqueue(&mut conn, &once("w2")).await.unwrap().id(),
    ];
    // Recorder and claim deadlines lease / 3 = 3 s; lease 9 s.
    let lease = Duration::from_secs(9);
    let proxy = Proxy::postgres().await;
    let url = proxy.postgres_url(&harness::database_url(&pool));
    let through = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let handler_gate = gate.clone();
    let warm_gate = Arc::new(tokio::sync::Semaphore::new(0));
    let handler_warm_gate = warm_gate.clone();
    let runs = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handler_runs = runs.clone();
    let config = WorkerConfig {
        concurrency: 4,
        batch_size: 4,
        lease,
        poll_interval: Duration::from_millis(100),
        ..WorkerConfig::default()
    };
    let worker =
        Worker::new(through, config.validated().unwrap()).register(KIND, move |ctx: JobContext| {
            let (gate, runs) = (handler_gate.clone(), handler_runs.clone());
            let warm_gate = handler_warm_gate.clone();
            async move {
                runs.lock().unwrap().push((ctx.job.id, ctx.job.attempts));
                if ctx.job.id == head {
                    gate.acquire().await.unwrap().forget();
                } else if warm.contains(&ctx.job.id) {
                    warm_gate.acquire().await.unwrap().forget();
                }
                Ok::<(), HandlerError>(())
            }
        });
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually(
        "the first jobs to start",
        Duration::from_secs(10),
        || async { runs.lock().unwrap().len() == 3 },
    )
    .await;
    for done in 1..=warm.len() as i64 {
        warm_gate.add_permits(1);
        eventually(
            "a warm-up job to be done",
            Duration::from_secs(10),
            || async { count_done(&pool, &warm).await == done },
        )
        .await;
    }

    // The completion goes through and commits; its answer does not come.
    proxy.hold_answers();
    gate.add_permits(1);
    eventually(
        "the completion to commit and claim the next job",
        Duration::from_secs(10),
        || async { status(&pool, head).await == JobStatus::Done },
    )
    .await;
    assert_eq!(status(&pool, next).await, JobStatus::Running);
    // Past the recorder's deadline (3 s) before the answers come again.
    tokio::time::sleep(Duration::from_secs(4)).await;
    proxy.thaw();

    let given_back_by = std::time::Instant::now();
    eventually(
        "the next job to run and be done",
        Duration::from_secs(5),
        || async { status(&pool, next).await == JobStatus::Done },
    )
    .await;
    assert!(
        given_back_by.elapsed() < lease / 2,
        "the next job waited for its lease"
    );
    stop.cancel();
    let report = running.await.unwrap().unwrap();
    let runs: Vec<(i64, i32)> = runs
        .lock()
        .unwrap()
        .iter()
        .copied()
        .filter(|(id, _)| !warm.contains(id))
        .collect();
    assert_eq!(
        runs,
        vec![(head, 1), (next, 1)],
        "each job ran once, in order"
    );
    assert_eq!(queue::get(&pool, next).await.unwrap().attempts, 1);
    assert_eq!(report.completed, 4, "{report:?}");
}

async fn count_done(pool: &PgPool, ids: &[i64]) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM almanac.jobs WHERE id = ANY($1) AND status = 'done'")
        .bind(ids)
        .fetch_one(pool)
        .await
        .unwrap()
}
