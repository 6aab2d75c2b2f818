//! The tick's writes of its state document: commits (a commit is a heartbeat), heartbeats, the
//! release of the lease, and the failures recorded for `status` and the watchdog. Each one is a
//! pure transition written by compare-and-swap on the ETag the previous read or write left.

use tokio::task::AbortHandle;
use tracing::{info, warn};

use crate::domain::late::KeyRow;
use crate::domain::poison::PoisonRecord;
use crate::domain::state::describe;
use crate::domain::transitions::{self, Delivered, Refusal};
use crate::domain::{Position, StateDocument};
use crate::store::{StateWriter, StoreError, WriteFailure};

use super::Poller;
use super::outcome::{TickError, TickOutcome};

/// How long after a failed heartbeat the next attempt is made (the lease stays ours until it
/// expires; `holder_may_act` stops the tick before that).
pub(super) const HEARTBEAT_RETRY_DELAY: chrono::Duration = chrono::Duration::seconds(1);

/// A batch handed to the sink, awaiting its acknowledgement.
pub(super) struct Sent {
    pub(super) batch_id: String,
    pub(super) first: Position,
    pub(super) last: Position,
    pub(super) rows: usize,
    /// The batches it completes: 1 for a batch of today's window; for a run of the ordered
    /// window, the batches whose every event it brings under the checkpoint.
    pub(super) batches: usize,
    /// Its rows' keys, for the late-arrival window (empty while the detector is off).
    pub(super) keys: Vec<KeyRow>,
    /// Aborts its delivery, when a batch before it failed (`None`: a run of the ordered window).
    pub(super) abort: Option<AbortHandle>,
}

/// What a commit over `run` (contiguous acknowledged batches) records; `None` for no batch.
pub(super) fn delivered(run: &[Sent]) -> Option<Delivered<'_>> {
    let last = run.last()?;
    Some(Delivered {
        last: &last.last,
        last_batch_id: &last.batch_id,
        rows: run.iter().map(|sent| sent.rows).sum(),
        batches: run.iter().map(|sent| sent.batches).sum(),
        quarantined: 0,
    })
}

/// Why a heartbeat stopped the work.
pub(super) enum HeartbeatFailure {
    LeaseLost,
    Store(StoreError),
}

impl Poller {
    /// Moves the checkpoint over `ready` (acknowledged, contiguous batches) in one CAS that also
    /// renews or releases the lease. `false`: the lease was taken over, nothing was committed.
    pub(super) async fn commit_batches(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        ready: &[Sent],
        release: bool,
    ) -> Result<bool, TickError> {
        let delivered = delivered(ready).expect("a commit covers at least one batch");
        let keys: Vec<&[KeyRow]> = ready.iter().map(|sent| sent.keys.as_slice()).collect();
        let committed = self.commit(writer, document, &delivered, &keys, release, None).await?;
        if committed {
            let fencing_token = document.lease.as_ref().map(|lease| lease.fencing_token).unwrap_or_default();
            for sent in ready {
                info!(
                    poller = %self.config.poller_name,
                    batch = %sent.batch_id,
                    rows = sent.rows,
                    fencing_token,
                    checkpoint = %describe(&sent.last),
                    "batch delivered and committed"
                );
            }
        }
        Ok(committed)
    }

