//! Which real instants a cron expression fires at in a time zone, and the
//! logical run each instant stands for. These are the project's own rules,
//! stated once here:
//!
//! - **Fixed-time schedules** (neither the minute nor the hour field starts with
//!   `*`): every matching local date gets each of its `(hour, minute[, second])`
//!   slots exactly once. A slot inside a DST gap runs shifted forward by the
//!   length of the gap (02:30 on a spring-forward night runs at 03:30; on
//!   Australia/Lord_Howe's 30-minute shift, 02:15 runs at 02:45). A slot inside a
//!   repeated hour runs once, at its first occurrence.
//! - **Wildcard schedules** (the minute or hour field starts with `*`): fire at
//!   every real instant whose local wall time matches: nothing inside a gap,
//!   both passes of a repeated hour.
//! - **Logical run**: the slot's local date `YYYY-MM-DD` when the schedule is
//!   fixed-time with a single slot per day (so it fires at most once per local
//!   day, whatever DST does); otherwise the fire instant in UTC,
//!   `YYYY-MM-DDTHH:MMZ` (`YYYY-MM-DDTHH:MM:SSZ` with a seconds field). Two slots
//!   that DST moves onto the same instant are one run.
//!
//! Transitions are assumed to be at least a day apart, which holds for every
//! zone in the tz database.

use chrono::{DateTime, Days, NaiveDate, NaiveDateTime, NaiveTime, Offset, TimeZone, Utc};
use chrono_tz::Tz;

use super::cron::CronExpr;

/// One firing: the instant, the local date of its slot, and its logical run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub fire_at: DateTime<Utc>,
    /// The local date of the slot (for fixed-time runs shifted past midnight,
    /// the date it was scheduled for).
    pub date: NaiveDate,
    pub logical_run: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Date,
    Minute,
    Second,
}

#[derive(Debug, Clone)]
pub struct Timeline {
    cron: CronExpr,
    tz: Tz,
    slots: Vec<NaiveTime>,
    format: Format,
}

/// How far the day scan looks for a next run: every (month, day) pair recurs
/// within eight years, leap days included.
const SCAN_DAYS: u64 = 366 * 8 + 2;

/// The most a transition moves the wall clock (tzdb's largest DST shifts are
/// two hours).
const MAX_SHIFT: chrono::Duration = chrono::Duration::hours(3);

impl Timeline {
    pub fn new(cron: CronExpr, tz: Tz) -> Self {
        let slots: Vec<NaiveTime> = cron
            .slots()
            .into_iter()
            .filter_map(|(h, m, s)| NaiveTime::from_hms_opt(h, m, s))
            .collect();
        let format = if cron.is_fixed_time() && slots.len() == 1 {
            Format::Date
        } else if cron.has_seconds() {
            Format::Second
        } else {
            Format::Minute
        };
        Timeline {
            cron,
            tz,
            slots,
            format,
        }
    }

    pub fn cron(&self) -> &CronExpr {
        &self.cron
    }

    pub fn tz(&self) -> Tz {
        self.tz
    }

    /// True when logical runs are local dates (one run per day at most).
    pub fn is_daily(&self) -> bool {
        self.format == Format::Date
    }

    fn logical_run(&self, date: NaiveDate, fire_at: DateTime<Utc>) -> String {
        match self.format {
            Format::Date => date.format("%Y-%m-%d").to_string(),
            Format::Minute => fire_at.format("%Y-%m-%dT%H:%MZ").to_string(),
            Format::Second => fire_at.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
        }
    }

    /// The instants of one local date's slots whose wall time lies within
    /// `[lo, hi]` (unbounded where `None`), before logical runs are named.
    fn instants_on(
        &self,
        date: NaiveDate,
        lo: Option<NaiveDateTime>,
        hi: Option<NaiveDateTime>,
        out: &mut Vec<(DateTime<Utc>, NaiveDate)>,
    ) {
        if !self.cron.matches_date(date) {
            return;
        }
        let first = match lo {
            Some(lo) if lo.date() > date => return,
            Some(lo) if lo.date() == date => self.slots.partition_point(|s| *s < lo.time()),
            _ => 0,
        };
        let end = match hi {
            Some(hi) if hi.date() < date => return,
            Some(hi) if hi.date() == date => self.slots.partition_point(|s| *s <= hi.time()),
            _ => self.slots.len(),
        };
        for slot in self.slots.get(first..end).unwrap_or_default() {
            self.resolve(date, *slot, out);
        }
    }

