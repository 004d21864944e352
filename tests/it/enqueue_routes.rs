//! The enqueue functions take their jobs' routes themselves, once per kind
//! (migration 0137), instead of the insert trigger once per row. What a
//! user relies on is unchanged: every job gets its kind's route and, off
//! `db`, its outbox row; an enqueue is ordered against `almanac route set`
//! (it holds the kind's lock until it commits, and a change committed while
//! it waited is the route it takes); and no other insert skips the trigger,
//! in the same transaction, one trigger level down, rewritten by a user's
//! trigger or after an error.

use std::time::Duration;

use almanac::queue::{self, NewJob};
use almanac::relay::routes::{self, RouteError, RouteMode};
use almanac::relay::SinkKind;
use sqlx::{Connection, PgConnection, PgPool};

use crate::harness::eventually;

/// Each kind and the route it is given: (kind, mode, sink, destination).
const ROUTES: [(&str, RouteMode, Option<SinkKind>, Option<&str>); 2] = [
    (
        "to_kafka",
        RouteMode::Broker,
        Some(SinkKind::Kafka),
        Some("topic-a"),
    ),
    (
        "to_rabbit",
        RouteMode::Dual,
        Some(SinkKind::Rabbitmq),
        Some("queue-b"),
    ),
];

async fn set_routes(pool: &PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    for (kind, mode, sink, destination) in ROUTES {
        routes::set(&mut conn, kind, mode, sink, destination)
            .await
            .unwrap();
    }
    exec(
        &mut *conn,
        "INSERT INTO almanac.kind_ordering (kind, set_by) VALUES ('ordered', 'test')",
    )
    .await;
}

/// Jobs whose route or outbox rows are not their kind's: (id, kind, route,
/// outbox rows as `sink/destination`).
async fn misrouted(conn: &mut PgConnection) -> Vec<(i64, String, String, Vec<String>)> {
    sqlx::query_as(
        "SELECT j.id, j.kind, j.route,
                coalesce(array_agg(o.sink || '/' || o.destination) FILTER (WHERE o.id IS NOT NULL), '{}')
         FROM almanac.jobs AS j
         LEFT JOIN almanac.routes AS r ON r.kind = j.kind
         LEFT JOIN almanac.outbox AS o ON o.job_id = j.id
         GROUP BY j.id, j.kind, j.route, r.mode, r.sink, r.destination
         HAVING j.route <> coalesce(r.mode, 'db')
             OR count(o.id) <> CASE WHEN coalesce(r.mode, 'db') = 'db' THEN 0 ELSE 1 END
             OR bool_or(o.sink IS DISTINCT FROM r.sink OR o.destination IS DISTINCT FROM r.destination)
         ORDER BY j.id",
    )
    .fetch_all(conn)
    .await
    .unwrap()
}

