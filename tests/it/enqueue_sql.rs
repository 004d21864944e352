//! `almanac.enqueue(...)` and `almanac.enqueue_many(...)`, the SQL functions
//! that are the one enqueue implementation (migrations/0114, docs/enqueue.md),
//! called the way other languages call them: the Python (psycopg) and Node
//! (pg) examples as real processes inside a business transaction, run by a
//! real worker; the PL/pgSQL trigger from the docs; idempotency, NOTIFY on
//! commit, routes and the outbox, named arguments and their defaults; and
//! every refusal, with its SQLSTATE and the message a person reads, and
//! nothing inserted.
//!
//! The examples' clients come from `scripts/services.sh` (a venv in
//! `target/py`, `npm ci` in `examples/node`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use almanac::queue::{self, Enqueued, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::SinkKind;
use almanac::role::{Role, Settings};
use almanac::worker::{Worker, WorkerConfig};
use serde_json::{json, Value};
use sqlx::postgres::PgListener;
use sqlx::Connection;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::{self, count, eventually};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// The kind the examples enqueue.
const EXAMPLE_KIND: &str = "send_order_confirmation";

/// A client of the examples: how to start it.
#[derive(Clone, Copy, Debug)]
enum Client {
    Python,
    Node,
}

impl Client {
    fn command(self) -> Command {
        let (program, script) = match self {
            Client::Python => (
                Path::new(ROOT).join("target/py/bin/python"),
                Path::new(ROOT).join("examples/python/enqueue.py"),
            ),
            Client::Node => (
                PathBuf::from("node"),
                Path::new(ROOT).join("examples/node/enqueue.js"),
            ),
        };
        let installed = match self {
            Client::Python => program.exists(),
            Client::Node => Path::new(ROOT)
                .join("examples/node/node_modules/pg")
                .exists(),
        };
        assert!(
            installed,
            "the {self:?} example's client is not installed; run scripts/services.sh"
        );
        let mut cmd = Command::new(program);
        cmd.arg(script);
        cmd
    }

    /// Runs the example on `pool`'s database: `outcome` is `commit` or
    /// `rollback`, then the order id and, optionally, the payload text.
    fn run(self, pool: &PgPool, args: &[&str]) -> std::process::Output {
        self.command()
            .args(args)
            .env("DATABASE_URL", harness::database_url(pool))
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("the {self:?} example starts: {e}"))
    }
}

