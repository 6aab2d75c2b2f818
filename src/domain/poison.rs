//! Poison batches (seed 001 case I): a batch the sink keeps refusing must neither stop the feed
//! forever nor be dropped in silence. The state document counts the failed attempts of the batch at
//! the checkpoint; a permanent refusal, or `poison.maxAttempts` failed ticks, isolates it: its rows
//! are delivered again in parts, in row order (depth first, left to right), a part that fails split
//! in halves down to single rows. A row the sink refuses for good alone is quarantined (kept, with its
//! error) or, with `poison.mode: stop`, held at. A transient failure never sends a row to the
//! quarantine: a row failing transiently alone, or two parts in a row failing transiently, stop the
//! isolation for this tick (the sink looks down or flaky). Nor does a refusal about the endpoint
//! rather than the rows ([`super::endpoint`]: a 401, a gateway's 404, a redirect, a queue SAS without
//! add rights): it is never isolated, and it stops an isolation under way; the poller holds at its
//! checkpoint until the endpoint answers again (issue 36). The rows settled so far (delivered or
//! quarantined) form a prefix of the batch that the tick commits as it grows, and the parts still to
//! try are kept in the record, so an isolation that outlasts one tick goes on where it stopped.
//! These are the pure decisions; the tick carries them out.

use std::collections::VecDeque;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::cursor::{CursorJson, Position};

/// The failures of the batch at the checkpoint, in the state document's `poison`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoisonRecord {
    pub batch_id: String,
    /// The first row after the checkpoint (the batch's first, until an isolation commits part of
    /// it) and the batch's last row.
    pub first: CursorJson,
    pub last: CursorJson,
    /// Failed ticks on this batch (an isolation that did not finish in its tick is one).
    pub attempts: u32,
    pub first_error: String,
    pub last_error: String,
    pub first_failure_at: DateTime<Utc>,
    pub last_failure_at: DateTime<Utc>,
    /// An isolation under way: what the next tick needs to go straight on with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolating: Option<Isolating>,
    /// The last failure was a refusal about the endpoint, with this HTTP status: the poller holds
    /// at its checkpoint, nothing is quarantined (`status` and the watchdog say `endpoint_refused`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_refused: Option<u16>,
    /// The last failure was a row refused alone past the quarantine budget
    /// ([`super::quarantine_budget`]): the poller holds at its checkpoint, nothing more is
    /// quarantined (`status` and the watchdog say `quarantine_budget_spent`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub quarantine_budget_spent: bool,
}

/// Where an unfinished isolation stands: the parts still to try, as row counts from the
/// checkpoint, in row order; they add up to the rows from `first` to `last`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Isolating {
    pub parts: Vec<usize>,
}

/// How a delivery failed, as far as poison handling cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The receiver refused for good (a 4xx other than 408/429, a row too large): retrying the
    /// same rows will not help.
    Permanent,
    /// A timeout, a refused connection, 408, 429, 5xx: it may pass.
    Transient,
    /// Refused for good with this HTTP status, for a reason about the endpoint, not the rows
    /// ([`super::endpoint::blame`]): every row would get the same answer.
    Endpoint(u16),
}

/// What to do with poison, from `poison.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoisonMode {
    /// Quarantine the rows that fail alone, deliver the rest, move on.
    Quarantine,
    /// Never skip a row: deliver up to the first row that fails alone, then hold there.
    Stop,
}

/// What a failed delivery of the batch at the checkpoint leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Keep the checkpoint; the next tick tries the same batch again.
    Retry,
    /// Split the batch to find the rows that fail alone.
    Isolate,
    /// The endpoint refuses (with this status): keep the checkpoint, isolate nothing, quarantine
    /// nothing; the next tick tries the same batch again.
    Hold(u16),
}

