//! `/dead`: dead jobs grouped by kind and the first line of their error;
//! one group's newest jobs; retry one, or retry a whole group after a
//! confirmation page that shows how many jobs it takes.

use axum::extract::{Path, Query, State};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::Form;
use maud::html;
use serde::Deserialize;

use super::act::{self, Who};
use super::jobs::job_table;
use super::view::{self, csrf, dash, layout, opt_time, query};
use super::{Page, Ui, UiError};
use crate::control::Source;
use crate::queue::browse::{self, DeadFilter};

const GROUPS: i64 = 200;
const GROUP_JOBS: i64 = 50;

#[derive(Debug, Default, Deserialize)]
pub(super) struct GroupQuery {
    kind: Option<String>,
    /// The exact first line of the error; present but empty means "no error".
    error: Option<String>,
}

impl GroupQuery {
    fn filter(&self) -> DeadFilter {
        DeadFilter {
            kind: self.kind.clone().filter(|k| !k.is_empty()),
            error: self.error.clone(),
        }
    }
}

fn group_link(path: &str, f: &DeadFilter) -> String {
    format!(
        "{path}{}",
        query(&[("kind", f.kind.clone()), ("error", f.error.clone())])
    )
}

pub(super) async fn page(State(ui): State<Ui>, Query(gq): Query<GroupQuery>) -> Page {
    let filter = gq.filter();
    let mut tx = ui.read().await?;
    let groups = browse::dead_groups(&mut *tx, GROUPS).await?;
    let total = browse::dead_count(&mut tx, &DeadFilter::default()).await?;
    let sampled = total > browse::DEAD_SAMPLE;
    let selected = if filter != DeadFilter::default() {
        Some((
            browse::dead_count(&mut tx, &filter).await?,
            browse::dead_list(&mut tx, &filter, GROUP_JOBS).await?,
        ))
    } else {
        None
    };
    tx.commit().await?;
    let body = html! {
        p { span #dead-total { (total) } " dead jobs"
            @if sampled { "; the newest " (browse::DEAD_SAMPLE) " of them, of every kind," }
            " in " (groups.len()) " groups"
            @if groups.len() as i64 == GROUPS { " (the largest " (GROUPS) " shown)" } "." }
        @if groups.is_empty() {
            p .muted { "No dead jobs." }
        } @else {
            div .scroll { table #groups {
                thead { tr { th { "kind" } th { "error (first line)" }
                    th .num { @if sampled { "of the newest " (browse::DEAD_SAMPLE) } @else { "jobs" } }
                    th { "last died" } th {} } }
                tbody {
                    @for g in &groups {
                        @let f = DeadFilter { kind: Some(g.kind.clone()), error: Some(g.error.clone()) };
                        tr data-kind=(g.kind) {
                            td { (g.kind) }
                            td .error { @if g.error.is_empty() { (dash()) } @else { (g.error) } }
                            td .num data-field="count" { (g.count) }
                            td { (opt_time(g.last_finished)) }
                            td { a .show href=(group_link("/dead", &f)) { "show" }
                                @if ui.actions { " · " a .retry-group href=(group_link("/dead/retry", &f)) { "retry all…" } } }
                        }
                    }
                }
            } }
        }
        @if let Some((count, jobs)) = &selected {
            h2 #selected { @if let Some(k) = &filter.kind { (k) } @else { "all kinds" }
                @if let Some(e) = &filter.error { ": " (e) } }
            p { span #selected-count { (count) } " dead jobs match"
                @if (*count) > GROUP_JOBS { "; the newest " (GROUP_JOBS) " are listed" } "." }
            @if ui.actions {
                p { a .button #retry-all href=(group_link("/dead/retry", &filter)) { "Retry all " (count) "…" } }
            } @else { (view::read_only_note()) }
            (job_table(jobs))
            @if ui.actions {
                div .actions {
                    @for j in jobs {
                        form method="post" action={"/jobs/" (j.id) "/retry"} {
                            (csrf(&ui.csrf))
                            button .retry-one type="submit" data-id=(j.id) { "Retry " (j.id) }
                        }
                    }
                }
            }
        }
        form .filters method="get" action="/dead" {
            label { "kind" input name="kind" value=(filter.kind.clone().unwrap_or_default()); }
            button type="submit" { "Show" }
        }
    };
    Ok(Html(
        layout("Dead letters", "/dead", true, body).into_string(),
    ))
}

