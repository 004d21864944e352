//! `/schedules` and `/schedules/{name}` with its run calendar, and, with
//! `--ui-actions`, the operator's pause (with a note), resume and trigger.
//!
//! The actions are admitted exactly as the retries are ([`Ui::admit`]:
//! actions on, this process's CSRF token; the origin check and basic auth
//! are the router's) and call the functions `almanac schedules
//! pause|resume|trigger` calls ([`crate::control::schedules`], through
//! [`super::act`]), on the definition the scheduler last synced, so their
//! rules are those of the CLI and each writes its audit row. The operator
//! recorded is `USER (dashboard)` behind basic auth, else
//! `anonymous (dashboard)`. Each is idempotent (a second pause says since when, a second
//! trigger finds the run), so the result is a page, not a redirect.
//!
//! The definitions are the ones last synced to the database (what the
//! scheduler runs), lag is the metrics snapshot's, and the calendar's
//! missing cells are `almanac gaps` for the same range
//! ([`crate::scheduler::history::calendar`]).

use std::collections::{BTreeMap, HashMap};

use axum::extract::{Path, Query, State};
use axum::response::{Html, IntoResponse, Response};
use axum::Form;
use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use maud::{html, Markup};
use serde::Deserialize;

use super::act::{self, Who};
use super::view::{age, csrf, dash, enc, layout, time};
use super::{Page, Ui, UiError};
use crate::config::HumanDuration;
use crate::control::Source;
use crate::scheduler::backfill::db_now;
use crate::scheduler::controls::{self, ControlError, Pause, Paused, Triggered};
use crate::scheduler::history::{self, CellState, Synced};
use crate::scheduler::spec::Schedule;
use crate::stats::snapshot;

fn next_fire(s: &Schedule, now: DateTime<Utc>) -> Markup {
    match s.next_after(now) {
        Some(run) if s.enabled => html! {
            span .local { (run.fire_at.with_timezone(&s.timeline.tz()).format("%Y-%m-%d %H:%M:%S %Z")) }
            br; span .muted { (time(run.fire_at)) }
        },
        Some(_) => html! { span .muted { "disabled" } },
        None => html! { span .muted { "never" } },
    }
}

/// The open pauses (`almanac schedules pause`) by schedule.
async fn paused_by_name(
    conn: &mut sqlx::PgConnection,
    names: &[String],
) -> Result<HashMap<String, Pause>, UiError> {
    Ok(controls::paused(conn, names)
        .await
        .map_err(crate::scheduler::backfill::BackfillError::from)?
        .into_iter()
        .map(|p| (p.schedule.clone(), p))
        .collect())
}

/// A pause as text: the dashboard shows it; `almanac schedules resume` ends it.
fn pause_text(p: &Pause) -> String {
    let note = if p.note.is_empty() {
        String::new()
    } else {
        format!(": {}", p.note)
    };
    format!(
        "paused since {} by {}{note}",
        p.since.format("%Y-%m-%d %H:%M:%SZ"),
        p.by
    )
}

fn policy(row: &Synced) -> String {
    let priority = match row.priority {
        0 => String::new(),
        p => format!(", priority {p}"),
    };
    format!(
        "catch-up {} (window {}), overlap {}{priority}",
        row.catchup,
        HumanDuration(std::time::Duration::from_secs_f64(
            row.catchup_window_seconds.max(0.0)
        )),
        row.overlap
    )
}

pub(super) async fn list(State(ui): State<Ui>) -> Page {
    let mut tx = ui.read().await?;
    let rows = history::synced(&mut tx).await?;
    let states: HashMap<String, snapshot::ScheduleState> = snapshot::schedules(&mut tx)
        .await?
        .into_iter()
        .map(|s| (s.name.clone(), s))
        .collect();
    let emitted = history::last_emitted(&mut tx).await?;
    let names: Vec<String> = rows.iter().map(|r| r.name.clone()).collect();
    let paused = paused_by_name(&mut tx, &names).await?;
    let now = db_now(&mut tx).await?;
    tx.commit().await?;
    let body = html! {
        @if rows.is_empty() {
            p .muted { "No schedules synced yet: the scheduler syncs the schedule files when it leads." }
        } @else {
            div .scroll { table #schedules {
                thead { tr { th { "name" } th { "cron" } th { "zone" } th { "next fire" } th { "last emitted" } th .num { "lag" } th { "policy" } th { "paused" } th { "deadline" } th .num { "overdue" } th .num { "missing" }
                    @if ui.actions { th { "actions" } } } }
                tbody {
                    @for row in &rows {
                        tr data-name=(row.name) {
                            td { a href={"/schedules/" (enc(&row.name))} { (row.name) } }
                            td { code { (row.cron) } }
                            td { (row.timezone) }
                            td { @match row.schedule() {
                                Ok(s) => (next_fire(&s, now)),
                                Err(e) => span .error { (e) },
                            } }
                            td { @match emitted.get(&row.name) { Some((run, _)) => (run), None => (dash()) } }
                            td .num { @match states.get(&row.name) { Some(s) => (age(s.lag_seconds)), None => (dash()) } }
                            td .small { (policy(row)) }
                            td .paused { @match paused.get(&row.name) { Some(p) => (pause_text(p)), None => (dash()) } }
                            td { @match &row.deadline { Some(d) => (d), None => (dash()) } }
                            @match states.get(&row.name) {
                                Some(s) => {
                                    td .num .overdue .warn[s.runs.overdue > 0] { (s.runs.overdue) }
                                    td .num .missing .warn[s.runs.missing > 0] { (s.runs.missing) }
                                }
                                None => { td .num { (dash()) } td .num { (dash()) } }
                            }
                            @if ui.actions { td .actions { (actions(&ui, &row.name, paused.contains_key(&row.name), false)) } }
                        }
                    }
                }
            } }
        }
    };
    Ok(Html(
        layout("Schedules", "/schedules", true, body).into_string(),
    ))
}