/// The record after one more failed tick on the batch from `first` to `last`: the attempts of the
/// same batch (same first row) go on counting, another batch starts again at one.
pub fn record_failure(
    previous: Option<&PoisonRecord>,
    batch_id: &str,
    first: &Position,
    last: &Position,
    error: &str,
    now: DateTime<Utc>,
) -> PoisonRecord {
    let first_json = CursorJson::from(first);
    match previous {
        Some(previous) if previous.first == first_json => PoisonRecord {
            batch_id: batch_id.to_string(),
            first: first_json,
            last: CursorJson::from(last),
            attempts: previous.attempts.saturating_add(1),
            first_error: previous.first_error.clone(),
            last_error: error.to_string(),
            first_failure_at: previous.first_failure_at,
            last_failure_at: now,
            isolating: None,
            endpoint_refused: None,
            quarantine_budget_spent: false,
        },
        _ => PoisonRecord {
            batch_id: batch_id.to_string(),
            first: first_json,
            last: CursorJson::from(last),
            attempts: 1,
            first_error: error.to_string(),
            last_error: error.to_string(),
            first_failure_at: now,
            last_failure_at: now,
            isolating: None,
            endpoint_refused: None,
            quarantine_budget_spent: false,
        },
    }
}

/// Isolate at once on a permanent refusal; after `max_attempts` failed ticks on a transient one;
/// never on a refusal about the endpoint, however many ticks it lasts.
pub fn verdict(kind: FailureKind, attempts: u32, max_attempts: u32) -> Verdict {
    match kind {
        FailureKind::Endpoint(status) => Verdict::Hold(status),
        FailureKind::Permanent => Verdict::Isolate,
        FailureKind::Transient if attempts >= max_attempts => Verdict::Isolate,
        FailureKind::Transient => Verdict::Retry,
    }
}

/// The plan of the isolation the previous tick left unfinished, when the rows after the checkpoint
/// (`positions`, in order) are still the ones it was isolating: the first is the record's `first`,
/// and the row its parts add up to is its `last`. Otherwise `None` (rows came or went in the range):
/// the rows are delivered as usual, and a failure starts a new isolation.
pub fn resume(record: &PoisonRecord, positions: &[Position], mode: PoisonMode) -> Option<IsolationPlan> {
    let isolating = record.isolating.as_ref()?;
    let rows: usize = isolating.parts.iter().sum();
    if rows == 0 || positions.len() < rows || isolating.parts.contains(&0) {
        return None;
    }
    if CursorJson::from(&positions[0]) != record.first || CursorJson::from(&positions[rows - 1]) != record.last {
        return None;
    }
    let mut pending = VecDeque::new();
    let mut start = 0;
    for size in &isolating.parts {
        pending.push_back(Part { start, end: start + size });
        start += size;
    }
    Some(IsolationPlan::with_parts(rows, pending, mode))
}

/// The record as a tick that goes on with an unfinished isolation counts it: one more attempt.
pub fn resumed(record: &PoisonRecord, now: DateTime<Utc>) -> PoisonRecord {
    PoisonRecord {
        attempts: record.attempts.saturating_add(1),
        last_failure_at: now,
        endpoint_refused: None,
        quarantine_budget_spent: false,
        ..record.clone()
    }
}

/// The record kept while an isolation is under way: the checkpoint is before `next_first`, and
/// `plan`'s parts are still to try.
pub fn in_progress(record: &PoisonRecord, next_first: &Position, plan: &IsolationPlan) -> PoisonRecord {
    PoisonRecord {
        first: CursorJson::from(next_first),
        isolating: Some(Isolating { parts: plan.remaining_parts() }),
        ..record.clone()
    }
}

/// The record after an isolation stopped for this tick, saying why (and, when the endpoint refused,
/// with which status).
pub fn stopped(record: &PoisonRecord, error: &str, endpoint_refused: Option<u16>, now: DateTime<Utc>) -> PoisonRecord {
    PoisonRecord {
        last_error: error.to_string(),
        last_failure_at: now,
        endpoint_refused,
        quarantine_budget_spent: false,
        ..record.clone()
    }
}

/// The record of a batch held because a row of it was refused alone past the quarantine budget.
pub fn held_for_budget(record: PoisonRecord) -> PoisonRecord {
    PoisonRecord { quarantine_budget_spent: true, endpoint_refused: None, ..record }
}

/// The record of a batch held because the endpoint refused it with `status`.
pub fn held_for_endpoint(record: PoisonRecord, status: u16) -> PoisonRecord {
    PoisonRecord { endpoint_refused: Some(status), ..record }
}

/// Rows `start..end` of the rows under isolation, delivered as one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub start: usize,
    pub end: usize,
}

