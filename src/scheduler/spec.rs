//! Schedule files: every `*.toml` in the schedules directory, each holding
//! schedules as tables keyed by name.
//!
//! Loading is all or nothing: unknown keys, a bad cron expression, an unknown
//! zone, a bad duration or date, or a name used twice across files reject the
//! whole load with `file:line: reason` for every problem found, and nothing
//! from it is applied.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use chrono_tz::Tz;
use serde::Deserialize;
use toml::Spanned;

use super::cron::CronExpr;
use super::deadline::Deadline;
use super::timeline::{Run, Timeline};
use crate::config::{line_col, HumanDuration};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Catchup {
    All,
    Latest,
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    Allow,
    Skip,
}

impl Catchup {
    pub fn as_str(self) -> &'static str {
        match self {
            Catchup::All => "all",
            Catchup::Latest => "latest",
            Catchup::None => "none",
        }
    }
}

impl Overlap {
    pub fn as_str(self) -> &'static str {
        match self {
            Overlap::Allow => "allow",
            Overlap::Skip => "skip",
        }
    }
}

pub const DEFAULT_CATCHUP_WINDOW: Duration = Duration::from_secs(7 * 86_400);

/// A validated schedule.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub name: String,
    pub timeline: Timeline,
    pub kind: String,
    pub payload: serde_json::Value,
    pub catchup: Catchup,
    pub catchup_window: Duration,
    /// No run before this local date.
    pub start: Option<NaiveDate>,
    pub overlap: Overlap,
    pub max_attempts: i32,
    /// The priority of every job the schedule emits (0 to
    /// [`crate::queue::MAX_PRIORITY`], higher claimed first within a kind).
    pub priority: i16,
    pub enabled: bool,
    /// By when each run should have succeeded (see [`super::deadline`]).
    pub deadline: Option<Deadline>,
    /// `file:line` of its table, for messages.
    pub origin: String,
}

impl Schedule {
    /// The definition as stored in `almanac.schedules` (and hashed there).
    ///
    /// A schedule without a deadline has no `deadline` key, so the hashes of
    /// definitions synced before deadlines existed stay as they were.
    pub fn definition(&self) -> serde_json::Value {
        let mut d = serde_json::json!({
            "cron": self.timeline.cron().source(),
            "timezone": self.timeline.tz().name(),
            "kind": self.kind,
            "payload": self.payload,
            "catchup": self.catchup.as_str(),
            "catchup_window": HumanDuration(self.catchup_window).to_string(),
            "start": self.start.map(|d| d.to_string()),
            "overlap": self.overlap.as_str(),
            "max_attempts": self.max_attempts,
            "enabled": self.enabled,
        });
        if let Some(deadline) = &self.deadline {
            d["deadline"] = deadline.to_string().into();
        }
        // Likewise a schedule of the default priority has no `priority` key.
        if self.priority != 0 {
            d["priority"] = self.priority.into();
        }
        d
    }

    /// When the run firing at `fire_at` should have succeeded by, if the
    /// schedule has a deadline.
    pub fn deadline_of(&self, fire_at: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.deadline.as_ref().map(|d| d.due(fire_at))
    }

    /// The job idempotency key of one logical run.
    pub fn job_key(&self, logical_run: &str) -> String {
        format!("schedule:{}:{}", self.name, logical_run)
    }

    // The `start` date is applied here and nowhere else: a run belongs to
    // the schedule when its slot's local date is on or after `start` (a slot
    // that DST shifts across midnight keeps the date it was scheduled for).

    fn admits(&self, run: &Run) -> bool {
        self.start.is_none_or(|start| run.date >= start)
    }

    /// The instant no run of the schedule comes before: the local midnight
    /// starting `start`, if any.
    fn earliest(&self) -> Option<DateTime<Utc>> {
        self.start.map(|start| self.timeline.start_of(start))
    }

    /// The schedule's runs with `from <= fire_at < to`, in order.
    pub fn runs_between(&self, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<Run> {
        let from = self.earliest().map_or(from, |e| from.max(e));
        let mut runs = self.timeline.runs_between(from, to);
        runs.retain(|r| self.admits(r));
        runs
    }

    /// The schedule's first run strictly after `t`.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<Run> {
        next_admitted(&self.timeline, self.start, t)
    }
}

