//! Lease decisions. The lease lives in the state document and changes only by compare-and-swap;
//! these functions decide what the next lease is, never whether the write lands.
//!
//! Rules (seed 000 §6-7, design "One tick"):
//! - a lease held by another owner is never taken before `expires_at + skew` (their clock may lag);
//! - taking a lease from someone else (or from nobody) bumps the fencing token; renewing our own
//!   lease keeps it, so receivers can tell a stale writer by a lower token;
//! - a holder stops acting at `expires_at - skew` by its own clock (ours may run ahead);
//! - releasing clears the owner but keeps the token, so the next acquire is immediate and still fenced.

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};

/// The `lease` object of the state document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// `None` once released.
    pub owner_id: Option<String>,
    pub fencing_token: u64,
    pub acquired_at: Option<DateTime<Utc>>,
    pub heartbeat_at: Option<DateTime<Utc>>,
    pub expires_at: Option<DateTime<Utc>>,
}

/// Lease timing, from the poller's `lease` configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTerms {
    pub ttl: Duration,
    pub heartbeat: Duration,
    pub clock_skew: Duration,
}

/// What the lease in a document means for `me` at `now`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseStatus {
    /// No lease, a released lease, or one that expired longer than the skew margin ago.
    Free,
    /// We hold it (perhaps from an earlier tick of this process that could not release it).
    Mine,
    /// Someone else holds it; wait.
    HeldByOther { owner_id: String, expires_at: Option<DateTime<Utc>> },
}

pub fn status(lease: Option<&LeaseRecord>, me: &str, now: DateTime<Utc>, terms: &LeaseTerms) -> LeaseStatus {
    let Some(lease) = lease else {
        return LeaseStatus::Free;
    };
    let Some(owner_id) = &lease.owner_id else {
        return LeaseStatus::Free;
    };
    if owner_id == me {
        return LeaseStatus::Mine;
    }
    match lease.expires_at {
        Some(expires_at) if now > expires_at + terms.clock_skew => LeaseStatus::Free,
        expires_at => LeaseStatus::HeldByOther { owner_id: owner_id.clone(), expires_at },
    }
}

/// The lease could not be taken: another owner holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldElsewhere {
    pub owner_id: String,
    pub expires_at: Option<DateTime<Utc>>,
}

/// The fencing token of the first lease of a document that has no lease record at all (a new
/// document, or one recreated after it was deleted): the clock in milliseconds. Every token issued
/// before for this poller came from an older document whose tokens started at an earlier clock
/// reading and grew by one per acquisition, so the new token exceeds them all (as long as a poller
/// is acquired fewer than 1,000 times a second), and a receiver that fences on the token keeps
/// accepting deliveries after the state document is deleted.
pub fn first_fencing_token(now: DateTime<Utc>) -> u64 {
    u64::try_from(now.timestamp_millis()).unwrap_or(0).max(1)
}

/// The lease to write for `me` to hold the poller from `now`.
pub fn acquire(
    current: Option<&LeaseRecord>,
    me: &str,
    now: DateTime<Utc>,
    terms: &LeaseTerms,
) -> Result<LeaseRecord, HeldElsewhere> {
    let previous_token = current.map(|lease| lease.fencing_token).unwrap_or(0);
    match status(current, me, now, terms) {
        LeaseStatus::HeldByOther { owner_id, expires_at } => Err(HeldElsewhere { owner_id, expires_at }),
        LeaseStatus::Mine => {
            let acquired_at = current.and_then(|lease| lease.acquired_at).unwrap_or(now);
            Ok(LeaseRecord {
                owner_id: Some(me.to_string()),
                fencing_token: previous_token.max(1),
                acquired_at: Some(acquired_at),
                heartbeat_at: Some(now),
                expires_at: Some(now + terms.ttl),
            })
        }
        LeaseStatus::Free => Ok(LeaseRecord {
            owner_id: Some(me.to_string()),
            fencing_token: match current {
                Some(_) => previous_token + 1,
                None => first_fencing_token(now),
            },
            acquired_at: Some(now),
            heartbeat_at: Some(now),
            expires_at: Some(now + terms.ttl),
        }),
    }
}