impl Part {
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }

    fn halves(&self) -> (Part, Part) {
        let middle = self.start + self.len() / 2;
        (Part { start: self.start, end: middle }, Part { start: middle, end: self.end })
    }
}

/// How one part came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartOutcome {
    Delivered,
    Failed(FailureKind),
}

/// What the isolation does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Deliver this part.
    Try(Part),
    /// Every row is settled: delivered, or refused alone and quarantined.
    Done,
    /// Stop for this tick, the parts not tried kept for the next one.
    Halt(Halt),
}

/// Why an isolation stopped before the end of its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Halt {
    /// A row failed transiently alone, or two parts in a row did: the sink looks down or flaky,
    /// not the rows.
    Transient,
    /// `poison.mode: stop`: this row is refused for good alone; nothing after it is delivered.
    RefusedAlone(usize),
    /// The endpoint refused a part with this status ([`FailureKind::Endpoint`]): no smaller part
    /// would pass, and no row is to blame.
    Endpoint(u16),
    /// Quarantine mode: this row is refused for good alone and the quarantine budget has no room
    /// for it ([`IsolationPlan::limit_quarantine`]): held at, as in stop mode.
    BudgetSpent(usize),
}

/// The isolation of the rows of one batch, in row order: the next part to try is always the
/// leftmost one not settled, so the rows settled form a prefix that may be committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IsolationPlan {
    mode: PoisonMode,
    rows: usize,
    /// The parts not settled, in row order, covering `settled..rows`; the first is tried next.
    pending: VecDeque<Part>,
    /// Rows `0..settled` are delivered or refused alone.
    settled: usize,
    /// The rows refused for good alone (quarantine mode), in row order.
    refused: Vec<usize>,
    delivered: usize,
    /// Transient failures of parts since the last part that got through or was refused.
    transient_in_a_row: u32,
    halted: Option<Halt>,
    /// The most rows this isolation may refuse alone into the quarantine (the budget's room).
    room: usize,
}

impl IsolationPlan {
    /// The isolation of a batch of `rows` rows whose delivery as a whole just failed as `kind`.
    pub fn after_batch_failed(rows: usize, kind: FailureKind, mode: PoisonMode) -> IsolationPlan {
        let mut plan = IsolationPlan::with_parts(rows, VecDeque::from([Part { start: 0, end: rows }]), mode);
        if rows > 0 {
            plan.record(PartOutcome::Failed(kind));
        }
        plan
    }

    fn with_parts(rows: usize, pending: VecDeque<Part>, mode: PoisonMode) -> IsolationPlan {
        IsolationPlan {
            mode,
            rows,
            pending,
            settled: 0,
            refused: Vec::new(),
            delivered: 0,
            transient_in_a_row: 0,
            halted: None,
            room: usize::MAX,
        }
    }

    pub fn next(&self) -> Next {
        if let Some(halt) = self.halted {
            return Next::Halt(halt);
        }
        match self.pending.front() {
            Some(part) => Next::Try(*part),
            None => Next::Done,
        }
    }

    /// Records how the part [`Self::next`] gave came back.
    pub fn record(&mut self, outcome: PartOutcome) {
        let Some(part) = self.pending.front().copied() else {
            return;
        };
        if self.halted.is_some() {
            return;
        }
        match outcome {
            PartOutcome::Delivered => {
                self.pending.pop_front();
                self.settled = part.end;
                self.delivered += part.len();
                self.transient_in_a_row = 0;
            }
            PartOutcome::Failed(FailureKind::Permanent) if part.len() == 1 => {
                self.transient_in_a_row = 0;
                match self.mode {
                    PoisonMode::Quarantine if self.refused.len() >= self.room => {
                        self.halted = Some(Halt::BudgetSpent(part.start));
                    }
                    PoisonMode::Quarantine => {
                        self.pending.pop_front();
                        self.settled = part.end;
                        self.refused.push(part.start);
                    }
                    PoisonMode::Stop => self.halted = Some(Halt::RefusedAlone(part.start)),
                }
            }
            PartOutcome::Failed(FailureKind::Permanent) => {
                self.transient_in_a_row = 0;
                self.split_front();
            }
            // Whatever its size, and whatever was delivered before it: the endpoint refuses, so no
            // row of the part is settled and none is quarantined.
            PartOutcome::Failed(FailureKind::Endpoint(status)) => self.halted = Some(Halt::Endpoint(status)),
            PartOutcome::Failed(FailureKind::Transient) => {
                self.transient_in_a_row += 1;
                // One transient failure of several rows may be their size (a request too big for
                // the receiver): smaller parts may pass. One row alone, or twice in a row: no.
                if part.len() == 1 || self.transient_in_a_row >= 2 {
                    self.halted = Some(Halt::Transient);
                } else {
                    self.split_front();
                }
            }
        }
    }