/// The action forms of one schedule: Pause (with a note) or Resume, and
/// Trigger (the latest due run; on the schedule's own page, or the one
/// named).
fn actions(ui: &Ui, name: &str, paused: bool, name_a_run: bool) -> Markup {
    let base = format!("/schedules/{}", enc(name));
    html! {
        @if paused {
            form .resume method="post" action={(base) "/resume"} {
                (csrf(&ui.csrf))
                button .resume type="submit" data-name=(name) { "Resume" }
            }
        } @else {
            form .pause method="post" action={(base) "/pause"} {
                (csrf(&ui.csrf))
                input type="text" name="note" size="14" placeholder="note: why" aria-label="pause note";
                button .pause type="submit" data-name=(name) { "Pause" }
            }
        }
        form .trigger method="post" action={(base) "/trigger"} {
            (csrf(&ui.csrf))
            @if name_a_run {
                input type="text" name="logical_run" size="30" placeholder="logical run (or the latest due)" aria-label="logical run";
            }
            button .trigger type="submit" data-name=(name) { "Trigger" }
        }
    }
}

/// An action's form fields.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ControlForm {
    csrf: Option<String>,
    note: Option<String>,
    logical_run: Option<String>,
}

impl From<ControlError> for UiError {
    fn from(err: ControlError) -> Self {
        match err {
            ControlError::NotALogicalRun { .. } | ControlError::NothingDue { .. } => {
                UiError::BadRequest(err.to_string())
            }
            ControlError::Ledger(_) | ControlError::Backfill(_) => UiError::Db(err.to_string()),
        }
    }
}

/// The synced definition of `name`: what the scheduler runs.
pub(super) async fn synced(conn: &mut sqlx::PgConnection, name: &str) -> Result<Schedule, UiError> {
    history::synced_one(conn, name)
        .await?
        .ok_or_else(|| UiError::NotFound(format!("No schedule named `{name}` has been synced.")))?
        .schedule()
        .map_err(UiError::BadRequest)
}

/// The page an action answers with: what it did, in the CLI's words.
fn done(name: &str, title: &str, message: String) -> Response {
    let body = html! {
        p .flash #flash { (message) }
        p { a href={"/schedules/" (enc(name))} { "Back to " (name) } " · " a href="/schedules" { "all schedules" } }
    };
    Html(layout(title, "/schedules", false, body).into_string()).into_response()
}

