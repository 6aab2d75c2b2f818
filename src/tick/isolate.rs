//! Isolating a poison batch: delivering its rows in the parts [`IsolationPlan`] gives, in row
//! order, while holding the lease, and committing the rows settled as they grow.
//!
//! - The lease is held like delivery holds it: a part that outlasts the heartbeat interval renews
//!   it while it runs (by committing what was settled, or a plain heartbeat), the isolation stops
//!   once it may no longer act as the holder, and a lost lease aborts the part in flight.
//! - A quarantine entry is written only under a lease just renewed by compare-and-swap and still
//!   good by the clock right before the write, then the checkpoint moves past it: a stale tick
//!   never keeps a row aside that a newer owner delivered.
//! - What is settled (delivered or quarantined) is committed at each heartbeat, and when the
//!   isolation ends or stops; a stop keeps the parts still to try in the poison record, so the next
//!   tick goes straight on with them.
//! - A part the endpoint refuses (a status about the endpoint, not the rows: `domain::endpoint`)
//!   stops the isolation like a transient failure: no row of it is quarantined (issue 36).

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use opentelemetry::context::FutureExt as _;
use serde_json::Value;
use tracing::warn;

use crate::domain::StateDocument;
use crate::domain::ids::batch_id;
use crate::domain::lease;
use crate::domain::poison::{
    self, FailureKind, Halt, IsolationPlan, Next, Part, PartOutcome, PoisonMode, PoisonRecord,
};
use crate::domain::quarantine_budget;
use crate::domain::transitions::{self, Delivered};
use crate::sink::{Batch, SinkError};
use crate::store::quarantine::{self, QuarantineEntry};
use crate::store::{StateWriter, WriteFailure};

use super::Poller;
use super::ledger::{HEARTBEAT_RETRY_DELAY, HeartbeatFailure};
use super::outcome::{StopReason, TickError, TickOutcome, Totals};
use super::panic_message;
use super::reader::Prepared;
use super::timer::{Timer, runtime_deadline};

/// A poison batch under isolation.
pub(super) struct Isolation {
    /// The rows under isolation: the batch that failed at the checkpoint, or what the previous
    /// tick left of it.
    pub(super) batch: Prepared,
    /// Its poison record, this tick's attempt counted.
    pub(super) record: PoisonRecord,
    pub(super) plan: IsolationPlan,
    /// The last failure seen: the batch's, then each failed part's.
    pub(super) last_error: Option<SinkError>,
}

/// What this tick has committed of the isolation.
#[derive(Default)]
struct Committed {
    /// Rows `0..rows` of the isolation are past the checkpoint.
    rows: usize,
    delivered: usize,
    /// Rows refused alone whose quarantine entries are written.
    entries: usize,
}

/// How the settled rows are committed.
enum Settle {
    /// The isolation goes on: the lease is renewed, the record kept with the parts still to try.
    Progress,
    /// It stopped for this tick (why, in words; the status, when the endpoint refused): the lease
    /// is released, the record kept.
    Stopped { why: String, endpoint_refused: Option<u16>, budget_spent: bool },
    /// It ended: the lease is released, the record cleared.
    Finished,
}

/// How renewing the lease went.
enum Kept {
    Renewed,
    /// A write failed in a way worth retrying soon; the lease is ours until it expires.
    RetrySoon,
    Lost,
}

/// How one part came back.
enum Delivery {
    Delivered,
    Failed(SinkError),
    /// The tick budget ran out, before or during the attempt: nothing is learnt of its rows.
    OutOfTime,
    LeaseLost,
}

