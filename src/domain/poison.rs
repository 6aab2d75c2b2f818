//! Poison batches (seed 001 case I): a batch the sink keeps refusing must neither stop the feed
//! forever nor be dropped in silence. The state document counts the failed attempts of the batch at
//! the checkpoint; a permanent refusal, or `poison.maxAttempts` failed ticks, isolates it: split in
//! halves down to single rows, the rows that still fail alone quarantined (kept, with their error)
//! and the rest delivered. If every part fails the same transient way, the sink is down, not the
//! rows: nothing is quarantined. These are the pure decisions; the tick carries them out.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::cursor::{CursorJson, Position};

/// The failures of the batch at the checkpoint, in the state document's `poison`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoisonRecord {
    pub batch_id: String,
    /// The batch's first and last rows.
    pub first: CursorJson,
    pub last: CursorJson,
    /// Failed ticks on this batch.
    pub attempts: u32,
    pub first_error: String,
    pub last_error: String,
    pub first_failure_at: DateTime<Utc>,
    pub last_failure_at: DateTime<Utc>,
}

/// How a delivery failed, as far as poison handling cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The receiver refused for good (a 4xx other than 408/429, a row too large): retrying the
    /// same rows will not help.
    Permanent,
    /// A timeout, a refused connection, 408, 429, 5xx: it may pass.
    Transient,
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
        },
    }
}

/// Isolate at once on a permanent refusal; after `max_attempts` failed ticks on a transient one.
pub fn verdict(kind: FailureKind, attempts: u32, max_attempts: u32) -> Verdict {
    match kind {
        FailureKind::Permanent => Verdict::Isolate,
        FailureKind::Transient if attempts >= max_attempts => Verdict::Isolate,
        FailureKind::Transient => Verdict::Retry,
    }
}

/// What isolating found, from the outcome of each part delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// No part got through and every failure was transient: the sink is down, not the rows.
    SinkDown,
    /// Some rows got through or were refused for good: quarantine (or stop at) the ones that
    /// failed alone.
    Found,
}

/// Whether to keep splitting, given what the first split's parts came to: when both halves of
/// the batch failed transiently, the sink is down and splitting further would only hammer it.
pub fn after_first_split(left: Option<FailureKind>, right: Option<FailureKind>) -> Isolation {
    match (left, right) {
        (Some(FailureKind::Transient), Some(FailureKind::Transient)) => Isolation::SinkDown,
        _ => Isolation::Found,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::cursor::{CursorValue, PkValue};

    fn position(cursor: i64, id: i64) -> Position {
        Position { cursor: CursorValue::Integer(cursor), pk: vec![("id".to_string(), PkValue::Integer(id))] }
    }

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_780_000_000 + seconds, 0).unwrap()
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
        ] {
            assert_eq!(verdict(kind, attempts, max), expected, "{kind:?} attempt {attempts} of {max}");
        }
    }

    #[test]
    fn both_halves_failing_transiently_is_a_sink_outage() {
        use FailureKind::{Permanent, Transient};
        assert_eq!(after_first_split(Some(Transient), Some(Transient)), Isolation::SinkDown);
        assert_eq!(after_first_split(None, Some(Transient)), Isolation::Found);
        assert_eq!(after_first_split(Some(Transient), None), Isolation::Found);
        assert_eq!(after_first_split(Some(Permanent), Some(Transient)), Isolation::Found);
        assert_eq!(after_first_split(Some(Permanent), Some(Permanent)), Isolation::Found);
    }
}
