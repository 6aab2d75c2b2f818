//! What `status` says of a poller, decided from what was read (its state document, the backlog the
//! source counted, its configuration's fingerprint) and `now`. Pure: the reading is done elsewhere.
//!
//! A poller is unhealthy when something needs a person: its configuration is unusable, its state
//! document cannot be read, its source cannot be counted, its fingerprint changed, or the batch at
//! its checkpoint has failed (`attempts` above zero; `endpoint_refused` when the receiver refuses
//! every row alike and the poller holds, issue 36).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use super::cursor::CursorValue;
use super::horizon::{Audience, HorizonHolder};
use super::lease::{self, LeaseStatus, LeaseTerms};
use super::state::StateDocument;
use super::transitions::{FingerprintCheck, check_fingerprint};

/// How the stored fingerprint relates to the configuration's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FingerprintState {
    /// The document was written for this source definition.
    Ok,
    /// It was written for another one: the poller stops until reset or accepted.
    Changed,
    /// No document yet: the first tick writes it.
    New,
}

/// The lease as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeaseView {
    pub owner: Option<String>,
    pub fencing_token: u64,
    pub expires_at: Option<DateTime<Utc>>,
    /// A tick holds it now (another instance would wait).
    pub live: bool,
}

/// The checkpoint as `status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckpointView {
    pub cursor: Value,
    pub pk: serde_json::Map<String, Value>,
    pub updated_at: DateTime<Utc>,
}

/// What waits after the checkpoint, as the source counted it.
#[derive(Debug, Clone, PartialEq)]
pub struct Lag {
    pub rows: u64,
    pub capped: bool,
    pub oldest: Option<CursorValue>,
}

/// One poller's status: the `status --json` object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PollerHealth {
    pub function: String,
    pub poller: String,
    pub healthy: bool,
    /// Why not, in words (empty when healthy).
    pub problems: Vec<String>,
    pub checkpoint: Option<CheckpointView>,
    /// Rows after the checkpoint, counted up to `lag_cap` (`null` when they could not be counted).
    pub lag_rows: Option<u64>,
    /// The count stopped at its cap: there are at least `lag_rows`.
    pub lag_capped: bool,
    /// Now minus the cursor of the first undelivered row, for timestamp cursors.
    pub oldest_pending_age_seconds: Option<f64>,
    /// While rows wait: the oldest open transaction, for a poller read below a commit horizon
    /// (`xid`) or a bound (`settle: "auto"`).
    pub horizon_holder: Option<HorizonHolder>,
    /// A logical source's replication slot: the WAL it holds, its `wal_status`, its reader.
    pub slot: Option<super::slot::SlotView>,
    /// The replication slot a tick found lost (invalidated, or gone after use): the poller stops
    /// until an operator resets it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot_lost: Option<String>,
    pub lease: Option<LeaseView>,
    /// When a tick last committed.
    pub last_success_at: Option<DateTime<Utc>>,
    /// Failed ticks on the batch at the checkpoint.
    pub attempts: u32,
    /// The HTTP status with which the endpoint refuses every row alike (a 401, a gateway's 404, a
    /// redirect, a queue's 403): the poller holds at its checkpoint and quarantines nothing until
    /// the URL or the credential is fixed.
    pub endpoint_refused: Option<u16>,
    /// A row refused alone found the quarantine budget spent (`poison.maxQuarantinedPerHour`):
    /// the poller holds at its checkpoint and quarantines nothing more.
    pub quarantine_budget_spent: bool,
    pub last_error: Option<String>,
    /// Rows isolated as poison so far (`dbtrigger quarantine list`).
    pub quarantined: u64,
    pub rows_delivered: u64,
    pub fingerprint: Option<FingerprintState>,
    /// The source generation the source reports now (`source.generation`), when one is configured.
    pub generation: Option<Value>,
    /// It moved since the checkpoint and `onChange` is `stop`: the poller stops until reset.
    pub generation_changed: bool,
    /// The function's configuration error, or why its state or source could not be read.
    pub error: Option<String>,
    /// Why the host does not run this function (`AzureWebJobs.<function>.Disabled`, or host.json
    /// `functions`): a disabled poller is healthy, and nothing more is read about it.
    pub disabled: Option<String>,
    /// Rows the late-arrival detector found committed behind the checkpoint and delivered late,
    /// in all (informational: they were delivered; the watchdog reports when this grows).
    pub late_arrivals: u64,
    /// The most seconds such a row was found after its cursor time: what `settleSeconds` would
    /// have had to be (integer cursors: after the checkpoint passed it).
    pub max_lateness_seconds: Option<u64>,
    pub last_late_arrival_at: Option<DateTime<Utc>>,
}

