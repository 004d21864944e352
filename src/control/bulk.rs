//! Bulk actions by filter: retry, cancel or delete every job matching a
//! [`Filter`], as `almanac jobs retry|cancel|delete --kind ... --yes` does.
//!
//! **What is counted is what is acted on, at most.** [`select`] reads the
//! matching ids once (through the status's partial index); the person
//! confirms that count; [`apply`] then acts on those ids only, in batches of
//! [`BATCH`] rows, each batch one short transaction that re-checks the
//! filter under the rows' locks (`SKIP LOCKED`: a row another transaction
//! holds, say a running job's heartbeat, is not waited for; it is tried
//! again after the rest, three times over about a second, and counted as
//! skipped if still held). A job that stopped matching meanwhile (it
//! ran, or someone else retried it) is left as it is and counted as
//! skipped; a job that started matching later is not touched. No long lock:
//! claims, completions and enqueues go on between batches.
//!
//! **One audit row per action**, written before the first batch (count 0)
//! and brought up to date by each batch's own transaction, so it always
//! says exactly how many rows the action changed, even when it stops
//! half-way (an error, Ctrl-C): what the batches did before stays done, and
//! the row says how much that was. Bad input is refused before anything is
//! written.
//!
//! What each action does to a matching job is the single-job action's:
//! retry as [`crate::queue::retry`] (dead or cancelled jobs; an earlier job
//! of a reprocessed scheduled run is refused, left as it is); cancel as
//! [`crate::queue::cancel_in`] (ready ones at once, running ones by request
//! to their holder); delete only finished jobs (`done`, `dead`,
//! `cancelled`): a ready or running job is cancelled, never deleted under a
//! worker.

use std::time::Duration;

use serde::Serialize;
use sqlx::{Connection, PgConnection, Postgres, QueryBuilder};

use super::audit::{self, Action};
use super::{Actor, ControlError};
use crate::queue::{self, JobStatus, CANCEL_CHANNEL};

/// Rows per batch transaction.
pub const BATCH: usize = 1_000;

/// A bulk action.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Bulk {
    Retry,
    Cancel,
    Delete,
}

impl Bulk {
    pub fn as_str(self) -> &'static str {
        match self {
            Bulk::Retry => "retry",
            Bulk::Cancel => "cancel",
            Bulk::Delete => "delete",
        }
    }

    /// The statuses it applies to (the default `--status`, and the only
    /// ones allowed).
    pub fn statuses(self) -> &'static [JobStatus] {
        match self {
            Bulk::Retry => &[JobStatus::Dead, JobStatus::Cancelled],
            Bulk::Cancel => &[JobStatus::Ready, JobStatus::Held, JobStatus::Running],
            Bulk::Delete => &[JobStatus::Done, JobStatus::Dead, JobStatus::Cancelled],
        }
    }
}

/// Which jobs: every given condition must hold.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Filter {
    pub kind: Option<String>,
    /// One status; `None`: every status the action applies to.
    pub status: Option<JobStatus>,
    /// `last_error` contains this text (case-insensitive).
    pub error_like: Option<String>,
    /// Finished (or, for jobs not finished, created) longer ago than this.
    pub older_than: Option<Duration>,
}

impl Filter {
    /// How the filter reads in the audit log and in the confirmation.
    pub fn describe(&self, bulk: Bulk) -> String {
        let statuses = self.statuses(bulk).unwrap_or_default();
        let mut parts = vec![format!(
            "status {}",
            statuses
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("|")
        )];
        if let Some(kind) = &self.kind {
            parts.push(format!("kind {kind}"));
        }
        if let Some(text) = &self.error_like {
            parts.push(format!("error like {text:?}"));
        }
        if let Some(age) = self.older_than {
            parts.push(format!("older than {}s", age.as_secs()));
        }
        format!("jobs where {}", parts.join(", "))
    }

    fn statuses(&self, bulk: Bulk) -> Result<Vec<JobStatus>, ControlError> {
        match self.status {
            None => Ok(bulk.statuses().to_vec()),
            Some(status) if bulk.statuses().contains(&status) => Ok(vec![status]),
            Some(status) => Err(ControlError::Invalid(format!(
                "jobs {} applies to {} jobs, not {status}{}",
                bulk.as_str(),
                bulk.statuses()
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(" or "),
                if bulk == Bulk::Delete {
                    "; cancel ready or running jobs first (jobs cancel)"
                } else {
                    ""
                }
            ))),
        }
    }

