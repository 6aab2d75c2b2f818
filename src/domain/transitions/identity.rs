//! The source's identity against the checkpoint's: the configuration's fingerprint and the
//! source generation (seed 003).

use chrono::{DateTime, Utc};

use super::operator::operator_write;
use super::{HistoryAction, Operator};
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
