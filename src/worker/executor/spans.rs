//! The `almanac.execute` span of each attempt ([`crate::telemetry`]): made
//! when the executor spawns the attempt (so the handler sees its context)
//! and ended when the attempt's flight is settled, with its outcome.

use super::Executed;
use crate::queue::Job;
use crate::telemetry::{Parent, Span, SpanKind, TraceContext, Tracer};

/// The `almanac.execute` span of a job's attempt (`None` when tracing is
/// off): the first attempt joins `via` or the job's trace; a retry starts
/// a trace linked to the job's.
pub(super) fn execution(tracer: &Tracer, job: &Job, via: Option<TraceContext>) -> Option<Span> {
    if !tracer.is_on() {
        return None;
    }
    let enqueued = job.traceparent.as_deref().and_then(TraceContext::parse);
    let parent = match (job.attempts > 1, via.or(enqueued)) {
        (false, Some(parent)) => Parent::Child(parent),
        (true, _) => enqueued.map_or(Parent::Root, Parent::Linked),
        (false, None) => Parent::Root,
    };
    let mut span = tracer.start("almanac.execute", SpanKind::Consumer, parent)?;
    span.attr("almanac.job.id", job.id);
    span.attr("almanac.job.kind", job.kind.clone());
    span.attr("almanac.job.attempt", job.attempts);
    if let Some(schedule) = &job.schedule {
        span.attr("almanac.schedule", schedule.clone());
    }
    if let Some(run) = &job.logical_run {
        span.attr("almanac.logical_run", run.clone());
    }
    Some(span)
}

/// An outcome's name, as spans carry it.
fn outcome_name(executed: Executed) -> &'static str {
    match executed {
        Executed::Completed => "completed",
        Executed::Retried => "retried",
        Executed::Dead => "dead",
        Executed::Lost => "lost",
        Executed::Released => "released",
        Executed::Cancelled => "cancelled",
        Executed::Snoozed => "snoozed",
    }
}

/// Ends `span` with how its attempt ended: an error for every outcome but
/// done and snoozed.
pub(super) fn end(tracer: &Tracer, mut span: Span, executed: Executed) {
    let outcome = outcome_name(executed);
    span.attr("almanac.outcome", outcome);
    if !matches!(executed, Executed::Completed | Executed::Snoozed) {
        span.fail(outcome);
    }
    tracer.end(span);
}
