//! How a tick ended: its outcome when it did not fail, its error when it did, the facts of its
//! summary line, and what it committed on the way.

use std::fmt;

use chrono::{DateTime, Utc};

use crate::domain::DocumentError;
use crate::domain::Position;
use crate::domain::state::{CheckpointRegression, describe};
use crate::sink::SinkError;
use crate::source::SourceError;
use crate::store::StoreError;

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
    /// Whether the late-arrival detector recounted the window at this tick.
    pub late_check: LateCheck,
    /// Rows found committed behind the checkpoint and delivered (`late: true`) at this tick.
    pub late_arrivals: u64,
    /// The most seconds such a row was found after its cursor time.
    pub max_lateness_seconds: Option<u64>,
    /// How long the tick waited for a database connection, every one the app allows to its
    /// database being in use by other pollers.
    pub connection_wait_ms: u64,
    /// How long the tick's reads waited for the app's budget of bytes in flight
    /// (`DBTRIGGER_MAX_BYTES_IN_FLIGHT`), spent by other pollers' batches.
    pub budget_wait_ms: u64,
}

/// Whether a tick recounted the late-arrival window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LateCheck {
    /// Not at this tick: the detector is off, not due (`everyTicks`), or has no window yet.
    #[default]
    Skipped,
    Checked,
    /// The recount failed (a warning says why); the tick delivered on without it.
    Failed,
}

impl LateCheck {
    pub fn as_str(self) -> &'static str {
        match self {
            LateCheck::Skipped => "skipped",
            LateCheck::Checked => "checked",
            LateCheck::Failed => "failed",
        }
    }
}

/// How a tick ended, when it did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickOutcome {
    /// Nothing after the checkpoint: one read, no write (one, to clear failures of earlier ticks).
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

/// What a delivery loop leaves when it ends: the rows it read and did not send, and whether a
/// read it would have made was given up (issue 45, finding 7: the deadline can pass between two
/// looks at it, so the outcome is read from what is left, never from where the deadline was seen).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Left {
    pub(super) unsent_rows: usize,
    pub(super) reads_given_up: bool,
}

impl StopReason {
    /// A delivery loop that ended without a failure caught up only if it left nothing.
    pub(super) fn after_delivery(left: Left) -> StopReason {
        if left.unsent_rows > 0 || left.reads_given_up { StopReason::BudgetExhausted } else { StopReason::CaughtUp }
    }
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
         The checkpoint may not mean the same rows any more: if it still does, `dbtrigger fingerprint accept` keeps it (after `dbtrigger reset` when the key changed); if not, reset the poller or use a new poller name"
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
    /// While a poison batch was isolated, a row failed alone, or two parts in a row failed, the
    /// same transient way: the sink is down or flaky, not the rows.
    #[error(
        "{error}; a poison batch was being isolated (attempt {attempts}), but a row alone, or two parts in a row, failed the same transient way: \
         the sink looks down or flaky. No row is quarantined for a transient failure: the {settled} rows settled before it are committed, \
         and the next tick goes on isolating from the checkpoint"
    )]
    SinkDown { error: SinkError, attempts: u32, settled: usize },
    /// The tick budget ran out while a poison batch was isolated: what was settled is committed, and
    /// the next tick goes on with the rest.
    #[error(
        "the tick budget ran out while isolating a poison batch (attempt {attempts}): {settled} of its {rows} rows are settled \
         (delivered or quarantined) and committed; the next tick goes on isolating the rest"
    )]
    IsolationUnfinished { settled: usize, rows: usize, attempts: u32 },
    /// `poison.mode: stop`: a row the sink refuses alone holds the poller.
    #[error(
        "poison.mode is stop: the row with primary key {pk} fails alone ({error}); the rows before it were delivered, \
         the checkpoint holds before it. Fix the receiver or the row, or reset the poller past it"
    )]
    PoisonStop { pk: String, error: SinkError },
    /// The endpoint refuses (a status about the endpoint, not the rows: `domain::endpoint`): the
    /// poller holds at its checkpoint and quarantines nothing until it answers again (issue 36).
    #[error(
        "{error}; the receiver refuses every row alike (HTTP {status}: {meaning}): that is the endpoint, not the rows. \
         Nothing is quarantined; the checkpoint holds (attempt {attempts}) and the next tick tries the same rows again. \
         Fix the URL or the credential (sink.url, the SAS or the connection)"
    )]
    EndpointRefused { status: u16, meaning: &'static str, error: SinkError, attempts: u32 },
    /// A row refused alone found the quarantine budget spent (`poison.maxQuarantinedPerHour`,
    /// issue 45 finding 8): the poller holds at its checkpoint and quarantines nothing more.
    #[error(
        "quarantine_budget_spent: {error}; {per_hour} rows were quarantined within the last hour (poison.maxQuarantinedPerHour), \
         so this one is not: the checkpoint holds (attempt {attempts}) and the next tick tries the same rows again. \
         A receiver refusing every row looks like this: fix it, or replay the quarantine, or raise the budget"
    )]
    QuarantineBudgetSpent { per_hour: u32, error: SinkError, attempts: u32 },
    /// The same for a late row (committed behind the checkpoint): held and tried again at every tick.
    #[error(
        "quarantine_budget_spent: {error}; {per_hour} rows were quarantined within the last hour (poison.maxQuarantinedPerHour), \
         so the late row (from {first}) is held, not quarantined, and tried again at every tick"
    )]
    LateQuarantineBudgetSpent { per_hour: u32, error: SinkError, first: String },
    /// `source.generation.onChange: stop` and the generation moved since the checkpoint.
    #[error(
        "the source generation changed from {stored} to {current} (a truncate and reload?): source.generation.onChange is stop, \
         so nothing is delivered until an operator resets the poller (dbtrigger reset <poller> --to-beginning, or --to-end)"
    )]
    GenerationChanged { stored: String, current: String },
    /// Internal: the generation moved before a commit; the tick turns it into `Superseded`.
    #[error("the source generation moved from {bound} during the tick")]
    Superseded { bound: Box<serde_json::Value>, current: Option<Box<serde_json::Value>> },
    /// A late batch failed transiently (or its isolation did): the bucket stays in the window,
    /// marked undelivered, and every tick tries it again.
    #[error(
        "{error}; rows committed behind the checkpoint (late arrivals, from {first}) could not be delivered: the next check finds them again"
    )]
    LateDelivery { error: SinkError, first: String },
    /// `poison.mode: stop`: a late row the receiver refuses alone is held (never quarantined): its
    /// bucket stays in the window, marked undelivered, and every tick tries it again (issue 35).
    #[error(
        "poison.mode is stop: the late row with primary key {pk} (committed behind the checkpoint) fails alone ({error}); \
         it is held, not quarantined, and tried again at every tick; new rows are still delivered. Fix the receiver or the row"
    )]
    LatePoisonStop { pk: String, error: SinkError },
    /// The endpoint refused a late batch (a status about the endpoint, not the rows): held,
    /// nothing quarantined, tried again at every tick (issue 35, as issue 36 for any batch).
    #[error(
        "{error}; the receiver refuses every row alike (HTTP {status}: {meaning}): that is the endpoint, not the rows. \
         Nothing is quarantined; the late rows (from {first}) are held and tried again at every tick. \
         Fix the URL or the credential (sink.url, the SAS or the connection)"
    )]
    LateEndpointRefused { status: u16, meaning: &'static str, error: SinkError, first: String },
    /// A bug: something panicked during the tick. The lease was released if it was held.
    #[error("the tick failed unexpectedly (panic: {message}); the checkpoint did not move")]
    Panicked { message: String },
}

