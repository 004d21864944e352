//! Job priorities (issue #23, item 4) against a real PostgreSQL: the claim
//! takes a kind's due jobs by `run_at - priority * PRIORITY_STEP`, which
//! bounds how long a low one waits; every enqueue path sets the priority
//! (the CLI, a schedule's key, SQL) and every place a job is shown shows it.

use std::collections::HashSet;
use std::time::Duration;

use almanac::queue::{self, Claim, Job, NewJob, PRIORITY_STEP};
use almanac::scheduler::spec::{load_sources, Schedule};
use almanac::telemetry::Tracer;
use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::harness::{self, count, text};

const LEASE: Duration = Duration::from_secs(30);

async fn db_now(pool: &PgPool) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT now()")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn minutes(m: i64) -> chrono::Duration {
    chrono::Duration::minutes(m)
}

async fn claim(pool: &PgPool, kinds: &[&str], limit: i64) -> Vec<Job> {
    let kinds: Vec<String> = kinds.iter().map(|k| k.to_string()).collect();
    queue::claim(
        pool,
        &Claim {
            kinds: &kinds,
            limit,
            lease: LEASE,
        },
    )
    .await
    .unwrap()
}

/// Claims of one job at a time until none is left: the ids in claim order.
async fn claim_one_by_one(pool: &PgPool, kinds: &[&str]) -> Vec<i64> {
    let mut out = Vec::new();
    loop {
        let got = claim(pool, kinds, 1).await;
        assert!(got.len() <= 1);
        match got.first() {
            Some(job) => out.push(job.id),
            None => return out,
        }
    }
}

async fn enqueue(pool: &PgPool, kind: &str, run_at: DateTime<Utc>, priority: i16) -> i64 {
    let mut conn = pool.acquire().await.unwrap();
    queue::enqueue(
        &mut conn,
        &NewJob::new(kind).run_at(run_at).priority(priority),
    )
    .await
    .unwrap()
    .id()
}

/// The claim's order key of a job: as if due `priority` steps earlier.
fn order_key(job: &Job) -> (DateTime<Utc>, i64) {
    let step = chrono::Duration::from_std(PRIORITY_STEP).unwrap();
    (job.run_at - step * i32::from(job.priority), job.id)
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn claims_take_the_highest_priority_first_then_the_earliest_due(pool: PgPool) {
    let now = db_now(&pool).await;
    let t = now - minutes(1);
    // One kind, all due at once: 9, 5, then 0.
    let p0 = enqueue(&pool, "mail", t, 0).await;
    let p5 = enqueue(&pool, "mail", t, 5).await;
    let p9 = enqueue(&pool, "mail", t, 9).await;
    assert_eq!(claim_one_by_one(&pool, &["mail"]).await, vec![p9, p5, p0]);

    // Equal priorities keep `(run_at, id)` order, whatever the insert order.
    let later = enqueue(&pool, "sms", now - minutes(2), 3).await;
    let tie_a = enqueue(&pool, "sms", now - minutes(3), 3).await;
    let tie_b = enqueue(&pool, "sms", now - minutes(3), 3).await;
    let earliest = enqueue(&pool, "sms", now - minutes(4), 3).await;
    assert_eq!(
        claim_one_by_one(&pool, &["sms"]).await,
        vec![earliest, tie_a, tie_b, later]
    );

    // Across kinds the order key is compared too: a priority-9 job due a
    // minute ago (as if due 46 minutes ago) comes before a priority-0 job
    // of another kind due 30 minutes ago, which comes before a priority-2
    // job due 15 minutes ago (as if 25).
    let a0 = enqueue(&pool, "a", now - minutes(30), 0).await;
    let b9 = enqueue(&pool, "b", now - minutes(1), 9).await;
    let b2 = enqueue(&pool, "b", now - minutes(15), 2).await;
    let a4 = enqueue(&pool, "a", now - minutes(2), 4).await; // as if 22
    assert_eq!(
        claim_one_by_one(&pool, &["a", "b"]).await,
        vec![b9, a0, b2, a4]
    );
    // And a claim of several takes the first of that order.
    for (kind, run_at, p) in [
        ("a", now - minutes(30), 0),
        ("b", now - minutes(1), 9),
        ("b", now - minutes(15), 2),
        ("a", now - minutes(2), 4),
    ] {
        enqueue(&pool, kind, run_at, p).await;
    }
    let two: HashSet<(String, i16)> = claim(&pool, &["a", "b"], 2)
        .await
        .into_iter()
        .map(|j| (j.kind, j.priority))
        .collect();
    assert_eq!(
        two,
        HashSet::from([("b".to_string(), 9), ("a".to_string(), 0)])
    );
}

/// The bound `PRIORITY_STEP` states: a job of priority 0 due at T is never
/// passed by a priority-9 job that became due more than 9 steps (45 min)
/// after it, and is passed by one due within them.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_low_priority_job_waits_no_longer_than_the_documented_bound(pool: PgPool) {
    assert_eq!(PRIORITY_STEP, Duration::from_secs(5 * 60));
    let now = db_now(&pool).await;
    let t = now - minutes(50);

    // Due 46 minutes after T: behind the old job.
    let old = enqueue(&pool, "late", t, 0).await;
    let hot = enqueue(&pool, "late", t + minutes(46), 9).await;
    assert_eq!(claim_one_by_one(&pool, &["late"]).await, vec![old, hot]);

    // Due 40 minutes after T: it passes.
    let old = enqueue(&pool, "soon", t, 0).await;
    let hot = enqueue(&pool, "soon", t + minutes(40), 9).await;
    assert_eq!(claim_one_by_one(&pool, &["soon"]).await, vec![hot, old]);

    // Exactly at the bound the keys are equal and the older id goes first.
    let old = enqueue(&pool, "edge", t, 0).await;
    let hot = enqueue(&pool, "edge", t + minutes(45), 9).await;
    assert_eq!(claim_one_by_one(&pool, &["edge"]).await, vec![old, hot]);

    // Each step is worth its share: priority 4 due at T + 19 min passes a
    // priority 0 due at T, and priority 4 due at T + 21 min does not.
    let old = enqueue(&pool, "mid", t, 0).await;
    let four = enqueue(&pool, "mid", t + minutes(21), 4).await;
    let also = enqueue(&pool, "mid", t + minutes(19), 4).await;
    assert_eq!(
        claim_one_by_one(&pool, &["mid"]).await,
        vec![also, old, four]
    );
}