impl PollerHealth {
    /// A function that cannot run: its configuration (or a connection it names) is unusable.
    pub fn unusable(function: &str, reason: String) -> PollerHealth {
        let mut health = PollerHealth::empty(function, function);
        health.problems.push(format!("configuration error: {reason}"));
        health.error = Some(reason);
        health
    }

    /// A function the host does not run (see `disabled`): healthy, nothing read.
    pub fn disabled(function: &str, poller: &str, reason: String) -> PollerHealth {
        let mut health = PollerHealth::empty(function, poller);
        health.healthy = true;
        health.disabled = Some(reason);
        health
    }

    /// Nothing known yet about a poller: not healthy until `assess` says so.
    pub(crate) fn empty(function: &str, poller: &str) -> PollerHealth {
        PollerHealth {
            function: function.to_string(),
            poller: poller.to_string(),
            healthy: false,
            problems: Vec::new(),
            checkpoint: None,
            lag_rows: None,
            lag_capped: false,
            oldest_pending_age_seconds: None,
            horizon_holder: None,
            slot: None,
            slot_lost: None,
            lease: None,
            last_success_at: None,
            attempts: 0,
            endpoint_refused: None,
            quarantine_budget_spent: false,
            last_error: None,
            quarantined: 0,
            rows_delivered: 0,
            fingerprint: None,
            generation: None,
            generation_changed: false,
            error: None,
            disabled: None,
            late_arrivals: 0,
            max_lateness_seconds: None,
            last_late_arrival_at: None,
        }
    }
}

/// What `status` and the watchdog say of a poller held because its endpoint refuses every row
/// alike: the status, what it means and what to do; never the URL (its path may hold a token).
pub fn endpoint_refused_problem(status: u16, attempts: u32) -> String {
    format!(
        "the receiver refuses every row alike (HTTP {status}): the endpoint (its URL, credential or a gateway in front of it), not the rows. \
         The poller holds at its checkpoint ({attempts} ticks so far) and quarantines nothing; fix the URL or the credential, \
         the next tick then delivers from the checkpoint"
    )
}

/// What was read about one poller.
pub struct Observed<'a> {
    pub function: &'a str,
    pub poller: &'a str,
    /// The state document (`Ok(None)`: none yet), or why it could not be read.
    pub document: Result<Option<&'a StateDocument>, String>,
    /// The backlog, or why it could not be counted (`None`: not asked, the checkpoint is unknown).
    pub lag: Option<Result<Lag, String>>,
    pub fingerprint: &'a str,
    pub earlier_fingerprint: Option<&'a str>,
    pub terms: &'a LeaseTerms,
    /// Naive timestamp cursors mean this zone; their age is known only for UTC.
    pub naive_cursors_are_utc: bool,
    /// What the source's generation query answers now (`Ok(None)`: none configured).
    pub generation: Result<Option<Value>, String>,
    /// A moved generation stops the poller (`onChange: stop`) rather than restarting it.
    pub generation_stops: bool,
    /// The oldest open transaction, asked for only while rows wait (see [`HorizonHolder`]).
    pub horizon_holder: Option<HorizonHolder>,
    /// Who reads this status: another session's query text is shown to an operator only.
    pub audience: Audience,
    /// A logical source's slot (`None`: not one, or not read).
    pub slot: Option<super::slot::SlotView>,
}

