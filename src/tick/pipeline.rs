//! The pipelined delivery loop (seed 004): up to `maxInFlight` batches in flight, the next one
//! read meanwhile, acknowledgements taken in any order and committed in order, as the contiguous
//! prefix of acknowledged batches grows.
//!
//! When a batch fails, nothing more is read or sent, the batches after it are aborted, and the ones
//! before it are still waited for (the first error stops the spawning, the draining goes on): their
//! prefix is committed, and the failed batch is then the batch at the checkpoint, whose failure is
//! counted and which, when it is poison, is isolated. If an earlier batch fails meanwhile, the
//! earliest failure is the one handled.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use opentelemetry::context::FutureExt as _;
use tokio::task::{JoinError, JoinSet};
use tracing::warn;

use crate::config::SinkConfig;
use crate::domain::StateDocument;
use crate::domain::endpoint::{self, Blame, Receiver};
use crate::domain::lease;
use crate::domain::poison::{self, FailureKind, IsolationPlan, PoisonMode, Verdict};
use crate::domain::quarantine_budget;
use crate::domain::window::BatchWindow;
use crate::sink::SinkError;
use crate::source::Fetched;
use crate::store::StateWriter;

use super::Poller;
use super::isolate::Isolation;
use super::ledger::{HEARTBEAT_RETRY_DELAY, HeartbeatFailure, Sent};
use super::ordered::Ordered;
use super::outcome::{Left, StopReason, TickError, TickOutcome, Totals};
use super::panic_message;
use super::reader::{BatchMaker, Prepared, Reader};
use super::timer::{Timer, runtime_deadline};

fn add_batches(totals: &mut Totals, committed: &[Sent]) {
    if let Some(last) = committed.last() {
        let batches = committed.iter().map(|sent| sent.batches).sum();
        totals.add(committed.iter().map(|sent| sent.rows).sum(), 0, batches, &last.last);
    }
}

/// How one delivery task ended: a failed batch comes back with its rows, for isolation.
type Delivery = Result<(), (SinkError, Prepared)>;

/// The earliest batch that failed so far.
struct Failed {
    sequence: u64,
    error: SinkError,
    batch: Prepared,
}

/// The work in flight, owned in one place: the window, the deliveries, the reader and what it
/// read, the acknowledged batches not committed yet, and the earliest failure.
struct Pipeline {
    window: BatchWindow<Sent>,
    in_flight: JoinSet<(u64, Delivery)>,
    reader: Reader,
    /// Read and not sent yet.
    ready: VecDeque<Prepared>,
    /// Rows read and dropped unsent when the budget ran out.
    dropped_rows: usize,
    /// Acknowledged, contiguous batches not committed yet.
    pending: Vec<Sent>,
    failed: Option<Failed>,
    /// The ordered window (issue 38), when a key's events must leave in order; `window` and
    /// `ready` stay empty then.
    ordered: Option<Ordered>,
    maker: Arc<BatchMaker>,
}

impl Pipeline {
    /// Takes a delivery that came back.
    fn take(&mut self, joined: Result<(u64, Delivery), JoinError>, poller: &Poller) {
        match joined {
            Ok((sequence, Ok(()))) => {
                let acknowledged = self.acknowledged(sequence, poller);
                self.pending.extend(acknowledged);
            }
            Ok((sequence, Err((error, batch)))) => self.fail(sequence, error, batch),
            // A batch after a failed one, aborted.
            Err(join_error) if join_error.is_cancelled() => {}
            // The task itself panicked (a delivery's panic is caught inside it): the tick's own
            // panic handling reports it.
            Err(join_error) => std::panic::resume_unwind(join_error.into_panic()),
        }
    }

    /// The batches acknowledged in order once `sequence` is: the window's, or the run of events
    /// the ordered window's prefix now covers.
    fn acknowledged(&mut self, sequence: u64, poller: &Poller) -> Vec<Sent> {
        let Some(ordered) = self.ordered.as_mut() else {
            return self.window.acknowledge(sequence);
        };
        let Some(covered) = ordered.acknowledge(sequence) else {
            return Vec::new();
        };
        let rows = covered.positions.len();
        let keys = poller.late_keys(&covered.positions);
        let batches = covered.batches;
        vec![Sent {
            batch_id: covered.batch_id,
            first: covered.first,
            last: covered.last,
            rows,
            batches,
            keys,
            abort: None,
        }]
    }

