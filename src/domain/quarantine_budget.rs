//! The quarantine budget (issue 45, finding 8): `poison.maxQuarantinedPerHour` rows at most are
//! quarantined in any rolling hour. A quarantine is not loss, but a receiver deployed with a bug
//! that answers 422 to every row would otherwise turn the whole backlog into entries to replay.
//! Past the budget nothing more is quarantined: the poller holds at its checkpoint, as for an
//! endpoint refusal, until the budget is raised, an operator replays or purges the quarantine, the
//! hour has passed, or the receiver accepts the row again.
//!
//! The state document keeps the times of the last quarantines (`quarantine_log`): never more than
//! [`KEPT_MOST`], whatever the budget, and none older than an hour once a quarantine is recorded.
//! An operator's replay or purge (a history entry: `quarantine_answered_at` in the state document's room) frees
//! the budget of the quarantines before it.

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};

/// The window the budget counts over.
pub fn window() -> Duration {
    Duration::hours(1)
}

/// The most quarantine times kept: the top of `poison.maxQuarantinedPerHour`'s range.
pub const KEPT_MOST: usize = 10_000;

/// The refusals kept for `status` and the watchdog.
pub const REFUSALS_KEPT: usize = 3;

/// The state document's `quarantineLog`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuarantineLog {
    /// When rows were quarantined, oldest first (one time per row).
    #[serde(default)]
    pub times: Vec<DateTime<Utc>>,
    /// The errors of the last rows quarantined, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub last_refusals: Vec<String>,
}

/// The quarantines that count against the budget at `now`: within the hour, after `answered`.
pub fn counted(log: Option<&QuarantineLog>, answered: Option<DateTime<Utc>>, now: DateTime<Utc>) -> usize {
    let Some(log) = log else {
        return 0;
    };
    let since = now - window();
    log.times.iter().filter(|at| **at > since && answered.is_none_or(|answered| **at > answered)).count()
}

/// How many more rows may be quarantined at `now` under a budget of `per_hour`.
pub fn room(log: Option<&QuarantineLog>, answered: Option<DateTime<Utc>>, now: DateTime<Utc>, per_hour: u32) -> usize {
    (per_hour as usize).saturating_sub(counted(log, answered, now))
}

/// The log once `refusals` (one per row) were quarantined at `now`: the times that no longer
/// count dropped, the newest [`KEPT_MOST`] kept, and the last [`REFUSALS_KEPT`] refusals.
pub fn recorded(
    log: Option<&QuarantineLog>,
    answered: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    refusals: &[String],
) -> QuarantineLog {
    let since = now - window();
    let mut times: Vec<DateTime<Utc>> = log
        .map(|log| log.times.iter().copied().filter(|at| *at > since && answered.is_none_or(|answered| *at > answered)))
        .into_iter()
        .flatten()
        .collect();
    times.extend(std::iter::repeat_n(now, refusals.len()));
    if times.len() > KEPT_MOST {
        times.drain(..times.len() - KEPT_MOST);
    }
    let mut last_refusals: Vec<String> = log.map(|log| log.last_refusals.clone()).unwrap_or_default();
    last_refusals.extend(refusals.iter().cloned());
    if last_refusals.len() > REFUSALS_KEPT {
        last_refusals.drain(..last_refusals.len() - REFUSALS_KEPT);
    }
    QuarantineLog { times, last_refusals }
}

/// What `status` and the watchdog say of a poller held because its budget is spent.
pub fn spent_problem(log: Option<&QuarantineLog>) -> String {
    let refusals = log.map(|log| log.last_refusals.join(" | ")).filter(|text| !text.is_empty());
    format!(
        "quarantine_budget_spent: as many rows as poison.maxQuarantinedPerHour allows were quarantined within the last hour; \
         the poller holds at its checkpoint and quarantines nothing more: a receiver refusing every row looks like this. \
         Fix the receiver (the next tick delivers from the checkpoint), or replay the quarantine, or raise the budget. \
         Last refusals: {}",
        refusals.as_deref().unwrap_or("(none kept)")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
    }

    fn refusals(count: usize) -> Vec<String> {
        (0..count).map(|row| format!("HTTP 422: row {row}")).collect()
    }

    #[test]
    fn the_budget_counts_a_rolling_hour() {
        let log = recorded(None, None, at(0), &refusals(10));
        assert_eq!(room(Some(&log), None, at(1), 10), 0, "spent within the hour");
        assert_eq!(room(Some(&log), None, at(3599), 10), 0);
        assert_eq!(room(Some(&log), None, at(3600), 10), 10, "an hour later the budget is back");
        assert_eq!(room(Some(&log), None, at(1), 25), 15, "a raised budget has room at once");
        assert_eq!(room(None, None, at(0), 10), 10);
    }

    #[test]
    fn a_replay_or_purge_frees_the_budget_of_the_quarantines_before_it() {
        let log = recorded(None, None, at(0), &refusals(10));
        assert_eq!(room(Some(&log), Some(at(5)), at(10), 10), 10);
        let later = recorded(Some(&log), Some(at(5)), at(20), &refusals(3));
        assert_eq!(later.times.len(), 3, "the answered times are dropped");
        assert_eq!(room(Some(&later), Some(at(5)), at(30), 10), 7);
    }

    #[test]
    fn the_log_keeps_the_last_refusals_only() {
        let log = recorded(None, None, at(0), &refusals(5));
        assert_eq!(log.last_refusals, vec!["HTTP 422: row 2", "HTTP 422: row 3", "HTTP 422: row 4"]);
        assert!(spent_problem(Some(&log)).contains("quarantine_budget_spent"));
        assert!(spent_problem(Some(&log)).contains("HTTP 422: row 4"));
    }

    proptest! {
        /// Whatever the times, the log stays bounded and holds no time older than the hour.
        #[test]
        fn the_log_stays_bounded(steps in proptest::collection::vec((0i64..7200, 0usize..3000), 1..20)) {
            let mut log: Option<QuarantineLog> = None;
            let mut now = at(0);
            for (gap, rows) in steps {
                now += Duration::seconds(gap);
                let next = recorded(log.as_ref(), None, now, &refusals(rows));
                prop_assert!(next.times.len() <= KEPT_MOST);
                prop_assert!(next.last_refusals.len() <= REFUSALS_KEPT);
                prop_assert!(next.times.iter().all(|time| *time > now - window()));
                log = Some(next);
            }
        }

        /// A tick that quarantines no more than `room` allows never has more than the budget
        /// counted within any hour.
        #[test]
        fn quarantining_within_the_room_keeps_every_hour_within_the_budget(
            per_hour in 1u32..30,
            steps in proptest::collection::vec((0i64..1800, 0usize..40), 1..40),
        ) {
            let mut log: Option<QuarantineLog> = None;
            let mut now = at(0);
            let mut all: Vec<DateTime<Utc>> = Vec::new();
            for (gap, wanted) in steps {
                now += Duration::seconds(gap);
                let taken = wanted.min(room(log.as_ref(), None, now, per_hour));
                all.extend(std::iter::repeat_n(now, taken));
                log = Some(recorded(log.as_ref(), None, now, &refusals(taken)));
                let within = all.iter().filter(|time| **time > now - window()).count();
                prop_assert!(within <= per_hour as usize, "{within} within an hour, budget {per_hour}");
            }
        }
    }
}