    fn split_front(&mut self) {
        let Some(part) = self.pending.pop_front() else {
            return;
        };
        let (left, right) = part.halves();
        self.pending.push_front(right);
        self.pending.push_front(left);
    }

    /// At most `room` rows of this isolation go to the quarantine: the next one refused alone
    /// halts it ([`Halt::BudgetSpent`]).
    pub fn limit_quarantine(&mut self, room: usize) {
        self.room = room;
    }

    /// Rows in the isolation.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Rows `0..settled()` are delivered or refused alone: the prefix that may be committed.
    pub fn settled(&self) -> usize {
        self.settled
    }

    /// Rows delivered so far.
    pub fn delivered(&self) -> usize {
        self.delivered
    }

    /// The rows refused for good alone, in row order (all of them before `settled()`).
    pub fn refused(&self) -> &[usize] {
        &self.refused
    }

    /// The sizes of the parts not settled, in row order: what the record keeps for the next tick.
    pub fn remaining_parts(&self) -> Vec<usize> {
        self.pending.iter().map(Part::len).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::cursor::{CursorValue, PkValue};
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn position(cursor: i64, id: i64) -> Position {
        Position { cursor: CursorValue::Integer(cursor), pk: vec![("id".to_string(), PkValue::Integer(id))] }
    }

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_780_000_000 + seconds, 0).unwrap()
    }

    /// Rows `0..rows` at positions `(index, index)`.
    fn positions(rows: usize) -> Vec<Position> {
        (0..rows as i64).map(|index| position(index, index)).collect()
    }

    /// The receiver of these tests: a part is refused for good when it holds a bad row.
    fn answer(part: Part, bad: &BTreeSet<usize>, offset: usize) -> PartOutcome {
        if (part.start..part.end).any(|row| bad.contains(&(row + offset))) {
            PartOutcome::Failed(FailureKind::Permanent)
        } else {
            PartOutcome::Delivered
        }
    }

    /// Runs `plan` to its end against `answer`, at most `limit` tries; returns the tries made.
    fn run(plan: &mut IsolationPlan, bad: &BTreeSet<usize>, offset: usize, limit: usize) -> usize {
        let mut tries = 0;
        while let Next::Try(part) = plan.next() {
            if tries == limit {
                break;
            }
            let settled_before = plan.settled();
            plan.record(answer(part, bad, offset));
            tries += 1;
            assert!(plan.settled() >= settled_before, "the settled prefix only grows");
            assert_eq!(
                plan.remaining_parts().iter().sum::<usize>(),
                plan.rows() - plan.settled(),
                "parts cover the rest"
            );
            assert!(plan.refused().iter().all(|row| *row < plan.settled()));
        }
        tries
    }

    fn isolating(rows: usize, bad: &BTreeSet<usize>) -> IsolationPlan {
        let kind = if bad.is_empty() { FailureKind::Transient } else { FailureKind::Permanent };
        IsolationPlan::after_batch_failed(rows, kind, PoisonMode::Quarantine)
    }

    #[test]
    fn attempts_count_per_batch_at_the_checkpoint() {
        let first = record_failure(None, "bat_1", &position(1, 1), &position(5, 9), "HTTP 503", at(0));
        assert_eq!((first.attempts, first.first_error.as_str()), (1, "HTTP 503"));
        let second = record_failure(Some(&first), "bat_1", &position(1, 1), &position(5, 9), "timeout", at(60));
        assert_eq!(second.attempts, 2);
        assert_eq!((second.first_error.as_str(), second.last_error.as_str()), ("HTTP 503", "timeout"));
        assert_eq!((second.first_failure_at, second.last_failure_at), (at(0), at(60)));
        // The batch at the checkpoint is another one (the checkpoint moved): counting starts again.
        let other = record_failure(Some(&second), "bat_2", &position(6, 1), &position(9, 9), "HTTP 500", at(120));
        assert_eq!((other.attempts, other.first_failure_at), (1, at(120)));
    }

    #[test]
    fn verdict_truth_table() {
        for (kind, attempts, max, expected) in [
            (FailureKind::Permanent, 1, 5, Verdict::Isolate),
            (FailureKind::Transient, 1, 5, Verdict::Retry),
            (FailureKind::Transient, 4, 5, Verdict::Retry),
            (FailureKind::Transient, 5, 5, Verdict::Isolate),
            (FailureKind::Transient, 9, 5, Verdict::Isolate),
            (FailureKind::Transient, 1, 1, Verdict::Isolate),
            (FailureKind::Endpoint(401), 1, 5, Verdict::Hold(401)),
            (FailureKind::Endpoint(404), 5, 5, Verdict::Hold(404)),
            (FailureKind::Endpoint(308), 99, 1, Verdict::Hold(308)),
        ] {
            assert_eq!(verdict(kind, attempts, max), expected, "{kind:?} attempt {attempts} of {max}");
        }
    }

    /// Regression (issue 24, item 4): a single row failing transiently is never quarantined, and a
    /// whole batch failing transiently stops at its first half failing the same way.
    #[test]
    fn transient_failures_halt_the_isolation_and_quarantine_nothing() {
        let one_row = IsolationPlan::after_batch_failed(1, FailureKind::Transient, PoisonMode::Quarantine);
        assert_eq!(one_row.next(), Next::Halt(Halt::Transient));
        let mut outage = IsolationPlan::after_batch_failed(100, FailureKind::Transient, PoisonMode::Quarantine);
        assert_eq!(outage.next(), Next::Try(Part { start: 0, end: 50 }));
        outage.record(PartOutcome::Failed(FailureKind::Transient));
        assert_eq!(outage.next(), Next::Halt(Halt::Transient));
        assert_eq!(outage.remaining_parts(), vec![50, 50], "the split is kept: the next tick tries 50 rows");
        // An outage that begins after the first split: the rows that fail with 503 alone are held.
        let mut late = IsolationPlan::after_batch_failed(4, FailureKind::Permanent, PoisonMode::Quarantine);
        late.record(PartOutcome::Delivered);
        assert_eq!(late.next(), Next::Try(Part { start: 2, end: 4 }));
        late.record(PartOutcome::Failed(FailureKind::Transient));
        assert_eq!(late.next(), Next::Try(Part { start: 2, end: 3 }), "one transient failure: maybe too big");
        late.record(PartOutcome::Failed(FailureKind::Transient));
        assert_eq!(late.next(), Next::Halt(Halt::Transient));
        assert!(late.refused().is_empty());
        assert_eq!((late.settled(), late.delivered()), (2, 2));
    }

    /// Regression (issue 36, item 1): a refusal about the endpoint halts the isolation where it is,
    /// at the first part or after rows got through, and never settles or quarantines a row for it.
    #[test]
    fn an_endpoint_refusal_halts_the_isolation_and_quarantines_nothing() {
        for mode in [PoisonMode::Quarantine, PoisonMode::Stop] {
            let at_once = IsolationPlan::after_batch_failed(10, FailureKind::Endpoint(401), mode);
            assert_eq!(at_once.next(), Next::Halt(Halt::Endpoint(401)));
            assert_eq!((at_once.settled(), at_once.remaining_parts()), (0, vec![10]), "the batch is kept whole");
            // The token rotates while a poison row is being isolated: rows 0-4 got through, the
            // rest is held, not quarantined row by row.
            let mut mid_way = IsolationPlan::after_batch_failed(10, FailureKind::Permanent, mode);
            mid_way.record(PartOutcome::Delivered);
            mid_way.record(PartOutcome::Failed(FailureKind::Endpoint(401)));
            assert_eq!(mid_way.next(), Next::Halt(Halt::Endpoint(401)));
            assert_eq!((mid_way.settled(), mid_way.delivered()), (5, 5));
            assert_eq!(mid_way.remaining_parts(), vec![5]);
            assert!(mid_way.refused().is_empty());
            // A single row refused alone about the endpoint is not poison either.
            let mut one = IsolationPlan::after_batch_failed(2, FailureKind::Permanent, mode);
            one.record(PartOutcome::Failed(FailureKind::Endpoint(403)));
            assert_eq!(one.next(), Next::Halt(Halt::Endpoint(403)));
            assert!(one.refused().is_empty() && one.settled() == 0);
        }
    }

    #[test]
    fn an_endpoint_hold_is_recorded_and_cleared_by_the_next_attempt() {
        let rows = positions(4);
        let failed = record_failure(None, "bat_1", &rows[0], &rows[3], "HTTP 401", at(0));
        assert_eq!(failed.endpoint_refused, None);
        let held = held_for_endpoint(failed.clone(), 401);
        assert_eq!((held.endpoint_refused, held.attempts), (Some(401), 1));
        let again = record_failure(Some(&held), "bat_1", &rows[0], &rows[3], "HTTP 422", at(60));
        assert_eq!((again.endpoint_refused, again.attempts), (None, 2), "another failure, another verdict");
        let stopped_there = stopped(&failed, "refused", Some(404), at(5));
        assert_eq!(stopped_there.endpoint_refused, Some(404));
        assert_eq!(resumed(&stopped_there, at(9)).endpoint_refused, None);
        // An older build's record (without the field) still reads.
        let mut json = serde_json::to_value(&failed).unwrap();
        json.as_object_mut().unwrap().remove("endpoint_refused");
        assert_eq!(serde_json::from_value::<PoisonRecord>(json).unwrap(), failed);
    }

    #[test]
    fn stop_mode_holds_at_the_first_row_refused_alone_and_keeps_it_next() {
        let bad = BTreeSet::from([6]);
        let mut plan = IsolationPlan::after_batch_failed(16, FailureKind::Permanent, PoisonMode::Stop);
        run(&mut plan, &bad, 0, 100);
        assert_eq!(plan.next(), Next::Halt(Halt::RefusedAlone(6)));
        assert_eq!((plan.settled(), plan.delivered()), (6, 6), "every row before it, nothing after");
        assert_eq!(plan.remaining_parts()[0], 1, "the next tick tries that row alone first");
        assert!(plan.refused().is_empty());
    }

    /// A record kept for an unfinished isolation is used only for the rows it was made for.
    #[test]
    fn an_isolation_resumes_only_over_the_same_rows() {
        let rows = positions(8);
        let first = record_failure(None, "bat_1", &rows[0], &rows[7], "HTTP 422", at(0));
        let mut plan = IsolationPlan::after_batch_failed(8, FailureKind::Permanent, PoisonMode::Quarantine);
        plan.record(PartOutcome::Delivered);
        let record = in_progress(&first, &rows[4], &plan);
        assert_eq!(record.isolating, Some(Isolating { parts: vec![4] }));
        assert_eq!(record.first, CursorJson::from(&rows[4]));
        assert!(resume(&record, &rows[4..], PoisonMode::Quarantine).is_some());
        assert!(resume(&record, &rows[3..], PoisonMode::Quarantine).is_none(), "another first row");
        assert!(resume(&record, &rows[4..7], PoisonMode::Quarantine).is_none(), "fewer rows");
        let mut moved = rows[4..].to_vec();
        moved[3] = position(99, 99);
        assert!(resume(&record, &moved, PoisonMode::Quarantine).is_none(), "another last row");
        assert!(resume(&first, &rows, PoisonMode::Quarantine).is_none(), "nothing under way");
        let counted = resumed(&record, at(60));
        assert_eq!((counted.attempts, counted.last_failure_at), (2, at(60)));
    }

    /// Issue 45, finding 8: a plan with room for `n` quarantined rows halts at the next row
    /// refused alone, before it: the rows after stay for the next tick, none quarantined.
    #[test]
    fn a_plan_quarantines_no_more_than_its_room() {
        let mut plan = IsolationPlan::after_batch_failed(4, FailureKind::Permanent, PoisonMode::Quarantine);
        plan.limit_quarantine(1);
        // Every part refused: 4 -> 2 + 2 -> 1 + 1 + 2: row 0 quarantined, row 1 held at.
        while let Next::Try(_) = plan.next() {
            plan.record(PartOutcome::Failed(FailureKind::Permanent));
        }
        assert_eq!(plan.next(), Next::Halt(Halt::BudgetSpent(1)));
        assert_eq!(plan.refused(), &[0]);
        assert_eq!(plan.settled(), 1);
        assert_eq!(plan.remaining_parts(), vec![1, 2]);

        let mut none = IsolationPlan::after_batch_failed(3, FailureKind::Permanent, PoisonMode::Quarantine);
        none.limit_quarantine(0);
        while let Next::Try(part) = none.next() {
            // Row 0 passes, the others are refused.
            let outcome = if part.start == 0 && part.len() == 1 {
                PartOutcome::Delivered
            } else {
                PartOutcome::Failed(FailureKind::Permanent)
            };
            none.record(outcome);
        }
        assert_eq!(none.next(), Next::Halt(Halt::BudgetSpent(1)));
        assert_eq!((none.settled(), none.delivered(), none.refused().len()), (1, 1, 0));
    }

    proptest! {
        /// Regression (issue 24, items 3 and 4): depth first, left to right, the isolation ends
        /// with exactly the rows refused alone quarantined and every other row delivered once, in a
        /// bounded number of parts.
        #[test]
        fn isolation_quarantines_exactly_the_rows_refused_alone(
            rows in 1usize..300,
            bad in proptest::collection::btree_set(0usize..300, 1..12),
        ) {
            let bad: BTreeSet<usize> = bad.into_iter().filter(|row| *row < rows).collect();
            prop_assume!(!bad.is_empty());
            let mut plan = isolating(rows, &bad);
            let tries = run(&mut plan, &bad, 0, 10_000);
            prop_assert_eq!(plan.next(), Next::Done);
            prop_assert_eq!(plan.refused().iter().copied().collect::<BTreeSet<usize>>(), bad.clone());
            prop_assert_eq!(plan.delivered(), rows - bad.len());
            let depth = usize::BITS - rows.leading_zeros();
            prop_assert!(tries <= 2 * bad.len() * (depth as usize + 1), "{} tries", tries);
        }

        /// Regression (issue 24, item 3): an isolation cut after any number of parts and resumed
        /// from its record (as the next tick reads it) ends as one that was never cut.
        #[test]
        fn a_resumed_isolation_ends_as_an_uninterrupted_one(
            rows in 2usize..200,
            bad in proptest::collection::btree_set(0usize..200, 1..8),
            cut in 0usize..40,
        ) {
            let bad: BTreeSet<usize> = bad.into_iter().filter(|row| *row < rows).collect();
            prop_assume!(!bad.is_empty());
            let mut whole = isolating(rows, &bad);
            let whole_tries = run(&mut whole, &bad, 0, 10_000);

            let all = positions(rows);
            let failed = record_failure(None, "bat_1", &all[0], &all[rows - 1], "HTTP 422", at(0));
            let mut first_tick = isolating(rows, &bad);
            let mut tries = run(&mut first_tick, &bad, 0, cut);
            let mut refused: Vec<usize> = first_tick.refused().to_vec();
            if first_tick.next() != Next::Done {
                let offset = first_tick.settled();
                let stored = in_progress(&failed, &all[offset], &first_tick);
                let bytes = serde_json::to_vec(&stored).unwrap();
                let read: PoisonRecord = serde_json::from_slice(&bytes).unwrap();
                let mut second_tick = resume(&read, &all[offset..], PoisonMode::Quarantine).expect("same rows");
                tries += run(&mut second_tick, &bad, offset, 10_000);
                prop_assert_eq!(second_tick.next(), Next::Done);
                refused.extend(second_tick.refused().iter().map(|row| row + offset));
            }
            prop_assert_eq!(refused, whole.refused().to_vec());
            prop_assert_eq!(tries, whole_tries);
        }

        /// Regression (issue 24, item 4): whatever mix of transient failures the sink gives, no row
        /// is quarantined unless it was refused for good alone, no tick tries more than two parts
        /// that fail transiently in a row, and once the sink answers again the isolation ends.
        #[test]
        fn a_transient_failure_never_quarantines_a_row(
            rows in 1usize..120,
            bad in proptest::collection::btree_set(0usize..120, 0..6),
            flaky in proptest::collection::vec(any::<bool>(), 0..200),
        ) {
            let bad: BTreeSet<usize> = bad.into_iter().filter(|row| *row < rows).collect();
            let all = positions(rows);
            let failed = record_failure(None, "bat_1", &all[0], &all[rows - 1], "HTTP 503", at(0));
            let mut plan = IsolationPlan::after_batch_failed(rows, FailureKind::Transient, PoisonMode::Quarantine);
            let mut offset = 0;
            let mut refused = BTreeSet::new();
            let mut answers = flaky.into_iter();
            let mut ticks = 0;
            loop {
                let mut transient_in_a_row = 0;
                while let Next::Try(part) = plan.next() {
                    // Flaky while the script lasts, then a working receiver.
                    let outcome = if answers.next().unwrap_or(false) {
                        transient_in_a_row += 1;
                        PartOutcome::Failed(FailureKind::Transient)
                    } else {
                        transient_in_a_row = 0;
                        answer(part, &bad, offset)
                    };
                    plan.record(outcome);
                    prop_assert!(transient_in_a_row <= 2);
                }
                refused.extend(plan.refused().iter().map(|row| row + offset));
                if plan.next() == Next::Done {
                    break;
                }
                prop_assert_eq!(plan.next(), Next::Halt(Halt::Transient));
                ticks += 1;
                prop_assert!(ticks < 300, "the isolation ends once the sink answers");
                offset += plan.settled();
                let record = in_progress(&failed, &all[offset], &plan);
                plan = resume(&record, &all[offset..], PoisonMode::Quarantine).expect("same rows");
            }
            prop_assert!(refused.is_subset(&bad), "{:?} quarantined, {:?} bad", refused, bad);
            prop_assert_eq!(refused, bad);
        }

        /// Regression (issue 36, item 1): an endpoint that refuses everything for stretches of
        /// requests (a rotated token, a gateway) never sends a row to the quarantine, whatever the
        /// poison rows and however the stretches fall; once it answers again only the poison rows
        /// are quarantined.
        #[test]
        fn an_endpoint_refusing_everything_never_quarantines_a_row(
            rows in 1usize..120,
            bad in proptest::collection::btree_set(0usize..120, 0..6),
            refusing in proptest::collection::vec(any::<bool>(), 0..200),
            first_kind in prop_oneof![Just(FailureKind::Permanent), Just(FailureKind::Endpoint(401))],
        ) {
            let bad: BTreeSet<usize> = bad.into_iter().filter(|row| *row < rows).collect();
            // A batch refused for good holds a row refused for good: a batch of one that failed
            // that way is that row, so the script must have one.
            prop_assume!(!matches!(first_kind, FailureKind::Permanent) || !bad.is_empty());
            let all = positions(rows);
            let failed = record_failure(None, "bat_1", &all[0], &all[rows - 1], "HTTP 401", at(0));
            let mut plan = IsolationPlan::after_batch_failed(rows, first_kind, PoisonMode::Quarantine);
            let mut offset = 0;
            let mut refused = BTreeSet::new();
            let mut answers = refusing.into_iter();
            let mut ticks = 0;
            loop {
                while let Next::Try(part) = plan.next() {
                    let outcome = if answers.next().unwrap_or(false) {
                        PartOutcome::Failed(FailureKind::Endpoint(401))
                    } else {
                        answer(part, &bad, offset)
                    };
                    plan.record(outcome);
                }
                prop_assert!(plan.refused().iter().all(|row| bad.contains(&(row + offset))));
                refused.extend(plan.refused().iter().map(|row| row + offset));
                if plan.next() == Next::Done {
                    break;
                }
                prop_assert_eq!(plan.next(), Next::Halt(Halt::Endpoint(401)));
                ticks += 1;
                prop_assert!(ticks < 300, "the isolation ends once the endpoint answers");
                offset += plan.settled();
                let record = in_progress(&failed, &all[offset], &plan);
                plan = resume(&record, &all[offset..], PoisonMode::Quarantine).expect("same rows");
            }
            prop_assert_eq!(refused, bad);
        }
    }
}