/// The first run of `timeline` strictly after `t` whose local date is on or
/// after `start`: the start rule for a timeline known without its
/// [`Schedule`] (the metrics collector reads schedules from the database).
pub fn next_admitted(
    timeline: &Timeline,
    start: Option<NaiveDate>,
    t: DateTime<Utc>,
) -> Option<Run> {
    let admits = |run: &Run| start.is_none_or(|start| run.date >= start);
    let t = start.map_or(t, |s| {
        t.max(timeline.start_of(s) - chrono::Duration::microseconds(1))
    });
    let mut next = timeline.next_after(t)?;
    while !admits(&next) {
        next = timeline.next_after(next.fire_at)?;
    }
    Some(next)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSchedule {
    cron: Spanned<String>,
    timezone: Option<Spanned<String>>,
    kind: Option<Spanned<String>>,
    payload: Option<toml::Value>,
    catchup: Option<Spanned<String>>,
    catchup_window: Option<Spanned<String>>,
    start: Option<Spanned<toml::Value>>,
    overlap: Option<Spanned<String>>,
    max_attempts: Option<Spanned<i64>>,
    priority: Option<Spanned<toml::Value>>,
    enabled: Option<bool>,
    deadline: Option<Spanned<String>>,
}

/// One problem, where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    pub line: usize,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file.display(), self.line, self.message)
    }
}

/// Why a load was rejected: every problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct LoadError(pub Vec<Problem>);

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for p in &self.0 {
            writeln!(f, "{p}")?;
        }
        write!(
            f,
            "schedules rejected: {} problem{}; nothing from them was applied",
            self.0.len(),
            if self.0.len() == 1 { "" } else { "s" }
        )
    }
}

/// Loads every `*.toml` in `dir`, in name order.
pub fn load_dir(dir: &Path) -> Result<Vec<Schedule>, LoadError> {
    let problem = |message: String| {
        LoadError(vec![Problem {
            file: dir.to_path_buf(),
            line: 0,
            message,
        }])
    };
    let entries = std::fs::read_dir(dir).map_err(|e| {
        problem(format!(
            "cannot read the schedules directory ({e}); set --schedules or ALMANAC_SCHEDULES"
        ))
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml") && p.is_file())
        .collect();
    files.sort();
    let mut sources = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file)
            .map_err(|e| problem(format!("cannot read {}: {e}", file.display())))?;
        sources.push((file, text));
    }
    load_sources(&sources)
}

/// Loads schedules from `(file, text)` pairs; names must be unique across all.
pub fn load_sources(sources: &[(PathBuf, String)]) -> Result<Vec<Schedule>, LoadError> {
    let mut problems = Vec::new();
    let mut schedules: Vec<Schedule> = Vec::new();
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    for (file, text) in sources {
        match parse_file(file, text) {
            Ok(found) => {
                for schedule in found {
                    if let Some(first) = seen.get(&schedule.name) {
                        problems.push(Problem {
                            file: file.clone(),
                            line: origin_line(&schedule.origin),
                            message: format!(
                                "schedule `{}` is already defined at {first}; names must be unique across files",
                                schedule.name
                            ),
                        });
                        continue;
                    }
                    seen.insert(schedule.name.clone(), schedule.origin.clone());
                    schedules.push(schedule);
                }
            }
            Err(mut found) => problems.append(&mut found),
        }
    }
    if problems.is_empty() {
        Ok(schedules)
    } else {
        Err(LoadError(problems))
    }
}

fn origin_line(origin: &str) -> usize {
    origin
        .rsplit(':')
        .next()
        .and_then(|l| l.parse().ok())
        .unwrap_or(0)
}

fn parse_file(file: &Path, text: &str) -> Result<Vec<Schedule>, Vec<Problem>> {
    let at = |offset: usize, message: String| Problem {
        file: file.to_path_buf(),
        line: line_col(text, offset).0,
        message,
    };
    let raw: BTreeMap<String, RawSchedule> = toml::from_str(text).map_err(|e| {
        vec![at(
            e.span().map_or(0, |s| s.start),
            e.message().trim().to_string(),
        )]
    })?;
    let mut problems = Vec::new();
    let mut out = Vec::new();
    let headers = header_lines(text);
    for (name, raw) in raw {
        let header = headers.get(&name).copied().unwrap_or(1);
        match validate(&name, raw, &|offset, message| at(offset, message)) {
            Ok(mut schedule) => {
                schedule.origin = format!("{}:{header}", file.display());
                out.push(schedule);
            }
            Err(problem) => problems.push(problem),
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems)
    }
}

