//! Cron expressions with crontab(5) field meanings.
//!
//! Five fields (`minute hour day-of-month month day-of-week`), or six with a
//! leading seconds field, or a macro (`@yearly`, `@annually`, `@monthly`,
//! `@weekly`, `@daily`, `@midnight`, `@hourly`). Lists, ranges and steps
//! (`1,15`, `1-5`, `*/10`, `10-50/20`, `5/15`), month and weekday names
//! (`jan`, `mon`), and day-of-week 0 or 7 for Sunday. When both day fields are
//! restricted (neither starts with `*`), a day matches if either matches, as in
//! Vixie cron; otherwise both must.
//!
//! This module only answers "does this wall-clock slot match"; which real
//! instants that means across DST lives in [`super::timeline`].

use chrono::{Datelike, NaiveDate};

/// A parsed expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CronExpr {
    source: String,
    seconds: Option<Field>,
    minutes: Field,
    hours: Field,
    days_of_month: Field,
    months: Field,
    days_of_week: Field,
    /// Neither the minute nor the hour field starts with `*`.
    fixed_time: bool,
}

/// A set of allowed values (bit i set: value i allowed) and whether the field
/// was written starting with `*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Field {
    bits: u64,
    star: bool,
}

impl Field {
    fn contains(&self, v: u32) -> bool {
        v < 64 && self.bits & (1 << v) != 0
    }

    fn values(&self) -> impl Iterator<Item = u32> + '_ {
        (0..64).filter(|v| self.contains(*v))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cron `{expr}`: {reason}")]
pub struct CronError {
    pub expr: String,
    pub reason: String,
}

struct Spec {
    name: &'static str,
    min: u32,
    max: u32,
    names: &'static [&'static str],
}

const SECOND: Spec = Spec {
    name: "second",
    min: 0,
    max: 59,
    names: &[],
};
const MINUTE: Spec = Spec {
    name: "minute",
    min: 0,
    max: 59,
    names: &[],
};
const HOUR: Spec = Spec {
    name: "hour",
    min: 0,
    max: 23,
    names: &[],
};
const DAY_OF_MONTH: Spec = Spec {
    name: "day-of-month",
    min: 1,
    max: 31,
    names: &[],
};
const MONTH: Spec = Spec {
    name: "month",
    min: 1,
    max: 12,
    names: &[
        "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
    ],
};
const DAY_OF_WEEK: Spec = Spec {
    name: "day-of-week",
    min: 0,
    max: 7,
    names: &["sun", "mon", "tue", "wed", "thu", "fri", "sat"],
};

