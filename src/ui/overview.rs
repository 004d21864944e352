//! `/`: the queue by status and kind, the oldest due job per kind, expired
//! leases, the last hour's throughput, the scheduler's leader and the outbox
//! per sink, the paused kinds and the limited ones. The figures are
//! [`Snapshot`]'s, the same as `/metrics` and `almanac stats`. With
//! `--ui-actions`, each kind has a Pause button (with a note), each paused
//! kind a Resume button, each limited kind a Clear button, and a form sets a
//! kind's limits (replacing them, as `almanac limits set` does)
//! ([`super::act`]).

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::response::{Html, IntoResponse, Response};
use axum::Form;
use maud::{html, Markup};
use serde::Deserialize;

use super::act::{self, Who};
use super::view::{age, csrf, dash, enc, layout, opt_time, sink_rows, time};
use super::{Page, Ui, UiError};
use crate::control::pause::{Pause, Paused};
use crate::control::Source;
use crate::queue::limits::Limits;
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
    // kind -> [ready, running, dead, held]
    let mut kinds: BTreeMap<&str, [i64; 4]> = BTreeMap::new();
    for c in &snap.jobs.by_kind_status {
        let slot = match c.status {
            JobStatus::Ready => 0,
            JobStatus::Running => 1,
            JobStatus::Dead => 2,
            JobStatus::Held => 3,
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
            div .card { span .label { @if snap.jobs.done_exact { "done" } @else { "done (estimate)" } } span .value #done-estimate { (snap.jobs.done_estimate) } }
            div .card .warn[snap.jobs.expired_leases > 0] {
                span .label { "expired leases" } span .value #expired-leases { (snap.jobs.expired_leases) }
            }
            div .card { span .label { "oldest due ready" } span .value #oldest-due { (age(snap.jobs.oldest_due_ready_seconds)) } }
        }
        section #paused-kinds {
            h2 { "Paused kinds" }
            @if snap.paused.is_empty() {
                p .muted #no-paused { "No kind is paused." }
            } @else {
                div .scroll { table #paused {
                    thead { tr { th { "kind" } th { "since" } th { "by" } th { "note" } @if ui.actions { th {} } } }
                    tbody {
                        @for p in &snap.paused {
                            tr data-kind=(p.kind) {
                                td { span .badge .paused { "paused" } " " code { (p.kind) } }
                                td { (time(p.paused_at)) }
                                td .by { (p.paused_by) }
                                td .pause-note { (p.note.as_deref().unwrap_or("")) }
                                @if ui.actions { td { (resume_form(&ui, &p.kind)) } }
                            }
                        }
                    }
                } }
            }
            @if ui.actions {
                form .pause-kind method="post" action="/kinds/pause" {
                    (csrf(&ui.csrf))
                    input type="text" name="kind" size="16" placeholder="kind (* for all)" aria-label="kind to pause";
                    input type="text" name="note" size="24" placeholder="note: why" aria-label="pause note";
                    button type="submit" { "Pause kind" }
                }
            }
        }
        section #limited-kinds {
            h2 { "Limited kinds" }
            @if snap.limits.is_empty() {
                p .muted #no-limits { "No kind has limits (almanac limits set)." }
            } @else {
                div .scroll { table #limits {
                    thead { tr { th { "kind" } th { "limits" } th .num { "running now" } th { "since" } th { "by" } @if ui.actions { th {} } } }
                    tbody {
                        @for l in &snap.limits {
                            tr data-kind=(l.limited.kind) {
                                td { span .badge .limited { "limited" } " " code { (l.limited.kind) } }
                                td .limits { (l.limited.limits) }
                                td .num .running { (l.running) }
                                td { (time(l.limited.set_at)) }
                                td .by { (l.limited.set_by) }
                                @if ui.actions { td { (clear_limits_form(&ui, &l.limited.kind)) } }
                            }
                        }
                    }
                } }
            }
            @if ui.actions {
                form .set-limits method="post" action="/kinds/limits" {
                    (csrf(&ui.csrf))
                    input type="text" name="kind" size="14" placeholder="kind" aria-label="kind to limit";
                    input type="text" name="global" size="6" placeholder="global N" aria-label="global limit";
                    input type="text" name="per_key" size="16" placeholder="/customer_id=1" aria-label="per-key limit";
                    input type="text" name="rate" size="8" placeholder="600/1m" aria-label="rate";
                    input type="text" name="burst" size="5" placeholder="burst" aria-label="burst";
                    button type="submit" title="replaces every limit the kind had" { "Set limits" }
                }
            }
        }
        section {
            h2 { "Jobs by kind" }
            @if kinds.is_empty() {
                p .muted { "No ready, running or dead jobs." }
            } @else {
                div .scroll { table #kinds {
                    thead { tr { th { "kind" } th .num { "ready" } th .num { "running" } th .num { "dead" } th .num title="held behind an earlier job of their ordering key" { "held" } th .num { "oldest due" } @if ui.actions { th {} } } }
                    tbody {
                        @for (kind, [ready, running, dead, held]) in &kinds {
                            tr data-kind=(kind) {
                                td { a href={"/jobs?kind=" (enc(kind))} { (kind) }
                                    @if snap.paused.iter().any(|p| p.kind == *kind || p.kind == "*") { " " span .badge .paused { "paused" } }
                                    @if let Some(l) = snap.limits.iter().find(|l| l.limited.kind == *kind) { " " span .badge .limited title=(l.limited.limits) { "limited" } } }
                                td .num data-status="ready" { (ready) }
                                td .num data-status="running" { (running) }
                                td .num data-status="dead" {
                                    @if *dead > 0 { a href={"/dead?kind=" (enc(kind))} { (dead) } } @else { "0" }
                                }
                                td .num data-status="held" { (held) }
                                td .num { @match oldest.get(kind) { Some(s) => (age(*s)), None => (dash()) } }
                                @if ui.actions { td .actions {
                                    @if snap.paused.iter().any(|p| p.kind == *kind) { (resume_form(&ui, kind)) }
                                    @else { (pause_form(&ui, kind)) }
                                } }
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

fn pause_form(ui: &Ui, kind: &str) -> Markup {
    html! {
        form .pause method="post" action={"/kinds/" (enc(kind)) "/pause"} {
            (csrf(&ui.csrf))
            input type="text" name="note" size="14" placeholder="note: why" aria-label="pause note";
            button .pause type="submit" data-kind=(kind) { "Pause" }
        }
    }
}

fn resume_form(ui: &Ui, kind: &str) -> Markup {
    html! {
        form .resume method="post" action={"/kinds/" (enc(kind)) "/resume"} {
            (csrf(&ui.csrf))
            button .resume type="submit" data-kind=(kind) { "Resume" }
        }
    }
}

fn clear_limits_form(ui: &Ui, kind: &str) -> Markup {
    html! {
        form .clear-limits method="post" action={"/kinds/" (enc(kind)) "/limits/clear"} {
            (csrf(&ui.csrf))
            button .clear-limits type="submit" data-kind=(kind) { "Clear limits" }
        }
    }
}

/// The overview's "Set limits" form: the CLI's flags, each optional (an
/// empty field is no limit of that sort).
#[derive(Debug, Default, Deserialize)]
pub(super) struct LimitsForm {
    csrf: Option<String>,
    kind: Option<String>,
    global: Option<String>,
    per_key: Option<String>,
    rate: Option<String>,
    burst: Option<String>,
}

/// Sets the limits the form gives, replacing the kind's.
pub(super) async fn set_limits(
    State(ui): State<Ui>,
    who: Who,
    Form(form): Form<LimitsForm>,
) -> Response {
    if let Err(e) = ui.admit(form.csrf.as_deref()) {
        return e.into_response();
    }
    let kind = form.kind.unwrap_or_default().trim().to_string();
    let given = |v: Option<String>| v.map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    let whole = |what: &str, v: Option<String>| -> Result<Option<i32>, UiError> {
        given(v)
            .map(|v| {
                v.parse()
                    .map_err(|_| UiError::BadRequest(format!("{what} `{v}` is not a whole number")))
            })
            .transpose()
    };
    let limits = (|| -> Result<Limits, UiError> {
        Ok(Limits {
            global: whole("the global limit", form.global)?,
            per_key: given(form.per_key)
                .map(|p| p.parse())
                .transpose()
                .map_err(act::limit_refusal)?,
            rate: given(form.rate)
                .map(|r| r.parse())
                .transpose()
                .map_err(act::limit_refusal)?,
            burst: whole("the burst", form.burst)?.unwrap_or(0),
        })
    })();
    let limits = match limits {
        Ok(l) => l,
        Err(e) => return e.into_response(),
    };
    match act::set_limits(&ui, who.actor(Source::Dashboard), kind.clone(), limits).await {
        Ok(stored) => limits_done(
            "Limits set",
            format!(
                "Kind {kind} is limited to: {} (this replaces every limit it had).",
                stored.limits
            ),
        ),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn clear_limits(
    State(ui): State<Ui>,
    who: Who,
    Path(kind): Path<String>,
    Form(form): Form<KindForm>,
) -> Response {
    if let Err(e) = ui.admit(form.csrf.as_deref()) {
        return e.into_response();
    }
    match act::clear_limits(&ui, who.actor(Source::Dashboard), kind.clone()).await {
        Ok(Some(removed)) => limits_done(
            "Limits cleared",
            format!(
                "Kind {kind} has no limits now (it had: {}).",
                removed.limits
            ),
        ),
        Ok(None) => limits_done(
            "No limits",
            format!("Kind {kind} had no limits; nothing changed."),
        ),
        Err(e) => e.into_response(),
    }
}

fn limits_done(title: &str, message: String) -> Response {
    answer(title, message, html! {})
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct KindForm {
    csrf: Option<String>,
    /// The kind, when the form names it (the "Pause kind" form).
    kind: Option<String>,
    note: Option<String>,
}

/// The page a pause or resume answers with.
fn done(title: &str, message: String, pause: &Pause) -> Response {
    let detail = html! {
        p .muted { "paused " (opt_time(Some(pause.paused_at))) " by " (pause.paused_by)
            @if let Some(note) = &pause.note { ": " (note) } }
    };
    answer(title, message, detail)
}

/// The page a kind's action answers with: what it did, `detail`, the way back.
fn answer(title: &str, message: String, detail: maud::Markup) -> Response {
    let body = html! {
        p .flash #flash { (message) }
        (detail)
        p { a href="/" { "Back to the overview" } " · " a href="/audit" { "audit log" } }
    };
    Html(layout(title, "/", false, body).into_string()).into_response()
}

/// Pauses the kind in the path.
pub(super) async fn pause(
    State(ui): State<Ui>,
    who: Who,
    Path(kind): Path<String>,
    Form(form): Form<KindForm>,
) -> Response {
    pause_kind(ui, who, kind, form).await
}

/// Pauses the kind the form names (the overview's "Pause kind" form).
pub(super) async fn pause_named(
    State(ui): State<Ui>,
    who: Who,
    Form(form): Form<KindForm>,
) -> Response {
    let kind = form.kind.clone().unwrap_or_default().trim().to_string();
    pause_kind(ui, who, kind, form).await
}

async fn pause_kind(ui: Ui, who: Who, kind: String, form: KindForm) -> Response {
    if let Err(e) = ui.admit(form.csrf.as_deref()) {
        return e.into_response();
    }
    match act::pause_kind(&ui, who.actor(Source::Dashboard), kind.clone(), form.note).await {
        Ok(Paused::Now(p)) => done(
            "Paused",
            format!("Kind {kind} is paused: no job of it starts until it is resumed."),
            &p,
        ),
        Ok(Paused::Already(p)) => done(
            "Already paused",
            format!("Kind {kind} was already paused; nothing changed."),
            &p,
        ),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn resume(
    State(ui): State<Ui>,
    who: Who,
    Path(kind): Path<String>,
    Form(form): Form<KindForm>,
) -> Response {
    if let Err(e) = ui.admit(form.csrf.as_deref()) {
        return e.into_response();
    }
    match act::resume_kind(&ui, who.actor(Source::Dashboard), kind.clone()).await {
        Ok(p) => done("Resumed", format!("Kind {kind} is resumed."), &p),
        Err(e) => e.into_response(),
    }
}