/// The line of each `[name]` header, for messages about a schedule as a
/// whole: one pass over the file, however many schedules it holds.
fn header_lines(text: &str) -> BTreeMap<String, usize> {
    let mut lines = BTreeMap::new();
    for (index, line) in text.lines().enumerate() {
        if let Some(inner) = line
            .trim()
            .strip_prefix('[')
            .and_then(|t| t.split(']').next())
        {
            let name = inner.trim().trim_matches(|c| c == '"' || c == '\'');
            lines.entry(name.to_string()).or_insert(index + 1);
        }
    }
    lines
}

fn validate(
    name: &str,
    raw: RawSchedule,
    at: &dyn Fn(usize, String) -> Problem,
) -> Result<Schedule, Problem> {
    let fail = |span: std::ops::Range<usize>, msg: String| {
        at(span.start, format!("schedule `{name}`: {msg}"))
    };
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(fail(
            raw.cron.span(),
            format!("the name `{name}` may use only letters, digits, `-`, `_` and `.`"),
        ));
    }
    let cron =
        CronExpr::parse(raw.cron.get_ref()).map_err(|e| fail(raw.cron.span(), e.to_string()))?;
    let tz: Tz = match &raw.timezone {
        None => chrono_tz::UTC,
        Some(zone) => zone.get_ref().parse().map_err(|_| {
            fail(
                zone.span(),
                format!(
                    "unknown time zone `{}`; use an IANA name such as Asia/Seoul or UTC",
                    zone.get_ref()
                ),
            )
        })?,
    };
    let kind = match &raw.kind {
        Some(kind) if kind.get_ref().trim().is_empty() => {
            return Err(fail(kind.span(), "kind is empty".into()))
        }
        Some(kind) => kind.get_ref().clone(),
        None => name.to_string(),
    };
    let payload = match raw.payload {
        None => serde_json::json!({}),
        Some(value) => serde_json::to_value(value)
            .map_err(|e| fail(raw.cron.span(), format!("payload cannot be JSON: {e}")))?,
    };
    // PostgreSQL's jsonb refuses U+0000; one such payload would fail every
    // sync, and with it every schedule.
    if payload.to_string().contains("\\u0000") {
        return Err(fail(
            raw.cron.span(),
            "payload holds a NUL character (\\u0000), which PostgreSQL cannot store; remove it"
                .into(),
        ));
    }
    let catchup = match raw
        .catchup
        .as_ref()
        .map(|c| (c.get_ref().as_str(), c.span()))
    {
        None | Some(("all", _)) => Catchup::All,
        Some(("latest", _)) => Catchup::Latest,
        Some(("none", _)) => Catchup::None,
        Some((other, span)) => {
            return Err(fail(
                span,
                format!("catchup is `{other}`; use all, latest or none"),
            ))
        }
    };
    let catchup_window = match &raw.catchup_window {
        None => DEFAULT_CATCHUP_WINDOW,
        Some(w) => {
            let d: HumanDuration = w
                .get_ref()
                .parse()
                .map_err(|e: String| fail(w.span(), format!("catchup_window: {e}")))?;
            d.0
        }
    };
    let start = match &raw.start {
        None => None,
        Some(value) => {
            let text = match value.get_ref() {
                toml::Value::String(s) => s.clone(),
                toml::Value::Datetime(d) => d.to_string(),
                other => other.to_string(),
            };
            Some(NaiveDate::parse_from_str(&text, "%Y-%m-%d").map_err(|_| {
                fail(
                    value.span(),
                    format!("start `{text}` is not a date; write YYYY-MM-DD"),
                )
            })?)
        }
    };
    let overlap = match raw
        .overlap
        .as_ref()
        .map(|o| (o.get_ref().as_str(), o.span()))
    {
        None | Some(("allow", _)) => Overlap::Allow,
        Some(("skip", _)) => Overlap::Skip,
        Some((other, span)) => {
            return Err(fail(
                span,
                format!("overlap is `{other}`; use allow or skip"),
            ))
        }
    };
    let max_attempts = match &raw.max_attempts {
        None => 5,
        Some(n) => i32::try_from(*n.get_ref())
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| {
                fail(
                    n.span(),
                    format!("max_attempts is {}; it must be at least 1", n.get_ref()),
                )
            })?,
    };
    let priority = match &raw.priority {
        None => 0,
        Some(value) => priority_of(value.get_ref()).map_err(|e| fail(value.span(), e))?,
    };
    let deadline = match &raw.deadline {
        None => None,
        Some(text) => Some(Deadline::parse(text.get_ref(), tz).map_err(|e| fail(text.span(), e))?),
    };
    Ok(Schedule {
        name: name.to_string(),
        timeline: Timeline::new(cron, tz),
        kind,
        payload,
        catchup,
        catchup_window,
        start,
        overlap,
        max_attempts,
        priority,
        enabled: raw.enabled.unwrap_or(true),
        deadline,
        origin: String::new(),
    })
}

