//! One trace per job (issue #24 item 3), against a real OTLP/HTTP receiver
//! in the test (an axum server on 127.0.0.1:0 decoding the JSON the
//! exporter posts, field by field as the OTLP spec names them, with none of
//! almanac's own types).
//!
//! For 1,000 jobs per route mode (`db` with a worker; `dual` and `broker`
//! with relay and consumer, on RabbitMQ and on the Kafka-protocol broker),
//! each enqueued with a traceparent of its own and one in ten failing its
//! first attempt: every first attempt's execution span is in the job's
//! trace, a child of the enqueue span (claimed from PostgreSQL) or of the
//! relay's publish span (run from a message; always so in `broker` mode);
//! every retry's execution span is in a new trace linked to the enqueue
//! context; the handler's `traceparent()` is its execution span. Also: an
//! exec handler's command sees `TRACEPARENT`, and a schedule's logical run
//! has a span its job's execution joins.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use almanac::consumer::{Consumer, ConsumerConfig};
use almanac::queue::{self, NewJob};
use almanac::relay::routes::{self, RouteMode};
use almanac::relay::{Publisher, Relay, SinkKind};
use almanac::role::{Role, Settings};
use almanac::scheduler::spec::load_sources;
use almanac::scheduler::ticker::Ticker;
use almanac::telemetry::{ExportConfig, Tracer};
use almanac::worker::exec::ExecHandler;
use almanac::worker::{HandlerError, JobContext, Worker, WorkerConfig};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::brokers::{self, unique};
use crate::harness::{self, count, eventually};

const KIND: &str = "traced";
const JOBS: i64 = 1_000;

/// A span as the receiver decoded it.
#[derive(Debug, Clone)]
struct Got {
    trace_id: String,
    span_id: String,
    parent: Option<String>,
    name: String,
    attributes: HashMap<String, Value>,
    /// (trace id, span id) of each link.
    links: Vec<(String, String)>,
    status_code: i64,
}

impl Got {
    fn int(&self, key: &str) -> Option<i64> {
        self.attributes.get(key)?["intValue"].as_str()?.parse().ok()
    }
    fn text(&self, key: &str) -> Option<&str> {
        self.attributes.get(key)?["stringValue"].as_str()
    }
}

/// The OTLP/HTTP receiver: every span of every `POST /v1/traces`.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Got>>>,
    /// Each post's `Content-Type` and `Authorization` headers.
    posts: Arc<Mutex<Vec<(String, String)>>>,
}