    /// The instants of one slot on one date, under the module's rules.
    fn resolve(&self, date: NaiveDate, slot: NaiveTime, out: &mut Vec<(DateTime<Utc>, NaiveDate)>) {
        let local = date.and_time(slot);
        let fixed = self.cron.is_fixed_time();
        match self.tz.from_local_datetime(&local) {
            chrono::LocalResult::Single(t) => out.push((t.with_timezone(&Utc), date)),
            chrono::LocalResult::Ambiguous(first, second) => {
                out.push((first.with_timezone(&Utc), date));
                if !fixed {
                    out.push((second.with_timezone(&Utc), date));
                }
            }
            chrono::LocalResult::None if fixed => out.push((self.shift_out_of_gap(local), date)),
            chrono::LocalResult::None => {}
        }
    }

    /// Offsets in force around `t` (a day either side), in seconds.
    fn offsets_near(&self, t: DateTime<Utc>) -> [i64; 3] {
        let day = chrono::Duration::days(1);
        [t - day, t, t + day].map(|at| {
            i64::from(
                self.tz
                    .offset_from_utc_datetime(&at.naive_utc())
                    .fix()
                    .local_minus_utc(),
            )
        })
    }

    /// The wall time of `t` at the lowest (or highest) offset near it: every
    /// slot that can fire at or after (or before) `t` has a wall time past it.
    fn wall_bound(&self, t: DateTime<Utc>, highest: bool) -> NaiveDateTime {
        let offsets = self.offsets_near(t);
        let offset = if highest {
            offsets.iter().max()
        } else {
            offsets.iter().min()
        };
        let margin = if highest { 1 } else { -1 };
        t.naive_utc() + chrono::Duration::seconds(offset.copied().unwrap_or(0) + margin)
    }

    /// A wall time inside a gap, read with the offset in force before the gap:
    /// the instant the gap's length later on the wall clock.
    fn shift_out_of_gap(&self, local: NaiveDateTime) -> DateTime<Utc> {
        let before = local.and_utc() - chrono::Duration::hours(26);
        let offset = self.tz.offset_from_utc_datetime(&before.naive_utc()).fix();
        (local - chrono::Duration::seconds(i64::from(offset.local_minus_utc()))).and_utc()
    }

    fn named(&self, mut instants: Vec<(DateTime<Utc>, NaiveDate)>) -> Vec<Run> {
        instants.sort();
        instants.dedup_by_key(|(t, _)| *t);
        instants
            .into_iter()
            .map(|(fire_at, date)| Run {
                fire_at,
                date,
                logical_run: self.logical_run(date, fire_at),
            })
            .collect()
    }

