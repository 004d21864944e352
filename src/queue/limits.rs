//! Per-kind limits: flow control that holds across the whole cluster.
//!
//! A kind may have any of three limits (`almanac.kind_limits`, changed live
//! with `almanac limits set`, audited):
//!
//! - **global**: at no instant do more than N jobs of the kind run, across
//!   every worker and broker consumer process;
//! - **per key**: at most N run per value of the payload at a JSON pointer
//!   (`/customer_id`). Jobs whose payload has no value there share one
//!   bucket of their own, limited like any key. Values compare as text
//!   (`42` and `"42"` are one key);
//! - **rate**: at most `rate + burst` jobs start in any window `[t, t +
//!   period)`: a token bucket of `max(burst, 1)` tokens refilled at `rate`
//!   per period, full when the limit is set.
//!
//! **One fence for every path.** A job starts only by a claim that sets it
//! `running`: a worker's [`super::claim`] (also in `dual` mode) or a broker
//! consumer's [`super::claim_by_id`]. Both take their budget from
//! `almanac.claim_budgets` (migration 0110; 0113 skips the per-key count when
//! no key can reach its limit), which locks the kind's limit
//! row until the claim commits and counts, with a snapshot taken after the
//! lock, the kind's running jobs whose lease is unexpired. So claims of a
//! limited kind are made one at a time, each seeing every earlier one; a
//! process that dies holds its slots only until its leases run out, not
//! until the reaper comes.
//!
//! **Nothing is lost or charged.** A worker simply does not claim what a
//! limit holds back; a consumer that meets a limited job keeps its message
//! unacknowledged and tries again shortly
//! ([`super::ClaimById::Limited`]). No attempt is used.
//!
//! **No collateral delay.** A kind's budget caps only its own walk in the
//! claim; unlimited kinds in the same claim are walked as before. A claim
//! never waits for a limit's lock: a limit row another claim holds gives
//! its kind nothing in this claim, and the claim's other kinds go on. A
//! worker with limited kinds claims again as soon as one of its own jobs
//! ends and polls every 100 ms (a limit's slots free up in other processes
//! too, and a rate's tokens refill with time).
//!
//! **On Kafka, a held message holds its partition.** A Kafka consumer
//! handles its partition's messages in order, so a job held back by a
//! limit holds back every message behind it on that partition, of any kind
//! (and commits stop until it starts). Under a per-key limit, one busy key
//! then slows its whole partition: route a kind with a per-key limit to a
//! topic of its own, or to RabbitMQ, whose consumers pass a held message to
//! the tail of the queue.
//!
//! **Limits.** A per-key kind's claim looks at its first
//! [`super::PER_KEY_WINDOW`] due jobs; if all of them belong to keys at
//! their limit, none of the kind is claimed until one ends. A change of
//! limits applies to claims that start after it commits; jobs already
//! running are never stopped. Processes older than migration 0110 know no
//! limits: upgrade every worker and consumer before setting one.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgExecutor;

use super::QueueError;
use crate::config::HumanDuration;

/// One kind's limits, as set.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Limits {
    pub global: Option<i32>,
    pub per_key: Option<PerKey>,
    pub rate: Option<Rate>,
    /// Starts allowed above the steady rate in one period.
    pub burst: i32,
}

/// At most `limit` running per value of the payload at `pointer`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PerKey {
    pub pointer: String,
    pub limit: i32,
}

/// At most `count` starts per `period` (plus the burst).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Rate {
    pub count: i32,
    #[serde(serialize_with = "serialize_period")]
    pub period: Duration,
}

fn serialize_period<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&HumanDuration(*d).to_string())
}

/// A kind's limits with who set them, as `limits list` shows them.
#[derive(Debug, Clone, Serialize)]
pub struct KindLimits {
    pub kind: String,
    #[serde(flatten)]
    pub limits: Limits,
    pub set_at: DateTime<Utc>,
    pub set_by: String,
}

impl Limits {
    pub fn is_empty(&self) -> bool {
        self.global.is_none() && self.per_key.is_none() && self.rate.is_none()
    }

