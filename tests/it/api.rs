//! The JSON API (`/api/v1`) and the dashboard's levers over real HTTP
//! against a real server and database: every endpoint's shape and errors,
//! actions refused without `--ui-actions`, cross-site browser posts refused
//! while scripts pass, basic auth naming the actor, one audit row per
//! action from the API, the dashboard and the CLI, and `almanac audit`
//! printing them.

use std::process::Stdio;

use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::harness::{self, count};

/// `ops:s3cret`, base64.
const OPS: &str = "Basic b3BzOnMzY3JldA==";

/// The HTTP server `almanac run` serves, in this process: the dashboard and
/// the API mounted as `run` mounts them (other areas' tests use it too).
pub(crate) struct Server {
    addr: String,
    stop: CancellationToken,
    serving: tokio::task::JoinHandle<Result<(), almanac::http::HttpError>>,
}

impl Server {
    pub(crate) async fn start(pool: &PgPool, actions: bool, auth: bool) -> Server {
        let auth: Option<almanac::http::BasicAuth> = auth.then(|| "ops:s3cret".parse().unwrap());
        let server = almanac::http::HttpServer::bind(
            "127.0.0.1:0".parse().unwrap(),
            auth,
            &pool.connect_options(),
        )
        .await
        .unwrap();
        let config = almanac::ui::UiConfig {
            actions,
            any_host: server.has_auth(),
        };
        let server = server.mount(almanac::ui::router(pool, config));
        let addr = server.local_addr().to_string();
        let stop = CancellationToken::new();
        let serving = tokio::spawn(server.run(stop.clone()));
        Server {
            addr,
            stop,
            serving,
        }
    }

    pub(crate) async fn stop(self) {
        self.stop.cancel();
        self.serving.await.unwrap().unwrap();
    }

    /// Sends one request; the status, the head and the body.
    async fn send(&self, method: &str, path: &str, headers: &[&str], body: &str) -> Reply {
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\n", self.addr);
        for h in headers {
            head.push_str(h);
            head.push_str("\r\n");
        }
        let request = format!(
            "{head}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let mut stream = tokio::net::TcpStream::connect(&self.addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        let text = String::from_utf8_lossy(&raw).to_string();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        Reply {
            status: head.split_whitespace().nth(1).unwrap().parse().unwrap(),
            head: head.to_string(),
            body: body.to_string(),
        }
    }

    pub(crate) async fn get(&self, path: &str) -> Reply {
        self.send("GET", path, &[], "").await
    }

    /// A script's POST: JSON, no Origin, no Sec-Fetch-Site.
    async fn post(&self, path: &str, body: &str) -> Reply {
        self.send("POST", path, &["Content-Type: application/json"], body)
            .await
    }

    /// A dashboard form's POST.
    async fn form(&self, path: &str, form: &str, extra: &[&str]) -> Reply {
        let mut headers = vec!["Content-Type: application/x-www-form-urlencoded"];
        headers.extend_from_slice(extra);
        self.send("POST", path, &headers, form).await
    }
}

#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    head: String,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn json(&self) -> Value {
        assert!(
            self.head
                .to_ascii_lowercase()
                .contains("content-type: application/json"),
            "not JSON: {}\n\n{}",
            self.head,
            self.body
        );
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The `error` of a JSON error reply with `status`.
    fn error(&self, status: u16) -> String {
        assert_eq!(self.status, status, "{}", self.body);
        self.json()["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error field: {}", self.body))
            .to_string()
    }
}

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(sql).execute(pool).await.unwrap();
}

async fn id_of(pool: &PgPool, sql: &str) -> i64 {
    count(pool, sql).await
}

