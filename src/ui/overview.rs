//! `/`: the queue by status and kind, the oldest due job per kind, expired
//! leases, the last hour's throughput, the scheduler's leader and the outbox
//! per sink. The figures are [`Snapshot`]'s, the same as `/metrics` and
//! `almanac stats`.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::response::Html;
use maud::html;

use super::view::{age, dash, enc, layout, sink_rows};
use super::{Page, Ui};
use crate::queue::{browse, JobStatus};
use crate::stats::Snapshot;

pub(super) async fn page(State(ui): State<Ui>) -> Page {
    let mut tx = ui.read().await?;
    let snap = Snapshot::read(&mut tx).await?;
    let minutes = browse::throughput(&mut *tx).await?;
    tx.commit().await?;

    let total = |status: JobStatus| -> i64 {
        snap.jobs
            .by_kind_status
            .iter()
            .filter(|c| c.status == status)
            .map(|c| c.count)
            .sum()
    };
    // kind -> [ready, running, dead]
    let mut kinds: BTreeMap<&str, [i64; 3]> = BTreeMap::new();
    for c in &snap.jobs.by_kind_status {
        let slot = match c.status {
            JobStatus::Ready => 0,
            JobStatus::Running => 1,
            JobStatus::Dead => 2,
            JobStatus::Done | JobStatus::Cancelled => continue,
        };
        kinds.entry(c.kind.as_str()).or_default()[slot] += c.count;
    }
    for k in &snap.jobs.oldest_due_ready {
        kinds.entry(k.kind.as_str()).or_default();
    }
    let oldest: BTreeMap<&str, f64> = snap
        .jobs
        .oldest_due_ready
        .iter()
        .map(|k| (k.kind.as_str(), k.seconds))
        .collect();
    let peak = minutes
        .iter()
        .map(|m| m.done + m.dead)
        .max()
        .unwrap_or(0)
        .max(1);
    let hour_done: i64 = minutes.iter().map(|m| m.done).sum();
    let hour_dead: i64 = minutes.iter().map(|m| m.dead).sum();

    let body = html! {
        section .cards {
            div .card { span .label { "ready" } span .value #total-ready { (total(JobStatus::Ready)) } }
            div .card { span .label { "running" } span .value #total-running { (total(JobStatus::Running)) } }
            div .card { span .label { "dead" } span .value #total-dead { (snap.jobs.dead) } }
            div .card { span .label { "done (estimate)" } span .value #done-estimate { (snap.jobs.done_estimate) } }
            div .card .warn[snap.jobs.expired_leases > 0] {
                span .label { "expired leases" } span .value #expired-leases { (snap.jobs.expired_leases) }
            }
            div .card { span .label { "oldest due ready" } span .value #oldest-due { (age(snap.jobs.oldest_due_ready_seconds)) } }
        }
        section {
            h2 { "Jobs by kind" }
            @if kinds.is_empty() {
                p .muted { "No ready, running or dead jobs." }
            } @else {
                div .scroll { table #kinds {
                    thead { tr { th { "kind" } th .num { "ready" } th .num { "running" } th .num { "dead" } th .num { "oldest due" } } }
                    tbody {
                        @for (kind, [ready, running, dead]) in &kinds {
                            tr data-kind=(kind) {
                                td { a href={"/jobs?kind=" (enc(kind))} { (kind) } }
                                td .num data-status="ready" { (ready) }
                                td .num data-status="running" { (running) }
                                td .num data-status="dead" {
                                    @if *dead > 0 { a href={"/dead?kind=" (enc(kind))} { (dead) } } @else { "0" }
                                }
                                td .num { @match oldest.get(kind) { Some(s) => (age(*s)), None => (dash()) } }
                            }
                        }
                    }
                } }
            }
        }
        section {
            h2 { "Throughput, last hour" }
            p { span #hour-done { (hour_done) } " done, " span #hour-dead { (hour_dead) } " dead" }
            div .chart role="img" aria-label="jobs finished per minute over the last hour" {
                @for m in &minutes {
                    div .bar title={(m.minutes_ago) " min ago: " (m.done) " done, " (m.dead) " dead"} {
                        div .dead style={"height:" (m.dead * 100 / peak) "%"} {}
                        div .done style={"height:" (m.done * 100 / peak) "%"} {}
                    }
                }
            }
            p .axis { span { "60 min ago" } span { "now" } }
        }
        section .two {
            div {
                h2 { "Scheduler" }
                @match &snap.leader {
                    Some(l) => p #leader { "Leader: PostgreSQL session " (l.pid) " (" (l.application_name) ", "
                        (l.client_addr.as_deref().unwrap_or("local socket")) "), up " (age(l.session_seconds)) },
                    None => p #leader .warn { "No scheduler holds the leader lock." },
                }
                @if !snap.schedules.is_empty() {
                    div .scroll { table { tbody {
                        @for s in &snap.schedules {
                            tr { td { a href={"/schedules/" (enc(&s.name))} { (s.name) } }
                                 td .num .warn[s.lag_seconds > 60.0] { "lag " (age(s.lag_seconds)) } }
                        }
                    } } }
                }
            }
            div {
                h2 { "Outbox" }
                div .scroll { table #outbox {
                    thead { tr { th { "sink" } th .num { "backlog" } th .num { "in flight" } th .num { "oldest" } th .num { "failed" } } }
                    tbody {
                        (sink_rows(&snap.outbox))
                    }
                } }
            }
        }
    };
    Ok(Html(layout("Overview", "/", true, body).into_string()))
}
