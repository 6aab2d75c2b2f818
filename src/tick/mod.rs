//! One tick of one poller: the orchestrator. It carries out the domain's decisions over the
//! traits (store, source, sink) and owns nothing but the order of things:
//!
//! 1. read the state document (1 GET); a live lease held elsewhere ends the tick; a changed source
//!    fingerprint fails it loudly;
//! 2. fetch the first batch after the checkpoint; nothing there ends the tick with no write at all
//!    (one, when failures of earlier ticks are recorded: nothing waits, so they are cleared);
//! 3. take the lease by CAS on the ETag just read (a conflict means someone moved first: stop);
//! 4. deliver batches, up to `maxInFlight` at once, fetching each next batch as the previous one
//!    leaves; commit by CAS the contiguous prefix of acknowledged batches (a commit renews the
//!    lease); heartbeat only when no commit happened for a heartbeat interval
//!    ([`pipeline`]); a batch that fails is, once the batches before it are committed, the batch at
//!    the checkpoint: its failure is counted and, poison, it is isolated ([`isolate`]);
//! 5. stop when caught up or at the tick budget; the last commit releases the lease.
//!
//! A source with a position of its own on the server (a logical slot, [`Source::fence`]) moves it
//! only under the lease: when a move is owed the lease is taken before step 2, and the lease is
//! kept after the last commit, given back by a write of its own once the source moved.
//!
//! A failed tick (a delivery, a fetch, a commit, even a panic) leaves the checkpoint past what was
//! acknowledged only, releases the lease, and is recorded in the document (`poison` for the batch
//! at the checkpoint, `failure` for anything else) so that `status` and the watchdog see it; the
//! next tick, anywhere, retries at once. Every write reuses the ETag of the previous read or write:
//! a tick that delivers k batches costs 1 GET and k + 1 PUTs.
//!
//! | file          | holds                                                                    |
//! |---------------|--------------------------------------------------------------------------|
//! | `mod.rs`      | [`Poller`], the tick's steps and how it ends                             |
//! | `pipeline.rs` | the delivery loop: window, deliveries, reads, commits, a failed batch    |
//! | `isolate.rs`  | isolating a poison batch, holding the lease, committing as it settles    |
//! | `late.rs`     | the late-arrival detector: its window recorded, recounted, delivered    |
//! | `late_refused.rs` | a late batch the receiver refuses: isolated, quarantined, held       |
//! | `ledger.rs`   | what was sent and what a commit over it records; the document writes:    |
//! |               | commit, heartbeat, release, failures recorded                            |
//! | `ordered.rs`  | the ordered window: a key's events in order, keys in parallel (issue 38) |
//! | `reader.rs`   | the batches: made from rows, read ahead                                  |
//! | `budget.rs`   | the app-wide budget of bytes in flight that every read reserves from     |
//! | `outcome.rs`  | [`TickOutcome`], [`TickError`], [`TickReport`]                           |
//! | `timer.rs`    | the loops' timer (the [`Clock`] itself is [`crate::clock`]'s)            |

pub mod budget;
mod isolate;
mod late;
mod late_refused;
mod ledger;
mod ordered;
mod outcome;
mod pipeline;
mod reader;
mod timer;

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;
use tracing::{error, warn};

#[cfg(any(test, feature = "testing"))]
pub use crate::clock::ManualClock;
pub use crate::clock::{Clock, SystemClock};
pub use outcome::{LagAfter, LateCheck, SUMMARY_LAG_CAP, StopReason, TickError, TickOutcome, TickReport};

use chrono::{DateTime, Utc};

use crate::config::{OnGenerationChange, PollerConfig};
use crate::domain::StateDocument;
use crate::domain::ids::EventIds;
use crate::domain::lease::{self, LeaseStatus};
use crate::domain::poison::{self, PoisonMode};
use crate::domain::state::describe;
use crate::domain::transitions::{self, FingerprintCheck, GenerationCheck};
use crate::sink::Sink;
use crate::source::{FetchLimit, Source, SourceError};
use crate::store::{BlobStore, StateKey, StateStore, StateWriter, WriteFailure};