impl Poller {
    /// Isolates `isolation`'s rows until every one is settled, the isolation halts (a transient
    /// failure; in stop mode a row refused alone), the budget runs out or the lease is lost.
    pub(super) async fn isolate(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        mut isolation: Isolation,
        mut totals: Totals,
        deadline: DateTime<Utc>,
    ) -> Result<TickOutcome, TickError> {
        let mut committed = Committed::default();
        if self.config.poison.mode == PoisonMode::Quarantine {
            isolation.plan.limit_quarantine(self.quarantine_room(document));
        }
        // The errors of the rows refused alone, for their quarantine entries.
        let mut row_errors: BTreeMap<usize, SinkError> = BTreeMap::new();
        let mut heartbeat_retry_at: Option<DateTime<Utc>> = None;
        let mut timer = Timer::new();
        loop {
            let part = match isolation.plan.next() {
                Next::Try(part) => part,
                Next::Done => {
                    let settle = Settle::Finished;
                    if !self
                        .settle(writer, document, &isolation, &row_errors, &mut committed, &mut totals, settle)
                        .await?
                    {
                        return totals.lease_lost("a commit found the state document taken over");
                    }
                    return Ok(totals.delivered(StopReason::Isolated));
                }
                Next::Halt(halt) => {
                    return self.halt(writer, document, &isolation, &row_errors, &mut committed, totals, halt).await;
                }
            };
            if self.clock.now() >= deadline {
                return self.out_of_time(writer, document, &isolation, &row_errors, &mut committed, totals).await;
            }
            let current = document.lease.clone().expect("the lease is held while isolating");
            let now = self.clock.now();
            if !lease::holder_may_act(&current, &self.owner_id, now, &self.config.lease) {
                warn!(poller = %self.config.poller_name, "the lease is about to expire while isolating; stopping");
                writer.lost = true;
                return totals.lease_lost("the lease came within the clock-skew margin of expiry while isolating");
            }
            let due = heartbeat_retry_at.or(lease::next_heartbeat_due(&current, &self.config.lease)).unwrap_or(now);
            if now >= due {
                match self.keep_lease(writer, document, &isolation, &row_errors, &mut committed, &mut totals).await? {
                    Kept::Renewed => heartbeat_retry_at = None,
                    Kept::RetrySoon => heartbeat_retry_at = Some(now + HEARTBEAT_RETRY_DELAY),
                    Kept::Lost => return totals.lease_lost("a heartbeat found the state document taken over"),
                }
                continue;
            }

            let delivery = self
                .deliver_part(
                    writer,
                    document,
                    &isolation,
                    part,
                    deadline,
                    &mut timer,
                    &mut heartbeat_retry_at,
                    &row_errors,
                    &mut committed,
                    &mut totals,
                )
                .await?;
            match delivery {
                Delivery::Delivered => isolation.plan.record(PartOutcome::Delivered),
                Delivery::Failed(error) => {
                    let kind = self.failure_kind(&error);
                    if part.len() == 1 && kind == FailureKind::Permanent {
                        row_errors.insert(part.start, error.clone());
                    }
                    isolation.plan.record(PartOutcome::Failed(kind));
                    isolation.last_error = Some(error);
                }
                Delivery::OutOfTime => {
                    return self.out_of_time(writer, document, &isolation, &row_errors, &mut committed, totals).await;
                }
                Delivery::LeaseLost => return totals.lease_lost("a heartbeat found the state document taken over"),
            }
        }
    }