    /// ` AND ...` conditions on `j` (the status test is the caller's).
    fn push_conditions(&self, b: &mut QueryBuilder<'static, Postgres>) {
        if let Some(kind) = &self.kind {
            b.push(" AND j.kind = ").push_bind(kind.clone());
        }
        if let Some(text) = &self.error_like {
            b.push(" AND j.last_error ILIKE ")
                .push_bind(crate::queue::browse::like_pattern(text));
        }
        if let Some(age) = self.older_than {
            b.push(" AND coalesce(j.finished_at, j.created_at) < now() - make_interval(secs => ")
                .push_bind(age.as_secs_f64())
                .push(")");
        }
    }

    fn push_status(b: &mut QueryBuilder<'static, Postgres>, statuses: &[JobStatus]) {
        let names: Vec<String> = statuses.iter().map(|s| s.as_str().to_string()).collect();
        b.push(" AND j.status = ANY(").push_bind(names).push(")");
    }
}

/// [`select`]'s statement for one status, after `prefix` (empty, or
/// `EXPLAIN ...`: a test reads its plan on a large table).
pub fn select_query(
    prefix: &str,
    status: JobStatus,
    filter: &Filter,
) -> QueryBuilder<'static, Postgres> {
    let mut b = QueryBuilder::new(format!(
        "{prefix}SELECT j.id FROM almanac.jobs j WHERE j.status = "
    ));
    b.push_bind(status.as_str());
    filter.push_conditions(&mut b);
    b
}

/// The jobs a bulk action would act on, read once.
#[derive(Debug, Clone)]
pub struct Selection {
    pub bulk: Bulk,
    pub filter: Filter,
    /// Ascending.
    pub ids: Vec<i64>,
}

/// Reads the ids matching `filter` for `bulk` (refusing a status the action
/// does not apply to).
pub async fn select(
    conn: &mut PgConnection,
    bulk: Bulk,
    filter: &Filter,
) -> Result<Selection, ControlError> {
    if filter.kind.as_deref().is_some_and(|k| k.trim().is_empty()) {
        return Err(ControlError::Invalid("--kind needs a kind name".into()));
    }
    if filter.error_like.as_deref().is_some_and(str::is_empty) {
        return Err(ControlError::Invalid(
            "--error-like needs some text to look for".into(),
        ));
    }
    let statuses = filter.statuses(bulk)?;
    // One scan per status, so each walks its own partial index.
    let mut ids = Vec::new();
    for status in statuses {
        let found: Vec<i64> = select_query("", status, filter)
            .build_query_scalar()
            .fetch_all(&mut *conn)
            .await?;
        ids.extend(found);
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(Selection {
        bulk,
        filter: filter.clone(),
        ids,
    })
}

/// What [`apply`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BulkReport {
    /// Rows changed (for cancel: cancelled at once or asked to stop).
    pub acted: u64,
    /// Of the selection, rows that no longer matched, were held by another
    /// transaction, or (retry) belong to a superseded scheduled run.
    pub skipped: u64,
    /// The audit row.
    pub audit_id: i64,
}

/// Acts on `selection` as the module doc says; `reason` goes with the audit
/// row (and, for cancel, onto each job); `progress` is told the running
/// total after each batch.
pub async fn apply(
    conn: &mut PgConnection,
    actor: &Actor,
    selection: &Selection,
    reason: Option<&str>,
    mut progress: impl FnMut(u64),
) -> Result<BulkReport, ControlError> {
    let bulk = selection.bulk;
    let statuses = selection.filter.statuses(bulk)?;
    let target = selection.filter.describe(bulk);
    let note = match reason {
        Some(reason) => format!("{} selected; {reason}", selection.ids.len()),
        None => format!("{} selected", selection.ids.len()),
    };
    let audit_id = audit::record_returning(
        &mut *conn,
        actor,
        &Action {
            action: &format!("bulk {}", bulk.as_str()),
            target: &target,
            count: 0,
            note: Some(&note),
        },
    )
    .await?;
    let mut report = BulkReport {
        audit_id,
        ..BulkReport::default()
    };
    // Rows another transaction held (a heartbeat, a claim, an outcome
    // being written): tried again, a few times, once the rest is done.
    let mut busy: Vec<i64> = Vec::new();
    for chunk in selection.ids.chunks(BATCH) {
        let (acted, held) =
            batch(conn, actor, selection, &statuses, reason, audit_id, chunk).await?;
        busy.extend(held);
        report.acted += acted;
        progress(report.acted);
    }
    for pause in BUSY_RETRIES {
        if busy.is_empty() {
            break;
        }
        tokio::time::sleep(pause).await;
        let ids = std::mem::take(&mut busy);
        for chunk in ids.chunks(BATCH) {
            let (acted, held) =
                batch(conn, actor, selection, &statuses, reason, audit_id, chunk).await?;
            busy.extend(held);
            report.acted += acted;
            progress(report.acted);
        }
    }
    report.skipped = selection.ids.len() as u64 - report.acted;
    Ok(report)
}

/// The pauses before each new try at rows that were busy.
const BUSY_RETRIES: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(200),
    Duration::from_millis(1_000),
];