/// Runs `sql`, which must succeed.
async fn exec<'c>(executor: impl sqlx::PgExecutor<'c>, sql: &str) {
    sqlx::query(sql)
        .execute(executor)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Installs a BEFORE INSERT row trigger `name` on `almanac.jobs` (a user's
/// own; triggers fire in name order) running the PL/pgSQL `body`.
async fn user_trigger(pool: &PgPool, name: &str, body: &str) {
    exec(
        pool,
        &format!(
            "CREATE FUNCTION public.{name}() RETURNS trigger LANGUAGE plpgsql AS $$ {body} $$"
        ),
    )
    .await;
    exec(
        pool,
        &format!(
            "CREATE TRIGGER {name} BEFORE INSERT ON almanac.jobs \
             FOR EACH ROW EXECUTE FUNCTION public.{name}()"
        ),
    )
    .await;
}

/// Orders kind `per_account` by the payload's `acct`.
async fn order_per_account(pool: &PgPool) {
    exec(
        pool,
        "INSERT INTO almanac.kind_ordering (kind, key_pointer, key_path, set_by) \
         VALUES ('per_account', '/acct', '{acct}', 'test')",
    )
    .await;
}

/// `kind status jobs` of the jobs matching `filter`.
async fn per_kind_and_status(conn: &mut PgConnection, filter: &str) -> Vec<String> {
    sqlx::query_scalar(&format!(
        "SELECT kind || ' ' || status || ' ' || count(*) FROM almanac.jobs WHERE {filter} \
         GROUP BY kind, status ORDER BY kind, status"
    ))
    .fetch_all(conn)
    .await
    .unwrap()
}

/// The marker that lets the functions' own insert skip the trigger.
async fn marker(conn: &mut PgConnection) -> Option<String> {
    sqlx::query_scalar("SELECT current_setting('almanac.routes_taken', true)")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// The current transaction's id, as the marker names it.
async fn xid(conn: &mut PgConnection) -> String {
    sqlx::query_scalar("SELECT pg_current_xact_id()::text")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// A job of a routed kind inserted by hand, asking for `db`: the trigger
/// must give it its kind's route.
async fn insert_by_hand(conn: &mut PgConnection) -> String {
    sqlx::query_scalar(
        "INSERT INTO almanac.jobs (kind, route) VALUES ('to_kafka', 'db') RETURNING route",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn every_way_of_enqueueing_gives_each_job_its_kinds_route_and_outbox_row(pool: PgPool) {
    set_routes(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    for call in [
        // One job, each kind.
        "SELECT count(*) FROM almanac.enqueue('to_kafka')",
        "SELECT count(*) FROM almanac.enqueue('to_rabbit', idempotency_key => 'r1')",
        "SELECT count(*) FROM almanac.enqueue('plain')",
        "SELECT count(*) FROM almanac.enqueue('ordered', ordering_key => 'k')",
        // Batches: without keys, with keys (one taken), with an ordered
        // kind (routed by the trigger), with ordering keys all NULL (the
        // functions' own path).
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['to_kafka', 'plain', 'to_rabbit', 'to_kafka'])",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['to_rabbit', 'to_kafka', 'to_rabbit'], \
             idempotency_keys => ARRAY['r1', 'k2', NULL])",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['ordered', 'to_kafka', 'plain'])",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['plain', 'to_kafka'], \
             ordering_keys => ARRAY[NULL, NULL])",
    ] {
        exec(&mut *tx, call).await;
        let left = marker(&mut tx).await;
        assert!(
            left.as_deref().unwrap_or_default().is_empty(),
            "{call} left the marker set: {left:?}"
        );
        assert_eq!(insert_by_hand(&mut tx).await, "broker", "after {call}");
    }
    let jobs: Vec<NewJob> = ["to_kafka", "plain", "to_rabbit"]
        .into_iter()
        .map(NewJob::new)
        .collect();
    queue::enqueue_many(&mut tx, &jobs).await.unwrap();
    queue::enqueue(&mut tx, &NewJob::new("to_rabbit"))
        .await
        .unwrap();
    // A value set by hand that names no transaction, or this one at
    // another depth or for another kind, skips nothing.
    for value in [
        "on",
        "1",
        "true",
        "{xid}:1:to_kafka",
        "{xid}:0:plain",
        "{xid}:0",
    ] {
        let value = value.replace("{xid}", &xid(&mut tx).await);
        sqlx::query("SELECT set_config('almanac.routes_taken', $1, true)")
            .bind(&value)
            .execute(&mut *tx)
            .await
            .unwrap();
        assert_eq!(insert_by_hand(&mut tx).await, "broker", "marker {value}");
    }
    tx.commit().await.unwrap();

    let wrong = misrouted(&mut conn).await;
    assert!(wrong.is_empty(), "jobs off their kind's route: {wrong:?}");
    let per_kind: Vec<(String, i64)> =
        sqlx::query_as("SELECT kind, count(*) FROM almanac.jobs GROUP BY kind ORDER BY kind")
            .fetch_all(&mut *conn)
            .await
            .unwrap();
    let per_kind: Vec<(&str, i64)> = per_kind.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    assert_eq!(
        per_kind,
        [
            ("ordered", 2),
            ("plain", 5),
            ("to_kafka", 21),
            ("to_rabbit", 5)
        ]
    );
}

/// A call that fails after the function set its marker (a trigger of the
/// user's refuses a row) rolls the marker back with the savepoint: the next
/// insert is routed.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_failed_call_leaves_no_insert_unrouted(pool: PgPool) {
    set_routes(&pool).await;
    user_trigger(
        &pool,
        "zz_refuse",
        "BEGIN
             IF NEW.payload ? 'refuse' THEN RAISE EXCEPTION 'refused'; END IF;
             RETURN NEW;
         END",
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    for call in [
        "SELECT count(*) FROM almanac.enqueue('to_kafka', '{\"refuse\": 1}')",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['to_kafka', 'to_kafka'], \
             ARRAY['{}', '{\"refuse\": 1}']::jsonb[])",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['to_kafka', 'to_kafka'], \
             ARRAY['{}', '{\"refuse\": 1}']::jsonb[], idempotency_keys => ARRAY['a', 'b'])",
    ] {
        let mut savepoint = tx.begin().await.unwrap();
        let err = sqlx::query(call)
            .execute(&mut *savepoint)
            .await
            .expect_err(call);
        assert!(err.to_string().contains("refused"), "{call}: {err}");
        savepoint.rollback().await.unwrap();
        assert_eq!(insert_by_hand(&mut tx).await, "broker", "after {call}");
    }
    tx.commit().await.unwrap();
    assert_eq!(
        crate::harness::count(&pool, "SELECT count(*) FROM almanac.jobs").await,
        3
    );
    assert!(misrouted(&mut conn).await.is_empty());
}

/// `route set` waits for an open enqueue of the kind (whichever function,
/// whichever path), and names it.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn an_open_enqueue_holds_each_of_its_kinds_against_a_route_change(pool: PgPool) {
    let mut app = pool.acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *app)
        .await
        .unwrap();
    let mut tx = app.begin().await.unwrap();
    exec(
        &mut *tx,
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['a', 'b', 'a'])",
    )
    .await;
    exec(
        &mut *tx,
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['c', 'c'], \
         idempotency_keys => ARRAY['x', 'y'])",
    )
    .await;
    exec(&mut *tx, "SELECT count(*) FROM almanac.enqueue('d')").await;
    let mut operator = pool.acquire().await.unwrap();
    for kind in ["a", "b", "c", "d"] {
        let change = routes::set_within(
            &mut operator,
            kind,
            RouteMode::Broker,
            Some(SinkKind::Kafka),
            Some("t"),
            Duration::from_millis(300),
            None,
        )
        .await;
        match change {
            Err(RouteError::LockTimeout { blockers, .. }) => assert!(
                blockers.iter().any(|b| b.pid == pid),
                "{kind}: the enqueue is named among {blockers:?}"
            ),
            other => panic!("{kind}: route set went ahead of an open enqueue: {other:?}"),
        }
    }
    tx.commit().await.unwrap();
    for kind in ["a", "b", "c", "d"] {
        routes::set(
            &mut operator,
            kind,
            RouteMode::Broker,
            Some(SinkKind::Kafka),
            Some("t"),
        )
        .await
        .unwrap();
    }
    assert!(misrouted(&mut operator).await.is_empty());
}

