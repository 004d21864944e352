//! `almanac run` processes: leader failover after SIGKILL with no logical run
//! missing or doubled, SIGHUP reloads, bad schedule files at start, and a
//! leader with nothing enabled that does not spin, a schedule disabled by
//! reload, and one paused and resumed by the commands across a failover. (Frozen, terminated,
//! stopped and clock-skewed leaders: tests/it/leader_faults.rs.)

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::harness::scheduler_proc::{db_now, dir_with, runs_after, Proc};
use crate::harness::{self, count, eventually};

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_standby_takes_over_from_a_killed_leader_and_no_run_is_missing_or_doubled(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = dir_with(
        "failover",
        &[(
            "fast.toml",
            "[every-2s]\ncron = \"*/2 * * * * *\"\nkind = \"tick\"\n",
        )],
    );
    let procs = [Proc::start(&url, &dir), Proc::start(&url, &dir)];
    eventually("a leader", Duration::from_secs(30), || async {
        procs.iter().any(|p| p.said("became scheduler leader"))
    })
    .await;
    let leader = procs
        .iter()
        .position(|p| p.said("became scheduler leader"))
        .unwrap();
    let standby = 1 - leader;
    eventually(
        "three runs from the first leader",
        Duration::from_secs(30),
        || async { count(&pool, "SELECT count(*) FROM almanac.schedule_runs").await >= 3 },
    )
    .await;
    assert!(procs[standby].said("another scheduler leads; standing by"));

    let [a, b] = procs;
    let (leader, standby) = if leader == 0 { (a, b) } else { (b, a) };
    leader.signal(libc::SIGKILL);
    let killed_at: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(leader.exit_code().await, None, "killed by a signal");

    eventually("the standby to lead", Duration::from_secs(15), || async {
        standby.said("became scheduler leader")
    })
    .await;
    eventually("runs after the failover", Duration::from_secs(30), || async {
        let after: i64 = sqlx::query_scalar("SELECT count(*) FROM almanac.schedule_runs WHERE fire_at > $1 + interval '4 seconds'")
            .bind(killed_at)
            .fetch_one(&pool)
            .await
            .unwrap();
        after >= 2
    })
    .await;
    standby.signal(libc::SIGTERM);
    assert_eq!(standby.exit_code().await, Some(0));

    let fires: Vec<DateTime<Utc>> =
        sqlx::query_scalar("SELECT fire_at FROM almanac.schedule_runs ORDER BY fire_at")
            .fetch_all(&pool)
            .await
            .unwrap();
    let span = (*fires.last().unwrap() - fires[0]).num_seconds();
    assert_eq!(
        fires.len() as i64,
        span / 2 + 1,
        "every 2-second run from first to last, once: {fires:?}"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.schedule_runs WHERE outcome <> 'emitted'"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(DISTINCT logical_run) FROM almanac.jobs"
        )
        .await,
        fires.len() as i64
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.jobs").await,
        fires.len() as i64
    );
    // On-time runs are emitted promptly (the median, to tolerate a loaded machine).
    let median: f64 = sqlx::query_scalar(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM recorded_at - fire_at))::float8
         FROM almanac.schedule_runs WHERE source = 'tick'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(median < 1.0, "median emission delay {median:.3}s");
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn sighup_reloads_schedules_and_a_bad_file_keeps_the_old_set(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = dir_with(
        "reload",
        &[("a.toml", "[first]\ncron = \"*/2 * * * * *\"\n")],
    );
    let proc = Proc::start(&url, &dir);
    eventually(
        "a run of the first schedule",
        Duration::from_secs(30),
        || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.schedule_runs WHERE schedule = 'first'",
            )
            .await
                >= 1
        },
    )
    .await;

    std::fs::write(
        dir.join("b.toml"),
        "[second]\ncron = \"*/2 * * * * *\"\ntimezone = \"Nowhere/Land\"\n",
    )
    .unwrap();
    proc.signal(libc::SIGHUP);
    eventually(
        "the reload to be rejected",
        Duration::from_secs(15),
        || async { proc.said("schedule reload rejected") },
    )
    .await;
    assert!(proc.said("b.toml:3: schedule `second`: unknown time zone `Nowhere/Land`"));
    let before = count(
        &pool,
        "SELECT count(*) FROM almanac.schedule_runs WHERE schedule = 'first'",
    )
    .await;
    eventually(
        "the old set to keep running",
        Duration::from_secs(15),
        || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.schedule_runs WHERE schedule = 'first'",
            )
            .await
                > before
        },
    )
    .await;
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.schedules WHERE name = 'second'"
        )
        .await,
        0
    );

    std::fs::write(dir.join("b.toml"), "[second]\ncron = \"*/2 * * * * *\"\n").unwrap();
    proc.signal(libc::SIGHUP);
    eventually(
        "the second schedule to run",
        Duration::from_secs(15),
        || async {
            count(
                &pool,
                "SELECT count(*) FROM almanac.schedule_runs WHERE schedule = 'second'",
            )
            .await
                >= 1
        },
    )
    .await;
    proc.signal(libc::SIGTERM);
    assert_eq!(proc.exit_code().await, Some(0));
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_bad_schedule_file_stops_the_start_with_file_and_line_and_applies_nothing(pool: PgPool) {
    let url = harness::database_url(&pool);
    let good = "[ok]\ncron = \"@daily\"\n";
    let bad = "[nightly]\ncron = \"30 2 * * *\"\ncatchup = \"sometimes\"\n";
    let dir = dir_with("badfile", &[("a.toml", good), ("b.toml", bad)]);
    for args in [vec!["run", "--schedules"], vec!["schedules", "check"]] {
        let out = harness::almanac()
            .args(&args)
            .arg(&dir)
            .env("DATABASE_URL", &url)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        let expected = format!(
            "error: {}:3: schedule `nightly`: catchup is `sometimes`; use all, latest or none",
            dir.join("b.toml").display()
        );
        assert!(err.contains(&expected), "{args:?}: {err}");
        assert!(err.contains("nothing from them was applied"), "{err}");
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.schedules").await,
        0
    );
}