/// We tried to renew or release a lease that is not ours any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotOwner {
    pub owner_id: Option<String>,
}

/// Extends our lease (a heartbeat, or the lease part of a commit).
pub fn renew(current: &LeaseRecord, me: &str, now: DateTime<Utc>, terms: &LeaseTerms) -> Result<LeaseRecord, NotOwner> {
    if current.owner_id.as_deref() != Some(me) {
        return Err(NotOwner { owner_id: current.owner_id.clone() });
    }
    Ok(LeaseRecord {
        owner_id: current.owner_id.clone(),
        fencing_token: current.fencing_token,
        acquired_at: current.acquired_at,
        heartbeat_at: Some(now),
        expires_at: Some(now + terms.ttl),
    })
}

/// Gives our lease up: the owner is cleared, the fencing token kept.
pub fn release(current: &LeaseRecord, me: &str, now: DateTime<Utc>) -> Result<LeaseRecord, NotOwner> {
    if current.owner_id.as_deref() != Some(me) {
        return Err(NotOwner { owner_id: current.owner_id.clone() });
    }
    Ok(LeaseRecord {
        owner_id: None,
        fencing_token: current.fencing_token,
        acquired_at: None,
        heartbeat_at: Some(now),
        expires_at: None,
    })
}

/// Whether the holder may still act (deliver, commit) at `now` by its own clock: it stops a skew
/// margin before expiry, since another instance whose clock runs ahead may take over at expiry.
pub fn holder_may_act(lease: &LeaseRecord, me: &str, now: DateTime<Utc>, terms: &LeaseTerms) -> bool {
    if lease.owner_id.as_deref() != Some(me) {
        return false;
    }
    match lease.expires_at {
        Some(expires_at) => now < expires_at - terms.clock_skew,
        None => false,
    }
}

