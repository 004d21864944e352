//! The relay's `almanac.publish` spans ([`crate::telemetry`]): one per
//! outbox row whose headers carry a `traceparent`, a child of it, from the
//! moment the row is handed to the broker client to its acknowledgement (or
//! failure). The row's `traceparent` header is replaced by the span's own
//! before sending, so a consumer's execution span is a child of the publish.
//! Per row rather than per batch with links: a trace then reads
//! enqueue → publish → execute without a detour through a batch that
//! belongs to no one job. Rows without a `traceparent` get no span (their
//! consumer starts a trace of its own). With tracing off nothing here
//! allocates: the list of spans stays empty.

use super::OutboxRow;
use crate::broker::{PublishError, SinkKind};
use crate::telemetry::{Parent, Span, SpanKind, TraceContext, Tracer, TRACEPARENT_HEADER};

/// Starts a span per traced row of `rows` and puts its context in the
/// row's `traceparent` header; one entry per row (empty when off).
pub(super) fn start(tracer: &Tracer, sink: SinkKind, rows: &mut [OutboxRow]) -> Vec<Option<Span>> {
    if !tracer.is_on() {
        return Vec::new();
    }
    rows.iter_mut()
        .map(|row| {
            let at = row
                .header_names
                .iter()
                .position(|name| name == TRACEPARENT_HEADER)?;
            let parent = TraceContext::parse(&row.header_values[at])?;
            let mut span =
                tracer.start("almanac.publish", SpanKind::Producer, Parent::Child(parent))?;
            span.attr("messaging.system", sink.as_str());
            span.attr("messaging.destination.name", row.destination.clone());
            span.attr("messaging.operation.type", "send");
            span.attr("almanac.job.id", row.job_id);
            span.attr("almanac.outbox.id", row.id);
            span.attr("almanac.publish.attempt", row.attempts);
            row.header_values[at] = span.traceparent();
            Some(span)
        })
        .collect()
}

/// Ends the spans [`start`] began with each row's result.
pub(super) fn end(tracer: &Tracer, spans: Vec<Option<Span>>, results: &[Result<(), PublishError>]) {
    for (span, result) in spans.into_iter().zip(results) {
        let Some(mut span) = span else { continue };
        if let Err(err) = result {
            span.fail(match err {
                PublishError::Retriable { .. } => "not acknowledged; will be retried",
                PublishError::Unroutable { .. } => "unroutable",
                PublishError::Fatal { .. } => "refused for good",
            });
        }
        tracer.end(span);
    }
}