    /// Delivers one part, renewing the lease while it runs for longer than the heartbeat interval.
    #[allow(clippy::too_many_arguments)]
    async fn deliver_part(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        isolation: &Isolation,
        part: Part,
        deadline: DateTime<Utc>,
        timer: &mut Timer,
        heartbeat_retry_at: &mut Option<DateTime<Utc>>,
        row_errors: &BTreeMap<usize, SinkError>,
        committed: &mut Committed,
        totals: &mut Totals,
    ) -> Result<Delivery, TickError> {
        let batch = &isolation.batch.batch;
        let positions = &isolation.batch.positions;
        let rows = part.len();
        let part_batch = Batch {
            poller: batch.poller.clone(),
            late: batch.late,
            // The same rows give the same id, whichever tick sends them.
            batch_id: batch_id(
                &self.config.poller_name,
                &self.config.fingerprint,
                &positions[part.start],
                &positions[part.end - 1],
                rows,
            ),
            fencing_token: batch.fencing_token,
            generation: batch.generation.clone(),
            events: batch.events[part.start..part.end].to_vec(),
        };
        let sink = self.sink.clone();
        let sink_deadline = runtime_deadline(deadline, self.clock.now());
        // A task of its own, so that the part goes on while the lease is renewed; in a set, so
        // that a tick dropped at an await (a crash of the host's request, an abandoned tick) takes
        // the part with it instead of leaving it sending detached (issue 35).
        let mut delivery = tokio::task::JoinSet::new();
        delivery.spawn(
            async move {
                let delivered = AssertUnwindSafe(sink.deliver(&part_batch, sink_deadline)).catch_unwind().await;
                delivered.unwrap_or_else(|panic| {
                    Err(SinkError::Transient {
                        batch_id: part_batch.batch_id.clone(),
                        reason: format!("the delivery panicked: {}", panic_message(panic.as_ref())),
                    })
                })
            }
            // The tick's trace context (telemetry: the delivery's span is the tick's child).
            .with_current_context(),
        );
        let delivered = loop {
            let current = document.lease.clone().expect("the lease is held while isolating");
            let now = self.clock.now();
            if !lease::holder_may_act(&current, &self.owner_id, now, &self.config.lease) {
                delivery.abort_all();
                writer.lost = true;
                return Ok(Delivery::LeaseLost);
            }
            let due = heartbeat_retry_at.or(lease::next_heartbeat_due(&current, &self.config.lease)).unwrap_or(now);
            timer.set((due - now).to_std().unwrap_or(Duration::ZERO));
            tokio::select! {
                biased;
                joined = delivery.join_next() => break joined.expect("the part's task is in the set"),
                _ = timer.wait() => {
                    let kept = self.keep_lease(writer, document, isolation, row_errors, committed, totals).await;
                    match kept {
                        Ok(Kept::Renewed) => *heartbeat_retry_at = None,
                        Ok(Kept::RetrySoon) => *heartbeat_retry_at = Some(self.clock.now() + HEARTBEAT_RETRY_DELAY),
                        Ok(Kept::Lost) => {
                            delivery.abort_all();
                            return Ok(Delivery::LeaseLost);
                        }
                        Err(error) => {
                            delivery.abort_all();
                            return Err(error);
                        }
                    }
                }
            }
        };
        let delivered = match delivered {
            Ok(delivered) => delivered,
            Err(join_error) => std::panic::resume_unwind(join_error.into_panic()),
        };
        Ok(match delivered {
            Ok(()) => Delivery::Delivered,
            // A failure once the budget is spent says nothing about the rows.
            Err(_) if self.clock.now() >= deadline => Delivery::OutOfTime,
            Err(error) => Delivery::Failed(error),
        })
    }

    /// Renews the lease: by committing what was settled since the last commit, or by a heartbeat.
    async fn keep_lease(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        isolation: &Isolation,
        row_errors: &BTreeMap<usize, SinkError>,
        committed: &mut Committed,
        totals: &mut Totals,
    ) -> Result<Kept, TickError> {
        if isolation.plan.settled() > committed.rows {
            let settled = self.settle(writer, document, isolation, row_errors, committed, totals, Settle::Progress);
            return Ok(if settled.await? { Kept::Renewed } else { Kept::Lost });
        }
        Ok(match self.heartbeat(writer, document).await {
            Ok(true) => Kept::Renewed,
            Ok(false) => Kept::RetrySoon,
            Err(HeartbeatFailure::LeaseLost) => Kept::Lost,
            Err(HeartbeatFailure::Store(error)) => return Err(error.into()),
        })
    }