    /// Every run with `from <= fire_at < to`, in order.
    pub fn runs_between(&self, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<Run> {
        if from >= to {
            return Vec::new();
        }
        let (lo, hi) = (self.wall_bound(from, false), self.wall_bound(to, true));
        let mut instants = Vec::new();
        let mut date = lo.date();
        while date <= hi.date() {
            self.instants_on(date, Some(lo), Some(hi), &mut instants);
            date = date + Days::new(1);
        }
        instants.retain(|(t, _)| *t >= from && *t < to);
        self.named(instants)
    }

    /// The first run strictly after `t`. Slots are resolved in wall-clock
    /// order and the scan stops once the wall clock is [`MAX_SHIFT`] past the
    /// best candidate: no later slot can fire earlier than that.
    ///
    /// When the offset is the same a day either side of `t` (no transition
    /// near, as almost always), wall-clock order is instant order there, so
    /// the first slot found within a day of `t` is the answer at once.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<Run> {
        let offsets = self.offsets_near(t);
        let uniform = offsets.iter().all(|o| *o == offsets[0]);
        let near = t + chrono::Duration::days(1);
        let lo = self.wall_bound(t, false);
        let mut best: Option<((DateTime<Utc>, NaiveDate), NaiveDateTime)> = None;
        let mut resolved = Vec::with_capacity(2);
        let mut date = lo.date();
        for _ in 0..SCAN_DAYS {
            if let Some(((fire, _), wall)) = best {
                if (uniform && fire <= near) || date.and_time(NaiveTime::MIN) > wall + MAX_SHIFT {
                    break;
                }
            }
            if self.cron.matches_date(date) {
                let first = if lo.date() == date {
                    self.slots.partition_point(|s| *s < lo.time())
                } else {
                    0
                };
                for slot in &self.slots[first..] {
                    if best.is_some_and(|((fire, _), wall)| {
                        (uniform && fire <= near) || date.and_time(*slot) > wall + MAX_SHIFT
                    }) {
                        break;
                    }
                    resolved.clear();
                    self.resolve(date, *slot, &mut resolved);
                    for &(fire, day) in &resolved {
                        if fire > t && best.is_none_or(|((b, _), _)| fire < b) {
                            best = Some(((fire, day), fire.with_timezone(&self.tz).naive_local()));
                        }
                    }
                }
            }
            date = date + Days::new(1);
        }
        best.and_then(|(found, _)| self.named(vec![found]).into_iter().next())
    }

