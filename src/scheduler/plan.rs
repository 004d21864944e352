//! Which runs to record, and how: pure decisions over an injected `now`.
//!
//! A run is **on time** while `now - fire_at <= grace`; it is emitted as a
//! `tick`. A run later than that was **missed** (the scheduler was down,
//! paused, or not leader) and goes through the schedule's catch-up policy as
//! `catchup`: `all` emits every missed run inside `catchup_window`; `latest`
//! emits only the most recent due run; `none` emits none. Missed runs that
//! are not emitted are still recorded, as `skipped_catchup`, so every logical
//! run is accounted for. Nothing is planned before the schedule's `start`
//! date, nor (for a schedule never run) before it was first synced.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::ledger::Cursor;
use super::spec::{Catchup, Schedule};
use super::timeline::Run;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Tick,
    Catchup,
    Backfill,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Tick => "tick",
            Source::Catchup => "catchup",
            Source::Backfill => "backfill",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Emit a job (unless the overlap rule skips it when recorded).
    Emit,
    SkipCatchup,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub run: Run,
    pub source: Source,
    pub decision: Decision,
}

/// The earliest instant the next run may fire at: just after the last
/// recorded run, or, for a schedule never run, its first sync; never before
/// its `start` date.
pub fn next_from(schedule: &Schedule, cursor: &Cursor) -> DateTime<Utc> {
    let from = match cursor.last_fire {
        Some(last) => last + chrono::Duration::microseconds(1),
        None => cursor.first_seen,
    };
    match schedule.start {
        Some(start) => from.max(schedule.timeline.start_of(start)),
        None => from,
    }
}

/// Runs from [`next_from`] up to and including `now`, at most `limit`, in order.
pub fn due_runs(
    schedule: &Schedule,
    cursor: &Cursor,
    now: DateTime<Utc>,
    limit: usize,
) -> Vec<Run> {
    runs_in(
        schedule,
        next_from(schedule, cursor),
        now + chrono::Duration::microseconds(1),
        limit,
    )
}

/// Runs with `from <= fire_at < to` on or after the `start` date, at most
/// `limit`, generated a day at a time so long ranges stay cheap.
pub fn runs_in(
    schedule: &Schedule,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    limit: usize,
) -> Vec<Run> {
    let mut out = Vec::new();
    let mut lo = from;
    while lo < to && out.len() < limit {
        let hi = (lo + chrono::Duration::days(31)).min(to);
        out.extend(
            schedule
                .timeline
                .runs_between(lo, hi)
                .into_iter()
                .filter(|r| schedule.start.is_none_or(|s| r.date >= s)),
        );
        lo = hi;
    }
    out.truncate(limit);
    out
}

