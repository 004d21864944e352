//! Bulk actions by filter (issue #22 item 4): `almanac jobs
//! retry|cancel|delete --kind --status --error-like --older-than` counts,
//! asks (or takes `--yes`), acts in batches on at most what it counted, and
//! leaves one audit row with the exact count.

use std::process::Output;

use almanac::control::bulk::{self, Bulk, Filter};
use almanac::control::{Actor, Source};
use almanac::queue::JobStatus;
use sqlx::PgPool;

use crate::harness::{self, count, text};

fn cli(pool: &PgPool, args: &[&str]) -> Output {
    harness::operator(pool, args)
}

/// `n` jobs of `kind` in `status`, finished `days` ago, with `error`.
async fn jobs(pool: &PgPool, n: i64, kind: &str, status: &str, error: &str, days: i32) {
    sqlx::query(
        "INSERT INTO almanac.jobs (kind, status, attempts, max_attempts, last_error, created_at, finished_at)
         SELECT $2, $3, 5, 5, $4, now() - make_interval(days => $5 + 1),
                CASE WHEN $3 IN ('done', 'dead', 'cancelled') THEN now() - make_interval(days => $5) END
         FROM generate_series(1, $1)",
    )
    .bind(n)
    .bind(kind)
    .bind(status)
    .bind(error)
    .bind(days)
    .execute(pool)
    .await
    .unwrap();
}