    /// Moves the checkpoint past `delivered` in one CAS that also renews or releases the lease,
    /// and extends the late-arrival window with its rows' `keys`; with `isolating`, the poison
    /// record stays (an isolation under way commits what it settled). `false`: the lease was taken
    /// over, nothing was committed.
    pub(super) async fn commit(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        delivered: &Delivered<'_>,
        keys: &[&[KeyRow]],
        release: bool,
        isolating: Option<&PoisonRecord>,
    ) -> Result<bool, TickError> {
        // Seed 003: re-check the generation before the side effect that matters, the commit; a
        // reload that began meanwhile makes the tick stand down.
        if self.config.source.generation.is_some()
            && let Some(bound) = document.generation.as_ref().map(|record| record.value.clone())
        {
            let current = self.source.generation().await?;
            if current.as_ref() != Some(&bound) {
                return Err(TickError::Superseded { bound: Box::new(bound), current: current.map(Box::new) });
            }
        }
        let now = self.clock.now();
        let terms = &self.config.lease;
        let transition = |document: &StateDocument, release: bool| {
            let mut next = match isolating {
                None => transitions::commit(document, &self.owner_id, delivered, release, now, terms),
                Some(record) => transitions::commit_isolating(
                    document,
                    &self.owner_id,
                    delivered,
                    record.clone(),
                    release,
                    now,
                    terms,
                ),
            }?;
            self.record_late(document, &mut next, keys);
            Ok(next)
        };
        // A source that moves a position of its own (a logical slot) moves it under the lease: the
        // last commit keeps the lease (clearing what a releasing one clears), and the write after
        // the source's move at the end of the tick gives it back.
        let kept = release && self.source.moves_under_lease();
        let release = release && !kept;
        let mut next = match transition(document, release) {
            Ok(next) if kept => StateDocument { failure: None, ..next },
            Ok(next) => next,
            Err(Refusal::Regression(regression)) => return Err(regression.into()),
            Err(_) => {
                writer.lost = true;
                self.source.fence(false);
                return Ok(false);
            }
        };
        if release {
            self.source.fence(false);
        }
        let written = writer.write(&mut next).await;
        // The rows were acknowledged, so the document may keep their checkpoint even if the write
        // failed: the release that follows writes it (or finds this write landed after all). A
        // failed release keeps the lease held in memory, or there would be no release to follow.
        *document = match (&written, release) {
            (Err(WriteFailure::Store(_)), true) => transition(document, false).unwrap_or(next),
            _ => next,
        };
        match written {
            Ok(()) => {
                self.committed_rows.fetch_add(delivered.rows as u64, std::sync::atomic::Ordering::Relaxed);
                // After the commit, never before: a logical source's slot moves past what it covers.
                // A failure here costs WAL retention until the next commit, never a change.
                if let Err(error) = self.source.committed(Some(delivered.last)).await {
                    warn!(poller = %self.config.poller_name, %error, "the source could not record the commit (the next one retries)");
                }
                Ok(true)
            }
            Err(WriteFailure::Conflict(_)) => {
                self.source.fence(false);
                Ok(false)
            }
            Err(WriteFailure::Store(error)) => Err(error.into()),
        }
    }

    /// Moves the checkpoint of `document` past `acknowledged` in memory only (no write): the
    /// release that ends a failed tick writes it.
    pub(super) fn absorb(&self, document: &mut StateDocument, acknowledged: &[Sent]) {
        let Some(delivered) = delivered(acknowledged) else {
            return;
        };
        if let Ok(mut next) =
            transitions::commit(document, &self.owner_id, &delivered, false, self.clock.now(), &self.config.lease)
        {
            let keys: Vec<&[KeyRow]> = acknowledged.iter().map(|sent| sent.keys.as_slice()).collect();
            self.record_late(document, &mut next, &keys);
            *document = next;
        }
    }

    /// Renews the lease while deliveries, a fetch or an isolation run. `Ok(true)`: renewed;
    /// `Ok(false)`: the write failed in a way worth retrying at the next interval (the lease is
    /// ours until it expires).
    pub(super) async fn heartbeat(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
    ) -> Result<bool, HeartbeatFailure> {
        let Ok(mut next) = transitions::heartbeat(document, &self.owner_id, self.clock.now(), &self.config.lease)
        else {
            writer.lost = true;
            self.source.fence(false);
            return Err(HeartbeatFailure::LeaseLost);
        };
        match writer.write(&mut next).await {
            Ok(()) => {
                *document = next;
                Ok(true)
            }
            Err(WriteFailure::Conflict(_)) => {
                self.source.fence(false);
                Err(HeartbeatFailure::LeaseLost)
            }
            Err(WriteFailure::Store(error)) => {
                // The document keeps the lease as it was: the writer remembers this write's id
                // in case it landed after all.
                warn!(poller = %self.config.poller_name, error = %error, "heartbeat failed, retrying");
                if error_is_retryable(&error) { Ok(false) } else { Err(HeartbeatFailure::Store(error)) }
            }
        }
    }

    /// Records the failure of the batch at the checkpoint and gives the lease back.
    pub(super) async fn write_failure(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        record: PoisonRecord,
    ) {
        let Ok(mut failed) = transitions::record_failure(document, &self.owner_id, record.clone(), self.clock.now())
        else {
            return;
        };
        self.letting_go().await;
        match writer.write(&mut failed).await {
            Ok(()) => *document = failed,
            Err(WriteFailure::Conflict(_)) => {}
            Err(WriteFailure::Store(error)) => {
                // The write may have landed. The lease stays held in memory, so that the release
                // ending the tick follows; it carries the failure too, so that it records it if this
                // write did not land, and cannot erase it if it did (the writer finds its own
                // write there and writes over it). As a commit's checkpoint is kept for its release.
                document.poison = Some(record);
                warn!(poller = %self.config.poller_name, error = %error, "could not record the failure; the release retries it");
            }
        }
    }