/// (actor, source, action, target, count, note) of every audit row, oldest first.
async fn audit_rows(pool: &PgPool) -> Vec<(String, String, String, String, i64, Option<String>)> {
    sqlx::query_as(
        "SELECT actor, source, action, target, count, note FROM almanac.audit_log ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Jobs of each status and two kinds, a route, a paused kind, a synced
/// schedule.
async fn seed(pool: &PgPool) {
    exec(
        pool,
        r#"
        INSERT INTO almanac.routes (kind, mode, sink, destination) VALUES ('mail', 'dual', 'kafka', 'mail-out');
        INSERT INTO almanac.jobs (kind, payload) SELECT 'mail', jsonb_build_object('n', g) FROM generate_series(1, 3) g;
        INSERT INTO almanac.jobs (kind, status, attempts, lease_token, lease_until)
          VALUES ('report', 'running', 1, gen_random_uuid(), now() + interval '1 hour');
        INSERT INTO almanac.jobs (kind, status, attempts, max_attempts, finished_at, last_error)
          SELECT 'mail', 'dead', 3, 3, now(), E'smtp 550\nat relay' FROM generate_series(1, 2);
        INSERT INTO almanac.jobs (kind, status, attempts, max_attempts, finished_at, last_error)
          VALUES ('report', 'dead', 1, 1, now(), 'exit status 3');
        INSERT INTO almanac.jobs (kind, status, attempts, finished_at)
          VALUES ('report', 'done', 1, now());
        INSERT INTO almanac.kind_pauses (kind, paused_by, note) VALUES ('report', 'alice (cli)', 'quarter close');
        "#,
    )
    .await;
    let schedules = almanac::scheduler::spec::load_sources(&[(
        "s.toml".into(),
        "[every5]\ncron = \"*/5 * * * *\"\n".to_string(),
    )])
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    almanac::scheduler::ledger::sync(&mut conn, &schedules, false)
        .await
        .unwrap();
}

/// Every read endpoint answers the shape README.md documents, from the
/// database's own rows; bad input and unknown ids get JSON errors.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn every_read_endpoint_answers_its_documented_shape(pool: PgPool) {
    seed(&pool).await;
    let s = Server::start(&pool, false, false).await;

    // Jobs: newest first, keyset pages, filters.
    let all = s.get("/api/v1/jobs").await.json();
    let ids: Vec<i64> = all["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids.len(), 8, "{all}");
    assert!(ids.windows(2).all(|w| w[0] > w[1]), "{ids:?}");
    assert!(all["jobs"][0].get("lease_token").is_none(), "never shown");
    let first = s.get("/api/v1/jobs?limit=2").await.json();
    assert_eq!(first["jobs"].as_array().unwrap().len(), 2);
    let next = first["next_before"].as_i64().unwrap();
    assert_eq!(next, ids[1]);
    let second = s
        .get(&format!("/api/v1/jobs?limit=2&before={next}"))
        .await
        .json();
    assert_eq!(second["jobs"][0]["id"].as_i64(), Some(ids[2]));
    let dead = s.get("/api/v1/jobs?kind=mail&status=dead").await.json();
    assert_eq!(dead["jobs"].as_array().unwrap().len(), 2);
    assert!(dead["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|j| j["kind"] == "mail" && j["status"] == "dead"));
    for (path, says) in [
        ("/api/v1/jobs?status=lost", "lost"),
        (
            "/api/v1/jobs?limit=0",
            "limit=0 is out of range; use 1 to 500",
        ),
        ("/api/v1/jobs?limit=ten", "limit=`ten` is not a number"),
        ("/api/v1/jobs?before=x", "before=`x` is not a job id"),
        ("/api/v1/jobs/abc", "`abc` is not a job id"),
        ("/api/v1/audit?limit=0", "limit=0 is out of range"),
    ] {
        let error = s.get(path).await.error(400);
        assert!(error.contains(says), "{path}: {error}");
    }

    // One job; an unknown one.
    let job = s.get(&format!("/api/v1/jobs/{}", ids[0])).await.json();
    assert_eq!(job["id"].as_i64(), Some(ids[0]));
    assert_eq!(job["kind"], "report");
    assert_eq!(job["status"], "done");
    assert_eq!(
        s.get("/api/v1/jobs/999999").await.error(404),
        "no job with id 999999"
    );

    // Dead groups.
    let dead = s.get("/api/v1/dead").await.json();
    assert_eq!(dead["total"], 3);
    assert_eq!(dead["truncated"], false);
    let groups: Vec<(String, String, i64)> = dead["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["kind"].as_str().unwrap().into(),
                g["error"].as_str().unwrap().into(),
                g["count"].as_i64().unwrap(),
            )
        })
        .collect();
    assert!(
        groups.contains(&("mail".into(), "smtp 550".into(), 2)),
        "{groups:?}"
    );
    assert!(
        groups.contains(&("report".into(), "exit status 3".into(), 1)),
        "{groups:?}"
    );

    // Schedules, routes, stats, paused kinds, audit.
    let schedules = s.get("/api/v1/schedules").await.json();
    let every5 = &schedules["schedules"][0];
    assert_eq!(every5["name"], "every5");
    assert_eq!(every5["cron"], "*/5 * * * *");
    assert_eq!(every5["timezone"], "UTC");
    assert_eq!(every5["enabled"], true);
    assert!(every5["next_fire"].is_string(), "{every5}");
    assert!(every5["paused"].is_null(), "{every5}");
    let routes = s.get("/api/v1/routes").await.json();
    assert_eq!(routes["routes"][0]["kind"], "mail");
    assert_eq!(routes["routes"][0]["mode"], "dual");
    assert_eq!(routes["routes"][0]["sink"], "kafka");
    assert_eq!(routes["routes"][0]["destination"], "mail-out");
    let stats = s.get("/api/v1/stats").await.json();
    assert_eq!(stats["jobs"]["dead"], 3, "{stats}");
    assert_eq!(stats["paused"][0]["kind"], "report", "{stats}");
    let paused = s.get("/api/v1/kinds/paused").await.json();
    assert_eq!(
        paused["paused"][0],
        json!({
            "kind": "report",
            "paused_at": paused["paused"][0]["paused_at"],
            "paused_by": "alice (cli)",
            "note": "quarter close",
        })
    );
    let audit = s.get("/api/v1/audit").await.json();
    assert_eq!(audit, json!({"entries": [], "next_before": null}));

    // A path that is no endpoint.
    let error = s.get("/api/v1/nothing").await.error(404);
    assert!(error.contains("no such endpoint"), "{error}");
    let error = s.get("/api/v1/kinds/mail/pause").await.error(405);
    assert!(error.contains("actions are POST"), "{error}");
    s.stop().await;
}

/// Every action refuses with 403 and a JSON error saying how to turn
/// actions on; nothing changes, nothing is logged.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn api_actions_are_refused_without_ui_actions(pool: PgPool) {
    seed(&pool).await;
    let s = Server::start(&pool, false, false).await;
    let dead = id_of(
        &pool,
        "SELECT min(id) FROM almanac.jobs WHERE status = 'dead'",
    )
    .await;
    let ready = id_of(
        &pool,
        "SELECT min(id) FROM almanac.jobs WHERE status = 'ready'",
    )
    .await;
    let before: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, status::text FROM almanac.jobs ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    for path in [
        format!("/api/v1/jobs/{dead}/retry"),
        format!("/api/v1/jobs/{ready}/cancel"),
        "/api/v1/dead/retry".into(),
        "/api/v1/kinds/mail/pause".into(),
        "/api/v1/kinds/report/resume".into(),
        "/api/v1/schedules/every5/pause".into(),
        "/api/v1/schedules/every5/resume".into(),
        "/api/v1/schedules/every5/trigger".into(),
    ] {
        let error = s.post(&path, "{}").await.error(403);
        assert!(
            error.starts_with("Actions are off") && error.contains("--ui-actions"),
            "{path}: {error}"
        );
    }
    let after: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, status::text FROM almanac.jobs ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(before, after);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.kind_pauses").await,
        1
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.schedule_pauses").await,
        0
    );
    assert!(audit_rows(&pool).await.is_empty());
    s.stop().await;
}