use isolate::Isolation;
use ledger::held_by_whoever_wrote;
use outcome::Totals;
use reader::BatchMaker;

/// Everything one poller needs, created once and reused by every tick.
pub struct Poller {
    pub config: PollerConfig,
    pub source: Arc<dyn Source>,
    pub sink: Arc<dyn Sink>,
    pub store: Arc<dyn StateStore>,
    pub clock: Arc<dyn Clock>,
    /// This process's lease owner id.
    pub owner_id: String,
    /// Where rows isolated as poison are kept (the state store, at the bytes level). Without one
    /// a poison batch is retried like any failure.
    pub quarantine: Option<Arc<dyn BlobStore>>,
    /// One tick at a time per poller in this process (the lease guards across processes).
    running: tokio::sync::Mutex<()>,
    /// The state store as the tick sees it, counting its requests.
    counted: Arc<crate::store::Counted>,
    /// What the running tick learnt for its summary line (token, lag after it).
    learnt: std::sync::Mutex<Learnt>,
    /// Rows committed by this poller in this process, ever: a long tick's progress.
    committed_rows: std::sync::atomic::AtomicU64,
    /// Ticks of this poller in this process: the late-arrival check runs at one in `everyTicks`.
    late_ticks: std::sync::atomic::AtomicU64,
    /// Where the late-arrival checks' turn over the window's older buckets is.
    late_sweep: std::sync::Mutex<crate::domain::late::sweep::Sweep>,
    /// The app's budget of bytes in flight, which every read of a batch reserves from (none: no
    /// bound but the poller's own window).
    budget: Option<Arc<budget::BytesBudget>>,
    /// How long the running tick's reads waited for that budget, in microseconds.
    budget_waited: Arc<std::sync::atomic::AtomicU64>,
}

/// What a tick learns on the way that its outcome does not carry.
#[derive(Debug, Clone, Copy, Default)]
struct Learnt {
    fencing_token: Option<u64>,
    lag_after: Option<LagAfter>,
    late_check: LateCheck,
    late_arrivals: u64,
    max_lateness_seconds: Option<u64>,
}

impl Poller {
    pub fn new(
        config: PollerConfig,
        source: Arc<dyn Source>,
        sink: Arc<dyn Sink>,
        store: Arc<dyn StateStore>,
        clock: Arc<dyn Clock>,
        owner_id: String,
    ) -> Self {
        let counted = Arc::new(crate::store::Counted::new(store));
        Poller {
            config,
            source,
            sink,
            store: counted.clone(),
            clock,
            owner_id,
            quarantine: None,
            running: tokio::sync::Mutex::new(()),
            counted,
            learnt: std::sync::Mutex::new(Learnt::default()),
            committed_rows: std::sync::atomic::AtomicU64::new(0),
            late_ticks: std::sync::atomic::AtomicU64::new(0),
            late_sweep: std::sync::Mutex::new(Default::default()),
            budget: None,
            budget_waited: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        }
    }

