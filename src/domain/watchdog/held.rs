//! `horizon_held`: rows wait behind a transaction that has held the commit horizon (an xid cursor)
//! or the `settle: "auto"` bound for `horizonHeldAfterSeconds` or longer. A tick cannot fix it: a
//! person (or the application) must end that transaction. Pure.
//!
//! How long it has held: the age the server reports; where the server hides it (PostgreSQL shows
//! another role's `backend_xid` but not its `xact_start` without `pg_read_all_stats`), the time
//! since the watchdog first saw that same transaction hold ([`HeldSeen`]), a lower bound.

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};

use crate::domain::finding::{Finding, FindingKind};
use crate::domain::health::PollerHealth;
use crate::domain::horizon::Horizon;

/// The holder the watchdog saw at its previous runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldSeen {
    /// [`crate::domain::horizon::HorizonHolder::identity`].
    pub holder: String,
    /// When the watchdog first saw it hold.
    pub since: DateTime<Utc>,
}

/// The finding, if the horizon has been held for `threshold`, and what to remember of its holder.
pub fn judge_horizon(
    health: &PollerHealth,
    threshold: Duration,
    seen: Option<&HeldSeen>,
    now: DateTime<Utc>,
) -> (Option<Finding>, Option<HeldSeen>) {
    let (Some(holder), Some(waiting)) = (health.horizon_holder.as_ref(), health.lag_rows.filter(|rows| *rows > 0))
    else {
        return (None, None);
    };
    let identity = holder.identity();
    let since = match seen {
        Some(seen) if seen.holder == identity => seen.since,
        _ => now,
    };
    let remembered = HeldSeen { holder: identity, since };
    let watched = (now - since).num_milliseconds() as f64 / 1000.0;
    let (held_for, how_long) = match holder.age_seconds {
        Some(age) => (age, String::new()),
        None => (watched, format!(" (seen holding for at least {} s)", watched.round() as i64)),
    };
    if held_for < threshold.num_seconds() as f64 {
        return (None, Some(remembered));
    }
    let what = match holder.holds {
        Horizon::CommitHorizon => "the commit horizon (cluster-wide: it holds every xid poller of the server)",
        Horizon::SettleBound => "the settle \"auto\" bound",
    };
    let finding = Finding {
        kind: FindingKind::HorizonHeld,
        function: health.function.clone(),
        poller: health.poller.clone(),
        message: format!("{waiting} rows wait behind {what}, held by {}{how_long}", holder.describe()),
    };
    (Some(finding), Some(remembered))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::health::CheckpointView;
    use crate::domain::horizon::HorizonHolder;

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_780_000_000 + seconds, 0).unwrap()
    }

    fn waiting(lag: u64, age: Option<f64>) -> PollerHealth {
        let mut health = PollerHealth::empty("orders", "orders");
        health.lag_rows = Some(lag);
        health.checkpoint =
            Some(CheckpointView { cursor: serde_json::json!(5), pk: serde_json::Map::new(), updated_at: at(0) });
        health.horizon_holder = Some(HorizonHolder {
            holds: Horizon::CommitHorizon,
            pid: Some(4242),
            gid: None,
            transaction: Some("812".into()),
            database: Some("reports".into()),
            role: Some("analyst".into()),
            application: None,
            age_seconds: age,
            state: Some("idle in transaction".into()),
            query: None,
        });
        health
    }

    /// Issue 26, item 3: rows waiting behind a transaction open past the threshold are reported
    /// (not kicked: a tick cannot end someone's transaction); younger, or nothing waiting, is not.
    #[test]
    fn a_horizon_held_past_the_threshold_is_reported_not_kicked() {
        let five = Duration::minutes(5);
        let (finding, seen) = judge_horizon(&waiting(12, Some(301.0)), five, None, at(0));
        let finding = finding.expect("held past five minutes");
        assert_eq!(finding.kind, FindingKind::HorizonHeld);
        assert!(!finding.kind.kickable());
        assert_eq!(
            finding.message,
            "12 rows wait behind the commit horizon (cluster-wide: it holds every xid poller of the server), held by pid 4242 (role analyst, database reports, idle in transaction, open 301 s)"
        );
        assert_eq!(seen.unwrap().since, at(0));
        assert_eq!(judge_horizon(&waiting(12, Some(301.0)), Duration::minutes(6), None, at(0)).0, None, "younger");
        assert_eq!(judge_horizon(&waiting(0, Some(301.0)), five, None, at(0)), (None, None), "nothing waits");
        let mut no_holder = waiting(3, Some(301.0));
        no_holder.horizon_holder = None;
        assert_eq!(judge_horizon(&no_holder, Duration::zero(), None, at(0)), (None, None), "no holder");
    }

    /// Issue 35, finding 7: a holder whose age the server hides (no pg_read_all_stats) is
    /// reported once the watchdog has seen the same transaction hold for the threshold.
    #[test]
    fn a_holder_of_hidden_age_is_reported_once_seen_holding_for_the_threshold() {
        let five = Duration::minutes(5);
        let (finding, seen) = judge_horizon(&waiting(4, None), five, None, at(0));
        assert_eq!(finding, None, "first sight: held for 0 s as far as the watchdog knows");
        let (finding, seen) = judge_horizon(&waiting(4, None), five, seen.as_ref(), at(120));
        assert_eq!(finding, None, "two minutes");
        let (finding, seen) = judge_horizon(&waiting(4, None), five, seen.as_ref(), at(300));
        let finding = finding.expect("five minutes, the same transaction");
        assert!(
            finding.message.ends_with(
                "open for a time this role cannot see (grant it pg_read_all_stats)) (seen holding for at least 300 s)"
            ),
            "{}",
            finding.message
        );
        // Another transaction took its place: counting starts again.
        let mut other = waiting(4, None);
        other.horizon_holder.as_mut().unwrap().transaction = Some("900".into());
        let (finding, again) = judge_horizon(&other, five, seen.as_ref(), at(400));
        assert_eq!((finding, again.unwrap().since), (None, at(400)));
    }
}
