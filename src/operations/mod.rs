//! The operator commands as library code: `reset`, `clone`, `fingerprint accept` and the
//! quarantine's `list`, `show`, `replay` and `purge`. The command line only parses, prints and asks
//! for confirmation; a simulation drives the same functions over its doubles and one clock.
//!
//! A write of a state document is two steps. A `plan` reads the document and computes the next
//! one by a pure transition ([`crate::domain::transitions`], which appends the audit entry to its
//! history): a [`Plan`] holding the document before, the document after and the version it was
//! read at. [`apply`] writes exactly that plan by compare-and-swap on that version, so a tick that
//! moved in between makes the write fail, not win. Between the two the caller shows the plan and
//! asks. The quarantine's writes (replay, purge) act on entries and record a line in the history
//! afterwards: see [`quarantine`].

pub mod clone;
pub mod fingerprint;
pub mod quarantine;
pub mod reset;

use crate::clock::Clock;
use crate::config::PollerConfig;
use crate::domain::StateDocument;
use crate::domain::transitions::Refusal;
use crate::source::{Source, SourceError};
use crate::store::{ETag, StateKey, StateStore, StoreError, WriteCondition};
use crate::tick::Poller;

pub use crate::domain::transitions::Operator;

/// What an operator command works on: one poller's configuration, its state store, its source
/// and the clock. The command line takes them from the app's poller ([`Parts::of`]); a
/// simulation from its doubles.
#[derive(Clone, Copy)]
pub struct Parts<'a> {
    pub config: &'a PollerConfig,
    pub store: &'a dyn StateStore,
    pub source: &'a dyn Source,
    pub clock: &'a dyn Clock,
}

impl<'a> Parts<'a> {
    pub fn of(poller: &'a Poller) -> Parts<'a> {
        Parts {
            config: &poller.config,
            store: poller.store.as_ref(),
            source: poller.source.as_ref(),
            clock: poller.clock.as_ref(),
        }
    }

    /// The poller's own state document.
    pub fn key(&self) -> StateKey {
        StateKey::new(&self.config.app_name, &self.config.poller_name)
    }
}

/// A planned write of one state document: what was read, what would be written, and the version
/// the write is conditional on.
#[derive(Debug, Clone)]
pub struct Plan {
    pub key: StateKey,
    /// The document as read (`None`: there was none).
    pub before: Option<StateDocument>,
    pub after: StateDocument,
    /// The version `before` was read at, or [`WriteCondition::Absent`] when there was none.
    pub condition: WriteCondition,
}

/// What became of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    Written(ETag),
    /// The document changed since it was read (a tick ran): nothing was written.
    Changed,
    /// A document appeared where there was none when the plan was made: nothing was written.
    Appeared,
}

/// Writes `plan` by compare-and-swap on the version it was read at, with a fresh write id.
pub async fn apply(store: &dyn StateStore, plan: &Plan) -> Result<Applied, StoreError> {
    let mut document = plan.after.clone();
    document.write_id = Some(uuid::Uuid::new_v4().simple().to_string());
    match store.write(&plan.key, &document, plan.condition.clone()).await {
        Ok(etag) => Ok(Applied::Written(etag)),
        Err(StoreError::Conflict { .. }) => Ok(Applied::Changed),
        Err(StoreError::AlreadyExists { .. }) => Ok(Applied::Appeared),
        Err(error) => Err(error),
    }
}

/// Why an operator command did not go ahead.
#[derive(Debug, thiserror::Error)]
pub enum OperationError {
    #[error("poller {poller} has no state document: nothing to change")]
    NoDocument { poller: String },
    #[error("poller {poller} already has a state document: refusing to overwrite it (reset it instead)")]
    AlreadyExists { poller: String },
    #[error("refused: {refusal}{}", hint(refusal))]
    Refused {
        #[from]
        refusal: Refusal,
    },
    /// What the operator asked for cannot be done as asked (a position, a name, an entry).
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The state document was written; the source's own position on the server (a logical
    /// source's slot) was not moved after it.
    #[error(
        "the state document was written, but the replication slot was not moved to the new checkpoint ({error}); \
         nothing is lost: the next tick skips what the checkpoint covers and moves the slot itself"
    )]
    NotMoved { error: SourceError },
}

fn hint(refusal: &Refusal) -> &'static str {
    match refusal {
        Refusal::HeldElsewhere { .. } => {
            "; a tick is running. Wait for it, or pass --force (its next write then fails)"
        }
        _ => "",
    }
}