/// An enqueue that waited for a route change takes the route the change
/// committed, and one that waited for `ordering set` is ordered: the
/// functions read both after the lock, in a statement of their own.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn an_enqueue_that_waited_for_a_route_or_ordering_change_takes_it(pool: PgPool) {
    set_routes(&pool).await;
    let mut change = pool.acquire().await.unwrap();
    let mut tx = change.begin().await.unwrap();
    exec(
        &mut *tx,
        "SELECT pg_advisory_xact_lock(hashtext('almanac.route:to_kafka'))",
    )
    .await;
    exec(
        &mut *tx,
        "UPDATE almanac.routes SET mode = 'db', sink = NULL, destination = NULL \
         WHERE kind = 'to_kafka'",
    )
    .await;
    // And `ordering set` of another kind, under its lock.
    exec(
        &mut *tx,
        "SELECT pg_advisory_xact_lock(hashtext('almanac.route:late'))",
    )
    .await;
    exec(
        &mut *tx,
        "INSERT INTO almanac.kind_ordering (kind, key_pointer, key_path, set_by) \
         VALUES ('late', '/acct', '{acct}', 'test')",
    )
    .await;
    let calls = [
        "SELECT count(*) FROM almanac.enqueue('late', '{\"acct\": \"x\"}')",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['late', 'late'], \
             ARRAY['{\"acct\": \"x\"}', '{\"acct\": \"x\"}']::jsonb[])",
        "SELECT count(*) FROM almanac.enqueue('to_kafka')",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['to_kafka', 'to_kafka'])",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['to_kafka', 'to_kafka'], \
             idempotency_keys => ARRAY['p', 'q'])",
    ];
    let mut pids = Vec::new();
    let mut waiting = tokio::task::JoinSet::new();
    for call in calls {
        // Connections of their own: more than the test pool holds.
        let mut conn = PgConnection::connect_with(&pool.connect_options())
            .await
            .unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        pids.push(pid);
        waiting.spawn(async move {
            exec(&mut conn, call).await;
        });
    }
    eventually(
        "every enqueue waits for the route lock",
        Duration::from_secs(30),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND pid = ANY($1)",
            )
            .bind(&pids)
            .fetch_one(&pool)
            .await
            .unwrap();
            waiting == calls.len() as i64
        },
    )
    .await;
    tx.commit().await.unwrap();
    while let Some(done) = waiting.join_next().await {
        done.unwrap();
    }
    let routes: Vec<String> = sqlx::query_scalar("SELECT DISTINCT route FROM almanac.jobs")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(routes, ["db"], "the route committed while they waited");
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM almanac.outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(outbox, 0);
    let late: Vec<(String, Option<String>, i64)> = sqlx::query_as(
        "SELECT status, ordering_key, count(*) FROM almanac.jobs WHERE kind = 'late' \
         GROUP BY 1, 2 ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        late,
        [
            ("held".to_string(), Some("x".to_string()), 2),
            ("ready".to_string(), Some("x".to_string()), 1)
        ],
        "ordered as the change committed while they waited"
    );
}