    /// Takes a batch read.
    fn accept(&mut self, read: Option<Prepared>) {
        match (self.ordered.as_mut(), read) {
            (Some(ordered), Some(prepared)) => ordered.accept(prepared),
            (None, read) => self.ready.extend(read),
            (_, None) => {}
        }
    }

    /// Nothing read waits to be sent.
    fn nothing_ready(&self) -> bool {
        self.ready.is_empty() && self.ordered.as_ref().is_none_or(|ordered| ordered.waiting() == 0)
    }

    /// No batch is in the window (acknowledged behind a gap, or unacknowledged).
    fn window_empty(&self) -> bool {
        self.window.is_empty() && self.ordered.as_ref().is_none_or(Ordered::idle)
    }

    /// Rows read and not sent (waiting in the ordered window's case).
    fn ready_rows(&self) -> usize {
        let ready: usize = self.ready.iter().map(|prepared| prepared.positions.len()).sum();
        ready + self.ordered.as_ref().map_or(0, Ordered::waiting)
    }

    /// Drops what was read and not sent (the budget ran out): the next tick reads it again.
    fn clear_ready(&mut self) {
        self.dropped_rows += self.ready_rows();
        self.ready.clear();
        if let Some(ordered) = self.ordered.as_mut() {
            ordered.clear_waiting();
        }
    }

    /// What the loop leaves behind: read and not sent, or not read.
    fn left(&self) -> Left {
        Left { unsent_rows: self.dropped_rows + self.ready_rows(), reads_given_up: self.reader.given_up() }
    }

    /// Starts the next read when what was read is sent (the ordered window: when fewer than a
    /// batch of events wait for their keys).
    fn read_more(&mut self, batch_rows: usize) {
        let waiting = match &self.ordered {
            Some(ordered) => usize::from(ordered.waiting() >= batch_rows),
            None => self.ready.len(),
        };
        self.reader.start(waiting);
    }

    /// Batch `sequence` failed: unless an earlier one did, it is the one the checkpoint stops
    /// before. Nothing more is read or sent, and the batches after it are given up. In the
    /// ordered window, only its keys stop: what was read of other keys is still sent, and the
    /// batches in flight are waited for.
    fn fail(&mut self, sequence: u64, error: SinkError, batch: Prepared) {
        if let Some(ordered) = self.ordered.as_mut() {
            let first = ordered.fail(sequence);
            self.reader.stop();
            if self.failed.as_ref().is_none_or(|failed| ordered.first_event(failed.sequence) > first) {
                self.failed = Some(Failed { sequence, error, batch });
            }
            return;
        }
        if self.failed.as_ref().is_some_and(|failed| failed.sequence < sequence) {
            return;
        }
        for later in self.window.close_after(sequence) {
            if let Some(abort) = later.abort {
                abort.abort();
            }
        }
        self.ready.clear();
        self.reader.stop();
        self.failed = Some(Failed { sequence, error, batch });
    }
}