impl Receiver {
    async fn start() -> (Receiver, SocketAddr) {
        let receiver = Receiver::default();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post({
                let receiver = receiver.clone();
                move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                    let receiver = receiver.clone();
                    async move {
                        let header = |name: &str| {
                            headers
                                .get(name)
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                                .to_string()
                        };
                        receiver
                            .posts
                            .lock()
                            .unwrap()
                            .push((header("content-type"), header("authorization")));
                        let request: Value = serde_json::from_slice(&body).unwrap();
                        receiver.spans.lock().unwrap().extend(decode(&request));
                        "{}"
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (receiver, addr)
    }

    fn named(&self, name: &str) -> Vec<Got> {
        self.spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.name == name)
            .cloned()
            .collect()
    }
}

/// An `ExportTraceServiceRequest` in OTLP/JSON: ids are hex, int64 values
/// strings.
fn decode(request: &Value) -> Vec<Got> {
    let mut out = Vec::new();
    for resource in request["resourceSpans"].as_array().unwrap() {
        let service = resource["resource"]["attributes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["key"] == "service.name")
            .map(|a| a["value"]["stringValue"].clone());
        assert_eq!(service, Some(json!("almanac")));
        for scope in resource["scopeSpans"].as_array().unwrap() {
            for span in scope["spans"].as_array().unwrap() {
                let hex = |v: &Value| {
                    let s = v.as_str().unwrap().to_string();
                    assert!(s.bytes().all(|b| b.is_ascii_hexdigit()), "{s}");
                    s
                };
                let start: u64 = span["startTimeUnixNano"].as_str().unwrap().parse().unwrap();
                let end: u64 = span["endTimeUnixNano"].as_str().unwrap().parse().unwrap();
                assert!(start > 0 && end >= start, "{span}");
                out.push(Got {
                    trace_id: hex(&span["traceId"]),
                    span_id: hex(&span["spanId"]),
                    parent: span.get("parentSpanId").map(hex).filter(|p| !p.is_empty()),
                    name: span["name"].as_str().unwrap().to_string(),
                    attributes: span["attributes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|a| (a["key"].as_str().unwrap().to_string(), a["value"].clone()))
                        .collect(),
                    links: span
                        .get("links")
                        .and_then(Value::as_array)
                        .map(|links| {
                            links
                                .iter()
                                .map(|l| (hex(&l["traceId"]), hex(&l["spanId"])))
                                .collect()
                        })
                        .unwrap_or_default(),
                    status_code: span["status"]["code"].as_i64().unwrap_or(0),
                });
            }
        }
    }
    out
}

fn tracer(addr: SocketAddr) -> Tracer {
    let mut config = ExportConfig::new(format!("http://{addr}"));
    config.interval = Duration::from_millis(100);
    Tracer::otlp(config).unwrap()
}

/// The enqueue context of job `n`: trace id and span id made from `n`.
fn enqueue_context(salt: u32, n: i64) -> (String, String) {
    (
        format!("{salt:08x}{:024x}", n + 1),
        format!("{:016x}", 0xabc0_0000 + n),
    )
}

fn traceparent((trace, span): &(String, String)) -> String {
    format!("00-{trace}-{span}-01")
}

/// Attempt → the traceparent the handler saw, per job.
type Seen = Arc<Mutex<HashMap<i64, Vec<(i32, Option<String>)>>>>;

/// Records what the handler saw; one job in ten fails its first attempt.
fn handler(seen: Seen) -> impl Fn(JobContext) -> std::future::Ready<Result<(), HandlerError>> {
    move |ctx: JobContext| {
        seen.lock()
            .unwrap()
            .entry(ctx.job.id)
            .or_default()
            .push((ctx.job.attempts, ctx.traceparent()));
        std::future::ready(
            if ctx.job.payload["n"].as_i64().unwrap() % 10 == 3 && ctx.job.attempts == 1 {
                Err(HandlerError::retry_after(
                    "the first attempt of one job in ten fails",
                    Duration::from_millis(10),
                ))
            } else {
                Ok(())
            },
        )
    }
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    Db,
    Dual(SinkKind),
    Broker(SinkKind),
}

async fn every_execution_joins_its_enqueue_trace(pool: PgPool, mode: Mode) {
    let (receiver, addr) = Receiver::start().await;
    let tracer = tracer(addr);
    let salt: u32 = rand_salt();
    let stop = CancellationToken::new();
    let seen: Seen = Arc::default();
    let config = WorkerConfig {
        concurrency: 32,
        batch_size: 16,
        poll_interval: Duration::from_millis(20),
        ..WorkerConfig::default()
    }
    .validated()
    .unwrap();
    let mut tasks = Vec::new();
    let sink = match mode {
        Mode::Db => None,
        Mode::Dual(s) | Mode::Broker(s) => Some(s),
    };
    if !matches!(mode, Mode::Broker(_)) {
        let worker = Worker::new(pool.clone(), config.clone())
            .with_tracer(tracer.clone())
            .register(KIND, handler(seen.clone()));
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            worker.run(stop).await.map(drop).map_err(|e| e.to_string())
        }));
    }
    if let Some(sink) = sink {
        let destination = unique("traced");
        let sinks = brokers::sinks();
        let mut publisher = Publisher::new(sink, &sinks).unwrap();
        publisher.ensure(&destination).await.unwrap();
        let relay = Relay::new(
            pool.clone(),
            publisher,
            brokers::relay_config().validated().unwrap(),
        )
        .with_tracer(tracer.clone());
        let stop2 = stop.clone();
        tasks.push(tokio::spawn(async move {
            relay.run(stop2).await.map(drop).map_err(|e| e.to_string())
        }));
        let consumer = Consumer::new(
            pool.clone(),
            sinks,
            ConsumerConfig {
                sink,
                destination: destination.clone(),
                group: None,
                worker: config.clone(),
            },
        )
        .with_tracer(tracer.clone())
        .register(KIND, handler(seen.clone()));
        let stop3 = stop.clone();
        tasks.push(tokio::spawn(async move {
            consumer
                .run(stop3)
                .await
                .map(drop)
                .map_err(|e| e.to_string())
        }));
        let route = if matches!(mode, Mode::Dual(_)) {
            RouteMode::Dual
        } else {
            RouteMode::Broker
        };
        routes::set(
            &mut pool.acquire().await.unwrap(),
            KIND,
            route,
            Some(sink),
            Some(&destination),
        )
        .await
        .unwrap();
    }
    // Enqueued in batches of 100, each job with its own traceparent.
    let mut ids: BTreeMap<i64, i64> = BTreeMap::new();
    let mut conn = pool.acquire().await.unwrap();
    for start in (0..JOBS).step_by(100) {
        let batch: Vec<NewJob> = (start..start + 100)
            .map(|n| {
                NewJob::new(KIND)
                    .payload(json!({ "n": n }))
                    .traceparent(traceparent(&enqueue_context(salt, n)))
            })
            .collect();
        for (n, enqueued) in (start..).zip(queue::enqueue_many(&mut conn, &batch).await.unwrap()) {
            ids.insert(enqueued.id(), n);
        }
    }
    drop(conn);
    eventually(
        "every traced job done",
        Duration::from_secs(240),
        || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
            )
            .await
                == JOBS
        },
    )
    .await;
    if matches!(mode, Mode::Dual(_)) {
        // In dual mode the database's workers may finish a job before the
        // relay has published its copy; every copy is published anyway (a
        // published row is deleted by its mark, a failed one kept).
        eventually(
            "every outbox row of a dual job published or failed",
            Duration::from_secs(120),
            || async {
                count(
                    &pool,
                    "SELECT count(*) FROM almanac.outbox WHERE failed_at IS NULL",
                )
                .await
                    == 0
            },
        )
        .await;
        assert_eq!(
            count(&pool, "SELECT count(*) FROM almanac.outbox").await,
            0,
            "no outbox row failed"
        );
    }
    stop.cancel();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    tracer.flush().await;
    let retried = JOBS / 10;
    eventually(
        "every execution span received",
        Duration::from_secs(30),
        || async {
            let got = receiver.named("almanac.execute").len() as i64;
            if got >= JOBS + retried {
                Ok(())
            } else {
                Err(format!("{got} of {}", JOBS + retried))
            }
        },
    )
    .await;
    assert_eq!(tracer.report().dropped, 0, "no span dropped");
    assert!(receiver
        .posts
        .lock()
        .unwrap()
        .iter()
        .all(|(c, _)| c == "application/json"));

    let publishes: HashMap<String, Got> = receiver
        .named("almanac.publish")
        .into_iter()
        .map(|s| (s.span_id.clone(), s))
        .collect();
    let executions = receiver.named("almanac.execute");
    let seen = seen.lock().unwrap();
    let mut per_job: HashMap<i64, Vec<&Got>> = HashMap::new();
    for span in &executions {
        let id = span
            .int("almanac.job.id")
            .expect("an execution span names its job");
        per_job.entry(id).or_default().push(span);
    }
    let (mut via_publish, mut via_db) = (0, 0);
    for (id, n) in &ids {
        let enqueue = enqueue_context(salt, *n);
        let spans = per_job
            .get(id)
            .unwrap_or_else(|| panic!("job {id} has no execution span"));
        let attempts = if n % 10 == 3 { 2 } else { 1 };
        assert_eq!(
            spans.len(),
            attempts,
            "job {id}: one execution span per attempt: {spans:?}"
        );
        for span in spans {
            assert_eq!(span.text("almanac.job.kind"), Some(KIND));
            let attempt = span.int("almanac.job.attempt").unwrap();
            // What the handler saw is the execution span's own context.
            let handed = seen[id]
                .iter()
                .find(|(a, _)| i64::from(*a) == attempt)
                .unwrap();
            assert_eq!(
                handed.1.as_deref(),
                Some(format!("00-{}-{}-01", span.trace_id, span.span_id).as_str()),
                "job {id} attempt {attempt}"
            );
            if attempt == 1 {
                assert_eq!(
                    span.trace_id, enqueue.0,
                    "job {id}: the first attempt joins the enqueue trace"
                );
                let parent = span
                    .parent
                    .as_deref()
                    .expect("a first attempt has a parent");
                if parent == enqueue.1 {
                    via_db += 1;
                } else {
                    let publish = publishes.get(parent).unwrap_or_else(|| {
                        panic!("job {id}: parent {parent} is neither enqueue nor publish")
                    });
                    assert_eq!(publish.trace_id, enqueue.0);
                    assert_eq!(publish.parent.as_deref(), Some(enqueue.1.as_str()));
                    assert_eq!(publish.int("almanac.job.id"), Some(*id));
                    via_publish += 1;
                }
                let outcome = if attempts == 2 {
                    "retried"
                } else {
                    "completed"
                };
                assert_eq!(span.text("almanac.outcome"), Some(outcome));
                assert_eq!(span.status_code, if attempts == 2 { 2 } else { 1 });
            } else {
                assert_ne!(
                    span.trace_id, enqueue.0,
                    "job {id}: a retry starts a new trace"
                );
                assert_eq!(span.parent, None);
                assert_eq!(
                    span.links,
                    vec![enqueue.clone()],
                    "job {id}: the retry links to the enqueue context"
                );
                assert_eq!(span.text("almanac.outcome"), Some("completed"));
            }
        }
    }
    match mode {
        Mode::Db => {
            assert_eq!(via_db, JOBS);
            assert!(publishes.is_empty());
        }
        Mode::Broker(sink) => {
            assert_eq!(
                via_publish, JOBS,
                "in broker mode every job came by a message"
            );
            // One publish per ready transition: the enqueue and each retry.
            let traced: Vec<&Got> = publishes
                .values()
                .filter(|p| p.trace_id.starts_with(&format!("{salt:08x}")))
                .collect();
            assert!(
                traced.len() as i64 >= JOBS + retried,
                "{} publish spans",
                traced.len()
            );
            for p in traced {
                assert_eq!(p.text("messaging.system"), Some(sink.as_str()));
                assert_eq!(p.status_code, 1);
            }
        }
        Mode::Dual(_) => {
            assert_eq!(via_db + via_publish, JOBS);
            assert!(
                publishes.len() as i64 >= JOBS,
                "every outbox row of a dual job was published under a span"
            );
        }
    }
}