pub(super) async fn pause(
    State(ui): State<Ui>,
    who: Who,
    Path(name): Path<String>,
    Form(form): Form<ControlForm>,
) -> Response {
    if let Err(e) = ui.admit(form.csrf.as_deref()) {
        return e.into_response();
    }
    let note = form.note.unwrap_or_default();
    match act::pause_schedule(&ui, who.actor(Source::Dashboard), name.clone(), note).await {
        Ok(Paused::Now(p)) => {
            tracing::info!(schedule = %name, by = %p.by, "dashboard: paused a schedule");
            done(&name, "Paused", format!("{name}: {}", pause_text(&p)))
        }
        Ok(Paused::Already(p)) => done(
            &name,
            "Already paused",
            format!("{name}: already {}; nothing changed", pause_text(&p)),
        ),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn resume(
    State(ui): State<Ui>,
    who: Who,
    Path(name): Path<String>,
    Form(form): Form<ControlForm>,
) -> Response {
    if let Err(e) = ui.admit(form.csrf.as_deref()) {
        return e.into_response();
    }
    match act::resume_schedule(&ui, who.actor(Source::Dashboard), name.clone()).await {
        Ok(Some(p)) => {
            tracing::info!(schedule = %name, "dashboard: resumed a schedule");
            done(
                &name,
                "Resumed",
                format!("{name}: resumed (was {})", pause_text(&p)),
            )
        }
        Ok(None) => done(
            &name,
            "Not paused",
            format!("{name}: not paused; nothing changed"),
        ),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn trigger(
    State(ui): State<Ui>,
    who: Who,
    Path(name): Path<String>,
    Form(form): Form<ControlForm>,
) -> Response {
    if let Err(e) = ui.admit(form.csrf.as_deref()) {
        return e.into_response();
    }
    let actor = who.actor(Source::Dashboard);
    match act::trigger_schedule(&ui, actor, name.clone(), form.logical_run).await {
        Ok(Triggered::Emitted { run, job_id }) => {
            tracing::info!(schedule = %name, logical_run = %run.logical_run, job_id, "dashboard: triggered a run");
            let body = html! {
                p .flash #flash { (name) ": emitted logical run " (run.logical_run) " as job "
                    a href={"/jobs/" (job_id)} { (job_id) } }
                p { a href={"/schedules/" (enc(&name))} { "Back to " (name) } }
            };
            Html(layout("Triggered", "/schedules", false, body).into_string()).into_response()
        }
        Ok(Triggered::Existed {
            run,
            source,
            job_id,
        }) => done(
            &name,
            "Already there",
            format!(
                "{name}: logical run {} already exists (recorded by {source}{}); nothing emitted",
                run.logical_run,
                job_id.map(|j| format!(", job {j}")).unwrap_or_default()
            ),
        ),
        Err(e) => e.into_response(),
    }
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct DetailQuery {
    /// A missing run the reader clicked: show its backfill command.
    missing: Option<String>,
}

/// The `almanac backfill` command for one run (both bounds inclusive,
/// RFC 3339, so the range is exactly that run).
pub(super) fn backfill_command(name: &str, fire_at: DateTime<Utc>) -> String {
    let at = fire_at.format("%Y-%m-%dT%H:%M:%SZ");
    let name = if name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        name.to_string()
    } else {
        format!("'{}'", name.replace('\'', "'\\''"))
    };
    format!("almanac backfill {name} --from {at} --to {at}")
}

pub(super) async fn detail(
    State(ui): State<Ui>,
    Path(name): Path<String>,
    Query(dq): Query<DetailQuery>,
) -> Page {
    let mut tx = ui.read().await?;
    let row = history::synced_one(&mut tx, &name)
        .await?
        .ok_or_else(|| UiError::NotFound(format!("No schedule named `{name}` has been synced.")))?;
    let schedule = row.schedule().map_err(UiError::BadRequest)?;
    let calendar = history::calendar(&mut tx, &schedule).await?;
    let lag = snapshot::schedules(&mut tx)
        .await?
        .into_iter()
        .find(|s| s.name == name)
        .map(|s| s.lag_seconds);
    let emitted = history::last_emitted(&mut tx).await?;
    let paused = paused_by_name(&mut tx, std::slice::from_ref(&name)).await?;
    let now = db_now(&mut tx).await?;
    tx.commit().await?;

    let tz: Tz = schedule.timeline.tz();
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &calendar.cells {
        *counts.entry(class(&c.state)).or_default() += 1;
    }
    let clicked = dq
        .missing
        .as_ref()
        .and_then(|run| calendar.cells.iter().find(|c| &c.run.logical_run == run));
    let daily = schedule.timeline.is_daily();
    let body = html! {
        dl .facts {
            dt { "cron" } dd { code { (row.cron) } " in " (row.timezone) }
            dt { "kind" } dd { a href={"/jobs?schedule=" (enc(&row.name))} { (row.kind) } }
            dt { "enabled" } dd { (row.enabled) }
            dt { "paused" } dd #paused { @match paused.get(&name) { Some(p) => (pause_text(p)), None => "no" } }
            dt { "next fire" } dd #next-fire { (next_fire(&schedule, now)) }
            dt { "last emitted" } dd { @match emitted.get(&row.name) {
                Some((run, at)) => { (run) " (" (time(*at)) ")" },
                None => (dash()),
            } }
            dt { "lag" } dd #lag { @match lag { Some(l) => (age(l)), None => (dash()) } }
            dt { "policy" } dd { (policy(&row)) }
            dt { "start" } dd { @match row.start { Some(d) => (d), None => (dash()) } }
            dt { "first synced" } dd { (time(row.created_at)) }
        }
        @if ui.actions { div .actions #actions { (actions(&ui, &row.name, paused.contains_key(&name), true)) } }
        h2 { "Run calendar" }
        p .muted {
            @if daily { "The last " (history::CALENDAR_DAYS) " days" } @else { "The last " (calendar.cells.len()) " runs" }
            ", " (tz.name()) " dates. Missing runs are what "
            code { "almanac gaps" } " reports; click one for its backfill command."
        }
        p .legend #legend {
            @for class in ["done", "emitted", "failed", "skipped", "missing", "due", "presync"] {
                span .cell .(class) {} " " (label(class)) " "
                strong data-state=(class) { (counts.get(class).copied().unwrap_or(0)) } " "
            }
        }
        @if let Some(cell) = clicked {
            @if cell.state == CellState::Missing {
                div #backfill .flash {
                    p { "Run " strong { (cell.run.logical_run) } " is missing. To emit it:" }
                    pre #backfill-cmd { (backfill_command(&row.name, cell.run.fire_at)) }
                }
            }
        }
        div .calendar #calendar {
            @for (i, c) in calendar.cells.iter().enumerate() {
                @let local = c.run.fire_at.with_timezone(&tz);
                @let new_day = i == 0 || calendar.cells[i - 1].run.fire_at.with_timezone(&tz).date_naive() != local.date_naive();
                @let text = cell_text(&local, daily, i == 0, new_day);
                @let title = format!("{} · {}{}", c.run.logical_run, describe(&c.state), c.source.as_deref().map(|s| format!(" · {s}")).unwrap_or_default());
                @match &c.state {
                    CellState::Done { job_id } | CellState::Failed { job_id } | CellState::Emitted { job_id } => {
                        a .cell .(class(&c.state)) href={"/jobs/" (job_id)} title=(title) data-run=(c.run.logical_run) { (text) }
                    },
                    CellState::Missing => {
                        a .cell .missing href={"?missing=" (enc(&c.run.logical_run)) "#backfill"} title=(title) data-run=(c.run.logical_run) { (text) }
                    },
                    _ => { span .cell .(class(&c.state)) title=(title) data-run=(c.run.logical_run) { (text) } },
                }
            }
        }
    };
    Ok(Html(
        layout(&format!("Schedule {}", row.name), "/schedules", false, body).into_string(),
    ))
}

/// A cell's label: the day (daily) or the time (sub-daily), with the month
/// or the date where it changes so the calendar can be read without hovering.
fn cell_text(local: &DateTime<Tz>, daily: bool, first: bool, new_day: bool) -> String {
    match (
        daily,
        first || local.format("%d").to_string() == "01",
        new_day,
    ) {
        (true, true, _) => local.format("%b %-d").to_string(),
        (true, false, _) => local.format("%d").to_string(),
        (false, _, true) => local.format("%b %-d %H:%M").to_string(),
        (false, _, false) => local.format("%H:%M").to_string(),
    }
}

fn label(class: &str) -> &'static str {
    match class {
        "done" => "done",
        "emitted" => "emitted",
        "failed" => "failed",
        "skipped" => "skipped",
        "missing" => "missing",
        "due" => "due now",
        _ => "before history",
    }
}