impl Poller {
    /// Keeps up to `maxInFlight` batches in flight and the next batch fetching meanwhile, and
    /// commits the contiguous prefix of acknowledged batches as soon as it grows (seed 004): a batch
    /// acknowledged early waits for the ones before it. A commit is a heartbeat; a separate
    /// heartbeat is written when no commit happened for a heartbeat interval, whether deliveries or
    /// a fetch are what the tick is waiting for. The commit that empties the window with nothing
    /// left to send releases the lease, unless `keep_lease` (late rows are delivered next).
    pub(super) async fn deliver_and_commit(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        (first, first_hold): (Fetched, super::budget::Hold),
        maker: Arc<BatchMaker>,
        deadline: DateTime<Utc>,
        keep_lease: bool,
    ) -> Result<TickOutcome, TickError> {
        let terms = self.config.lease;
        // The batches after the first one are read by this task while batches are delivered and
        // committed, so the window refills without waiting for a query and a commit never holds up
        // the reads. Memory holds what is in flight plus two batches at most: one ready here and
        // one being read.
        let after_first = if first.full { first.rows.last().map(|row| row.position.clone()) } else { None };
        let mut pipeline = Pipeline {
            window: BatchWindow::new(),
            in_flight: JoinSet::new(),
            reader: Reader::new(
                self.source.clone(),
                self.fetch_limit(),
                maker.clone(),
                after_first,
                self.reservations(),
            ),
            ready: VecDeque::new(),
            dropped_rows: 0,
            pending: Vec::new(),
            failed: None,
            ordered: maker.grouping.as_ref().map(|_| Ordered::new()),
            maker: maker.clone(),
        };
        pipeline.accept(Some(Prepared { hold: first_hold, ..maker.prepare(first.rows) }));
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
            if self.clock.now() >= deadline && (!pipeline.nothing_ready() || !pipeline.reader.done()) {
                // Out of budget: what is fetched or fetching waits for the next tick.
                pipeline.clear_ready();
                pipeline.reader.stop();
            }

            // Fill the window with what has been fetched, before committing: the next deliveries
            // run while the commit of the ones acknowledged is written, so a commit never holds up
            // a delivery (even at maxInFlight 1, where the receiver still sees batches in order).
            // Commits stay in order, one at a time; a lost lease aborts whatever is in flight.
            self.send_ready(&mut pipeline, deadline);
            pipeline.read_more(self.config.batch.size);
            if pipeline.failed.is_some() && pipeline.in_flight.is_empty() {
                // Every batch before the failed one is settled: on to the failed one.
                break;
            }
            // Commit what is acknowledged, once the commit interval has passed since the last
            // commit, at once when it is the tick's last (it releases the lease) or a heartbeat is
            // due (it serves as one). When every batch is acknowledged but a fetch is still
            // running, the commit waits for it (or for the heartbeat): only then is it known
            // whether this commit is the last one, and a tick keeps to 1 GET and k + 1 PUTs.
            if !pipeline.pending.is_empty() {
                let drained = pipeline.in_flight.is_empty() && pipeline.window_empty();
                let nothing_more = pipeline.nothing_ready() && pipeline.reader.done();
                let more_is_known = !pipeline.nothing_ready() || pipeline.reader.done();
                // A tick whose read failed does not end well: its release records the failure.
                let last = drained && nothing_more && pipeline.reader.failed.is_none() && pipeline.failed.is_none();
                let release = last && !keep_lease;
                let interval_over = commit_due || self.clock.now() - last_commit_at >= commit_interval;
                if last || heartbeat_due || ((!drained || more_is_known) && interval_over) {
                    // While the commit is written, deliveries go on: finished ones are taken
                    // (acknowledged ones wait for the next commit, which then covers them all),
                    // the window refills, reads go on. New deliveries start only while the lease
                    // as last written lets this holder act.
                    let committing = std::mem::take(&mut pipeline.pending);
                    let lease_before = document.lease.clone().expect("the lease is held while delivering");
                    let result = {
                        let commit = self.commit_batches(writer, document, &committing, release);
                        tokio::pin!(commit);
                        loop {
                            tokio::select! {
                                biased;
                                result = &mut commit => break result,
                                joined = pipeline.in_flight.join_next(), if !pipeline.in_flight.is_empty() => {
                                    pipeline.take(joined.expect("the set is not empty"), self);
                                }
                                read = pipeline.reader.next(), if pipeline.reader.reading() => pipeline.accept(read),
                            }
                            if lease::holder_may_act(&lease_before, &self.owner_id, self.clock.now(), &terms) {
                                self.send_ready(&mut pipeline, deadline);
                                pipeline.read_more(self.config.batch.size);
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
                            self.absorb(document, &pipeline.pending);
                            while let Some(joined) = pipeline.in_flight.join_next().await {
                                if let Ok((sequence, Ok(()))) = joined {
                                    let acknowledged = pipeline.acknowledged(sequence, self);
                                    self.absorb(document, &acknowledged);
                                }
                            }
                            return Err(error);
                        }
                        Err(error) => return Err(error),
                    };
                    if !committed {
                        pipeline.in_flight.abort_all();
                        warn!(poller = %self.config.poller_name, "commit refused: the lease was taken over; the new owner delivers these batches again");
                        return totals.lease_lost("a commit found the state document taken over");
                    }
                    add_batches(&mut totals, &committing);
                    heartbeat_due = false;
                    heartbeat_retry_at = None;
                    last_commit_at = self.clock.now();
                    commit_due = commit_interval.is_zero();
                    if !pipeline.pending.is_empty() || pipeline.failed.is_some() {
                        // Acknowledged (or failed) while this commit was written: decide now.
                        continue;
                    }
                }
            }
            if heartbeat_due {
                heartbeat_due = false;
                match self.heartbeat(writer, document).await {
                    Ok(true) => heartbeat_retry_at = None,
                    Ok(false) => heartbeat_retry_at = Some(self.clock.now() + HEARTBEAT_RETRY_DELAY),
                    Err(HeartbeatFailure::LeaseLost) => {
                        pipeline.in_flight.abort_all();
                        return totals.lease_lost("a heartbeat found the state document taken over");
                    }
                    Err(HeartbeatFailure::Store(error)) => {
                        pipeline.in_flight.abort_all();
                        return Err(error.into());
                    }
                }
            }

            if pipeline.in_flight.is_empty() && pipeline.pending.is_empty() && pipeline.reader.done() {
                break;
            }

            let current = document.lease.clone().expect("the lease is held while delivering");
            let now = self.clock.now();
            if !lease::holder_may_act(&current, &self.owner_id, now, &terms) {
                pipeline.in_flight.abort_all();
                warn!(poller = %self.config.poller_name, "the lease is about to expire without a heartbeat; stopping");
                writer.lost = true;
                return totals.lease_lost("the lease came within the clock-skew margin of expiry without a heartbeat");
            }
            let due = heartbeat_retry_at.or(lease::next_heartbeat_due(&current, &terms)).unwrap_or(now);
            if now >= due {
                // Due by the clock: decided here rather than by the timer, which the biased
                // select below serves after the deliveries.
                heartbeat_due = true;
                continue;
            }
            let wait = (due - now).to_std().unwrap_or(Duration::ZERO);
            // Acknowledged batches wait for the commit interval to pass (unless something else
            // comes first and decides for them).
            let commit_wait = (last_commit_at + commit_interval - now).to_std().unwrap_or(Duration::ZERO);
            heartbeat_timer.set(wait);
            let commit_waits = !pipeline.pending.is_empty() && !commit_due;
            if commit_waits {
                commit_timer.set(commit_wait);
            }
            // Biased: the order of the arms is the order of preference, so that a run replays.
            tokio::select! {
                biased;
                joined = pipeline.in_flight.join_next(), if !pipeline.in_flight.is_empty() => {
                    // Take every delivery that has finished by now, so that one commit covers them all.
                    pipeline.take(joined.expect("the set is not empty"), self);
                    while let Some(more) = pipeline.in_flight.try_join_next() {
                        pipeline.take(more, self);
                    }
                }
                read = pipeline.reader.next(), if pipeline.reader.reading() => pipeline.accept(read),
                _ = heartbeat_timer.wait() => heartbeat_due = true,
                _ = commit_timer.wait(), if commit_waits => commit_due = true,
            }
        }

        if let Some(failed) = pipeline.failed.take() {
            return self.after_failure(writer, document, pipeline, failed, totals, deadline).await;
        }
        if let Some(error) = pipeline.reader.failed {
            return Err(error.into());
        }
        // Read from what is left, not from where the deadline was seen: it may pass after the
        // check above and before `send_ready`'s, and a batch then ends the loop unsent.
        Ok(totals.delivered(StopReason::after_delivery(pipeline.left())))
    }