/// The job id in an example's `order N: job ID (new), committed` line.
fn job_id_printed(out: &std::process::Output) -> i64 {
    let stdout = harness::text(&out.stdout);
    assert!(
        out.status.success(),
        "the example failed: {}\n{stdout}\n{}",
        out.status,
        harness::text(&out.stderr)
    );
    let id = stdout
        .split_once(": job ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|id| id.parse().ok());
    id.unwrap_or_else(|| panic!("no job id in the example's output: {stdout}"))
}

fn worker_config() -> WorkerConfig {
    WorkerConfig {
        concurrency: 4,
        batch_size: 4,
        lease: Duration::from_secs(10),
        poll_interval: Duration::from_millis(50),
        shutdown_deadline: Duration::from_secs(5),
        listen: true,
        ..WorkerConfig::default()
    }
}

/// One body for every client: a rolled-back order and its job never exist
/// and never run; a committed one is run exactly once by a worker; a
/// payload that is not JSON fails the call (22P02) and neither row exists.
async fn an_example_enqueues_in_its_business_transaction(pool: PgPool, client: Client) {
    harness::create_exec_log(&pool).await;
    let stop = CancellationToken::new();
    let worker = Worker::new(pool.clone(), worker_config().validated().unwrap())
        .register(EXAMPLE_KIND, harness::logging_handler(pool.clone(), 1));
    let running = tokio::spawn(worker.run(stop.clone()));

    let rolled_back = job_id_printed(&client.run(&pool, &["rollback", "7"]));
    let committed = job_id_printed(&client.run(&pool, &["commit", "8"]));
    eventually(
        "the committed order's job to be done",
        Duration::from_secs(30),
        || async {
            count(
                &pool,
                &format!(
                    "SELECT count(*) FROM almanac.jobs WHERE id = {committed} AND status = 'done'"
                ),
            )
            .await
                == 1
        },
    )
    .await;
    stop.cancel();
    let report = running.await.unwrap().unwrap();
    assert_eq!((report.completed, report.retried, report.lost), (1, 0, 0));

    let ran: Vec<i64> = sqlx::query_scalar("SELECT job_id FROM exec_log")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(ran, [committed], "the committed job ran once, nothing else");
    let jobs: Vec<(i64, String, Value, i16, Option<String>)> = sqlx::query_as(
        "SELECT id, kind, payload, priority, idempotency_key FROM almanac.jobs ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        jobs,
        [(
            committed,
            EXAMPLE_KIND.to_string(),
            json!({"order_id": 8}),
            5,
            Some("order:8:confirmation".to_string())
        )],
        "the rolled-back job {rolled_back} does not exist"
    );
    let orders: Vec<i64> = sqlx::query_scalar("SELECT id FROM orders ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(orders, [8]);

    // Text that is not JSON, sent as the payload: the server's cast refuses
    // it, and the transaction leaves neither the order nor a job.
    let out = client.run(&pool, &["commit", "9", "{\"order_id\": 9"]);
    let stderr = harness::text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("22P02") && stderr.contains("invalid input syntax for type json"),
        "{stderr}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 1);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_python_example_commits_a_job_that_runs_once_and_rolls_back_one_that_never_exists(
    pool: PgPool,
) {
    an_example_enqueues_in_its_business_transaction(pool, Client::Python).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_node_example_commits_a_job_that_runs_once_and_rolls_back_one_that_never_exists(
    pool: PgPool,
) {
    an_example_enqueues_in_its_business_transaction(pool, Client::Node).await;
}

/// The first ```sql block of docs/enqueue.md that creates a trigger: the
/// test runs what the docs show.
fn trigger_example() -> &'static str {
    let doc = include_str!("../../docs/enqueue.md");
    doc.split("```sql\n")
        .skip(1)
        .filter_map(|block| block.split_once("```").map(|(sql, _)| sql))
        .find(|sql| sql.contains(" TRIGGER "))
        .expect("docs/enqueue.md shows a trigger that enqueues")
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_docs_trigger_commits_a_business_row_and_its_job_together_or_neither(pool: PgPool) {
    sqlx::raw_sql(trigger_example())
        .execute(&pool)
        .await
        .unwrap();

    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO signups (email) VALUES ('ada@example.com')")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO signups (email) VALUES ('bob@example.com')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let inside: i64 = sqlx::query_scalar("SELECT count(*) FROM almanac.jobs")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(inside, 2, "the trigger enqueued inside the transaction");
    tx.rollback().await.unwrap();

    let signups: Vec<(i64, String)> = sqlx::query_as("SELECT id, email FROM signups")
        .fetch_all(&pool)
        .await
        .unwrap();
    let jobs: Vec<(String, Value, Option<String>)> =
        sqlx::query_as("SELECT kind, payload, idempotency_key FROM almanac.jobs")
            .fetch_all(&pool)
            .await
            .unwrap();
    let [(ada, ref email)] = signups[..] else {
        panic!("one signup committed: {signups:?}")
    };
    assert_eq!(email, "ada@example.com");
    assert_eq!(
        jobs,
        [(
            "send_welcome_email".to_string(),
            json!({"signup_id": ada, "email": "ada@example.com"}),
            Some(format!("signup:{ada}:welcome"))
        )]
    );
}

async fn enqueue_sql(conn: &mut sqlx::PgConnection, call: &str) -> (i64, bool) {
    sqlx::query_as(&format!("SELECT id, created FROM {call}"))
        .fetch_one(conn)
        .await
        .unwrap_or_else(|e| panic!("{call}: {e}"))
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_taken_key_reports_the_job_holding_it_across_calls_batches_and_the_rust_api(
    pool: PgPool,
) {
    let mut conn = pool.acquire().await.unwrap();
    let call = "almanac.enqueue('invoice', '{\"n\": 1}', idempotency_key => 'invoice:2026-11')";
    let (first, created) = enqueue_sql(&mut conn, call).await;
    assert!(created);
    let again = "almanac.enqueue('invoice', '{\"n\": 2}', idempotency_key => 'invoice:2026-11')";
    assert_eq!(enqueue_sql(&mut conn, again).await, (first, false));

    // One call: keyed rows, unkeyed rows, a key taken before the call and
    // one taken earlier in it. Rows come back in input order.
    let rows: Vec<(i64, i64, bool)> = sqlx::query_as(
        "SELECT ord, id, created FROM almanac.enqueue_many(
             kinds => ARRAY['invoice', 'invoice', 'invoice', 'invoice', 'invoice'],
             payloads => ARRAY['{\"i\": 0}', '{}', '{\"i\": 2}', '{\"i\": 3}', '{\"i\": 4}']::jsonb[],
             idempotency_keys => ARRAY[NULL, 'invoice:2026-11', 'invoice:2026-12', NULL, 'invoice:2026-12'])",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let ords: Vec<i64> = rows.iter().map(|r| r.0).collect();
    assert_eq!(ords, [1, 2, 3, 4, 5]);
    let created: Vec<bool> = rows.iter().map(|r| r.2).collect();
    assert_eq!(created, [true, false, true, true, false]);
    assert_eq!(rows[1].1, first);
    assert_eq!(rows[4].1, rows[2].1, "a key taken earlier in the call");
    for (i, n) in [(0, 0), (2, 2), (3, 3)] {
        let payload = queue::get(&pool, rows[i].1).await.unwrap().payload;
        assert_eq!(payload, json!({"i": n}));
    }
    assert_eq!(
        queue::get(&pool, first).await.unwrap().payload,
        json!({"n": 1}),
        "a duplicate never overwrites"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 4);

    // The Rust API and SQL share one implementation, so one key space.
    let rust = queue::enqueue(
        &mut conn,
        &NewJob::new("invoice").idempotency_key("invoice:2026-11"),
    )
    .await
    .unwrap();
    assert_eq!(rust, Enqueued::Existing(first));
    let Enqueued::New(rust_id) = queue::enqueue(
        &mut conn,
        &NewJob::new("invoice").idempotency_key("invoice:2027-01"),
    )
    .await
    .unwrap() else {
        panic!("a new key is a new job")
    };
    let sql = "almanac.enqueue('invoice', idempotency_key => 'invoice:2027-01')";
    assert_eq!(enqueue_sql(&mut conn, sql).await, (rust_id, false));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn named_arguments_take_their_defaults_and_priority_is_stored(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let (plain, _) = enqueue_sql(&mut conn, "almanac.enqueue(kind => 'report')").await;
    let (set, _) = enqueue_sql(
        &mut conn,
        "almanac.enqueue('report', priority => 7, max_attempts => 2, \
         run_at => now() + interval '1 hour', payload => '{\"day\": \"2026-11-30\"}')",
    )
    .await;
    let row = |id: i64| {
        let pool = pool.clone();
        async move {
            let row: (Value, i32, i16, Option<String>, String, String, bool) = sqlx::query_as(
                "SELECT payload, max_attempts, priority, idempotency_key, status, route,
                        run_at <= now() FROM almanac.jobs WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
            row
        }
    };
    assert_eq!(
        row(plain).await,
        (
            json!({}),
            5,
            0,
            None,
            "ready".to_string(),
            "db".to_string(),
            true
        )
    );
    assert_eq!(
        row(set).await,
        (
            json!({"day": "2026-11-30"}),
            2,
            7,
            None,
            "ready".to_string(),
            "db".to_string(),
            false
        )
    );

    // Parameters bound by a driver as int4 (here sqlx's i32) resolve: the
    // parameters are `integer`, not `smallint`.
    let (bound, created): (i64, bool) = sqlx::query_as(
        "SELECT id, created FROM almanac.enqueue(kind => $1, priority => $2, max_attempts => $3)",
    )
    .bind("report")
    .bind(9_i32)
    .bind(1_i32)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert!(created);
    assert_eq!(queue::get(&pool, bound).await.unwrap().priority, 9);

    // enqueue_many: NULL arrays and NULL elements take the defaults.
    let rows: Vec<(i64, i64, bool)> = sqlx::query_as(
        "SELECT * FROM almanac.enqueue_many(ARRAY['a', 'b'], priorities => ARRAY[3, NULL])",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let priorities: Vec<(String, i16, Value)> = sqlx::query_as(
        "SELECT kind, priority, payload FROM almanac.jobs WHERE id = ANY($1) ORDER BY id",
    )
    .bind(rows.iter().map(|r| r.1).collect::<Vec<_>>())
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        priorities,
        [
            ("a".to_string(), 3, json!({})),
            ("b".to_string(), 0, json!({}))
        ]
    );
    let none: Vec<(i64, i64, bool)> = sqlx::query_as("SELECT * FROM almanac.enqueue_many('{}')")
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    assert!(none.is_empty(), "an empty batch enqueues nothing");
}

/// The next notification on `listener`, within a deadline.
async fn next_notification(listener: &mut PgListener) -> String {
    tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("a notification within 10 s")
        .unwrap()
        .payload()
        .to_string()
}

/// A notification from outside the transaction under test: whatever arrives
/// before it was sent before it.
async fn marker(pool: &PgPool, name: &str) {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(queue::NOTIFY_CHANNEL)
        .bind(name)
        .execute(pool)
        .await
        .unwrap();
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn workers_are_notified_when_the_enqueue_commits_and_never_for_a_rollback(pool: PgPool) {
    let mut listener = PgListener::connect_with(&pool).await.unwrap();
    listener.listen(queue::NOTIFY_CHANNEL).await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    enqueue_sql(&mut tx, "almanac.enqueue('ping')").await;
    // Not delivered while the transaction is open: the marker, sent after
    // the enqueue, arrives first.
    marker(&pool, "marker-1").await;
    assert_eq!(next_notification(&mut listener).await, "marker-1");
    tx.commit().await.unwrap();
    assert_eq!(next_notification(&mut listener).await, "ping");

    let mut tx = pool.begin().await.unwrap();
    enqueue_sql(&mut tx, "almanac.enqueue('pong')").await;
    tx.rollback().await.unwrap();
    // A duplicate key inserts nothing: no notification either.
    let mut conn = pool.acquire().await.unwrap();
    enqueue_sql(
        &mut conn,
        "almanac.enqueue('keyed', idempotency_key => 'k')",
    )
    .await;
    assert_eq!(next_notification(&mut listener).await, "keyed");
    enqueue_sql(
        &mut conn,
        "almanac.enqueue('keyed', idempotency_key => 'k')",
    )
    .await;
    marker(&pool, "marker-2").await;
    assert_eq!(
        next_notification(&mut listener).await,
        "marker-2",
        "nothing from the rollback or the duplicate"
    );

    // One notification per kind that got a new row.
    sqlx::query("SELECT * FROM almanac.enqueue_many(ARRAY['x', 'y', 'x'])")
        .execute(&mut *conn)
        .await
        .unwrap();
    let mut kinds = vec![
        next_notification(&mut listener).await,
        next_notification(&mut listener).await,
    ];
    kinds.sort();
    assert_eq!(kinds, ["x", "y"]);
    marker(&pool, "marker-3").await;
    assert_eq!(next_notification(&mut listener).await, "marker-3");
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_dual_kind_enqueued_from_sql_gets_its_outbox_row_and_a_db_kind_none(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    routes::set(
        &mut conn,
        "invoice",
        RouteMode::Dual,
        Some(SinkKind::Kafka),
        Some("invoices"),
    )
    .await
    .unwrap();
    let (id, _) = enqueue_sql(
        &mut conn,
        "almanac.enqueue('invoice', '{\"n\": 1}', idempotency_key => 'invoice:1')",
    )
    .await;
    sqlx::query("SELECT * FROM almanac.enqueue_many(ARRAY['invoice', 'mail'])")
        .execute(&mut *conn)
        .await
        .unwrap();
    // A duplicate writes no second outbox row.
    enqueue_sql(
        &mut conn,
        "almanac.enqueue('invoice', idempotency_key => 'invoice:1')",
    )
    .await;

    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!(job.route, "dual");
    let outbox: Vec<(i64, String, String, String, Value)> = sqlx::query_as(
        "SELECT o.job_id, o.sink, o.destination, j.kind, o.payload
         FROM almanac.outbox o JOIN almanac.jobs j ON j.id = o.job_id ORDER BY o.id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(outbox.len(), 2, "{outbox:?}");
    assert_eq!(
        outbox[0],
        (
            id,
            "kafka".to_string(),
            "invoices".to_string(),
            "invoice".to_string(),
            json!({"n": 1})
        )
    );
    assert_eq!(outbox[1].3, "invoice");
    let key: String = sqlx::query_scalar("SELECT msg_key FROM almanac.outbox WHERE job_id = $1")
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(key, "invoice:1");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE kind = 'mail' AND route = 'db'"
        )
        .await,
        1
    );
}

/// Runs `sql` expecting a refusal: its SQLSTATE and message.
async fn refused(pool: &PgPool, sql: &str) -> (String, String) {
    match sqlx::query(sql).execute(pool).await {
        Err(sqlx::Error::Database(e)) => (
            e.code().unwrap_or_default().into_owned(),
            e.message().to_string(),
        ),
        other => panic!("{sql}: expected a refusal, got {other:?}"),
    }
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn every_invalid_value_is_refused_naming_it_and_nothing_is_inserted(pool: PgPool) {
    let hint = "give the kind its handlers are registered under";
    let cases = [
        (
            "almanac.enqueue('')".to_string(),
            format!("the job kind is empty; {hint}"),
        ),
        (
            "almanac.enqueue('   ')".to_string(),
            format!("the job kind is '   ' (white space only); {hint}"),
        ),
        (
            "almanac.enqueue(NULL)".to_string(),
            format!("the job kind is NULL; {hint}"),
        ),
        (
            "almanac.enqueue('mail', max_attempts => 0)".to_string(),
            "max_attempts is 0; it must be at least 1".to_string(),
        ),
        (
            "almanac.enqueue('mail', priority => 10)".to_string(),
            "priority is 10; it must be 0 (the default) to 9, higher first".to_string(),
        ),
        (
            "almanac.enqueue('mail', priority => -1)".to_string(),
            "priority is -1; it must be 0 (the default) to 9, higher first".to_string(),
        ),
        (
            "almanac.enqueue('mail', idempotency_key => '')".to_string(),
            "the idempotency key is empty; omit it or give a value".to_string(),
        ),
        // In a batch, the first bad job fails the whole call, by its place.
        (
            "almanac.enqueue_many(ARRAY['mail', 'mail', 'mail'], priorities => ARRAY[0, 5, 70])"
                .to_string(),
            "priority is 70; it must be 0 (the default) to 9, higher first (job 3 of 3)"
                .to_string(),
        ),
        (
            "almanac.enqueue_many(ARRAY['mail', ''])".to_string(),
            format!("the job kind is empty; {hint} (job 2 of 2)"),
        ),
        // Arrays that do not line up.
        (
            "almanac.enqueue_many(ARRAY['a', 'b'], payloads => ARRAY['{}']::jsonb[])".to_string(),
            "payloads has 1 element, kinds has 2; give one element per job, or NULL for all defaults"
                .to_string(),
        ),
        (
            "almanac.enqueue_many(ARRAY['a', 'b'], priorities => ARRAY[1, 2, 3])".to_string(),
            "priorities has 3 elements, kinds has 2; give one element per job, or NULL for all defaults"
                .to_string(),
        ),
        (
            "almanac.enqueue_many(ARRAY['a'], idempotency_keys => '{}')".to_string(),
            "idempotency_keys has 0 elements, kinds has 1; give one element per job, or NULL for all defaults"
                .to_string(),
        ),
        (
            "almanac.enqueue_many(ARRAY[['a', 'b'], ['c', 'd']])".to_string(),
            "kinds has 2 dimensions; give a one-dimensional array, one element per job".to_string(),
        ),
        (
            "almanac.enqueue_many(NULL)".to_string(),
            "kinds is NULL; give one kind per job (an empty array enqueues nothing)".to_string(),
        ),
    ];
    for (call, message) in cases {
        let (code, got) = refused(&pool, &format!("SELECT * FROM {call}")).await;
        assert_eq!(
            (code.as_str(), got.as_str()),
            ("22023", message.as_str()),
            "{call}"
        );
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 0);

    // A payload that is not JSON fails at the cast: as a literal, and as
    // text a driver binds.
    let (code, message) =
        refused(&pool, "SELECT * FROM almanac.enqueue('mail', '{\"to\": ')").await;
    assert_eq!(code, "22P02", "{message}");
    assert!(
        message.contains("invalid input syntax for type json"),
        "{message}"
    );
    let bound = sqlx::query("SELECT * FROM almanac.enqueue('mail', $1::jsonb)")
        .bind("ada@example.com")
        .execute(&pool)
        .await
        .unwrap_err();
    let db = bound.as_database_error().expect("a database error");
    assert_eq!(db.code().as_deref(), Some("22P02"), "{db}");
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 0);

    // Inside a business transaction, a refused job takes the business row
    // down with it.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("CREATE TABLE orders (id int)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO orders VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = sqlx::query("SELECT * FROM almanac.enqueue('ship', priority => 12)")
        .execute(&mut *tx)
        .await
        .unwrap_err();
    assert_eq!(
        err.as_database_error().unwrap().code().as_deref(),
        Some("22023")
    );
    // COMMIT of a failed transaction rolls it back.
    let _ = tx.commit().await;
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 0);
}

/// The Rust API refuses an invalid job before sending it, with the
/// function's words, so the caller's transaction stays usable.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_rust_api_refuses_with_the_functions_message_before_sending(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    let batch = [NewJob::new("mail"), NewJob::new("mail").priority(12)];
    let err = queue::enqueue_many(&mut tx, &batch).await.unwrap_err();
    let rust = err.to_string();
    let (_, sql) = refused(
        &pool,
        "SELECT * FROM almanac.enqueue_many(ARRAY['mail', 'mail'], priorities => ARRAY[0, 12])",
    )
    .await;
    assert_eq!(rust, format!("invalid job: {sql}"));
    for job in [
        NewJob::new(""),
        NewJob::new("mail").max_attempts(0),
        NewJob::new("mail").idempotency_key(""),
    ] {
        let err = queue::enqueue(&mut tx, &job).await.unwrap_err();
        assert!(matches!(err, queue::QueueError::Invalid(_)), "{err}");
    }
    // Still usable: nothing was sent.
    queue::enqueue(&mut tx, &NewJob::new("mail")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 1);
}

/// A key whose holder is deleted between the insert that conflicted on it
/// and the read of its id (retention, an operator) is a serialization
/// failure, to retry; the Rust API reports the function's words. A
/// statement trigger stands in for the deleter: it runs after the insert,
/// before the read.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_key_whose_holder_vanishes_under_the_call_is_refused_as_a_retry(pool: PgPool) {
    let message =
        "idempotency key `doomed` conflicted but its job is not visible to this transaction; retry";
    sqlx::raw_sql(
        "CREATE FUNCTION vanish() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN DELETE FROM almanac.jobs WHERE idempotency_key = 'doomed'; RETURN NULL; END $$;
         CREATE TRIGGER vanish AFTER INSERT ON almanac.jobs
             FOR EACH STATEMENT EXECUTE FUNCTION vanish();",
    )
    .execute(&pool)
    .await
    .unwrap();
    // The holder, inserted with the trigger off. (A failed call's delete
    // rolls back with it: the holder stays for the next call.)
    sqlx::raw_sql(
        "ALTER TABLE almanac.jobs DISABLE TRIGGER vanish;
         INSERT INTO almanac.jobs (kind, idempotency_key) VALUES ('mail', 'doomed');
         ALTER TABLE almanac.jobs ENABLE TRIGGER vanish;",
    )
    .execute(&pool)
    .await
    .unwrap();
    for call in [
        "almanac.enqueue('mail', idempotency_key => 'doomed')",
        "almanac.enqueue_many(ARRAY['mail', 'mail'], idempotency_keys => ARRAY['kept', 'doomed'])",
    ] {
        let (code, got) = refused(&pool, &format!("SELECT * FROM {call}")).await;
        assert_eq!((code.as_str(), got.as_str()), ("40001", message), "{call}");
        assert_eq!(
            count(
                &pool,
                "SELECT count(*) FROM almanac.jobs WHERE idempotency_key = 'kept'"
            )
            .await,
            0,
            "{call}: nothing of the call stays"
        );
    }
    let mut conn = pool.acquire().await.unwrap();
    let err = queue::enqueue(&mut conn, &NewJob::new("mail").idempotency_key("doomed"))
        .await
        .unwrap_err();
    // A database error with its SQLSTATE, so that a caller's retry of
    // serialization failures retries it.
    match err {
        almanac::queue::QueueError::Db(sqlx::Error::Database(db)) => {
            assert_eq!(db.code().as_deref(), Some("40001"));
            assert_eq!(db.message(), message);
        }
        other => panic!("expected the database's 40001, got {other:?}"),
    }
}

/// `almanac.enqueue` inserts its one job itself and hands any job it would
/// refuse to `almanac.enqueue_many` (migrations 0134, 0136): fed the same
/// values, the two store the same row and refuse with the same SQLSTATE
/// and message, also in a session with `standard_conforming_strings` off
/// (PL/pgSQL reads its statements' literals with the session's setting).
/// Each pair runs in one transaction (one `now()`), rolled back.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn enqueue_stores_and_refuses_exactly_as_enqueue_many_does(pool: PgPool) {
    sqlx::query("INSERT INTO almanac.kind_ordering (kind, set_by) VALUES ('ordered', 'test')")
        .execute(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    same_from_both_functions(&mut conn).await;
    // A new session, so that the functions' statements are first parsed
    // with the setting off.
    let options = pool
        .connect_options()
        .as_ref()
        .clone()
        .options([("standard_conforming_strings", "off")]);
    let mut old_style = sqlx::PgConnection::connect_with(&options).await.unwrap();
    same_from_both_functions(&mut old_style).await;
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 0);
}

/// The cases of [`enqueue_stores_and_refuses_exactly_as_enqueue_many_does`]
/// on `conn`.
async fn same_from_both_functions(conn: &mut sqlx::PgConnection) {
    let tp = "'00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'";
    // kind; payload; run_at; max_attempts; idempotency key; priority;
    // ordering key; traceparent: SQL literals, a missing one NULL.
    let cases = [
        "'mail'".to_string(),
        format!("'mail'; '{{\"to\": \"ada\"}}'; '2030-01-02 03:04:05+00'; 3; 'welcome:ada'; 7; NULL; {tp}"),
        "'ordered'; '{}'; NULL; 1; NULL; 9; 'order-1'".into(),
        "'mail'; '[1, 2]'; NULL; NULL; NULL; 0".into(),
        // Accepted at the edges: kinds without a capital S or with the
        // batch check's separator, a key of white space, a traceparent of a
        // later version.
        "'sss'; NULL; NULL; 1; ' '; 9".into(),
        "'a' || chr(1) || 'b'; NULL; NULL; NULL; NULL; 0".into(),
        "' x '".into(),
        // The separator alone: enqueue_many's batch check suspects it, its
        // query finds nothing wrong.
        "chr(1)".into(),
        "'mail'; NULL; NULL; NULL; NULL; NULL; NULL; '01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later'".into(),
        // Refused, by the function or by the kind's route trigger.
        "''".into(),
        "' \t'".into(),
        "NULL".into(),
        "'mail'; NULL; NULL; 0".into(),
        "'mail'; NULL; NULL; -4".into(),
        "'mail'; NULL; NULL; NULL; NULL; 10".into(),
        "'mail'; NULL; NULL; NULL; NULL; -1".into(),
        "'mail'; NULL; NULL; NULL; ''".into(),
        "'ordered'; NULL; NULL; NULL; NULL; NULL; ''".into(),
        "'mail'; NULL; NULL; NULL; NULL; NULL; 'k'".into(),
        "'mail'; NULL; NULL; NULL; NULL; NULL; NULL; '00-0-0-01'".into(),
        "'mail'; NULL; NULL; NULL; NULL; NULL; NULL; '00-00000000000000000000000000000000-00f067aa0ba902b7-01'".into(),
        // Two problems: the first in enqueue_many's order is named.
        "''; NULL; NULL; 0; ''; 12; NULL; 'x'".into(),
    ];
    let row = "SELECT to_jsonb(j) - 'id' FROM almanac.jobs AS j";
    let mut accepted = 0;
    for case in &cases {
        let mut fields: Vec<&str> = case.split(';').map(str::trim).collect();
        assert!(fields.len() <= 8, "{case}: more than eight values");
        fields.resize(8, "NULL");
        let [kind, payload, run_at, max_attempts, key, priority, okey, tp] = fields[..] else {
            unreachable!("eight values");
        };
        let one = format!(
            "SELECT id FROM almanac.enqueue(kind => {kind}, payload => {payload}, run_at => {run_at}, \
             max_attempts => {max_attempts}, idempotency_key => {key}, priority => {priority}, \
             ordering_key => {okey}, traceparent => {tp})"
        );
        let many = format!(
            "SELECT id FROM almanac.enqueue_many(kinds => ARRAY[{kind}]::text[], \
             payloads => ARRAY[{payload}]::jsonb[], run_ats => ARRAY[{run_at}]::timestamptz[], \
             max_attempts => ARRAY[{max_attempts}]::int[], idempotency_keys => ARRAY[{key}]::text[], \
             priorities => ARRAY[{priority}]::int[], ordering_keys => ARRAY[{okey}]::text[], \
             traceparents => ARRAY[{tp}]::text[])"
        );
        let mut tx = conn.begin().await.unwrap();
        let mut outcomes = Vec::new();
        for call in [&one, &many] {
            sqlx::query("SAVEPOINT call")
                .execute(&mut *tx)
                .await
                .unwrap();
            let outcome = match sqlx::query_scalar::<_, i64>(call).fetch_one(&mut *tx).await {
                Ok(_) => Ok(sqlx::query_scalar::<_, Value>(row)
                    .fetch_all(&mut *tx)
                    .await
                    .unwrap()),
                Err(sqlx::Error::Database(e)) => Err((
                    e.code().unwrap_or_default().into_owned(),
                    e.message().to_string(),
                )),
                Err(other) => panic!("{call}: {other}"),
            };
            outcomes.push(outcome);
            sqlx::query("ROLLBACK TO SAVEPOINT call")
                .execute(&mut *tx)
                .await
                .unwrap();
        }
        tx.rollback().await.unwrap();
        if let Ok(stored) = &outcomes[0] {
            assert_eq!(stored.len(), 1, "{one}: one job stored");
            accepted += 1;
        }
        assert_eq!(outcomes[0], outcomes[1], "{one}\n{many}");
    }
    assert_eq!(accepted, 9, "the first nine cases are accepted");
}

/// A batch without idempotency keys takes its own insert (migration 0135:
/// no `ON CONFLICT`); given keys that are all NULL, the same batch takes
/// the keyed one. Both store the same rows, return one row per job in
/// input order with ids ascending, all new, and notify each kind once.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_batch_without_keys_stores_and_returns_what_the_keyed_path_does(pool: PgPool) {
    sqlx::query("INSERT INTO almanac.kind_ordering (kind, set_by) VALUES ('c', 'test')")
        .execute(&pool)
        .await
        .unwrap();
    // Every parameter set on some job; the two jobs of ordered kind `c`
    // share a key, so the second is held.
    let args = "ARRAY['b', 'a', 'c', 'c'], \
                payloads => ARRAY['{\"n\": 1}', NULL, '{\"n\": 3}', '[4]']::jsonb[], \
                max_attempts => ARRAY[NULL, 2, NULL, 9], priorities => ARRAY[1, NULL, 0, 9], \
                run_ats => ARRAY[NULL, '2030-01-01 00:00:00+00', NULL, NULL]::timestamptz[], \
                schedules => ARRAY['nightly', NULL, NULL, NULL], \
                logical_runs => ARRAY['2026-12-01', NULL, NULL, NULL], \
                ordering_keys => ARRAY[NULL, NULL, 'k', 'k'], \
                traceparents => ARRAY['00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01', \
                                      NULL, NULL, '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00']";
    let row = "SELECT to_jsonb(j) - 'id' FROM almanac.jobs AS j ORDER BY j.id";
    let mut stored = Vec::new();
    for keys in ["NULL", "ARRAY[NULL, NULL, NULL, NULL]::text[]"] {
        let mut tx = pool.begin().await.unwrap();
        let mut listener = PgListener::connect_with(&pool).await.unwrap();
        listener.listen(queue::NOTIFY_CHANNEL).await.unwrap();
        let returned: Vec<(i64, i64, bool)> = sqlx::query_as(&format!(
            "SELECT ord, id, created FROM almanac.enqueue_many({args}, idempotency_keys => {keys})"
        ))
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        let ords: Vec<i64> = returned.iter().map(|r| r.0).collect();
        assert_eq!(ords, [1, 2, 3, 4], "{keys}");
        assert!(returned.iter().all(|r| r.2), "{keys}: every job new");
        assert!(
            returned.windows(2).all(|w| w[0].1 < w[1].1),
            "{keys}: ids ascend in input order: {returned:?}"
        );
        let rows: Vec<Value> = sqlx::query_scalar(row).fetch_all(&mut *tx).await.unwrap();
        let statuses: Vec<&str> = rows.iter().map(|r| r["status"].as_str().unwrap()).collect();
        assert_eq!(statuses, ["ready", "ready", "ready", "held"], "{keys}");
        // Read as another language's driver would, without ORDER BY.
        let unordered: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT ord FROM almanac.enqueue_many({args}, idempotency_keys => {keys})"
        ))
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        assert_eq!(unordered, [1, 2, 3, 4], "{keys}");
        tx.commit().await.unwrap();
        let mut heard = Vec::new();
        for _ in 0..3 {
            heard.push(next_notification(&mut listener).await);
        }
        heard.sort();
        assert_eq!(heard, ["a", "b", "c"], "{keys}: each kind once");
        marker(&pool, "end").await;
        assert_eq!(next_notification(&mut listener).await, "end", "{keys}");
        sqlx::query("DELETE FROM almanac.jobs")
            .execute(&pool)
            .await
            .unwrap();
        stored.push(
            rows.into_iter()
                .map(|mut r| {
                    // now() differs between the two transactions.
                    r.as_object_mut().unwrap().remove("created_at");
                    if r["run_at"] != "2030-01-01T00:00:00+00:00" {
                        r.as_object_mut().unwrap().remove("run_at");
                    }
                    r
                })
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(stored[0], stored[1]);
}
