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
//! A failed delivery leaves the checkpoint where it was and releases the lease, so the next tick,
//! anywhere, retries the same batch at once. Every write reuses the ETag of the previous read or
//! write: a tick that delivers k batches costs 1 GET and k + 1 PUTs.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;

use chrono::{DateTime, Utc};
use tracing::{info, warn};

use crate::config::PollerConfig;
use crate::domain::ids::batch_id;
use crate::domain::lease::{self, LeaseStatus};
use crate::domain::state::{CheckpointRegression, advance_checkpoint, describe};
use crate::domain::window::BatchWindow;
use crate::domain::{DocumentError, Position, StateDocument};
use crate::sink::{Batch, Sink, SinkError};
use crate::source::{Source, SourceError, SourceRow};
use crate::store::{ETag, StateKey, StateStore, StoreError, WriteCondition};

/// How long after a failed heartbeat the next attempt is made (the lease stays ours until it
/// expires; `holder_may_act` stops the tick before that).
const HEARTBEAT_RETRY_DELAY: Duration = Duration::from_secs(1);

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

/// Everything one poller needs, created once and reused by every tick.
pub struct Poller {
    pub config: PollerConfig,
    pub source: Arc<dyn Source>,
    pub sink: Arc<dyn Sink>,
    pub store: Arc<dyn StateStore>,
    pub clock: Arc<dyn Clock>,
    /// This process's lease owner id.
    pub owner_id: String,
    /// One tick at a time per poller in this process (the lease guards across processes).
    running: tokio::sync::Mutex<()>,
}

/// How a tick ended, when it did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickOutcome {
    /// Nothing after the checkpoint: one read, no write.
    Idle,
    /// Batches delivered and committed.
    Delivered { rows: u64, batches: u64, checkpoint: String, stop: StopReason },
    /// Another instance holds a live lease.
    LeaseHeld { owner_id: String, expires_at: Option<DateTime<Utc>> },
    /// The lease was lost mid-tick (someone else wrote the document); nothing more was committed.
    LeaseLost { rows: u64, batches: u64 },
    /// A tick of this poller is already running in this process.
    Busy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    CaughtUp,
    BudgetExhausted,
}

impl TickOutcome {
    /// A short stable name, for logs and the `X-DbTrigger-Outcome` header.
    pub fn kind(&self) -> &'static str {
        match self {
            TickOutcome::Idle => "idle",
            TickOutcome::Delivered { stop: StopReason::CaughtUp, .. } => "caught-up",
            TickOutcome::Delivered { stop: StopReason::BudgetExhausted, .. } => "budget-exhausted",
            TickOutcome::LeaseHeld { .. } => "lease-held",
            TickOutcome::LeaseLost { .. } => "lease-lost",
            TickOutcome::Busy => "busy",
        }
    }
}

impl fmt::Display for TickOutcome {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TickOutcome::Idle => write!(formatter, "nothing new"),
            TickOutcome::Delivered { rows, batches, checkpoint, stop } => {
                let how = match stop {
                    StopReason::CaughtUp => "caught up",
                    StopReason::BudgetExhausted => "tick budget used up, more to deliver",
                };
                write!(formatter, "delivered {batches} batches, {rows} rows; {how}; checkpoint {checkpoint}")
            }
            TickOutcome::LeaseHeld { owner_id, expires_at } => match expires_at {
                Some(at) => write!(formatter, "lease held by {owner_id} until {}", at.to_rfc3339()),
                None => write!(formatter, "lease held by {owner_id}"),
            },
            TickOutcome::LeaseLost { rows, batches } => {
                write!(formatter, "lease lost after {batches} batches, {rows} rows; the new owner continues")
            }
            TickOutcome::Busy => write!(formatter, "a tick of this poller is already running here"),
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
}

/// A write that did not land.
enum WriteFailure {
    /// Someone else wrote first; this is what is there now (if anything).
    Conflict(Option<Box<StateDocument>>),
    Store(StoreError),
}

/// Why a heartbeat stopped the deliveries.
enum DeliveryFailure {
    LeaseLost,
    Store(StoreError),
}

/// A batch handed to the sink, awaiting its acknowledgement.
struct Sent {
    batch_id: String,
    last: Position,
    rows: usize,
}

/// What the tick has committed so far.
#[derive(Default)]
struct Totals {
    rows: u64,
    batches: u64,
    checkpoint: Option<String>,
}

impl Totals {
    fn add(&mut self, committed: &[Sent]) {
        self.rows += committed.iter().map(|sent| sent.rows as u64).sum::<u64>();
        self.batches += committed.len() as u64;
        if let Some(last) = committed.last() {
            self.checkpoint = Some(describe(&last.last));
        }
    }