fn rand_salt() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        | 1
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn tracing_db_mode_every_execution_joins_or_links_its_enqueue_trace(pool: PgPool) {
    every_execution_joins_its_enqueue_trace(pool, Mode::Db).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn tracing_dual_mode_on_rabbitmq(pool: PgPool) {
    every_execution_joins_its_enqueue_trace(pool, Mode::Dual(SinkKind::Rabbitmq)).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn tracing_dual_mode_on_kafka(pool: PgPool) {
    every_execution_joins_its_enqueue_trace(pool, Mode::Dual(SinkKind::Kafka)).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn tracing_broker_mode_on_rabbitmq(pool: PgPool) {
    every_execution_joins_its_enqueue_trace(pool, Mode::Broker(SinkKind::Rabbitmq)).await;
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn tracing_broker_mode_on_kafka(pool: PgPool) {
    every_execution_joins_its_enqueue_trace(pool, Mode::Broker(SinkKind::Kafka)).await;
}

/// A worker running `cmd` for `KIND` with `tracer` until every job is done.
async fn run_until_done(pool: &PgPool, tracer: &Tracer, handler: ExecHandler, jobs: i64) {
    let stop = CancellationToken::new();
    let worker = Worker::new(
        pool.clone(),
        WorkerConfig::for_commands().validated().unwrap(),
    )
    .with_tracer(tracer.clone())
    .register(KIND, handler);
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { worker.run(stop).await.unwrap() }
    });
    eventually("the jobs done", Duration::from_secs(60), || async {
        count(
            pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
        )
        .await
            == jobs
    })
    .await;
    stop.cancel();
    task.await.unwrap();
    tracer.flush().await;
}

fn exec_handler(dir: &std::path::Path) -> ExecHandler {
    ExecHandler::new(format!(
        "printf '%s\\n' \"$TRACEPARENT\" > {}/$ALMANAC_JOB_ID",
        dir.display()
    ))
    .watchdog(env!("CARGO_BIN_EXE_almanac"))
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn tracing_an_exec_handler_sees_its_execution_span_in_traceparent(pool: PgPool) {
    let (receiver, addr) = Receiver::start().await;
    let tracer = tracer(addr);
    let dir = std::env::temp_dir().join(unique("traceparent"));
    std::fs::create_dir_all(&dir).unwrap();
    let enqueued = (7, 42);
    let mut conn = pool.acquire().await.unwrap();
    let with = queue::enqueue(
        &mut conn,
        &NewJob::new(KIND).traceparent(traceparent(&enqueue_context(enqueued.0, enqueued.1))),
    )
    .await
    .unwrap()
    .id();
    let without = queue::enqueue(&mut conn, &NewJob::new(KIND))
        .await
        .unwrap()
        .id();
    drop(conn);
    run_until_done(&pool, &tracer, exec_handler(&dir), 2).await;
    let executions = receiver.named("almanac.execute");
    for id in [with, without] {
        let env = std::fs::read_to_string(dir.join(id.to_string())).unwrap();
        let span = executions
            .iter()
            .find(|s| s.int("almanac.job.id") == Some(id))
            .unwrap_or_else(|| panic!("job {id} has an execution span"));
        assert_eq!(
            env.trim(),
            format!("00-{}-{}-01", span.trace_id, span.span_id),
            "job {id}"
        );
    }
    let joined = executions
        .iter()
        .find(|s| s.int("almanac.job.id") == Some(with))
        .unwrap();
    let enqueue = enqueue_context(enqueued.0, enqueued.1);
    assert_eq!(
        (joined.trace_id.as_str(), joined.parent.as_deref()),
        (enqueue.0.as_str(), Some(enqueue.1.as_str()))
    );

    // Tracing off: the command gets the traceparent the job was enqueued
    // with, passed on as it is, and none when it has none.
    let off_dir = dir.join("off");
    std::fs::create_dir_all(&off_dir).unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let with = queue::enqueue(
        &mut conn,
        &NewJob::new(KIND).traceparent(traceparent(&enqueue)),
    )
    .await
    .unwrap()
    .id();
    let without = queue::enqueue(&mut conn, &NewJob::new(KIND))
        .await
        .unwrap()
        .id();
    drop(conn);
    run_until_done(&pool, &Tracer::off(), exec_handler(&off_dir), 4).await;
    let read = |id: i64| std::fs::read_to_string(off_dir.join(id.to_string())).unwrap();
    assert_eq!(read(with).trim(), traceparent(&enqueue));
    assert_eq!(read(without).trim(), "");
    let _ = std::fs::remove_dir_all(&dir);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn tracing_a_schedule_s_logical_run_has_a_span_its_job_joins(pool: PgPool) {
    let (receiver, addr) = Receiver::start().await;
    let tracer = tracer(addr);
    let text = format!("[traced-every-minute]\ncron = \"* * * * *\"\nkind = \"{KIND}\"\n");
    let schedules = load_sources(&[("test.toml".into(), text)]).unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let mut ticker = Ticker::load(&mut conn, schedules, Duration::from_secs(60))
        .await
        .unwrap()
        .with_tracer(tracer.clone());
    let first = ticker.next_wake().unwrap();
    let report = ticker
        .tick(&mut conn, first + chrono::Duration::seconds(1))
        .await
        .unwrap();
    assert_eq!(report.emitted, 1);
    // Due now rather than at its fire time (up to a minute away).
    sqlx::query("UPDATE almanac.jobs SET run_at = now()")
        .execute(&mut *conn)
        .await
        .unwrap();
    let (id, stored, run): (i64, Option<String>, String) =
        sqlx::query_as("SELECT id, traceparent, logical_run FROM almanac.jobs")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    drop(conn);
    let seen: Seen = Arc::default();
    let stop = CancellationToken::new();
    let worker = Worker::new(pool.clone(), WorkerConfig::default().validated().unwrap())
        .with_tracer(tracer.clone())
        .register(KIND, {
            let seen = seen.clone();
            move |ctx: JobContext| {
                seen.lock()
                    .unwrap()
                    .entry(ctx.job.id)
                    .or_default()
                    .push((ctx.job.attempts, ctx.traceparent()));
                std::future::ready(Ok::<(), HandlerError>(()))
            }
        });
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { worker.run(stop).await.unwrap() }
    });
    eventually(
        "the scheduled job done",
        Duration::from_secs(30),
        || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
            )
            .await
                == 1
        },
    )
    .await;
    stop.cancel();
    task.await.unwrap();
    tracer.flush().await;
    let runs = receiver.named("almanac.schedule.run");
    assert_eq!(runs.len(), 1, "{runs:?}");
    let run_span = &runs[0];
    assert_eq!(
        run_span.text("almanac.schedule"),
        Some("traced-every-minute")
    );
    assert_eq!(run_span.text("almanac.logical_run"), Some(run.as_str()));
    assert_eq!(run_span.parent, None, "a logical run starts its trace");
    assert_eq!(
        stored.as_deref(),
        Some(format!("00-{}-{}-01", run_span.trace_id, run_span.span_id).as_str()),
        "the emitted job carries the run span's context"
    );
    let execution = receiver
        .named("almanac.execute")
        .into_iter()
        .find(|s| s.int("almanac.job.id") == Some(id))
        .expect("the scheduled job's execution span");
    assert_eq!(execution.trace_id, run_span.trace_id);
    assert_eq!(execution.parent.as_deref(), Some(run_span.span_id.as_str()));
    assert_eq!(
        execution.text("almanac.schedule"),
        Some("traced-every-minute")
    );
}

