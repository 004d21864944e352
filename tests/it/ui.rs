//! The dashboard in a real browser: headless Chromium (Debian's `chromium`
//! and `chromium-driver`, installed by `scripts/services.sh`) driven over
//! WebDriver against the real `almanac run` binary and a database holding
//! real jobs, schedules, ledger rows and outbox rows. Every number a page
//! shows is compared with the database's; a dead job is retried through the
//! UI and runs; a schedule's hole shows as missing and its backfill command
//! fills it; actions are refused without `--ui-actions`. Screenshots of each
//! page land in `target/ui-screenshots/`.
//!
//! Also: `EXPLAIN` of every jobs-table statement the pages run, on a table
//! of 200,000 done jobs, uses an index (no sequential scan of `almanac.jobs`).

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use almanac::queue::browse::{self, DeadFilter, JobQuery, EXPLAIN};
use almanac::queue::JobStatus;
use almanac::scheduler::history;
use chrono::{DateTime, Utc};
use fantoccini::{Client, ClientBuilder, Locator};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::{self, count, eventually, free_port};

/// A synced schedule, parsed, and when it was first synced.
async fn synced_schedule(
    conn: &mut sqlx::PgConnection,
    name: &str,
) -> (almanac::scheduler::spec::Schedule, DateTime<Utc>) {
    let synced = history::synced_one(conn, name).await.unwrap().unwrap();
    (synced.schedule().unwrap(), synced.created_at)
}

/// A child process killed when the test ends, however it ends.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn almanac(url: &str) -> Command {
    let mut cmd = harness::almanac();
    cmd.env("DATABASE_URL", url)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    cmd
}

/// `almanac run` serving the dashboard on a free port, without the
/// scheduler and the janitor (the test's ledger and old jobs stay as made).
async fn serve(pool: &PgPool, actions: bool) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut cmd = almanac(&harness::database_url(pool));
    cmd.args(["run", "--roles", "reaper,metrics", "--http-addr", &addr]);
    if actions {
        cmd.arg("--ui-actions");
    }
    let mut child = Proc(cmd.spawn().unwrap());
    let probe = addr.clone();
    eventually(
        "almanac run to serve /readyz",
        Duration::from_secs(60),
        || {
            let exited = child.0.try_wait().unwrap();
            assert!(exited.is_none(), "almanac run exited: {exited:?}");
            let probe = probe.clone();
            async move {
                matches!(harness::http::get(&probe, "/readyz").await, Ok(r) if r.status == 200)
            }
        },
    )
    .await;
    (child, addr)
}

/// chromedriver on a free port and a headless Chromium session through it.
async fn browser() -> (Proc, Client) {
    let port = free_port();
    let driver = Proc(
        Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver is installed (scripts/services.sh installs chromium-driver)"),
    );
    eventually(
        "chromedriver to listen",
        Duration::from_secs(30),
        || async move { TcpStream::connect(("127.0.0.1", port)).is_ok() },
    )
    .await;
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,1000"],
        }),
    );
    // WebDriver on loopback is plain HTTP: no TLS stack needed.
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let client = ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("a headless Chromium session");
    (driver, client)
}

async fn shot(client: &Client, name: &str) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/target/ui-screenshots");
    std::fs::create_dir_all(dir).unwrap();
    let png = client.screenshot().await.unwrap();
    std::fs::write(format!("{dir}/{name}.png"), png).unwrap();
}

/// The text of the element `css`, waiting (up to 10 s) for it to appear:
/// after a click that navigates, the next page may still be loading.
async fn text(client: &Client, css: &str) -> String {
    client
        .wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no element `{css}`: {e}"))
        .text()
        .await
        .unwrap()
        .trim()
        .to_string()
}

async fn number(client: &Client, css: &str) -> i64 {
    let t = text(client, css).await;
    t.parse()
        .unwrap_or_else(|_| panic!("`{css}` shows `{t}`, not a number"))
}

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(sql).execute(pool).await.unwrap();
}

/// A POST with a form body, for what a browser would not send from our pages.
async fn post(addr: &str, path: &str, form: &str) -> (u16, String) {
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
        form.len()
    );
    raw(addr, &request).await
}

/// Sends `request` as written and returns the status and the whole reply.
async fn raw(addr: &str, request: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap();
    (status, text)
}