    fn lease_lost(&self) -> TickOutcome {
        TickOutcome::LeaseLost { rows: self.rows, batches: self.batches }
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
        Poller { config, source, sink, store, clock, owner_id, running: tokio::sync::Mutex::new(()) }
    }

    pub fn key(&self) -> StateKey {
        StateKey::new(&self.config.app_name, &self.config.poller_name)
    }

    /// Runs one tick.
    pub async fn tick(&self) -> Result<TickOutcome, TickError> {
        let Ok(_running) = self.running.try_lock() else {
            return Ok(TickOutcome::Busy);
        };
        let deadline = Instant::now() + self.config.batch.tick_budget;
        let key = self.key();
        let terms = self.config.lease;

        // 1. One read.
        let (mut document, mut etag) = match self.store.read(&key).await? {
            Some(versioned) => (versioned.document, Some(versioned.etag)),
            None => (StateDocument::new(&self.config.poller_name, &self.config.fingerprint), None),
        };
        if document.source_fingerprint != self.config.fingerprint {
            return Err(TickError::FingerprintMismatch {
                stored: document.source_fingerprint.clone(),
                current: self.config.fingerprint.clone(),
            });
        }
        let now = self.clock.now();
        if let LeaseStatus::HeldByOther { owner_id, expires_at } =
            lease::status(document.lease.as_ref(), &self.owner_id, now, &terms)
        {
            return Ok(TickOutcome::LeaseHeld { owner_id, expires_at });
        }

        // 2. Anything to do?
        let checkpoint = document.position()?;
        let size = self.config.batch.size;
        let rows = self.source.fetch_after(checkpoint.as_ref(), size).await?;
        if rows.is_empty() {
            return Ok(TickOutcome::Idle);
        }

        // 3. Take the lease.
        let acquired = match lease::acquire(document.lease.as_ref(), &self.owner_id, now, &terms) {
            Ok(acquired) => acquired,
            Err(held) => {
                return Ok(TickOutcome::LeaseHeld { owner_id: held.owner_id, expires_at: held.expires_at });
            }
        };
        let fencing_token = acquired.fencing_token;
        document.lease = Some(acquired);
        let condition = match etag.take() {
            Some(etag) => WriteCondition::Matches(etag),
            None => WriteCondition::Absent,
        };
        let etag = match self.write_state(&key, &mut document, condition).await {
            Ok(etag) => etag,
            Err(WriteFailure::Conflict(current)) => return Ok(held_by_whoever_wrote(current)),
            Err(WriteFailure::Store(error)) => return Err(error.into()),
        };

        // 4 and 5. Deliver and commit until caught up or out of budget.
        self.deliver_and_commit(&key, &mut document, etag, rows, fencing_token, deadline).await
    }