impl CronExpr {
    pub fn parse(expr: &str) -> Result<CronExpr, CronError> {
        let fail = |reason: String| CronError {
            expr: expr.to_string(),
            reason,
        };
        let trimmed = expr.trim();
        let expanded = match trimmed {
            "@yearly" | "@annually" => "0 0 1 1 *",
            "@monthly" => "0 0 1 * *",
            "@weekly" => "0 0 * * 0",
            "@daily" | "@midnight" => "0 0 * * *",
            "@hourly" => "0 * * * *",
            m if m.starts_with('@') => {
                return Err(fail(format!(
                    "unknown macro `{m}`; use @yearly, @monthly, @weekly, @daily or @hourly"
                )))
            }
            other => other,
        };
        let fields: Vec<&str> = expanded.split_whitespace().collect();
        let (seconds, rest) = match fields.len() {
            5 => (None, &fields[..]),
            6 => (Some(fields[0]), &fields[1..]),
            n => {
                return Err(fail(format!(
                    "has {n} fields; write 5 (minute hour day-of-month month day-of-week) or 6 with a leading seconds field"
                )))
            }
        };
        let parse = |text: &str, spec: &Spec| parse_field(text, spec).map_err(fail);
        let seconds = seconds.map(|s| parse(s, &SECOND)).transpose()?;
        let minutes = parse(rest[0], &MINUTE)?;
        let hours = parse(rest[1], &HOUR)?;
        let days_of_month = parse(rest[2], &DAY_OF_MONTH)?;
        let months = parse(rest[3], &MONTH)?;
        let mut days_of_week = parse(rest[4], &DAY_OF_WEEK)?;
        if days_of_week.contains(7) {
            days_of_week.bits = (days_of_week.bits | 1) & !(1 << 7);
        }
        let fixed_time = !minutes.star && !hours.star;
        let cron = CronExpr {
            source: trimmed.to_string(),
            seconds,
            minutes,
            hours,
            days_of_month,
            months,
            days_of_week,
            fixed_time,
        };
        if !cron.can_ever_match() {
            return Err(fail(
                "no date ever matches (check day-of-month against month)".into(),
            ));
        }
        Ok(cron)
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Fixed-time schedules get each slot once per matching date, shifting
    /// slots out of DST gaps; wildcard schedules fire at real instants only.
    pub fn is_fixed_time(&self) -> bool {
        self.fixed_time
    }

    pub fn has_seconds(&self) -> bool {
        self.seconds.is_some()
    }

    /// The `(hour, minute, second)` slots of a matching day, in order.
    pub fn slots(&self) -> Vec<(u32, u32, u32)> {
        let seconds: Vec<u32> = match &self.seconds {
            Some(f) => f.values().collect(),
            None => vec![0],
        };
        let mut out = Vec::new();
        for h in self.hours.values() {
            for m in self.minutes.values() {
                for s in &seconds {
                    out.push((h, m, *s));
                }
            }
        }
        out
    }

    /// Whether the expression fires on this local date (month and day fields).
    pub fn matches_date(&self, date: NaiveDate) -> bool {
        if !self.months.contains(date.month()) {
            return false;
        }
        let dom = self.days_of_month.contains(date.day());
        let dow = self
            .days_of_week
            .contains(date.weekday().num_days_from_sunday());
        if !self.days_of_month.star && !self.days_of_week.star {
            dom || dow
        } else {
            dom && dow
        }
    }

    fn can_ever_match(&self) -> bool {
        // Every month holds every weekday, so only a restricted day-of-month
        // with an unrestricted day-of-week can rule out every date: it needs
        // one of its days in one of its months (February has 29 in leap years).
        if self.days_of_month.star || !self.days_of_week.star {
            return true;
        }
        const LONGEST: [u32; 12] = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
        self.months
            .values()
            .filter(|m| (1..=12).contains(m))
            .any(|m| {
                self.days_of_month
                    .values()
                    .any(|d| d <= LONGEST[m as usize - 1])
            })
    }
}

fn parse_field(text: &str, spec: &Spec) -> Result<Field, String> {
    let mut bits = 0u64;
    for part in text.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((range, step)) => {
                let step: u32 = step.parse().ok().filter(|s| *s > 0).ok_or_else(|| {
                    format!("{} step `{step}` must be a positive number", spec.name)
                })?;
                (range, Some(step))
            }
            None => (part, None),
        };
        let (lo, hi) = if range == "*" {
            (spec.min, spec.max)
        } else if let Some((a, b)) = range.split_once('-') {
            let (a, b) = (value(a, spec)?, value(b, spec)?);
            if a > b {
                return Err(format!("{} range `{range}` runs backwards", spec.name));
            }
            (a, b)
        } else {
            let v = value(range, spec)?;
            // `5/15` means from 5 to the end, every 15.
            (v, if step.is_some() { spec.max } else { v })
        };
        let step = step.unwrap_or(1);
        let mut v = lo;
        while v <= hi {
            bits |= 1 << v;
            v += step;
        }
    }
    Ok(Field {
        bits,
        star: text.starts_with('*'),
    })
}