/// Jobs of every status and two kinds, one routed through an outbox with a
/// failed row, and a daily schedule first synced ten days ago whose ledger
/// has done, failed, skipped and unfinished runs and one hole.
async fn seed(pool: &PgPool) -> (String, DateTime<Utc>) {
    exec(
        pool,
        r#"
        INSERT INTO almanac.routes (kind, mode, sink, destination) VALUES ('mail', 'dual', 'kafka', 'mail-out');
        INSERT INTO almanac.jobs (kind, payload) SELECT 'mail', jsonb_build_object('to', 'user' || g || '@example.com')
          FROM generate_series(1, 3) g;
        INSERT INTO almanac.jobs (kind, payload) SELECT 'report', '{"pages": 2}' FROM generate_series(1, 2);
        INSERT INTO almanac.jobs (kind, status, attempts, lease_token, lease_until)
          VALUES ('report', 'running', 1, gen_random_uuid(), now() + interval '1 hour');
        INSERT INTO almanac.jobs (kind, status, attempts, max_attempts, finished_at, last_error)
          SELECT 'mail', 'dead', 3, 3, now() - interval '5 minutes', E'smtp 550 mailbox unavailable\nat relay.example.com'
          FROM generate_series(1, 2);
        INSERT INTO almanac.jobs (kind, status, attempts, max_attempts, finished_at, last_error)
          VALUES ('report', 'dead', 1, 1, now() - interval '2 minutes', 'exit status 3');
        INSERT INTO almanac.jobs (kind, status, attempts, finished_at)
          SELECT 'report', 'done', 1, now() - (g || ' minutes')::interval FROM generate_series(1, 7) g;
        UPDATE almanac.outbox SET failed_at = now(), last_error = 'broker said no: topic is read-only'
          WHERE id = (SELECT min(id) FROM almanac.outbox);
        INSERT INTO almanac.schedules (name, cron, timezone, kind, payload, catchup, catchup_window,
                                       overlap, max_attempts, enabled, definition_hash, created_at)
          VALUES ('nightly', '0 2 * * *', 'UTC', 'report', '{}', 'all', '7 days', 'skip', 5, true, 'h',
                  now() - interval '10 days');
        INSERT INTO almanac.schedule_pauses (schedule, paused_at, note, paused_by)
          VALUES ('nightly', now(), 'quarter close', 'alice');
        "#,
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    let (schedule, created_at) = synced_schedule(&mut conn, "nightly").await;
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let runs = schedule.runs_between(created_at, now);
    assert!(runs.len() >= 9, "{} runs", runs.len());
    let hole = runs[4].clone();
    for (i, run) in runs.iter().enumerate() {
        if i == 4 {
            continue;
        }
        let (outcome, status) = match i {
            2 => ("skipped_overlap", None),
            6 => ("emitted", Some("dead")),
            i if i == runs.len() - 1 => ("emitted", Some("ready")),
            _ => ("emitted", Some("done")),
        };
        let job_id: Option<i64> = match status {
            Some(status) => Some(
                sqlx::query_scalar(
                    "INSERT INTO almanac.jobs (kind, status, attempts, schedule, logical_run, idempotency_key,
                                               run_at, created_at, finished_at, last_error)
                     VALUES ('report', $1, 1, 'nightly', $2, 'schedule:nightly:' || $2, $3, $3,
                             CASE WHEN $1 IN ('done', 'dead') THEN $3 + interval '1 minute' END,
                             CASE WHEN $1 = 'dead' THEN 'exit status 3' END)
                     RETURNING id",
                )
                .bind(status)
                .bind(&run.logical_run)
                .bind(run.fire_at)
                .fetch_one(&mut *conn)
                .await
                .unwrap(),
            ),
            None => None,
        };
        sqlx::query(
            "INSERT INTO almanac.schedule_runs (schedule, logical_run, fire_at, job_id, source, outcome)
             VALUES ('nightly', $1, $2, $3, 'tick', $4)",
        )
        .bind(&run.logical_run)
        .bind(run.fire_at)
        .bind(job_id)
        .bind(outcome)
        .execute(&mut *conn)
        .await
        .unwrap();
    }
    (hole.logical_run, hole.fire_at)
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn every_page_shows_the_database_and_a_retried_job_runs(pool: PgPool) {
    let (hole, hole_at) = seed(&pool).await;
    let (_almanac, addr) = serve(&pool, true).await;
    let (_driver, c) = browser().await;
    let base = format!("http://{addr}");

    // Overview: totals, per kind, the hour's throughput, the outbox.
    c.goto(&format!("{base}/")).await.unwrap();
    for status in ["ready", "running", "dead"] {
        let sql = format!("SELECT count(*) FROM almanac.jobs WHERE status = '{status}'");
        assert_eq!(
            number(&c, &format!("#total-{status}")).await,
            count(&pool, &sql).await,
            "{status}"
        );
        for kind in ["mail", "report"] {
            let sql = format!(
                "SELECT count(*) FROM almanac.jobs WHERE status = '{status}' AND kind = '{kind}'"
            );
            let css = format!("tr[data-kind='{kind}'] td[data-status='{status}']");
            assert_eq!(number(&c, &css).await, count(&pool, &sql).await, "{css}");
        }
    }
    assert_eq!(
        number(&c, "#hour-done").await,
        count(&pool, "SELECT count(*) FROM almanac.jobs WHERE status = 'done' AND finished_at > now() - interval '1 hour'").await
    );
    assert_eq!(
        number(&c, "#outbox tr[data-sink='kafka'] td[data-field='backlog']").await,
        count(
            &pool,
            "SELECT count(*) FROM almanac.outbox WHERE published_at IS NULL AND failed_at IS NULL"
        )
        .await
    );
    assert_eq!(
        text(&c, "#leader").await,
        "No scheduler holds the leader lock."
    );
    shot(&c, "overview").await;
    // On a phone: the page fits the width (no horizontal scrolling of the page).
    c.set_window_size(390, 844).await.unwrap();
    c.refresh().await.unwrap();
    let overflow: serde_json::Value = c
        .execute(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(
        overflow.as_i64(),
        Some(0),
        "the overview is wider than a phone"
    );
    shot(&c, "overview-phone").await;
    c.set_window_size(1280, 1000).await.unwrap();

    // Jobs: newest first, filters.
    c.goto(&format!("{base}/jobs")).await.unwrap();
    let rows = c.find_all(Locator::Css("#jobs tbody tr")).await.unwrap();
    let total = count(&pool, "SELECT count(*) FROM almanac.jobs").await;
    assert_eq!(rows.len() as i64, total.min(50));
    assert_eq!(
        rows[0].attr("data-id").await.unwrap().unwrap(),
        count(&pool, "SELECT max(id) FROM almanac.jobs")
            .await
            .to_string()
    );
    shot(&c, "jobs").await;
    c.goto(&format!("{base}/jobs?kind=mail&status=dead"))
        .await
        .unwrap();
    let rows = c.find_all(Locator::Css("#jobs tbody tr")).await.unwrap();
    assert_eq!(
        rows.len() as i64,
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE kind = 'mail' AND status = 'dead'"
        )
        .await
    );
    c.goto(&format!("{base}/jobs?q=USER2%40example"))
        .await
        .unwrap();
    let rows = c.find_all(Locator::Css("#jobs tbody tr")).await.unwrap();
    assert_eq!(rows.len(), 1, "one payload names user2@example.com");
    c.goto(&format!("{base}/jobs?key=schedule:nightly:{hole}"))
        .await
        .unwrap();
    assert!(c.find(Locator::Css("#no-jobs")).await.is_ok());

    // Job detail: a routed mail job with its outbox row.
    let mail: i64 = count(
        &pool,
        "SELECT max(id) FROM almanac.jobs WHERE kind = 'mail' AND status = 'ready'",
    )
    .await;
    // An earlier message of the job was published: its row is gone, and
    // the batch that published it is the record.
    sqlx::query(
        "INSERT INTO almanac.outbox_batches (token, sink, ids, job_ids, job_span, lease_until, published_at) \
         VALUES (gen_random_uuid(), 'kafka', '{987654}', ARRAY[$1::bigint], int8range($1, $1, '[]'), now(), now())",
    )
    .bind(mail)
    .execute(&pool)
    .await
    .unwrap();
    c.goto(&format!("{base}/jobs/{mail}")).await.unwrap();
    assert_eq!(text(&c, "#kind").await, "mail");
    let outbox = c
        .find_all(Locator::Css(".outbox-rows tbody tr"))
        .await
        .unwrap();
    assert_eq!(
        outbox.len() as i64,
        count(
            &pool,
            &format!("SELECT count(*) FROM almanac.outbox WHERE job_id = {mail}")
        )
        .await
            + 1
    );
    let published = c
        .find(Locator::Css(".outbox-rows tbody tr[data-id='987654']"))
        .await
        .unwrap();
    assert!(published.text().await.unwrap().contains("published"));
    assert!(c.source().await.unwrap().contains("user3@example.com"));
    shot(&c, "job").await;

    // Dead letters: groups with the database's counts.
    c.goto(&format!("{base}/dead")).await.unwrap();
    assert_eq!(
        number(&c, "#dead-total").await,
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'dead'"
        )
        .await
    );
    let groups: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT kind, split_part(coalesce(last_error, ''), E'\\n', 1), count(*) FROM almanac.jobs
          WHERE status = 'dead' GROUP BY 1, 2",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let shown = c.find_all(Locator::Css("#groups tbody tr")).await.unwrap();
    assert_eq!(shown.len(), groups.len());
    let mut seen = BTreeMap::new();
    for row in shown {
        let cells = row.find_all(Locator::Css("td")).await.unwrap();
        let kind = cells[0].text().await.unwrap();
        let error = cells[1].text().await.unwrap();
        let n: i64 = cells[2].text().await.unwrap().parse().unwrap();
        seen.insert((kind, error), n);
    }
    for (kind, error, n) in &groups {
        assert_eq!(
            seen.get(&(kind.clone(), error.clone())),
            Some(n),
            "{kind}: {error}"
        );
    }
    shot(&c, "dead").await;

    // Schedules, and the calendar with its hole.
    c.goto(&format!("{base}/schedules")).await.unwrap();
    let row = text(&c, "tr[data-name='nightly']").await;
    assert!(row.contains("0 2 * * *"), "{row}");
    assert!(
        row.contains("by alice: quarter close"),
        "a pause shows as text: {row}"
    );
    // The one hole is the list's one missing run (the calendar's, below);
    // without a deadline nothing is overdue.
    assert_eq!(
        number(&c, "tr[data-name='nightly'] td.missing").await,
        1,
        "{row}"
    );
    assert_eq!(
        number(&c, "tr[data-name='nightly'] td.overdue").await,
        0,
        "{row}"
    );
    shot(&c, "schedules").await;
    c.goto(&format!("{base}/schedules/nightly")).await.unwrap();
    let paused = text(&c, "#paused").await;
    assert!(
        paused.starts_with("paused since") && paused.ends_with("by alice: quarter close"),
        "{paused}"
    );
    let state = |s: &'static str| {
        let c = &c;
        async move { number(c, &format!("#legend strong[data-state='{s}']")).await }
    };
    let ledger = |outcome: &str, status: &str| {
        format!(
            "SELECT count(*) FROM almanac.schedule_runs r JOIN almanac.jobs j ON j.id = r.job_id
              WHERE r.schedule = 'nightly' AND r.outcome = '{outcome}' AND j.status {status}"
        )
    };
    assert_eq!(
        state("done").await,
        count(&pool, &ledger("emitted", "= 'done'")).await
    );
    assert_eq!(
        state("failed").await,
        count(&pool, &ledger("emitted", "= 'dead'")).await
    );
    assert_eq!(
        state("emitted").await,
        count(&pool, &ledger("emitted", "IN ('ready', 'running')")).await
    );
    assert_eq!(
        state("skipped").await,
        count(
            &pool,
            "SELECT count(*) FROM almanac.schedule_runs WHERE outcome LIKE 'skipped%'"
        )
        .await
    );
    assert_eq!(state("missing").await, 1);
    let skipped = c
        .find(Locator::Css("#calendar .cell.skipped"))
        .await
        .unwrap()
        .attr("title")
        .await
        .unwrap()
        .unwrap();
    assert!(skipped.contains("skipped (overlap)"), "{skipped}");
    // Exactly what `gaps` reports for the calendar's range.
    let mut conn = pool.acquire().await.unwrap();
    let (schedule, created_at) = synced_schedule(&mut conn, "nightly").await;
    let gaps = almanac::scheduler::backfill::gaps(&mut conn, &schedule, created_at, Utc::now())
        .await
        .unwrap();
    assert_eq!(
        gaps.iter()
            .map(|r| r.logical_run.clone())
            .collect::<Vec<_>>(),
        vec![hole.clone()]
    );
    drop(conn);
    let missing = c
        .find(Locator::Css("#calendar a.cell.missing"))
        .await
        .unwrap();
    assert_eq!(missing.attr("data-run").await.unwrap(), Some(hole.clone()));
    shot(&c, "schedule").await;
    missing.click().await.unwrap();
    let at = hole_at.format("%Y-%m-%dT%H:%M:%SZ");
    let command = text(&c, "#backfill-cmd").await;
    assert_eq!(
        command,
        format!("almanac backfill nightly --from {at} --to {at}")
    );
    shot(&c, "schedule-missing").await;
    // The command shown fills the hole.
    let dir = std::env::temp_dir().join(format!("almanac-ui-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("nightly.toml"),
        "[nightly]\ncron = \"0 2 * * *\"\ntimezone = \"UTC\"\nkind = \"report\"\noverlap = \"skip\"\n",
    )
    .unwrap();
    let args: Vec<&str> = command.split_whitespace().skip(1).collect();
    let out = almanac(&harness::database_url(&pool))
        .args(&args)
        .arg("--schedules")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.goto(&format!("{base}/schedules/nightly")).await.unwrap();
    assert_eq!(state("missing").await, 0);
    assert_eq!(
        state("emitted").await,
        2,
        "the backfilled run and the latest"
    );

    // Routes: backlog per kind and the failed row with its error.
    c.goto(&format!("{base}/routes")).await.unwrap();
    assert_eq!(
        number(&c, "#routes tr[data-kind='mail'] td[data-field='backlog']").await,
        count(&pool, "SELECT count(*) FROM almanac.outbox WHERE published_at IS NULL AND failed_at IS NULL AND headers->>'almanac-kind' = 'mail'").await
    );
    let failed = text(&c, "#failed").await;
    assert!(
        failed.contains("broker said no: topic is read-only"),
        "{failed}"
    );
    assert_eq!(
        number(&c, "#sinks tr[data-sink='kafka'] td[data-field='failed']").await,
        1
    );
    shot(&c, "routes").await;

    // A forged POST (no token) is refused even with actions on.
    let dead_mail = count(
        &pool,
        "SELECT min(id) FROM almanac.jobs WHERE kind = 'mail' AND status = 'dead'",
    )
    .await;
    let (status, body) = post(&addr, &format!("/jobs/{dead_mail}/retry"), "csrf=guess").await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("CSRF token does not match"), "{body}");

    // Retry one dead job through the UI, then see a worker run it.
    c.goto(&format!(
        "{base}/dead?kind=mail&error=smtp%20550%20mailbox%20unavailable"
    ))
    .await
    .unwrap();
    assert_eq!(number(&c, "#selected-count").await, 2);
    c.find(Locator::Css(&format!(
        "button.retry-one[data-id='{dead_mail}']"
    )))
    .await
    .unwrap()
    .click()
    .await
    .unwrap();
    assert!(text(&c, "#flash").await.starts_with("Retried"));
    assert!(c
        .current_url()
        .await
        .unwrap()
        .path()
        .ends_with(&format!("/jobs/{dead_mail}")));
    let status_of = |id: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, JobStatus>("SELECT status FROM almanac.jobs WHERE id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(status_of(dead_mail).await, JobStatus::Ready);
    let _worker = Proc(
        almanac(&harness::database_url(&pool))
            .args(["work", "--handler", "mail=true", "--poll-interval", "100ms"])
            .spawn()
            .unwrap(),
    );
    eventually(
        "the retried job to run",
        Duration::from_secs(60),
        || async { status_of(dead_mail).await == JobStatus::Done },
    )
    .await;

    // Retry a whole group: the confirmation shows the count, then it is done.
    let group = count(
        &pool,
        "SELECT count(*) FROM almanac.jobs WHERE kind = 'report' AND status = 'dead'",
    )
    .await;
    c.goto(&format!("{base}/dead?kind=report&error=exit%20status%203"))
        .await
        .unwrap();
    c.find(Locator::Css("#retry-all"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert_eq!(number(&c, "#confirm-count").await, group);
    shot(&c, "dead-confirm").await;
    c.find(Locator::Css("#confirm"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert_eq!(number(&c, "#retried").await, group);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE kind = 'report' AND status = 'dead'"
        )
        .await,
        0
    );
    c.close().await.unwrap();
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn actions_are_refused_without_ui_actions(pool: PgPool) {
    exec(
        &pool,
        "INSERT INTO almanac.jobs (kind, status, attempts, finished_at, last_error)
         VALUES ('mail', 'dead', 5, now(), 'gave up')",
    )
    .await;
    let id = count(&pool, "SELECT max(id) FROM almanac.jobs").await;
    let (_almanac, addr) = serve(&pool, false).await;
    let (_driver, c) = browser().await;
    c.goto(&format!("http://{addr}/jobs/{id}")).await.unwrap();
    assert!(text(&c, "#read-only").await.contains("--ui-actions"));
    assert!(
        c.find(Locator::Css("#retry")).await.is_err(),
        "no retry button"
    );
    c.goto(&format!("http://{addr}/dead?kind=mail"))
        .await
        .unwrap();
    assert!(c
        .find_all(Locator::Css("button.retry-one"))
        .await
        .unwrap()
        .is_empty());
    c.goto(&format!("http://{addr}/dead/retry?kind=mail"))
        .await
        .unwrap();
    assert!(text(&c, "#error-message").await.contains("Actions are off"));
    c.close().await.unwrap();
    for (path, form) in [
        (format!("/jobs/{id}/retry"), String::new()),
        ("/dead/retry".to_string(), "kind=mail".to_string()),
    ] {
        let (status, body) = post(&addr, &path, &form).await;
        assert_eq!(status, 403, "{path}: {body}");
        assert!(
            body.to_ascii_lowercase().contains("x-frame-options: deny"),
            "{body}"
        );
        assert!(
            body.contains("Actions are off: this dashboard is read-only. Start `almanac run` with --ui-actions"),
            "{body}"
        );
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'dead'"
        )
        .await,
        1
    );
}

/// The nodes of a JSON plan that scan `almanac.jobs` sequentially.
fn seq_scans_of_jobs(plan: &serde_json::Value, out: &mut Vec<String>) {
    match plan {
        serde_json::Value::Object(map) => {
            if map.get("Node Type").and_then(|v| v.as_str()) == Some("Seq Scan")
                && map.get("Relation Name").and_then(|v| v.as_str()) == Some("jobs")
            {
                out.push(plan.to_string());
            }
            map.values().for_each(|v| seq_scans_of_jobs(v, out));
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| seq_scans_of_jobs(v, out)),
        _ => {}
    }
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn every_jobs_query_of_the_dashboard_uses_an_index_on_a_large_table(pool: PgPool) {
    exec(
        &pool,
        r#"
        INSERT INTO almanac.jobs (kind, status, attempts, payload, finished_at, created_at, schedule, logical_run)
          SELECT 'kind' || (g % 20), 'done', 1, jsonb_build_object('n', g), now() - (g || ' seconds')::interval,
                 now() - (g || ' seconds')::interval,
                 CASE WHEN g % 100 = 0 THEN 'nightly' END, CASE WHEN g % 100 = 0 THEN g::text END
            FROM generate_series(1, 200000) g;
        INSERT INTO almanac.jobs (kind, payload) SELECT 'kind' || (g % 20), '{}' FROM generate_series(1, 500) g;
        INSERT INTO almanac.jobs (kind, status, attempts, finished_at, last_error)
          SELECT 'kind' || (g % 5), 'dead', 5, now(), 'error ' || (g % 3) FROM generate_series(1, 300) g;
        ANALYZE almanac.jobs;
        "#,
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    let newest = browse::newest_id(&mut *conn).await.unwrap();
    let below = newest + 1;
    let from = below - browse::SCAN_WINDOW;
    let base = JobQuery {
        limit: 50,
        ..Default::default()
    };
    let queries: Vec<(&str, JobQuery)> = vec![
        ("newest", base.clone()),
        (
            "kind",
            JobQuery {
                kind: Some("kind7".into()),
                ..base.clone()
            },
        ),
        (
            "status done",
            JobQuery {
                status: Some(JobStatus::Done),
                ..base.clone()
            },
        ),
        (
            "status dead",
            JobQuery {
                status: Some(JobStatus::Dead),
                ..base.clone()
            },
        ),
        (
            "status ready + kind",
            JobQuery {
                status: Some(JobStatus::Ready),
                kind: Some("kind3".into()),
                ..base.clone()
            },
        ),
        (
            "schedule",
            JobQuery {
                schedule: Some("nightly".into()),
                ..base.clone()
            },
        ),
        (
            "payload text",
            JobQuery {
                payload_text: Some("\"n\": 4242".into()),
                ..base.clone()
            },
        ),
        (
            "idempotency key",
            JobQuery {
                idempotency_key: Some("schedule:nightly:x".into()),
                ..base.clone()
            },
        ),
    ];
    let mut plans: Vec<(String, serde_json::Value)> = Vec::new();
    for (name, q) in &queries {
        let plan: serde_json::Value = browse::page_query(EXPLAIN, q, from, below)
            .build_query_scalar()
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        plans.push((format!("jobs list by {name}"), plan));
    }
    let group = DeadFilter {
        kind: Some("kind1".into()),
        error: Some("error 1".into()),
    };
    for (name, mut b) in [
        ("dead list", browse::dead_list_query(EXPLAIN, &group, 50)),
        ("dead count", browse::dead_count_query(EXPLAIN, &group)),
        (
            "dead count, all",
            browse::dead_count_query(EXPLAIN, &DeadFilter::default()),
        ),
    ] {
        let plan: serde_json::Value = b.build_query_scalar().fetch_one(&mut *conn).await.unwrap();
        plans.push((name.to_string(), plan));
    }
    let plan: serde_json::Value =
        sqlx::query_scalar(&format!("{EXPLAIN}{}", browse::dead_groups_sql()))
            .bind(200i64)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    plans.push(("dead groups".into(), plan));
    let plan: serde_json::Value =
        sqlx::query_scalar(&format!("{EXPLAIN}{}", browse::THROUGHPUT_SQL))
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    plans.push(("throughput".into(), plan));
    let plan: serde_json::Value = sqlx::query_scalar(&format!(
        "{EXPLAIN}SELECT id, status FROM almanac.jobs WHERE id = ANY($1)"
    ))
    .bind(vec![1i64, 2, 3])
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    plans.push(("calendar job statuses".into(), plan));
    // The check can fail: a count of one kind over every status must scan.
    let plan: serde_json::Value = sqlx::query_scalar(&format!(
        "{EXPLAIN}SELECT count(*) FROM almanac.jobs WHERE kind = 'kind7'"
    ))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    let mut scans = Vec::new();
    seq_scans_of_jobs(&plan, &mut scans);
    assert!(
        !scans.is_empty(),
        "the check sees a sequential scan: {plan}"
    );
    let mut bad = Vec::new();
    for (name, plan) in &plans {
        let top = &plan[0]["Plan"];
        eprintln!(
            "{name}: {} (cost {})",
            top["Node Type"].as_str().unwrap_or("?"),
            top["Total Cost"]
        );
        let mut scans = Vec::new();
        seq_scans_of_jobs(plan, &mut scans);
        if !scans.is_empty() {
            bad.push(format!("{name}: {plan}"));
        }
    }
    assert!(
        bad.is_empty(),
        "sequential scans of almanac.jobs:\n{}",
        bad.join("\n")
    );
    // And the pages answer: the newest page lists 50 of the 200,800 rows.
    let page = browse::page(&mut conn, &base).await.unwrap();
    assert_eq!(page.jobs.len(), 50);
    assert_eq!(page.jobs[0].id, newest);
    assert!(page.next_before.is_some());
}

/// With `--http-basic-auth` the dashboard needs the credentials, like
/// `/metrics`; the probes stay open.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_dashboard_sits_behind_basic_auth_when_configured(pool: PgPool) {
    let auth: almanac::http::BasicAuth = "ops:s3cret".parse().unwrap();
    let server = almanac::http::HttpServer::bind(
        "127.0.0.1:0".parse().unwrap(),
        Some(auth),
        &pool.connect_options(),
    )
    .await
    .unwrap()
    .mount(almanac::ui::router(
        &pool,
        almanac::ui::UiConfig {
            actions: true,
            any_host: true,
        },
    ));
    let addr = server.local_addr().to_string();
    let stop = tokio_util::sync::CancellationToken::new();
    let serving = tokio::spawn(server.run(stop.clone()));
    for path in [
        "/",
        "/jobs",
        "/dead",
        "/schedules",
        "/routes",
        "/ui/style.css",
    ] {
        let reply = harness::http::get(&addr, path).await.unwrap();
        assert_eq!(reply.status, 401, "{path}");
        // "ops:s3cret" in base64.
        let reply = harness::http::get_with(&addr, path, Some("Basic b3BzOnMzY3JldA=="))
            .await
            .unwrap();
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
    }
    let (status, _) = post(&addr, "/dead/retry", "kind=x").await;
    assert_eq!(status, 401, "an action without credentials");
    assert_eq!(
        harness::http::get(&addr, "/healthz").await.unwrap().status,
        200
    );
    stop.cancel();
    serving.await.unwrap().unwrap();
}

/// A group retry takes exactly the group, in batches, and leaves the rest.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_group_retry_takes_exactly_its_group_in_batches(pool: PgPool) {
    exec(
        &pool,
        r#"
        INSERT INTO almanac.jobs (kind, status, attempts, finished_at, last_error)
          SELECT 'bulk', 'dead', 5, now(), E'quota exceeded\nretry later' FROM generate_series(1, 2500);
        INSERT INTO almanac.jobs (kind, status, attempts, finished_at, last_error)
          SELECT 'bulk', 'dead', 5, now(), 'quota exceeded!' FROM generate_series(1, 3);
        INSERT INTO almanac.jobs (kind, status, attempts, finished_at, last_error)
          SELECT 'other', 'dead', 5, now(), 'quota exceeded' FROM generate_series(1, 2);
        "#,
    )
    .await;
    let group = DeadFilter {
        kind: Some("bulk".into()),
        error: Some("quota exceeded".into()),
    };
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(browse::dead_count(&mut conn, &group).await.unwrap(), 2500);
    const { assert!(2500 > browse::RETRY_BATCH) };
    let n = browse::retry_dead_matching(&mut conn, &group)
        .await
        .unwrap();
    assert_eq!(n, 2500);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.jobs WHERE status = 'ready' AND attempts = 0 AND finished_at IS NULL AND run_at <= now() AND kind = 'bulk'").await,
        2500
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'dead'"
        )
        .await,
        5
    );
    // Nothing is left to take: a second retry of the group is a no-op.
    assert_eq!(
        browse::retry_dead_matching(&mut conn, &group)
            .await
            .unwrap(),
        0
    );
}