    /// The local midnight that starts `date` (or the first instant of the day
    /// when midnight falls in a gap).
    pub fn start_of(&self, date: NaiveDate) -> DateTime<Utc> {
        let midnight = date.and_time(NaiveTime::MIN);
        match self.tz.from_local_datetime(&midnight) {
            chrono::LocalResult::Single(t) | chrono::LocalResult::Ambiguous(t, _) => {
                t.with_timezone(&Utc)
            }
            chrono::LocalResult::None => self.shift_out_of_gap(midnight),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn runs(zone: &str, cron: &str, from: &str, to: &str) -> Vec<(String, String)> {
        let timeline = Timeline::new(CronExpr::parse(cron).unwrap(), zone.parse().unwrap());
        timeline
            .runs_between(at(from), at(to))
            .into_iter()
            .map(|r| {
                (
                    r.logical_run,
                    r.fire_at.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
                )
            })
            .collect()
    }

    fn expect(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn new_york_spring_forward_runs_the_0230_slot_at_0330() {
        assert_eq!(
            runs(
                "America/New_York",
                "30 2 * * *",
                "2026-03-07T00:00:00Z",
                "2026-03-10T00:00:00Z"
            ),
            expect(&[
                ("2026-03-07", "2026-03-07T07:30:00Z"),
                ("2026-03-08", "2026-03-08T07:30:00Z"), // 03:30 EDT
                ("2026-03-09", "2026-03-09T06:30:00Z"),
            ])
        );
    }

    #[test]
    fn new_york_fall_back_runs_a_0130_job_once_at_its_first_occurrence() {
        assert_eq!(
            runs(
                "America/New_York",
                "30 1 * * *",
                "2026-10-31T00:00:00Z",
                "2026-11-03T00:00:00Z"
            ),
            expect(&[
                ("2026-10-31", "2026-10-31T05:30:00Z"),
                ("2026-11-01", "2026-11-01T05:30:00Z"), // 01:30 EDT, not again at 01:30 EST
                ("2026-11-02", "2026-11-02T06:30:00Z"),
            ])
        );
    }

    #[test]
    fn new_york_wildcard_fires_twice_in_the_repeated_hour_and_never_in_the_gap() {
        assert_eq!(
            runs(
                "America/New_York",
                "30 * * * *",
                "2026-11-01T04:00:00Z",
                "2026-11-01T08:00:00Z"
            ),
            expect(&[
                ("2026-11-01T04:30Z", "2026-11-01T04:30:00Z"),
                ("2026-11-01T05:30Z", "2026-11-01T05:30:00Z"),
                ("2026-11-01T06:30Z", "2026-11-01T06:30:00Z"),
                ("2026-11-01T07:30Z", "2026-11-01T07:30:00Z"),
            ])
        );
        assert_eq!(
            runs(
                "America/New_York",
                "30 * * * *",
                "2026-03-08T05:00:00Z",
                "2026-03-08T09:00:00Z"
            ),
            expect(&[
                ("2026-03-08T05:30Z", "2026-03-08T05:30:00Z"), // 00:30 EST
                ("2026-03-08T06:30Z", "2026-03-08T06:30:00Z"), // 01:30 EST
                ("2026-03-08T07:30Z", "2026-03-08T07:30:00Z"), // 03:30 EDT; 02:30 does not exist
                ("2026-03-08T08:30Z", "2026-03-08T08:30:00Z"),
            ])
        );
    }

    #[test]
    fn london_gap_and_repeat() {
        assert_eq!(
            runs(
                "Europe/London",
                "30 1 * * *",
                "2026-03-28T00:00:00Z",
                "2026-03-30T00:00:00Z"
            ),
            expect(&[
                ("2026-03-28", "2026-03-28T01:30:00Z"),
                ("2026-03-29", "2026-03-29T01:30:00Z")
            ]) // 02:30 BST
        );
        assert_eq!(
            runs(
                "Europe/London",
                "30 1 * * *",
                "2026-10-24T00:00:00Z",
                "2026-10-27T00:00:00Z"
            ),
            expect(&[
                ("2026-10-24", "2026-10-24T00:30:00Z"),
                ("2026-10-25", "2026-10-25T00:30:00Z"), // 01:30 BST, the first pass
                ("2026-10-26", "2026-10-26T01:30:00Z"),
            ])
        );
    }

    #[test]
    fn lord_howe_half_hour_shift() {
        // 02:00 -> 02:30 on 2026-10-04: 02:15 runs at 02:45 (+11:00).
        assert_eq!(
            runs(
                "Australia/Lord_Howe",
                "15 2 * * *",
                "2026-10-02T00:00:00Z",
                "2026-10-05T00:00:00Z"
            ),
            expect(&[
                ("2026-10-03", "2026-10-02T15:45:00Z"),
                ("2026-10-04", "2026-10-03T15:45:00Z"),
                ("2026-10-05", "2026-10-04T15:15:00Z"),
            ])
        );
        // 02:00 -> 01:30 on 2026-04-05: 01:45 happens twice; a fixed job runs once.
        assert_eq!(
            runs(
                "Australia/Lord_Howe",
                "45 1 * * *",
                "2026-04-04T00:00:00Z",
                "2026-04-05T00:00:00Z"
            ),
            expect(&[("2026-04-05", "2026-04-04T14:45:00Z")])
        );
        assert_eq!(
            runs(
                "Australia/Lord_Howe",
                "45 * * * *",
                "2026-04-04T14:00:00Z",
                "2026-04-04T16:00:00Z"
            ),
            expect(&[
                ("2026-04-04T14:45Z", "2026-04-04T14:45:00Z"),
                ("2026-04-04T15:15Z", "2026-04-04T15:15:00Z")
            ])
        );
    }

    #[test]
    fn santiago_transitions_at_midnight() {
        // Midnight does not exist on 2026-09-06: 00:30 runs at 01:30 (-03).
        assert_eq!(
            runs(
                "America/Santiago",
                "30 0 * * *",
                "2026-09-05T00:00:00Z",
                "2026-09-08T00:00:00Z"
            ),
            expect(&[
                ("2026-09-05", "2026-09-05T04:30:00Z"),
                ("2026-09-06", "2026-09-06T04:30:00Z"),
                ("2026-09-07", "2026-09-07T03:30:00Z"),
            ])
        );
        assert_eq!(
            runs(
                "America/Santiago",
                "0 0 * * *",
                "2026-09-06T00:00:00Z",
                "2026-09-07T00:00:00Z"
            ),
            expect(&[("2026-09-06", "2026-09-06T04:00:00Z")]) // 01:00 -03, the day's first instant
        );
        // 23:00-24:00 repeats on 2026-04-04.
        assert_eq!(
            runs(
                "America/Santiago",
                "30 23 * * *",
                "2026-04-04T12:00:00Z",
                "2026-04-05T12:00:00Z"
            ),
            expect(&[("2026-04-04", "2026-04-05T02:30:00Z")])
        );
        assert_eq!(
            runs(
                "America/Santiago",
                "*/30 23 * * *",
                "2026-04-04T12:00:00Z",
                "2026-04-05T12:00:00Z"
            ),
            expect(&[
                ("2026-04-05T02:00Z", "2026-04-05T02:00:00Z"),
                ("2026-04-05T02:30Z", "2026-04-05T02:30:00Z"),
                ("2026-04-05T03:00Z", "2026-04-05T03:00:00Z"),
                ("2026-04-05T03:30Z", "2026-04-05T03:30:00Z"),
            ])
        );
    }

    #[test]
    fn beirut_transitions_at_midnight() {
        assert_eq!(
            runs(
                "Asia/Beirut",
                "0 0 * * *",
                "2026-03-27T12:00:00Z",
                "2026-03-30T12:00:00Z"
            ),
            expect(&[
                ("2026-03-28", "2026-03-27T22:00:00Z"),
                ("2026-03-29", "2026-03-28T22:00:00Z"), // 01:00 +03, the day's first instant
                ("2026-03-30", "2026-03-29T21:00:00Z"),
            ])
        );
        assert_eq!(
            runs(
                "Asia/Beirut",
                "30 23 * * *",
                "2026-10-24T12:00:00Z",
                "2026-10-25T12:00:00Z"
            ),
            expect(&[("2026-10-24", "2026-10-24T20:30:00Z")])
        );
    }

    #[test]
    fn chatham_quarter_hour_offsets() {
        // 02:45 -> 03:45 on 2026-09-27: 03:00 runs at 04:00 (+13:45).
        assert_eq!(
            runs(
                "Pacific/Chatham",
                "0 3 * * *",
                "2026-09-26T00:00:00Z",
                "2026-09-27T00:00:00Z"
            ),
            expect(&[("2026-09-27", "2026-09-26T14:15:00Z")])
        );
        // 03:45 -> 02:45 on 2026-04-05: 03:00 runs once, at +13:45.
        assert_eq!(
            runs(
                "Pacific/Chatham",
                "0 3 * * *",
                "2026-04-04T00:00:00Z",
                "2026-04-05T00:00:00Z"
            ),
            expect(&[("2026-04-05", "2026-04-04T13:15:00Z")])
        );
    }

    #[test]
    fn seoul_has_no_transitions() {
        assert_eq!(
            runs(
                "Asia/Seoul",
                "0 2 * * *",
                "2026-03-07T00:00:00Z",
                "2026-03-10T00:00:00Z"
            ),
            expect(&[
                ("2026-03-08", "2026-03-07T17:00:00Z"),
                ("2026-03-09", "2026-03-08T17:00:00Z"),
                ("2026-03-10", "2026-03-09T17:00:00Z"),
            ])
        );
    }

    #[test]
    fn a_year_of_a_daily_fixed_schedule_has_one_run_per_day_in_every_zone() {
        for zone in [
            "America/New_York",
            "Europe/London",
            "Australia/Lord_Howe",
            "America/Santiago",
            "Asia/Beirut",
            "Pacific/Chatham",
            "Asia/Seoul",
        ] {
            for cron in [
                "0 0 * * *",
                "30 2 * * *",
                "59 23 * * *",
                "45 1 * * *",
                "0 3 * * *",
            ] {
                let all = runs(zone, cron, "2026-01-01T00:00:00Z", "2027-01-01T00:00:00Z");
                let mut dates: Vec<&String> = all.iter().map(|(d, _)| d).collect();
                dates.dedup();
                assert_eq!(dates.len(), all.len(), "{zone} {cron}: a date twice");
                // The year in UTC covers 364 or 365 local dates, less the partial ends.
                assert!(
                    (363..=366).contains(&all.len()),
                    "{zone} {cron}: {} runs",
                    all.len()
                );
            }
        }
    }

    #[test]
    fn multi_slot_and_seconds_schedules_name_runs_by_utc_instant() {
        assert_eq!(
            runs(
                "Asia/Seoul",
                "0 9,18 * * *",
                "2026-03-08T00:00:00Z",
                "2026-03-08T12:00:00Z"
            ),
            expect(&[
                ("2026-03-08T00:00Z", "2026-03-08T00:00:00Z"),
                ("2026-03-08T09:00Z", "2026-03-08T09:00:00Z")
            ])
        );
        assert_eq!(
            runs(
                "UTC",
                "*/20 * * * * *",
                "2026-03-08T00:00:00Z",
                "2026-03-08T00:01:00Z"
            ),
            expect(&[
                ("2026-03-08T00:00:00Z", "2026-03-08T00:00:00Z"),
                ("2026-03-08T00:00:20Z", "2026-03-08T00:00:20Z"),
                ("2026-03-08T00:00:40Z", "2026-03-08T00:00:40Z"),
            ])
        );
    }

    #[test]
    fn next_after_finds_the_next_shifted_or_distant_run() {
        let ny = Timeline::new(
            CronExpr::parse("30 2 * * *").unwrap(),
            "America/New_York".parse().unwrap(),
        );
        let next = ny.next_after(at("2026-03-08T00:00:00Z")).unwrap();
        assert_eq!(
            (next.logical_run.as_str(), next.fire_at),
            ("2026-03-08", at("2026-03-08T07:30:00Z"))
        );
        let leap = Timeline::new(CronExpr::parse("0 0 29 2 *").unwrap(), chrono_tz::UTC);
        assert_eq!(
            leap.next_after(at("2026-03-01T00:00:00Z")).unwrap().fire_at,
            at("2028-02-29T00:00:00Z")
        );
        let start = ny.start_of(NaiveDate::from_ymd_opt(2026, 3, 8).unwrap());
        assert_eq!(start, at("2026-03-08T05:00:00Z"));
    }

    /// Narrow windows and next_after agree with one wide enumeration, around
    /// every transition of every zone under test.
    #[test]
    fn windows_and_next_after_agree_with_a_wide_enumeration() {
        let zones = [
            "America/New_York",
            "Europe/London",
            "Australia/Lord_Howe",
            "America/Santiago",
            "Asia/Beirut",
            "Pacific/Chatham",
            "Asia/Seoul",
            "Pacific/Apia",
        ];
        let crons = [
            "30 2 * * *",
            "*/20 * * * *",
            "0 0 * * *",
            "15 1,2,3 * * *",
            "45 * * * *",
            "0 */7 * * 1-5",
        ];
        let (lo, hi) = (at("2026-03-01T00:00:00Z"), at("2026-11-15T00:00:00Z"));
        for zone in zones {
            for cron in crons {
                let tl = Timeline::new(CronExpr::parse(cron).unwrap(), zone.parse().unwrap());
                let wide = tl.runs_between(
                    lo - chrono::Duration::days(3),
                    hi + chrono::Duration::days(3),
                );
                let mut t = lo;
                while t < hi {
                    let to = t + chrono::Duration::minutes(97);
                    let narrow = tl.runs_between(t, to);
                    let expected: Vec<Run> = wide
                        .iter()
                        .filter(|r| r.fire_at >= t && r.fire_at < to)
                        .cloned()
                        .collect();
                    assert_eq!(narrow, expected, "{zone} {cron} [{t}, {to})");
                    let next = tl.next_after(t);
                    assert_eq!(
                        next.as_ref(),
                        wide.iter().find(|r| r.fire_at > t),
                        "{zone} {cron} after {t}"
                    );
                    t += chrono::Duration::minutes(631);
                }
            }
        }
    }
}
