//! One tick of one poller: the orchestrator. It carries out the domain's decisions over the
//! traits (store, source, sink) and owns nothing but the order of things:
//!
//! 1. read the state document (1 GET); a live lease held elsewhere ends the tick; a changed source
//!    fingerprint fails it loudly;
//! 2. fetch the first batch after the checkpoint; nothing there ends the tick with no write at all;
//! 3. take the lease by CAS on the ETag just read (a conflict means someone moved first: stop);
//! 4. deliver batches, up to `maxInFlight` at once, fetching each next batch as the previous one
//!    leaves; commit by CAS the contiguous prefix of acknowledged batches (a commit renews the
//!    lease); heartbeat only when no commit happened for a heartbeat interval;
//! 5. stop when caught up or at the tick budget; the last commit releases the lease.
//!
//! A failed tick (a delivery, a fetch, a commit, even a panic) leaves the checkpoint where it was
//! and releases the lease, so the next tick, anywhere, retries the same batch at once. Every write
//! reuses the ETag of the previous read or write: a tick that delivers k batches costs 1 GET and
//! k + 1 PUTs. The next batch is fetched while the current ones are delivered, and heartbeats keep
//! the lease alive while either runs.

use std::any::Any;
use std::collections::VecDeque;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};

use chrono::{DateTime, Utc};
use serde_json::Value;
use tracing::{error, info, warn};

use crate::config::{OnGenerationChange, PollerConfig};
use crate::domain::Event;
use crate::domain::ids::{EventIds, batch_id};
use crate::domain::lease::{self, LeaseStatus};
use crate::domain::poison::{self, FailureKind, Isolation, PoisonMode, PoisonRecord, Verdict};
use crate::domain::state::{CheckpointRegression, describe};
use crate::domain::transitions::{self, Delivered, FingerprintCheck, GenerationCheck, Refusal};
use crate::domain::window::BatchWindow;
use crate::domain::{DocumentError, Position, StateDocument};
use crate::sink::{Batch, Sink, SinkError};
use crate::source::{FetchLimit, Fetched, Source, SourceError, SourceRow};
use crate::store::quarantine::{self, QuarantineEntry};
use crate::store::{BlobStore, StateKey, StateStore, StateWriter, StoreError, WriteFailure};

/// How long after a failed heartbeat the next attempt is made (the lease stays ours until it
/// expires; `holder_may_act` stops the tick before that).
const HEARTBEAT_RETRY_DELAY: chrono::Duration = chrono::Duration::seconds(1);

/// Where `now` comes from. Production reads the system clock; the domain never does.
pub trait Clock: Send + Sync {
    fn now(&self) -> DateTime<Utc>;
}

pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that moves only when told: tests drive leases and budgets through time without sleeping.
#[cfg(any(test, feature = "testing"))]
pub struct ManualClock {
    now: std::sync::Mutex<DateTime<Utc>>,
}

#[cfg(any(test, feature = "testing"))]
impl ManualClock {
    pub fn at(now: DateTime<Utc>) -> Self {
        ManualClock { now: std::sync::Mutex::new(now) }
    }

    pub fn set(&self, now: DateTime<Utc>) {
        *self.now.lock().unwrap() = now;
    }

    pub fn advance(&self, by: chrono::Duration) {
        let mut now = self.now.lock().unwrap();
        *now += by;
    }
}

#[cfg(any(test, feature = "testing"))]
impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap()
    }
}

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
}

/// What a tick learns on the way that its outcome does not carry.
#[derive(Debug, Clone, Copy, Default)]
struct Learnt {
    fencing_token: Option<u64>,
    lag_after: Option<LagAfter>,
}

/// Rows after the checkpoint when a tick ended, counted up to [`SUMMARY_LAG_CAP`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LagAfter {
    pub rows: u64,
    pub capped: bool,
}

/// A tick that ends with rows left counts them up to this many, for its summary line.
pub const SUMMARY_LAG_CAP: u64 = 100_000;

/// The facts of one tick beside its outcome: its summary line's numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TickReport {
    pub duration_ms: i64,
    /// State document requests: reads and (conditional) writes.
    pub blob_reads: u64,
    pub blob_writes: u64,
    /// The fencing token of the lease this tick held, if it took one.
    pub fencing_token: Option<u64>,
    /// Rows still after the checkpoint (0 when it caught up; unknown when it failed or waited).
    pub lag_after: Option<LagAfter>,
}

/// How a tick ended, when it did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickOutcome {
    /// Nothing after the checkpoint: one read, no write.
    Idle,
    /// Batches delivered and committed. `new_document`: there was no state document, so the tick
    /// started from the beginning of the source (said loudly: a deleted document means redelivery).
    Delivered { rows: u64, batches: u64, checkpoint: String, stop: StopReason, new_document: bool, quarantined: u64 },
    /// Another instance holds a live lease.
    LeaseHeld { owner_id: String, expires_at: Option<DateTime<Utc>> },
    /// The lease was lost mid-tick (someone else wrote the document); nothing more was committed.
    LeaseLost { rows: u64, batches: u64 },
    /// A tick of this poller is already running in this process.
    Busy,
    /// The source generation moved during the tick (a reload began): the tick stood down before
    /// its next commit, nothing more was committed. The next tick acts on the new generation.
    Superseded { bound: serde_json::Value, current: Option<serde_json::Value> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    CaughtUp,
    BudgetExhausted,
    /// A poison batch was isolated: its good rows delivered, the others quarantined; the next tick
    /// goes on after it.
    Isolated,
}

impl TickOutcome {
    /// A short stable name, for logs and the `X-DbTrigger-Outcome` header.
    pub fn kind(&self) -> &'static str {
        match self {
            TickOutcome::Idle => "idle",
            TickOutcome::Delivered { stop: StopReason::CaughtUp, .. } => "caught-up",
            TickOutcome::Delivered { stop: StopReason::BudgetExhausted, .. } => "budget-exhausted",
            TickOutcome::Delivered { stop: StopReason::Isolated, .. } => "isolated",
            TickOutcome::LeaseHeld { .. } => "lease-held",
            TickOutcome::LeaseLost { .. } => "lease-lost",
            TickOutcome::Busy => "busy",
            TickOutcome::Superseded { .. } => "superseded",
        }
    }
}