/// Runs recorded by `almanac backfill` and `almanac schedules trigger`
/// get their `almanac.schedule.run` span too, exported before the command
/// exits, and each emitted job carries its run's context.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn tracing_backfilled_and_triggered_runs_have_their_spans(pool: PgPool) {
    let (receiver, addr) = Receiver::start().await;
    let dir = std::env::temp_dir().join(unique("traced-backfill"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("s.toml"),
        format!("[hourly]\ncron = \"0 * * * *\"\ntimezone = \"UTC\"\nkind = \"{KIND}\"\n"),
    )
    .unwrap();
    let url = harness::database_url(&pool);
    let endpoint = format!("http://{addr}");
    // Waited for off the runtime's thread, which serves the receiver.
    let cli = |args: &[&str]| {
        let mut command = harness::almanac();
        command
            .args(args)
            .arg("--schedules")
            .arg(&dir)
            .args(["--otlp-endpoint", &endpoint])
            .env("DATABASE_URL", &url);
        let shown = format!("{args:?}");
        async move {
            let out = tokio::task::spawn_blocking(move || command.output().unwrap())
                .await
                .unwrap();
            assert!(
                out.status.success(),
                "{shown}: {}",
                harness::text(&out.stderr)
            );
        }
    };
    // The runs of three hours two days ago; then the latest due run.
    let from = (chrono::Utc::now() - chrono::Duration::days(2))
        .format("%Y-%m-%dT%H:00:00Z")
        .to_string();
    let to = (chrono::Utc::now() - chrono::Duration::days(2) + chrono::Duration::hours(3))
        .format("%Y-%m-%dT%H:00:00Z")
        .to_string();
    cli(&["backfill", "hourly", "--from", &from, "--to", &to]).await;
    cli(&["schedules", "trigger", "hourly"]).await;
    // The same run again: recorded already, so no job and no span.
    cli(&["schedules", "trigger", "hourly"]).await;
    // A backfilled run whose job died, run again: a new job, a new span.
    sqlx::query(
        "UPDATE almanac.jobs SET status = 'dead', finished_at = now()
         WHERE id = (SELECT min(id) FROM almanac.jobs)",
    )
    .execute(&pool)
    .await
    .unwrap();
    cli(&[
        "backfill",
        "hourly",
        "--from",
        &from,
        "--to",
        &to,
        "--reprocess",
        "failed",
    ])
    .await;
    // Exported before each command exited: no waiting here.
    let runs = receiver.named("almanac.schedule.run");
    let jobs: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT logical_run, traceparent FROM almanac.jobs ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(
        jobs.len() >= 5,
        "three or more backfilled, one triggered, one run again: {jobs:?}"
    );
    assert_eq!(runs.len(), jobs.len(), "{runs:?}");
    let mut sources = Vec::new();
    for (run, traceparent) in &jobs {
        let span = runs
            .iter()
            .find(|s| {
                traceparent.as_deref()
                    == Some(format!("00-{}-{}-01", s.trace_id, s.span_id).as_str())
            })
            .unwrap_or_else(|| {
                panic!("no span for the job of run {run} ({traceparent:?}): {runs:?}")
            });
        assert_eq!(span.text("almanac.schedule"), Some("hourly"));
        assert_eq!(span.text("almanac.logical_run"), Some(run.as_str()));
        assert_eq!(span.text("almanac.schedule.outcome"), Some("emitted"));
        assert_eq!(span.parent, None, "a logical run starts its trace");
        sources.push(
            span.text("almanac.schedule.source")
                .unwrap_or("")
                .to_string(),
        );
    }
    sources.sort();
    sources.dedup();
    assert_eq!(sources, ["backfill", "reprocess", "trigger"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `almanac work` with `OTEL_EXPORTER_OTLP_ENDPOINT` (holding a password):
/// its command sees `TRACEPARENT`, the execution span joins the job's
/// enqueue trace, the spans reach the collector by SIGTERM (flushed at
/// shutdown) with the password as basic auth, and no log line shows it.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn tracing_almanac_work_exports_to_the_otel_endpoint_and_hides_its_password(pool: PgPool) {
    let (receiver, addr) = Receiver::start().await;
    let dir = std::env::temp_dir().join(unique("traceparent-cli"));
    std::fs::create_dir_all(&dir).unwrap();
    let enqueue = enqueue_context(9, 9);
    let id = queue::enqueue(
        &mut pool.acquire().await.unwrap(),
        &NewJob::new(KIND).traceparent(traceparent(&enqueue)),
    )
    .await
    .unwrap()
    .id();
    let handler = format!(
        "{KIND}=printf '%s' \"$TRACEPARENT\" > {}/$ALMANAC_JOB_ID",
        dir.display()
    );
    let child = harness::almanac()
        .args(["work", "--handler", &handler, "--poll-interval", "50ms"])
        .env("DATABASE_URL", harness::database_url(&pool))
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://collector:otlpS3cretPw@{addr}"),
        )
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    eventually("the job done", Duration::from_secs(30), || async {
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
        )
        .await
            == 1
    })
    .await;
    // SAFETY: signals the child this test spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    // Waited for off the runtime: the receiver must answer the last posts.
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let logs = format!(
        "{}{}",
        harness::text(&out.stdout),
        harness::text(&out.stderr)
    );
    assert!(
        !logs.contains("otlpS3cretPw"),
        "the password in the logs:\n{logs}"
    );
    assert!(logs.contains("exporting spans by OTLP/HTTP"), "{logs}");
    // Flushed before the process exited: no waiting here.
    let executions = receiver.named("almanac.execute");
    assert_eq!(executions.len(), 1, "{executions:?}");
    let span = &executions[0];
    assert_eq!(span.int("almanac.job.id"), Some(id));
    assert_eq!(
        (span.trace_id.as_str(), span.parent.as_deref()),
        (enqueue.0.as_str(), Some(enqueue.1.as_str()))
    );
    let seen = std::fs::read_to_string(dir.join(id.to_string())).unwrap();
    assert_eq!(seen, format!("00-{}-{}-01", span.trace_id, span.span_id));
    use base64::Engine as _;
    let auth = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("collector:otlpS3cretPw")
    );
    assert!(receiver
        .posts
        .lock()
        .unwrap()
        .iter()
        .all(|(_, a)| *a == auth));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A bad endpoint or ratio fails the start, before any database is