/// Classifies due runs (from [`due_runs`]) as the module doc says.
/// `complete` says whether `runs` reaches `now` (it was not cut by a limit),
/// which `latest` needs to know which run is the most recent.
pub fn classify(
    schedule: &Schedule,
    runs: Vec<Run>,
    now: DateTime<Utc>,
    grace: Duration,
    complete: bool,
) -> Vec<Planned> {
    let grace = chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::MAX);
    let window =
        chrono::Duration::from_std(schedule.catchup_window).unwrap_or(chrono::Duration::MAX);
    let latest = if complete {
        runs.last().map(|r| r.fire_at)
    } else {
        None
    };
    runs.into_iter()
        .map(|run| {
            let late = now - run.fire_at;
            let (source, decision) = if late <= grace {
                (Source::Tick, Decision::Emit)
            } else if late > window {
                (Source::Catchup, Decision::SkipCatchup)
            } else {
                let emit = match schedule.catchup {
                    Catchup::All => true,
                    Catchup::Latest => latest == Some(run.fire_at),
                    Catchup::None => false,
                };
                (
                    Source::Catchup,
                    if emit {
                        Decision::Emit
                    } else {
                        Decision::SkipCatchup
                    },
                )
            };
            Planned {
                run,
                source,
                decision,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::spec::load_sources;

    fn schedule(extra: &str) -> Schedule {
        let text = format!("[s]\ncron = \"0 2 * * *\"\ntimezone = \"Asia/Seoul\"\n{extra}\n");
        load_sources(&[("s.toml".into(), text)]).unwrap().remove(0)
    }

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn decide(extra: &str, after: &str, now: &str) -> Vec<(String, &'static str, Decision)> {
        let s = schedule(extra);
        let now = at(now);
        let cursor = Cursor {
            last_fire: Some(at(after)),
            first_seen: at("2026-11-01T00:00:00Z"),
        };
        let runs = due_runs(&s, &cursor, now, 1000);
        classify(&s, runs, now, Duration::from_secs(60), true)
            .into_iter()
            .map(|p| (p.run.logical_run, p.source.as_str(), p.decision))
            .collect()
    }

    // Runs at 02:00 KST = 17:00Z the day before. Last emitted: 2026-03-01.
    // "Now" is 2026-03-05 17:00:30Z, thirty seconds after the 03-06 run.
    const AFTER: &str = "2026-02-28T17:00:00Z";
    const NOW: &str = "2026-03-05T17:00:30Z";

    #[test]
    fn all_emits_every_missed_run_in_the_window_and_the_on_time_one() {
        let plan = decide("catchup = \"all\"\ncatchup_window = \"4d\"", AFTER, NOW);
        use Decision::*;
        assert_eq!(
            plan,
            vec![
                ("2026-03-02".into(), "catchup", SkipCatchup), // missed by more than 4 days
                ("2026-03-03".into(), "catchup", Emit),
                ("2026-03-04".into(), "catchup", Emit),
                ("2026-03-05".into(), "catchup", Emit),
                ("2026-03-06".into(), "tick", Emit),
            ]
        );
    }

    #[test]
    fn latest_emits_only_the_most_recent_due_run() {
        use Decision::*;
        let plan = decide("catchup = \"latest\"", AFTER, "2026-03-05T16:00:00Z");
        assert_eq!(
            plan,
            vec![
                ("2026-03-02".into(), "catchup", SkipCatchup),
                ("2026-03-03".into(), "catchup", SkipCatchup),
                ("2026-03-04".into(), "catchup", SkipCatchup),
                ("2026-03-05".into(), "catchup", Emit),
            ]
        );
        // With an on-time run, that run is the latest: every missed one is skipped.
        let plan = decide("catchup = \"latest\"", AFTER, NOW);
        assert_eq!(plan.iter().filter(|p| p.2 == Emit).count(), 1);
        assert_eq!(
            plan.last().unwrap(),
            &("2026-03-06".to_string(), "tick", Emit)
        );
    }

    #[test]
    fn none_records_missed_runs_as_skipped_and_still_runs_on_time() {
        use Decision::*;
        let plan = decide("catchup = \"none\"", AFTER, NOW);
        assert_eq!(plan.len(), 5);
        assert!(plan[..4]
            .iter()
            .all(|p| p.2 == SkipCatchup && p.1 == "catchup"));
        assert_eq!(plan[4], ("2026-03-06".to_string(), "tick", Emit));
    }

    #[test]
    fn nothing_before_start_nor_before_a_new_schedule_was_first_synced() {
        let s = schedule("start = \"2026-03-04\"");
        let new = |first_seen: &str| Cursor {
            last_fire: None,
            first_seen: at(first_seen),
        };
        let names = |runs: Vec<Run>| runs.into_iter().map(|r| r.logical_run).collect::<Vec<_>>();
        let runs = due_runs(&s, &new("2026-01-01T00:00:00Z"), at(NOW), 100);
        assert_eq!(names(runs), vec!["2026-03-04", "2026-03-05", "2026-03-06"]);
        let runs = due_runs(&s, &new("2026-03-04T12:00:00Z"), at(NOW), 100);
        assert_eq!(names(runs)[0], "2026-03-05");
        // Once it has run (a backfill, say), the last run is the bound, not the first sync.
        let ran = Cursor {
            last_fire: Some(at("2026-03-03T17:00:00Z")),
            first_seen: at("2026-11-01T00:00:00Z"),
        };
        assert_eq!(
            names(due_runs(&s, &ran, at(NOW), 100)),
            vec!["2026-03-05", "2026-03-06"]
        );
    }
}