impl fmt::Display for TickOutcome {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TickOutcome::Idle => write!(formatter, "nothing new"),
            TickOutcome::Delivered { rows, batches, checkpoint, stop, new_document, quarantined } => {
                let how = match stop {
                    StopReason::CaughtUp => "caught up",
                    StopReason::BudgetExhausted => "tick budget used up, more to deliver",
                    StopReason::Isolated => "a poison batch was isolated, the next tick goes on after it",
                };
                write!(formatter, "delivered {batches} batches, {rows} rows; {how}; checkpoint {checkpoint}")?;
                if *quarantined > 0 {
                    write!(formatter, "; {quarantined} rows quarantined (dbtrigger quarantine list)")?;
                }
                if *new_document {
                    write!(
                        formatter,
                        "; NEW STATE DOCUMENT: none was found, so delivery started from the beginning of the source"
                    )?;
                }
                Ok(())
            }
            TickOutcome::LeaseHeld { owner_id, expires_at } => match expires_at {
                Some(at) => write!(formatter, "lease held by {owner_id} until {}", at.to_rfc3339()),
                None => write!(formatter, "lease held by {owner_id}"),
            },
            TickOutcome::LeaseLost { rows, batches } => {
                write!(formatter, "lease lost after {batches} batches, {rows} rows; the new owner continues")
            }
            TickOutcome::Busy => write!(formatter, "a tick of this poller is already running here"),
            TickOutcome::Superseded { bound, current } => write!(
                formatter,
                "stood down: the source generation moved from {bound} to {} during the tick; nothing more was committed, the next tick acts on the new generation",
                current.as_ref().map(ToString::to_string).unwrap_or_else(|| "none".into())
            ),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TickError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(
        "{error}; the checkpoint did not move ({rows_committed} rows committed before it), the batch is retried next tick"
    )]
    Delivery { error: SinkError, rows_committed: u64 },
    #[error(
        "the source definition changed: the state document was written for fingerprint {stored}, the configuration now gives {current}. \
         The checkpoint may not mean the same rows any more: reset the poller or use a new poller name"
    )]
    FingerprintMismatch { stored: String, current: String },
    #[error(transparent)]
    Document(#[from] DocumentError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointRegression),
    /// The lease was lost before this tick committed anything: reported as a failure, not as a
    /// quiet success, since the same thing will happen again on the next tick.
    #[error(
        "the lease was lost before anything was committed ({reason}); the next tick starts over from the same checkpoint. \
         If this repeats, a fetch or a delivery is slower than lease.ttlSeconds allows"
    )]
    NoProgress { reason: String },
    /// Every part of a poison batch failed the same transient way: the sink is down, not the rows.
    #[error(
        "{error}; the batch was isolated after {attempts} failed attempts, but every part failed the same transient way: \
         the sink looks down, so nothing was quarantined and the checkpoint did not move"
    )]
    SinkDown { error: SinkError, attempts: u32 },
    /// `poison.mode: stop`: a row the sink refuses alone holds the poller.
    #[error(
        "poison.mode is stop: the row with primary key {pk} fails alone ({error}); the rows before it were delivered, \
         the checkpoint holds before it. Fix the receiver or the row, or reset the poller past it"
    )]
    PoisonStop { pk: String, error: SinkError },
    /// `source.generation.onChange: stop` and the generation moved since the checkpoint.
    #[error(
        "the source generation changed from {stored} to {current} (a truncate and reload?): source.generation.onChange is stop, \
         so nothing is delivered until an operator resets the poller (dbtrigger reset <poller> --to-beginning, or --to-end)"
    )]
    GenerationChanged { stored: String, current: String },
    /// Internal: the generation moved before a commit; the tick turns it into `Superseded`.
    #[error("the source generation moved from {bound} during the tick")]
    Superseded { bound: Box<serde_json::Value>, current: Option<Box<serde_json::Value>> },
    /// A bug: something panicked during the tick. The lease was released if it was held.
    #[error("the tick failed unexpectedly (panic: {message}); the checkpoint did not move")]
    Panicked { message: String },
}

/// What a commit over `run` (contiguous acknowledged batches) records; `None` for no batch.
fn delivered(run: &[Sent]) -> Option<Delivered<'_>> {
    let last = run.last()?;
    Some(Delivered {
        last: &last.last,
        last_batch_id: &last.batch_id,
        rows: run.iter().map(|sent| sent.rows).sum(),
        batches: run.len(),
        quarantined: run.iter().map(|sent| sent.quarantined).sum(),
    })
}

/// Why a heartbeat stopped the deliveries.
enum DeliveryFailure {
    LeaseLost,
    Store(StoreError),
}

/// A batch handed to the sink, awaiting its acknowledgement.
struct Sent {
    batch_id: String,
    first: Position,
    last: Position,
    /// Rows delivered (a batch's rows, or after isolation the ones that got through).
    rows: usize,
    /// Rows of the batch kept in the quarantine instead.
    quarantined: usize,
}

/// What the tick has committed so far.
#[derive(Default)]
struct Totals {
    rows: u64,
    batches: u64,
    quarantined: u64,
    checkpoint: Option<String>,
}

impl Totals {
    fn add(&mut self, committed: &[Sent]) {
        self.rows += committed.iter().map(|sent| sent.rows as u64).sum::<u64>();
        self.quarantined += committed.iter().map(|sent| sent.quarantined as u64).sum::<u64>();
        self.batches += committed.len() as u64;
        if let Some(last) = committed.last() {
            self.checkpoint = Some(describe(&last.last));
        }
    }