/// touched, saying what to do and never showing the password.
#[test]
fn tracing_a_bad_endpoint_or_ratio_is_refused_at_start() {
    for (args, expected) in [
        (
            vec!["--otlp-endpoint", "https://u:otlpS3cretPw@collector:4318"],
            "only http:// is supported",
        ),
        (
            vec![
                "--otlp-endpoint",
                "http://127.0.0.1:1",
                "--trace-sample-ratio",
                "1.5",
            ],
            "give a ratio from 0 to 1",
        ),
    ] {
        let out = harness::almanac()
            .args(["work", "--handler", "k=true"])
            .args(&args)
            .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
            .output()
            .unwrap();
        let stderr = harness::text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(expected), "{stderr}");
        assert!(!stderr.contains("otlpS3cretPw"), "{stderr}");
        assert!(
            !stderr.contains("cannot connect to database"),
            "the tracing settings are checked before the database: {stderr}"
        );
    }
}

/// OpenTelemetry variables set for other SDKs on the host (an empty
/// endpoint, another sampler's argument) never stop a start with tracing
/// off; `--help` never prints the endpoint's secret; a token alone as the
/// URL's user part is hidden too.
#[test]
fn tracing_settings_meant_for_others_never_stop_a_start_nor_leak() {
    let out = harness::almanac()
        .args(["work", "--help"])
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://u:otlpS3cretPw@collector:4318",
        )
        .output()
        .unwrap();
    let help = harness::text(&out.stdout);
    assert!(help.contains("--otlp-endpoint"), "{help}");
    assert!(!help.contains("otlpS3cretPw"), "{help}");

    let out = harness::almanac()
        .args(["work", "--handler", "k=true"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        .env(
            "OTEL_TRACES_SAMPLER_ARG",
            "endpoint=http://jaeger:14250,pollingIntervalMs=5000",
        )
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .unwrap();
    let stderr = harness::text(&out.stderr);
    assert!(
        stderr.contains("cannot connect to database"),
        "the start went past the tracing settings to the database: {stderr}"
    );

    let out = harness::almanac()
        .args([
            "work",
            "--handler",
            "k=true",
            "--otlp-endpoint",
            "https://t0kenS3cret@collector",
        ])
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .unwrap();
    let stderr = harness::text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("only http:// is supported"), "{stderr}");
    assert!(!stderr.contains("t0kenS3cret"), "{stderr}");
}