/// When the holder should renew next, given the time of its last write of the lease.
pub fn next_heartbeat_due(lease: &LeaseRecord, terms: &LeaseTerms) -> Option<DateTime<Utc>> {
    lease.heartbeat_at.map(|at| at + terms.heartbeat)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn terms() -> LeaseTerms {
        LeaseTerms { ttl: Duration::seconds(60), heartbeat: Duration::seconds(15), clock_skew: Duration::seconds(5) }
    }

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + seconds, 0).unwrap()
    }

    /// Regression (issue 9, item 6): a document recreated after deletion must not restart its
    /// tokens at 1, below the ones receivers have already seen.
    #[test]
    fn the_first_acquire_takes_its_token_from_the_clock() {
        let lease = acquire(None, "a", at(0), &terms()).unwrap();
        assert_eq!(lease.fencing_token, 1_700_000_000_000);
        // A thousand acquisitions later, a recreated document still starts above them.
        let mut previous = lease.clone();
        for step in 1..=1000 {
            let next =
                acquire(Some(&previous), if step % 2 == 0 { "a" } else { "b" }, at(70 * step), &terms()).unwrap();
            previous = next;
        }
        assert_eq!(previous.fencing_token, 1_700_000_001_000);
        let recreated = acquire(None, "c", at(70 * 1000), &terms()).unwrap();
        assert!(recreated.fencing_token > previous.fencing_token);
        assert_eq!(lease.owner_id.as_deref(), Some("a"));
        assert_eq!(lease.expires_at, Some(at(60)));
    }

    #[test]
    fn a_live_lease_is_not_stolen_even_just_after_expiry() {
        let lease = acquire(None, "a", at(0), &terms()).unwrap();
        assert!(acquire(Some(&lease), "b", at(30), &terms()).is_err());
        // Expired by b's clock, but within the skew margin: a's clock may lag behind ours.
        assert!(acquire(Some(&lease), "b", at(64), &terms()).is_err());
        let taken = acquire(Some(&lease), "b", at(66), &terms()).unwrap();
        assert_eq!(taken.fencing_token, lease.fencing_token + 1);
    }

    #[test]
    fn a_released_lease_is_free_at_once_and_keeps_its_token() {
        let lease = acquire(None, "a", at(0), &terms()).unwrap();
        let released = release(&lease, "a", at(1)).unwrap();
        assert_eq!(released.owner_id, None);
        assert_eq!(released.fencing_token, lease.fencing_token);
        let taken = acquire(Some(&released), "b", at(1), &terms()).unwrap();
        assert_eq!(taken.fencing_token, lease.fencing_token + 1);
    }

    #[test]
    fn reacquiring_our_own_lease_keeps_the_token() {
        let lease = acquire(None, "a", at(0), &terms()).unwrap();
        let again = acquire(Some(&lease), "a", at(10), &terms()).unwrap();
        assert_eq!(again.fencing_token, lease.fencing_token);
        assert_eq!(again.expires_at, Some(at(70)));
    }

    #[test]
    fn only_the_owner_renews_or_releases() {
        let lease = acquire(None, "a", at(0), &terms()).unwrap();
        assert!(renew(&lease, "b", at(1), &terms()).is_err());
        assert!(release(&lease, "b", at(1)).is_err());
        assert_eq!(renew(&lease, "a", at(20), &terms()).unwrap().expires_at, Some(at(80)));
    }

    #[test]
    fn the_holder_stops_a_skew_margin_before_expiry() {
        let lease = acquire(None, "a", at(0), &terms()).unwrap();
        assert!(holder_may_act(&lease, "a", at(54), &terms()));
        assert!(!holder_may_act(&lease, "a", at(55), &terms()));
        assert!(!holder_may_act(&lease, "b", at(1), &terms()));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Acquire,
        Renew,
        Release,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![Just(Op::Acquire), Just(Op::Renew), Just(Op::Release)]
    }

    proptest! {
        /// Two owners never both believe they hold the lease at one instant of true time, with
        /// clocks that disagree by up to the skew margin. Every operation goes through one
        /// linearizable document (what CAS gives), as in production.
        #[test]
        fn two_owners_never_hold_at_once(
            offsets in proptest::collection::vec(-2_500i64..=2_500, 3),
            steps in proptest::collection::vec((0usize..3, 0i64..40_000, op()), 1..80),
        ) {
            let terms = terms();
            let owners = ["a", "b", "c"];
            let mut document: Option<LeaseRecord> = None;
            // For each owner, the true time (ms) until which it believes it may act.
            let mut believes_until: [i64; 3] = [i64::MIN; 3];
            let mut true_now_ms: i64 = 0;
            for (who, advance_ms, operation) in steps {
                true_now_ms += advance_ms;
                let local_now = at(0) + Duration::milliseconds(true_now_ms + offsets[who]);
                let me = owners[who];
                let next = match operation {
                    Op::Acquire => acquire(document.as_ref(), me, local_now, &terms).ok(),
                    Op::Renew => document.as_ref().and_then(|lease| renew(lease, me, local_now, &terms).ok()),
                    Op::Release => document.as_ref().and_then(|lease| release(lease, me, local_now).ok()),
                };
                let Some(next) = next else { continue };
                if next.owner_id.as_deref() == Some(me) {
                    // It now believes it holds the lease: nobody else may believe so too.
                    for other in 0..3 {
                        if other != who {
                            prop_assert!(
                                believes_until[other] <= true_now_ms,
                                "{} acquired at {} while {} believed it held until {}",
                                me, true_now_ms, owners[other], believes_until[other]
                            );
                        }
                    }
                    // Converted to true time: it acts while its local clock is below expiry - skew.
                    let expires_local = next.expires_at.unwrap() - terms.clock_skew;
                    let expires_true_ms = (expires_local - at(0)).num_milliseconds() - offsets[who];
                    believes_until[who] = expires_true_ms;
                    prop_assert!(holder_may_act(&next, me, local_now, &terms));
                } else {
                    believes_until[who] = true_now_ms;
                }
                if let Some(before) = document.as_ref() {
                    prop_assert!(next.fencing_token >= before.fencing_token, "fencing token went down");
                }
                document = Some(next);
            }
        }
    }
}
