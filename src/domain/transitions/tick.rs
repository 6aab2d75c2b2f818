//! The transitions of a tick: the lease taken, renewed and given back, the checkpoint moved past
//! what was delivered, and failures recorded and cleared.

use chrono::{DateTime, Utc};

use super::Refusal;
use crate::domain::cursor::Position;
use crate::domain::lease::{self, HeldElsewhere, LeaseStatus, LeaseTerms};
use crate::domain::poison::PoisonRecord;
use crate::domain::state::{FailureRecord, StateDocument, advance_checkpoint};

/// The document with the lease taken by `me` (a new lease, or ours renewed).
pub fn acquire(
    document: &StateDocument,
    me: &str,
    now: DateTime<Utc>,
    terms: &LeaseTerms,
) -> Result<StateDocument, HeldElsewhere> {
    let lease = lease::acquire(document.lease.as_ref(), me, now, terms)?;
    let mut next = document.clone();
    next.lease = Some(lease);
    Ok(next)
}

/// The document with our lease extended.
pub fn heartbeat(
    document: &StateDocument,
    me: &str,
    now: DateTime<Utc>,
    terms: &LeaseTerms,
) -> Result<StateDocument, Refusal> {
    let lease = ours(document, me)?;
    let renewed = lease::renew(lease, me, now, terms).map_err(|not| Refusal::NotOwner { owner_id: not.owner_id })?;
    let mut next = document.clone();
    next.lease = Some(renewed);
    Ok(next)
}

/// The document with our lease given up (owner cleared, fencing token kept).
pub fn release(document: &StateDocument, me: &str, now: DateTime<Utc>) -> Result<StateDocument, Refusal> {
    let lease = ours(document, me)?;
    let released = lease::release(lease, me, now).map_err(|not| Refusal::NotOwner { owner_id: not.owner_id })?;
    let mut next = document.clone();
    next.lease = Some(released);
    Ok(next)
}

/// What a commit covers: the contiguous, acknowledged batches ending at `last`.
#[derive(Debug, Clone)]
pub struct Delivered<'a> {
    pub last: &'a Position,
    pub last_batch_id: &'a str,
    pub rows: usize,
    pub batches: usize,
    /// Rows of those batches kept in the quarantine instead of delivered.
    pub quarantined: usize,
}

/// The document with the checkpoint moved past `delivered` and our lease renewed, or released when
/// `release` (the last commit of a tick, which ended well: a failure record of earlier ticks is
/// cleared). A commit is a heartbeat.
pub fn commit(
    document: &StateDocument,
    me: &str,
    delivered: &Delivered<'_>,
    release: bool,
    now: DateTime<Utc>,
    terms: &LeaseTerms,
) -> Result<StateDocument, Refusal> {
    let lease = ours(document, me)?;
    let next_lease = if release { lease::release(lease, me, now) } else { lease::renew(lease, me, now, terms) }
        .map_err(|not| Refusal::NotOwner { owner_id: not.owner_id })?;
    let checkpoint =
        advance_checkpoint(document.checkpoint.as_ref(), delivered.last, delivered.last_batch_id, delivered.rows, now)?;
    let mut next = document.clone();
    next.checkpoint = Some(checkpoint);
    next.lease = Some(next_lease);
    // The batch at the checkpoint got through (or was isolated): its failures are history.
    next.poison = None;
    next.stats.quarantined += delivered.quarantined as u64;
    next.stats.rows_delivered += delivered.rows as u64;
    next.stats.batches_delivered += delivered.batches as u64;
    next.stats.last_tick_at = Some(now);
    if release {
        next.failure = None;
    }
    Ok(next)
}

/// A commit of the rows of a poison batch settled so far (delivered, or quarantined): the
/// checkpoint moves past them as in [`commit`], and `still_isolating` stays in the document, so
/// that the next tick goes on with the rest of the batch.
pub fn commit_isolating(
    document: &StateDocument,
    me: &str,
    delivered: &Delivered<'_>,
    still_isolating: PoisonRecord,
    release: bool,
    now: DateTime<Utc>,
    terms: &LeaseTerms,
) -> Result<StateDocument, Refusal> {
    let mut next = commit(document, me, delivered, release, now, terms)?;
    next.poison = Some(still_isolating);
    // The tick has not ended well: the batch is not past yet.
    next.failure = document.failure.clone();
    Ok(next)
}