/// `n` due jobs of `kind` with priorities 0..9 and due times spread over
/// two hours, in one statement.
async fn backlog(pool: &PgPool, kind: &str, n: i64) {
    sqlx::query(
        "INSERT INTO almanac.jobs (kind, run_at, priority)
         SELECT $1, now() - interval '1 minute' - ((g * 37) % 120) * interval '1 minute',
                (g * 7) % 10
         FROM generate_series(1, $2) AS g",
    )
    .bind(kind)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_mixed_backlog_drains_exactly_once_in_order(pool: PgPool) {
    backlog(&pool, "mixed", 2_000).await;
    // One claimer, batches of 50: each batch is the next 50 of the order,
    // so every key of a batch is at or after every key of the batch before.
    let mut seen = HashSet::new();
    let mut last: Option<(DateTime<Utc>, i64)> = None;
    let mut batches = 0;
    loop {
        let mut batch = claim(&pool, &["mixed"], 50).await;
        if batch.is_empty() {
            break;
        }
        batches += 1;
        batch.sort_by_key(order_key);
        let first = order_key(&batch[0]);
        if let Some(last) = last {
            assert!(
                last <= first,
                "batch {batches} starts at {first:?}, before the previous batch's last {last:?}"
            );
        }
        last = Some(order_key(batch.last().unwrap()));
        for job in &batch {
            assert!(seen.insert(job.id), "job {} claimed twice", job.id);
        }
    }
    assert_eq!(seen.len(), 2_000);
    assert_eq!(batches, 40);

    // Four claimers at once over another 2,000: each job exactly once.
    backlog(&pool, "mixed", 2_000).await;
    let claimers: Vec<_> = (0..4)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut ids = Vec::new();
                loop {
                    let batch = claim(&pool, &["mixed"], 25).await;
                    if batch.is_empty() {
                        return ids;
                    }
                    ids.extend(batch.iter().map(|j| j.id));
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for c in claimers {
        all.extend(c.await.unwrap());
    }
    let unique: HashSet<i64> = all.iter().copied().collect();
    assert_eq!((all.len(), unique.len()), (2_000, 2_000));
    assert!(unique.is_disjoint(&seen));
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE status <> 'running' OR attempts <> 1"
        )
        .await,
        0
    );
}

