//! A schedule's `deadline`: by when each of its runs should have succeeded.
//!
//! - `deadline = "2h"` (any duration `catchup_window` accepts): that long
//!   after the run's fire time.
//! - `deadline = "06:00"` (`HH:MM`, local to the schedule's zone): the first
//!   such local time strictly after the fire time. It follows the project's
//!   DST rules for a fixed-time slot, by the same code ([`Timeline`], as if
//!   it were the cron expression `0 6 * * *`): a time inside a DST gap is
//!   shifted forward by the gap's length (02:30 on a spring-forward night is
//!   03:30), and a time in a repeated hour is its first occurrence.
//!
//! A run is **overdue** once its deadline has passed while its job is not
//! `done` (a dead job included); the collector counts them
//! ([`crate::stats::snapshot`]). The text is stored in
//! `almanac.schedules.deadline` as written (normalised), and parsed back the
//! same way.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, NaiveTime, Utc};
use chrono_tz::Tz;

use super::cron::CronExpr;
use super::timeline::Timeline;
use crate::config::HumanDuration;

#[derive(Debug, Clone)]
pub enum Deadline {
    /// This long after the fire time.
    After(Duration),
    /// The first such local time after the fire time, in the schedule's zone.
    At {
        time: NaiveTime,
        /// The time of day as a daily fixed-time timeline in the zone.
        daily: Box<Timeline>,
    },
}

impl Deadline {
    /// Parses `2h` or `06:00` for a schedule in `tz`; the error says what
    /// to write instead.
    pub fn parse(text: &str, tz: Tz) -> Result<Deadline, String> {
        let text = text.trim();
        if text.contains(':') {
            let time = NaiveTime::parse_from_str(text, "%H:%M").map_err(|_| {
                format!("deadline `{text}` is not a local time of day; write HH:MM, such as 06:00")
            })?;
            let cron = CronExpr::parse(&time.format("%M %H * * *").to_string())
                .map_err(|e| format!("deadline `{text}`: {e}"))?;
            return Ok(Deadline::At {
                time,
                daily: Box::new(Timeline::new(cron, tz)),
            });
        }
        let d: HumanDuration = text.parse().map_err(|_| {
            format!(
                "deadline `{text}` is neither a duration (30m, 2h, 1d) nor a local time of day (06:00)"
            )
        })?;
        if d.0.is_zero() {
            return Err(format!(
                "deadline `{text}` is zero; give a run some time, such as 30m"
            ));
        }
        Ok(Deadline::After(d.0))
    }

    /// When the run firing at `fire_at` should have succeeded by.
    pub fn due(&self, fire_at: DateTime<Utc>) -> DateTime<Utc> {
        match self {
            Deadline::After(d) => chrono::Duration::from_std(*d)
                .ok()
                .and_then(|d| fire_at.checked_add_signed(d))
                .unwrap_or(DateTime::<Utc>::MAX_UTC),
            // A daily slot always has a next occurrence.
            Deadline::At { daily, .. } => daily
                .next_after(fire_at)
                .map_or(DateTime::<Utc>::MAX_UTC, |r| r.fire_at),
        }
    }
}

impl fmt::Display for Deadline {
    /// The stored form: `2h`, `06:00`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Deadline::After(d) => write!(f, "{}", HumanDuration(*d)),
            Deadline::At { time, .. } => write!(f, "{}", time.format("%H:%M")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn due(text: &str, zone: &str, fire: &str) -> String {
        Deadline::parse(text, zone.parse().unwrap())
            .unwrap()
            .due(at(fire))
            .to_rfc3339()
    }

    #[test]
    fn a_duration_deadline_is_that_long_after_the_fire_time() {
        assert_eq!(
            due("2h", "Asia/Seoul", "2026-03-01T17:00:00Z"),
            "2026-03-01T19:00:00+00:00"
        );
        assert_eq!(
            due("1h30m", "UTC", "2026-03-01T23:00:00Z"),
            "2026-03-02T00:30:00+00:00"
        );
    }

    #[test]
    fn a_time_of_day_deadline_is_the_next_such_local_time_after_the_fire_time() {
        // 02:00 KST fire, 06:00 KST deadline the same local morning.
        assert_eq!(
            due("06:00", "Asia/Seoul", "2026-03-01T17:00:00Z"),
            "2026-03-01T21:00:00+00:00"
        );
        // A run firing at 07:00 local is due at 06:00 the next day.
        assert_eq!(
            due("06:00", "Asia/Seoul", "2026-03-01T22:00:00Z"),
            "2026-03-02T21:00:00+00:00"
        );
        // Firing exactly at the deadline's time: the next day's (strictly after).
        assert_eq!(
            due("06:00", "UTC", "2026-03-01T06:00:00Z"),
            "2026-03-02T06:00:00+00:00"
        );
    }

    #[test]
    fn a_time_of_day_deadline_follows_the_timeline_dst_rules() {
        // New York springs forward on 2026-03-08 at 02:00: 02:30 does not
        // exist and moves forward by the gap, to 03:30 EDT (07:30Z).
        assert_eq!(
            due("02:30", "America/New_York", "2026-03-08T05:00:00Z"),
            "2026-03-08T07:30:00+00:00"
        );
        // It falls back on 2026-11-01: 01:30 happens twice; the first (EDT, 05:30Z).
        assert_eq!(
            due("01:30", "America/New_York", "2026-11-01T04:00:00Z"),
            "2026-11-01T05:30:00+00:00"
        );
        // Lord Howe's 30-minute gap on 2026-10-04: 02:15 becomes 02:45 (+11).
        assert_eq!(
            due("02:15", "Australia/Lord_Howe", "2026-10-03T13:00:00Z"),
            "2026-10-03T15:45:00+00:00"
        );
    }

    #[test]
    fn bad_deadlines_say_what_to_write() {
        let tz = chrono_tz::UTC;
        let err = |t: &str| Deadline::parse(t, tz).unwrap_err();
        assert_eq!(
            err("soon"),
            "deadline `soon` is neither a duration (30m, 2h, 1d) nor a local time of day (06:00)"
        );
        assert_eq!(
            err("25:00"),
            "deadline `25:00` is not a local time of day; write HH:MM, such as 06:00"
        );
        assert_eq!(
            err("0s"),
            "deadline `0s` is zero; give a run some time, such as 30m"
        );
    }

    #[test]
    fn the_stored_form_parses_back_to_the_same_deadline() {
        for text in ["2h", "90m", "06:00", "1d"] {
            let d = Deadline::parse(text, chrono_tz::UTC).unwrap();
            let again = Deadline::parse(&d.to_string(), chrono_tz::UTC).unwrap();
            assert_eq!(d.to_string(), again.to_string());
        }
        assert_eq!(
            Deadline::parse("90m", chrono_tz::UTC).unwrap().to_string(),
            "90m"
        );
    }
}
