//! `almanac enqueue KIND [--payload JSON] [--key KEY] [--run-at RFC3339] [--max-attempts N]
//! [--priority 0-9] [--ordering-key KEY] [--traceparent HEADER]`

use anyhow::Context as _;
use chrono::{DateTime, Utc};

use super::Ctx;
use crate::queue::{self, Enqueued, NewJob};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The job kind, as handlers are registered.
    kind: String,
    /// The payload, as JSON.
    #[arg(long, env = "ALMANAC_PAYLOAD", default_value = "{}", value_parser = parse_json)]
    payload: serde_json::Value,
    /// Idempotency key: a second enqueue with it inserts nothing.
    #[arg(long, env = "ALMANAC_KEY")]
    key: Option<String>,
    /// Not before this instant (RFC 3339, e.g. 2026-12-01T09:00:00+09:00).
    #[arg(long, env = "ALMANAC_RUN_AT", value_parser = parse_instant)]
    run_at: Option<DateTime<Utc>>,
    /// Attempts before the job is dead (default 5).
    #[arg(long, env = "ALMANAC_MAX_ATTEMPTS", value_parser = clap::value_parser!(i32).range(1..))]
    max_attempts: Option<i32>,
    /// 0 (the default) to 9: among the kind's due jobs the higher is
    /// claimed first, within a bound on how long a lower one waits.
    #[arg(long, env = "ALMANAC_PRIORITY", default_value = "0", allow_negative_numbers = true,
          value_parser = parse_priority)]
    priority: i16,
    /// Jobs of an ordered kind with the same ordering key run one at a
    /// time, in enqueue order (`almanac ordering set KIND` first).
    #[arg(long, env = "ALMANAC_ORDERING_KEY")]
    ordering_key: Option<String>,
    /// The W3C traceparent of the enqueuing request (00-<trace id>-<span
    /// id>-<flags>): the job's spans join its trace. TRACEPARENT, as exec
    /// handlers get it, is read when the flag is not given.
    #[arg(long, env = "TRACEPARENT", value_parser = parse_traceparent)]
    traceparent: Option<String>,
}

/// A traceparent as the queue takes it ([`queue::check_traceparent`]).
pub fn parse_traceparent(s: &str) -> Result<String, String> {
    queue::check_traceparent(s).map_err(|e| match e {
        queue::QueueError::Invalid(m) => m,
        other => other.to_string(),
    })?;
    Ok(s.to_string())
}

/// A priority as the queue takes it: its own message names a value out of
/// range ([`queue::check_priority`]).
pub fn parse_priority(s: &str) -> Result<i16, String> {
    let p: i16 = s.trim().parse().map_err(|_| {
        format!(
            "priority is `{s}`; it must be a whole number, 0 (the default) to {}, higher first",
            queue::MAX_PRIORITY
        )
    })?;
    queue::check_priority(p).map_err(|e| match e {
        queue::QueueError::Invalid(m) => m,
        other => other.to_string(),
    })?;
    Ok(p)
}

pub fn parse_json(s: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(s).map_err(|e| {
        format!("not valid JSON ({e}); quote it for the shell, e.g. --payload '{{\"id\": 42}}'")
    })
}

pub fn parse_instant(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| {
            format!("`{s}` is not an RFC 3339 instant ({e}); write e.g. 2026-12-01T09:00:00Z")
        })
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    let pool = ctx.pool().await?;
    let mut job = NewJob::new(args.kind)
        .payload(args.payload)
        .priority(args.priority);
    job.run_at = args.run_at;
    job.max_attempts = args.max_attempts;
    job.idempotency_key = args.key.clone();
    job.ordering_key = args.ordering_key;
    job.traceparent = args.traceparent;
    let mut conn = pool.acquire().await?;
    let enqueued = queue::enqueue(&mut conn, &job)
        .await
        .context("enqueue failed")?;
    println!("{}", enqueued.id());
    if let Enqueued::Existing(id) = enqueued {
        eprintln!(
            "a job with idempotency key `{}` already exists (id {id}); nothing was enqueued",
            args.key.unwrap_or_default()
        );
    }
    Ok(())
}