    /// Keeps up to `maxInFlight` batches in flight, fetching each next batch as the previous one
    /// leaves, and commits the contiguous prefix of acknowledged batches as soon as it grows (seed
    /// 004): a batch acknowledged early waits for the ones before it. A commit is a heartbeat; a
    /// separate heartbeat is written only when no commit happened for a heartbeat interval. The
    /// commit that empties the window with nothing left to send releases the lease.
    async fn deliver_and_commit(
        &self,
        key: &StateKey,
        document: &mut StateDocument,
        mut etag: ETag,
        first_rows: Vec<SourceRow>,
        fencing_token: u64,
        deadline: Instant,
    ) -> Result<TickOutcome, TickError> {
        let terms = self.config.lease;
        let size = self.config.batch.size;
        let mut window: BatchWindow<Sent> = BatchWindow::new();
        let mut in_flight: JoinSet<(u64, Result<(), SinkError>)> = JoinSet::new();
        let mut next: Option<Vec<SourceRow>> = Some(first_rows);
        let mut fetch_error: Option<SourceError> = None;
        let mut totals = Totals::default();
        // After a failed heartbeat, the next attempt waits a little instead of following at once.
        let mut heartbeat_retry_at: Option<Instant> = None;
        loop {
            // Fill the window.
            while in_flight.len() < self.config.batch.max_in_flight && Instant::now() < deadline {
                let Some(rows) = next.take() else {
                    break;
                };
                let first = rows.first().expect("a batch is never empty").position.clone();
                let last = rows.last().expect("a batch is never empty").position.clone();
                let id = batch_id(&self.config.poller_name, &self.config.fingerprint, &first, &last, rows.len());
                let batch =
                    Batch::new(&self.config.poller_name, &self.config.fingerprint, id.clone(), fencing_token, &rows);
                let sequence = window.open(Sent { batch_id: id, last: last.clone(), rows: rows.len() });
                let sink = self.sink.clone();
                in_flight.spawn(async move { (sequence, sink.deliver(&batch, deadline).await) });
                // A short batch means the source had no more rows when it was read: no need to ask again.
                if rows.len() == size {
                    match self.source.fetch_after(Some(&last), size).await {
                        Ok(more) if !more.is_empty() => next = Some(more),
                        Ok(_) => {}
                        Err(error) => fetch_error = Some(error),
                    }
                }
            }
            if in_flight.is_empty() {
                break;
            }

            let current = document.lease.clone().expect("the lease is held while delivering");
            let now = self.clock.now();
            if !lease::holder_may_act(&current, &self.owner_id, now, &terms) {
                in_flight.abort_all();
                warn!(poller = %self.config.poller_name, "the lease is about to expire without a heartbeat; stopping");
                return Ok(totals.lease_lost());
            }
            let due = lease::next_heartbeat_due(&current, &terms).unwrap_or(now);
            let wait = match heartbeat_retry_at {
                Some(retry_at) => retry_at.saturating_duration_since(Instant::now()),
                None => (due - now).to_std().unwrap_or(Duration::ZERO),
            };
            tokio::select! {
                joined = in_flight.join_next() => {
                    // Take every delivery that has finished by now, so that one commit covers them all.
                    let mut finished = vec![joined.expect("the set is not empty")];
                    while let Some(more) = in_flight.try_join_next() {
                        finished.push(more);
                    }
                    let mut ready = Vec::new();
                    let mut failure: Option<SinkError> = None;
                    for joined in finished {
                        match joined {
                            Ok((sequence, Ok(()))) => ready.extend(window.acknowledge(sequence)),
                            Ok((_, Err(error))) => failure = failure.or(Some(error)),
                            Err(join_error) => {
                                let reason = format!("the delivery task failed: {join_error}");
                                failure = failure.or(Some(SinkError::Transient { batch_id: String::new(), reason }));
                            }
                        }
                    }
                    if let Some(error) = &failure {
                        // Batches after the failed one may have landed: the next tick delivers them again.
                        in_flight.abort_all();
                        warn!(poller = %self.config.poller_name, error = %error, "delivery failed; checkpoint left before this batch");
                    }
                    if !ready.is_empty() {
                        let nothing_more = next.is_none() || fetch_error.is_some() || Instant::now() >= deadline;
                        let release = failure.is_some() || (in_flight.is_empty() && window.is_empty() && nothing_more);
                        match self.commit(key, document, etag.clone(), &ready, release).await? {
                            Some(new_etag) => {
                                etag = new_etag;
                                heartbeat_retry_at = None;
                            }
                            None => {
                                in_flight.abort_all();
                                warn!(poller = %self.config.poller_name, "commit refused: the lease was taken over; the new owner delivers these batches again");
                                return Ok(totals.lease_lost());
                            }
                        }
                        totals.add(&ready);
                    }
                    if let Some(error) = failure {
                        self.release_lease(key, document, etag).await;
                        return Err(TickError::Delivery { error, rows_committed: totals.rows });
                    }
                }
                _ = tokio::time::sleep(wait) => {
                    match self.heartbeat(key, document, &etag).await {
                        Ok(Some(new_etag)) => {
                            etag = new_etag;
                            heartbeat_retry_at = None;
                        }
                        Ok(None) => heartbeat_retry_at = Some(Instant::now() + HEARTBEAT_RETRY_DELAY),
                        Err(DeliveryFailure::LeaseLost) => {
                            in_flight.abort_all();
                            return Ok(totals.lease_lost());
                        }
                        Err(DeliveryFailure::Store(error)) => {
                            in_flight.abort_all();
                            self.release_lease(key, document, etag).await;
                            return Err(error.into());
                        }
                    }
                }
            }
        }

        // The tick budget can run out between the last commit and the check above: then the last
        // commit renewed the lease, and it is released here.
        if document.lease.as_ref().and_then(|lease| lease.owner_id.as_deref()) == Some(self.owner_id.as_str()) {
            self.release_lease(key, document, etag).await;
        }
        if let Some(error) = fetch_error {
            return Err(error.into());
        }
        let stop = if next.is_some() { StopReason::BudgetExhausted } else { StopReason::CaughtUp };
        Ok(TickOutcome::Delivered {
            rows: totals.rows,
            batches: totals.batches,
            checkpoint: totals.checkpoint.clone().unwrap_or_default(),
            stop,
        })
    }