/// Rows the scans of `almanac.jobs` (its table or indexes) under `node`
/// returned, over all their loops.
fn jobs_rows_read(node: &serde_json::Value) -> i64 {
    let on_jobs = node["Relation Name"] == "jobs"
        || node["Index Name"]
            .as_str()
            .is_some_and(|i| i.starts_with("jobs_"));
    let own = if on_jobs
        && node["Node Type"]
            .as_str()
            .is_some_and(|t| t.ends_with("Scan"))
    {
        node["Actual Rows"].as_i64().unwrap_or(0) * node["Actual Loops"].as_i64().unwrap_or(0)
    } else {
        0
    };
    own + node["Plans"]
        .as_array()
        .into_iter()
        .flatten()
        .map(jobs_rows_read)
        .sum::<i64>()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_claim_reads_a_bounded_number_of_buffers_with_priorities_in_a_100k_backlog(pool: PgPool) {
    // 100,000 due jobs of one kind, 1,000 of them with priorities 1..9,
    // and another kind's 20 due jobs.
    sqlx::raw_sql(
        "SET session_replication_role = replica;
         INSERT INTO almanac.jobs (kind, run_at, priority)
             SELECT 'busy', now() - interval '2 hours' + g * interval '50 milliseconds',
                    CASE WHEN g % 100 = 0 THEN 1 + (g / 100) % 9 ELSE 0 END
             FROM generate_series(1, 100000) AS g;
         INSERT INTO almanac.jobs (kind, run_at)
             SELECT 'quiet', now() - g * interval '1 second' FROM generate_series(1, 20) AS g;
         SET session_replication_role = origin;
         ANALYZE almanac.jobs;",
    )
    .execute(&pool)
    .await
    .unwrap();
    for (kinds, n) in [("{busy}", 1), ("{busy,quiet}", 2)] {
        for (mode, buffers, plan) in harness::claim_buffers(&pool, kinds).await {
            // Per kind, at most 10 rows from each of its ten walks (one in
            // due order, one per priority) and one probe of the priority
            // index; then the 10 claimed rows by primary key: whatever the
            // backlog. (About 90 of those rows lie on heap pages of their
            // own and are locked: some 400 buffers in all. A sort of the
            // kind's ready rows reads every one of its 100,000.)
            let read = jobs_rows_read(&plan[0]["Plan"]);
            assert!(
                read <= n * (10 * 10 + 1) + 10,
                "{kinds} {mode}: {read} rows of almanac.jobs read for a claim of 10:\n{plan:#}"
            );
            assert!(
                buffers < 600,
                "{kinds} {mode}: {buffers} buffers for a claim of 10:\n{plan:#}"
            );
            let mut scans = Vec::new();
            harness::seq_scans(&plan[0]["Plan"], &mut scans);
            assert!(!scans.contains(&"jobs".to_string()), "{mode}: {plan:#}");
        }
    }
    // And the claim: the ten highest keys, priority 9 ones first.
    let got = claim(&pool, &["busy"], 10).await;
    let best: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM almanac.jobs WHERE kind = 'busy' AND status = 'running'
         ORDER BY run_at - priority * interval '5 minutes', id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let expected: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM almanac.jobs WHERE kind = 'busy'
         ORDER BY run_at - priority * interval '5 minutes', id LIMIT 10",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(got.len(), 10);
    assert_eq!(best, expected);
    // Every prioritized job's key is earlier than any priority-0 one here.
    assert!(got.iter().all(|j| j.priority > 0), "{got:?}");
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn enqueue_takes_a_priority_and_every_view_of_the_job_shows_it(pool: PgPool) {
    for (value, says) in [
        (
            "10",
            "priority is 10; it must be 0 (the default) to 9, higher first",
        ),
        (
            "-1",
            "priority is -1; it must be 0 (the default) to 9, higher first",
        ),
        (
            "high",
            "priority is `high`; it must be a whole number, 0 (the default) to 9, higher first",
        ),
    ] {
        let out = harness::operator(&pool, &["enqueue", "mail", "--priority", value]);
        assert!(!out.status.success(), "--priority {value} was accepted");
        let err = text(&out.stderr);
        assert!(err.contains(says), "--priority {value}: {err}");
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM almanac.jobs").await, 0);

    let out = harness::operator(&pool, &["enqueue", "mail", "--priority", "7"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let id: i64 = text(&out.stdout).parse().unwrap();
    let plain = harness::operator(&pool, &["enqueue", "mail"]);
    let plain: i64 = text(&plain.stdout).parse().unwrap();
    let stored: Vec<(i64, i16)> =
        sqlx::query_as("SELECT id, priority FROM almanac.jobs ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(stored, vec![(id, 7), (plain, 0)]);

    // From SQL, as the README shows: the column, its range checked.
    let from_sql: i64 = sqlx::query_scalar(
        "INSERT INTO almanac.jobs (kind, payload, priority) VALUES ('mail', '{}', 4) RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let bad = sqlx::query("INSERT INTO almanac.jobs (kind, priority) VALUES ('mail', 10)")
        .execute(&pool)
        .await
        .unwrap_err()
        .to_string();
    assert!(bad.contains("jobs_priority_check"), "{bad}");

    // `jobs show`, text and JSON.
    let show = text(&harness::operator(&pool, &["jobs", "show", &id.to_string()]).stdout);
    assert!(show.lines().any(|l| l == "priority:        7"), "{show}");
    let json: serde_json::Value = serde_json::from_str(&text(
        &harness::operator(&pool, &["jobs", "show", &id.to_string(), "--json"]).stdout,
    ))
    .unwrap();
    assert_eq!(json["priority"], 7);
    // `jobs list`, text and JSON (newest first).
    let list = text(&harness::operator(&pool, &["jobs", "list", "--kind", "mail"]).stdout);
    let mut lines = list.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    let column = header.iter().position(|h| *h == "PRI").expect(&list);
    let shown: Vec<(String, String)> = lines
        .map(|l| {
            let cells: Vec<&str> = l.split_whitespace().collect();
            (cells[0].to_string(), cells[column].to_string())
        })
        .collect();
    assert_eq!(
        shown,
        vec![
            (from_sql.to_string(), "4".to_string()),
            (plain.to_string(), "0".to_string()),
            (id.to_string(), "7".to_string()),
        ]
    );
    let listed: Vec<i64> =
        text(&harness::operator(&pool, &["jobs", "list", "--kind", "mail", "--json"]).stdout)
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["priority"]
                    .as_i64()
                    .unwrap()
            })
            .collect();
    assert_eq!(listed, vec![4, 0, 7]);

    // The dashboard's job page and list, and the JSON API.
    let server = crate::api::Server::start(&pool, false, false).await;
    let page = server.get(&format!("/jobs/{id}")).await;
    assert_eq!(page.status, 200);
    assert!(
        page.body.contains(r#"<dd id="priority">7</dd>"#),
        "{}",
        page.body
    );
    let list = server.get("/jobs?kind=mail").await;
    assert!(
        list.body.contains(r#"<td class="num priority">7</td>"#),
        "{}",
        list.body
    );
    let api = server.get(&format!("/api/v1/jobs/{id}")).await.json();
    assert_eq!(api["priority"], 7);
    let api = server.get("/api/v1/jobs?kind=mail").await.json();
    let priorities: Vec<i64> = api["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["priority"].as_i64().unwrap())
        .collect();
    assert_eq!(priorities, vec![4, 0, 7]);
    server.stop().await;
}

fn schedules(text: &str) -> Vec<Schedule> {
    load_sources(&[("p.toml".into(), text.to_string())]).unwrap()
}

/// Priorities of the jobs of `schedule`, by source of the ledger row.
async fn emitted(pool: &PgPool, schedule: &str) -> Vec<(String, i16)> {
    sqlx::query_as(
        "SELECT r.source, j.priority FROM almanac.jobs j
         JOIN almanac.schedule_runs r ON r.schedule = j.schedule AND r.logical_run = j.logical_run
         WHERE j.schedule = $1 ORDER BY j.id",
    )
    .bind(schedule)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn every_job_a_schedule_emits_carries_its_priority(pool: PgPool) {
    use almanac::scheduler::backfill::{self, Range};
    use almanac::scheduler::controls;
    use almanac::scheduler::reprocess::{self, Reprocess};
    use almanac::scheduler::ticker::Ticker;

    let text = "[hot]\ncron = \"*/5 * * * *\"\npriority = 7\n\n[cold]\ncron = \"*/5 * * * *\"\n";
    let mut conn = pool.acquire().await.unwrap();
    let mut ticker = Ticker::load(&mut conn, schedules(text), Duration::from_secs(60))
        .await
        .unwrap();
    let first = ticker.next_wake().unwrap();
    // A tick on time, then one 12 minutes later (two runs caught up).
    let on_time = ticker
        .tick(&mut conn, first + chrono::Duration::seconds(1))
        .await
        .unwrap();
    assert_eq!(on_time.emitted, 2);
    ticker.tick(&mut conn, first + minutes(12)).await.unwrap();

    let all = schedules(text);
    let hot = all.iter().find(|s| s.name == "hot").unwrap();
    assert_eq!(hot.priority, 7);
    // A trigger of a past run and a backfill of the hour before the first.
    let before = first - minutes(30);
    let run = hot.next_after(before).unwrap();
    controls::trigger(&mut conn, hot, Some(&run.logical_run), &Tracer::off())
        .await
        .unwrap();
    let range = Range {
        from: first - minutes(60),
        to: first - minutes(40),
        dry_run: false,
        allow_future: false,
    };
    backfill::backfill(&mut conn, hot, range, |_, _| {})
        .await
        .unwrap();
    // A reprocess of a dead run.
    let dead: i64 = sqlx::query_scalar(
        "UPDATE almanac.jobs SET status = 'dead', finished_at = now()
         WHERE id = (SELECT min(id) FROM almanac.jobs WHERE schedule = 'hot') RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let dead_run: String = sqlx::query_scalar("SELECT logical_run FROM almanac.jobs WHERE id = $1")
        .bind(dead)
        .fetch_one(&pool)
        .await
        .unwrap();
    let planned = hot
        .runs_between(first - minutes(1), first + minutes(1))
        .into_iter()
        .find(|r| r.logical_run == dead_run)
        .unwrap();
    let replaced = reprocess::replace(
        &mut conn,
        hot,
        Reprocess::Failed,
        &[&planned],
        &almanac::telemetry::Tracer::off(),
    )
    .await
    .unwrap();
    assert_eq!(replaced.dead, 1);

    let hot_jobs = emitted(&pool, "hot").await;
    let sources: HashSet<&str> = hot_jobs.iter().map(|(s, _)| s.as_str()).collect();
    for source in ["tick", "catchup", "trigger", "backfill"] {
        assert!(sources.contains(source), "no {source} job: {hot_jobs:?}");
    }
    // tick, 2 catch-up, trigger, 4 backfilled, the reprocessed run's new job.
    assert_eq!(hot_jobs.len(), 1 + 2 + 1 + 4 + 1, "{hot_jobs:?}");
    assert!(hot_jobs.iter().all(|(_, p)| *p == 7), "{hot_jobs:?}");
    let cold_jobs = emitted(&pool, "cold").await;
    assert_eq!(cold_jobs.len(), 3, "{cold_jobs:?}");
    assert!(cold_jobs.iter().all(|(_, p)| *p == 0), "{cold_jobs:?}");

    // The dashboard and the API trigger the schedule as synced to the
    // database (migration 0112): its jobs carry the priority too.
    use almanac::scheduler::history;
    let stored = history::synced_one(&mut conn, "hot")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.priority, 7);
    let stored = stored.schedule().unwrap();
    let earlier = stored.next_after(first - minutes(90)).unwrap();
    controls::trigger(
        &mut conn,
        &stored,
        Some(&earlier.logical_run),
        &Tracer::off(),
    )
    .await
    .unwrap();
    let hot_jobs = emitted(&pool, "hot").await;
    assert_eq!(hot_jobs.len(), 10, "{hot_jobs:?}");
    assert!(hot_jobs.iter().all(|(_, p)| *p == 7), "{hot_jobs:?}");
    let cold = history::synced_one(&mut conn, "cold")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cold.priority, 0);
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_schedule_with_a_bad_priority_is_refused_naming_file_schedule_and_value(pool: PgPool) {
    let dir = std::env::temp_dir().join(format!(
        "almanac-priority-{}-{}",
        std::process::id(),
        pool.connect_options().get_database().unwrap()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for (value, says) in [
        ("10", "priority is 10; it must be 0 (the default) to 9"),
        ("-1", "priority is -1; it must be 0 (the default) to 9"),
        (
            "\"high\"",
            "priority is \"high\"; it must be a whole number",
        ),
    ] {
        let file = dir.join("jobs.toml");
        std::fs::write(
            &file,
            format!(
                "[fine]\ncron = \"@daily\"\n\n[urgent]\ncron = \"@daily\"\npriority = {value}\n"
            ),
        )
        .unwrap();
        let out = harness::operator(&pool, &["schedules", "check", dir.to_str().unwrap()]);
        assert_eq!(
            out.status.code(),
            Some(1),
            "priority = {value} was accepted"
        );
        let err = text(&out.stderr);
        assert!(
            err.contains(&format!("{}:6: schedule `urgent`: {says}", file.display())),
            "priority = {value}: {err}"
        );
    }
    std::fs::write(
        dir.join("jobs.toml"),
        "[urgent]\ncron = \"@daily\"\npriority = 9\n",
    )
    .unwrap();
    let out = harness::operator(&pool, &["schedules", "check", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}