fn describe(state: &CellState) -> String {
    match state {
        CellState::Emitted { job_id } => format!("emitted, job {job_id} not finished"),
        CellState::Done { job_id } => format!("done, job {job_id}"),
        CellState::Failed { job_id } => format!("failed, job {job_id} is dead"),
        CellState::JobDeleted => "emitted, job deleted by retention".into(),
        CellState::Skipped { reason } => format!("skipped ({reason})"),
        CellState::Missing => "missing".into(),
        CellState::BeforeHistory => {
            "before the schedule's history (its first sync or earliest ledger row)".into()
        }
        CellState::Disabled => {
            "skipped (disabled or paused; recorded when the scheduler next plans it)".into()
        }
        CellState::Due => "due now; the scheduler emits it at its next tick".into(),
    }
}

/// The CSS class (and legend key) the calendar draws a run's state with.
fn class(state: &CellState) -> &'static str {
    match state {
        CellState::Emitted { .. } | CellState::JobDeleted => "emitted",
        CellState::Done { .. } => "done",
        CellState::Failed { .. } => "failed",
        CellState::Skipped { .. } | CellState::Disabled => "skipped",
        CellState::Missing => "missing",
        CellState::BeforeHistory => "presync",
        CellState::Due => "due",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backfill_commands_cover_exactly_the_run_and_quote_odd_names() {
        let at: DateTime<Utc> = "2026-11-20T02:00:00Z".parse().unwrap();
        assert_eq!(
            backfill_command("nightly-report", at),
            "almanac backfill nightly-report --from 2026-11-20T02:00:00Z --to 2026-11-20T02:00:00Z"
        );
        assert!(backfill_command("it's mine", at).starts_with("almanac backfill 'it'\\''s mine' "));
    }
}