    /// Sends what has been fetched while the window has room and the budget lasts, unless a batch
    /// failed.
    fn send_ready(&self, pipeline: &mut Pipeline, deadline: DateTime<Utc>) {
        if pipeline.failed.is_some() && pipeline.ordered.is_none() {
            return;
        }
        let max_in_flight = self.config.batch.max_in_flight;
        while pipeline.in_flight.len() < max_in_flight && self.clock.now() < deadline {
            let (sequence, prepared) = match pipeline.ordered.as_mut() {
                Some(ordered) => {
                    let (size, bytes) = (self.config.batch.size, self.config.batch.max_bytes);
                    match ordered.next(&pipeline.maker, size, bytes) {
                        Some(next) => next,
                        None => break,
                    }
                }
                None => match pipeline.ready.pop_front() {
                    Some(prepared) => (pipeline.window.next_sequence(), prepared),
                    None => break,
                },
            };
            let batch_id = prepared.batch.batch_id.clone();
            let first = prepared.positions.first().expect("a batch is never empty").clone();
            let last = prepared.positions.last().expect("a batch is never empty").clone();
            let rows = prepared.batch.events.len();
            // The ordered window records the late-arrival keys as its prefix moves.
            let keys = if pipeline.ordered.is_none() { self.late_keys(&prepared.positions) } else { Vec::new() };
            let sink = self.sink.clone();
            // The sink counts its time in its runtime's terms: the budget left, by our clock.
            let sink_deadline = runtime_deadline(deadline, self.clock.now());
            let abort = pipeline.in_flight.spawn(
                async move {
                    // A failed batch comes back with its rows' positions: it may have to be isolated.
                    // A delivered one is dropped here, so acknowledged batches hold no rows. A panic in
                    // the sink is a failed delivery of this batch, not a lost task.
                    let delivered = AssertUnwindSafe(sink.deliver(&prepared.batch, sink_deadline)).catch_unwind().await;
                    let delivered = delivered.unwrap_or_else(|panic| {
                        Err(SinkError::Transient {
                            batch_id: prepared.batch.batch_id.clone(),
                            reason: format!("the delivery panicked: {}", panic_message(panic.as_ref())),
                        })
                    });
                    (sequence, delivered.map_err(|error| (error, prepared)))
                }
                // The tick's trace context (telemetry: the delivery's span is the tick's child).
                .with_current_context(),
            );
            if pipeline.ordered.is_none() {
                let opened =
                    pipeline.window.open(Sent { batch_id, first, last, rows, batches: 1, keys, abort: Some(abort) });
                debug_assert_eq!(opened, sequence);
            }
        }
    }

