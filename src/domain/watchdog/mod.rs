//! What the watchdog concludes about one poller, from its status, what the watchdog saw at its
//! previous run, and `now`. Pure: reading and reporting happen elsewhere.
//!
//! The findings and when each is made: [`super::finding`]. Beside [`judge`]: [`judge_horizon`]
//! (a held commit horizon or settle bound) and [`judge_slot`] (a logical source's slot).

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

mod held;
mod slot;

pub use super::finding::{Finding, FindingKind};
use super::health::{FingerprintState, PollerHealth};
pub use held::{HeldSeen, judge_horizon};
pub use slot::judge_slot;

/// What the watchdog saw of one poller at its previous run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Seen {
    pub quarantined: u64,
    pub attempts: u32,
    /// The checkpoint it saw (its cursor and key), to tell whether it moved.
    pub checkpoint: Option<Value>,
    /// Since when rows have been waiting behind that checkpoint, as far as the watchdog saw.
    pub waiting_since: Option<DateTime<Utc>>,
    /// Rows found late so far.
    #[serde(default)]
    pub late_arrivals: u64,
    /// The transaction that held the horizon, and since when the watchdog has seen it hold
    /// ([`judge_horizon`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub horizon: Option<HeldSeen>,
}

/// What the watchdog keeps between runs, by poller name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    #[serde(default)]
    pub pollers: BTreeMap<String, Seen>,
    /// Each poller's lag over the last hours, for the status page (bounded: `lag_series`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub lag: BTreeMap<String, super::lag_series::LagSeries>,
    /// The findings of the last run, for the status page.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub findings: Vec<super::lag_series::FindingNote>,
}

/// The findings about one poller, and what to remember of it.
pub fn judge(
    health: &PollerHealth,
    interval: Option<Duration>,
    stalled_after_intervals: u32,
    seen: Option<&Seen>,
    now: DateTime<Utc>,
) -> (Vec<Finding>, Seen) {
    let mut findings = Vec::new();
    let mut found = |kind: FindingKind, message: String| {
        findings.push(Finding { kind, function: health.function.clone(), poller: health.poller.clone(), message });
    };
    if let Some(error) = &health.error {
        found(FindingKind::Unreadable, error.clone());
    }
    if health.fingerprint == Some(FingerprintState::Changed) {
        found(
            FindingKind::FingerprintChanged,
            "the source definition changed: every tick fails until the poller is reset or `dbtrigger fingerprint accept`".into(),
        );
    }
    if health.generation_changed {
        found(
            FindingKind::GenerationChanged,
            format!(
                "the source generation moved to {}: the poller stops until it is reset (source.generation.onChange: stop)",
                health.generation.as_ref().map(ToString::to_string).unwrap_or_else(|| "?".into())
            ),
        );
    }
    if let Some(lease) = &health.lease
        && let Some(owner) = &lease.owner
        && !lease.live
    {
        found(
            FindingKind::LeaseAbandoned,
            format!(
                "the lease of {owner} expired at {} without being released: a tick died mid-work and no tick has resumed since",
                lease.expires_at.map(|at| at.to_rfc3339()).unwrap_or_else(|| "?".into())
            ),
        );
    }
    let previous = seen.cloned().unwrap_or_default();
    if health.quarantine_budget_spent {
        // In place of `failing`: the problem names the budget and the last refusals.
        let problem = health.problems.iter().find(|problem| problem.starts_with("quarantine_budget_spent"));
        found(FindingKind::QuarantineBudgetSpent, problem.cloned().unwrap_or_else(|| "quarantine_budget_spent".into()));
    } else if let Some(status) = health.endpoint_refused {
        // The status and what to do; the URL never (its path or query may hold a token), nor the
        // receiver's body (it is in `status` for whoever may read it).
        found(FindingKind::EndpointRefused, super::health::endpoint_refused_problem(status, health.attempts));
    } else if health.attempts > 0 {
        let trend = if health.attempts > previous.attempts && seen.is_some() {
            format!(" (was {} at the previous check)", previous.attempts)
        } else {
            String::new()
        };
        found(
            FindingKind::Failing,
            format!(
                "ticks at the checkpoint failed {} times{trend}, last: {}",
                health.attempts,
                health.last_error.as_deref().unwrap_or("?")
            ),
        );
    }
    if health.quarantined > previous.quarantined {
        found(
            FindingKind::QuarantineGrew,
            format!(
                "the quarantine grew from {} to {} rows (dbtrigger quarantine list {})",
                previous.quarantined, health.quarantined, health.poller
            ),
        );
    }
    if health.late_arrivals > previous.late_arrivals {
        found(FindingKind::LateArrivals, late_arrivals_message(health, previous.late_arrivals));
    }
    let checkpoint = health
        .checkpoint
        .as_ref()
        .map(|checkpoint| serde_json::json!({"cursor": checkpoint.cursor, "pk": checkpoint.pk}));
    let waiting = health.lag_rows.is_some_and(|rows| rows > 0);
    let waiting_since = match (waiting, &previous.waiting_since) {
        (false, _) => None,
        (true, Some(since)) if previous.checkpoint == checkpoint => Some(*since),
        (true, _) => Some(now),
    };
    if let (Some(since), Some(interval)) = (waiting_since, interval) {
        // Rows wait behind a checkpoint that has not moved since `since` (or since the last commit,
        // whichever is later).
        let reference = health.last_success_at.map_or(since, |last| last.max(since));
        let limit = interval * stalled_after_intervals as i32;
        if now - reference >= limit {
            found(
                FindingKind::Stalled,
                format!(
                    "{} rows wait and the checkpoint has not moved for {} s ({} schedule intervals); last commit: {}",
                    health.lag_rows.unwrap_or_default(),
                    (now - reference).num_seconds(),
                    stalled_after_intervals,
                    health.last_success_at.map(|at| at.to_rfc3339()).unwrap_or_else(|| "never".into())
                ),
            );
        }
    }
    let remembered = Seen {
        quarantined: health.quarantined,
        attempts: health.attempts,
        checkpoint,
        waiting_since,
        late_arrivals: health.late_arrivals,
        horizon: None,
    };
    (findings, remembered)
}