/// The document after a failed tick: the failure of the batch at the checkpoint recorded, our
/// lease released (the checkpoint stays, so the next tick, anywhere, tries again at once).
pub fn record_failure(
    document: &StateDocument,
    me: &str,
    poison: PoisonRecord,
    now: DateTime<Utc>,
) -> Result<StateDocument, Refusal> {
    let mut next = release(document, me, now)?;
    next.poison = Some(poison);
    Ok(next)
}

/// The document after a tick that failed for another reason than the sink (a source error, a
/// checkpoint refused, a store error): one more failed tick in `failure`, and our lease released if
/// we hold it. A tick that failed before taking the lease records it too, unless another owner's
/// lease is live (that owner's ticks say how things are).
pub fn record_tick_failure(
    document: &StateDocument,
    me: &str,
    error: &str,
    now: DateTime<Utc>,
    terms: &LeaseTerms,
) -> Result<StateDocument, Refusal> {
    let mut next = match lease::status(document.lease.as_ref(), me, now, terms) {
        LeaseStatus::HeldByOther { owner_id, expires_at } => {
            return Err(Refusal::HeldElsewhere { owner_id, expires_at });
        }
        LeaseStatus::Mine => release(document, me, now)?,
        LeaseStatus::Free => document.clone(),
    };
    next.failure = Some(FailureRecord::after(document.failure.as_ref(), error, now));
    Ok(next)
}

/// Our lease given back at the end of a tick that ended well: a failure record of earlier ticks is
/// cleared with it.
pub fn release_after_success(document: &StateDocument, me: &str, now: DateTime<Utc>) -> Result<StateDocument, Refusal> {
    let mut next = release(document, me, now)?;
    if !late_undelivered(document) {
        next.failure = None;
    }
    Ok(next)
}

/// A late bucket whose delivery failed is still undelivered: the failure recorded for it stays
/// visible (to `status` and the watchdog) until it is delivered, whatever ticks pass between
/// (issue 35, finding 6).
fn late_undelivered(document: &StateDocument) -> bool {
    document.late.as_ref().is_some_and(|late| late.undelivered.is_some())
}

/// Moves the checkpoint of an idle tick's document to `rest` (where a read that found nothing
/// after the checkpoint ended), when that is forward; whether it moved. No row is counted.
pub fn rest_at(document: &mut StateDocument, rest: &Position, now: DateTime<Utc>) -> bool {
    let batch_id = document.checkpoint.as_ref().map(|checkpoint| checkpoint.last_successful_batch_id.clone());
    match advance_checkpoint(document.checkpoint.as_ref(), rest, batch_id.as_deref().unwrap_or("rest"), 0, now) {
        Ok(checkpoint) => {
            document.checkpoint = Some(checkpoint);
            true
        }
        Err(_) => false,
    }
}

/// The document an idle tick writes when it finds failures recorded: nothing waits after the
/// checkpoint, so whatever failed is fixed or gone (but a late bucket still undelivered keeps
/// its failure). `None` when there is nothing to clear (an idle
/// tick writes nothing).
pub fn clear_failures(document: &StateDocument) -> Option<StateDocument> {
    let failure = document.failure.is_some() && !late_undelivered(document);
    if !failure && document.poison.is_none() {
        return None;
    }
    let mut next = document.clone();
    if failure {
        next.failure = None;
    }
    next.poison = None;
    Some(next)
}

fn ours<'a>(document: &'a StateDocument, me: &str) -> Result<&'a lease::LeaseRecord, Refusal> {
    match &document.lease {
        Some(lease) if lease.owner_id.as_deref() == Some(me) => Ok(lease),
        Some(lease) => Err(Refusal::NotOwner { owner_id: lease.owner_id.clone() }),
        None => Err(Refusal::NotOwner { owner_id: None }),
    }
}