    /// A batch failed and every batch before it is settled: what was acknowledged before it is
    /// committed, and it is at the checkpoint.
    async fn after_failure(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        mut pipeline: Pipeline,
        failed: Failed,
        mut totals: Totals,
        deadline: DateTime<Utc>,
    ) -> Result<TickOutcome, TickError> {
        warn!(poller = %self.config.poller_name, error = %failed.error, "delivery failed; checkpoint left before this batch");
        if !pipeline.pending.is_empty() {
            let acknowledged = std::mem::take(&mut pipeline.pending);
            if !self.commit_batches(writer, document, &acknowledged, false).await? {
                return totals.lease_lost("a commit found the state document taken over");
            }
            add_batches(&mut totals, &acknowledged);
        }
        if let Some(ordered) = &pipeline.ordered {
            // The ordered window: the failed batch is handled here as today's window would only
            // when it sits at the checkpoint; otherwise the next tick starts at the checkpoint,
            // where its first batch is.
            if !ordered.at_the_checkpoint(failed.sequence) {
                return Err(TickError::Delivery { error: failed.error, rows_committed: totals.rows });
            }
            let positions = &failed.batch.positions;
            let sent = Sent {
                batch_id: failed.batch.batch.batch_id.clone(),
                first: positions.first().expect("a batch is never empty").clone(),
                last: positions.last().expect("a batch is never empty").clone(),
                rows: positions.len(),
                batches: 1,
                keys: Vec::new(),
                abort: None,
            };
            return self.at_the_checkpoint(writer, document, sent, failed.error, failed.batch, totals, deadline).await;
        }
        let Some(sent) = pipeline.window.take_first_open(failed.sequence) else {
            // Not reached: every batch before it was acknowledged and committed above.
            return Err(TickError::Delivery { error: failed.error, rows_committed: totals.rows });
        };
        self.at_the_checkpoint(writer, document, sent, failed.error, failed.batch, totals, deadline).await
    }