/// A schedule's `priority`: a whole number the queue accepts
/// ([`crate::queue::check_priority`], whose message names the value).
fn priority_of(value: &toml::Value) -> Result<i16, String> {
    use crate::queue::{check_priority, QueueError, MAX_PRIORITY};
    let message = |e: QueueError| match e {
        QueueError::Invalid(m) => m,
        other => other.to_string(),
    };
    match value {
        toml::Value::Integer(n) => match i16::try_from(*n) {
            Ok(p) => check_priority(p).map(|()| p).map_err(message),
            Err(_) => Err(format!(
                "priority is {n}; it must be 0 (the default) to {MAX_PRIORITY}, higher first"
            )),
        },
        other => Err(format!(
            "priority is {other}; it must be a whole number, 0 (the default) to {MAX_PRIORITY}, higher first"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(files: &[(&str, &str)]) -> Result<Vec<Schedule>, String> {
        let sources: Vec<(PathBuf, String)> = files
            .iter()
            .map(|(f, t)| (PathBuf::from(f), t.to_string()))
            .collect();
        load_sources(&sources).map_err(|e| e.to_string())
    }

    #[test]
    fn a_full_schedule_loads_with_defaults_filled_in() {
        let text = r#"
[daily-ingest]
cron = "0 2 * * *"
timezone = "Asia/Seoul"
kind = "daily_ingest"
payload = { source = "s3://bucket/in", retries = 2 }
catchup = "latest"
catchup_window = "7d"
start = "2026-01-01"
overlap = "skip"
max_attempts = 3
deadline = "06:00"

[hourly]
cron = "@hourly"
start = 2026-02-01
deadline = "45m"
"#;
        let all = load(&[("schedules/a.toml", text)]).unwrap();
        assert_eq!(all.len(), 2);
        let daily = &all[0];
        assert_eq!(
            (daily.name.as_str(), daily.kind.as_str()),
            ("daily-ingest", "daily_ingest")
        );
        assert_eq!(
            daily.payload,
            serde_json::json!({"source": "s3://bucket/in", "retries": 2})
        );
        assert_eq!(
            (daily.catchup, daily.overlap, daily.max_attempts),
            (Catchup::Latest, Overlap::Skip, 3)
        );
        assert_eq!(daily.origin, "schedules/a.toml:2");
        assert_eq!(
            daily.job_key("2026-03-01"),
            "schedule:daily-ingest:2026-03-01"
        );
        let hourly = &all[1];
        assert_eq!(
            (hourly.kind.as_str(), hourly.catchup, hourly.enabled),
            ("hourly", Catchup::All, true)
        );
        assert_eq!(hourly.start, NaiveDate::from_ymd_opt(2026, 2, 1));
        assert_eq!(hourly.catchup_window, DEFAULT_CATCHUP_WINDOW);
        // 02:00 KST fires at 17:00Z; its 06:00 KST deadline is 21:00Z.
        let fire: DateTime<Utc> = "2026-03-01T17:00:00Z".parse().unwrap();
        assert_eq!(
            daily.deadline_of(fire).unwrap().to_rfc3339(),
            "2026-03-01T21:00:00+00:00"
        );
        assert_eq!(daily.definition()["deadline"], "06:00");
        assert_eq!(hourly.definition()["deadline"], "45m");
    }

    #[test]
    fn a_schedule_without_a_deadline_keeps_the_definition_it_had_before_deadlines() {
        let all = load(&[("s/a.toml", "[x]\ncron = \"@daily\"\n")]).unwrap();
        assert!(all[0].deadline.is_none());
        assert!(all[0].definition().get("deadline").is_none());
    }

    #[test]
    fn every_kind_of_mistake_is_reported_at_its_line_and_nothing_loads() {
        let good = "[fine]\ncron = \"0 1 * * *\"\n";
        let bad = r#"[a]
cron = "0 25 * * *"

[b]
cron = "0 1 * * *"
timezone = "Mars/Olympus"

[c]
cron = "0 1 * * *"
catchup_window = "a week"

[d]
cron = "0 1 * * *"
start = "2026-13-01"

[e]
cron = "0 1 * * *"
retries = 3

[f]
cron = "0 1 * * *"
deadline = "by noon"
"#;
        let err = load(&[("s/1.toml", good), ("s/2.toml", bad)]).unwrap_err();
        // Unknown keys fail the file's parse before anything else is checked.
        assert_eq!(err, "s/2.toml:18: unknown field `retries`, expected one of `cron`, `timezone`, `kind`, `payload`, `catchup`, `catchup_window`, `start`, `overlap`, `max_attempts`, `priority`, `enabled`, `deadline`\nschedules rejected: 1 problem; nothing from them was applied");

        let bad = bad.replace("retries = 3", "");
        let err = load(&[("s/2.toml", &bad)]).unwrap_err();
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines, vec![
            "s/2.toml:2: schedule `a`: cron `0 25 * * *`: hour 25 is out of range 0-23",
            "s/2.toml:6: schedule `b`: unknown time zone `Mars/Olympus`; use an IANA name such as Asia/Seoul or UTC",
            "s/2.toml:10: schedule `c`: catchup_window: `a week` is not a duration; write a number with a unit: 500ms, 30s, 5m, 2h, 7d (or 1h30m)",
            "s/2.toml:14: schedule `d`: start `2026-13-01` is not a date; write YYYY-MM-DD",
            "s/2.toml:22: schedule `f`: deadline `by noon` is neither a duration (30m, 2h, 1d) nor a local time of day (06:00)",
            "schedules rejected: 5 problems; nothing from them was applied",
        ]);
    }

    #[test]
    fn a_priority_loads_and_a_bad_one_is_refused_naming_file_schedule_and_value() {
        let all = load(&[(
            "s/a.toml",
            "[hot]\ncron = \"@daily\"\npriority = 7\n[plain]\ncron = \"@daily\"\n",
        )])
        .unwrap();
        assert_eq!((all[0].priority, all[1].priority), (7, 0));
        assert_eq!(all[0].definition()["priority"], 7);
        // The default keeps the definition (and its hash) as it was.
        assert!(all[1].definition().get("priority").is_none());

        for (value, says) in [
            ("10", "priority is 10; it must be 0 (the default) to 9, higher first"),
            ("-1", "priority is -1; it must be 0 (the default) to 9, higher first"),
            ("70000", "priority is 70000; it must be 0 (the default) to 9, higher first"),
            (
                "\"high\"",
                "priority is \"high\"; it must be a whole number, 0 (the default) to 9, higher first",
            ),
            (
                "1.5",
                "priority is 1.5; it must be a whole number, 0 (the default) to 9, higher first",
            ),
        ] {
            let err = load(&[(
                "s/b.toml",
                &format!("[ok]\ncron = \"@daily\"\n\n[urgent]\ncron = \"@daily\"\npriority = {value}\n"),
            )])
            .unwrap_err();
            assert_eq!(
                err,
                format!("s/b.toml:6: schedule `urgent`: {says}\nschedules rejected: 1 problem; nothing from them was applied")
            );
        }
    }

    #[test]
    fn a_name_used_twice_across_files_is_rejected() {
        let err = load(&[
            ("s/a.toml", "[x]\ncron = \"@daily\"\n"),
            ("s/b.toml", "\n\n[x]\ncron = \"@hourly\"\n"),
        ])
        .unwrap_err();
        assert!(err.starts_with("s/b.toml:3: schedule `x` is already defined at s/a.toml:1; names must be unique across files"), "{err}");
    }

    #[test]
    fn a_toml_syntax_error_names_its_line() {
        let err = load(&[("s/a.toml", "[x]\ncron = \"@daily\nkind = 1\n")]).unwrap_err();
        assert!(err.starts_with("s/a.toml:2: "), "{err}");
    }

    #[test]
    fn a_payload_postgresql_cannot_store_is_rejected_at_its_line() {
        let err = load(&[(
            "s/a.toml",
            "[x]\ncron = \"@daily\"\npayload = { note = \"a\\u0000b\" }\n",
        )])
        .unwrap_err();
        assert!(
            err.starts_with("s/a.toml:2: schedule `x`: payload holds a NUL character"),
            "{err}"
        );
    }
}
