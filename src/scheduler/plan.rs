//! Which runs to record, and how: pure decisions over an injected `now`.
//!
//! **Disabled is not missed.** A run that fell due while its schedule was
//! disabled (inside one of its disabled spells, [`Spell`], which every sync
//! of the definitions keeps) is recorded `skipped_disabled` and never
//! emitted, however late it is planned and whatever the catch-up policy;
//! `almanac backfill` fills it when wanted. A disabled schedule is not
//! planned at all: its runs are recorded when it is enabled again (until
//! then, [`super::backfill::Expected`] does not count them missing).
//!
//! **Paused is not missed either.** A run that fell due while its schedule
//! was paused (`almanac schedules pause`, a [`Spell`] of its own kind, see
//! [`super::controls`]) is recorded `skipped_paused` and never emitted, in
//! the same way; a paused schedule is still planned, so its runs are
//! recorded as they fall due and the run after a resume is on time.
//!
//! Of the other runs, a run is **on time** while `seen - fire_at <= grace`,
//! where `seen` is when a living leader first saw it due: the leader's
//! start for runs that fell due before it, the fire time itself for runs
//! that fell due while it led (see [`super::ticker`]; a slow or blocked step
//! never makes a run missed). An on-time run is emitted as a `tick`. A run
//! later than that was **missed** (no leader was running) and goes through the
//! schedule's catch-up policy as `catchup`: `all` emits every missed run
//! inside `catchup_window`; `latest` emits only the most recent due run (of
//! those that fell due while enabled); `none` emits none. Missed runs that
//! are not emitted are still recorded, as `skipped_catchup`, so every logical
//! run is accounted for. Planning starts after the scheduler's own cursor
//! ([`Cursor`]) and, for a schedule never planned, at its first sync; the
//! `start` date is the schedule's own rule ([`Schedule::runs_between`]).

use std::time::Duration;

use chrono::{DateTime, Utc};

pub use super::ledger::Spell;
use super::spec::{Catchup, Schedule};
use super::timeline::Run;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Tick,
    Catchup,
    Backfill,
    /// `almanac schedules trigger`: one run, now.
    Trigger,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Tick => "tick",
            Source::Catchup => "catchup",
            Source::Backfill => "backfill",
            Source::Trigger => "trigger",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Emit a job (unless the overlap rule skips it when recorded).
    Emit,
    SkipCatchup,
    /// Fell due while the schedule was disabled.
    SkipDisabled,
    /// Fell due while the schedule was paused.
    SkipPaused,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub run: Run,
    pub source: Source,
    pub decision: Decision,
}

/// Where a schedule stands for planning: the last run the scheduler itself
/// planned (a `tick` or `catchup` ledger row; backfilled rows never move
/// it, so a partial backfill cannot hide earlier missed runs) and when the
/// schedule was first synced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    pub last_planned: Option<DateTime<Utc>>,
    pub first_seen: DateTime<Utc>,
}

impl Cursor {
    /// The earliest instant the next run may fire at: just after the last
    /// planned run or, for a schedule never planned, its first sync.
    pub fn from(&self) -> DateTime<Utc> {
        match self.last_planned {
            Some(last) => last + chrono::Duration::microseconds(1),
            None => self.first_seen,
        }
    }
}

/// The first run to plan after `cursor`.
pub fn next_run(schedule: &Schedule, cursor: &Cursor) -> Option<Run> {
    schedule.next_after(cursor.from() - chrono::Duration::microseconds(1))
}

/// Runs after `cursor` up to and including `now`, at most `limit`, in order.
pub fn due_runs(
    schedule: &Schedule,
    cursor: &Cursor,
    now: DateTime<Utc>,
    limit: usize,
) -> Vec<Run> {
    runs_in(
        schedule,
        cursor.from(),
        now + chrono::Duration::microseconds(1),
        limit,
    )
}

/// The runs due at `now` from `next` (the schedule's next run, already
/// known), at most `limit`, and the run after them. In the usual case one
/// run is due and this costs one `next_after`; a backlog is generated in
/// bulk. Nothing already planned is scanned again.
pub fn due_from(
    schedule: &Schedule,
    next: Run,
    now: DateTime<Utc>,
    limit: usize,
) -> (Vec<Run>, Option<Run>) {
    let mut following = schedule.next_after(next.fire_at);
    let mut runs = vec![next];
    if let Some(f) = following.as_ref().filter(|f| f.fire_at <= now && limit > 1) {
        runs.extend(runs_in(
            schedule,
            f.fire_at,
            now + chrono::Duration::microseconds(1),
            limit - 1,
        ));
        let last = runs.last().map(|r| r.fire_at).unwrap_or(now);
        following = schedule.next_after(last);
    }
    (runs, following)
}

/// The schedule's runs with `from <= fire_at < to`, at most `limit`,
/// generated in spans that start at an hour and double up to a month: a
/// few runs of a frequent schedule cost a few runs, not a month of them (a
/// step of two runs of a once-a-minute schedule generated 44,640), and a
/// long range of a rare one still takes few spans.
pub fn runs_in(
    schedule: &Schedule,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    limit: usize,
) -> Vec<Run> {
    let mut out = Vec::new();
    let mut lo = from;
    let mut span = chrono::Duration::hours(1);
    while lo < to && out.len() < limit {
        let hi = (lo + span).min(to);
        out.extend(schedule.runs_between(lo, hi));
        lo = hi;
        span = (span * 2).min(chrono::Duration::days(31));
    }
    out.truncate(limit);
    out
}