/// The status of one poller at `now`.
pub fn assess(observed: Observed<'_>, now: DateTime<Utc>) -> PollerHealth {
    let mut health = PollerHealth::empty(observed.function, observed.poller);
    let recorded_generation = match &observed.document {
        Ok(Some(document)) => document.generation.as_ref().map(|record| record.value.clone()),
        _ => None,
    };
    match observed.document {
        Err(reason) => {
            health.problems.push(format!("state document unreadable: {reason}"));
            health.error = Some(reason);
        }
        Ok(None) => health.fingerprint = Some(FingerprintState::New),
        Ok(Some(document)) => {
            let check =
                check_fingerprint(&document.source_fingerprint, observed.fingerprint, observed.earlier_fingerprint);
            let fingerprint = match check {
                FingerprintCheck::Same | FingerprintCheck::Earlier => FingerprintState::Ok,
                FingerprintCheck::Changed => FingerprintState::Changed,
            };
            if fingerprint == FingerprintState::Changed {
                health.problems.push(format!(
                    "fingerprint changed: the document is for {}, the configuration gives {} (reset, or `dbtrigger fingerprint accept`)",
                    document.source_fingerprint, observed.fingerprint
                ));
            }
            health.fingerprint = Some(fingerprint);
            health.checkpoint = document.checkpoint.as_ref().map(|checkpoint| CheckpointView {
                cursor: checkpoint.cursor.value.clone(),
                pk: checkpoint.cursor.tiebreaker.clone(),
                updated_at: checkpoint.updated_at,
            });
            health.lease = document.lease.as_ref().map(|record| LeaseView {
                owner: record.owner_id.clone(),
                fencing_token: record.fencing_token,
                expires_at: record.expires_at,
                live: matches!(
                    lease::status(Some(record), "(status)", now, observed.terms),
                    LeaseStatus::HeldByOther { .. }
                ),
            });
            health.last_success_at = document.stats.last_tick_at;
            health.quarantined = document.stats.quarantined;
            health.rows_delivered = document.stats.rows_delivered;
            if let Some(late) = &document.late {
                health.late_arrivals = late.found;
                health.max_lateness_seconds = late.max_lateness_seconds;
                health.last_late_arrival_at = late.last_found_at;
            }
            if let Some(poison) = &document.poison {
                health.attempts = poison.attempts;
                health.last_error = Some(poison.last_error.clone());
                health.endpoint_refused = poison.endpoint_refused;
                if let Some(status) = poison.endpoint_refused {
                    health.problems.push(endpoint_refused_problem(status, poison.attempts));
                }
                health.quarantine_budget_spent = poison.quarantine_budget_spent;
                if poison.quarantine_budget_spent {
                    health.problems.push(super::quarantine_budget::spent_problem(document.quarantine_log.as_ref()));
                }
                if poison.attempts > 0 {
                    health.problems.push(format!(
                        "the batch at the checkpoint failed {} times, last: {}",
                        poison.attempts, poison.last_error
                    ));
                }
            }
            // Ticks failing for another reason than the sink count as attempts too; the error
            // shown is the later one.
            if let Some(failure) = &document.failure {
                health
                    .problems
                    .push(format!("the last {} ticks failed, last: {}", failure.attempts, failure.last_error));
                health.attempts = health.attempts.max(failure.attempts);
                health.slot_lost = failure.slot_lost.clone();
                if document.poison.as_ref().is_none_or(|poison| failure.last_failure_at >= poison.last_failure_at) {
                    health.last_error = Some(failure.last_error.clone());
                }
            }
        }
    }
    match &observed.generation {
        Ok(current) => {
            health.generation = current.clone();
            if let (Some(recorded), Some(current)) = (&recorded_generation, current)
                && recorded != current
                && observed.generation_stops
            {
                health.generation_changed = true;
                health.problems.push(format!(
                    "source generation changed from {recorded} to {current}: the poller stops until it is reset"
                ));
            }
        }
        Err(reason) => health.problems.push(format!("source generation not read: {reason}")),
    }
    match observed.lag {
        None => {}
        Some(Ok(lag)) => {
            health.lag_rows = Some(lag.rows);
            health.lag_capped = lag.capped;
            health.oldest_pending_age_seconds =
                lag.oldest.as_ref().and_then(|oldest| age_seconds(oldest, now, observed.naive_cursors_are_utc));
            if lag.rows > 0 {
                health.horizon_holder =
                    observed.horizon_holder.clone().map(|holder| holder.for_audience(observed.audience));
            }
        }
        Some(Err(reason)) => {
            health.problems.push(format!("source not counted: {reason}"));
            health.error.get_or_insert(reason);
        }
    }
    if let Some(slot) = observed.slot {
        if slot.lost() {
            health.problems.push(format!(
                "replication slot {} was invalidated by the server: changes were lost (docs/logical-operations.md, \"A lost slot\")",
                slot.slot
            ));
        }
        health.slot = Some(slot);
    }
    health.healthy = health.problems.is_empty();
    health
}