impl TickError {
    /// Whether the end of the failed tick records it in the document's `failure`, so that `status`
    /// and the watchdog see it. A sink's failure is recorded on the batch (`poison`) where it
    /// happens; a changed fingerprint or a stopped generation shows in `status` by itself; a lost
    /// lease leaves nothing to write with.
    pub(super) fn needs_failure_record(&self) -> bool {
        matches!(
            self,
            TickError::Store(_)
                | TickError::Source(_)
                | TickError::Document(_)
                | TickError::Checkpoint(_)
                | TickError::LateDelivery { .. }
                | TickError::LatePoisonStop { .. }
                | TickError::LateEndpointRefused { .. }
                | TickError::LateQuarantineBudgetSpent { .. }
                | TickError::Panicked { .. }
        )
    }
}

/// What the tick has committed so far.
#[derive(Default)]
pub(super) struct Totals {
    pub(super) rows: u64,
    pub(super) batches: u64,
    pub(super) quarantined: u64,
    pub(super) checkpoint: Option<String>,
}

impl Totals {
    /// A commit of `rows` delivered and `quarantined` kept aside, over `batches` whole batches, up
    /// to `last`.
    pub(super) fn add(&mut self, rows: usize, quarantined: usize, batches: usize, last: &Position) {
        self.rows += rows as u64;
        self.quarantined += quarantined as u64;
        self.batches += batches as u64;
        self.checkpoint = Some(describe(last));
    }

    /// The lease was lost: after some progress an outcome (the new owner continues), before any
    /// an error (the same will happen next tick, and a 200 would hide it).
    pub(super) fn lease_lost(&self, reason: &str) -> Result<TickOutcome, TickError> {
        if self.rows == 0 && self.quarantined == 0 {
            return Err(TickError::NoProgress { reason: reason.to_string() });
        }
        Ok(TickOutcome::LeaseLost { rows: self.rows, batches: self.batches })
    }

    pub(super) fn delivered(&self, stop: StopReason) -> TickOutcome {
        TickOutcome::Delivered {
            rows: self.rows,
            batches: self.batches,
            checkpoint: self.checkpoint.clone().unwrap_or_default(),
            stop,
            new_document: false,
            quarantined: self.quarantined,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 45, finding 7: the outcome of a delivery loop is read from what it leaves.
    #[test]
    fn a_loop_caught_up_only_when_it_leaves_nothing() {
        let cases = [
            (Left { unsent_rows: 0, reads_given_up: false }, StopReason::CaughtUp),
            (Left { unsent_rows: 1, reads_given_up: false }, StopReason::BudgetExhausted),
            (Left { unsent_rows: 0, reads_given_up: true }, StopReason::BudgetExhausted),
            (Left { unsent_rows: 7, reads_given_up: true }, StopReason::BudgetExhausted),
        ];
        for (left, expected) in cases {
            assert_eq!(StopReason::after_delivery(left), expected, "{left:?}");
        }
    }
}