    /// Commits the rows settled since the last commit, writing first the quarantine entries of the
    /// rows refused alone among them. `false`: the lease was lost, nothing was written after.
    #[allow(clippy::too_many_arguments)]
    async fn settle(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        isolation: &Isolation,
        row_errors: &BTreeMap<usize, SinkError>,
        committed: &mut Committed,
        totals: &mut Totals,
        settle: Settle,
    ) -> Result<bool, TickError> {
        let plan = &isolation.plan;
        let positions = &isolation.batch.positions;
        let settled = plan.settled();
        let record = match &settle {
            Settle::Finished => None,
            Settle::Progress => Some(poison::in_progress(&isolation.record, &positions[settled], plan)),
            Settle::Stopped { why, endpoint_refused, budget_spent } => {
                let kept = poison::in_progress(&isolation.record, &positions[settled], plan);
                let stopped = poison::stopped(&kept, why, *endpoint_refused, self.clock.now());
                Some(if *budget_spent { poison::held_for_budget(stopped) } else { stopped })
            }
        };
        let release = !matches!(settle, Settle::Progress);
        if settled == committed.rows {
            // Nothing new to commit: a stop records itself and gives the lease back.
            if let Some(record) = record
                && release
            {
                self.write_failure(writer, document, record).await;
            }
            return Ok(!writer.lost);
        }

        let refused = plan.refused();
        if refused.len() > committed.entries {
            let refusals: Vec<String> = refused[committed.entries..]
                .iter()
                .map(|row| {
                    row_errors.get(row).or(isolation.last_error.as_ref()).map(ToString::to_string).unwrap_or_default()
                })
                .collect();
            if !self.renew_before_quarantining(writer, document, &refusals).await? {
                return Ok(false);
            }
            for row in &refused[committed.entries..] {
                let error = row_errors.get(row).or(isolation.last_error.as_ref());
                self.quarantine_row(isolation, *row, error).await?;
            }
            committed.entries = refused.len();
        }

        let delivered_rows = plan.delivered() - committed.delivered;
        let quarantined_rows = (settled - committed.rows) - delivered_rows;
        let batches = usize::from(matches!(settle, Settle::Finished));
        let delivered = Delivered {
            last: &positions[settled - 1],
            last_batch_id: &isolation.record.batch_id,
            rows: delivered_rows,
            batches,
            quarantined: quarantined_rows,
        };
        let keys = self.late_keys(&positions[committed.rows..settled]);
        if !self.commit(writer, document, &delivered, &[&keys], release, record.as_ref()).await? {
            return Ok(false);
        }
        totals.add(delivered_rows, quarantined_rows, batches, &positions[settled - 1]);
        committed.rows = settled;
        committed.delivered = plan.delivered();
        Ok(true)
    }

    /// The lease, renewed by compare-and-swap right before quarantine entries are written, and
    /// still good by the clock: `false` when it is not ours any more. The same write records the
    /// rows about to be quarantined (`refusals`, one error each) in the quarantine budget's log,
    /// before any entry exists: a crash after it leaves the budget counting rows not kept, never
    /// rows kept uncounted.
    pub(super) async fn renew_before_quarantining(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        refusals: &[String],
    ) -> Result<bool, TickError> {
        let now = self.clock.now();
        let Ok(mut renewed) = transitions::heartbeat(document, &self.owner_id, now, &self.config.lease) else {
            writer.lost = true;
            return Ok(false);
        };
        let answered = crate::domain::state::quarantine_answered_at(&renewed.history);
        renewed.quarantine_log =
            Some(quarantine_budget::recorded(renewed.quarantine_log.as_ref(), answered, now, refusals));
        match writer.write(&mut renewed).await {
            Ok(()) => *document = renewed,
            Err(WriteFailure::Conflict(_)) => return Ok(false),
            Err(WriteFailure::Store(error)) => return Err(error.into()),
        }
        let lease = document.lease.as_ref().expect("just renewed");
        Ok(lease::holder_may_act(lease, &self.owner_id, self.clock.now(), &self.config.lease))
    }

    /// Keeps row `row` in the quarantine (again, if it is there: its id comes from its event id).
    async fn quarantine_row(
        &self,
        isolation: &Isolation,
        row: usize,
        error: Option<&SinkError>,
    ) -> Result<(), TickError> {
        let Some(blobs) = &self.quarantine else {
            // Not reached: an isolation in quarantine mode starts only with a quarantine store.
            return Err(TickError::Store(crate::store::StoreError::Unavailable {
                location: "quarantine".into(),
                reason: "no quarantine store is configured".into(),
                retryable: false,
            }));
        };
        let event = &isolation.batch.batch.events[row];
        let record = &isolation.record;
        let entry = QuarantineEntry {
            id: quarantine::entry_id(event.event_id()),
            poller: self.config.poller_name.clone(),
            event: event.to_value(),
            error: error.map(ToString::to_string).unwrap_or_default(),
            status: match error {
                Some(SinkError::Rejected { status, .. }) => Some(*status),
                _ => None,
            },
            attempts: record.attempts,
            batch_id: record.batch_id.clone(),
            fencing_token: isolation.batch.batch.fencing_token,
            source_fingerprint: self.config.fingerprint.clone(),
            first_failure_at: record.first_failure_at,
            last_failure_at: record.last_failure_at,
            quarantined_at: self.clock.now(),
        };
        quarantine::put(blobs.as_ref(), &self.config.app_name, &entry).await?;
        let pk = Value::Object(event.pk()).to_string();
        warn!(poller = %self.config.poller_name, entry = %entry.id, pk = %pk, error = %entry.error, "row quarantined");
        Ok(())
    }

