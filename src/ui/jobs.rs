//! `/jobs` (filters, newest first, keyset pages) and `/jobs/{id}`.

use axum::extract::{Path, Query, State};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::Form;
use maud::{html, Markup};
use serde::Deserialize;

use super::act::{self, Who};
use super::view::{self, csrf, dash, enc, first_line, layout, opt_time, query, time};
use super::{outbox, Page, Ui, UiError};
use crate::control::Source;
use crate::queue::browse::{self, JobQuery};
use crate::queue::{self, JobStatus};

pub(super) const PAGE_SIZE: i64 = 50;

#[derive(Debug, Default, Deserialize)]
pub(super) struct Filters {
    kind: Option<String>,
    status: Option<String>,
    key: Option<String>,
    schedule: Option<String>,
    q: Option<String>,
    before: Option<String>,
}

fn some(v: &Option<String>) -> Option<String> {
    v.as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
}

impl Filters {
    fn to_query(&self) -> Result<JobQuery, UiError> {
        let status = match some(&self.status) {
            Some(s) => Some(s.parse::<JobStatus>().map_err(UiError::BadRequest)?),
            None => None,
        };
        let before = match some(&self.before) {
            Some(b) => Some(b.parse::<i64>().map_err(|_| {
                UiError::BadRequest(format!("before=`{b}` is not a job id; use the page links"))
            })?),
            None => None,
        };
        Ok(JobQuery {
            kind: some(&self.kind),
            status,
            idempotency_key: some(&self.key),
            schedule: some(&self.schedule),
            payload_text: some(&self.q),
            before,
            limit: PAGE_SIZE,
        })
    }

    fn link(&self, before: Option<i64>) -> String {
        let mut pairs = vec![
            ("kind", some(&self.kind)),
            ("status", some(&self.status)),
            ("key", some(&self.key)),
            ("schedule", some(&self.schedule)),
            ("q", some(&self.q)),
        ];
        pairs.push(("before", before.map(|b| b.to_string())));
        format!("/jobs{}", query(&pairs))
    }
}

pub(super) async fn list(State(ui): State<Ui>, Query(f): Query<Filters>) -> Page {
    let q = f.to_query()?;
    let mut tx = ui.read().await?;
    let page = browse::page(&mut tx, &q).await?;
    tx.commit().await?;
    let value = |v: &Option<String>| some(v).unwrap_or_default();
    let body = html! {
        form .filters method="get" action="/jobs" {
            label { "kind" input name="kind" value=(value(&f.kind)); }
            label { "status" select name="status" {
                option value="" { "any" }
                @for s in JobStatus::ALL {
                    option value=(s.as_str()) selected[q.status == Some(s)] { (s.as_str()) }
                }
            } }
            label { "idempotency key" input name="key" value=(value(&f.key)); }
            label { "schedule" input name="schedule" value=(value(&f.schedule)); }
            label { "payload contains" input name="q" value=(value(&f.q)); }
            button type="submit" { "Filter" }
            a href="/jobs" { "clear" }
        }
        (job_table(&page.jobs))
        p .pager {
            @if q.idempotency_key.is_none() {
                span .muted #searched { "Searched ids " (page.searched_from) "–" (page.searched_below - 1) ". " }
            }
            @if q.before.is_some() { a href=(f.link(None)) { "Newest" } " " }
            @if let Some(next) = page.next_before {
                a #older href=(f.link(Some(next))) { "Older →" }
            }
        }
    };
    Ok(Html(layout("Jobs", "/jobs", true, body).into_string()))
}

pub(super) fn job_table(jobs: &[queue::Job]) -> Markup {
    html! {
        @if jobs.is_empty() {
            p .muted #no-jobs { "No jobs match in this range." }
        } @else {
            div .scroll { table #jobs {
                thead { tr {
                    th .num { "id" } th { "kind" } th { "status" } th .num { "priority" } th .num { "attempts" }
                    th { "run at" } th { "schedule / run" } th { "last error" }
                } }
                tbody {
                    @for j in jobs {
                        tr data-id=(j.id) {
                            td .num { a href={"/jobs/" (j.id)} { (j.id) } }
                            td { (j.kind) }
                            td { (view::status(j.status)) }
                            td .num .priority { (j.priority) }
                            td .num { (j.attempts) "/" (j.max_attempts) }
                            td { (time(j.run_at)) }
                            td { @match (&j.schedule, &j.logical_run) {
                                (Some(s), run) => { a href={"/schedules/" (enc(s))} { (s) } " " (run.as_deref().unwrap_or("")) },
                                _ => (dash()),
                            } }
                            td .error { (first_line(j.last_error.as_deref().unwrap_or(""))) }
                        }
                    }
                }
            } }
        }
    }
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct DetailQuery {
    retried: Option<String>,
    cancelled: Option<String>,
}

