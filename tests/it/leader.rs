//! `almanac run` processes: leader failover after SIGKILL with no logical run
//! missing or doubled, SIGHUP reloads, bad schedule files at start, and a
//! leader with nothing enabled that does not spin. (Frozen, terminated,
//! stopped and clock-skewed leaders: tests/it/leader_faults.rs.)

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::harness::scheduler_proc::{db_now, dir_with, Proc};
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