/// Each action does what it says, answers its documented JSON, refuses
/// what does not apply (404 unknown, 409 wrong state, 400 bad body, 415 not
/// JSON), and writes exactly one audit row per action that acted or found
/// its target done already, as `anonymous` from `api`.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn api_actions_act_answer_and_log_once_each(pool: PgPool) {
    seed(&pool).await;
    let s = Server::start(&pool, true, false).await;
    let dead = id_of(
        &pool,
        "SELECT min(id) FROM almanac.jobs WHERE status = 'dead' AND kind = 'mail'",
    )
    .await;
    let ready = id_of(
        &pool,
        "SELECT min(id) FROM almanac.jobs WHERE status = 'ready'",
    )
    .await;
    let running = id_of(
        &pool,
        "SELECT min(id) FROM almanac.jobs WHERE status = 'running'",
    )
    .await;
    let done = id_of(
        &pool,
        "SELECT min(id) FROM almanac.jobs WHERE status = 'done'",
    )
    .await;

    // Retry: a dead job; again (it is ready now): 409; unknown: 404.
    let reply = s
        .post(&format!("/api/v1/jobs/{dead}/retry"), "")
        .await
        .json();
    assert_eq!(reply["outcome"], "retried");
    assert_eq!(reply["job"]["status"], "ready");
    assert_eq!(reply["job"]["attempts"], 0);
    let error = s
        .post(&format!("/api/v1/jobs/{dead}/retry"), "")
        .await
        .error(409);
    assert!(error.contains(&format!("job {dead} is ready")), "{error}");
    assert_eq!(
        s.post("/api/v1/jobs/999999/retry", "").await.error(404),
        "no job with id 999999"
    );

    // Cancel: a ready job with a reason; a running one (stop requested); a
    // done one: 409, nothing changed.
    let reply = s
        .post(
            &format!("/api/v1/jobs/{ready}/cancel"),
            r#"{"reason": "duplicate send"}"#,
        )
        .await
        .json();
    assert_eq!(reply["outcome"], "cancelled");
    assert_eq!(reply["job"]["status"], "cancelled");
    assert_eq!(reply["job"]["cancel_reason"], "duplicate send");
    assert_eq!(reply["job"]["cancelled_by"], "anonymous (api)");
    let reply = s
        .post(&format!("/api/v1/jobs/{running}/cancel"), "")
        .await
        .json();
    assert_eq!(reply["outcome"], "stop_requested");
    assert_eq!(reply["job"]["status"], "running");
    assert!(reply["job"]["cancel_requested_at"].is_string(), "{reply}");
    let error = s
        .post(&format!("/api/v1/jobs/{done}/cancel"), "{}")
        .await
        .error(409);
    assert_eq!(
        error,
        format!("job {done} had already finished (done): nothing changed")
    );
    assert_eq!(
        s.post("/api/v1/jobs/999999/cancel", "").await.error(404),
        "no job with id 999999"
    );

    // Bad bodies and content types change nothing.
    let error = s
        .post(&format!("/api/v1/jobs/{done}/cancel"), r#"{"reasn": 1}"#)
        .await
        .error(400);
    assert!(
        error.contains("not the JSON this action takes") && error.contains("reasn"),
        "{error}"
    );
    let error = s.post("/api/v1/kinds/mail/pause", "{").await.error(400);
    assert!(error.contains("not the JSON"), "{error}");
    let error = s
        .send("POST", "/api/v1/kinds/mail/pause", &[], "")
        .await
        .error(415);
    assert!(error.contains("Content-Type: application/json"), "{error}");

    // Pause a kind with a note; again: already; resume; again: 409.
    let reply = s
        .post("/api/v1/kinds/mail/pause", r#"{"note": "smtp outage"}"#)
        .await
        .json();
    assert_eq!(reply["outcome"], "paused");
    assert_eq!(reply["pause"]["kind"], "mail");
    assert_eq!(reply["pause"]["paused_by"], "anonymous (api)");
    assert_eq!(reply["pause"]["note"], "smtp outage");
    let reply = s.post("/api/v1/kinds/mail/pause", "").await.json();
    assert_eq!(reply["outcome"], "already_paused");
    assert_eq!(reply["pause"]["note"], "smtp outage");
    let reply = s.post("/api/v1/kinds/mail/resume", "").await.json();
    assert_eq!(reply["outcome"], "resumed");
    assert_eq!(reply["pause"]["note"], "smtp outage");
    assert_eq!(
        s.post("/api/v1/kinds/mail/resume", "").await.error(409),
        "kind mail is not paused; paused kinds: report"
    );
    let error = s.post("/api/v1/kinds/%20/pause", "").await.error(400);
    assert!(error.contains("a kind name is required"), "{error}");

    // A dead-letter group; every dead job only when asked for by name.
    let error = s.post("/api/v1/dead/retry", "{}").await.error(400);
    assert_eq!(
        error,
        "name a dead-letter group (\"kind\", \"error\"), or send \"all\": true to retry every dead job"
    );
    let reply = s
        .post(
            "/api/v1/dead/retry",
            r#"{"kind": "report", "error": "exit status 3"}"#,
        )
        .await
        .json();
    assert_eq!(reply, json!({"outcome": "retried", "retried": 1}));

    // Schedules: trigger, again (it exists), pause, resume, unknown.
    let reply = s.post("/api/v1/schedules/every5/trigger", "").await.json();
    assert_eq!(reply["outcome"], "emitted", "{reply}");
    let job_id = reply["job_id"].as_i64().unwrap();
    let run = reply["logical_run"].as_str().unwrap().to_string();
    let reply = s
        .post(
            "/api/v1/schedules/every5/trigger",
            &json!({"logical_run": run}).to_string(),
        )
        .await
        .json();
    assert_eq!(reply["outcome"], "existed");
    assert_eq!(reply["job_id"].as_i64(), Some(job_id));
    let error = s
        .post(
            "/api/v1/schedules/every5/trigger",
            r#"{"logical_run": "2026-03-08"}"#,
        )
        .await
        .error(400);
    assert!(
        error.contains("`2026-03-08` is not a logical run of `every5`"),
        "{error}"
    );
    let reply = s
        .post("/api/v1/schedules/every5/pause", r#"{"note": "migration"}"#)
        .await
        .json();
    assert_eq!(reply["outcome"], "paused");
    assert_eq!(reply["pause"]["by"], "anonymous (api)");
    let listed = s.get("/api/v1/schedules").await.json();
    assert_eq!(listed["schedules"][0]["paused"]["note"], "migration");
    let reply = s.post("/api/v1/schedules/every5/resume", "").await.json();
    assert_eq!(reply["outcome"], "resumed");
    let error = s
        .post("/api/v1/schedules/every5/resume", "")
        .await
        .error(409);
    assert_eq!(error, "schedule every5 is not paused; nothing changed");
    let error = s
        .post("/api/v1/schedules/nosuch/trigger", "")
        .await
        .error(404);
    assert!(error.contains("No schedule named `nosuch`"), "{error}");

    // What happened, as the database holds it...
    let status = |id: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT status::text FROM almanac.jobs WHERE id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(status(dead).await, "ready");
    assert_eq!(status(ready).await, "cancelled");
    assert_eq!(status(running).await, "running");
    assert_eq!(status(done).await, "done");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.kind_pauses WHERE kind = 'mail'"
        )
        .await,
        0
    );

    // ... and as the audit log does: one row each, none for a refusal.
    let row = |action: &str, target: String, count: i64, note: Option<&str>| {
        (
            "anonymous".to_string(),
            "api".to_string(),
            action.to_string(),
            target,
            count,
            note.map(String::from),
        )
    };
    let trigger_note = format!("logical run {run} as job {job_id}");
    let existed_note =
        format!("logical run {run} already existed (recorded by trigger); nothing emitted");
    assert_eq!(
        audit_rows(&pool).await,
        vec![
            row("retry", format!("job {dead}"), 1, None),
            row("cancel", format!("job {ready}"), 1, Some("duplicate send")),
            row(
                "cancel",
                format!("job {running}"),
                1,
                Some("running: stop requested")
            ),
            row(
                "cancel",
                format!("job {done}"),
                0,
                Some("already done: nothing changed")
            ),
            row("pause", "kind mail".into(), 1, Some("smtp outage")),
            row("pause", "kind mail".into(), 0, None),
            row("resume", "kind mail".into(), 1, None),
            row(
                "bulk retry",
                r#"dead jobs of kind report with error "exit status 3""#.into(),
                1,
                Some("1 selected")
            ),
            row("trigger", "schedule every5".into(), 1, Some(&trigger_note)),
            row("trigger", "schedule every5".into(), 0, Some(&existed_note)),
            row("pause", "schedule every5".into(), 1, Some("migration")),
            row("resume", "schedule every5".into(), 1, None),
        ]
    );
    let listed = s.get("/api/v1/audit?limit=2").await.json();
    let entries = listed["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[0]["action"], "resume");
    assert_eq!(entries[0]["target"], "schedule every5");
    assert_eq!(entries[0]["actor"], "anonymous");
    assert_eq!(entries[0]["source"], "api");
    assert_eq!(entries[1]["action"], "pause");
    let older = s
        .get(&format!("/api/v1/audit?before={}", listed["next_before"]))
        .await
        .json();
    assert_eq!(older["entries"].as_array().unwrap().len(), 10);
    s.stop().await;
}

/// A browser POST from another site is refused, whatever it sends; a
/// script's POST (no Origin, no Sec-Fetch-Site) and the dashboard's own
/// origin pass; a form's content type never reaches an API action.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn cross_site_browser_posts_to_the_api_are_refused(pool: PgPool) {
    seed(&pool).await;
    let s = Server::start(&pool, true, false).await;
    let own = format!("Origin: http://{}", s.addr);
    for headers in [
        vec![
            "Origin: http://evil.example",
            "Content-Type: application/json",
        ],
        vec![
            "Sec-Fetch-Site: cross-site",
            "Content-Type: application/json",
        ],
        vec!["Origin: null", "Content-Type: application/json"],
    ] {
        let error = s
            .send("POST", "/api/v1/kinds/mail/pause", &headers, "{}")
            .await
            .error(403);
        assert!(
            error.contains("sent from another site"),
            "{headers:?}: {error}"
        );
    }
    // What a cross-site HTML form could send without a preflight.
    for content_type in [
        "Content-Type: application/x-www-form-urlencoded",
        "Content-Type: text/plain",
        "Content-Type: multipart/form-data; boundary=x",
    ] {
        let error = s
            .send("POST", "/api/v1/kinds/mail/pause", &[content_type], "")
            .await
            .error(415);
        assert!(error.contains("application/json"), "{error}");
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.kind_pauses WHERE kind = 'mail'"
        )
        .await,
        0
    );
    assert!(audit_rows(&pool).await.is_empty());
    // Its own origin, and a script, pass.
    let reply = s
        .send(
            "POST",
            "/api/v1/kinds/mail/pause",
            &[
                &own,
                "Sec-Fetch-Site: same-origin",
                "Content-Type: application/json",
            ],
            "",
        )
        .await;
    assert_eq!(reply.json()["outcome"], "paused");
    assert_eq!(
        s.post("/api/v1/kinds/mail/resume", "").await.json()["outcome"],
        "resumed"
    );
    // A foreign Host (DNS rebinding) gets JSON too.
    let port = s.addr.rsplit_once(':').unwrap().1;
    let mut stream = tokio::net::TcpStream::connect(&s.addr).await.unwrap();
    stream
        .write_all(
            format!("GET /api/v1/stats HTTP/1.1\r\nHost: evil.example:{port}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.unwrap();
    assert!(raw.starts_with("HTTP/1.1 421"), "{raw}");
    assert!(
        raw.contains(r#"{"error":"this dashboard answers only to localhost"#),
        "{raw}"
    );
    s.stop().await;
}

/// With basic auth, the API answers 401 (JSON) without credentials, and
/// the actor of an action is the basic-auth user, from the API and from a
/// dashboard form alike.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn basic_auth_guards_the_api_and_names_the_actor(pool: PgPool) {
    seed(&pool).await;
    let s = Server::start(&pool, true, true).await;
    let auth = format!("Authorization: {OPS}");
    for path in [
        "/api/v1/jobs",
        "/api/v1/stats",
        "/api/v1/audit",
        "/api/v1/kinds/paused",
    ] {
        let error = s.get(path).await.error(401);
        assert!(error.contains("authentication required"), "{path}: {error}");
        let reply = s.send("GET", path, &[&auth], "").await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
    }
    let error = s.post("/api/v1/kinds/mail/pause", "").await.error(401);
    assert!(error.contains("authentication required"), "{error}");
    let wrong = "Authorization: Basic b3BzOndyb25n";
    s.send(
        "POST",
        "/api/v1/kinds/mail/pause",
        &[wrong, "Content-Type: application/json"],
        "",
    )
    .await
    .error(401);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.kind_pauses WHERE kind = 'mail'"
        )
        .await,
        0
    );

    let reply = s
        .send(
            "POST",
            "/api/v1/kinds/mail/pause",
            &[&auth, "Content-Type: application/json"],
            r#"{"note": "by the book"}"#,
        )
        .await
        .json();
    assert_eq!(reply["pause"]["paused_by"], "ops (api)");
    // The same user from the dashboard's Resume button.
    let page = s.send("GET", "/", &[&auth], "").await.body;
    let token = page
        .split_once(r#"name="csrf" value=""#)
        .map(|(_, rest)| rest.split('"').next().unwrap().to_string())
        .unwrap_or_else(|| panic!("no action form: {page}"));
    let reply = s
        .form("/kinds/mail/resume", &format!("csrf={token}"), &[&auth])
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(
        reply.body.contains("Kind mail is resumed."),
        "{}",
        reply.body
    );
    let rows: Vec<(String, String, String)> = audit_rows(&pool)
        .await
        .into_iter()
        .map(|(actor, source, action, ..)| (actor, source, action))
        .collect();
    assert_eq!(
        rows,
        vec![
            ("ops".into(), "api".into(), "pause".into()),
            ("ops".into(), "dashboard".into(), "resume".into())
        ]
    );
    s.stop().await;
}