#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_leader_with_nothing_enabled_sleeps_instead_of_spinning(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = dir_with(
        "idle",
        &[(
            "off.toml",
            "[off]\ncron = \"* * * * * *\"\nenabled = false\n",
        )],
    );
    let proc = Proc::start(&url, &dir);
    eventually("a leader", Duration::from_secs(30), || async {
        proc.said("became scheduler leader")
    })
    .await;
    eventually("the idle notice", Duration::from_secs(15), || async {
        proc.said("no enabled schedule will fire")
    })
    .await;
    // Transactions committed in this database over a few seconds: a busy
    // loop makes thousands; a sleeping leader a heartbeat every few seconds.
    let commits = || async {
        let mut conn = pool.acquire().await.unwrap();
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut *conn)
            .await
            .unwrap();
        let n: i64 = sqlx::query_scalar(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        n
    };
    let before = commits().await;
    let started = std::time::Instant::now();
    // Wait for a few heartbeats' worth of time by watching the database's
    // clock move (not a sleep that synchronises anything).
    let t0 = db_now(&pool).await;
    eventually(
        "five seconds of database time",
        Duration::from_secs(30),
        || async { db_now(&pool).await - t0 >= chrono::Duration::seconds(5) },
    )
    .await;
    // Statistics reach pg_stat_database within a second or so of a backend's
    // activity (PostgreSQL 15 flushes them at most every second).
    let t1 = db_now(&pool).await;
    eventually(
        "statistics to be flushed",
        Duration::from_secs(30),
        || async { db_now(&pool).await - t1 >= chrono::Duration::seconds(2) },
    )
    .await;
    let after = commits().await;
    let per_second = (after - before) as f64 / started.elapsed().as_secs_f64();
    assert!(
        per_second < 20.0,
        "{} commits in {:?}: the idle leader is spinning",
        after - before,
        started.elapsed()
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM almanac.schedule_runs").await,
        0
    );
    proc.signal(libc::SIGTERM);
    assert_eq!(proc.exit_code().await, Some(0));
}