    /// Refuses what `almanac.kind_limits` would, naming the value.
    pub fn validate(&self) -> Result<(), QueueError> {
        // First: a burst alone is this mistake, not a missing limit.
        if self.burst > 0 && self.rate.is_none() {
            return Err(QueueError::Invalid(format!(
                "a burst of {} without a rate: the burst is the starts allowed above a rate; give --rate too",
                self.burst
            )));
        }
        if self.is_empty() {
            return Err(QueueError::Invalid(
                "no limit given: set at least one of a global limit, a per-key limit or a rate"
                    .into(),
            ));
        }
        if let Some(n) = self.global {
            positive("the global limit", n)?;
        }
        if let Some(per_key) = &self.per_key {
            positive("the per-key limit", per_key.limit)?;
            pointer_path(&per_key.pointer)?;
        }
        if let Some(rate) = &self.rate {
            positive("the rate", rate.count)?;
            if rate.period.as_millis() == 0 {
                return Err(QueueError::Invalid(
                    "the rate's period is zero; give one of at least a millisecond, e.g. 600/1m"
                        .into(),
                ));
            }
        }
        if self.burst < 0 {
            return Err(QueueError::Invalid(format!(
                "the burst is {}; it must be 0 or more",
                self.burst
            )));
        }
        Ok(())
    }
}

fn positive(what: &str, n: i32) -> Result<(), QueueError> {
    if n > 0 {
        Ok(())
    } else {
        Err(QueueError::Invalid(format!(
            "{what} is {n}; it must be at least 1 (to stop a kind, pause it: almanac kinds pause)"
        )))
    }
}

impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(n) = self.global {
            parts.push(format!("global {n}"));
        }
        if let Some(per_key) = &self.per_key {
            parts.push(format!("per key {}={}", per_key.pointer, per_key.limit));
        }
        if let Some(rate) = &self.rate {
            parts.push(format!("rate {rate} burst {}", self.burst));
        }
        f.write_str(&parts.join(", "))
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, HumanDuration(self.period))
    }
}

impl std::str::FromStr for Rate {
    type Err = QueueError;

    /// `600/1m`, `10/1s`, `5000/1h`: starts per period.
    fn from_str(s: &str) -> Result<Rate, QueueError> {
        let bad = |why: &str| {
            QueueError::Invalid(format!(
                "the rate `{s}` {why}; write STARTS/PERIOD, e.g. 600/1m or 10/1s"
            ))
        };
        let (count, period) = s.split_once('/').ok_or_else(|| bad("has no `/`"))?;
        let count: i32 = count
            .trim()
            .parse()
            .map_err(|_| bad("does not start with a whole number of starts"))?;
        let period = period
            .trim()
            .parse::<HumanDuration>()
            .map_err(|e| bad(&format!("has a period that does not parse ({e})")))?
            .0;
        let rate = Rate { count, period };
        positive("the rate", count)?;
        if period < Duration::from_millis(1) {
            return Err(bad("has a period under a millisecond"));
        }
        if i64::try_from(period.as_millis()).is_err() {
            return Err(bad("has a period too long"));
        }
        Ok(rate)
    }
}

impl std::str::FromStr for PerKey {
    type Err = QueueError;

    /// `/customer_id=1`: a JSON pointer, `=`, the limit.
    fn from_str(s: &str) -> Result<PerKey, QueueError> {
        let (pointer, limit) = s.rsplit_once('=').ok_or_else(|| {
            QueueError::Invalid(format!(
                "the per-key limit `{s}` has no `=`; write JSON_POINTER=N, e.g. /customer_id=1"
            ))
        })?;
        let limit: i32 = limit.trim().parse().map_err(|_| {
            QueueError::Invalid(format!(
                "the per-key limit `{s}` does not end in a whole number; write JSON_POINTER=N, e.g. /customer_id=1"
            ))
        })?;
        positive("the per-key limit", limit)?;
        pointer_path(pointer)?;
        Ok(PerKey {
            pointer: pointer.to_string(),
            limit,
        })
    }
}

/// A JSON pointer (RFC 6901) as the path `#>>` takes: `/a/b~1c` is
/// `{a,b/c}`. Refused, naming it: an empty pointer (the whole payload is
/// not a key), one not starting with `/`, a `~` not followed by 0 or 1.
pub fn pointer_path(pointer: &str) -> Result<Vec<String>, QueueError> {
    let bad = |why: &str| {
        QueueError::Invalid(format!(
            "the JSON pointer `{pointer}` {why}; write one like /customer_id or /account/id (RFC 6901)"
        ))
    };
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(bad(if pointer.is_empty() {
            "is empty"
        } else {
            "does not start with `/`"
        }));
    };
    rest.split('/')
        .map(|token| {
            let mut out = String::with_capacity(token.len());
            let mut chars = token.chars();
            while let Some(c) = chars.next() {
                match c {
                    '~' => match chars.next() {
                        Some('0') => out.push('~'),
                        Some('1') => out.push('/'),
                        _ => return Err(bad("has a `~` not followed by 0 or 1")),
                    },
                    c => out.push(c),
                }
            }
            Ok(out)
        })
        .collect()
}