    /// Reads reserve their batches' bytes from `budget`, shared by the app's pollers.
    pub fn with_budget(mut self, budget: Arc<budget::BytesBudget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// What the reads of this poller's ticks reserve from, and where their waits are added up.
    fn reservations(&self) -> budget::Reservations {
        budget::Reservations { budget: self.budget.clone(), waited: self.budget_waited.clone() }
    }

    /// Keeps rows isolated as poison in `blobs` (`quarantine/{app}/{poller}/…`).
    pub fn with_quarantine(mut self, blobs: Arc<dyn BlobStore>) -> Self {
        self.quarantine = Some(blobs);
        self
    }

    pub fn key(&self) -> StateKey {
        StateKey::new(&self.config.app_name, &self.config.poller_name)
    }

    fn fetch_limit(&self) -> FetchLimit {
        FetchLimit { rows: self.config.batch.size, bytes: self.config.batch.max_bytes }
    }

    /// Runs one tick. A panic anywhere in it (a driver bug, a value nobody foresaw) becomes a
    /// failed tick with its message, and the lease is given back if this process holds it: it
    /// never kills the process nor leaves the poller blocked until the lease expires.
    pub async fn tick(&self) -> Result<TickOutcome, TickError> {
        self.tick_reported().await.0
    }

    /// Runs one tick, and says what it cost beside how it ended (for its summary line).
    pub async fn tick_reported(&self) -> (Result<TickOutcome, TickError>, TickReport) {
        let Ok(_running) = self.running.try_lock() else {
            return (Ok(TickOutcome::Busy), TickReport::default());
        };
        let started = self.clock.now();
        // However the tick ends (a panic, this future dropped), a connection its reads kept goes back.
        let _reads = EndReads(self.source.as_ref());
        let (reads_before, writes_before) = self.counted.counts();
        *self.learnt.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Learnt::default();
        self.budget_waited.store(0, std::sync::atomic::Ordering::Relaxed);
        let result = match AssertUnwindSafe(self.run_tick()).catch_unwind().await {
            Ok(result) => result,
            Err(panic) => {
                let message = panic_message(panic.as_ref());
                error!(poller = %self.config.poller_name, "the tick panicked: {message}");
                let error = TickError::Panicked { message };
                self.source.fence(false);
                self.record_panic(&error).await;
                Err(error)
            }
        };
        let learnt = *self.learnt.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (reads, writes) = self.counted.counts();
        let lag_after = match &result {
            Ok(TickOutcome::Idle | TickOutcome::Delivered { stop: StopReason::CaughtUp, .. }) => {
                Some(LagAfter { rows: 0, capped: false })
            }
            _ => learnt.lag_after,
        };
        let report = TickReport {
            duration_ms: (self.clock.now() - started).num_milliseconds(),
            blob_reads: reads - reads_before,
            blob_writes: writes - writes_before,
            fencing_token: learnt.fencing_token,
            lag_after,
            late_check: learnt.late_check,
            late_arrivals: learnt.late_arrivals,
            max_lateness_seconds: learnt.max_lateness_seconds,
            connection_wait_ms: self.source.connection_wait().as_millis() as u64,
            budget_wait_ms: self.budget_waited.load(std::sync::atomic::Ordering::Relaxed) / 1000,
        };
        (result, report)
    }

    /// Rows this poller committed in this process so far (a tick in progress included).
    pub fn committed_rows(&self) -> u64 {
        self.committed_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn learn(&self, change: impl FnOnce(&mut Learnt)) {
        change(&mut self.learnt.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
    }

    async fn run_tick(&self) -> Result<TickOutcome, TickError> {
        // Every decision about time in this tick (budget, lease, heartbeat) reads this one clock.
        // (The configuration bounds the budget to a day, far from any overflow.)
        let deadline = self.clock.now() + chrono::Duration::seconds(self.config.batch.tick_budget.as_secs() as i64);
        let key = self.key();

        // 1. One read. A document that cannot be read is left as it is: nothing is recorded in it.
        let (mut document, etag) = match self.store.read(&key).await? {
            Some(versioned) => (versioned.document, Some(versioned.etag)),
            None => (StateDocument::new(&self.config.poller_name, &self.config.fingerprint), None),
        };
        let new_document = etag.is_none();
        match transitions::check_fingerprint(
            &document.source_fingerprint,
            &self.config.fingerprint,
            self.config.legacy_fingerprint.as_deref(),
        ) {
            FingerprintCheck::Same => {}
            // Written by an earlier build for the same target: the next write records today's form.
            FingerprintCheck::Earlier => document.source_fingerprint = self.config.fingerprint.clone(),
            FingerprintCheck::Changed => {
                return Err(TickError::FingerprintMismatch {
                    stored: document.source_fingerprint.clone(),
                    current: self.config.fingerprint.clone(),
                });
            }
        }
        if let LeaseStatus::HeldByOther { owner_id, expires_at } =
            lease::status(document.lease.as_ref(), &self.owner_id, self.clock.now(), &self.config.lease)
        {
            return Ok(TickOutcome::LeaseHeld { owner_id, expires_at });
        }

        let mut writer = StateWriter::new(self.store.as_ref(), &key, etag);
        self.source.fence(false);
        let mut result = self.work(&mut writer, &mut document, new_document, deadline).await;
        // Nothing more is read for delivery: a connection kept between the reads goes back before
        // the count and the last write.
        self.source.end_reads();
        if let Err(TickError::Source(SourceError::SlotInUse { .. })) = &result
            && !self.holds_lease(&document)
            && let Some(held) = self.held_since(&key).await
        {
            // The slot's reader is the tick that took the lease after this one's first read.
            result = Ok(held);
        }
        // A source that moves a position of its own (a logical slot) keeps the lease to here: it
        // counts and moves under it, and the write that follows gives it back.
        let leased = self.may_act(&writer, &document);
        self.source.fence(leased);
        if let Ok(TickOutcome::Delivered { stop: StopReason::BudgetExhausted | StopReason::Isolated, .. }) = &result
            && (leased || !self.source.moves_under_lease())
            && let Ok(position) = document.position()
        {
            // Rows are left: how many (capped, so that it stays cheap), for the summary line;
            // before the lease is given back (a logical source reads its slot for it).
            match self.source.count_after(position.as_ref(), SUMMARY_LAG_CAP).await {
                Ok(rows) => self.learn(|learnt| {
                    learnt.lag_after =
                        Some(LagAfter { rows, capped: rows >= SUMMARY_LAG_CAP.min(self.source.count_limit()) });
                }),
                Err(error) => warn!(poller = %self.config.poller_name, "cannot count the rows left: {error}"),
            }
        }
        if let Err(error) = self.source.tick_ended().await {
            warn!(poller = %self.config.poller_name, %error, "the source could not end the tick cleanly (the next tick retries)");
        }
        self.source.fence(false);
        self.end(&mut writer, &mut document, &result).await;
        let outcome = match result {
            Err(TickError::Superseded { bound, current }) => {
                warn!(poller = %self.config.poller_name, bound = %bound, "the source generation moved during the tick: standing down");
                return Ok(TickOutcome::Superseded { bound: *bound, current: current.map(|current| *current) });
            }
            other => other?,
        };
        Ok(match outcome {
            TickOutcome::Delivered { rows, batches, checkpoint, stop, quarantined, .. } => {
                TickOutcome::Delivered { rows, batches, checkpoint, stop, new_document, quarantined }
            }
            other => other,
        })
    }

    /// The tick after its first read: the generation, the first fetch, the lease, the work.
    async fn work(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        new_document: bool,
        deadline: DateTime<Utc>,
    ) -> Result<TickOutcome, TickError> {
        // A logical source's slot found lost by an earlier tick: a gap, until an operator resets
        // the poller (even if the slot was created again meanwhile).
        if let Some(failure) = &document.failure
            && let Some(slot) = &failure.slot_lost
        {
            let since = format!(
                "an earlier tick found it lost (the poller has failed since {}), and no operator has reset the poller since",
                failure.first_failure_at.to_rfc3339()
            );
            if let Some(file) = slot.strip_prefix(crate::source::BINLOG_LOST_PREFIX) {
                return Err(TickError::Source(crate::source::SourceError::BinlogLost {
                    location: self.source.describe(),
                    file: file.to_string(),
                    reason: since,
                }));
            }
            return Err(TickError::Source(crate::source::SourceError::SlotLost {
                location: self.source.describe(),
                slot: slot.clone(),
                reason: since,
            }));
        }
        // A source read from a server's log (a binary log) says where the checkpoint is on the
        // server read now: recorded by CAS before anything is read (a failover re-bases it).
        let rebase = self
            .source
            .rebase(document.position()?.as_ref(), document.generation.as_ref().map(|record| &record.value))
            .await?;
        if let Some(rebase) = rebase {
            let mut next = transitions::rebase(
                document,
                rebase.checkpoint.as_ref(),
                &rebase.server,
                rebase.what.as_deref(),
                self.clock.now(),
            );
            if let Some(what) = &rebase.what {
                warn!(poller = %self.config.poller_name, "{what}");
            }
            match writer.write(&mut next).await {
                Ok(()) => *document = next,
                Err(WriteFailure::Conflict(current)) => return Ok(held_by_whoever_wrote(current)),
                Err(WriteFailure::Store(error)) => return Err(error.into()),
            }
        }
        // 2. The source generation the work is bound to (seed 003), read before any row.
        let generation = self.source.generation().await?;
        let restart = self
            .config
            .source
            .generation
            .as_ref()
            .is_some_and(|config| config.on_change == OnGenerationChange::Restart);
        let mut restarted = false;
        match transitions::check_generation(document, generation.as_ref(), restart, self.clock.now()) {
            GenerationCheck::Same => {}
            GenerationCheck::Adopted(next) => *document = next,
            GenerationCheck::Restarted(next) => {
                warn!(
                    poller = %self.config.poller_name,
                    "{}",
                    next.history.last().map(|entry| entry.what.as_str()).unwrap_or("source generation changed")
                );
                *document = next;
                restarted = true;
            }
            GenerationCheck::Stopped { stored, current } => {
                return Err(TickError::GenerationChanged { stored: stored.to_string(), current: current.to_string() });
            }
        }

        // 3. Anything to do? Rows after the checkpoint, or (at one tick in `everyTicks`) rows
        // committed behind it since it passed them ([`late`]).
        let late_found = self.check_late(document).await;
        let checkpoint = document.position()?;
        // A source with a position of its own (a logical source's slot) learns what is committed,
        // and moves it under the lease only: when a move is owed, the lease comes before the read.
        self.source.committed(checkpoint.as_ref()).await?;
        let late_to_deliver = late_found.as_ref().is_some_and(late::LateFound::has_late);
        let mut owed = self.source.move_owed().await?;
        let mut first_read = None;
        if !owed {
            let read = self.read_first(checkpoint.as_ref()).await?;
            if read.0.rows.is_empty() && !late_to_deliver {
                // A read that reached an end of the WAL far past the slot owes it a move too.
                owed = self.source.move_owed().await?;
            }
            first_read = Some(read);
        }
        let nothing_read = first_read.as_ref().is_some_and(|(first, _)| first.rows.is_empty());
        if !owed && nothing_read && !late_to_deliver {
            // Nothing waits: failures recorded by earlier ticks are of a problem fixed or gone,
            // and are cleared with the restart, if there was one, in one write by CAS (with the
            // late-arrival buckets that shrank, if the check found some).
            let mut next = document.clone();
            let adopted = late_found.as_ref().is_some_and(|found| self.adopt_shrunk(&mut next, found));
            let cleared = transitions::clear_failures(&next);
            let next_is_cleared = cleared.is_some();
            if let Some(cleared) = cleared {
                next = cleared;
            }
            // A source read from the end of a log (a binary log) records where the read ended:
            // a first tick fixes where the poller starts, a quiet one follows the log.
            let rested = match self.source.resting_position(checkpoint.as_ref()).await? {
                Some(rest) => transitions::rest_at(&mut next, &rest, self.clock.now()),
                None => false,
            };
            if restarted || next_is_cleared || adopted || rested {
                match writer.write(&mut next).await {
                    Ok(()) => *document = next,
                    Err(WriteFailure::Conflict(current)) => return Ok(held_by_whoever_wrote(current)),
                    Err(WriteFailure::Store(error)) if restarted => return Err(error.into()),
                    Err(WriteFailure::Store(error)) => {
                        warn!(poller = %self.config.poller_name, error = %error, "could not clear the failures recorded");
                    }
                }
            }
            return Ok(TickOutcome::Idle);
        }

        // Buckets of the late-arrival window that shrank (rows updated past the checkpoint, or
        // deleted) take their recount, written with the lease.
        if let Some(found) = late_found.as_ref() {
            self.adopt_shrunk(document, found);
        }

        // 3. Take the lease, on the clock as it is after the query (which may have been slow).
        let mut acquired = match transitions::acquire(document, &self.owner_id, self.clock.now(), &self.config.lease) {
            Ok(acquired) => acquired,
            Err(held) => return Ok(TickOutcome::LeaseHeld { owner_id: held.owner_id, expires_at: held.expires_at }),
        };
        let fencing_token = acquired.lease.as_ref().map(|lease| lease.fencing_token).unwrap_or_default();
        self.learn(|learnt| learnt.fencing_token = Some(fencing_token));
        if new_document {
            warn!(
                poller = %self.config.poller_name,
                state = %self.store.describe(),
                fencing_token,
                "no state document for this poller: starting a new one, from the beginning of the source \
                 (if it existed before, it was deleted: every row is delivered again)"
            );
        }
        let written = writer.write(&mut acquired).await;
        *document = acquired;
        match written {
            Ok(()) => self.source.fence(true),
            Err(WriteFailure::Conflict(current)) => return Ok(held_by_whoever_wrote(current)),
            // The write may have landed: the end of the tick gives the lease back if it did.
            Err(WriteFailure::Store(error)) => return Err(error.into()),
        }
        let (first, first_hold) = match first_read {
            Some(read) => read,
            None => self.read_first(checkpoint.as_ref()).await?,
        };
        if first.rows.is_empty() && !late_to_deliver {
            // Only the source's own move was owed: made at the end of the tick, under the lease;
            // nothing waits, so the failures of earlier ticks are cleared with the release.
            if let Some(cleared) = transitions::clear_failures(document) {
                *document = cleared;
            }
            return Ok(TickOutcome::Idle);
        }

        // 4 and 5. Deliver and commit until caught up or out of budget; or go straight on with
        // the isolation the previous tick left unfinished.
        let maker = Arc::new(BatchMaker {
            ids: EventIds::new(&self.config.poller_name, &self.config.fingerprint),
            poller: self.config.poller_name.clone(),
            fingerprint: self.config.fingerprint.clone(),
            fencing_token,
            generation: generation.clone(),
            grouping: match &self.config.batch.order {
                crate::config::Order::Key { columns } if self.config.batch.max_in_flight > 1 => Some(columns.clone()),
                _ => None,
            },
        });
        if let Some(isolation) = self.resumed_isolation(document, first.rows.as_slice(), &maker) {
            warn!(poller = %self.config.poller_name, attempts = isolation.record.attempts, "going on isolating a poison batch");
            return self.isolate(writer, document, isolation, Totals::default(), deadline).await;
        }
        let Some(found) = late_found.filter(late::LateFound::has_late) else {
            return self.deliver_and_commit(writer, document, (first, first_hold), maker, deadline, false).await;
        };
        // Late rows go after the tick's own batches (the lease kept for them), so that a late batch
        // that keeps failing never holds up new rows.
        let outcome = if first.rows.is_empty() {
            Totals { checkpoint: checkpoint.as_ref().map(describe), ..Totals::default() }
                .delivered(StopReason::CaughtUp)
        } else {
            self.deliver_and_commit(writer, document, (first, first_hold), maker.clone(), deadline, true).await?
        };
        let delivered_well =
            matches!(outcome, TickOutcome::Delivered { stop: StopReason::CaughtUp | StopReason::BudgetExhausted, .. });
        if delivered_well && self.holds_lease(document) {
            self.deliver_late(writer, document, found, &maker, deadline).await?;
        }
        Ok(outcome)
    }

    /// The isolation the previous tick left unfinished, if the rows after the checkpoint are still
    /// the ones it was isolating (their first part is taken from `first`).
    fn resumed_isolation(
        &self,
        document: &StateDocument,
        first: &[crate::source::SourceRow],
        maker: &BatchMaker,
    ) -> Option<Isolation> {
        let record = document.poison.as_ref()?;
        record.isolating.as_ref()?;
        let mode = self.config.poison.mode;
        if mode == PoisonMode::Quarantine && self.quarantine.is_none() {
            return None;
        }
        let positions: Vec<_> = first.iter().map(|row| row.position.clone()).collect();
        let plan = poison::resume(record, &positions, mode)?;
        let rows = first[..plan.rows()].to_vec();
        Some(Isolation {
            batch: maker.prepare(rows),
            record: poison::resumed(record, self.clock.now()),
            plan,
            last_error: None,
        })
    }

    /// Whatever happened, a lease still ours is given back, so that the next tick anywhere starts
    /// at once; and a failure not recorded yet is recorded in that write (or, before the lease was
    /// taken, in a write of its own, unless another owner's lease is live).
    async fn end(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        result: &Result<TickOutcome, TickError>,
    ) {
        if writer.lost {
            return;
        }
        match result {
            Err(error) if error.needs_failure_record() => {
                warn!(poller = %self.config.poller_name, error = %error, "the tick failed; recording it for status and the watchdog");
                self.write_tick_failure(writer, document, error).await;
            }
            Ok(TickOutcome::Delivered { .. } | TickOutcome::Idle) if self.holds_lease(document) => {
                self.release_lease(writer, document, true).await;
            }
            _ if self.holds_lease(document) => self.release_lease(writer, document, false).await,
            _ => {}
        }
    }

    /// The lease another owner holds now, read again: a tick that met a busy slot before taking
    /// the lease stands down when the reader is the holder's tick, instead of failing.
    async fn held_since(&self, key: &StateKey) -> Option<TickOutcome> {
        let current = self.store.read(key).await.ok()??;
        match lease::status(current.document.lease.as_ref(), &self.owner_id, self.clock.now(), &self.config.lease) {
            LeaseStatus::HeldByOther { owner_id, expires_at } => Some(TickOutcome::LeaseHeld { owner_id, expires_at }),
            _ => None,
        }
    }

    /// The first read of a tick, its bytes reserved from the app's budget.
    async fn read_first(
        &self,
        checkpoint: Option<&crate::domain::Position>,
    ) -> Result<(crate::source::Fetched, budget::Hold), TickError> {
        let mut first_hold = self.reservations().reserve(self.fetch_limit().bytes).await;
        let first = self.source.fetch_after(checkpoint, self.fetch_limit()).await?;
        first_hold.keep(budget::rows_bytes(&first.rows));
        Ok((first, first_hold))
    }

    /// Whether this process may still act under the lease as last written: its own, not lost to
    /// another writer, not expired.
    fn may_act(&self, writer: &StateWriter<'_>, document: &StateDocument) -> bool {
        !writer.lost
            && document
                .lease
                .as_ref()
                .is_some_and(|lease| lease::holder_may_act(lease, &self.owner_id, self.clock.now(), &self.config.lease))
    }

    fn holds_lease(&self, document: &StateDocument) -> bool {
        document.lease.as_ref().and_then(|lease| lease.owner_id.as_deref()) == Some(self.owner_id.as_str())
    }
}

/// Ends a tick's delivering reads when dropped ([`Source::end_reads`]).
struct EndReads<'a>(&'a dyn Source);

impl Drop for EndReads<'_> {
    fn drop(&mut self) {
        self.0.end_reads();
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        return (*text).to_string();
    }
    if let Some(text) = panic.downcast_ref::<String>() {
        return text.clone();
    }
    "unknown panic".to_string()
}