/// The confirmation step of a bulk retry: how many jobs, and the form.
pub(super) async fn confirm(State(ui): State<Ui>, Query(gq): Query<GroupQuery>) -> Response {
    if !ui.actions {
        return UiError::Forbidden(super::ACTIONS_OFF.into()).into_response();
    }
    let filter = gq.filter();
    let count = async {
        let mut tx = ui.read().await?;
        let n = browse::dead_count(&mut tx, &filter).await?;
        tx.commit().await?;
        Ok::<_, UiError>(n)
    }
    .await;
    let count = match count {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    let body = html! {
        p #confirm-text {
            "Retry " strong #confirm-count { (count) } " dead jobs"
            @if let Some(k) = &filter.kind { " of kind " code { (k) } }
            @if let Some(e) = &filter.error { " whose error starts " code { (e) } }
            "? Each gets a fresh set of attempts and is due now."
        }
        form method="post" action="/dead/retry" {
            (csrf(&ui.csrf))
            @if let Some(k) = &filter.kind { input type="hidden" name="kind" value=(k); }
            @if let Some(e) = &filter.error { input type="hidden" name="error" value=(e); input type="hidden" name="has_error" value="1"; }
            input type="hidden" name="expected" value=(count);
            button #confirm type="submit" { "Retry " (count) " jobs" }
            " " a href=(group_link("/dead", &filter)) { "Cancel" }
        }
    };
    Html(layout("Retry dead jobs", "/dead", false, body).into_string()).into_response()
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct ActionForm {
    csrf: Option<String>,
    kind: Option<String>,
    error: Option<String>,
    has_error: Option<String>,
    expected: Option<String>,
}

pub(super) async fn retry_all(
    State(ui): State<Ui>,
    who: Who,
    Form(form): Form<ActionForm>,
) -> Response {
    if let Err(e) = ui.admit(form.csrf.as_deref()) {
        return e.into_response();
    }
    let filter = DeadFilter {
        kind: form.kind.clone().filter(|k| !k.is_empty()),
        error: if form.has_error.is_some() {
            Some(form.error.clone().unwrap_or_default())
        } else {
            None
        },
    };
    let n = match act::retry_group(&ui, who.actor(Source::Dashboard), filter.clone()).await {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    let expected = form.expected.unwrap_or_default();
    let jobs_link = format!(
        "/jobs{}",
        query(&[
            ("status", Some("ready".into())),
            ("kind", filter.kind.clone())
        ])
    );
    let body = html! {
        p .flash #flash { "Retried " span #retried { (n) } " dead jobs"
            @if expected != n.to_string() { " (" (expected) " were shown when you confirmed; the group changed meanwhile)" }
            "." }
        p { a href="/dead" { "Back to dead letters" } " · "
            a href=(jobs_link) { "ready jobs" } }
    };
    Html(layout("Retried", "/dead", false, body).into_string()).into_response()
}

pub(super) async fn retry_one(
    State(ui): State<Ui>,
    who: Who,
    Path(id): Path<String>,
    Form(form): Form<ActionForm>,
) -> Response {
    if let Err(e) = ui.admit(form.csrf.as_deref()) {
        return e.into_response();
    }
    let id = match act::job_id(&id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    match act::retry(&ui, who.actor(Source::Dashboard), id).await {
        Ok(_) => Redirect::to(&format!("/jobs/{id}?retried=1")).into_response(),
        Err(e) => e.into_response(),
    }
}