async fn statuses(pool: &PgPool, kind: &str) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT status, count(*) FROM almanac.jobs WHERE kind = $1 GROUP BY 1 ORDER BY 1",
    )
    .bind(kind)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_bulk_retry_acts_on_exactly_what_it_counted(pool: PgPool) {
    // 2,500 dead `report` jobs that timed out (three batches), 300 that were
    // refused, 200 that timed out yesterday only, and other kinds' dead jobs.
    jobs(
        &pool,
        2_500,
        "report",
        "dead",
        "upstream TIMEOUT after 30s",
        3,
    )
    .await;
    jobs(&pool, 300, "report", "dead", "connection refused", 3).await;
    jobs(
        &pool,
        200,
        "report",
        "dead",
        "upstream timeout after 30s",
        0,
    )
    .await;
    jobs(&pool, 100, "mail", "dead", "upstream timeout after 30s", 3).await;
    let filter = [
        "--kind",
        "report",
        "--error-like",
        "timeout",
        "--older-than",
        "2d",
    ];

    let mut args = vec!["jobs", "retry"];
    args.extend(filter);
    let unasked = cli(&pool, &args);
    assert_eq!(unasked.status.code(), Some(1));
    let what =
        "jobs where status dead|cancelled, kind report, error like \"timeout\", older than 172800s";
    assert_eq!(
        text(&unasked.stderr),
        format!("error: 2500 jobs match ({what}); add --yes to retry them without a prompt")
    );
    let mut dry = args.clone();
    dry.push("--dry-run");
    assert_eq!(
        text(&cli(&pool, &dry).stdout),
        format!("2500 jobs match ({what}); --dry-run: nothing changed")
    );
    assert_eq!(
        statuses(&pool, "report").await,
        vec![("dead".into(), 3_000)],
        "a refused or dry run changed something"
    );

    args.push("--yes");
    let done = cli(&pool, &args);
    assert!(done.status.success(), "{}", text(&done.stderr));
    assert_eq!(text(&done.stdout), "2500 of 2500 jobs retried");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'ready' AND kind = 'report' \
             AND last_error ILIKE '%timeout%' AND attempts = 0 AND finished_at IS NULL"
        )
        .await,
        2_500
    );
    assert_eq!(
        statuses(&pool, "report").await,
        vec![("dead".into(), 500), ("ready".into(), 2_500)]
    );
    assert_eq!(statuses(&pool, "mail").await, vec![("dead".into(), 100)]);
    let audit: Vec<(String, String, String, String, i64)> = sqlx::query_as(
        "SELECT actor, source, action, target, count FROM almanac.audit_log ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        vec![(
            "night-ops".into(),
            "cli".into(),
            "bulk retry".into(),
            what.into(),
            2_500
        )]
    );

    // Nothing left to match: a clear answer, nothing written.
    let again = cli(&pool, &args);
    assert!(again.status.success());
    assert_eq!(
        text(&again.stdout),
        format!("no job matches ({what}): nothing changed")
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.audit_log").await,
        1
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn bulk_cancel_and_delete_keep_to_their_statuses(pool: PgPool) {
    jobs(&pool, 40, "sync", "ready", "", 0).await;
    jobs(&pool, 10, "sync", "done", "", 10).await;
    jobs(&pool, 5, "other", "ready", "", 0).await;

    let cancel = cli(
        &pool,
        &[
            "jobs",
            "cancel",
            "--kind",
            "sync",
            "--reason",
            "vendor down",
            "--yes",
        ],
    );
    assert!(cancel.status.success(), "{}", text(&cancel.stderr));
    assert_eq!(
        text(&cancel.stdout),
        "40 of 40 jobs cancelled (running ones: asked to stop)"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status = 'cancelled' \
             AND cancel_reason = 'vendor down' AND cancelled_by = 'night-ops (cli)'"
        )
        .await,
        40
    );
    assert_eq!(statuses(&pool, "other").await, vec![("ready".into(), 5)]);

    // Delete never takes a job from under a worker.
    let refused = cli(&pool, &["jobs", "delete", "--status", "ready", "--yes"]);
    assert_eq!(refused.status.code(), Some(1));
    assert_eq!(
        text(&refused.stderr),
        "error: jobs delete applies to done or dead or cancelled jobs, not ready; \
         cancel ready or running jobs first (jobs cancel)"
    );
    let both = cli(&pool, &["jobs", "cancel", "7", "--kind", "sync"]);
    assert_eq!(both.status.code(), Some(1));
    assert_eq!(
        text(&both.stderr),
        "error: jobs cancel takes a job id or filters (--kind, --status, --error-like, --older-than), not both"
    );
    let bare = cli(&pool, &["jobs", "delete"]);
    assert_eq!(bare.status.code(), Some(1));
    assert_eq!(
        text(&bare.stderr),
        "error: jobs delete needs a job id or at least one filter (--kind, --status, --error-like, --older-than)"
    );
    let bad_age = cli(&pool, &["jobs", "delete", "--older-than", "soon"]);
    assert_eq!(bad_age.status.code(), Some(2));
    assert!(
        text(&bad_age.stderr).contains("`soon` is not a duration"),
        "{}",
        text(&bad_age.stderr)
    );

    let delete = cli(
        &pool,
        &[
            "jobs",
            "delete",
            "--kind",
            "sync",
            "--older-than",
            "7d",
            "--yes",
        ],
    );
    assert!(delete.status.success(), "{}", text(&delete.stderr));
    assert_eq!(text(&delete.stdout), "10 of 10 jobs deleted");
    assert_eq!(
        statuses(&pool, "sync").await,
        vec![("cancelled".into(), 40)]
    );
    let audit: Vec<(String, i64)> =
        sqlx::query_as("SELECT action, count FROM almanac.audit_log ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        audit,
        vec![("bulk cancel".into(), 40), ("bulk delete".into(), 10)]
    );
    jobs(&pool, 1, "lone", "dead", "boom", 0).await;
    let one = cli(&pool, &["jobs", "retry", "--kind", "lone"]);
    assert_eq!(
        text(&one.stderr),
        "error: 1 job matches (jobs where status dead|cancelled, kind lone); \
         add --yes to retry it without a prompt"
    );
}

