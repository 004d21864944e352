//! `almanac route`, `almanac run` (relay) and `almanac consume` as a person
//! runs them, against RabbitMQ.

use std::process::{Child, Output, Stdio};
use std::time::Duration;

use sqlx::PgPool;

use crate::harness::brokers::{amqp_url, unique};
use crate::harness::{self, count, eventually};

fn almanac(url: &str, args: &[&str]) -> Output {
    harness::almanac()
        .args(args)
        .env("DATABASE_URL", url)
        .output()
        .unwrap()
}

/// `almanac route set KIND --mode broker` to RabbitMQ queue `queue`.
fn route_to_queue(url: &str, kind: &str, queue: &str, amqp: &str) -> Output {
    almanac(
        url,
        &[
            "route",
            "set",
            kind,
            "--mode",
            "broker",
            "--sink",
            "rabbitmq",
            "--destination",
            queue,
            "--amqp-url",
            amqp,
        ],
    )
}

fn spawn(url: &str, args: &[&str]) -> Child {
    harness::almanac()
        .args(args)
        .env("DATABASE_URL", url)
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_string()
}

fn stop(mut child: Child) -> Option<i32> {
    // SAFETY: signals a child process this test spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    child.wait().unwrap().code()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn route_set_refuses_what_it_cannot_do_and_names_no_password(pool: PgPool) {
    let url = harness::database_url(&pool);
    let out = almanac(&url, &["route", "set", "mail", "--mode", "broker"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stderr), "error: mode broker needs a sink and a destination: add --sink kafka|rabbitmq --destination NAME");

    let out = almanac(
        &url,
        &[
            "route",
            "set",
            "mail",
            "--mode",
            "broker",
            "--sink",
            "rabbitmq",
            "--destination",
            "mail",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr)
            .contains("rabbitmq is not configured: pass --amqp-url (or ALMANAC_AMQP_URL)"),
        "{}",
        text(&out.stderr)
    );

    let dead = "amqp://guest:pa55word@127.0.0.1:1/%2f";
    let out = route_to_queue(&url, "mail", "mail", dead);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("cannot reach RabbitMQ at amqp://guest:***@127.0.0.1:1/%2f"),
        "{err}"
    );
    assert!(err.contains("the route was not changed"), "{err}");
    assert!(!err.contains("pa55word"), "{err}");
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.routes").await, 0);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn enqueue_relay_consume_end_to_end_with_exec_handlers(pool: PgPool) {
    let url = harness::database_url(&pool);
    let amqp = amqp_url();
    let queue = unique("cli");
    let dir = std::env::temp_dir().join(format!("almanac-cli-broker-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let seen = dir.join("seen");

    let out = route_to_queue(&url, "mail", &queue, &amqp);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!("mail: broker via rabbitmq `{queue}`; 0 ready jobs moved to it")
    );
    let shown = almanac(&url, &["route", "show", "--json"]);
    let route: serde_json::Value = serde_json::from_str(&text(&shown.stdout)).unwrap();
    assert_eq!(
        (
            route["kind"].as_str(),
            route["mode"].as_str(),
            route["sink"].as_str()
        ),
        (Some("mail"), Some("broker"), Some("rabbitmq"))
    );

    for i in 0..3 {
        let out = almanac(
            &url,
            &[
                "enqueue",
                "mail",
                "--payload",
                &format!(r#"{{"to":"user{i}@example.com"}}"#),
            ],
        );
        assert!(out.status.success());
    }
    // A worker polling PostgreSQL does not take a broker kind.
    let worker = spawn(
        &url,
        &[
            "work",
            "--handler",
            &format!("mail=echo worker >> {}", seen.display()),
        ],
    );
    let relay = spawn(&url, &["run", "--roles", "relay", "--amqp-url", &amqp]);
    let handler = format!(
        "mail=jq -r .to >> {0} 2>/dev/null || cat >> {0}; echo \" $ALMANAC_ATTEMPT\" >> {0}",
        seen.display()
    );
    let consumer = spawn(
        &url,
        &[
            "consume",
            "--sink",
            "rabbitmq",
            "--destination",
            &queue,
            "--amqp-url",
            &amqp,
            "--handler",
            &handler,
        ],
    );
    eventually(
        "three jobs done by the consumer",
        Duration::from_secs(60),
        || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.jobs WHERE status = 'done'",
            )
            .await
                == 3
        },
    )
    .await;
    assert_eq!(stop(consumer), Some(0));
    assert_eq!(stop(relay), Some(0));
    assert_eq!(stop(worker), Some(0));
    let seen = std::fs::read_to_string(&seen).unwrap();
    assert!(
        !seen.contains("worker"),
        "a worker ran a broker job:\n{seen}"
    );
    for i in 0..3 {
        assert!(seen.contains(&format!("user{i}@example.com")), "{seen}");
    }
    assert_eq!(
        count(
            &pool,
            "SELECT coalesce(sum(cardinality(job_ids)), 0)::bigint FROM almanac.outbox_batches WHERE published_at IS NOT NULL"
        )
        .await,
        3
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn route_set_gives_up_after_its_lock_timeout_naming_the_blocker(pool: PgPool) {
    use sqlx::Connection;
    let url = harness::database_url(&pool);
    almanac::relay::routes::set(
        &mut pool.acquire().await.unwrap(),
        "mail",
        almanac::relay::routes::RouteMode::Broker,
        Some(almanac::relay::SinkKind::Rabbitmq),
        Some("mail"),
    )
    .await
    .unwrap();
    // An application enqueued the kind in a transaction it keeps open.
    let mut app = harness::another_pool(&pool, 1)
        .await
        .acquire()
        .await
        .unwrap()
        .detach();
    sqlx::query("SET application_name = 'billing-app'")
        .execute(&mut app)
        .await
        .unwrap();
    let app_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut app)
        .await
        .unwrap();
    let mut tx = app.begin().await.unwrap();
    almanac::queue::enqueue(&mut tx, &almanac::queue::NewJob::new("mail"))
        .await
        .unwrap();

    let started = std::time::Instant::now();
    let out = tokio::task::spawn_blocking(move || {
        almanac(
            &url,
            &[
                "route",
                "set",
                "mail",
                "--mode",
                "db",
                "--lock-timeout",
                "1s",
            ],
        )
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("route set for kind `mail` gave up after 1s"),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "pid {app_pid} (application `billing-app`, idle in transaction"
        )),
        "{err}"
    );
    assert!(err.contains("nothing was changed"), "{err}");
    assert!(err.contains("--lock-timeout"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "it gave up instead of waiting"
    );
    tx.rollback().await.unwrap();
    // Nothing changed.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.routes WHERE kind = 'mail' AND mode = 'broker'"
        )
        .await,
        1
    );
    // Once the transaction is gone the change goes through.
    let url = harness::database_url(&pool);
    let out = almanac(
        &url,
        &[
            "route",
            "set",
            "mail",
            "--mode",
            "db",
            "--lock-timeout",
            "1s",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// A consumer started for a destination whose routed kinds it cannot all
/// run says which, at start (and runs the ones it can).
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn consume_names_the_routed_kinds_it_has_no_handler_for(pool: PgPool) {
    let url = harness::database_url(&pool);
    let amqp = amqp_url();
    let queue = unique("partial");
    for kind in ["mail", "sms", "push"] {
        let out = route_to_queue(&url, kind, &queue, &amqp);
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    let (consumer, log) = consume_logged(&url, &amqp, &queue, "mail=true");
    let line = logged(&log, "have no handler in this consumer").await;
    assert!(line.contains("push") && line.contains("sms"), "{line}");
    assert!(!line.contains("kinds=[\"mail\""), "{line}");
    // No other consumer runs: none handles push or sms.
    let line = logged(
        &log,
        "no running consumer of this destination has a handler",
    )
    .await;
    assert!(line.contains("kinds=[\"push\", \"sms\"]"), "{line}");

    // A second consumer, with sms only: mail has a consumer, push none.
    let (second, log) = consume_logged(&url, &amqp, &queue, "sms=true");
    let line = logged(
        &log,
        "no running consumer of this destination has a handler",
    )
    .await;
    assert!(line.contains("kinds=[\"push\"]"), "{line}");

    // `route set` says so at once.
    let out = route_to_queue(&url, "push", &queue, &amqp);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let unrun = format!(
        "kind push is routed (broker) to rabbitmq `{queue}`, but none of the 2 consumers running there \
         has a handler for it (they handle mail, sms). Start `almanac consume --sink rabbitmq \
         --destination {queue}` with a handler for push, or route the kind elsewhere (almanac route set)"
    );
    assert_eq!(text(&out.stderr), format!("warning: {unrun}"));

    // So do `almanac stats` and the dashboard's routes page.
    let stats = text(&almanac(&url, &["stats"]).stdout);
    let lines: Vec<&str> = stats
        .lines()
        .filter(|l| l.starts_with("consumers "))
        .collect();
    assert_eq!(lines.len(), 1, "{stats}");
    assert_eq!(
        lines[0]
            .strip_prefix("consumers push:")
            .map(str::trim_start),
        Some(unrun.as_str())
    );
    let addr = format!("127.0.0.1:{}", harness::free_port());
    let ui = spawn(
        &url,
        &["run", "--roles", "reaper,metrics", "--http-addr", &addr],
    );
    let page = eventually_page(&addr, "/routes").await;
    assert!(
        page.contains("<p class=\"warn unconsumed\" data-kind=\"push\">")
            && page.contains("none of the 2 consumers running there"),
        "{page}"
    );
    assert!(!page.contains("unconsumed\" data-kind=\"mail"), "{page}");
    eventually(
        "the unconsumed route on /metrics",
        Duration::from_secs(30),
        || async {
            let body = harness::http::get(&addr, "/metrics")
                .await
                .map(|r| r.body)
                .unwrap_or_default();
            let push = harness::http::sample(
                &body,
                "almanac_route_unconsumed",
                &[("kind", "push"), ("sink", "rabbitmq")],
            );
            let mail = harness::http::sample(
                &body,
                "almanac_route_unconsumed",
                &[("kind", "mail"), ("sink", "rabbitmq")],
            );
            (push, mail) == (Some(1.0), None)
        },
    )
    .await;
    assert_eq!(stop(ui), Some(0));
    assert_eq!(stop(second), Some(0));
    assert_eq!(stop(consumer), Some(0));
}

/// `almanac consume` of `queue` with one `--handler`, its log gathered.
fn consume_logged(
    url: &str,
    amqp: &str,
    queue: &str,
    handler: &str,
) -> (Child, std::sync::Arc<std::sync::Mutex<String>>) {
    use std::io::{BufRead, BufReader};
    let mut consumer = harness::almanac()
        .args([
            "consume",
            "--sink",
            "rabbitmq",
            "--destination",
            queue,
            "--amqp-url",
            amqp,
            "--handler",
            handler,
        ])
        .env("DATABASE_URL", url)
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let lines = log.clone();
    let stderr = consumer.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let mut log = lines.lock().unwrap();
            log.push_str(&line);
            log.push('\n');
        }
    });
    (consumer, log)
}

/// The first line of `log` containing `what`, waited for.
async fn logged(log: &std::sync::Mutex<String>, what: &str) -> String {
    eventually(what, Duration::from_secs(30), || async {
        let log = log.lock().unwrap().clone();
        if log.contains(what) {
            Ok(())
        } else {
            Err(log)
        }
    })
    .await;
    let log = log.lock().unwrap().clone();
    log.lines().find(|l| l.contains(what)).unwrap().to_string()
}

/// `path`'s body once the server at `addr` is ready.
async fn eventually_page(addr: &str, path: &str) -> String {
    eventually(
        "almanac run to serve /readyz",
        Duration::from_secs(60),
        || async { matches!(harness::http::get(addr, "/readyz").await, Ok(r) if r.status == 200) },
    )
    .await;
    let page = harness::http::get(addr, path).await.unwrap();
    assert_eq!(page.status, 200);
    page.body
}