    /// The isolation halted for this tick: what was settled is committed, the record keeps the
    /// parts still to try, and the tick fails saying why.
    #[allow(clippy::too_many_arguments)]
    async fn halt(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        isolation: &Isolation,
        row_errors: &BTreeMap<usize, SinkError>,
        committed: &mut Committed,
        mut totals: Totals,
        halt: Halt,
    ) -> Result<TickOutcome, TickError> {
        let settled = isolation.plan.settled();
        let attempts = isolation.record.attempts;
        let mut endpoint_refused = None;
        let mut budget_spent = false;
        let (why, error) = match halt {
            Halt::Transient => {
                let error = isolation.last_error.clone().unwrap_or_else(|| SinkError::Transient {
                    batch_id: isolation.record.batch_id.clone(),
                    reason: "a transient failure".into(),
                });
                let why = format!("{error}; the sink looks down or flaky, the isolation goes on next tick");
                (why, TickError::SinkDown { error, attempts, settled })
            }
            Halt::RefusedAlone(row) => {
                let error = row_errors.get(&row).or(isolation.last_error.as_ref()).cloned().unwrap_or_else(|| {
                    SinkError::Transient { batch_id: isolation.record.batch_id.clone(), reason: "refused".into() }
                });
                let pk = Value::Object(isolation.batch.batch.events[row].pk()).to_string();
                let why = format!("poison.mode is stop: the row with primary key {pk} fails alone: {error}");
                (why, TickError::PoisonStop { pk, error })
            }
            Halt::Endpoint(status) => {
                endpoint_refused = Some(status);
                let error = isolation.last_error.clone().unwrap_or_else(|| SinkError::Rejected {
                    batch_id: isolation.record.batch_id.clone(),
                    status,
                    body: String::new(),
                });
                let meaning = crate::domain::endpoint::meaning(self.receiver(), status);
                let why = format!(
                    "{error}; the receiver refuses every row alike (HTTP {status}: {meaning}): the endpoint, not the rows; held, nothing quarantined"
                );
                (why, TickError::EndpointRefused { status, meaning, error, attempts })
            }
            Halt::BudgetSpent(row) => {
                budget_spent = true;
                let error = row_errors.get(&row).or(isolation.last_error.as_ref()).cloned().unwrap_or_else(|| {
                    SinkError::Transient { batch_id: isolation.record.batch_id.clone(), reason: "refused".into() }
                });
                let per_hour = self.config.poison.max_quarantined_per_hour;
                let error = TickError::QuarantineBudgetSpent { per_hour, error, attempts };
                (error.to_string(), error)
            }
        };
        warn!(poller = %self.config.poller_name, settled, attempts, "isolation stopped: {why}");
        let settle = Settle::Stopped { why, endpoint_refused, budget_spent };
        if !self.settle(writer, document, isolation, row_errors, committed, &mut totals, settle).await? {
            return totals.lease_lost("a commit found the state document taken over");
        }
        Err(error)
    }

    /// The budget ran out: what was settled is committed, and the next tick goes on.
    async fn out_of_time(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        isolation: &Isolation,
        row_errors: &BTreeMap<usize, SinkError>,
        committed: &mut Committed,
        mut totals: Totals,
    ) -> Result<TickOutcome, TickError> {
        let error = TickError::IsolationUnfinished {
            settled: isolation.plan.settled(),
            rows: isolation.plan.rows(),
            attempts: isolation.record.attempts,
        };
        warn!(poller = %self.config.poller_name, "{error}");
        let settle = Settle::Stopped { why: error.to_string(), endpoint_refused: None, budget_spent: false };
        if !self.settle(writer, document, isolation, row_errors, committed, &mut totals, settle).await? {
            return totals.lease_lost("a commit found the state document taken over");
        }
        Err(error)
    }
}