/// Rows that stop matching between the count and the action (someone else
/// retried them, a worker claimed them) are left as they are, and rows that
/// start matching later are not touched: the action changes at most what
/// was counted, and its audit row says exactly how many.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn rows_that_changed_since_the_count_are_left_alone(pool: PgPool) {
    jobs(&pool, 1_500, "report", "dead", "boom", 1).await;
    let mut conn = pool.acquire().await.unwrap();
    let filter = Filter {
        kind: Some("report".into()),
        status: Some(JobStatus::Dead),
        ..Filter::default()
    };
    let selection = bulk::select(&mut conn, Bulk::Retry, &filter).await.unwrap();
    assert_eq!(selection.ids.len(), 1_500);
    // Meanwhile: 7 of them are retried by someone else, and 20 new dead
    // jobs appear.
    sqlx::query(
        "UPDATE almanac.jobs SET status = 'ready', finished_at = NULL \
         WHERE id IN (SELECT id FROM almanac.jobs ORDER BY id DESC LIMIT 7)",
    )
    .execute(&pool)
    .await
    .unwrap();
    jobs(&pool, 20, "report", "dead", "boom", 1).await;

    let actor = Actor::new("ops", Source::Api);
    let mut seen = Vec::new();
    let report = bulk::apply(&mut conn, &actor, &selection, None, |n| seen.push(n))
        .await
        .unwrap();
    assert_eq!((report.acted, report.skipped), (1_493, 7));
    assert_eq!(seen, vec![1_000, 1_493]);
    assert_eq!(
        statuses(&pool, "report").await,
        vec![("dead".into(), 20), ("ready".into(), 1_500)]
    );
    let logged: (String, String, i64) =
        sqlx::query_as("SELECT actor, source, count FROM almanac.audit_log WHERE id = $1")
            .bind(report.audit_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(logged, ("ops".into(), "api".into(), 1_493));
}

/// Selecting what a bulk action acts on walks the status's partial index,
/// never the whole table: on 200,000 done jobs, the dead, cancelled, ready
/// and running ones of a kind are found without a sequential scan.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn selecting_a_bulk_action_uses_an_index_on_a_large_table(pool: PgPool) {
    sqlx::raw_sql(
        "INSERT INTO almanac.jobs (kind, status, attempts, finished_at)
           SELECT 'kind' || (g % 20), 'done', 1, now() - (g || ' seconds')::interval
             FROM generate_series(1, 200000) g;
         INSERT INTO almanac.jobs (kind, status, attempts, finished_at, last_error)
           SELECT 'kind' || (g % 5), s, 5, now(), 'error ' || (g % 3)
             FROM generate_series(1, 300) g, unnest(ARRAY['dead', 'cancelled']) s;
         INSERT INTO almanac.jobs (kind) SELECT 'kind' || (g % 20) FROM generate_series(1, 500) g;
         ANALYZE almanac.jobs;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let filter = Filter {
        kind: Some("kind3".into()),
        error_like: Some("error 1".into()),
        older_than: Some(std::time::Duration::from_secs(0)),
        ..Filter::default()
    };
    let mut bad = Vec::new();
    for status in [
        JobStatus::Dead,
        JobStatus::Cancelled,
        JobStatus::Ready,
        JobStatus::Running,
    ] {
        let plan: serde_json::Value = bulk::select_query("EXPLAIN (FORMAT JSON) ", status, &filter)
            .build_query_scalar()
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        if plan.to_string().contains("\"Seq Scan\"") {
            bad.push(format!("{status}: {plan}"));
        }
    }
    assert!(bad.is_empty(), "sequential scans:\n{}", bad.join("\n"));
    // The check can fail: every done job of a kind has no index of its own.
    let plan: serde_json::Value = bulk::select_query(
        "EXPLAIN (FORMAT JSON) ",
        JobStatus::Done,
        &Filter {
            kind: Some("kind3".into()),
            ..Filter::default()
        },
    )
    .build_query_scalar()
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert!(plan.to_string().contains("\"Seq Scan\""), "{plan}");
}
