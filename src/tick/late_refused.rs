//! A late batch the receiver refuses (issue 35, finding 6): the same refusal handling as any
//! batch, without moving the checkpoint (the late rows are behind it already).
//!
//! | the receiver says                         | done                                                      |
//! |-------------------------------------------|-----------------------------------------------------------|
//! | a transient failure (5xx, timeout, …)     | the tick fails ([`TickError::LateDelivery`])              |
//! | a refusal about the endpoint (401, 404, …)| held, nothing quarantined ([`TickError::LateEndpointRefused`]) |
//! | a refusal about the rows (422, …)         | isolated: split down to single rows ([`IsolationPlan`])   |
//! | … a row refused alone, `mode: quarantine` | quarantined (under a lease just renewed), the rest delivered |
//! | … a row refused alone, `mode: stop`       | held, nothing quarantined ([`TickError::LatePoisonStop`]) |
//! | … past `poison.maxQuarantinedPerHour`     | held, nothing more quarantined ([`TickError::LateQuarantineBudgetSpent`]) |
//!
//! Whenever the tick fails here, [`Poller::deliver_late`] marks the bucket undelivered: it stays in
//! the window whatever commits come after, every tick checks it again, and the failure recorded
//! stays until it is delivered (`transitions::release_after_success`, `clear_failures`). The
//! isolation is of one late batch within one tick (no poison record: the checkpoint is not at
//! it); a tick that stops midway starts the bucket again at the next one (at least once).

use std::collections::BTreeMap;

use serde_json::Value;
use tracing::warn;

use crate::domain::StateDocument;
use crate::domain::endpoint;
use crate::domain::poison::{FailureKind, Halt, IsolationPlan, Next, PartOutcome, PoisonMode};
use crate::domain::state::describe;
use crate::sink::SinkError;
use crate::source::SourceRow;
use crate::store::StateWriter;
use crate::store::quarantine::{self, QuarantineEntry};

use super::Poller;
use super::outcome::TickError;
use super::reader::{BatchMaker, Prepared};

/// The errors of the rows `plan` refused alone, one each, for the quarantine budget's log.
fn late_refusals(plan: &IsolationPlan, row_errors: &BTreeMap<usize, SinkError>, last_error: &SinkError) -> Vec<String> {
    plan.refused().iter().map(|row| row_errors.get(row).unwrap_or(last_error).to_string()).collect()
}

