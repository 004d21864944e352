//! The operator's side of per-kind limits (issue #23): `almanac limits
//! set|clear|list` run as an operator runs them, with the text a person
//! reads; every bad input refused in the library's words, naming the value,
//! with nothing written; the audit rows; the gauges at `/metrics`, the
//! dashboard, the JSON API and `almanac stats`, and what each shows once the
//! limits are cleared.

use std::process::Output;
use std::time::Duration;

use almanac::metrics::Metrics;
use almanac::queue::{self, NewJob};
use almanac::role::{Periodic, Valid};
use almanac::stats::Collector;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness::http::sample;
use crate::harness::{self, count, text};

fn cli(pool: &PgPool, args: &[&str]) -> Output {
    harness::operator(pool, args)
}

/// Runs `args`, which must succeed; its stdout as a person reads it.
fn ok(pool: &PgPool, args: &[&str]) -> String {
    let out = cli(pool, args);
    assert!(
        out.status.success(),
        "{args:?}: {}\n{}",
        text(&out.stderr),
        text(&out.stdout)
    );
    text(&out.stdout)
}

/// `almanac.kind_limits` as it is, every column a change would touch.
async fn stored(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT row_to_json(l)::text FROM almanac.kind_limits l ORDER BY kind")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Claims one job of `kind` for a minute: it runs, as the limits count.
async fn start_one(pool: &PgPool, kind: &str) {
    let mut conn = pool.acquire().await.unwrap();
    queue::enqueue(&mut conn, &NewJob::new(kind)).await.unwrap();
    let kinds = vec![kind.to_string()];
    let claimed = queue::claim(
        pool,
        &queue::Claim {
            kinds: &kinds,
            limit: 1,
            lease: Duration::from_secs(60),
        },
    )
    .await
    .unwrap();
    assert_eq!(claimed.len(), 1);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn limits_are_set_listed_and_cleared_as_an_operator_reads_them(pool: PgPool) {
    assert_eq!(ok(&pool, &["limits", "list"]), "(no kind has limits)");

    let set = ok(
        &pool,
        &[
            "limits",
            "set",
            "api",
            "--global",
            "10",
            "--per-key",
            "/customer_id=2",
            "--rate",
            "600/1m",
            "--burst",
            "10",
        ],
    );
    let lines: Vec<&str> = set.lines().collect();
    assert_eq!(
        lines[0], "kind api is limited to: global 10, per key /customer_id=2, rate 600/1m burst 10",
        "{set}"
    );
    assert!(
        lines[1].starts_with("set by night-ops (cli) at ")
            && lines[1].ends_with("; it had no limits before"),
        "{set}"
    );

    // Setting replaces: what is not given is gone.
    let replaced = ok(&pool, &["limits", "set", "api", "--global", "5"]);
    let lines: Vec<&str> = replaced.lines().collect();
    assert_eq!(lines[0], "kind api is limited to: global 5", "{replaced}");
    assert!(
        lines[1].ends_with(
            "; this replaces all it had (global 10, per key /customer_id=2, rate 600/1m burst 10)"
        ),
        "{replaced}"
    );
    let row: (Option<i32>, Option<String>, Option<i32>, i32) = sqlx::query_as(
        "SELECT global_limit, key_pointer, rate, burst FROM almanac.kind_limits WHERE kind = 'api'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(row, (Some(5), None, None, 0));

    assert_eq!(
        ok(&pool, &["limits", "set", "mail", "--rate", "10/1s"])
            .lines()
            .next(),
        Some("kind mail is limited to: rate 10/1s burst 0")
    );
    start_one(&pool, "api").await;

    let listed = ok(&pool, &["limits", "list"]);
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 3, "{listed}");
    assert!(lines[0].starts_with("KIND") && lines[0].ends_with("LIMITS"));
    let api: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(api[..2], ["api", "1"], "{listed}");
    assert_eq!(api[3..], ["night-ops", "(cli)", "global", "5"], "{listed}");
    assert!(
        lines[2].starts_with("mail ") && lines[2].ends_with("rate 10/1s burst 0"),
        "{listed}"
    );
    let json: Vec<serde_json::Value> = ok(&pool, &["limits", "list", "--json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(json.len(), 2);
    assert_eq!(json[0]["kind"], "api");
    assert_eq!(json[0]["global"], 5);
    assert_eq!(json[0]["per_key"], serde_json::Value::Null);
    assert_eq!(json[0]["running"], 1);
    assert_eq!(json[0]["set_by"], "night-ops (cli)");
    assert_eq!(
        json[1]["rate"],
        serde_json::json!({"count": 10, "period": "1s"})
    );
    assert_eq!(json[1]["running"], 0);

    // `stats` shows them beside the paused kinds, text and JSON.
    ok(&pool, &["kinds", "pause", "mail"]);
    let stats = ok(&pool, &["stats"]);
    let paused = stats.find("paused mail:").expect(&stats);
    let limited: Vec<&str> = stats
        .lines()
        .filter(|l| l.starts_with("limited "))
        .collect();
    assert_eq!(limited.len(), 2, "{stats}");
    assert!(
        limited[0].starts_with("limited api:")
            && limited[0].contains(" global 5; 1 running now; set by night-ops (cli) at "),
        "{stats}"
    );
    assert!(
        limited[1].contains("mail:") && limited[1].contains(" rate 10/1s burst 0; 0 running now;"),
        "{stats}"
    );
    assert!(stats.find("limited api:").unwrap() > paused, "{stats}");
    let stats: serde_json::Value = serde_json::from_str(&ok(&pool, &["stats", "--json"])).unwrap();
    assert_eq!(stats["limits"][0]["kind"], "api");
    assert_eq!(stats["limits"][0]["running"], 1);
    assert_eq!(stats["limits"][1]["kind"], "mail");

    assert_eq!(
        ok(&pool, &["limits", "clear", "api"]),
        "kind api has no limits now (it had: global 5)"
    );
    let again = cli(&pool, &["limits", "clear", "api"]);
    assert_eq!(again.status.code(), Some(0));
    assert_eq!(
        text(&again.stdout),
        "kind api had no limits; nothing changed"
    );
    let listed = ok(&pool, &["limits", "list"]);
    assert_eq!(listed.lines().count(), 2, "{listed}");
    assert!(listed.lines().nth(1).unwrap().starts_with("mail "));
    assert!(!ok(&pool, &["stats"]).contains("limited api:"));

    // One audit row per change; the clear of nothing has none.
    let audit: Vec<(String, String, String, String, i64, Option<String>)> = sqlx::query_as(
        "SELECT actor, source, action, target, count, note FROM almanac.audit_log \
         WHERE action LIKE 'limits%' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let row = |action: &str, kind: &str, note: &str| {
        (
            "night-ops".to_string(),
            "cli".to_string(),
            action.to_string(),
            format!("kind {kind}"),
            1,
            Some(note.to_string()),
        )
    };
    assert_eq!(
        audit,
        vec![
            row(
                "limits set",
                "api",
                "global 10, per key /customer_id=2, rate 600/1m burst 10"
            ),
            row("limits set", "api", "global 5"),
            row("limits set", "mail", "rate 10/1s burst 0"),
            row("limits clear", "api", "was: global 5"),
        ]
    );
    let log = ok(&pool, &["audit"]);
    let newest = log.lines().nth(1).unwrap();
    assert!(
        newest.contains("limits clear") && newest.ends_with("was: global 5"),
        "{log}"
    );
}

/// Each bad input: a non-zero exit, `error: ` and the library's message
/// naming the value, and nothing written: the limit already set stays as
/// it was, and no audit row is added.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn bad_limits_are_refused_naming_the_value_and_nothing_is_written(pool: PgPool) {
    ok(&pool, &["limits", "set", "api", "--global", "3"]);
    let before = stored(&pool).await;
    let audit = "SELECT count(*) FROM almanac.audit_log";
    assert_eq!(count(&pool, audit).await, 1);
    let cases: [(&[&str], &str); 12] = [
        (&["--global", "0"], "the global limit is 0; it must be at least 1"),
        (&["--global", "-1"], "the global limit is -1; it must be at least 1"),
        (
            &["--per-key", "/x=0"],
            "the per-key limit is 0; it must be at least 1",
        ),
        (
            &["--per-key", "x=1"],
            "the JSON pointer `x` does not start with `/`",
        ),
        (
            &["--per-key", "/customer_id"],
            "the per-key limit `/customer_id` has no `=`",
        ),
        (&["--rate", "600"], "the rate `600` has no `/`"),
        (
            &["--rate", "600/soon"],
            "the rate `600/soon` has a period that does not parse",
        ),
        (&["--rate", "0/1m"], "the rate is 0; it must be at least 1"),
        (
            &["--burst", "5"],
            "a burst of 5 without a rate: the burst is the starts allowed above a rate; give --rate too",
        ),
        (
            &["--global", "3", "--burst", "5"],
            "a burst of 5 without a rate",
        ),
        (
            &["--rate", "10/1s", "--burst", "-2"],
            "the burst is -2; it must be 0 or more",
        ),
        (
            &[],
            "no limit given: set at least one of a global limit, a per-key limit or a rate",
        ),
    ];
    for (flags, says) in cases {
        let args: Vec<&str> = ["limits", "set", "api"]
            .iter()
            .chain(flags)
            .copied()
            .collect();
        let out = cli(&pool, &args);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{flags:?} was accepted");
        assert!(
            stderr.starts_with("error: ") && stderr.contains(says),
            "{flags:?}: {stderr}"
        );
        assert!(!stderr.contains("invalid job"), "{flags:?}: {stderr}");
        assert_eq!(stored(&pool).await, before, "{flags:?} changed the limits");
        assert_eq!(count(&pool, audit).await, 1, "{flags:?} was audited");
    }
    // A value clap cannot read names the value and the flag.
    let out = cli(&pool, &["limits", "set", "api", "--per-key", "/a~2=1"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("the JSON pointer `/a~2` has a `~` not followed by 0 or 1"),
        "{}",
        text(&out.stderr)
    );
    // Limits are per kind: no blank kind, no `*`.
    for kind in [" ", "*"] {
        let out = cli(&pool, &["limits", "set", kind, "--global", "1"]);
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(
            text(&out.stderr),
            format!("error: limits are per kind; `{kind}` is not a kind name")
        );
    }
    assert_eq!(stored(&pool).await, before);
    assert_eq!(count(&pool, audit).await, 1);
    let help = text(&cli(&pool, &["limits", "set", "--help"]).stdout);
    assert!(help.contains("replacing every limit it had"), "{help}");
}

/// `/metrics` (the collector's read, served over HTTP), the dashboard and
/// `GET /api/v1/kinds/limits` show a kind's limits and its running jobs; a
/// limit the kind loses loses its series, and once cleared the kind has
/// none.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn metrics_and_the_dashboard_show_limits_until_they_are_cleared(pool: PgPool) {
    let metrics = Metrics::new();
    let server = almanac::http::HttpServer::bind(
        "127.0.0.1:0".parse().unwrap(),
        None,
        &pool.connect_options(),
    )
    .await
    .unwrap()
    .with_metrics(metrics.clone())
    .mount(almanac::ui::router(
        &pool,
        almanac::ui::UiConfig {
            actions: false,
            any_host: true,
        },
    ));
    let addr = server.local_addr().to_string();
    let stop = CancellationToken::new();
    let serving = tokio::spawn(server.run(stop.clone()));
    let collector = Collector::new(pool.clone(), Valid::default()).with_metrics(metrics.clone());
    let refresh = || async {
        collector.run_once(&CancellationToken::new()).await.unwrap();
        let reply = harness::http::get(&addr, "/metrics").await.unwrap();
        assert_eq!(reply.status, 200);
        reply.body
    };
    let limit = |body: &str, kind: &str, which: &str| {
        sample(
            body,
            "almanac_kind_limit",
            &[("kind", kind), ("limit", which)],
        )
    };

    let page = harness::http::get(&addr, "/").await.unwrap().body;
    assert!(page.contains("No kind has limits"), "{page}");

    ok(
        &pool,
        &[
            "limits",
            "set",
            "api",
            "--global",
            "10",
            "--per-key",
            "/customer_id=2",
            "--rate",
            "600/1m",
            "--burst",
            "7",
        ],
    );
    start_one(&pool, "api").await;
    let body = refresh().await;
    assert_eq!(limit(&body, "api", "global"), Some(10.0), "{body}");
    assert_eq!(limit(&body, "api", "per_key"), Some(2.0), "{body}");
    assert_eq!(limit(&body, "api", "rate_per_second"), Some(10.0), "{body}");
    assert_eq!(limit(&body, "api", "burst"), Some(7.0), "{body}");
    assert_eq!(
        sample(&body, "almanac_kind_limit_running", &[("kind", "api")]),
        Some(1.0),
        "{body}"
    );

    let page = harness::http::get(&addr, "/").await.unwrap().body;
    let table = &page[page.find("id=\"limits\"").expect(&page)..];
    let row = &table[table.find("data-kind=\"api\"").expect(table)..];
    let row = &row[..row.find("</tr>").unwrap()];
    assert!(
        row.contains("global 10, per key /customer_id=2, rate 600/1m burst 7"),
        "{row}"
    );
    assert!(row.contains("<td class=\"num running\">1</td>"), "{row}");
    assert!(row.contains("night-ops (cli)"), "{row}");
    // The kind's row in "Jobs by kind" carries a badge.
    let kinds = &page[page.find("id=\"kinds\"").expect(&page)..];
    assert!(kinds.contains("badge limited"), "{kinds}");

    let api = harness::http::get(&addr, "/api/v1/kinds/limits")
        .await
        .unwrap();
    assert_eq!(api.status, 200);
    let api: serde_json::Value = serde_json::from_str(&api.body).unwrap();
    assert_eq!(api["limits"][0]["kind"], "api");
    assert_eq!(api["limits"][0]["global"], 10);
    assert_eq!(api["limits"][0]["per_key"]["pointer"], "/customer_id");
    assert_eq!(api["limits"][0]["running"], 1);

    // Replaced by a global limit alone: the others lose their series.
    ok(&pool, &["limits", "set", "api", "--global", "4"]);
    let body = refresh().await;
    assert_eq!(limit(&body, "api", "global"), Some(4.0), "{body}");
    for gone in ["per_key", "rate_per_second", "burst"] {
        assert_eq!(limit(&body, "api", gone), None, "{gone}: {body}");
    }

    ok(&pool, &["limits", "clear", "api"]);
    let body = refresh().await;
    assert!(
        !body
            .lines()
            .any(|l| l.starts_with("almanac_kind_limit") && l.contains("kind=\"api\"")),
        "{body}"
    );
    let page = harness::http::get(&addr, "/").await.unwrap().body;
    assert!(page.contains("No kind has limits"), "{page}");
    // Set again after a clear: the series come back.
    ok(&pool, &["limits", "set", "api", "--global", "2"]);
    let body = refresh().await;
    assert_eq!(limit(&body, "api", "global"), Some(2.0), "{body}");
    assert_eq!(
        sample(&body, "almanac_kind_limit_running", &[("kind", "api")]),
        Some(1.0),
        "{body}"
    );
    stop.cancel();
    serving.await.unwrap().unwrap();
}