/// What a `late_arrivals` finding says: how many, how late, and the `settleSeconds` that would
/// have caught them (a timestamp cursor), or why none would (an integer one).
fn late_arrivals_message(health: &PollerHealth, before: u64) -> String {
    let found = health.late_arrivals - before;
    let integer_cursor = health.checkpoint.as_ref().is_some_and(|checkpoint| checkpoint.cursor.is_number());
    let lateness = health.max_lateness_seconds.unwrap_or_default();
    let head = format!(
        "{found} rows were committed behind the checkpoint after the poller had passed them, found by the late-arrival detector and delivered late ({} in all)",
        health.late_arrivals
    );
    if integer_cursor {
        return format!(
            "{head}; the latest came {lateness} s after the checkpoint passed its value: an identity or sequence cursor hands out values before commit, and settleSeconds does not apply to it (keep the detector on; on PostgreSQL an xid cursor cannot skip a commit)"
        );
    }
    format!(
        "{head}; the latest was found {lateness} s after its cursor time: settleSeconds {} would have caught them (or settle: auto / an xid cursor, where the database can bound its open transactions)",
        lateness + 1
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::health::{CheckpointView, LeaseView};

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_780_000_000 + seconds, 0).unwrap()
    }

    fn healthy(lag: u64) -> PollerHealth {
        let mut health = PollerHealth::empty("orders", "orders");
        health.healthy = true;
        health.lag_rows = Some(lag);
        health.fingerprint = Some(FingerprintState::Ok);
        health.checkpoint =
            Some(CheckpointView { cursor: serde_json::json!(5), pk: serde_json::Map::new(), updated_at: at(0) });
        health.last_success_at = Some(at(0));
        health
    }

    fn kinds(findings: &[Finding]) -> Vec<FindingKind> {
        findings.iter().map(|finding| finding.kind).collect()
    }

    const MINUTE: Duration = Duration::minutes(1);

    #[test]
    fn rows_waiting_behind_a_checkpoint_that_does_not_move_become_stalled() {
        // First sight: rows wait, the watchdog starts counting.
        let (findings, seen) = judge(&healthy(10), Some(MINUTE), 3, None, at(600));
        assert!(findings.is_empty(), "{findings:?}");
        assert_eq!(seen.waiting_since, Some(at(600)));
        // Two minutes later: not yet three intervals.
        let (findings, seen) = judge(&healthy(10), Some(MINUTE), 3, Some(&seen), at(720));
        assert!(findings.is_empty());
        // Three: stalled, and a tick could fix it.
        let (findings, _) = judge(&healthy(10), Some(MINUTE), 3, Some(&seen), at(780));
        assert_eq!(kinds(&findings), [FindingKind::Stalled]);
        assert!(findings[0].kind.kickable());
        // The checkpoint moved meanwhile: counting starts again.
        let mut moved = healthy(10);
        moved.checkpoint.as_mut().unwrap().cursor = serde_json::json!(9);
        let (findings, again) = judge(&moved, Some(MINUTE), 3, Some(&seen), at(780));
        assert!(findings.is_empty());
        assert_eq!(again.waiting_since, Some(at(780)));
        // Nothing waiting: never stalled, however old the last commit.
        let (findings, idle) = judge(&healthy(0), Some(MINUTE), 3, Some(&seen), at(100_000));
        assert!(findings.is_empty());
        assert_eq!(idle.waiting_since, None);
    }

    #[test]
    fn an_expired_unreleased_lease_is_abandoned_a_released_one_is_not() {
        let mut health = healthy(0);
        health.lease =
            Some(LeaseView { owner: Some("dead/1".into()), fencing_token: 3, expires_at: Some(at(10)), live: false });
        let (findings, _) = judge(&health, Some(MINUTE), 3, None, at(100));
        assert_eq!(kinds(&findings), [FindingKind::LeaseAbandoned]);
        assert!(findings[0].message.contains("dead/1"));
        health.lease = Some(LeaseView { owner: None, fencing_token: 3, expires_at: None, live: false });
        assert!(judge(&health, Some(MINUTE), 3, None, at(100)).0.is_empty());
        health.lease =
            Some(LeaseView { owner: Some("busy/1".into()), fencing_token: 3, expires_at: Some(at(200)), live: true });
        assert!(judge(&health, Some(MINUTE), 3, None, at(100)).0.is_empty(), "a live lease is a tick at work");
    }

    #[test]
    fn failures_quarantine_growth_and_changed_sources_are_reported() {
        let mut health = healthy(0);
        health.attempts = 2;
        health.last_error = Some("HTTP 500".into());
        health.quarantined = 4;
        health.fingerprint = Some(FingerprintState::Changed);
        let seen = Seen { quarantined: 1, attempts: 1, ..Seen::default() };
        let (findings, remembered) = judge(&health, Some(MINUTE), 3, Some(&seen), at(0));
        assert_eq!(
            kinds(&findings),
            [FindingKind::FingerprintChanged, FindingKind::Failing, FindingKind::QuarantineGrew]
        );
        assert!(findings[1].message.contains("failed 2 times (was 1 at the previous check), last: HTTP 500"));
        assert!(findings[2].message.contains("from 1 to 4"));
        assert_eq!((remembered.quarantined, remembered.attempts), (4, 2));
        // The same again: still failing, but the quarantine did not grow.
        let (findings, _) = judge(&health, Some(MINUTE), 3, Some(&remembered), at(60));
        assert_eq!(kinds(&findings), [FindingKind::FingerprintChanged, FindingKind::Failing]);
        // Issue 36: held because the endpoint refuses every row alike: `endpoint_refused` in place
        // of `failing`, naming the status and never the receiver's answer.
        let mut refused = healthy(40);
        refused.attempts = 3;
        refused.endpoint_refused = Some(401);
        refused.last_error = Some("HTTP 401: {\"error\": \"token T0KEN expired\"}".into());
        let (findings, _) = judge(&refused, Some(MINUTE), 3, None, at(0));
        assert_eq!(kinds(&findings), [FindingKind::EndpointRefused]);
        assert_eq!(findings[0].kind.name(), "endpoint_refused");
        assert!(findings[0].message.contains("HTTP 401") && findings[0].message.contains("3 ticks"), "{findings:?}");
        assert!(!findings[0].message.contains("T0KEN"), "{findings:?}");
        assert!(!findings[0].kind.kickable(), "a tick cannot fix a credential");
        // Issue 45, finding 8: held past the quarantine budget: `quarantine_budget_spent` in place
        // of `failing`, with the last refusals.
        let mut spent = healthy(40);
        spent.attempts = 2;
        spent.quarantine_budget_spent = true;
        spent.problems = vec![crate::domain::quarantine_budget::spent_problem(Some(
            &crate::domain::quarantine_budget::QuarantineLog {
                times: Vec::new(),
                last_refusals: vec!["HTTP 422: no".into()],
            },
        ))];
        let (findings, _) = judge(&spent, Some(MINUTE), 3, None, at(0));
        assert_eq!(kinds(&findings), [FindingKind::QuarantineBudgetSpent]);
        assert_eq!(findings[0].kind.name(), "quarantine_budget_spent");
        assert!(findings[0].message.contains("HTTP 422: no"), "{findings:?}");
        let mut reloaded = healthy(0);
        reloaded.generation = Some(serde_json::json!(8));
        reloaded.generation_changed = true;
        let (findings, _) = judge(&reloaded, Some(MINUTE), 3, None, at(0));
        assert_eq!(kinds(&findings), [FindingKind::GenerationChanged]);
        assert!(findings[0].message.contains("moved to 8") && !findings[0].kind.kickable());
    }

    /// Issue 26, section 3: rows found late are reported once, with the settleSeconds that would
    /// have caught them (a timestamp cursor) or why none would (an integer cursor).
    #[test]
    fn late_arrivals_are_reported_when_they_grow_with_the_settle_that_would_have_caught_them() {
        let mut health = healthy(0);
        health.checkpoint.as_mut().unwrap().cursor = serde_json::json!("2026-01-01T00:00:00Z");
        health.late_arrivals = 3;
        health.max_lateness_seconds = Some(4);
        let (findings, seen) = judge(&health, Some(MINUTE), 3, None, at(100));
        assert_eq!(kinds(&findings), [FindingKind::LateArrivals]);
        assert!(
            findings[0].message.starts_with("3 rows were committed behind the checkpoint"),
            "{}",
            findings[0].message
        );
        assert!(findings[0].message.contains("settleSeconds 5 would have caught them"), "{}", findings[0].message);
        assert!(!findings[0].kind.kickable());
        assert_eq!(seen.late_arrivals, 3);
        // Seen already: nothing new to say.
        assert!(judge(&health, Some(MINUTE), 3, Some(&seen), at(200)).0.is_empty());
        // An integer cursor: settle would not have helped.
        health.checkpoint.as_mut().unwrap().cursor = serde_json::json!(42);
        health.late_arrivals = 4;
        let (findings, _) = judge(&health, Some(MINUTE), 3, Some(&seen), at(300));
        assert!(findings[0].message.starts_with("1 rows"), "{}", findings[0].message);
        assert!(findings[0].message.contains("settleSeconds does not apply"), "{}", findings[0].message);
        // A memory written before this field existed reads as none seen.
        let old: Seen = serde_json::from_value(serde_json::json!({"quarantined": 0, "attempts": 0})).unwrap();
        assert_eq!(old.late_arrivals, 0);
    }
}