#[derive(sqlx::FromRow)]
struct Row {
    kind: String,
    global_limit: Option<i32>,
    key_pointer: Option<String>,
    per_key_limit: Option<i32>,
    rate: Option<i32>,
    rate_period_ms: Option<i64>,
    burst: i32,
    set_at: DateTime<Utc>,
    set_by: String,
}

impl From<Row> for KindLimits {
    fn from(r: Row) -> KindLimits {
        KindLimits {
            kind: r.kind,
            limits: Limits {
                global: r.global_limit,
                per_key: r
                    .key_pointer
                    .zip(r.per_key_limit)
                    .map(|(pointer, limit)| PerKey { pointer, limit }),
                rate: r.rate.zip(r.rate_period_ms).map(|(count, ms)| Rate {
                    count,
                    period: Duration::from_millis(ms.max(0) as u64),
                }),
                burst: r.burst,
            },
            set_at: r.set_at,
            set_by: r.set_by,
        }
    }
}

const COLUMNS: &str =
    "kind, global_limit, key_pointer, per_key_limit, rate, rate_period_ms, burst, set_at, set_by";

/// Every kind's limits, by kind.
pub async fn list<'e>(db: impl PgExecutor<'e>) -> Result<Vec<KindLimits>, sqlx::Error> {
    let rows: Vec<Row> = sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM almanac.kind_limits ORDER BY kind"
    ))
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(KindLimits::from).collect())
}

/// `kind`'s limits, if it has any.
pub async fn get<'e>(
    db: impl PgExecutor<'e>,
    kind: &str,
) -> Result<Option<KindLimits>, sqlx::Error> {
    let row: Option<Row> = sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM almanac.kind_limits WHERE kind = $1"
    ))
    .bind(kind)
    .fetch_optional(db)
    .await?;
    Ok(row.map(KindLimits::from))
}

/// Writes `kind`'s limits (replacing any it had; the rate's bucket starts
/// full) on the caller's transaction; returns them as stored.
pub async fn put(
    tx: &mut sqlx::PgConnection,
    kind: &str,
    limits: &Limits,
    by: &str,
) -> Result<KindLimits, QueueError> {
    limits.validate()?;
    if kind.trim().is_empty() || kind == "*" {
        return Err(QueueError::Invalid(format!(
            "limits are per kind; `{kind}` is not a kind name"
        )));
    }
    let path = limits
        .per_key
        .as_ref()
        .map(|p| pointer_path(&p.pointer))
        .transpose()?;
    let row: Row = sqlx::query_as(&format!(
        r#"
        INSERT INTO almanac.kind_limits AS l
            (kind, global_limit, key_pointer, key_path, per_key_limit, rate, rate_period_ms, burst,
             tokens, refilled_at, set_at, set_by)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, NULL, NULL, now(), $9)
        ON CONFLICT (kind) DO UPDATE SET
            global_limit = excluded.global_limit, key_pointer = excluded.key_pointer,
            key_path = excluded.key_path, per_key_limit = excluded.per_key_limit,
            rate = excluded.rate, rate_period_ms = excluded.rate_period_ms, burst = excluded.burst,
            tokens = CASE WHEN (l.rate, l.rate_period_ms, l.burst)
                               IS NOT DISTINCT FROM (excluded.rate, excluded.rate_period_ms, excluded.burst)
                          THEN l.tokens END,
            refilled_at = CASE WHEN (l.rate, l.rate_period_ms, l.burst)
                                    IS NOT DISTINCT FROM (excluded.rate, excluded.rate_period_ms, excluded.burst)
                               THEN l.refilled_at END,
            set_at = now(), set_by = excluded.set_by
        RETURNING {COLUMNS}
        "#
    ))
    .bind(kind)
    .bind(limits.global)
    .bind(limits.per_key.as_ref().map(|p| p.pointer.as_str()))
    .bind(path)
    .bind(limits.per_key.as_ref().map(|p| p.limit))
    .bind(limits.rate.map(|r| r.count))
    .bind(limits.rate.map(|r| r.period.as_millis() as i64))
    .bind(limits.burst)
    .bind(by)
    .fetch_one(&mut *tx)
    .await?;
    Ok(row.into())
}

