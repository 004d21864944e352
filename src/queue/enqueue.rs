//! Enqueueing: the Rust face of `almanac.enqueue` and `almanac.enqueue_many`,
//! the SQL functions that are the one implementation of enqueue (every
//! language calls them; migrations/0114_enqueue_function.sql, 0115 for
//! their last two parameters, 0134 for `enqueue`'s own one-job insert,
//! 0137 for the route read once per kind instead of by the insert trigger
//! once per row, docs/enqueue.md).
//!
//! What an enqueue guarantees: it runs in the caller's transaction, so the
//! job commits or rolls back with the caller's own rows; a job with an
//! idempotency key that is taken inserts nothing and reports the job that
//! holds it; the kind's route applies and a `dual` or `broker` job gets its
//! outbox row in the same transaction; workers are notified on
//! [`NOTIFY_CHANNEL`] when it commits, never before. An invalid job inserts
//! nothing, and neither does the rest of its batch.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;

use super::QueueError;

/// Workers `LISTEN` here; enqueue and retry `NOTIFY` with the job's kind, so the
/// notification is delivered exactly when the row becomes visible (on commit).
/// (`almanac.enqueue_many` names the channel itself.)
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
    /// Jobs of one ordered kind with the same key run one at a time, in
    /// enqueue order ([`super::ordering`]). `None` on an ordered kind with
    /// a key pointer takes the payload's value there.
    pub ordering_key: Option<String>,
    /// The W3C `traceparent` of the request that enqueued the job: the
    /// job's spans join that trace.
    pub traceparent: Option<String>,
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
            ordering_key: None,
            traceparent: None,
        }
    }

    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    pub fn traceparent(mut self, traceparent: impl Into<String>) -> Self {
        self.traceparent = Some(traceparent.into());
        self
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
            let kind = if self.kind.is_empty() {
                "empty".to_string()
            } else {
                format!("'{}' (white space only)", self.kind)
            };
            return Err(QueueError::Invalid(format!(
                "the job kind is {kind}; give the kind its handlers are registered under"
            )));
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
        if self.ordering_key.as_deref() == Some("") {
            return Err(QueueError::Invalid(
                "the ordering key is empty; omit it or give a value".into(),
            ));
        }
        if let Some(tp) = self.traceparent.as_deref() {
            check_traceparent(tp)?;
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

/// A W3C trace context `traceparent` as `almanac.traceparent_ok` takes it
/// (version 00 exactly; a later version's first four fields, then anything
/// after a `-`; lowercase hex, ids not all zeros, version not `ff`: the
/// parser the tracer reads it with, [`crate::telemetry::TraceContext`]);
/// refused with the function's own message otherwise.
pub fn check_traceparent(tp: &str) -> Result<(), QueueError> {
    if crate::telemetry::TraceContext::parse(tp).is_some() {
        Ok(())
    } else {
        Err(QueueError::Invalid(format!(
            "traceparent '{tp}' is not a W3C trace context header (00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>, \
             lowercase, ids not all zeros); pass the header your tracer formats, or omit it"
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
    /// From the functions' `(id, created)`.
    fn from_row(id: i64, created: bool) -> Self {
        if created {
            Enqueued::New(id)
        } else {
            Enqueued::Existing(id)
        }
    }

    pub fn id(self) -> i64 {
        match self {
            Enqueued::New(id) | Enqueued::Existing(id) => id,
        }
    }
}

/// Inserts one job on the caller's connection or transaction
/// (`&mut *tx`): the job commits or rolls back with the caller's own writes.
/// One call of `almanac.enqueue` (migration 0134: one job without the
/// batch's arrays), or of `almanac.enqueue_many` for a job of a schedule's
/// run, which only that function takes.
pub async fn enqueue(conn: &mut PgConnection, job: &NewJob) -> Result<Enqueued, QueueError> {
    if job.schedule.is_some() || job.logical_run.is_some() {
        let mut ids = enqueue_many(conn, std::slice::from_ref(job)).await?;
        return Ok(ids.remove(0));
    }
    job.validate()?;
    let (id, created): (i64, bool) = sqlx::query_as(ENQUEUE_SQL)
        .bind(&job.kind)
        .bind(&job.payload)
        .bind(job.run_at)
        .bind(job.max_attempts)
        .bind(job.idempotency_key.as_deref())
        .bind(i32::from(job.priority))
        .bind(job.ordering_key.as_deref())
        .bind(job.traceparent.as_deref())
        .fetch_one(&mut *conn)
        .await
        .map_err(refusal)?;
    Ok(Enqueued::from_row(id, created))
}

/// The call [`enqueue`] makes.
pub const ENQUEUE_SQL: &str = "SELECT id, created FROM almanac.enqueue(\
    kind => $1, payload => $2, run_at => $3, max_attempts => $4, idempotency_key => $5, \
    priority => $6, ordering_key => $7, traceparent => $8)";

/// Inserts a batch with one call of `almanac.enqueue_many` (one round
/// trip), the one implementation of enqueue that every language calls
/// (migrations/0114_enqueue_function.sql, docs/enqueue.md): the result is in
/// input order, and jobs whose key is already taken (by an existing row or
/// earlier in the batch) come back as [`Enqueued::Existing`].
///
/// The jobs are checked here first ([`NewJob`]'s rules, the function's own),
/// so that an invalid job is refused before anything is sent and the
/// caller's transaction stays usable; the function checks again and is the
/// authority: its refusal (SQLSTATE 22023) comes back as
/// [`QueueError::Invalid`] with its message, and aborts the transaction, as
/// any error from the database does.
pub async fn enqueue_many(
    conn: &mut PgConnection,
    jobs: &[NewJob],
) -> Result<Vec<Enqueued>, QueueError> {
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    for (i, job) in jobs.iter().enumerate() {
        job.validate().map_err(|err| match err {
            QueueError::Invalid(why) if jobs.len() > 1 => {
                QueueError::Invalid(format!("{why} (job {} of {})", i + 1, jobs.len()))
            }
            other => other,
        })?;
    }
    // An array whose every element would be the default goes as NULL
    // (the function's "all defaults"): less to encode, send and read.
    fn column<'a, T>(
        jobs: &'a [NewJob],
        field: impl Fn(&'a NewJob) -> Option<T>,
    ) -> Option<Vec<Option<T>>> {
        let values: Vec<Option<T>> = jobs.iter().map(field).collect();
        values.iter().any(Option::is_some).then_some(values)
    }
    let kinds: Vec<&str> = jobs.iter().map(|j| j.kind.as_str()).collect();
    let payloads: Vec<&Value> = jobs.iter().map(|j| &j.payload).collect();
    let run_ats = column(jobs, |j| j.run_at);
    let max_attempts = column(jobs, |j| j.max_attempts);
    let keys = column(jobs, |j| j.idempotency_key.as_deref());
    let priorities = column(jobs, |j| (j.priority != 0).then_some(i32::from(j.priority)));
    let schedules = column(jobs, |j| j.schedule.as_deref());
    let runs = column(jobs, |j| j.logical_run.as_deref());
    let ordering_keys = column(jobs, |j| j.ordering_key.as_deref());
    let traceparents = column(jobs, |j| j.traceparent.as_deref());

    let rows: Vec<(i64, i64, bool)> = sqlx::query_as(ENQUEUE_MANY_SQL)
        .bind(&kinds)
        .bind(&payloads)
        .bind(&run_ats)
        .bind(&max_attempts)
        .bind(&keys)
        .bind(&priorities)
        .bind(&schedules)
        .bind(&runs)
        .bind(&ordering_keys)
        .bind(&traceparents)
        .fetch_all(&mut *conn)
        .await
        .map_err(refusal)?;
    if rows.len() != jobs.len() {
        return Err(QueueError::Invalid(format!(
            "almanac.enqueue_many returned {} rows for {} jobs; is the database's migration 0115 the one this build carries?",
            rows.len(),
            jobs.len()
        )));
    }
    Ok(rows
        .into_iter()
        .map(|(_, id, created)| Enqueued::from_row(id, created))
        .collect())
}

/// The call [`enqueue_many`] makes; the rows come back in input order.
pub const ENQUEUE_MANY_SQL: &str = "SELECT ord, id, created FROM almanac.enqueue_many(\
    kinds => $1, payloads => $2, run_ats => $3, max_attempts => $4, idempotency_keys => $5, \
    priorities => $6, schedules => $7, logical_runs => $8, ordering_keys => $9, \
    traceparents => $10) ORDER BY ord";

/// The function's refusals, as the queue's own: an invalid value (SQLSTATE
/// 22023) or an ordered job enqueued under an isolation level it cannot be
/// (0A000, `almanac.jobs_take_route`) is [`QueueError::Invalid`] with the
/// function's message. Anything
/// else stays a database error with its SQLSTATE, the function's 40001 (a
/// key whose holder vanished under the call) included: a caller that
/// retries serialization failures retries it, as it should.
fn refusal(err: sqlx::Error) -> QueueError {
    if let sqlx::Error::Database(db) = &err {
        let raised_by_function = db
            .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .is_some_and(|pg| pg.routine() == Some("exec_stmt_raise"));
        if raised_by_function && matches!(db.code().as_deref(), Some("22023" | "0A000")) {
            return QueueError::Invalid(db.message().to_string());
        }
    }
    QueueError::Db(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The function's refusal is the queue's own; other errors stay
    /// database errors.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn the_functions_refusal_is_an_invalid_job_with_its_message(pool: sqlx::PgPool) {
        let err = sqlx::query("SELECT * FROM almanac.enqueue('mail', priority => 10)")
            .execute(&pool)
            .await
            .unwrap_err();
        match refusal(err) {
            QueueError::Invalid(message) => assert_eq!(
                message,
                "priority is 10; it must be 0 (the default) to 9, higher first"
            ),
            other => panic!("expected Invalid, got {other:?}"),
        }
        let err = sqlx::query("SELECT * FROM almanac.enqueue('mail', 'not json')")
            .execute(&pool)
            .await
            .unwrap_err();
        assert!(matches!(refusal(err), QueueError::Db(_)));
    }
}
