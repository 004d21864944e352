//! Enqueueing: inside the caller's transaction, idempotent by key.

use chrono::{DateTime, Utc};
use serde_json::Value;
use std::collections::{HashMap, HashSet};

use sqlx::PgConnection;

use super::QueueError;

/// Workers `LISTEN` here; enqueue and retry `NOTIFY` with the job's kind, so the
/// notification is delivered exactly when the row becomes visible (on commit).
pub const NOTIFY_CHANNEL: &str = "almanac_jobs";

/// A job to insert. Only `kind` is required.
#[derive(Debug, Clone)]
pub struct NewJob {
    pub kind: String,
    pub payload: Value,
    /// Not before this instant; `None` means now.
    pub run_at: Option<DateTime<Utc>>,
    /// `None` takes the column default (5).
    pub max_attempts: Option<i32>,
    /// A second enqueue with the same key inserts nothing and reports the
    /// existing job.
    pub idempotency_key: Option<String>,
    pub schedule: Option<String>,
    pub logical_run: Option<String>,
    /// 0 (the default) to [`MAX_PRIORITY`]: among a kind's due jobs the
    /// higher is claimed first (see [`super::CLAIM_SQL`] for the bound on
    /// how long a lower one can wait).
    pub priority: i16,
}

/// The highest job priority.
pub const MAX_PRIORITY: i16 = 9;

impl NewJob {
    pub fn new(kind: impl Into<String>) -> Self {
        NewJob {
            kind: kind.into(),
            payload: Value::Object(Default::default()),
            run_at: None,
            max_attempts: None,
            idempotency_key: None,
            schedule: None,
            logical_run: None,
            priority: 0,
        }
    }

    pub fn priority(mut self, priority: i16) -> Self {
        self.priority = priority;
        self
    }

    pub fn payload(mut self, payload: Value) -> Self {
        self.payload = payload;
        self
    }

    pub fn run_at(mut self, at: DateTime<Utc>) -> Self {
        self.run_at = Some(at);
        self
    }

    pub fn max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = Some(n);
        self
    }

    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    fn validate(&self) -> Result<(), QueueError> {
        if self.kind.trim().is_empty() {
            return Err(QueueError::Invalid("the job kind is empty".into()));
        }
        if let Some(n) = self.max_attempts {
            if n < 1 {
                return Err(QueueError::Invalid(format!(
                    "max_attempts is {n}; it must be at least 1"
                )));
            }
        }
        check_priority(self.priority)?;
        if self.idempotency_key.as_deref() == Some("") {
            return Err(QueueError::Invalid(
                "the idempotency key is empty; omit it or give a value".into(),
            ));
        }
        Ok(())
    }
}

/// A priority outside `0..=MAX_PRIORITY` is refused, naming the value.
pub fn check_priority(priority: i16) -> Result<(), QueueError> {
    if (0..=MAX_PRIORITY).contains(&priority) {
        Ok(())
    } else {
        Err(QueueError::Invalid(format!(
            "priority is {priority}; it must be 0 (the default) to {MAX_PRIORITY}, higher first"
        )))
    }
}

/// What an enqueue did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// A new row with this id.
    New(i64),
    /// The idempotency key was taken; this is the job that holds it.
    Existing(i64),
}

impl Enqueued {
    pub fn id(self) -> i64 {
        match self {
            Enqueued::New(id) | Enqueued::Existing(id) => id,
        }
    }
}

/// Inserts one job on the caller's connection or transaction
/// (`&mut *tx`): the job commits or rolls back with the caller's own writes.
pub async fn enqueue(conn: &mut PgConnection, job: &NewJob) -> Result<Enqueued, QueueError> {
    let mut ids = enqueue_many(conn, std::slice::from_ref(job)).await?;
    Ok(ids.remove(0))
}