    /// Records a tick that failed for another reason than the sink (see
    /// [`TickError::needs_failure_record`]) and gives the lease back if it is ours; written only
    /// while no other owner's lease is live.
    pub(super) async fn write_tick_failure(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        error: &TickError,
    ) {
        let mut failed = transitions::record_tick_failure(
            document,
            &self.owner_id,
            &error.to_string(),
            self.clock.now(),
            &self.config.lease,
        );
        // A lost slot stops the poller until an operator resets it.
        let lost = match error {
            TickError::Source(crate::source::SourceError::SlotLost { slot, .. }) => Some(slot.clone()),
            TickError::Source(crate::source::SourceError::BinlogLost { file, .. }) => {
                Some(format!("{}{file}", crate::source::BINLOG_LOST_PREFIX))
            }
            _ => None,
        };
        if let (Ok(next), Some(lost)) = (&mut failed, lost)
            && let Some(failure) = next.failure.as_mut()
        {
            failure.slot_lost = Some(lost);
        }
        self.write_letting_go(writer, document, failed, "could not record the failure").await;
    }

    /// Gives the lease back without moving the checkpoint: after a failure, so that the retry on any
    /// instance need not wait for expiry, or when the tick ends without a releasing commit (having
    /// ended well, it clears the failures of earlier ticks). Best effort: if the write fails, the
    /// lease simply expires.
    pub(super) async fn release_lease(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        ended_well: bool,
    ) {
        let released = if ended_well {
            transitions::release_after_success(document, &self.owner_id, self.clock.now())
        } else {
            transitions::release(document, &self.owner_id, self.clock.now())
        };
        self.write_letting_go(writer, document, released, "could not release the lease; it will expire").await;
    }

    /// Writes a document that gives the lease back (a release, a recorded failure), if the
    /// transition allowed it. Best effort: if the write fails, the lease simply expires.
    async fn write_letting_go(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        next: Result<StateDocument, Refusal>,
        if_it_fails: &str,
    ) {
        let Ok(mut next) = next else {
            return;
        };
        self.letting_go().await;
        match writer.write(&mut next).await {
            Ok(()) => *document = next,
            Err(WriteFailure::Conflict(_)) => {}
            Err(WriteFailure::Store(error)) => {
                warn!(poller = %self.config.poller_name, error = %error, "{if_it_fails}");
            }
        }
    }

    /// Before a write that gives the lease back: a source that moves a position of its own (a
    /// logical slot) ends its reading and makes its move while the lease is still held, and moves
    /// nothing after.
    async fn letting_go(&self) {
        if self.source.moves_under_lease()
            && let Err(error) = self.source.tick_ended().await
        {
            warn!(poller = %self.config.poller_name, %error, "the source could not end the tick cleanly (the next tick retries)");
        }
        self.source.fence(false);
    }

    /// After a panic the tick's own view of the document is gone: read it again, and record the
    /// failed tick by CAS (releasing the lease if this process holds it).
    pub(super) async fn record_panic(&self, error: &TickError) {
        let key = self.key();
        let (mut document, etag) = match self.store.read(&key).await {
            Ok(Some(versioned)) => (versioned.document, Some(versioned.etag)),
            // No document: a panic before the first write; recorded in a new one.
            Ok(None) => (StateDocument::new(&self.config.poller_name, &self.config.fingerprint), None),
            Err(_) => return,
        };
        let fingerprint = transitions::check_fingerprint(
            &document.source_fingerprint,
            &self.config.fingerprint,
            self.config.legacy_fingerprint.as_deref(),
        );
        if fingerprint == transitions::FingerprintCheck::Changed {
            // Not ours to write: the fingerprint check says what is wrong.
            return;
        }
        let mut writer = StateWriter::new(self.store.as_ref(), &key, etag);
        self.write_tick_failure(&mut writer, &mut document, error).await;
    }
}

fn error_is_retryable(error: &StoreError) -> bool {
    matches!(error, StoreError::Unavailable { retryable: true, .. })
}

/// The outcome of a tick that found the document written by someone else when it wrote.
pub(super) fn held_by_whoever_wrote(current: Option<Box<StateDocument>>) -> TickOutcome {
    let lease = current.and_then(|document| document.lease);
    match lease {
        Some(lease) => TickOutcome::LeaseHeld {
            owner_id: lease.owner_id.unwrap_or_else(|| "(released)".to_string()),
            expires_at: lease.expires_at,
        },
        None => TickOutcome::LeaseHeld { owner_id: "(unknown)".to_string(), expires_at: None },
    }
}
