//! `/routes`: each kind's mode, sink and destination and its outbox
//! backlog; the outbox per sink (with how long its oldest due row has
//! waited), and failed rows.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::response::Html;
use maud::html;

use super::view::{dash, enc, layout, sink_rows};
use super::{outbox, Page, Ui, UiError};
use crate::relay::outbox as relay_outbox;
use crate::relay::routes;
use crate::stats::snapshot;

const FAILED_ROWS: i64 = 50;

pub(super) async fn page(State(ui): State<Ui>) -> Page {
    let mut tx = ui.read().await?;
    let routes = routes::list(&mut tx)
        .await
        .map_err(|e| UiError::Db(e.to_string()))?;
    let backlog: BTreeMap<String, i64> = outbox::backlog_by_kind(&mut tx).await?;
    let sinks = relay_outbox::stats(&mut tx).await?;
    let unserved = snapshot::unserved_routes(&mut tx).await?;
    let unconsumed = crate::consumer::presence::gaps(&mut tx).await?;
    let failed = outbox::failed(&mut tx, FAILED_ROWS).await?;
    tx.commit().await?;
    let body = html! {
        @for u in &unserved {
            p .warn .unserved data-kind=(u.kind) {
                "Kind " code { (u.kind) } " is routed (" (u.mode) ") to " (u.sink)
                ", but no relay for " (u.sink) " is running: its jobs wait in the outbox"
                @if u.mode == "broker" { " and nothing runs them" }
                ". Start one with " code { "almanac run --roles relay" } " and the " (u.sink) " settings."
            }
        }
        @for g in &unconsumed {
            p .warn .unconsumed data-kind=(g.kind) { (g.describe()) "." }
        }
        @if routes.is_empty() {
            p .muted { "No routes set: every kind runs from the database (mode db). Set one with "
                code { "almanac route set KIND --mode dual --sink kafka --destination TOPIC" } "." }
        } @else {
            div .scroll { table #routes {
                thead { tr { th { "kind" } th { "mode" } th { "sink" } th { "destination" } th .num { "backlog" } } }
                tbody {
                    @for r in &routes {
                        @let b = backlog.get(&r.kind);
                        tr data-kind=(r.kind) {
                            td { a href={"/jobs?kind=" (enc(&r.kind))} { (r.kind) } }
                            td { span .badge .(r.mode) { (r.mode) } }
                            td { @match &r.sink { Some(s) => (s), None => (dash()) } }
                            td { @match &r.destination { Some(d) => code { (d) }, None => (dash()) } }
                            td .num data-field="backlog" { (b.copied().unwrap_or(0)) }
                        }
                    }
                }
            } }
        }
        h2 { "Outbox per sink" }
        div .scroll { table #sinks {
            thead { tr { th { "sink" } th .num { "backlog" } th .num { "in flight" } th .num { "oldest unpublished" } th .num { "failed" } } }
            tbody {
                (sink_rows(&sinks))
            }
        } }
        h2 { "Failed rows" }
        p .muted { "Rows the broker rejected for good (their jobs went dead); the newest " (FAILED_ROWS) "." }
        div #failed { (outbox::table(&failed)) }
    };
    Ok(Html(layout("Routes", "/routes", true, body).into_string()))
}