/// Without basic auth the dashboard answers only to loopback names, so a
/// site that re-points its own name at 127.0.0.1 (DNS rebinding) cannot read
/// it or its CSRF token; and an action posted from another site is refused
/// before anything else is looked at.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn foreign_hosts_and_cross_site_posts_are_refused(pool: PgPool) {
    let server = almanac::http::HttpServer::bind(
        "127.0.0.1:0".parse().unwrap(),
        None,
        &pool.connect_options(),
    )
    .await
    .unwrap();
    let ui = almanac::ui::UiConfig {
        actions: true,
        any_host: server.has_auth(),
    };
    let server = server.mount(almanac::ui::router(&pool, ui));
    let addr = server.local_addr().to_string();
    let port = server.local_addr().port();
    let stop = tokio_util::sync::CancellationToken::new();
    let serving = tokio::spawn(server.run(stop.clone()));

    let get =
        |host: String| format!("GET /dead HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let (status, reply) = raw(&addr, &get(format!("evil.example:{port}"))).await;
    assert_eq!(status, 421, "{reply}");
    assert!(reply.contains("answers only to localhost"), "{reply}");
    for host in [
        format!("localhost:{port}"),
        addr.clone(),
        format!("[::1]:{port}"),
    ] {
        let (status, reply) = raw(&addr, &get(host.clone())).await;
        assert_eq!(status, 200, "{host}: {reply}");
    }

    let form = "kind=x";
    let cross = |header: &str| {
        format!(
            "POST /dead/retry HTTP/1.1\r\nHost: {addr}\r\n{header}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        )
    };
    for header in ["Origin: http://evil.example", "Sec-Fetch-Site: cross-site"] {
        let (status, reply) = raw(&addr, &cross(header)).await;
        assert_eq!(status, 403, "{header}: {reply}");
        assert!(
            reply.contains("sent from another site"),
            "{header}: {reply}"
        );
    }
    // From its own page the same POST gets past the check (and is then
    // refused for its missing CSRF token, not for where it came from).
    let (status, reply) = raw(&addr, &cross(&format!("Origin: http://{addr}"))).await;
    assert_eq!(status, 403, "{reply}");
    assert!(reply.contains("CSRF token"), "{reply}");
    stop.cancel();
    serving.await.unwrap().unwrap();
}

/// A run that fell due within the last minute and is not recorded yet is
/// shown as due (the leader emits it at its next tick), not as missing;
/// older unrecorded runs are missing, exactly as `almanac gaps` lists them.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_run_due_this_minute_is_due_not_missing(pool: PgPool) {
    exec(
        &pool,
        r#"
        INSERT INTO almanac.schedules (name, cron, timezone, kind, payload, catchup, catchup_window,
                                       overlap, max_attempts, enabled, definition_hash, created_at)
          VALUES ('minutely', '* * * * *', 'UTC', 'tick', '{}', 'all', '1 day', 'skip', 5, true, 'h',
                  now() - interval '10 minutes');
        "#,
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    let (schedule, created_at) = synced_schedule(&mut conn, "minutely").await;
    let calendar = history::calendar(&mut conn, &schedule).await.unwrap();
    let last = calendar.cells.last().unwrap();
    assert_eq!(last.state, history::CellState::Due, "{:?}", last.run);
    let missing: Vec<String> = calendar
        .cells
        .iter()
        .filter(|c| c.state == history::CellState::Missing)
        .map(|c| c.run.logical_run.clone())
        .collect();
    // Nine or ten minutes since the first sync, less the one still due.
    assert!(
        (8..=10).contains(&missing.len()),
        "{} missing: {missing:?}",
        missing.len()
    );
    let gaps =
        almanac::scheduler::backfill::gaps(&mut conn, &schedule, created_at, last.run.fire_at)
            .await
            .unwrap();
    assert_eq!(
        gaps.iter()
            .map(|r| r.logical_run.clone())
            .collect::<Vec<_>>(),
        missing
    );
}

/// A synced five-minute schedule, `every5`, as the scheduler would leave it.
async fn sync_every5(pool: &PgPool) {
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

/// The CSRF token the page's action forms carry.
fn token_in(page: &str) -> String {
    let (_, rest) = page
        .split_once(r#"name="csrf" value=""#)
        .unwrap_or_else(|| panic!("no action form: {page}"));
    rest.split('"').next().unwrap().to_string()
}

/// The dashboard's schedule actions, as its forms send them: pause with a
/// note, resume, trigger, each saying what it did in the CLI's words, each
/// idempotent; a wrong token, another site, an unknown schedule or run are
/// refused and change nothing.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn schedules_are_paused_resumed_and_triggered_from_the_dashboard(pool: PgPool) {
    sync_every5(&pool).await;
    let (_almanac, addr) = serve(&pool, true).await;
    let page = harness::http::get(&addr, "/schedules").await.unwrap().body;
    assert!(
        page.contains(r#"action="/schedules/every5/pause""#)
            && page.contains(r#"action="/schedules/every5/trigger""#)
            && !page.contains(r#"action="/schedules/every5/resume""#),
        "{page}"
    );
    let token = token_in(&page);
    let pauses = || async {
        let rows: Vec<(String, String, Option<String>)> = sqlx::query_as(
            "SELECT note, paused_by, resumed_by FROM almanac.schedule_pauses ORDER BY paused_at",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        rows
    };

    // Refused: a wrong token, another site, an unknown schedule.
    let (status, body) = post(&addr, "/schedules/every5/pause", "csrf=guess&note=x").await;
    assert_eq!(status, 403);
    assert!(body.contains("CSRF token does not match"), "{body}");
    let form = format!("csrf={token}&note=x");
    let (status, body) = raw(
        &addr,
        &format!(
            "POST /schedules/every5/pause HTTP/1.1\r\nHost: {addr}\r\nOrigin: http://evil.example\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        ),
    )
    .await;
    assert_eq!(status, 403);
    assert!(body.contains("sent from another site"), "{body}");
    let (status, body) = post(&addr, "/schedules/nosuch/pause", &form).await;
    assert_eq!(status, 404);
    assert!(
        body.contains("No schedule named `nosuch` has been synced."),
        "{body}"
    );
    assert!(pauses().await.is_empty());

    // Pause with a note; again: already, nothing changed.
    let (status, body) = post(
        &addr,
        "/schedules/every5/pause",
        &format!("csrf={token}&note=warehouse+migration"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("every5: paused since ")
            && body.contains(" by anonymous (dashboard): warehouse migration"),
        "{body}"
    );
    let (_, body) = post(
        &addr,
        "/schedules/every5/pause",
        &format!("csrf={token}&note="),
    )
    .await;
    assert!(
        body.contains("every5: already paused since ") && body.contains("nothing changed"),
        "{body}"
    );
    assert_eq!(
        pauses().await,
        vec![(
            "warehouse migration".into(),
            "anonymous (dashboard)".into(),
            None
        )]
    );
    let page = harness::http::get(&addr, "/schedules").await.unwrap().body;
    assert!(
        page.contains(r#"action="/schedules/every5/resume""#)
            && !page.contains(r#"action="/schedules/every5/pause""#)
            && page.contains("by anonymous (dashboard): warehouse migration"),
        "{page}"
    );

    // Resume; again: not paused.
    let (status, body) = post(&addr, "/schedules/every5/resume", &format!("csrf={token}")).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("every5: resumed (was paused since "),
        "{body}"
    );
    let (_, body) = post(&addr, "/schedules/every5/resume", &format!("csrf={token}")).await;
    assert!(
        body.contains("every5: not paused; nothing changed"),
        "{body}"
    );
    assert_eq!(
        pauses().await,
        vec![(
            "warehouse migration".into(),
            "anonymous (dashboard)".into(),
            Some("anonymous (dashboard)".into())
        )]
    );

    // Trigger the latest due run; again: it exists; a name that is no run
    // of the schedule is refused.
    let (status, body) = post(
        &addr,
        "/schedules/every5/trigger",
        &format!("csrf={token}&logical_run="),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("every5: emitted logical run "), "{body}");
    let (_, body) = post(&addr, "/schedules/every5/trigger", &format!("csrf={token}")).await;
    assert!(
        body.contains("already exists (recorded by trigger, job ")
            && body.contains("nothing emitted"),
        "{body}"
    );
    let (status, body) = post(
        &addr,
        "/schedules/every5/trigger",
        &format!("csrf={token}&logical_run=2026-03-08"),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        body.contains("`2026-03-08` is not a logical run of `every5`"),
        "{body}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 1);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.schedule_runs WHERE source = 'trigger' AND job_id IS NOT NULL"
        )
        .await,
        1
    );
    // One audit row per action that did or found something; the refusals
    // and the resume of a schedule that was not paused left none.
    let audit: Vec<(String, String, String, String, i64)> = sqlx::query_as(
        "SELECT actor, source, action, target, count FROM almanac.audit_log ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let row = |action: &str, count: i64| {
        (
            "anonymous".to_string(),
            "dashboard".to_string(),
            action.to_string(),
            "schedule every5".to_string(),
            count,
        )
    };
    assert_eq!(
        audit,
        vec![
            row("pause", 1),
            row("pause", 0),
            row("resume", 1),
            row("trigger", 1),
            row("trigger", 0)
        ]
    );
}

/// Without `--ui-actions` the schedule pages show no action form and every
/// schedule action is refused, saying how to turn actions on.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn schedule_actions_are_refused_without_ui_actions(pool: PgPool) {
    sync_every5(&pool).await;
    let (_almanac, addr) = serve(&pool, false).await;
    for path in ["/schedules", "/schedules/every5"] {
        let reply = harness::http::get(&addr, path).await.unwrap();
        assert_eq!(reply.status, 200);
        assert!(reply.body.contains("every5"), "{}", reply.body);
        assert!(
            !reply.body.contains("csrf") && !reply.body.contains("/schedules/every5/"),
            "{path}: {}",
            reply.body
        );
    }
    for action in ["pause", "resume", "trigger"] {
        let (status, body) = post(
            &addr,
            &format!("/schedules/every5/{action}"),
            "csrf=guess&note=x",
        )
        .await;
        assert_eq!(status, 403, "{action}: {body}");
        assert!(
            body.contains("Actions are off: this dashboard is read-only. Start `almanac run` with --ui-actions")
                && body.contains("`almanac schedules pause|resume|trigger NAME`"),
            "{body}"
        );
    }
    for table in ["schedule_pauses", "schedule_runs", "jobs"] {
        let sql = format!("SELECT count(*) FROM almanac.{table}");
        assert_eq!(count(&pool, &sql).await, 0, "{table}");
    }
}

/// The schedule buttons in a real browser: pause with a note typed into
/// the form, resume, trigger; each page says what happened and the
/// database agrees.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn schedule_buttons_work_in_a_browser(pool: PgPool) {
    sync_every5(&pool).await;
    let (_almanac, addr) = serve(&pool, true).await;
    let (_driver, c) = browser().await;
    let base = format!("http://{addr}");
    let click = |css: &'static str| {
        let c = &c;
        async move {
            c.find(Locator::Css(css))
                .await
                .unwrap_or_else(|e| panic!("no `{css}`: {e}"))
                .click()
                .await
                .unwrap();
        }
    };
    c.goto(&format!("{base}/schedules")).await.unwrap();
    shot(&c, "schedules-actions").await;
    c.find(Locator::Css("tr[data-name='every5'] input[name='note']"))
        .await
        .unwrap()
        .send_keys("quarter close")
        .await
        .unwrap();
    click("tr[data-name='every5'] button.pause").await;
    let flash = text(&c, "#flash").await;
    assert!(
        flash.starts_with("every5: paused since")
            && flash.ends_with("by anonymous (dashboard): quarter close"),
        "{flash}"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.schedule_pauses WHERE resumed_at IS NULL AND note = 'quarter close'"
        )
        .await,
        1
    );

    c.goto(&format!("{base}/schedules/every5")).await.unwrap();
    assert!(text(&c, "#paused")
        .await
        .ends_with("by anonymous (dashboard): quarter close"));
    shot(&c, "schedule-actions").await;
    click("#actions button.resume").await;
    assert!(text(&c, "#flash")
        .await
        .starts_with("every5: resumed (was paused since"));
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.schedule_pauses WHERE resumed_at IS NULL"
        )
        .await,
        0
    );

    c.goto(&format!("{base}/schedules")).await.unwrap();
    click("tr[data-name='every5'] button.trigger").await;
    let flash = text(&c, "#flash").await;
    assert!(flash.starts_with("every5: emitted logical run "), "{flash}");
    let job = count(&pool, "SELECT max(id) FROM almanac.jobs").await;
    assert!(flash.ends_with(&format!(" as job {job}")), "{flash}");
    click("#flash a").await;
    assert!(c
        .current_url()
        .await
        .unwrap()
        .path()
        .ends_with(&format!("/jobs/{job}")));
    c.close().await.unwrap();
}

/// The kinds' Pause (with a note) and Resume buttons and a job's Cancel
/// button in a real browser; each action is on `/audit` as the browser's
/// (anonymous) operator.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn kind_and_cancel_buttons_work_in_a_browser(pool: PgPool) {
    exec(
        &pool,
        "INSERT INTO almanac.jobs (kind, run_at) VALUES ('mail', now() + interval '1 hour')",
    )
    .await;
    let id = count(&pool, "SELECT max(id) FROM almanac.jobs").await;
    let (_almanac, addr) = serve(&pool, true).await;
    let (_driver, c) = browser().await;
    let base = format!("http://{addr}");
    let click = |css: &'static str| {
        let c = &c;
        async move {
            c.find(Locator::Css(css))
                .await
                .unwrap_or_else(|e| panic!("no `{css}`: {e}"))
                .click()
                .await
                .unwrap();
        }
    };
    c.goto(&format!("{base}/")).await.unwrap();
    assert!(text(&c, "#no-paused").await.contains("No kind is paused"));
    c.find(Locator::Css("tr[data-kind='mail'] input[name='note']"))
        .await
        .unwrap()
        .send_keys("smtp outage")
        .await
        .unwrap();
    click("tr[data-kind='mail'] button.pause").await;
    assert!(text(&c, "#flash").await.starts_with("Kind mail is paused"));
    c.goto(&format!("{base}/")).await.unwrap();
    shot(&c, "overview-paused").await;
    assert!(text(&c, "#paused tr[data-kind='mail'] .pause-note")
        .await
        .contains("smtp outage"));
    assert_eq!(
        text(&c, "#paused tr[data-kind='mail'] .by").await,
        "anonymous (dashboard)"
    );
    click("#paused tr[data-kind='mail'] button.resume").await;
    assert!(text(&c, "#flash")
        .await
        .starts_with("Kind mail is resumed."));
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.kind_pauses").await,
        0
    );

    c.goto(&format!("{base}/jobs/{id}")).await.unwrap();
    c.find(Locator::Css("form.cancel input[name='reason']"))
        .await
        .unwrap()
        .send_keys("sent twice")
        .await
        .unwrap();
    click("#cancel").await;
    assert_eq!(text(&c, "#flash").await, "Cancelled.");
    assert!(text(&c, "#cancel-info").await.contains("sent twice"));
    assert_eq!(
        count(
            &pool,
            &format!("SELECT count(*) FROM almanac.jobs WHERE id = {id} AND status = 'cancelled'")
        )
        .await,
        1
    );

    c.goto(&format!("{base}/audit")).await.unwrap();
    shot(&c, "audit").await;
    let actions: Vec<String> = {
        let mut out = Vec::new();
        for cell in c.find_all(Locator::Css("#audit td.action")).await.unwrap() {
            out.push(cell.text().await.unwrap());
        }
        out
    };
    assert_eq!(actions, ["cancel", "resume", "pause"]);
    assert!(text(&c, "#audit tbody tr:first-child .audit-note")
        .await
        .contains("sent twice"));
    c.close().await.unwrap();
}

/// A kind routed to a sink no relay serves is a warning on `/routes`
/// (issue #20, item 10); `almanac run --roles reaper,metrics` runs no relay.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn the_routes_page_warns_of_a_sink_no_relay_serves(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    almanac::relay::routes::set(
        &mut conn,
        "mailer",
        almanac::relay::routes::RouteMode::Dual,
        Some(almanac::relay::SinkKind::Kafka),
        Some("mail"),
    )
    .await
    .unwrap();
    drop(conn);
    let (_proc, addr) = serve(&pool, false).await;
    let page = harness::http::get(&addr, "/routes").await.unwrap();
    assert_eq!(page.status, 200);
    assert!(
        page.body.contains("no relay for kafka is running")
            && page.body.contains("data-kind=\"mailer\""),
        "{}",
        page.body
    );
    assert!(
        !page.body.contains("nothing runs them"),
        "dual: workers still run them"
    );
}
