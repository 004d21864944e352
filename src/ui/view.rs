//! The page frame and small formatting helpers shared by the pages.

use chrono::{DateTime, Utc};
use maud::{html, Markup, PreEscaped, DOCTYPE};

use crate::queue::JobStatus;

const NAV: [(&str, &str); 6] = [
    ("/", "Overview"),
    ("/jobs", "Jobs"),
    ("/dead", "Dead letters"),
    ("/schedules", "Schedules"),
    ("/routes", "Routes"),
    ("/audit", "Audit"),
];

/// A whole page; `refresh` turns on the auto-refresh (the reader can stop it).
pub fn layout(title: &str, active: &str, refresh: bool, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · almanac" }
                link rel="stylesheet" href="/ui/style.css";
                script src="/ui/app.js" defer {}
            }
            body data-refresh=[refresh.then_some("10")] {
                header {
                    a .brand href="/" { "almanac" }
                    nav {
                        @for (href, label) in NAV {
                            a href=(href) .active[href == active] { (label) }
                        }
                    }
                    @if refresh {
                        button #refresh-toggle type="button" { "auto-refresh" }
                    }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

pub fn time(t: DateTime<Utc>) -> Markup {
    html! { time datetime=(t.to_rfc3339()) { (t.format("%Y-%m-%d %H:%M:%SZ")) } }
}

pub fn opt_time(t: Option<DateTime<Utc>>) -> Markup {
    match t {
        Some(t) => time(t),
        None => html! { span .muted { "–" } },
    }
}

/// `3d 4h`, `5m 10s`: the two largest units of a span of seconds.
pub fn age(seconds: f64) -> String {
    crate::config::coarse_age(seconds.round() as i64)
}

/// The outbox of each sink: backlog, in flight, oldest unpublished, failed.
pub fn sink_rows(sinks: &[crate::relay::SinkOutboxStats]) -> Markup {
    html! {
        @for s in sinks {
            tr data-sink=(s.sink) {
                td { (s.sink) }
                td .num data-field="backlog" { (s.backlog) }
                td .num { (s.in_flight) }
                td .num { (age(s.oldest_unpublished_seconds)) }
                td .num data-field="failed" { (s.failed) }
            }
        }
    }
}

pub fn status(s: JobStatus) -> Markup {
    html! { span .badge .(s.as_str()) { (s.as_str()) } }
}

/// The first line of an error, at most 160 characters.
pub fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or("");
    let mut out: String = line.chars().take(160).collect();
    if line.chars().count() > 160 {
        out.push('…');
    }
    out
}

/// Percent-encodes a query value or path segment.
pub fn enc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `?a=1&b=2` from the pairs that have a value.
pub fn query(pairs: &[(&str, Option<String>)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={}", enc(v))))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

/// The hidden CSRF field of an action form.
pub fn csrf(token: &str) -> Markup {
    html! { input type="hidden" name="csrf" value=(token); }
}

/// The note shown where an action would be when actions are off.
pub fn read_only_note() -> Markup {
    html! {
        p .note #read-only {
            "Read-only: start " code { "almanac run --ui-actions" } " to act from here."
        }
    }
}

pub fn pretty_json(value: &serde_json::Value) -> Markup {
    let text = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    html! { pre .json { (text) } }
}

/// Empty cells stay visible in tables.
pub fn dash() -> Markup {
    html! { span .muted { (PreEscaped("&ndash;")) } }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_and_encodings_read_well() {
        assert_eq!(age(0.4), "0s");
        assert_eq!(age(3_725.0), "1h 2m");
        assert_eq!(age(90_061.0), "1d 1h");
        assert_eq!(enc("a b/ü&"), "a%20b%2F%C3%BC%26");
        assert_eq!(
            query(&[("kind", Some("x y".into())), ("s", None)]),
            "?kind=x%20y"
        );
        assert_eq!(first_line("boom\nat line 2"), "boom");
    }
}