    /// The lease was lost: after some progress an outcome (the new owner continues), before any
    /// an error (the same will happen next tick, and a 200 would hide it).
    fn lease_lost(&self, reason: &str) -> Result<TickOutcome, TickError> {
        if self.batches == 0 {
            return Err(TickError::NoProgress { reason: reason.to_string() });
        }
        Ok(TickOutcome::LeaseLost { rows: self.rows, batches: self.batches })
    }
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
        }
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
        let (reads_before, writes_before) = self.counted.counts();
        *self.learnt.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Learnt::default();
        let result = match AssertUnwindSafe(self.run_tick()).catch_unwind().await {
            Ok(result) => result,
            Err(panic) => {
                let message = panic_message(panic.as_ref());
                error!(poller = %self.config.poller_name, "the tick panicked: {message}");
                self.release_after_panic().await;
                Err(TickError::Panicked { message })
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
        let terms = self.config.lease;

        // 1. One read.
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
            lease::status(document.lease.as_ref(), &self.owner_id, self.clock.now(), &terms)
        {
            return Ok(TickOutcome::LeaseHeld { owner_id, expires_at });
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
        match transitions::check_generation(&document, generation.as_ref(), restart, self.clock.now()) {
            GenerationCheck::Same => {}
            GenerationCheck::Adopted(next) => document = next,
            GenerationCheck::Restarted(next) => {
                warn!(
                    poller = %self.config.poller_name,
                    "{}",
                    next.history.last().map(|entry| entry.what.as_str()).unwrap_or("source generation changed")
                );
                document = next;
                restarted = true;
            }
            GenerationCheck::Stopped { stored, current } => {
                return Err(TickError::GenerationChanged { stored: stored.to_string(), current: current.to_string() });
            }
        }

        // 3. Anything to do?
        let checkpoint = document.position()?;
        let first = self.source.fetch_after(checkpoint.as_ref(), self.fetch_limit()).await?;
        if first.rows.is_empty() {
            if restarted {
                // The new load has no row yet: the restart itself is written, by CAS.
                let mut writer = StateWriter::new(self.store.as_ref(), &key, etag);
                match writer.write(&mut document).await {
                    Ok(()) => {}
                    Err(WriteFailure::Conflict(current)) => return Ok(held_by_whoever_wrote(current)),
                    Err(WriteFailure::Store(error)) => return Err(error.into()),
                }
            }
            return Ok(TickOutcome::Idle);
        }

        // 3. Take the lease, on the clock as it is after the query (which may have been slow).
        let mut acquired = match transitions::acquire(&document, &self.owner_id, self.clock.now(), &terms) {
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
        let mut writer = StateWriter::new(self.store.as_ref(), &key, etag);
        let written = writer.write(&mut acquired).await;
        document = acquired;
        match written {
            Ok(()) => {}
            Err(WriteFailure::Conflict(current)) => return Ok(held_by_whoever_wrote(current)),
            Err(WriteFailure::Store(error)) => {
                // The write may have landed: give the lease back if it did.
                self.release_lease(&mut writer, &mut document).await;
                return Err(error.into());
            }
        }

        // 4 and 5. Deliver and commit until caught up or out of budget.
        let result = self
            .deliver_and_commit(&mut writer, &mut document, first, fencing_token, generation.as_ref(), deadline)
            .await;
        // Whatever happened, a lease still ours is given back (a failed commit, a fetch error,
        // the budget running out between commits), so the next tick anywhere starts at once.
        if !writer.lost && self.holds_lease(&document) {
            self.release_lease(&mut writer, &mut document).await;
        }
        let outcome = match result {
            Err(TickError::Superseded { bound, current }) => {
                warn!(poller = %self.config.poller_name, bound = %bound, "the source generation moved during the tick: standing down");
                return Ok(TickOutcome::Superseded { bound: *bound, current: current.map(|current| *current) });
            }
            other => other?,
        };
        if let TickOutcome::Delivered { stop: StopReason::BudgetExhausted | StopReason::Isolated, .. } = &outcome
            && let Ok(position) = document.position()
        {
            // Rows are left: how many (capped, so that it stays cheap), for the summary line.
            match self.source.count_after(position.as_ref(), SUMMARY_LAG_CAP).await {
                Ok(rows) => self.learn(|learnt| {
                    learnt.lag_after = Some(LagAfter { rows, capped: rows >= SUMMARY_LAG_CAP });
                }),
                Err(error) => warn!(poller = %self.config.poller_name, "cannot count the rows left: {error}"),
            }
        }
        Ok(match outcome {
            TickOutcome::Delivered { rows, batches, checkpoint, stop, quarantined, .. } => {
                TickOutcome::Delivered { rows, batches, checkpoint, stop, new_document, quarantined }
            }
            other => other,
        })
    }

    fn holds_lease(&self, document: &StateDocument) -> bool {
        document.lease.as_ref().and_then(|lease| lease.owner_id.as_deref()) == Some(self.owner_id.as_str())
    }

    /// Keeps up to `maxInFlight` batches in flight and the next batch fetching meanwhile, and
    /// commits the contiguous prefix of acknowledged batches as soon as it grows (seed 004): a batch
    /// acknowledged early waits for the ones before it. A commit is a heartbeat; a separate
    /// heartbeat is written when no commit happened for a heartbeat interval, whether deliveries or
    /// a fetch are what the tick is waiting for. The commit that empties the window with nothing
    /// left to send releases the lease.
    async fn deliver_and_commit(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        first: Fetched,
        fencing_token: u64,
        generation: Option<&serde_json::Value>,
        deadline: DateTime<Utc>,
    ) -> Result<TickOutcome, TickError> {
        let terms = self.config.lease;
        let limit = self.fetch_limit();
        let maker = Arc::new(BatchMaker {
            ids: EventIds::new(&self.config.poller_name, &self.config.fingerprint),
            poller: self.config.poller_name.clone(),
            fingerprint: self.config.fingerprint.clone(),
            fencing_token,
            generation: generation.cloned(),
        });
        let mut window: BatchWindow<Sent> = BatchWindow::new();
        let mut in_flight: JoinSet<(u64, Delivery)> = JoinSet::new();
        // The batches after the first one are read by this task while batches are delivered and
        // committed, so the window refills without waiting for a query and a commit never holds up
        // the reads. Memory holds what is in flight plus two batches at most: one ready here and
        // one being read.
        let after_first = if first.full { first.rows.last().map(|row| row.position.clone()) } else { None };
        let mut reader = Reader::new(self.source.clone(), limit, maker.clone(), after_first);
        let mut ready: VecDeque<Prepared> = VecDeque::from([maker.prepare(first.rows)]);
        let mut budget_exhausted = false;
        // Acknowledged, contiguous batches not committed yet.
        let mut pending: Vec<Sent> = Vec::new();
        let mut heartbeat_due = false;
        // Commits are spaced by the commit interval (from the tick's start, where the lease was
        // written): acknowledgements pile up meanwhile and one commit covers them all.
        let commit_interval = chrono::Duration::from_std(self.config.batch.commit_interval).unwrap_or_default();
        let mut last_commit_at = self.clock.now();
        let mut commit_due = commit_interval.is_zero();
        let mut totals = Totals::default();
        // After a failed heartbeat, the next attempt waits a little instead of following at once.
        let mut heartbeat_retry_at: Option<DateTime<Utc>> = None;
        let (mut heartbeat_timer, mut commit_timer) = (Timer::new(), Timer::new());
        loop {
            if self.clock.now() >= deadline && (!ready.is_empty() || !reader.done()) {
                // Out of budget: what is fetched or fetching waits for the next tick.
                budget_exhausted = true;
                ready.clear();
                reader.stop();
            }

            // Fill the window with what has been fetched, before committing: the next deliveries
            // run while the commit of the ones acknowledged is written, so a commit never holds up
            // a delivery (even at maxInFlight 1, where the receiver still sees batches in order).
            // Commits stay in order, one at a time; a lost lease aborts whatever is in flight.
            self.send_ready(&mut ready, &mut window, &mut in_flight, deadline);
            reader.start(ready.len());
            // Commit what is acknowledged, once the commit interval has passed since the last
            // commit, at once when it is the tick's last (it releases the lease) or a heartbeat is
            // due (it serves as one). When every batch is acknowledged but a fetch is still
            // running, the commit waits for it (or for the heartbeat): only then is it known
            // whether this commit is the last one, and a tick keeps to 1 GET and k + 1 PUTs.
            if !pending.is_empty() {
                let drained = in_flight.is_empty() && window.is_empty();
                let nothing_more = ready.is_empty() && reader.done();
                let more_is_known = !ready.is_empty() || reader.done();
                let release = drained && nothing_more;
                let interval_over = commit_due || self.clock.now() - last_commit_at >= commit_interval;
                if release || heartbeat_due || ((!drained || more_is_known) && interval_over) {
                    // While the commit is written, deliveries go on: finished ones are taken
                    // (acknowledged ones wait for the next commit, which then covers them all),
                    // the window refills, reads go on. A failed delivery waits for the
                    // commit to end. New deliveries start only while the lease as last written
                    // lets this holder act.
                    let committing = std::mem::take(&mut pending);
                    let lease_before = document.lease.clone().expect("the lease is held while delivering");
                    let mut parked = Vec::new();
                    let result = {
                        let commit = self.commit(writer, document, &committing, release);
                        tokio::pin!(commit);
                        loop {
                            tokio::select! {
                                biased;
                                result = &mut commit => break result,
                                joined = in_flight.join_next(), if !in_flight.is_empty() && parked.is_empty() => {
                                    match joined.expect("the set is not empty") {
                                        Ok((sequence, Ok(()))) => pending.extend(window.acknowledge(sequence)),
                                        other => parked.push(other),
                                    }
                                }
                                read = reader.next(), if reader.reading() => ready.extend(read),
                            }
                            if parked.is_empty()
                                && lease::holder_may_act(&lease_before, &self.owner_id, self.clock.now(), &terms)
                            {
                                self.send_ready(&mut ready, &mut window, &mut in_flight, deadline);
                                reader.start(ready.len());
                            }
                        }
                    };
                    let committed = match result {
                        Ok(committed) => committed,
                        Err(error @ TickError::Store(_)) => {
                            // The commit's write failed (it may even have landed). The deliveries
                            // sent meanwhile are ours to finish: wait for them, and let the
                            // release that follows record the ones acknowledged in order, so
                            // that they are not sent twice.
                            self.absorb(document, &pending);
                            while let Some(joined) = in_flight.join_next().await {
                                if let Ok((sequence, Ok(()))) = joined {
                                    let acknowledged = window.acknowledge(sequence);
                                    self.absorb(document, &acknowledged);
                                }
                            }
                            return Err(error);
                        }
                        Err(error) => return Err(error),
                    };
                    if !committed {
                        in_flight.abort_all();
                        warn!(poller = %self.config.poller_name, "commit refused: the lease was taken over; the new owner delivers these batches again");
                        return totals.lease_lost("a commit found the state document taken over");
                    }
                    totals.add(&committing);
                    heartbeat_due = false;
                    heartbeat_retry_at = None;
                    last_commit_at = self.clock.now();
                    commit_due = commit_interval.is_zero();
                    if !parked.is_empty()
                        && let Some(ended) = self
                            .on_finished(
                                parked,
                                &mut in_flight,
                                &mut reader,
                                &mut window,
                                &mut pending,
                                writer,
                                document,
                                &mut totals,
                                deadline,
                            )
                            .await?
                    {
                        return Ok(ended);
                    }
                    if !pending.is_empty() {
                        // Acknowledged while this commit was written: decide about them now.
                        continue;
                    }
                }
            }
            if heartbeat_due {
                heartbeat_due = false;
                match self.heartbeat(writer, document).await {
                    Ok(true) => heartbeat_retry_at = None,
                    Ok(false) => heartbeat_retry_at = Some(self.clock.now() + HEARTBEAT_RETRY_DELAY),
                    Err(DeliveryFailure::LeaseLost) => {
                        in_flight.abort_all();
                        return totals.lease_lost("a heartbeat found the state document taken over");
                    }
                    Err(DeliveryFailure::Store(error)) => {
                        in_flight.abort_all();
                        return Err(error.into());
                    }
                }
            }

            if in_flight.is_empty() && pending.is_empty() && reader.done() {
                break;
            }

            let current = document.lease.clone().expect("the lease is held while delivering");
            let now = self.clock.now();
            if !lease::holder_may_act(&current, &self.owner_id, now, &terms) {
                in_flight.abort_all();
                warn!(poller = %self.config.poller_name, "the lease is about to expire without a heartbeat; stopping");
                writer.lost = true;
                return totals.lease_lost("the lease came within the clock-skew margin of expiry without a heartbeat");
            }
            let due = lease::next_heartbeat_due(&current, &terms).unwrap_or(now);
            let wait = (heartbeat_retry_at.unwrap_or(due) - now).to_std().unwrap_or(Duration::ZERO);
            // Acknowledged batches wait for the commit interval to pass (unless something else
            // comes first and decides for them).
            let commit_wait = (last_commit_at + commit_interval - now).to_std().unwrap_or(Duration::ZERO);
            heartbeat_timer.set(wait);
            let commit_waits = !pending.is_empty() && !commit_due;
            if commit_waits {
                commit_timer.set(commit_wait);
            }
            // Biased: when several branches are ready at once they are taken in this order, not
            // in a random one, so that a run can be replayed exactly (the simulation test's seeds).
            tokio::select! {
                biased;
                joined = in_flight.join_next(), if !in_flight.is_empty() => {
                    // Take every delivery that has finished by now, so that one commit covers them all.
                    let mut finished = vec![joined.expect("the set is not empty")];
                    while let Some(more) = in_flight.try_join_next() {
                        finished.push(more);
                    }
                    if let Some(ended) = self
                        .on_finished(finished, &mut in_flight, &mut reader, &mut window, &mut pending, writer, document, &mut totals, deadline)
                        .await?
                    {
                        return Ok(ended);
                    }
                }
                read = reader.next(), if reader.reading() => ready.extend(read),
                _ = heartbeat_timer.wait() => heartbeat_due = true,
                _ = commit_timer.wait(), if commit_waits => commit_due = true,
            }
        }

        if let Some(error) = reader.failed {
            return Err(error.into());
        }
        let stop = if budget_exhausted { StopReason::BudgetExhausted } else { StopReason::CaughtUp };
        Ok(TickOutcome::Delivered {
            rows: totals.rows,
            batches: totals.batches,
            checkpoint: totals.checkpoint.clone().unwrap_or_default(),
            stop,
            new_document: false,
            quarantined: totals.quarantined,
        })
    }

    /// Sends what has been fetched while the window has room and the budget lasts.
    fn send_ready(
        &self,
        ready: &mut VecDeque<Prepared>,
        window: &mut BatchWindow<Sent>,
        in_flight: &mut JoinSet<(u64, Delivery)>,
        deadline: DateTime<Utc>,
    ) {
        let max_in_flight = self.config.batch.max_in_flight;
        while in_flight.len() < max_in_flight && self.clock.now() < deadline {
            let Some(prepared) = ready.pop_front() else {
                break;
            };
            let sequence = window.open(Sent {
                batch_id: prepared.batch.batch_id.clone(),
                first: prepared.positions.first().expect("a batch is never empty").clone(),
                last: prepared.positions.last().expect("a batch is never empty").clone(),
                rows: prepared.batch.events.len(),
                quarantined: 0,
            });
            let sink = self.sink.clone();
            // The sink counts its time in its runtime's terms: the budget left, by our clock.
            let sink_deadline = Instant::now() + (deadline - self.clock.now()).to_std().unwrap_or(Duration::ZERO);
            in_flight.spawn(async move {
                // A failed batch comes back with its rows' positions: it may have to be isolated.
                // A delivered one is dropped here, so acknowledged batches hold no rows.
                let delivered = sink.deliver(&prepared.batch, sink_deadline).await;
                (sequence, delivered.map_err(|error| (error, prepared)))
            });
        }
    }

    /// Deliveries that came back: acknowledged ones join `pending`; the earliest failed one ends
    /// the tick (after committing what was acknowledged before it), `Some` being how it ended.
    #[allow(clippy::too_many_arguments)]
    async fn on_finished(
        &self,
        finished: Vec<Result<(u64, Delivery), tokio::task::JoinError>>,
        in_flight: &mut JoinSet<(u64, Delivery)>,
        reader: &mut Reader,
        window: &mut BatchWindow<Sent>,
        pending: &mut Vec<Sent>,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        totals: &mut Totals,
        deadline: DateTime<Utc>,
    ) -> Result<Option<TickOutcome>, TickError> {
        // The earliest failed batch, if any: the one the checkpoint stops before.
        let mut failure: Option<(u64, SinkError, Option<Prepared>)> = None;
        for joined in finished {
            let (sequence, error, batch) = match joined {
                Ok((sequence, Ok(()))) => {
                    pending.extend(window.acknowledge(sequence));
                    continue;
                }
                Ok((sequence, Err((error, batch)))) => (sequence, error, Some(batch)),
                Err(join_error) => {
                    let reason = format!("the delivery task failed: {join_error}");
                    (u64::MAX, SinkError::Transient { batch_id: String::new(), reason }, None)
                }
            };
            if failure.as_ref().is_none_or(|(earliest, _, _)| sequence < *earliest) {
                failure = Some((sequence, error, batch));
            }
        }
        let Some((sequence, error, batch)) = failure else {
            return Ok(None);
        };
        // Batches after the failed one may have landed: the next tick delivers them again.
        in_flight.abort_all();
        reader.stop();
        warn!(poller = %self.config.poller_name, error = %error, "delivery failed; checkpoint left before this batch");
        if !pending.is_empty() {
            // What was acknowledged before the failed batch is kept.
            if !self.commit(writer, document, pending, false).await? {
                return totals.lease_lost("a commit found the state document taken over").map(Some);
            }
            totals.add(pending);
            pending.clear();
        }
        // Only the batch at the checkpoint is poison's business: a later one failing is retried
        // from the checkpoint by the next tick.
        let at_checkpoint = match (window.take_first_open(sequence), batch) {
            (Some(sent), Some(batch)) => Some((sent, batch)),
            _ => None,
        };
        let totals = std::mem::take(totals);
        self.after_failure(writer, document, at_checkpoint, error, totals, deadline).await.map(Some)
    }

    /// A delivery failed. If it is the batch at the checkpoint, its failure is counted in the
    /// document (seed 001 case I) and, when it is poison (refused for good, or failing for
    /// `poison.maxAttempts` ticks), isolated: its rows that fail alone are quarantined (or, with
    /// `poison.mode: stop`, delivered up to the first of them), the rest delivered. Otherwise the
    /// lease is released with the failure recorded and the next tick retries the same batch.
    async fn after_failure(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        at_checkpoint: Option<(Sent, Prepared)>,
        error: SinkError,
        mut totals: Totals,
        deadline: DateTime<Utc>,
    ) -> Result<TickOutcome, TickError> {
        let Some((sent, Prepared { batch, positions })) = at_checkpoint else {
            return Err(TickError::Delivery { error, rows_committed: totals.rows });
        };
        let kind = failure_kind(&error);
        let record = poison::record_failure(
            document.poison.as_ref(),
            &sent.batch_id,
            &sent.first,
            &sent.last,
            &error.to_string(),
            self.clock.now(),
        );
        let poison_config = self.config.poison;
        let verdict = poison::verdict(kind, record.attempts, poison_config.max_attempts);
        let quarantine = match (&self.quarantine, poison_config.mode) {
            (Some(blobs), PoisonMode::Quarantine) => Some(blobs.clone()),
            _ => None,
        };
        if verdict == Verdict::Retry || (poison_config.mode == PoisonMode::Quarantine && quarantine.is_none()) {
            warn!(poller = %self.config.poller_name, attempts = record.attempts, "batch at the checkpoint failed; the next tick retries it");
            self.write_failure(writer, document, record).await;
            return Err(TickError::Delivery { error, rows_committed: totals.rows });
        }

        warn!(poller = %self.config.poller_name, attempts = record.attempts, batch = %sent.batch_id, "isolating a poison batch");
        let stop_at_first = poison_config.mode == PoisonMode::Stop;
        let isolated = self.isolate(&batch, &positions, deadline, stop_at_first).await;
        if isolated.out_of_time {
            // Rows that failed for lack of time are no poison: try again next tick.
            warn!(poller = %self.config.poller_name, "the tick budget ran out while isolating; the next tick starts over");
            self.write_failure(writer, document, record).await;
            return Err(TickError::Delivery { error, rows_committed: totals.rows });
        }
        if isolated.sink_down {
            let attempts = record.attempts;
            self.write_failure(writer, document, record).await;
            return Err(TickError::SinkDown { error, attempts });
        }
        if stop_at_first {
            // Deliver nothing past the first poison row: commit up to the row before it, and hold.
            let Some((row, row_error)) = isolated.poisoned.into_iter().next() else {
                // Every part got through on the way: the batch is delivered after all.
                let whole = Sent { rows: batch.events.len(), ..sent };
                return self.finish_isolation(writer, document, whole, totals).await;
            };
            if let Some(last_delivered) = isolated.delivered_through {
                let delivered = Sent {
                    batch_id: sent.batch_id.clone(),
                    first: sent.first.clone(),
                    last: last_delivered,
                    rows: isolated.delivered,
                    quarantined: 0,
                };
                if !self.commit(writer, document, std::slice::from_ref(&delivered), false).await? {
                    return totals.lease_lost("a commit found the state document taken over");
                }
                totals.add(std::slice::from_ref(&delivered));
            }
            self.write_failure(writer, document, record).await;
            return Err(TickError::PoisonStop { pk: Value::Object(row.pk()).to_string(), error: row_error });
        }

        // Keep each poison row before the checkpoint moves past it; a crash in between writes the
        // same entries again (their ids come from the event ids).
        let blobs = quarantine.expect("quarantine mode has a store here");
        let now = self.clock.now();
        for (event, row_error) in &isolated.poisoned {
            let entry = QuarantineEntry {
                id: quarantine::entry_id(event.event_id()),
                poller: self.config.poller_name.clone(),
                event: event.to_value(),
                error: row_error.to_string(),
                status: match row_error {
                    SinkError::Rejected { status, .. } => Some(*status),
                    SinkError::Transient { .. } => None,
                },
                attempts: record.attempts,
                batch_id: sent.batch_id.clone(),
                fencing_token: batch.fencing_token,
                source_fingerprint: self.config.fingerprint.clone(),
                first_failure_at: record.first_failure_at,
                last_failure_at: record.last_failure_at,
                quarantined_at: now,
            };
            quarantine::put(blobs.as_ref(), &self.config.app_name, &entry).await?;
            let pk = Value::Object(event.pk()).to_string();
            warn!(
                poller = %self.config.poller_name,
                entry = %entry.id,
                pk = %pk,
                error = %row_error,
                "row quarantined"
            );
        }
        let whole = Sent { rows: isolated.delivered, quarantined: isolated.poisoned.len(), ..sent };
        self.finish_isolation(writer, document, whole, totals).await
    }

    /// Commits past an isolated batch (releasing the lease) and ends the tick.
    async fn finish_isolation(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        whole: Sent,
        mut totals: Totals,
    ) -> Result<TickOutcome, TickError> {
        if !self.commit(writer, document, std::slice::from_ref(&whole), true).await? {
            return totals.lease_lost("a commit found the state document taken over");
        }
        totals.add(std::slice::from_ref(&whole));
        Ok(TickOutcome::Delivered {
            rows: totals.rows,
            batches: totals.batches,
            checkpoint: totals.checkpoint.clone().unwrap_or_default(),
            stop: StopReason::Isolated,
            new_document: false,
            quarantined: totals.quarantined,
        })
    }

    /// Delivers `batch` in parts, halving the parts that fail down to single rows.
    ///
    /// Quarantine mode: both halves of the first split are tried first (both failing transiently
    /// means the sink is down: nothing more is tried); then each failed half is split further, so a
    /// receiver may see the rows of a poison batch out of order while it is isolated. Stop mode
    /// keeps row order strictly: parts go depth first, left to right, and it stops at the first row
    /// refused alone, or at any transient failure (the sink is not answering: hold).
    async fn isolate(
        &self,
        batch: &Batch,
        positions: &[Position],
        deadline: DateTime<Utc>,
        stop_at_first: bool,
    ) -> IsolationResult {
        let mut result = IsolationResult::default();
        let count = batch.events.len();
        let halves: Vec<(usize, usize)> =
            if count < 2 { vec![(0, count)] } else { vec![(0, count / 2), (count / 2, count)] };
        let mut to_split: VecDeque<(usize, usize)> = VecDeque::new();
        if stop_at_first {
            to_split.extend(halves);
        } else {
            let mut kinds = Vec::new();
            for (start, end) in halves {
                match self.deliver_part(batch, start, end, deadline).await {
                    Part::Delivered => result.delivered_part(start, end, positions),
                    Part::OutOfTime => {
                        result.out_of_time = true;
                        return result;
                    }
                    Part::Failed(error) => {
                        kinds.push(Some(failure_kind(&error)));
                        if end - start == 1 {
                            result.poisoned.push((batch.events[start].clone(), error));
                        } else {
                            to_split.push_back((start, end));
                        }
                    }
                }
            }
            let sink_down = match kinds.as_slice() {
                [Some(FailureKind::Transient)] => count < 2,
                [first, second] => poison::after_first_split(*first, *second) == Isolation::SinkDown,
                _ => false,
            };
            if sink_down {
                result.sink_down = true;
                result.poisoned.clear();
                return result;
            }
            // The halves that failed are split next.
            let failed: Vec<(usize, usize)> = to_split.drain(..).collect();
            for (start, end) in failed {
                let middle = start + (end - start) / 2;
                to_split.push_back((start, middle));
                to_split.push_back((middle, end));
            }
        }
        while let Some((start, end)) = to_split.pop_front() {
            match self.deliver_part(batch, start, end, deadline).await {
                Part::Delivered => result.delivered_part(start, end, positions),
                Part::OutOfTime => {
                    result.out_of_time = true;
                    return result;
                }
                Part::Failed(error) if stop_at_first && failure_kind(&error) == FailureKind::Transient => {
                    result.sink_down = true;
                    return result;
                }
                Part::Failed(error) if end - start == 1 => {
                    result.poisoned.push((batch.events[start].clone(), error));
                    if stop_at_first {
                        return result;
                    }
                }
                Part::Failed(_) => {
                    let middle = start + (end - start) / 2;
                    // Its halves come next, left first.
                    to_split.push_front((middle, end));
                    to_split.push_front((start, middle));
                }
            }
        }
        result
    }

    /// Delivers the rows `start..end` of `batch` as one part, with an id of its own; not at all once
    /// the deadline has passed, and a failure once it has passed says nothing about the rows.
    async fn deliver_part(&self, batch: &Batch, start: usize, end: usize, deadline: DateTime<Utc>) -> Part {
        if self.clock.now() >= deadline {
            return Part::OutOfTime;
        }
        let part = Batch {
            poller: batch.poller.clone(),
            batch_id: format!("{}-rows{start}to{end}", batch.batch_id),
            fencing_token: batch.fencing_token,
            generation: batch.generation.clone(),
            events: batch.events[start..end].to_vec(),
        };
        let sink_deadline = Instant::now() + (deadline - self.clock.now()).to_std().unwrap_or(Duration::ZERO);
        match self.sink.deliver(&part, sink_deadline).await {
            Ok(()) => Part::Delivered,
            Err(_) if self.clock.now() >= deadline => Part::OutOfTime,
            Err(error) => Part::Failed(error),
        }
    }

    async fn write_failure(&self, writer: &mut StateWriter<'_>, document: &mut StateDocument, record: PoisonRecord) {
        let failed = transitions::record_failure(document, &self.owner_id, record, self.clock.now());
        self.write_letting_go(writer, document, failed, "could not record the failure; the lease will expire").await;
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
        match writer.write(&mut next).await {
            Ok(()) => *document = next,
            Err(WriteFailure::Conflict(_)) => {}
            Err(WriteFailure::Store(error)) => {
                warn!(poller = %self.config.poller_name, error = %error, "{if_it_fails}");
            }
        }
    }

    /// Moves the checkpoint over `ready` (acknowledged, contiguous batches) in one CAS that also
    /// renews or releases the lease. `false`: the lease was taken over, nothing was committed.
    async fn commit(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        ready: &[Sent],
        release: bool,
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
        let delivered = delivered(ready).expect("a commit covers at least one batch");
        let mut next = match transitions::commit(
            document,
            &self.owner_id,
            &delivered,
            release,
            self.clock.now(),
            &self.config.lease,
        ) {
            Ok(next) => next,
            Err(Refusal::Regression(regression)) => return Err(regression.into()),
            Err(_) => {
                writer.lost = true;
                return Ok(false);
            }
        };
        let fencing_token = next.lease.as_ref().map(|lease| lease.fencing_token).unwrap_or_default();
        let written = writer.write(&mut next).await;
        // The batches were acknowledged, so the document may keep their checkpoint even if the
        // write failed: the release that follows writes it (or finds this write landed after all).
        // A failed release keeps the lease held in memory, or there would be no release to follow.
        *document = match (&written, release) {
            (Err(WriteFailure::Store(_)), true) => {
                transitions::commit(document, &self.owner_id, &delivered, false, self.clock.now(), &self.config.lease)
                    .unwrap_or(next)
            }
            _ => next,
        };
        match written {
            Ok(()) => {
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
                self.committed_rows.fetch_add(delivered.rows as u64, std::sync::atomic::Ordering::Relaxed);
                Ok(true)
            }
            Err(WriteFailure::Conflict(_)) => Ok(false),
            Err(WriteFailure::Store(error)) => Err(error.into()),
        }
    }

    /// Moves the checkpoint of `document` past `acknowledged` in memory only (no write): the
    /// release that ends a failed tick writes it.
    fn absorb(&self, document: &mut StateDocument, acknowledged: &[Sent]) {
        let Some(delivered) = delivered(acknowledged) else {
            return;
        };
        if let Ok(next) =
            transitions::commit(document, &self.owner_id, &delivered, false, self.clock.now(), &self.config.lease)
        {
            *document = next;
        }
    }

    /// Renews the lease while deliveries or a fetch run. `Ok(true)`: renewed; `Ok(false)`: the
    /// write failed in a way worth retrying at the next interval (the lease is ours until it
    /// expires).
    async fn heartbeat(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
    ) -> Result<bool, DeliveryFailure> {
        let Ok(mut next) = transitions::heartbeat(document, &self.owner_id, self.clock.now(), &self.config.lease)
        else {
            writer.lost = true;
            return Err(DeliveryFailure::LeaseLost);
        };
        match writer.write(&mut next).await {
            Ok(()) => {
                *document = next;
                Ok(true)
            }
            Err(WriteFailure::Conflict(_)) => Err(DeliveryFailure::LeaseLost),
            Err(WriteFailure::Store(error)) => {
                // The document keeps the lease as it was: the writer remembers this write's id
                // in case it landed after all.
                warn!(poller = %self.config.poller_name, error = %error, "heartbeat failed, retrying");
                if error_is_retryable(&error) { Ok(false) } else { Err(DeliveryFailure::Store(error)) }
            }
        }
    }

    /// Gives the lease back without moving the checkpoint: after a failure, so that the retry on any
    /// instance need not wait for expiry, or when the tick ends without a releasing commit. Best
    /// effort: if the write fails, the lease simply expires.
    async fn release_lease(&self, writer: &mut StateWriter<'_>, document: &mut StateDocument) {
        let released = transitions::release(document, &self.owner_id, self.clock.now());
        self.write_letting_go(writer, document, released, "could not release the lease; it will expire").await;
    }

    /// After a panic the tick's own view of the document is gone: read it again, and release the
    /// lease by CAS if this process holds it.
    async fn release_after_panic(&self) {
        let key = self.key();
        let Ok(Some(versioned)) = self.store.read(&key).await else {
            return;
        };
        let mut document = versioned.document;
        if !self.holds_lease(&document) {
            return;
        }
        let mut writer = StateWriter::new(self.store.as_ref(), &key, Some(versioned.etag));
        self.release_lease(&mut writer, &mut document).await;
    }
}

/// What makes the batches of one tick: the same poller, fingerprint, token and generation for
/// every one of them.
struct BatchMaker {
    ids: EventIds,
    poller: String,
    fingerprint: String,
    fencing_token: u64,
    generation: Option<serde_json::Value>,
}

/// A fetched batch ready to send: its events encoded, its rows' positions kept for the window
/// and for isolation.
struct Prepared {
    batch: Batch,
    positions: Vec<Position>,
}

impl BatchMaker {
    /// The batch of `rows` (never empty): the rows' values move into its events.
    fn prepare(&self, rows: Vec<SourceRow>) -> Prepared {
        let first = &rows.first().expect("a batch is never empty").position;
        let last = &rows.last().expect("a batch is never empty").position;
        let id = batch_id(&self.poller, &self.fingerprint, first, last, rows.len());
        let (mut batch, positions) = Batch::from_rows(&self.ids, &self.poller, id, self.fencing_token, rows);
        batch.generation = self.generation.clone();
        Prepared { batch, positions }
    }
}

/// A timer kept across the turns of the tick's loop, instead of one registered and dropped on
/// every turn: set again only when its deadline moves by more than a millisecond.
struct Timer {
    sleep: Pin<Box<Sleep>>,
}

impl Timer {
    fn new() -> Timer {
        Timer { sleep: Box::pin(tokio::time::sleep(Duration::MAX)) }
    }

    /// Goes off `wait` from now (up to a millisecond early, if it was set that close; a wait
    /// beyond a day is a day: the loop turns well before that).
    fn set(&mut self, wait: Duration) {
        let deadline = Instant::now() + wait.min(Duration::from_secs(86_400));
        let current = self.sleep.deadline();
        if deadline.max(current) - deadline.min(current) > Duration::from_millis(1) {
            self.sleep.as_mut().reset(deadline);
        }
    }

    /// Ends when the timer goes off (at once if it has, until it is set later again).
    async fn wait(&mut self) {
        self.sleep.as_mut().await;
    }
}

/// The batches after a tick's first one, read in order, one at a time, by the tick's own task: a
/// read is polled where the tick waits for its deliveries, so a batch reaches the window without a
/// hand-off between tasks. The next read starts once no batch waits to be sent (see `start`), and
/// a batch is prepared (its events encoded) as its read ends. Dropping a read (`stop`, or the
/// reader) cancels it, and a source interrupts a query whose future is dropped.
struct Reader {
    source: Arc<dyn Source>,
    limit: FetchLimit,
    maker: Arc<BatchMaker>,
    /// Where the next read starts: `None` while one runs, and for good once one came back short
    /// of its limits (the end of the source for now), failed, or the reader was stopped.
    from: Option<Position>,
    reading: Option<BoxFuture<'static, Result<Read, SourceError>>>,
    /// Why reading stopped, if a read failed: the tick ends with this error.
    failed: Option<SourceError>,
}

/// What one read of the reader found: a batch (none if the source had no more rows), and where the
/// next read starts, if the read stopped at a limit.
struct Read {
    batch: Option<Prepared>,
    next: Option<Position>,
}

impl Reader {
    /// Reads after `from`; `None` means there is nothing more to read this tick.
    fn new(source: Arc<dyn Source>, limit: FetchLimit, maker: Arc<BatchMaker>, from: Option<Position>) -> Reader {
        Reader { source, limit, maker, from, reading: None, failed: None }
    }

    /// No read runs and none will: the source has nothing more this tick, a read failed, or the
    /// reader stopped.
    fn done(&self) -> bool {
        self.from.is_none() && self.reading.is_none()
    }

    fn reading(&self) -> bool {
        self.reading.is_some()
    }

    /// Cancels the read in progress, if any, and reads nothing more.
    fn stop(&mut self) {
        self.from = None;
        self.reading = None;
    }

    /// Starts the next read, unless one runs or a batch still waits to be sent (`waiting`): memory
    /// holds what is in flight, one batch ready and one being read, at most.
    fn start(&mut self, waiting: usize) {
        if self.reading.is_some() || waiting > 0 {
            return;
        }
        let Some(from) = self.from.take() else {
            return;
        };
        let (source, maker, limit) = (self.source.clone(), self.maker.clone(), self.limit);
        let read = async move {
            let read = AssertUnwindSafe(async {
                let fetched = source.fetch_after(Some(&from), limit).await?;
                let next = if fetched.full { fetched.rows.last().map(|row| row.position.clone()) } else { None };
                let batch = if fetched.rows.is_empty() { None } else { Some(maker.prepare(fetched.rows)) };
                Ok(Read { batch, next })
            })
            .catch_unwind()
            .await;
            // A panicking read is a failed read: the tick commits what was acknowledged before it
            // and never calls itself caught up.
            read.unwrap_or_else(|panic| {
                Err(SourceError::Query {
                    location: source.describe(),
                    reason: format!("the read of the next batch panicked: {}", panic_message(panic.as_ref())),
                })
            })
        };
        self.reading = Some(read.boxed());
    }

    /// Waits for the read in progress to end (pending for ever if none runs: guard a wait on
    /// `reading`), and returns its batch, if the source had more rows (a failed read keeps its
    /// error in `failed` and reads nothing more). Cancel-safe: dropped before the read ends, the
    /// read goes on and is waited for next time.
    async fn next(&mut self) -> Option<Prepared> {
        let Some(reading) = self.reading.as_mut() else {
            return std::future::pending().await;
        };
        let read = reading.await;
        self.reading = None;
        match read {
            Ok(read) => {
                self.from = read.next;
                read.batch
            }
            Err(error) => {
                self.failed = Some(error);
                None
            }
        }
    }
}

/// How one delivery task ended: a failed batch comes back with its error.
type Delivery = Result<(), (SinkError, Prepared)>;

/// How one part of an isolated batch went.
enum Part {
    Delivered,
    Failed(SinkError),
    /// The tick budget ran out, before or during the attempt.
    OutOfTime,
}

fn failure_kind(error: &SinkError) -> FailureKind {
    match error {
        SinkError::Rejected { .. } => FailureKind::Permanent,
        SinkError::Transient { .. } => FailureKind::Transient,
    }
}

/// What isolating a batch found.
#[derive(Default)]
struct IsolationResult {
    /// The sink is down, not the rows: nothing more was tried.
    sink_down: bool,
    /// The tick budget ran out before every part was tried: nothing may be concluded (a part
    /// failing for lack of time says nothing about its rows).
    out_of_time: bool,
    /// Rows delivered, and the position of the last of them in row order.
    delivered: usize,
    delivered_through: Option<Position>,
    /// Rows that failed alone, with why.
    poisoned: Vec<(Event, SinkError)>,
}

impl IsolationResult {
    fn delivered_part(&mut self, start: usize, end: usize, positions: &[Position]) {
        self.delivered += end - start;
        // Meaningful in stop mode, where parts go strictly in row order.
        self.delivered_through = Some(positions[end - 1].clone());
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

fn error_is_retryable(error: &StoreError) -> bool {
    matches!(error, StoreError::Unavailable { retryable: true, .. })
}

fn held_by_whoever_wrote(current: Option<Box<StateDocument>>) -> TickOutcome {
    let lease = current.and_then(|document| document.lease);
    match lease {
        Some(lease) => TickOutcome::LeaseHeld {
            owner_id: lease.owner_id.unwrap_or_else(|| "(released)".to_string()),
            expires_at: lease.expires_at,
        },
        None => TickOutcome::LeaseHeld { owner_id: "(unknown)".to_string(), expires_at: None },
    }
}