/// Inserts a batch in one statement; the result is in input order. Jobs whose
/// key is already taken (by an existing row or earlier in the batch) come
/// back as [`Enqueued::Existing`].
pub async fn enqueue_many(
    conn: &mut PgConnection,
    jobs: &[NewJob],
) -> Result<Vec<Enqueued>, QueueError> {
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    for job in jobs {
        job.validate()?;
    }
    let kinds: Vec<&str> = jobs.iter().map(|j| j.kind.as_str()).collect();
    let payloads: Vec<&Value> = jobs.iter().map(|j| &j.payload).collect();
    let run_ats: Vec<Option<DateTime<Utc>>> = jobs.iter().map(|j| j.run_at).collect();
    let max_attempts: Vec<Option<i32>> = jobs.iter().map(|j| j.max_attempts).collect();
    let keys: Vec<Option<&str>> = jobs.iter().map(|j| j.idempotency_key.as_deref()).collect();
    let schedules: Vec<Option<&str>> = jobs.iter().map(|j| j.schedule.as_deref()).collect();
    let runs: Vec<Option<&str>> = jobs.iter().map(|j| j.logical_run.as_deref()).collect();
    let priorities: Vec<i16> = jobs.iter().map(|j| j.priority).collect();

    // One statement, so one round trip: the rows and the NOTIFY for each kind
    // that got a new row. (The count makes PostgreSQL run `notified`, which
    // nothing else reads; with no new row there is nothing to notify.)
    let returned: Vec<(i64, Option<String>)> = sqlx::query_as(
        r#"
        WITH ins AS (
            INSERT INTO almanac.jobs (kind, payload, run_at, max_attempts, idempotency_key, schedule, logical_run, priority)
            SELECT kind, payload, coalesce(run_at, now()), coalesce(max_attempts, 5), key, schedule, logical_run, priority
            FROM unnest($1::text[], $2::jsonb[], $3::timestamptz[], $4::int[], $5::text[], $6::text[], $7::text[], $9::smallint[])
                 WITH ORDINALITY AS t(kind, payload, run_at, max_attempts, key, schedule, logical_run, priority, ord)
            ORDER BY ord
            ON CONFLICT (idempotency_key) DO NOTHING
            RETURNING id, idempotency_key, kind
        ), notified AS (
            SELECT pg_notify($8, k.kind) FROM (SELECT DISTINCT kind FROM ins) k
        )
        SELECT id, idempotency_key FROM ins
        WHERE (SELECT count(*) FROM notified) >= 0
        "#,
    )
    .bind(&kinds)
    .bind(&payloads)
    .bind(&run_ats)
    .bind(&max_attempts)
    .bind(&keys)
    .bind(&schedules)
    .bind(&runs)
    .bind(NOTIFY_CHANNEL)
    .bind(&priorities)
    .fetch_all(&mut *conn)
    .await?;

    // Keyed rows pair up by key. Unkeyed rows pair up by order: identity
    // values are drawn as the ordered SELECT produces its rows.
    let mut new_by_key = HashMap::new();
    let mut unkeyed = Vec::new();
    for (id, key) in returned {
        match key {
            Some(key) => {
                new_by_key.insert(key, id);
            }
            None => unkeyed.push(id),
        }
    }
    unkeyed.sort_unstable();
    let mut unkeyed = unkeyed.into_iter();

    let missing: Vec<&str> = keys
        .iter()
        .flatten()
        .copied()
        .filter(|key| !new_by_key.contains_key(*key))
        .collect();
    let existing: HashMap<String, i64> = if missing.is_empty() {
        HashMap::new()
    } else {
        sqlx::query_as(
            "SELECT idempotency_key, id FROM almanac.jobs WHERE idempotency_key = ANY($1)",
        )
        .bind(&missing)
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .collect()
    };

    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(jobs.len());
    for key in &keys {
        let result = match key {
            None => Enqueued::New(unkeyed.next().ok_or_else(|| {
                QueueError::Invalid("insert returned fewer rows than jobs".into())
            })?),
            Some(key) => match new_by_key.get(*key) {
                Some(&id) if seen.insert(*key) => Enqueued::New(id),
                Some(&id) => Enqueued::Existing(id),
                None => Enqueued::Existing(*existing.get(*key).ok_or_else(|| {
                    QueueError::Invalid(format!(
                        "idempotency key `{key}` conflicted but its job is not visible to this transaction; retry"
                    ))
                })?),
            },
        };
        out.push(result);
    }

    Ok(out)
}