/// The real scheduler, reloaded with a schedule disabled and enabled again
/// (SIGHUP): the runs that fell due in between are recorded
/// `skipped_disabled` with no job; every other second is emitted once, the
/// first after the re-enable on time; no second is missing or doubled.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_schedule_disabled_and_reenabled_by_reload_skips_what_fell_due_meanwhile(pool: PgPool) {
    let url = harness::database_url(&pool);
    let schedule = |enabled: bool| format!("[tick]\ncron = \"* * * * * *\"\nenabled = {enabled}\n");
    let dir = dir_with("disabled", &[("a.toml", &schedule(true))]);
    let proc = Proc::start(&url, &dir);
    let rows = "SELECT count(*) FROM almanac.schedule_runs WHERE schedule = 'tick'";
    eventually("runs while enabled", Duration::from_secs(30), || async {
        count(&pool, rows).await >= 2
    })
    .await;

    std::fs::write(dir.join("a.toml"), schedule(false)).unwrap();
    proc.signal(libc::SIGHUP);
    let spell =
        "SELECT disabled_at, enabled_at FROM almanac.schedule_disabled WHERE schedule = 'tick'";
    let read_spell = || async {
        sqlx::query_as::<_, (DateTime<Utc>, Option<DateTime<Utc>>)>(spell)
            .fetch_optional(&pool)
            .await
            .unwrap()
    };
    eventually(
        "the disable to be synced",
        Duration::from_secs(15),
        || async { read_spell().await.is_some() },
    )
    .await;
    let (disabled_at, _) = read_spell().await.unwrap();
    eventually("four seconds disabled", Duration::from_secs(15), || async {
        db_now(&pool).await > disabled_at + chrono::Duration::seconds(4)
    })
    .await;

    std::fs::write(dir.join("a.toml"), schedule(true)).unwrap();
    proc.signal(libc::SIGHUP);
    eventually(
        "the re-enable to be synced",
        Duration::from_secs(15),
        || async { read_spell().await.is_some_and(|(_, until)| until.is_some()) },
    )
    .await;
    let enabled_at = read_spell().await.unwrap().1.unwrap();
    eventually(
        "runs after the re-enable",
        Duration::from_secs(15),
        || async {
            runs_after(&pool, "tick", enabled_at + chrono::Duration::seconds(2)).await >= 1
        },
    )
    .await;
    proc.signal(libc::SIGTERM);
    assert_eq!(proc.exit_code().await, Some(0));

    let (in_spell, skipped, with_job, seconds): (i64, i64, i64, i64) = sqlx::query_as(
        r#"
        SELECT count(*), count(*) FILTER (WHERE outcome = 'skipped_disabled'),
               count(job_id),
               (SELECT count(*) FROM generate_series(date_trunc('second', $1), $2, '1 second') t
                 WHERE t >= $1 AND t < $2)
          FROM almanac.schedule_runs
         WHERE schedule = 'tick' AND fire_at >= $1 AND fire_at < $2
        "#,
    )
    .bind(disabled_at)
    .bind(enabled_at)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(seconds >= 4, "{seconds}");
    assert_eq!((in_spell, skipped, with_job), (seconds, seconds, 0));
    // Every second from the first run to the last is in the ledger once;
    // outside the spell, emitted with one job, none early.
    let (rows, span, distinct_jobs, bad): (i64, i64, i64, i64) = sqlx::query_as(
        r#"
        SELECT count(*),
               extract(epoch FROM max(fire_at) - min(fire_at))::bigint + 1,
               (SELECT count(DISTINCT logical_run) FROM almanac.jobs WHERE schedule = 'tick'),
               count(*) FILTER (WHERE (fire_at < $1 OR fire_at >= $2)
                                  AND (outcome <> 'emitted' OR job_id IS NULL OR recorded_at < fire_at))
          FROM almanac.schedule_runs WHERE schedule = 'tick'
        "#,
    )
    .bind(disabled_at)
    .bind(enabled_at)
    .fetch_one(&pool)
    .await
    .unwrap();
    let first_after: String = sqlx::query_scalar(
        "SELECT source FROM almanac.schedule_runs WHERE schedule = 'tick' AND fire_at >= $1 ORDER BY fire_at LIMIT 1",
    )
    .bind(enabled_at)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        first_after, "tick",
        "the first run after the re-enable is on time"
    );
    assert_eq!(rows, span, "every second once");
    assert_eq!(bad, 0, "runs outside the spell not emitted, or early");
    assert_eq!(distinct_jobs, rows - seconds);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM almanac.jobs WHERE schedule = 'tick'"
        )
        .await,
        rows - seconds,
        "one job per emitted run"
    );
}