/// Jobs a trigger inserts while an enqueue function inserts (a user's
/// trigger on `almanac.jobs` fanning a job out) are routed and ordered by
/// the insert trigger: the functions' marker names their own statement's
/// trigger depth (migration 0138). A nested enqueue restores the outer
/// call's marker, so the outer batch's later rows still skip the trigger:
/// counted with `track_functions`, it runs only for the nested rows that
/// are not a nested function's own.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn jobs_a_trigger_inserts_during_an_enqueue_are_routed_and_ordered(pool: PgPool) {
    set_routes(&pool).await;
    order_per_account(&pool).await;
    // A BEFORE trigger, after the route trigger (triggers fire in name
    // order): it runs while the outer call's batch is half inserted.
    user_trigger(
        &pool,
        "zz_fan_out",
        "BEGIN
             IF NEW.kind = 'parent' THEN
                 INSERT INTO almanac.jobs (kind) VALUES ('to_kafka');
                 PERFORM almanac.enqueue('to_rabbit');
                 PERFORM almanac.enqueue('per_account', '{\"acct\": \"a-1\"}');
                 PERFORM almanac.enqueue_many(ARRAY['to_kafka', 'to_kafka']);
             END IF;
             RETURN NEW;
         END",
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    exec(&mut *tx, "SET LOCAL track_functions = 'pl'").await;
    for call in [
        "SELECT count(*) FROM almanac.enqueue('parent')",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['parent', 'parent', 'parent'])",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['parent', 'parent'], \
             idempotency_keys => ARRAY['p', 'q'])",
    ] {
        exec(&mut *tx, call).await;
        let left = marker(&mut tx).await;
        assert!(
            left.as_deref().unwrap_or_default().is_empty(),
            "{call} left the marker set: {left:?}"
        );
    }
    // Six parents, each with two rows for the trigger: the hand insert and
    // the ordered kind's job.
    assert_eq!(trigger_calls(&mut tx).await, 12);
    tx.commit().await.unwrap();

    let wrong = misrouted(&mut conn).await;
    assert!(wrong.is_empty(), "jobs off their kind's route: {wrong:?}");
    assert_eq!(
        per_kind_and_status(&mut conn, "kind <> 'parent' OR status <> 'ready'").await,
        [
            "per_account held 5",
            "per_account ready 1",
            "to_kafka ready 18",
            "to_rabbit ready 6",
        ]
    );
    let keys: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT DISTINCT ordering_key FROM almanac.jobs WHERE kind = 'per_account'",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert_eq!(keys, [Some("a-1".to_string())]);
}