/// `now - cursor` in seconds, for a timestamp cursor (a naive one only when it means UTC).
fn age_seconds(cursor: &CursorValue, now: DateTime<Utc>, naive_is_utc: bool) -> Option<f64> {
    let at = match cursor {
        CursorValue::Integer(_) | CursorValue::Xid(_) => return None,
        CursorValue::Timestamp { at, .. } => *at,
        CursorValue::NaiveTimestamp(at) if naive_is_utc => at.and_utc(),
        CursorValue::NaiveTimestamp(_) => return None,
    };
    Some(((now - at).num_milliseconds() as f64 / 1000.0).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::cursor::{PkValue, Position};
    use crate::domain::horizon::{Horizon, query_prefix};
    use crate::domain::poison::PoisonRecord;
    use crate::domain::transitions::{self, Delivered};
    use chrono::Duration;

    fn terms() -> LeaseTerms {
        LeaseTerms { ttl: Duration::seconds(60), heartbeat: Duration::seconds(15), clock_skew: Duration::seconds(5) }
    }

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_780_000_000 + seconds, 0).unwrap()
    }

    fn observed<'a>(document: Result<Option<&'a StateDocument>, String>, lag: Result<Lag, String>) -> Observed<'a> {
        Observed {
            function: "orders",
            poller: "orders",
            document,
            lag: Some(lag),
            fingerprint: "sha256:a",
            earlier_fingerprint: None,
            terms: Box::leak(Box::new(terms())),
            naive_cursors_are_utc: true,
            generation: Ok(None),
            generation_stops: true,
            horizon_holder: None,
            audience: Audience::Operator,
            slot: None,
        }
    }

    fn holder() -> HorizonHolder {
        HorizonHolder {
            holds: Horizon::CommitHorizon,
            pid: Some(4242),
            gid: None,
            transaction: Some("731".into()),
            database: Some("shop".into()),
            role: Some("billing".into()),
            application: Some("psql".into()),
            age_seconds: Some(611.6),
            state: Some("idle in transaction".into()),
            query: Some(query_prefix("UPDATE orders\n   SET total = 12, card = '4111 1111 1111 1111' WHERE id = 7")),
        }
    }

    /// Issue 26, item 3: what holds the horizon is shown while rows wait behind it (and only
    /// then), with a short prefix of its query, never the whole text; issue 36, section 3: the
    /// query only to an operator, never in what is published (the status function, the watchdog).
    #[test]
    fn the_horizon_holder_is_shown_while_rows_wait_with_a_short_query_prefix() {
        let mut waiting = observed(Ok(None), Ok(lag(3, None)));
        waiting.horizon_holder = Some(holder());
        let health = assess(waiting, at(0));
        let shown = health.horizon_holder.expect("rows wait: the holder is shown");
        assert_eq!(
            shown.describe(),
            "pid 4242 (role billing, application psql, database shop, idle in transaction, open 612 s): UPDATE orders SET total = 12, card = '41…"
        );
        assert!(!shown.query.unwrap().contains("1111 1111 1111"), "never more than a prefix of the query");
        assert!(health.healthy, "a held horizon is shown, the watchdog judges its age");
        let mut published = observed(Ok(None), Ok(lag(3, None)));
        published.horizon_holder = Some(holder());
        published.audience = Audience::Published;
        let published = assess(published, at(0)).horizon_holder.expect("shown");
        assert_eq!(published.query, None, "no query text where the status is published");
        assert_eq!(
            published.describe(),
            "pid 4242 (role billing, application psql, database shop, idle in transaction, open 612 s)"
        );
        let mut idle = observed(Ok(None), Ok(lag(0, None)));
        idle.horizon_holder = Some(holder());
        assert_eq!(assess(idle, at(0)).horizon_holder, None, "nothing waits: nothing is held");
        assert_eq!(query_prefix("SELECT 1"), "SELECT 1");
    }

    fn lag(rows: u64, oldest: Option<CursorValue>) -> Lag {
        Lag { rows, capped: false, oldest }
    }

    fn committed(owner: &str, now: DateTime<Utc>, release: bool) -> StateDocument {
        let document = transitions::acquire(&StateDocument::new("orders", "sha256:a"), owner, now, &terms()).unwrap();
        let last = Position { cursor: CursorValue::Integer(7), pk: vec![("id".into(), PkValue::Integer(7))] };
        let delivered = Delivered { last: &last, last_batch_id: "bat_1", rows: 7, batches: 1, quarantined: 0 };
        transitions::commit(&document, owner, &delivered, release, now, &terms()).unwrap()
    }

    #[test]
    fn a_caught_up_poller_is_healthy_and_shows_its_checkpoint() {
        let document = committed("a", at(0), true);
        let health = assess(observed(Ok(Some(&document)), Ok(lag(0, None))), at(10));
        assert!(health.healthy, "{:?}", health.problems);
        assert_eq!(health.lag_rows, Some(0));
        assert_eq!(health.fingerprint, Some(FingerprintState::Ok));
        assert_eq!(health.checkpoint.as_ref().unwrap().cursor, serde_json::json!(7));
        assert_eq!(health.last_success_at, Some(at(0)));
        assert!(!health.lease.unwrap().live, "a released lease is not live");
    }

    #[test]
    fn a_held_lease_is_live_until_expiry_and_skew() {
        let document = committed("a", at(0), false);
        let live = assess(observed(Ok(Some(&document)), Ok(lag(0, None))), at(30));
        assert!(live.lease.unwrap().live);
        let expired = assess(observed(Ok(Some(&document)), Ok(lag(0, None))), at(66));
        assert!(!expired.lease.unwrap().live);
    }

    #[test]
    fn attempts_a_changed_fingerprint_and_unreadable_things_are_unhealthy() {
        let mut document = committed("a", at(0), true);
        document.poison = Some(PoisonRecord {
            batch_id: "bat_2".into(),
            first: document.checkpoint.as_ref().unwrap().cursor.clone(),
            last: document.checkpoint.as_ref().unwrap().cursor.clone(),
            attempts: 2,
            first_error: "HTTP 500".into(),
            last_error: "HTTP 503".into(),
            first_failure_at: at(1),
            last_failure_at: at(2),
            isolating: None,
            endpoint_refused: None,
            quarantine_budget_spent: false,
        });
        let failing = assess(observed(Ok(Some(&document)), Ok(lag(3, None))), at(10));
        assert!(!failing.healthy);
        assert_eq!((failing.attempts, failing.endpoint_refused), (2, None));
        assert!(failing.problems[0].contains("failed 2 times, last: HTTP 503"), "{:?}", failing.problems);

        // Issue 36: the endpoint refuses every row alike; the status says so, with what to do.
        let held = crate::domain::poison::held_for_endpoint(document.poison.clone().unwrap(), 401);
        document.poison = Some(held);
        let refused = assess(observed(Ok(Some(&document)), Ok(lag(3, None))), at(10));
        assert!(!refused.healthy);
        assert_eq!(refused.endpoint_refused, Some(401));
        assert!(refused.problems[0].contains("refuses every row alike (HTTP 401)"), "{:?}", refused.problems);
        assert!(refused.problems[0].contains("fix the URL or the credential"), "{:?}", refused.problems);

        // Issue 45, finding 8: held past the quarantine budget; the status says so, with the last
        // refusals.
        let spent = crate::domain::poison::held_for_budget(document.poison.clone().unwrap());
        document.poison = Some(spent);
        document.quarantine_log =
            Some(crate::domain::quarantine_budget::recorded(None, None, at(5), &["HTTP 422: bad row 7".to_string()]));
        let spent = assess(observed(Ok(Some(&document)), Ok(lag(3, None))), at(10));
        assert!(!spent.healthy && spent.quarantine_budget_spent);
        let problem = spent.problems.iter().find(|problem| problem.starts_with("quarantine_budget_spent"));
        assert!(problem.is_some_and(|problem| problem.contains("HTTP 422: bad row 7")), "{:?}", spent.problems);

        let mut moved = committed("a", at(0), true);
        moved.source_fingerprint = "sha256:b".into();
        let changed = assess(observed(Ok(Some(&moved)), Ok(lag(0, None))), at(10));
        assert_eq!(changed.fingerprint, Some(FingerprintState::Changed));
        assert!(!changed.healthy);

        let unreadable = assess(observed(Err("not JSON".into()), Err("connection refused".into())), at(10));
        assert!(!unreadable.healthy);
        assert_eq!(unreadable.error.as_deref(), Some("not JSON"));
        assert_eq!(unreadable.problems.len(), 2);
        assert_eq!(unreadable.lag_rows, None);
    }

    /// Regression (issue 24, item 9): ticks failing for another reason than the sink (here a
    /// source error) make the poller unhealthy, with their count and error.
    #[test]
    fn ticks_failing_for_another_reason_than_the_sink_are_unhealthy() {
        let mut document = committed("a", at(0), true);
        let error = "opColumn \"note\" holds \"order 3\"";
        document.failure = Some(crate::domain::state::FailureRecord::after(None, error, at(1)));
        document.failure = Some(crate::domain::state::FailureRecord::after(document.failure.as_ref(), error, at(2)));
        let failing = assess(observed(Ok(Some(&document)), Ok(lag(3, None))), at(10));
        assert!(!failing.healthy);
        assert_eq!((failing.attempts, failing.last_error.as_deref()), (2, Some(error)));
        assert!(failing.problems[0].contains("the last 2 ticks failed"), "{:?}", failing.problems);
    }

    #[test]
    fn a_new_poller_is_healthy_with_its_whole_table_as_lag() {
        let oldest = CursorValue::Timestamp { at: at(-90), source_text: None };
        let health = assess(observed(Ok(None), Ok(Lag { rows: 1000, capped: true, oldest: Some(oldest) })), at(0));
        assert!(health.healthy);
        assert_eq!(health.fingerprint, Some(FingerprintState::New));
        assert_eq!((health.lag_rows, health.lag_capped), (Some(1000), true));
        assert_eq!(health.oldest_pending_age_seconds, Some(90.0));
    }

    #[test]
    fn pending_age_is_known_for_utc_timestamps_only() {
        let naive = CursorValue::NaiveTimestamp(at(-5).naive_utc());
        assert_eq!(age_seconds(&naive, at(0), true), Some(5.0));
        assert_eq!(age_seconds(&naive, at(0), false), None);
        assert_eq!(age_seconds(&CursorValue::Integer(4), at(0), true), None);
    }
}