/// The real scheduler, paused and resumed by the commands while it leads,
/// with the leader SIGKILLed in between: from the second after the pause,
/// every run is recorded `skipped_paused` with no job, by the first leader
/// (no reload, no restart) and by the standby that takes over (the pause is
/// in the database); after the resume, runs are emitted again, the first on
/// time; no second is missing or doubled.
#[sqlx::test(migrator = "almanac::db::MIGRATOR")]
async fn a_pause_takes_effect_at_the_next_tick_and_survives_a_leader_change(pool: PgPool) {
    let url = harness::database_url(&pool);
    let dir = dir_with("paused", &[("a.toml", "[tick]\ncron = \"* * * * * *\"\n")]);
    let command = |args: &[&str]| {
        let out = harness::almanac()
            .args(args)
            .arg("--schedules")
            .arg(&dir)
            .env("DATABASE_URL", &url)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let first = Proc::start(&url, &dir);
    eventually("a leader", Duration::from_secs(30), || async {
        first.said("became scheduler leader")
    })
    .await;
    let second = Proc::start(&url, &dir);
    let rows = "SELECT count(*) FROM almanac.schedule_runs WHERE schedule = 'tick'";
    eventually("runs before the pause", Duration::from_secs(30), || async {
        count(&pool, rows).await >= 2
    })
    .await;

    command(&["schedules", "pause", "tick", "--note", "maintenance"]);
    let paused_at: DateTime<Utc> =
        sqlx::query_scalar("SELECT paused_at FROM almanac.schedule_pauses WHERE schedule = 'tick'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let skipped_after = |at: DateTime<Utc>| {
        let pool = &pool;
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM almanac.schedule_runs WHERE schedule = 'tick' \
                 AND outcome = 'skipped_paused' AND fire_at > $1",
            )
            .bind(at)
            .fetch_one(pool)
            .await
            .unwrap()
        }
    };
    eventually("paused runs recorded", Duration::from_secs(15), || async {
        skipped_after(paused_at).await >= 3
    })
    .await;
    first.signal(libc::SIGKILL);
    assert_eq!(first.exit_code().await, None, "killed by a signal");
    eventually("the standby to lead", Duration::from_secs(15), || async {
        second.said("became scheduler leader")
    })
    .await;
    let took_over = db_now(&pool).await;
    eventually(
        "paused runs recorded by the new leader",
        Duration::from_secs(15),
        || async { skipped_after(took_over + chrono::Duration::seconds(1)).await >= 2 },
    )
    .await;

    command(&["schedules", "resume", "tick"]);
    let resumed_at: DateTime<Utc> = sqlx::query_scalar(
        "SELECT resumed_at FROM almanac.schedule_pauses WHERE schedule = 'tick'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    eventually("runs after the resume", Duration::from_secs(15), || async {
        runs_after(&pool, "tick", resumed_at + chrono::Duration::seconds(2)).await >= 1
    })
    .await;
    second.signal(libc::SIGTERM);
    assert_eq!(second.exit_code().await, Some(0));

    // Inside the pause (from the second after it): skipped, no job.
    let (inside, skipped, with_job): (i64, i64, i64) = sqlx::query_as(
        r#"
        SELECT count(*), count(*) FILTER (WHERE outcome = 'skipped_paused'), count(job_id)
          FROM almanac.schedule_runs
         WHERE schedule = 'tick' AND fire_at >= $1 + interval '1 second' AND fire_at < $2
        "#,
    )
    .bind(paused_at)
    .bind(resumed_at)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(inside >= 5, "{inside}");
    assert_eq!((skipped, with_job), (inside, 0));
    // Every second once; from the second after the resume, emitted with a
    // job, the first on time.
    let after_resume = resumed_at + chrono::Duration::seconds(1);
    let (rows, span, bad_after): (i64, i64, i64) = sqlx::query_as(
        r#"
        SELECT count(*),
               extract(epoch FROM max(fire_at) - min(fire_at))::bigint + 1,
               count(*) FILTER (WHERE fire_at >= $1 AND (outcome <> 'emitted' OR job_id IS NULL))
          FROM almanac.schedule_runs WHERE schedule = 'tick'
        "#,
    )
    .bind(after_resume)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rows, span, "every second once");
    assert_eq!(bad_after, 0, "runs after the resume emitted");
    let first_after: String = sqlx::query_scalar(
        "SELECT source FROM almanac.schedule_runs WHERE schedule = 'tick' AND fire_at >= $1 ORDER BY fire_at LIMIT 1",
    )
    .bind(after_resume)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        first_after, "tick",
        "the first run after the resume is on time"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM (SELECT logical_run FROM almanac.jobs WHERE schedule = 'tick' \
             GROUP BY logical_run HAVING count(*) > 1) d"
        )
        .await,
        0
    );
}