fn value(text: &str, spec: &Spec) -> Result<u32, String> {
    let lower = text.to_ascii_lowercase();
    if let Some(i) = spec.names.iter().position(|n| *n == lower) {
        return Ok(i as u32 + if spec.min == 1 { 1 } else { 0 });
    }
    let v: u32 = text.parse().map_err(|_| {
        if text.is_empty() {
            format!("{} field has an empty value", spec.name)
        } else {
            format!("`{text}` is not a valid {} value", spec.name)
        }
    })?;
    if v < spec.min || v > spec.max {
        return Err(format!(
            "{} {v} is out of range {}-{}",
            spec.name, spec.min, spec.max
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn date(y: i32, m: u32, d: u32) -> NaiveDate {
        NaiveDate::from_ymd_opt(y, m, d).unwrap()
    }

    #[test]
    fn weekdays_are_monday_to_friday_not_sunday_to_thursday() {
        let cron = CronExpr::parse("0 9 * * 1-5").unwrap();
        // 2026-11-29 is a Sunday.
        let days: Vec<bool> = (0..7)
            .map(|i| cron.matches_date(date(2026, 11, 29) + chrono::Days::new(i)))
            .collect();
        assert_eq!(days, vec![false, true, true, true, true, true, false]);
    }

    #[test]
    fn sunday_is_0_or_7_and_names_work() {
        for expr in ["0 0 * * 0", "0 0 * * 7", "0 0 * * sun", "0 0 * * SUN"] {
            let cron = CronExpr::parse(expr).unwrap();
            assert!(cron.matches_date(date(2026, 11, 29)), "{expr}");
            assert!(!cron.matches_date(date(2026, 11, 30)), "{expr}");
        }
        let cron = CronExpr::parse("0 0 1 jan-mar *").unwrap();
        assert!(cron.matches_date(date(2027, 3, 1)) && !cron.matches_date(date(2027, 4, 1)));
    }

    #[test]
    fn both_day_fields_restricted_means_either_matches() {
        // The 13th, or any Friday.
        let cron = CronExpr::parse("0 0 13 * 5").unwrap();
        assert!(cron.matches_date(date(2026, 12, 13))); // a Sunday the 13th
        assert!(cron.matches_date(date(2026, 12, 4))); // a Friday
        assert!(!cron.matches_date(date(2026, 12, 5)));
        // A star in one day field makes the other decide alone.
        let cron = CronExpr::parse("0 0 */2 * 5").unwrap();
        assert!(
            !cron.matches_date(date(2026, 12, 4)),
            "Friday the 4th: even day, and */2 is a star field"
        );
        assert!(cron.matches_date(date(2026, 12, 11)), "Friday the 11th");
    }

    #[test]
    fn steps_ranges_lists_and_macros() {
        let cron = CronExpr::parse("5/20 1-3,22 * * *").unwrap();
        let slots = cron.slots();
        assert_eq!(slots.len(), 4 * 3);
        assert_eq!(slots[..3], [(1, 5, 0), (1, 25, 0), (1, 45, 0)]);
        assert!(cron.is_fixed_time());
        assert!(!CronExpr::parse("@hourly").unwrap().is_fixed_time());
        assert_eq!(CronExpr::parse("@daily").unwrap().slots(), vec![(0, 0, 0)]);
        let six = CronExpr::parse("*/15 * * * * *").unwrap();
        assert!(six.has_seconds() && !six.is_fixed_time());
        assert_eq!(six.slots().len(), 4 * 60 * 24);
    }

    #[test]
    fn bad_expressions_say_what_is_wrong() {
        let err = |e: &str| CronExpr::parse(e).unwrap_err().to_string();
        assert_eq!(
            err("0 25 * * *"),
            "cron `0 25 * * *`: hour 25 is out of range 0-23"
        );
        assert_eq!(err("0 0 * *"), "cron `0 0 * *`: has 4 fields; write 5 (minute hour day-of-month month day-of-week) or 6 with a leading seconds field");
        assert_eq!(
            err("0 0 30 2 *"),
            "cron `0 0 30 2 *`: no date ever matches (check day-of-month against month)"
        );
        assert_eq!(
            err("*/0 * * * *"),
            "cron `*/0 * * * *`: minute step `0` must be a positive number"
        );
        assert_eq!(
            err("0 0 * * fri-mon"),
            "cron `0 0 * * fri-mon`: day-of-week range `fri-mon` runs backwards"
        );
        assert_eq!(err("@reboot"), "cron `@reboot`: unknown macro `@reboot`; use @yearly, @monthly, @weekly, @daily or @hourly");
        assert_eq!(
            err("0 0 * foo *"),
            "cron `0 0 * foo *`: `foo` is not a valid month value"
        );
        assert!(CronExpr::parse("0 0 29 2 *").is_ok(), "leap days exist");
    }
}