/// One batch in one transaction: what it changed, and the ids of `chunk`
/// that still match but another transaction held.
#[allow(clippy::too_many_arguments)]
async fn batch(
    conn: &mut PgConnection,
    actor: &Actor,
    selection: &Selection,
    statuses: &[JobStatus],
    reason: Option<&str>,
    audit_id: i64,
    chunk: &[i64],
) -> Result<(u64, Vec<i64>), ControlError> {
    let mut tx = conn.begin().await?;
    let locked = lock(&mut tx, chunk, statuses, &selection.filter).await?;
    let acted = match selection.bulk {
        Bulk::Retry => retry(&mut tx, &locked).await?,
        Bulk::Cancel => cancel(&mut tx, &locked, actor, reason).await?,
        Bulk::Delete => delete(&mut tx, &locked).await?,
    };
    sqlx::query("UPDATE almanac.audit_log SET count = count + $2 WHERE id = $1")
        .bind(audit_id)
        .bind(acted as i64)
        .execute(&mut *tx)
        .await?;
    // Of the rows not locked, those that still match (read without locks:
    // they were held, not changed).
    let unlocked: Vec<i64> = chunk
        .iter()
        .copied()
        .filter(|id| locked.binary_search(id).is_err())
        .collect();
    let held = if unlocked.is_empty() {
        Vec::new()
    } else {
        matching(&mut tx, &unlocked, statuses, &selection.filter).await?
    };
    tx.commit().await?;
    Ok((acted, held))
}

/// The ids among `ids` that match, without locking them.
async fn matching(
    tx: &mut PgConnection,
    ids: &[i64],
    statuses: &[JobStatus],
    filter: &Filter,
) -> Result<Vec<i64>, sqlx::Error> {
    let mut b = QueryBuilder::new("SELECT j.id FROM almanac.jobs j WHERE j.id = ANY(");
    b.push_bind(ids.to_vec()).push(")");
    Filter::push_status(&mut b, statuses);
    filter.push_conditions(&mut b);
    b.build_query_scalar().fetch_all(tx).await
}

/// Locks the rows of `chunk` that still match, skipping rows another
/// transaction holds; returns their ids.
async fn lock(
    tx: &mut PgConnection,
    chunk: &[i64],
    statuses: &[JobStatus],
    filter: &Filter,
) -> Result<Vec<i64>, sqlx::Error> {
    let mut b = QueryBuilder::new("SELECT j.id FROM almanac.jobs j WHERE j.id = ANY(");
    b.push_bind(chunk.to_vec()).push(")");
    Filter::push_status(&mut b, statuses);
    filter.push_conditions(&mut b);
    b.push(" ORDER BY j.id FOR UPDATE SKIP LOCKED");
    b.build_query_scalar().fetch_all(tx).await
}

async fn retry(tx: &mut PgConnection, ids: &[i64]) -> Result<u64, ControlError> {
    Ok(queue::browse::retry_locked(tx, ids).await?)
}

async fn cancel(
    tx: &mut PgConnection,
    ids: &[i64],
    actor: &Actor,
    reason: Option<&str>,
) -> Result<u64, ControlError> {
    let changed: Vec<(i64, JobStatus)> = sqlx::query_as(
        r#"
        UPDATE almanac.jobs
        SET status = CASE WHEN status = 'running' THEN status ELSE 'cancelled' END,
            finished_at = CASE WHEN status = 'running' THEN finished_at ELSE clock_timestamp() END,
            cancel_requested_at = coalesce(cancel_requested_at, clock_timestamp()),
            cancelled_by = $2,
            cancel_reason = $3
        WHERE id = ANY($1) AND status IN ('ready', 'held', 'running')
        RETURNING id, status
        "#,
    )
    .bind(ids)
    .bind(actor.to_string())
    .bind(reason.map(crate::queue::storable))
    .fetch_all(&mut *tx)
    .await?;
    let running: Vec<String> = changed
        .iter()
        .filter(|(_, s)| *s == JobStatus::Running)
        .map(|(id, _)| id.to_string())
        .collect();
    if !running.is_empty() {
        sqlx::query("SELECT pg_notify($1, id) FROM unnest($2::text[]) AS u(id)")
            .bind(CANCEL_CHANNEL)
            .bind(&running)
            .execute(&mut *tx)
            .await?;
    }
    Ok(changed.len() as u64)
}

async fn delete(tx: &mut PgConnection, ids: &[i64]) -> Result<u64, ControlError> {
    let deleted = sqlx::query(
        "DELETE FROM almanac.jobs WHERE id = ANY($1) AND status IN ('done', 'dead', 'cancelled')",
    )
    .bind(ids)
    .execute(tx)
    .await?;
    Ok(deleted.rows_affected())
}