impl Poller {
    /// `rows`, sent as the late batch `prepared`, came back with `error`: handled as the table
    /// above says. `Ok(true)`: every row is delivered or quarantined; `Ok(false)`: the lease could
    /// not be kept (stop, nothing more written). An isolation that stops (the budget spent, a
    /// transient failure) quarantines the rows refused alone so far and says in `settled` how many
    /// of the first rows are settled, so that the next tick goes on after them (an isolation
    /// longer than a tick budget still ends).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn late_refused(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        rows: Vec<SourceRow>,
        prepared: Prepared,
        error: SinkError,
        maker: &BatchMaker,
        deadline: chrono::DateTime<chrono::Utc>,
        settled: &mut usize,
    ) -> Result<bool, TickError> {
        let first = prepared.positions.first().map(describe).unwrap_or_default();
        let mode = self.config.poison.mode;
        let kind = self.failure_kind(&error);
        match kind {
            FailureKind::Transient => return Err(TickError::LateDelivery { error, first }),
            FailureKind::Endpoint(status) => return Err(self.late_endpoint_refused(status, error, first)),
            FailureKind::Permanent if mode == PoisonMode::Quarantine && self.quarantine.is_none() => {
                return Err(TickError::LateDelivery { error, first });
            }
            FailureKind::Permanent => {}
        }
        warn!(poller = %self.config.poller_name, rows = rows.len(), batch = %prepared.batch.batch_id, "isolating a refused late batch");
        let mut plan = IsolationPlan::after_batch_failed(rows.len(), kind, mode);
        if mode == PoisonMode::Quarantine {
            plan.limit_quarantine(self.quarantine_room(document));
        }
        let mut row_errors: BTreeMap<usize, SinkError> = BTreeMap::new();
        if rows.len() == 1 {
            row_errors.insert(0, error.clone());
        }
        let mut last_error = error;
        // Bounded: each part tried is settled, split in two, or halts; n rows take at most 2n - 1.
        for _ in 0..2 * rows.len() {
            let part = match plan.next() {
                Next::Try(part) => part,
                Next::Done => break,
                Next::Halt(Halt::Transient) => {
                    self.settle_late(writer, document, &prepared, &plan, &row_errors, &last_error, settled).await?;
                    return Err(TickError::LateDelivery { error: last_error, first });
                }
                Next::Halt(Halt::Endpoint(status)) => {
                    return Err(self.late_endpoint_refused(status, last_error, first));
                }
                Next::Halt(Halt::BudgetSpent(row)) => {
                    self.settle_late(writer, document, &prepared, &plan, &row_errors, &last_error, settled).await?;
                    let error = row_errors.remove(&row).unwrap_or(last_error);
                    let per_hour = self.config.poison.max_quarantined_per_hour;
                    warn!(poller = %self.config.poller_name, per_hour, "the quarantine budget is spent: a late row refused alone is held");
                    return Err(TickError::LateQuarantineBudgetSpent { per_hour, error, first });
                }
                Next::Halt(Halt::RefusedAlone(row)) => {
                    let pk = Value::Object(prepared.batch.events[row].pk()).to_string();
                    let error = row_errors.remove(&row).unwrap_or(last_error);
                    warn!(poller = %self.config.poller_name, pk = %pk, "poison.mode is stop: a late row fails alone; held");
                    return Err(TickError::LatePoisonStop { pk, error });
                }
            };
            if self.clock.now() >= deadline {
                self.settle_late(writer, document, &prepared, &plan, &row_errors, &last_error, settled).await?;
                return Err(TickError::LateDelivery { error: last_error, first });
            }
            let part_rows = rows[part.start..part.end].to_vec();
            let Some((_, sent)) = self.try_late(writer, document, part_rows, maker, deadline).await? else {
                return Ok(false);
            };
            match sent {
                Ok(()) => plan.record(PartOutcome::Delivered),
                // A failure once the budget is spent says nothing about the rows.
                Err(error) if self.clock.now() >= deadline => {
                    self.settle_late(writer, document, &prepared, &plan, &row_errors, &error, settled).await?;
                    return Err(TickError::LateDelivery { error, first });
                }
                Err(error) => {
                    let kind = self.failure_kind(&error);
                    if part.len() == 1 && kind == FailureKind::Permanent {
                        row_errors.insert(part.start, error.clone());
                    }
                    plan.record(PartOutcome::Failed(kind));
                    last_error = error;
                }
            }
        }
        if plan.next() != Next::Done {
            // Not reached (the plan settles within the bound); the bucket is tried again.
            return Err(TickError::LateDelivery { error: last_error, first });
        }
        if plan.refused().is_empty() {
            return Ok(true);
        }
        let refusals = late_refusals(&plan, &row_errors, &last_error);
        if !self.renew_before_quarantining(writer, document, &refusals).await? {
            return Ok(false);
        }
        for row in plan.refused() {
            let error = row_errors.get(row).unwrap_or(&last_error);
            self.quarantine_late(&prepared, *row, error).await?;
        }
        Ok(true)
    }

    /// The isolation stopped midway: the rows refused alone so far are quarantined (under a lease
    /// just renewed), and `settled` says how many first rows are settled (none when the lease
    /// could not be renewed: they are tried again).
    #[allow(clippy::too_many_arguments)]
    async fn settle_late(
        &self,
        writer: &mut StateWriter<'_>,
        document: &mut StateDocument,
        prepared: &Prepared,
        plan: &IsolationPlan,
        row_errors: &BTreeMap<usize, SinkError>,
        last_error: &SinkError,
        settled: &mut usize,
    ) -> Result<(), TickError> {
        if !plan.refused().is_empty() {
            let refusals = late_refusals(plan, row_errors, last_error);
            if !self.renew_before_quarantining(writer, document, &refusals).await? {
                return Ok(());
            }
            for row in plan.refused() {
                self.quarantine_late(prepared, *row, row_errors.get(row).unwrap_or(last_error)).await?;
            }
        }
        *settled = plan.settled();
        Ok(())
    }

    fn late_endpoint_refused(&self, status: u16, error: SinkError, first: String) -> TickError {
        let meaning = endpoint::meaning(self.receiver(), status);
        warn!(poller = %self.config.poller_name, status, "the endpoint refuses a late batch ({meaning}); held, nothing quarantined");
        TickError::LateEndpointRefused { status, meaning, error, first }
    }

    /// Keeps late row `row` of `prepared` in the quarantine (its id comes from its event id).
    async fn quarantine_late(&self, prepared: &Prepared, row: usize, error: &SinkError) -> Result<(), TickError> {
        let Some(blobs) = &self.quarantine else {
            return Ok(());
        };
        let event = &prepared.batch.events[row];
        let now = self.clock.now();
        let entry = QuarantineEntry {
            id: quarantine::entry_id(event.event_id()),
            poller: self.config.poller_name.clone(),
            event: event.to_value(),
            error: error.to_string(),
            status: match error {
                SinkError::Rejected { status, .. } => Some(*status),
                SinkError::Transient { .. } => None,
            },
            attempts: 1,
            batch_id: prepared.batch.batch_id.clone(),
            fencing_token: prepared.batch.fencing_token,
            source_fingerprint: self.config.fingerprint.clone(),
            first_failure_at: now,
            last_failure_at: now,
            quarantined_at: now,
        };
        quarantine::put(blobs.as_ref(), &self.config.app_name, &entry).await?;
        let pk = Value::Object(event.pk()).to_string();
        warn!(poller = %self.config.poller_name, entry = %entry.id, pk = %pk, error = %entry.error, "late row quarantined");
        Ok(())
    }
}
