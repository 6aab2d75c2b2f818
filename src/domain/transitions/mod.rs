//! Every change to a state document, as a pure function of (document, inputs, `now`) that returns
//! the next document or a [`Refusal`]. The tick and the operator commands make the same decisions
//! through these functions; what they do not decide is whether the write lands (that is the store's
//! compare-and-swap).
//!
//! | transition            | refused when                                                        |
//! |-----------------------|---------------------------------------------------------------------|
//! | [`acquire`]           | another owner's lease is live (expiry + skew not passed)            |
//! | [`heartbeat`]         | the lease is not ours                                               |
//! | [`commit`]            | the lease is not ours; the checkpoint would not move forward        |
//! | [`release`]           | the lease is not ours                                               |
//! | [`commit_isolating`]  | as [`commit`]; the poison record kept, for an isolation under way    |
//! | [`record_failure`]    | the lease is not ours                                               |
//! | [`record_tick_failure`]| another owner's lease is live                                      |
//! | [`clear_failures`]    | never (`None`: nothing to clear)                                    |
//! | [`rest_at`]           | never (`false`: the rest is not forward of the checkpoint)          |
//! | [`reset`]             | another owner's lease is live, unless forced                        |
//! | [`accept_fingerprint`]| another owner's lease is live, unless forced; nothing would change   |
//! | [`clone_to`]          | never (a new document for another poller name)                      |
//!
//! Operator transitions (reset, clone, fingerprint accept) append an entry to `history` (who, when,
//! what, the checkpoint before), keeping the last [`HISTORY_LIMIT`]. A forced operator write clears
//! the lease owner and keeps the fencing token, so the next tick acquires at once with a higher
//! token, and the displaced holder's next write fails on the ETag.

mod identity;
mod operator;
mod tick;

#[cfg(test)]
mod tests;

use chrono::{DateTime, Utc};

use super::cursor::Position;
use super::state::CheckpointRegression;
pub use super::state::{HistoryAction, HistoryEntry};
pub use identity::{FingerprintCheck, GenerationCheck, check_fingerprint, check_generation, rebase};
pub use operator::{accept_fingerprint, audit, clone_to, reset};
pub use tick::{
    Delivered, acquire, clear_failures, commit, commit_isolating, heartbeat, record_failure, record_tick_failure,
    release, release_after_success, rest_at,
};

/// How many operator entries a document keeps.
pub const HISTORY_LIMIT: usize = 50;

/// Why a transition was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the lease is held by {owner_id} until {}", expires_at.map(|at| at.to_rfc3339()).unwrap_or_else(|| "an unknown time".into()))]
    HeldElsewhere { owner_id: String, expires_at: Option<DateTime<Utc>> },
    #[error("the lease is not ours (it is {})", owner_id.as_deref().unwrap_or("released"))]
    NotOwner { owner_id: Option<String> },
    #[error(transparent)]
    Regression(#[from] CheckpointRegression),
    #[error("nothing to change: {0}")]
    NoChange(String),
}

/// Who is acting, for the operator transitions.
#[derive(Debug, Clone, Copy)]
pub struct Operator<'a> {
    /// `user@host`.
    pub who: &'a str,
    /// Act even though another owner's lease is live.
    pub force: bool,
    /// Why, in the operator's words (`--reason`).
    pub reason: Option<&'a str>,
}

/// Where a reset puts the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum ResetTarget {
    /// No checkpoint: the next tick starts from the first row.
    Beginning,
    /// Just after this position (a cursor value and its key, or the source's last row for
    /// "to the end").
    After(Position),
}
