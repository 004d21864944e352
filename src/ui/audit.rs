//! `/audit`: the audit log, newest first, a keyset page on its id
//! ([`crate::control::audit::list`]).

use axum::extract::{Query, State};
use axum::response::Html;
use maud::html;
use serde::Deserialize;

use super::view::{dash, layout, query, time};
use super::{Page, Ui, UiError};
use crate::control::audit;

const PAGE: i64 = 100;

#[derive(Debug, Default, Deserialize)]
pub(super) struct AuditQuery {
    before: Option<String>,
}

pub(super) async fn page(State(ui): State<Ui>, Query(aq): Query<AuditQuery>) -> Page {
    let before = match aq
        .before
        .as_deref()
        .map(str::trim)
        .filter(|b| !b.is_empty())
    {
        Some(b) => Some(b.parse::<i64>().map_err(|_| {
            UiError::BadRequest(format!(
                "before=`{b}` is not an audit row id; use the page links"
            ))
        })?),
        None => None,
    };
    let mut tx = ui.read().await?;
    let entries = audit::list(&mut *tx, PAGE, before).await?;
    tx.commit().await?;
    let older = (entries.len() as i64 == PAGE)
        .then(|| entries.last().map(|e| e.id))
        .flatten();
    let body = html! {
        p .muted { "Every operator action, from the CLI, the dashboard or the API: who, what, on what, how many rows it changed. Newest first." }
        @if entries.is_empty() {
            p .muted #no-entries { "No action has been logged yet." }
        } @else {
            div .scroll { table #audit {
                thead { tr { th { "when" } th { "actor" } th { "source" } th { "action" } th { "target" } th .num { "count" } th { "note" } } }
                tbody {
                    @for e in &entries {
                        tr data-id=(e.id) {
                            td { (time(e.at)) }
                            td .actor { (e.actor) }
                            td .source { (e.source) }
                            td .action { (e.action) }
                            td .target { (e.target) }
                            td .num .count { (e.count) }
                            td .audit-note { @match &e.note { Some(n) => (n), None => (dash()) } }
                        }
                    }
                }
            } }
        }
        p .pager {
            @if before.is_some() { a href="/audit" { "Newest" } " " }
            @if let Some(id) = older { a #older href={"/audit" (query(&[("before", Some(id.to_string()))]))} { "Older →" } }
        }
    };
    Ok(Html(
        layout("Audit log", "/audit", true, body).into_string(),
    ))
}