/// A user's BEFORE trigger that runs ahead of the route trigger and
/// changes the row meets the route trigger, as a hand-written insert's row
/// does (migrations 0139, 0140): a kind it rewrites takes the new kind's
/// route and ordering, an ordering key it sets is refused on a kind that
/// is not ordered, and a route it sets is overwritten with the kind's.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_row_a_user_trigger_rewrites_is_routed_as_rewritten(pool: PgPool) {
    set_routes(&pool).await;
    order_per_account(&pool).await;
    user_trigger(
        &pool,
        "aa_rewrite",
        "BEGIN
             IF NEW.kind = 'alias' THEN NEW.kind := 'to_kafka'; END IF;
             IF NEW.kind = 'alias_ordered' THEN NEW.kind := 'per_account'; END IF;
             IF NEW.kind = 'keyed' THEN NEW.ordering_key := 'k1'; END IF;
             IF NEW.payload ? 'reroute' THEN NEW.route := 'db'; END IF;
             RETURN NEW;
         END",
    )
    .await;
    for call in [
        "SELECT count(*) FROM almanac.enqueue('alias')",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['alias', 'alias'])",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['alias', 'alias'], \
             idempotency_keys => ARRAY['x', 'y'])",
        "SELECT count(*) FROM almanac.enqueue('to_kafka', '{\"reroute\": 1}')",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['to_kafka', 'to_kafka'], \
             ARRAY['{\"reroute\": 1}', '{\"reroute\": 1}']::jsonb[])",
        "SELECT count(*) FROM almanac.enqueue('alias_ordered', '{\"acct\": \"z\"}')",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['alias_ordered', 'alias_ordered'], \
             ARRAY['{\"acct\": \"z\"}', '{\"acct\": \"z\"}']::jsonb[])",
    ] {
        exec(&pool, call).await;
    }
    for call in [
        "SELECT count(*) FROM almanac.enqueue('keyed')",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['keyed', 'keyed'])",
    ] {
        match sqlx::query(call).execute(&pool).await {
            Err(sqlx::Error::Database(e)) => {
                assert_eq!(e.code().as_deref(), Some("22023"), "{call}: {e}");
                assert!(
                    e.message().contains("kind 'keyed' is not ordered"),
                    "{call}: {e}"
                );
            }
            other => panic!("{call}: a key on an unordered kind went in: {other:?}"),
        }
    }
    let mut conn = pool.acquire().await.unwrap();
    let wrong = misrouted(&mut conn).await;
    assert!(wrong.is_empty(), "jobs off their kind's route: {wrong:?}");
    assert_eq!(
        per_kind_and_status(&mut conn, "true").await,
        [
            "per_account held 2",
            "per_account ready 1",
            "to_kafka ready 8",
        ]
    );
}

/// The speed of 0137 is the trigger not running for the functions' own
/// rows: counted with `track_functions`, calls of one kind without ordering
/// call it for no row, while a batch of several kinds (0139), an ordered
/// kind's rows and a hand-written insert still do.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_trigger_runs_for_no_row_the_functions_route_and_for_every_other(pool: PgPool) {
    set_routes(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    exec(&mut *tx, "SET LOCAL track_functions = 'pl'").await;
    let mut counted = Vec::new();
    for call in [
        "SELECT count(*) FROM almanac.enqueue_many(array_fill('to_kafka'::text, ARRAY[300]))",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['plain', 'plain'], \
             idempotency_keys => ARRAY['a', 'b'])",
        "SELECT count(*) FROM almanac.enqueue('to_rabbit')",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['plain', 'to_kafka'])",
        "SELECT count(*) FROM almanac.enqueue_many(ARRAY['ordered', 'ordered', 'ordered'])",
        "SELECT count(*) FROM almanac.enqueue('ordered')",
        "INSERT INTO almanac.jobs (kind) VALUES ('to_kafka'), ('plain')",
    ] {
        exec(&mut *tx, call).await;
        counted.push(trigger_calls(&mut tx).await);
    }
    tx.commit().await.unwrap();
    assert_eq!(counted, [0, 0, 0, 2, 5, 6, 8]);
    assert!(misrouted(&mut conn).await.is_empty());
}

/// How many times the route trigger ran in this transaction (with
/// `track_functions` on).
async fn trigger_calls(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_xact_user_functions \
         WHERE schemaname = 'almanac' AND funcname = 'jobs_take_route'",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}