pub(super) async fn detail(
    State(ui): State<Ui>,
    Path(id): Path<String>,
    Query(dq): Query<DetailQuery>,
) -> Page {
    let id: i64 = id
        .parse()
        .map_err(|_| UiError::NotFound(format!("`{id}` is not a job id.")))?;
    let mut tx = ui.read().await?;
    let job = queue::get(&mut *tx, id).await?;
    let rows = outbox::for_job(&mut tx, id).await?;
    tx.commit().await?;
    let body = html! {
        @if dq.retried.is_some() {
            p .flash #flash { "Retried: the job is ready again with a fresh set of attempts." }
        }
        @if dq.cancelled.is_some() {
            p .flash #flash { @if job.status == JobStatus::Running {
                "Stop requested: the process holding this job stops its handler, and it ends cancelled."
            } @else { "Cancelled." } }
        }
        dl .facts {
            dt { "kind" } dd #kind { (job.kind) }
            dt { "status" } dd #status { (view::status(job.status)) }
            dt { "attempts" } dd #attempts { (job.attempts) " of " (job.max_attempts) }
            dt { "priority" } dd #priority { (job.priority) }
            dt { "run at" } dd { (time(job.run_at)) }
            dt { "created" } dd { (time(job.created_at)) }
            dt { "finished" } dd { (opt_time(job.finished_at)) }
            dt { "lease" } dd {
                @if job.status == JobStatus::Running {
                    "held until " (opt_time(job.lease_until))
                    " (the holder is not recorded; the token is never shown)"
                } @else { (dash()) }
            }
            dt { "idempotency key" } dd { code { (job.effective_idempotency_key()) } }
            dt { "route" } dd { (job.route) }
            dt { "schedule" } dd { @match &job.schedule {
                Some(s) => a href={"/schedules/" (enc(s))} { (s) },
                None => (dash()),
            } }
            dt { "logical run" } dd { (job.logical_run.as_deref().unwrap_or("–")) }
            @if job.cancelled_by.is_some() || job.cancel_requested_at.is_some() {
                dt { "cancel" } dd #cancel-info {
                    @if job.status == JobStatus::Running { "stop requested " } @else { "requested " }
                    (opt_time(job.cancel_requested_at))
                    @if let Some(by) = &job.cancelled_by { " by " (by) }
                    @if let Some(reason) = &job.cancel_reason { ": " (reason) }
                }
            }
        }
        @if matches!(job.status, JobStatus::Ready | JobStatus::Running) {
            @if ui.actions {
                form .cancel method="post" action={"/jobs/" (job.id) "/cancel"} {
                    (csrf(&ui.csrf))
                    input type="text" name="reason" size="30" placeholder="reason (optional)" aria-label="cancel reason";
                    button #cancel type="submit" {
                        @if job.status == JobStatus::Running { "Cancel (stop the running handler)" } @else { "Cancel this job" }
                    }
                }
            } @else { (view::read_only_note()) }
        }
        @if matches!(job.status, JobStatus::Dead | JobStatus::Cancelled) {
            @if ui.actions {
                form method="post" action={"/jobs/" (job.id) "/retry"} {
                    (csrf(&ui.csrf))
                    button #retry type="submit" { "Retry this job" }
                }
            } @else { (view::read_only_note()) }
        }
        h2 { "Last error" }
        @match &job.last_error {
            Some(e) => pre #last-error .error { (e) },
            None => p .muted { "None." },
        }
        h2 { "Payload" }
        (view::pretty_json(&job.payload))
        h2 { "Outbox rows" }
        (outbox::table(&rows))
    };
    Ok(Html(
        layout(&format!("Job {}", job.id), "/jobs", false, body).into_string(),
    ))
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct CancelForm {
    csrf: Option<String>,
    reason: Option<String>,
}

/// Cancels a ready job, or asks the holder of a running one to stop it.
pub(super) async fn cancel(
    State(ui): State<Ui>,
    who: Who,
    Path(id): Path<String>,
    Form(form): Form<CancelForm>,
) -> Response {
    if let Err(e) = ui.admit(form.csrf.as_deref()) {
        return e.into_response();
    }
    let id = match act::job_id(&id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    match act::cancel(&ui, who.actor(Source::Dashboard), id, form.reason).await {
        Ok(queue::Cancel::Finished(job)) => UiError::Conflict(format!(
            "Job {id} had already finished ({}): nothing changed.",
            job.status
        ))
        .into_response(),
        Ok(_) => Redirect::to(&format!("/jobs/{id}?cancelled=1")).into_response(),
        Err(e) => e.into_response(),
    }
}