/// Removes `kind`'s limits on the caller's transaction; what it had, if any.
pub async fn remove(
    tx: &mut sqlx::PgConnection,
    kind: &str,
) -> Result<Option<KindLimits>, QueueError> {
    let row: Option<Row> = sqlx::query_as(&format!(
        "DELETE FROM almanac.kind_limits WHERE kind = $1 RETURNING {COLUMNS}"
    ))
    .bind(kind)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(row.map(KindLimits::from))
}

/// Running jobs per limited kind (leases unexpired, as the limits count
/// them), for `/metrics` and `stats`.
pub async fn running<'e>(db: impl PgExecutor<'e>) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT l.kind, (SELECT count(*) FROM almanac.jobs j WHERE j.status = 'running' \
         AND j.kind = l.kind AND j.lease_until > clock_timestamp()) \
         FROM almanac.kind_limits l ORDER BY l.kind",
    )
    .fetch_all(db)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid(e: QueueError) -> String {
        match e {
            QueueError::Invalid(m) => m,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn rates_parse_and_bad_ones_name_the_value() {
        let rate: Rate = "600/1m".parse().unwrap();
        assert_eq!(rate.count, 600);
        assert_eq!(rate.period, Duration::from_secs(60));
        assert_eq!(rate.to_string(), "600/1m");
        for (bad, says) in [
            ("600", "has no `/`"),
            ("x/1m", "whole number"),
            ("600/soon", "does not parse"),
            ("0/1m", "at least 1"),
            ("-5/1m", "at least 1"),
            ("10/0s", "under a millisecond"),
        ] {
            let message = invalid(bad.parse::<Rate>().unwrap_err());
            assert!(message.contains(says), "{bad}: {message}");
            if !message.starts_with("the rate is") {
                assert!(message.contains(&format!("`{bad}`")), "{bad}: {message}");
            }
        }
    }

    #[test]
    fn pointers_follow_rfc_6901_and_bad_ones_are_refused() {
        assert_eq!(pointer_path("/customer_id").unwrap(), ["customer_id"]);
        assert_eq!(pointer_path("/a/b~1c/d~0e").unwrap(), ["a", "b/c", "d~e"]);
        assert_eq!(pointer_path("/").unwrap(), [""]);
        for (bad, says) in [
            ("", "is empty"),
            ("customer_id", "does not start with `/`"),
            ("/a~2", "`~` not followed"),
        ] {
            let message = invalid(pointer_path(bad).unwrap_err());
            assert!(message.contains(says), "{bad}: {message}");
            assert!(message.contains(&format!("`{bad}`")), "{bad}: {message}");
        }
        let per_key: PerKey = "/tenant/id=2".parse().unwrap();
        assert_eq!((per_key.pointer.as_str(), per_key.limit), ("/tenant/id", 2));
        for (bad, says) in [
            ("/customer_id", "has no `=`"),
            ("/customer_id=x", "whole number"),
            ("/customer_id=0", "at least 1"),
            ("customer_id=1", "does not start with `/`"),
        ] {
            let message = invalid(bad.parse::<PerKey>().unwrap_err());
            assert!(message.contains(says), "{bad}: {message}");
        }
    }

    #[test]
    fn limits_need_one_limit_positive_values_and_a_rate_for_a_burst() {
        assert!(invalid(Limits::default().validate().unwrap_err()).contains("no limit given"));
        let zero = Limits {
            global: Some(0),
            ..Limits::default()
        };
        assert!(invalid(zero.validate().unwrap_err()).contains("global limit is 0"));
        let negative = Limits {
            global: Some(-3),
            ..Limits::default()
        };
        assert!(invalid(negative.validate().unwrap_err()).contains("global limit is -3"));
        let burst = Limits {
            global: Some(3),
            burst: 10,
            ..Limits::default()
        };
        assert!(invalid(burst.validate().unwrap_err()).contains("without a rate"));
        let burst_alone = Limits {
            burst: 5,
            ..Limits::default()
        };
        assert!(
            invalid(burst_alone.validate().unwrap_err()).contains("a burst of 5 without a rate")
        );
        let all = Limits {
            global: Some(10),
            per_key: Some("/c=1".parse().unwrap()),
            rate: Some("600/1m".parse().unwrap()),
            burst: 10,
        };
        all.validate().unwrap();
        assert_eq!(
            all.to_string(),
            "global 10, per key /c=1, rate 600/1m burst 10"
        );
    }
}