/// Classifies due runs (from [`due_runs`]) as the module doc says, with
/// the schedule's disabled and paused spells (any order). `awake` is when
/// the leader began watching (or `now`, for one that just woke): a run is as
/// late as `awake - fire_at`, and never late when it fell due after `awake`.
/// `complete` says whether `runs` reaches `now` (it was not cut by a limit),
/// which `latest` needs to know which run is the most recent.
pub fn classify(
    schedule: &Schedule,
    runs: Vec<Run>,
    awake: DateTime<Utc>,
    grace: Duration,
    complete: bool,
    disabled: &[Spell],
    paused: &[Spell],
) -> Vec<Planned> {
    let grace = chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::MAX);
    let window =
        chrono::Duration::from_std(schedule.catchup_window).unwrap_or(chrono::Duration::MAX);
    let was_disabled = |run: &Run| disabled.iter().any(|s| s.covers(run.fire_at));
    let was_paused = |run: &Run| paused.iter().any(|s| s.covers(run.fire_at));
    let latest = if complete {
        runs.iter()
            .rev()
            .find(|r| !was_disabled(r) && !was_paused(r))
            .map(|r| r.fire_at)
    } else {
        None
    };
    runs.into_iter()
        .map(|run| {
            let late = awake - run.fire_at;
            let on_time = if late <= grace {
                Source::Tick
            } else {
                Source::Catchup
            };
            let (source, decision) = if was_disabled(&run) {
                (on_time, Decision::SkipDisabled)
            } else if was_paused(&run) {
                (on_time, Decision::SkipPaused)
            } else if late <= grace {
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
            last_planned: Some(at(after)),
            first_seen: at("2026-11-01T00:00:00Z"),
        };
        let runs = due_runs(&s, &cursor, now, 1000);
        classify(&s, runs, now, Duration::from_secs(60), true, &[], &[])
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
            last_planned: None,
            first_seen: at(first_seen),
        };
        let names = |runs: Vec<Run>| runs.into_iter().map(|r| r.logical_run).collect::<Vec<_>>();
        let runs = due_runs(&s, &new("2026-01-01T00:00:00Z"), at(NOW), 100);
        assert_eq!(names(runs), vec!["2026-03-04", "2026-03-05", "2026-03-06"]);
        let runs = due_runs(&s, &new("2026-03-04T12:00:00Z"), at(NOW), 100);
        assert_eq!(names(runs)[0], "2026-03-05");
        // Once it has been planned, the last planned run is the bound, not the first sync.
        let ran = Cursor {
            last_planned: Some(at("2026-03-03T17:00:00Z")),
            first_seen: at("2026-11-01T00:00:00Z"),
        };
        assert_eq!(
            names(due_runs(&s, &ran, at(NOW), 100)),
            vec!["2026-03-05", "2026-03-06"]
        );
    }

    #[test]
    fn due_from_carries_the_next_run_forward_without_rescanning_and_agrees_with_due_runs() {
        let s = schedule("");
        let cursor = Cursor {
            last_planned: Some(at(AFTER)),
            first_seen: at("2026-01-01T00:00:00Z"),
        };
        let next = next_run(&s, &cursor).unwrap();
        assert_eq!(next.logical_run, "2026-03-02");
        // One due: the following run is the next one, in the future.
        let (runs, following) = due_from(&s, next.clone(), at("2026-03-01T17:00:01Z"), 100);
        assert_eq!(runs, vec![next.clone()]);
        assert_eq!(following.unwrap().logical_run, "2026-03-03");
        // A backlog: the same runs as planning from the cursor, then the next.
        let (runs, following) = due_from(&s, next.clone(), at(NOW), 100);
        assert_eq!(runs, due_runs(&s, &cursor, at(NOW), 100));
        assert_eq!(following.unwrap().logical_run, "2026-03-07");
        // Cut by the limit: the following run is still due.
        let (runs, following) = due_from(&s, next, at(NOW), 2);
        assert_eq!(runs.len(), 2);
        assert_eq!(following.unwrap().logical_run, "2026-03-04");
    }

    #[test]
    fn start_is_one_rule_for_windows_and_next_runs() {
        let s = schedule("start = \"2026-03-04\"");
        let from = at("2026-03-01T00:00:00Z");
        assert_eq!(s.next_after(from).unwrap().logical_run, "2026-03-04");
        let names: Vec<String> = s
            .runs_between(from, at("2026-03-06T00:00:00Z"))
            .into_iter()
            .map(|r| r.logical_run)
            .collect();
        // 02:00 in Seoul is 17:00Z the day before.
        assert_eq!(names, vec!["2026-03-04", "2026-03-05", "2026-03-06"]);
    }

    #[test]
    fn runs_due_while_disabled_are_skipped_disabled_and_latest_picks_among_the_others() {
        use Decision::*;
        let s = schedule("catchup = \"latest\"");
        let cursor = Cursor {
            last_planned: Some(at(AFTER)),
            first_seen: at("2026-01-01T00:00:00Z"),
        };
        // Disabled from before the 03-04 run until after the 03-05 run; back
        // at 16:00Z, before the 03-06 run.
        let spell = Spell {
            from: at("2026-03-03T12:00:00Z"),
            until: Some(at("2026-03-04T18:00:00Z")),
        };
        let now = at("2026-03-05T16:00:00Z");
        let runs = due_runs(&s, &cursor, now, 100);
        let plan: Vec<_> = classify(&s, runs, now, Duration::from_secs(60), true, &[spell], &[])
            .into_iter()
            .map(|p| (p.run.logical_run, p.source.as_str(), p.decision))
            .collect();
        assert_eq!(
            plan,
            vec![
                ("2026-03-02".into(), "catchup", SkipCatchup),
                ("2026-03-03".into(), "catchup", Emit), // the latest run due while enabled
                ("2026-03-04".into(), "catchup", SkipDisabled),
                ("2026-03-05".into(), "catchup", SkipDisabled),
            ]
        );
    }
}