    /// Moves the checkpoint over `ready` (acknowledged, contiguous batches) in one CAS that also
    /// renews or releases the lease. `None`: the lease was taken over, nothing was committed.
    async fn commit(
        &self,
        key: &StateKey,
        document: &mut StateDocument,
        etag: ETag,
        ready: &[Sent],
        release: bool,
    ) -> Result<Option<ETag>, TickError> {
        let last = ready.last().expect("a commit covers at least one batch");
        let rows: usize = ready.iter().map(|sent| sent.rows).sum();
        let now = self.clock.now();
        document.checkpoint =
            Some(advance_checkpoint(document.checkpoint.as_ref(), &last.last, &last.batch_id, rows, now)?);
        document.stats.rows_delivered += rows as u64;
        document.stats.batches_delivered += ready.len() as u64;
        document.stats.last_tick_at = Some(now);
        let current_lease = document.lease.clone().expect("the lease is held while committing");
        let next_lease = if release {
            lease::release(&current_lease, &self.owner_id, now)
        } else {
            lease::renew(&current_lease, &self.owner_id, now, &self.config.lease)
        };
        let Ok(next_lease) = next_lease else {
            return Ok(None);
        };
        document.lease = Some(next_lease);
        match self.write_state(key, document, WriteCondition::Matches(etag)).await {
            Ok(new_etag) => {
                for sent in ready {
                    info!(
                        poller = %self.config.poller_name,
                        batch = %sent.batch_id,
                        rows = sent.rows,
                        fencing_token = current_lease.fencing_token,
                        checkpoint = %describe(&sent.last),
                        "batch delivered and committed"
                    );
                }
                Ok(Some(new_etag))
            }
            Err(WriteFailure::Conflict(_)) => Ok(None),
            Err(WriteFailure::Store(error)) => Err(error.into()),
        }
    }

    /// Renews the lease while deliveries run. `Ok(Some)`: renewed; `Ok(None)`: the write failed
    /// in a way worth retrying at the next interval (the lease is ours until it expires).
    async fn heartbeat(
        &self,
        key: &StateKey,
        document: &mut StateDocument,
        etag: &ETag,
    ) -> Result<Option<ETag>, DeliveryFailure> {
        let current = document.lease.clone().expect("the lease is held while delivering");
        let Ok(renewed) = lease::renew(&current, &self.owner_id, self.clock.now(), &self.config.lease) else {
            return Err(DeliveryFailure::LeaseLost);
        };
        document.lease = Some(renewed);
        match self.write_state(key, document, WriteCondition::Matches(etag.clone())).await {
            Ok(new_etag) => Ok(Some(new_etag)),
            Err(WriteFailure::Conflict(_)) => Err(DeliveryFailure::LeaseLost),
            Err(WriteFailure::Store(error)) => {
                warn!(poller = %self.config.poller_name, error = %error, "heartbeat failed, retrying");
                document.lease = Some(current);
                if error_is_retryable(&error) { Ok(None) } else { Err(DeliveryFailure::Store(error)) }
            }
        }
    }

    /// Writes the document with a fresh write id. A conflict is re-read once: if the stored document
    /// carries our write id, the write landed and only its answer was lost (seed 001 case G).
    async fn write_state(
        &self,
        key: &StateKey,
        document: &mut StateDocument,
        condition: WriteCondition,
    ) -> Result<ETag, WriteFailure> {
        let write_id = uuid::Uuid::new_v4().simple().to_string();
        document.write_id = Some(write_id.clone());
        match self.store.write(key, document, condition).await {
            Ok(etag) => Ok(etag),
            Err(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. }) => match self.store.read(key).await {
                Ok(Some(stored)) if stored.document.write_id.as_deref() == Some(write_id.as_str()) => Ok(stored.etag),
                Ok(stored) => Err(WriteFailure::Conflict(stored.map(|versioned| Box::new(versioned.document)))),
                Err(error) => Err(WriteFailure::Store(error)),
            },
            Err(error) => Err(WriteFailure::Store(error)),
        }
    }

    /// Gives the lease back without moving the checkpoint: after a failure, so that the retry on any
    /// instance need not wait for expiry, or when the tick ends without a releasing commit. Best
    /// effort: if the write fails, the lease simply expires.
    async fn release_lease(&self, key: &StateKey, document: &mut StateDocument, etag: ETag) {
        let Some(current) = document.lease.clone() else {
            return;
        };
        let Ok(released) = lease::release(&current, &self.owner_id, self.clock.now()) else {
            return;
        };
        document.lease = Some(released);
        if let Err(WriteFailure::Store(error)) = self.write_state(key, document, WriteCondition::Matches(etag)).await {
            warn!(poller = %self.config.poller_name, error = %error, "could not release the lease; it will expire");
        }
    }
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