/// A kind paused through the API and resumed with `almanac kinds resume`:
/// both rows are in the log, with their actors, and `almanac audit` prints
/// them (and `--json` one object a line). `almanac route set` and
/// `almanac schedules pause` log as the OS user too.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_pause_from_the_api_and_a_resume_from_the_cli_are_both_in_almanac_audit(pool: PgPool) {
    seed(&pool).await;
    let s = Server::start(&pool, true, true).await;
    let auth = format!("Authorization: {OPS}");
    let reply = s
        .send(
            "POST",
            "/api/v1/kinds/mail/pause",
            &[&auth, "Content-Type: application/json"],
            r#"{"note": "smtp outage"}"#,
        )
        .await
        .json();
    assert_eq!(reply["outcome"], "paused");
    s.stop().await;

    let url = harness::database_url(&pool);
    let cli = |args: &[&str]| {
        let output = harness::almanac()
            .env("DATABASE_URL", &url)
            .env("USER", "carol")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        assert!(output.status.success(), "{args:?}: {stdout}\n{stderr}");
        stdout
    };
    assert_eq!(cli(&["kinds", "resume", "mail"]), "kind mail is resumed\n");
    cli(&["route", "set", "mail", "--mode", "db"]);
    let dir = harness::scheduler_proc::dir_with(
        "audit_cli",
        &[("s.toml", "[every5]\ncron = \"*/5 * * * *\"\n")],
    );
    let dir = dir.to_str().unwrap();
    cli(&[
        "schedules",
        "pause",
        "every5",
        "--note",
        "freeze",
        "--schedules",
        dir,
    ]);

    let rows: Vec<(String, String, String, String)> = audit_rows(&pool)
        .await
        .into_iter()
        .map(|(actor, source, action, target, ..)| (actor, source, action, target))
        .collect();
    let row = |actor: &str, source: &str, action: &str, target: &str| {
        (
            actor.to_string(),
            source.to_string(),
            action.to_string(),
            target.to_string(),
        )
    };
    assert_eq!(
        rows,
        vec![
            row("ops", "api", "pause", "kind mail"),
            row("carol", "cli", "resume", "kind mail"),
            row("carol", "cli", "route set", "kind mail"),
            row("carol", "cli", "pause", "schedule every5"),
        ]
    );

    let printed = cli(&["audit"]);
    let lines: Vec<&str> = printed.lines().collect();
    assert!(
        lines[0].starts_with("ID ") && lines[0].contains("ACTOR"),
        "{printed}"
    );
    assert_eq!(lines.len(), 5, "{printed}");
    // Newest first.
    assert!(
        lines[1].contains("carol")
            && lines[1].contains("schedule every5")
            && lines[1].contains("freeze"),
        "{printed}"
    );
    assert!(
        lines[3].contains("carol") && lines[3].contains("resume") && lines[3].contains("kind mail"),
        "{printed}"
    );
    assert!(
        lines[4].contains("ops")
            && lines[4].contains(" api ")
            && lines[4].contains("pause")
            && lines[4].contains("smtp outage"),
        "{printed}"
    );
    let json: Vec<Value> = cli(&["audit", "--limit", "2", "--json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(json.len(), 2);
    assert_eq!(json[0]["action"], "pause");
    assert_eq!(json[0]["actor"], "carol");
    assert_eq!(json[0]["source"], "cli");
    assert_eq!(json[1]["action"], "route set");
    assert_eq!(json[1]["note"], "mode db");
}

/// The dashboard's levers as its forms send them: a kind paused with a note
/// shows as paused (who, when, note) and is resumed; a ready job is
/// cancelled with a reason and shows in the `cancelled` filter; each logs
/// one row, shown at `/audit`.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_dashboard_pauses_resumes_and_cancels_and_logs_each(pool: PgPool) {
    seed(&pool).await;
    let s = Server::start(&pool, true, false).await;
    let page = s.get("/").await.body;
    assert!(
        page.contains(r#"action="/kinds/mail/pause""#)
            && page.contains(r#"action="/kinds/report/resume""#),
        "{page}"
    );
    assert!(
        page.contains("quarter close") && page.contains("alice (cli)"),
        "{page}"
    );
    let token = page
        .split_once(r#"name="csrf" value=""#)
        .map(|(_, rest)| rest.split('"').next().unwrap().to_string())
        .unwrap();

    // Refused: a wrong token.
    let reply = s.form("/kinds/mail/pause", "csrf=guess&note=x", &[]).await;
    assert_eq!(reply.status, 403);
    assert!(
        reply.body.contains("CSRF token does not match"),
        "{}",
        reply.body
    );

    let reply = s
        .form(
            "/kinds/mail/pause",
            &format!("csrf={token}&note=smtp+outage"),
            &[],
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.contains("Kind mail is paused"), "{}", reply.body);
    let page = s.get("/").await.body;
    let paused = page.split_once(r#"id="paused-kinds""#).unwrap().1;
    let paused = paused.split_once("</section>").unwrap().0;
    assert!(
        paused.contains(r#"data-kind="mail""#)
            && paused.contains("smtp outage")
            && paused.contains("anonymous (dashboard)")
            && paused.contains(r#"action="/kinds/mail/resume""#),
        "{paused}"
    );
    let reply = s
        .form("/kinds/mail/resume", &format!("csrf={token}"), &[])
        .await;
    assert!(
        reply.body.contains("Kind mail is resumed."),
        "{}",
        reply.body
    );
    let reply = s
        .form("/kinds/mail/resume", &format!("csrf={token}"), &[])
        .await;
    assert_eq!(reply.status, 409);
    assert!(
        reply.body.contains("kind mail is not paused"),
        "{}",
        reply.body
    );
    // The "Pause kind" form names the kind.
    let reply = s
        .form(
            "/kinds/pause",
            &format!("csrf={token}&kind=%2A&note=freeze"),
            &[],
        )
        .await;
    assert!(reply.body.contains("Kind * is paused"), "{}", reply.body);

    // Cancel a ready job from its page.
    let ready = id_of(
        &pool,
        "SELECT min(id) FROM almanac.jobs WHERE status = 'ready'",
    )
    .await;
    let page = s.get(&format!("/jobs/{ready}")).await.body;
    assert!(
        page.contains(&format!(r#"action="/jobs/{ready}/cancel""#)),
        "{page}"
    );
    let reply = s
        .form(
            &format!("/jobs/{ready}/cancel"),
            &format!("csrf={token}&reason=sent+twice"),
            &[],
        )
        .await;
    assert_eq!(reply.status, 303, "{}", reply.body);
    let page = s.get(&format!("/jobs/{ready}?cancelled=1")).await.body;
    assert!(
        page.contains("Cancelled.") && page.contains("sent twice"),
        "{page}"
    );
    assert!(
        !page.contains(r#"id="cancel""#),
        "no cancel button on a cancelled job"
    );
    let list = s.get("/jobs?status=cancelled").await.body;
    assert!(
        list.contains(r#"<option value="cancelled" selected>"#),
        "{list}"
    );
    assert!(list.contains(&format!(r#"data-id="{ready}""#)), "{list}");
    // A finished job: refused, says so.
    let done = id_of(
        &pool,
        "SELECT min(id) FROM almanac.jobs WHERE status = 'done'",
    )
    .await;
    let reply = s
        .form(
            &format!("/jobs/{done}/cancel"),
            &format!("csrf={token}"),
            &[],
        )
        .await;
    assert_eq!(reply.status, 409);
    assert!(
        reply
            .body
            .contains("had already finished (done): nothing changed"),
        "{}",
        reply.body
    );

    let (status, reason, by): (String, Option<String>, Option<String>) = sqlx::query_as(
        "SELECT status::text, cancel_reason, cancelled_by FROM almanac.jobs WHERE id = $1",
    )
    .bind(ready)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (status.as_str(), reason.as_deref(), by.as_deref()),
        (
            "cancelled",
            Some("sent twice"),
            Some("anonymous (dashboard)")
        )
    );
    let rows: Vec<(String, String, String, String, i64)> = audit_rows(&pool)
        .await
        .into_iter()
        .map(|(actor, source, action, target, count, _)| (actor, source, action, target, count))
        .collect();
    let row = |action: &str, target: String, count: i64| {
        (
            "anonymous".to_string(),
            "dashboard".to_string(),
            action.to_string(),
            target,
            count,
        )
    };
    assert_eq!(
        rows,
        vec![
            row("pause", "kind mail".into(), 1),
            row("resume", "kind mail".into(), 1),
            row("pause", "kind *".into(), 1),
            row("cancel", format!("job {ready}"), 1),
            row("cancel", format!("job {done}"), 0),
        ]
    );
    let audit = s.get("/audit").await.body;
    let table = audit.split_once(r#"id="audit""#).unwrap().1;
    let first = table.find(&format!("job {done}")).unwrap();
    let last = table.find("kind mail").unwrap();
    assert!(first < last, "newest first: {table}");
    assert!(
        table.contains("sent twice") && table.contains("smtp outage"),
        "{table}"
    );
    assert!(
        audit.contains(r#"href="/audit" class="active""#)
            || audit.contains(r#"class="active" href="/audit""#),
        "{audit}"
    );
    s.stop().await;
}

/// A kind's limits set and cleared through the API (`POST` and `DELETE
/// /api/v1/kinds/{kind}/limits`) and the dashboard's forms, each with its
/// audit row; bad values are 400 in the library's words with nothing
/// written; without `--ui-actions` both are 403; a cross-site `DELETE` is
/// refused like a cross-site `POST`.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn limits_are_set_and_cleared_through_the_api_and_the_dashboard(pool: PgPool) {
    let off = Server::start(&pool, false, false).await;
    let refused = off
        .post("/api/v1/kinds/api/limits", r#"{"global": 3}"#)
        .await
        .error(403);
    assert!(refused.starts_with("Actions are off"), "{refused}");
    let refused = off
        .send(
            "DELETE",
            "/api/v1/kinds/api/limits",
            &["Content-Type: application/json"],
            "",
        )
        .await;
    assert_eq!(refused.status, 403);
    off.stop().await;

    let s = Server::start(&pool, true, false).await;
    let set = s
        .post(
            "/api/v1/kinds/api/limits",
            r#"{"global": 10, "per_key": "/customer_id=2", "rate": "600/1m", "burst": 5}"#,
        )
        .await
        .json();
    assert_eq!(set["outcome"], "set");
    assert_eq!(set["limits"]["kind"], "api");
    assert_eq!(set["limits"]["global"], 10);
    assert_eq!(set["limits"]["per_key"]["pointer"], "/customer_id");
    assert_eq!(set["limits"]["rate"]["period"], "1m");
    assert_eq!(set["limits"]["burst"], 5);
    assert_eq!(set["limits"]["set_by"], "anonymous (api)");
    let listed = s.get("/api/v1/kinds/limits").await.json();
    assert_eq!(listed["limits"][0]["global"], 10);

    let stored = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT coalesce(string_agg(row_to_json(l)::text, ','), '') FROM almanac.kind_limits l",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let before = stored().await;
    for (body, says) in [
        (
            r#"{"global": 0}"#,
            "the global limit is 0; it must be at least 1",
        ),
        (
            r#"{"per_key": "x=1"}"#,
            "the JSON pointer `x` does not start with `/`",
        ),
        (
            r#"{"rate": "600/soon"}"#,
            "the rate `600/soon` has a period that does not parse",
        ),
        (
            r#"{"global": 2, "burst": 5}"#,
            "a burst of 5 without a rate",
        ),
        ("", "no limit given"),
        (r#"{"globl": 2}"#, "unknown field `globl`"),
    ] {
        let error = s.post("/api/v1/kinds/api/limits", body).await.error(400);
        assert!(error.contains(says), "{body}: {error}");
        assert!(!error.contains("invalid job"), "{body}: {error}");
    }
    assert_eq!(stored().await, before, "a refused set changed the limits");

    let delete = |path: &'static str, extra: &'static [&'static str]| {
        let mut headers = vec!["Content-Type: application/json"];
        headers.extend_from_slice(extra);
        let s = &s;
        async move { s.send("DELETE", path, &headers, "").await }
    };
    let foreign = delete("/api/v1/kinds/api/limits", &["Origin: http://evil.example"]).await;
    assert_eq!(foreign.status, 403, "{}", foreign.body);
    assert_eq!(stored().await, before);
    let cleared = delete("/api/v1/kinds/api/limits", &[]).await.json();
    assert_eq!(cleared["outcome"], "cleared");
    assert_eq!(cleared["limits"]["global"], 10);
    let again = delete("/api/v1/kinds/api/limits", &[]).await.json();
    assert_eq!(again["outcome"], "had_none");
    assert_eq!(again["limits"], Value::Null);

    // The dashboard's forms, with the page's CSRF token.
    let page = s.get("/").await.body;
    let token = page
        .split_once(r#"name="csrf" value=""#)
        .unwrap()
        .1
        .split('"')
        .next()
        .unwrap()
        .to_string();
    let reply = s
        .form(
            "/kinds/limits",
            &format!("csrf={token}&kind=mail&global=&per_key=&rate=10%2F1s&burst=2"),
            &[],
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(
        reply.body.contains(
            "Kind mail is limited to: rate 10/1s burst 2 (this replaces every limit it had)."
        ),
        "{}",
        reply.body
    );
    let reply = s
        .form(
            "/kinds/limits",
            &format!("csrf={token}&kind=mail&global=ten"),
            &[],
        )
        .await;
    assert_eq!(reply.status, 400);
    assert!(
        reply
            .body
            .contains("the global limit `ten` is not a whole number"),
        "{}",
        reply.body
    );
    let page = s.get("/").await.body;
    assert!(
        page.contains(r#"action="/kinds/mail/limits/clear""#),
        "{page}"
    );
    let reply = s
        .form("/kinds/mail/limits/clear", &format!("csrf={token}"), &[])
        .await;
    assert_eq!(reply.status, 200);
    assert!(
        reply
            .body
            .contains("Kind mail has no limits now (it had: rate 10/1s burst 2)."),
        "{}",
        reply.body
    );
    assert_eq!(stored().await, "");

    let audit: Vec<(String, String, String, String)> =
        sqlx::query_as("SELECT actor, source, action, target FROM almanac.audit_log ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let row = |source: &str, action: &str, kind: &str| {
        (
            "anonymous".to_string(),
            source.to_string(),
            action.to_string(),
            format!("kind {kind}"),
        )
    };
    assert_eq!(
        audit,
        vec![
            row("api", "limits set", "api"),
            row("api", "limits clear", "api"),
            row("dashboard", "limits set", "mail"),
            row("dashboard", "limits clear", "mail"),
        ]
    );
    s.stop().await;
}
