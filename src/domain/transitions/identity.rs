//! The source's identity against the checkpoint's: the configuration's fingerprint and the
//! source generation (seed 003).

use chrono::{DateTime, Utc};

use super::operator::operator_write;
use super::{HistoryAction, Operator};
use crate::domain::cursor::{CursorJson, Position};
use crate::domain::state::{GenerationRecord, StateDocument};

/// How a stored fingerprint relates to the configuration's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FingerprintCheck {
    Same,
    /// The form an earlier build wrote for the same target: accepted, and replaced at the next write.
    Earlier,
    Changed,
}

pub fn check_fingerprint(stored: &str, current: &str, earlier: Option<&str>) -> FingerprintCheck {
    if stored == current {
        FingerprintCheck::Same
    } else if earlier == Some(stored) {
        FingerprintCheck::Earlier
    } else {
        FingerprintCheck::Changed
    }
}

/// What a tick does about the source generation it read (seed 003).
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationCheck {
    /// The checkpoint belongs to this generation (or none is configured): go on.
    Same,
    /// No generation recorded yet: this is the document with it recorded.
    Adopted(StateDocument),
    /// It moved and `onChange` is `restart`: this is the document reset to the beginning of the
    /// new load, its history saying so, under a new fencing token.
    Restarted(StateDocument),
    /// It moved and `onChange` is `stop`.
    Stopped { stored: serde_json::Value, current: serde_json::Value },
}

/// Compares the generation the source reports with the one the checkpoint belongs to.
pub fn check_generation(
    document: &StateDocument,
    current: Option<&serde_json::Value>,
    restart: bool,
    now: DateTime<Utc>,
) -> GenerationCheck {
    let Some(current) = current else {
        return GenerationCheck::Same;
    };
    let record = GenerationRecord { value: current.clone(), since: now };
    match &document.generation {
        Some(stored) if stored.value == *current => GenerationCheck::Same,
        None => {
            let mut next = document.clone();
            next.generation = Some(record);
            GenerationCheck::Adopted(next)
        }
        Some(stored) if !restart => GenerationCheck::Stopped { stored: stored.value.clone(), current: current.clone() },
        Some(stored) => {
            let what = format!(
                "source generation changed from {} to {}: restarted from the beginning (source.generation.onChange: restart)",
                stored.value, current
            );
            let mut next = operator_write(
                document,
                Operator { who: "dbtrigger", force: false, reason: None },
                false,
                (HistoryAction::GenerationRestart, what),
                None,
                now,
            );
            next.checkpoint = None;
            next.poison = None;
            next.generation = Some(record);
            if let Some(lease) = next.lease.as_mut() {
                lease.fencing_token += 1;
            }
            GenerationCheck::Restarted(next)
        }
    }
}

/// The document after a source read from a server's log said where its checkpoint is on the
/// server read now (issue 39): the server recorded as the generation, the checkpoint moved to
/// `checkpoint` when given (back or forth: it names the same place in another log), and the history
/// saying so when `what` is given. No row is counted; the lease is not touched.
pub fn rebase(
    document: &StateDocument,
    checkpoint: Option<&Position>,
    server: &serde_json::Value,
    what: Option<&str>,
    now: DateTime<Utc>,
) -> StateDocument {
    let mut next = match what {
        Some(what) => operator_write(
            document,
            Operator { who: "dbtrigger", force: false, reason: None },
            false,
            (HistoryAction::Rebase, what.to_string()),
            None,
            now,
        ),
        None => document.clone(),
    };
    if next.generation.as_ref().is_none_or(|record| record.value != *server) {
        next.generation = Some(GenerationRecord { value: server.clone(), since: now });
    }
    if let (Some(position), Some(current)) = (checkpoint, next.checkpoint.as_mut()) {
        current.cursor = CursorJson::from(position);
        current.updated_at = now;
    }
    next
}

#[cfg(test)]
mod rebase_tests {
    use super::*;
    use crate::domain::cursor::{CursorValue, PkValue};

    #[test]
    fn a_rebase_records_the_server_moves_the_checkpoint_back_and_says_so() {
        let now = DateTime::from_timestamp(1_780_000_000, 0).unwrap();
        let at = |cursor: i64| Position {
            cursor: CursorValue::Integer(cursor),
            pk: vec![("ordinal".into(), PkValue::Integer(2))],
        };
        let mut document = StateDocument::new("orders", "sha256:x");
        document.checkpoint = Some(crate::domain::state::advance_checkpoint(None, &at(900), "b1", 1, now).unwrap());
        let server = serde_json::json!("server_id 2");
        let recorded = rebase(&document, None, &server, None, now);
        assert_eq!(recorded.generation.as_ref().unwrap().value, server);
        assert!(recorded.history.is_empty());
        assert_eq!(recorded.checkpoint, document.checkpoint, "nothing else moves");
        let moved = rebase(&recorded, Some(&at(100)), &server, Some("re-based by GTID"), now);
        assert_eq!(moved.position().unwrap(), Some(at(100)), "back: the same place in another log");
        let entry = moved.history.last().unwrap();
        assert_eq!(entry.action, Some(HistoryAction::Rebase));
        assert_eq!(entry.previous_checkpoint.as_ref().unwrap().value, serde_json::json!(900));
        assert_eq!(moved.checkpoint.as_ref().unwrap().last_successful_batch_id, "b1");
    }
}
