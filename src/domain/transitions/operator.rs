//! The operator transitions (reset, clone, fingerprint accept, an audit entry): each appends to
//! `history`, and a forced one clears a live lease's owner, keeping its token.

use chrono::{DateTime, Utc};

use super::{HISTORY_LIMIT, HistoryAction, HistoryEntry, Operator, Refusal, ResetTarget};
use crate::domain::cursor::CursorJson;
use crate::domain::lease::{self, LeaseStatus, LeaseTerms};
use crate::domain::state::{Checkpoint, StateDocument, describe};

/// The document with an operator's action on something beside it (the quarantine) written into its
/// history; nothing else changes. Never refused: it records what was done.
pub fn audit(
    document: &StateDocument,
    operator: Operator<'_>,
    action: HistoryAction,
    what: String,
    now: DateTime<Utc>,
) -> StateDocument {
    operator_write(document, operator, false, (action, what), None, now)
}

/// The document with its checkpoint moved where an operator says (backwards, forwards, or to
/// nothing), whatever it was.
pub fn reset(
    document: &StateDocument,
    target: &ResetTarget,
    operator: Operator<'_>,
    now: DateTime<Utc>,
    terms: &LeaseTerms,
) -> Result<StateDocument, Refusal> {
    let forced = operator_may_write(document, operator, now, terms)?;
    let (checkpoint, what) = match target {
        ResetTarget::Beginning => (None, "reset to the beginning".to_string()),
        ResetTarget::After(position) => (
            Some(Checkpoint {
                cursor: CursorJson::from(position),
                last_successful_batch_id: "reset".to_string(),
                updated_at: now,
                metadata: serde_json::json!({"reset_by": operator.who}),
                extra: document.checkpoint.as_ref().map(|checkpoint| checkpoint.extra.clone()).unwrap_or_default(),
            }),
            format!("reset to after {}", describe(position)),
        ),
    };
    let mut next = operator_write(document, operator, forced, (HistoryAction::Reset, what), None, now);
    next.checkpoint = checkpoint;
    // A new fencing token: deliveries of a tick still running on the old checkpoint are then
    // recognisably stale to receivers (the next tick acquires above it again).
    if let Some(lease) = next.lease.as_mut() {
        lease.fencing_token += 1;
        lease.owner_id = None;
        lease.acquired_at = None;
        lease.expires_at = None;
    }
    // The failures recorded were those of the batch at the old checkpoint; a lost slot's stop is
    // lifted by this operator's decision.
    next.poison = None;
    next.failure = None;
    // An operator's reset acknowledges the source as it is now: the next tick records its generation.
    next.generation = None;
    Ok(next)
}

/// The document with the configuration's fingerprint recorded and the checkpoint kept: after an
/// intended change of the source definition that keeps the rows' order and meaning.
pub fn accept_fingerprint(
    document: &StateDocument,
    fingerprint: &str,
    operator: Operator<'_>,
    now: DateTime<Utc>,
    terms: &LeaseTerms,
) -> Result<StateDocument, Refusal> {
    if document.source_fingerprint == fingerprint {
        return Err(Refusal::NoChange(format!("the document already has fingerprint {fingerprint}")));
    }
    let forced = operator_may_write(document, operator, now, terms)?;
    let what = format!("accepted fingerprint {fingerprint}");
    let previous = Some(document.source_fingerprint.clone());
    let mut next = operator_write(document, operator, forced, (HistoryAction::FingerprintAccept, what), previous, now);
    next.source_fingerprint = fingerprint.to_string();
    Ok(next)
}

/// A new document for `poller_name` that starts where `source` is (or from the beginning): a
/// backfill or a migration on a separate name. No lease, fresh stats, the history of the copy
/// beginning with where it came from. A copy of the checkpoint keeps the source generation it
/// belongs to, so that a copy made after a reload is not taken for the new load's position.
pub fn clone_to(
    source: &StateDocument,
    poller_name: &str,
    from_beginning: bool,
    operator: Operator<'_>,
    now: DateTime<Utc>,
) -> StateDocument {
    let mut next = StateDocument::new(poller_name, &source.source_fingerprint);
    next.checkpoint = if from_beginning { None } else { source.checkpoint.clone() };
    // From the beginning, the next tick records the generation of the load it starts on.
    next.generation = if from_beginning { None } else { source.generation.clone() };
    let what = if from_beginning {
        format!("cloned from {} (from the beginning)", source.poller_name)
    } else {
        format!("cloned from {} at its checkpoint", source.poller_name)
    };
    next.history.push(HistoryEntry {
        at: now,
        who: operator.who.to_string(),
        action: Some(HistoryAction::Clone),
        what,
        previous_checkpoint: None,
        previous_fingerprint: None,
        forced: false,
        reason: operator.reason.map(str::to_string),
    });
    next
}

/// Whether an operator may write now; `Ok(true)` when it goes through a live lease by force.
fn operator_may_write(
    document: &StateDocument,
    operator: Operator<'_>,
    now: DateTime<Utc>,
    terms: &LeaseTerms,
) -> Result<bool, Refusal> {
    match lease::status(document.lease.as_ref(), operator.who, now, terms) {
        LeaseStatus::HeldByOther { .. } if operator.force => Ok(true),
        LeaseStatus::HeldByOther { owner_id, expires_at } => Err(Refusal::HeldElsewhere { owner_id, expires_at }),
        LeaseStatus::Free | LeaseStatus::Mine => Ok(false),
    }
}

/// The document after an operator write: the entry appended (the oldest dropped past the limit),
/// and a live lease (there only if forced) released, its token kept.
pub(super) fn operator_write(
    document: &StateDocument,
    operator: Operator<'_>,
    forced: bool,
    (action, what): (HistoryAction, String),
    previous_fingerprint: Option<String>,
    now: DateTime<Utc>,
) -> StateDocument {
    let mut next = document.clone();
    next.history.push(HistoryEntry {
        at: now,
        who: operator.who.to_string(),
        action: Some(action),
        what,
        previous_checkpoint: document.checkpoint.as_ref().map(|checkpoint| checkpoint.cursor.clone()),
        previous_fingerprint,
        forced,
        reason: operator.reason.map(str::to_string),
    });
    if next.history.len() > HISTORY_LIMIT {
        let excess = next.history.len() - HISTORY_LIMIT;
        next.history.drain(..excess);
    }
    if forced && let Some(lease) = next.lease.as_mut() {
        lease.owner_id = None;
        lease.acquired_at = None;
        lease.expires_at = None;
        lease.heartbeat_at = Some(now);
    }
    next
}