    /// The batch at the checkpoint failed: its failure is counted in the document (seed 001 case
    /// I) and, when it is poison (refused for good, or failing for `poison.maxAttempts` ticks), it
    /// is isolated. Otherwise the lease is released with the failure recorded and the next tick
    /// retries the same batch: so too when the endpoint refused it (issue 36), however long that
    /// lasts, since every row would be refused alike and none is to blame.
    #[allow(clippy::too_many_arguments)]
    async fn at_the_checkpoint(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        sent: Sent,
        error: SinkError,
        batch: Prepared,
        totals: Totals,
        deadline: DateTime<Utc>,
    ) -> Result<TickOutcome, TickError> {
        let kind = self.failure_kind(&error);
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
        if let Verdict::Hold(status) = verdict {
            let attempts = record.attempts;
            let meaning = endpoint::meaning(self.receiver(), status);
            warn!(poller = %self.config.poller_name, attempts, status, "the endpoint refuses the batch at the checkpoint ({meaning}); holding, nothing quarantined");
            self.write_failure(writer, document, poison::held_for_endpoint(record, status)).await;
            return Err(TickError::EndpointRefused { status, meaning, error, attempts });
        }
        let nowhere_to_keep = poison_config.mode == PoisonMode::Quarantine && self.quarantine.is_none();
        if verdict == Verdict::Retry || nowhere_to_keep {
            warn!(poller = %self.config.poller_name, attempts = record.attempts, "batch at the checkpoint failed; the next tick retries it");
            self.write_failure(writer, document, record).await;
            return Err(TickError::Delivery { error, rows_committed: totals.rows });
        }
        if kind == FailureKind::Permanent
            && poison_config.mode == PoisonMode::Quarantine
            && self.quarantine_room(document) == 0
        {
            // Past the quarantine budget: held as for an endpoint refusal, one request a tick
            // (an isolation could only end at a row refused alone, and keep it no more).
            let (attempts, per_hour) = (record.attempts, poison_config.max_quarantined_per_hour);
            warn!(poller = %self.config.poller_name, attempts, per_hour, "the quarantine budget is spent; holding at the checkpoint, nothing quarantined");
            self.write_failure(writer, document, poison::held_for_budget(record)).await;
            return Err(TickError::QuarantineBudgetSpent { per_hour, error, attempts });
        }
        warn!(poller = %self.config.poller_name, attempts = record.attempts, batch = %sent.batch_id, "isolating a poison batch");
        let plan = IsolationPlan::after_batch_failed(batch.batch.events.len(), kind, poison_config.mode);
        let isolation = Isolation { batch, record, plan, last_error: Some(error) };
        self.isolate(writer, document, isolation, totals, deadline).await
    }
}

impl Poller {
    /// How many more rows the quarantine budget lets this poller quarantine now.
    pub(super) fn quarantine_room(&self, document: &StateDocument) -> usize {
        let answered = crate::domain::state::quarantine_answered_at(&document.history);
        let per_hour = self.config.poison.max_quarantined_per_hour;
        quarantine_budget::room(document.quarantine_log.as_ref(), answered, self.clock.now(), per_hour)
    }

    /// What kind of receiver the sink is, for [`endpoint::blame`].
    pub(super) fn receiver(&self) -> Receiver {
        match self.config.sink {
            SinkConfig::Webhook(_) => Receiver::Webhook,
            SinkConfig::Queue(_) => Receiver::StorageQueue,
        }
    }

    /// How a delivery failed, as poison handling sees it: a refusal for good is about the endpoint
    /// or about the rows, as [`endpoint::blame`]'s table says.
    pub(super) fn failure_kind(&self, error: &SinkError) -> FailureKind {
        match error {
            SinkError::Rejected { status, .. } => match endpoint::blame(self.receiver(), *status) {
                Blame::Endpoint => FailureKind::Endpoint(*status),
                Blame::Rows => FailureKind::Permanent,
            },
            SinkError::Transient { .. } => FailureKind::Transient,
        }
    }
}
