//! The state document: one per poller, holding its checkpoint and its lease together so that both
//! change in one compare-and-swap (seed 000 §1, §4).
//!
//! The document is read before it is written, always: a document this build cannot read (invalid
//! JSON, a newer `version`) is an error that stops the poller and is never overwritten.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::cursor::{CursorJson, Position, PositionOrder};
use super::late::LateRecord;
use super::lease::LeaseRecord;
use super::poison::PoisonRecord;

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// The format version this build reads and writes.
pub const STATE_VERSION: u64 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateDocument {
    pub version: u64,
    pub poller_name: String,
    /// `sha256:<hex>` of the source definition (seed 000 §9), without the password.
    pub source_fingerprint: String,
    /// `None` until the first batch is committed.
    pub checkpoint: Option<Checkpoint>,
    pub lease: Option<LeaseRecord>,
    #[serde(default)]
    pub stats: Stats,
    /// A fresh id per write. After a conditional write answered 412 we re-read: if the stored
    /// document carries our id, the write landed and only its response was lost (seed 001 case G).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_id: Option<String>,
    /// The failures of the batch at the checkpoint; cleared by the next commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poison: Option<PoisonRecord>,
    /// Ticks failing in a row for another reason than the sink (a source error, a checkpoint
    /// refused, a store error): `status` and the watchdog show them as they show `poison`. Cleared
    /// by the next tick that ends well.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureRecord>,
    /// The source generation (seed 003) the checkpoint belongs to, when one is configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<GenerationRecord>,
    /// When the last rows were quarantined, for the quarantine budget ([`super::quarantine_budget`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantine_log: Option<super::quarantine_budget::QuarantineLog>,
    /// The late-arrival detector's window and findings ([`super::late`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub late: Option<LateRecord>,
    /// Operator changes (reset, clone, fingerprint accept), oldest first, the last 50 kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<HistoryEntry>,
    /// Fields this build does not know (written by a newer build of the same version: poison,
    /// quarantine, history...). Kept through every read-modify-write, so that an older build
    /// running beside a newer one (a slot swap, a rollback) never erases them.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub cursor: CursorJson,
    pub last_successful_batch_id: String,
    pub updated_at: DateTime<Utc>,
    #[serde(default)]
    pub metadata: Value,
    /// Unknown checkpoint fields, kept (see [`StateDocument::extra`]).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Ticks that failed in a row for a reason other than the sink, in the state document's `failure`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureRecord {
    pub attempts: u32,
    pub first_error: String,
    pub last_error: String,
    pub first_failure_at: DateTime<Utc>,
    pub last_failure_at: DateTime<Utc>,
    /// A logical source's replication slot found lost (its name): a gap. The poller stops at every
    /// tick until an operator resets it (`dbtrigger reset`, which clears this record).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot_lost: Option<String>,
}

impl FailureRecord {
    /// The record after one more failed tick.
    pub fn after(previous: Option<&FailureRecord>, error: &str, now: DateTime<Utc>) -> FailureRecord {
        match previous {
            Some(previous) => FailureRecord {
                attempts: previous.attempts.saturating_add(1),
                first_error: previous.first_error.clone(),
                last_error: error.to_string(),
                first_failure_at: previous.first_failure_at,
                last_failure_at: now,
                slot_lost: previous.slot_lost.clone(),
            },
            None => FailureRecord {
                attempts: 1,
                first_error: error.to_string(),
                last_error: error.to_string(),
                first_failure_at: now,
                last_failure_at: now,
                slot_lost: None,
            },
        }
    }
}

/// The source generation a checkpoint belongs to, and since when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationRecord {
    /// What `source.generation.query` returned: text, an integer, or null.
    pub value: Value,
    pub since: DateTime<Utc>,
}

/// One operator change, kept in the document's `history`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub at: DateTime<Utc>,
    /// Who asked: `user@host` of the operator's shell.
    pub who: String,
    /// What was done, for programs (`reset`, `clone`, …); absent in entries older builds wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<HistoryAction>,
    /// What was done, in words: `reset to the beginning`, `cloned from orders`…
    pub what: String,
    /// The checkpoint before the change (`None`: there was none).
    pub previous_checkpoint: Option<CursorJson>,
    /// The source fingerprint before the change, when the change was to the fingerprint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_fingerprint: Option<String>,
    /// The write went through another owner's live lease.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub forced: bool,
    /// Why, in the operator's words (`--reason`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// What a history entry records, for programs that read the history (`what` says it for people).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HistoryAction {
    Reset,
    Clone,
    FingerprintAccept,
    QuarantineReplay,
    QuarantinePurge,
    /// The tick restarted from the beginning of a new source load (`onChange: restart`).
    GenerationRestart,
    /// The tick found the checkpoint again on another server's log, by GTID (a binary log's
    /// failover, issue 39).
    Rebase,
    /// An action a newer build wrote: kept as it is, so that this build never fails to read the
    /// document (which would stop the poller) nor rewrites the entry.
    #[serde(untagged)]
    Other(String),
}

/// Running totals, for `status` and for people reading the blob.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    #[serde(default)]
    pub rows_delivered: u64,
    #[serde(default)]
    pub batches_delivered: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_tick_at: Option<DateTime<Utc>>,
    /// Rows isolated as poison and kept in the quarantine instead of delivered.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub quarantined: u64,
    /// Unknown stats fields, kept (see [`StateDocument::extra`]).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Why a stored document cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DocumentError {
    #[error("the state document is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("the state document has no numeric `version` field")]
    MissingVersion,
    #[error(
        "the state document has version {found}, this build of dbtrigger reads version {STATE_VERSION}: upgrade dbtrigger"
    )]
    NewerVersion { found: u64 },
    #[error("the state document has unsupported version {found}")]
    UnsupportedVersion { found: u64 },
    #[error("the state document does not match the version {STATE_VERSION} format: {0}")]
    InvalidShape(String),
    #[error("the checkpoint cursor is invalid: {0}")]
    InvalidCursor(String),
}

impl StateDocument {
    /// A new document for a poller that has never committed.
    pub fn new(poller_name: &str, source_fingerprint: &str) -> Self {
        StateDocument {
            version: STATE_VERSION,
            poller_name: poller_name.to_string(),
            source_fingerprint: source_fingerprint.to_string(),
            checkpoint: None,
            lease: None,
            stats: Stats::default(),
            write_id: None,
            poison: None,
            failure: None,
            generation: None,
            quarantine_log: None,
            late: None,
            history: Vec::new(),
            extra: Map::new(),
        }
    }

    /// Parses stored bytes, checking the version before anything else so that a document from a
    /// newer build is reported as such rather than as a shape error.
    pub fn parse(bytes: &[u8]) -> Result<Self, DocumentError> {
        let value: Value =
            serde_json::from_slice(bytes).map_err(|error| DocumentError::InvalidJson(error.to_string()))?;
        let version = value.get("version").and_then(Value::as_u64).ok_or(DocumentError::MissingVersion)?;
        if version > STATE_VERSION {
            return Err(DocumentError::NewerVersion { found: version });
        }
        if version != STATE_VERSION {
            return Err(DocumentError::UnsupportedVersion { found: version });
        }
        let document: StateDocument =
            serde_json::from_value(value).map_err(|error| DocumentError::InvalidShape(error.to_string()))?;
        if let Some(checkpoint) = &document.checkpoint {
            Position::try_from(&checkpoint.cursor).map_err(DocumentError::InvalidCursor)?;
        }
        Ok(document)
    }

    /// Pretty JSON, so that an operator reading the blob sees a readable document.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec_pretty(self).expect("a state document always serializes");
        bytes.push(b'\n');
        bytes
    }

    /// The committed position, if any.
    pub fn position(&self) -> Result<Option<Position>, DocumentError> {
        match &self.checkpoint {
            None => Ok(None),
            Some(checkpoint) => Position::try_from(&checkpoint.cursor).map(Some).map_err(DocumentError::InvalidCursor),
        }
    }
}

/// What a document found after a 412 says about our writes: every write carries a fresh
/// `write_id`, and the writer remembers the ids of its writes that answered an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteCheck {
    /// It carries the id of the write that answered 412: it landed, only its answer was lost.
    ThisWriteLanded,
    /// It carries the id of an earlier write of this tick that answered an error: that one
    /// landed, so the document is still ours.
    EarlierWriteLanded,
    /// Someone else wrote it.
    Conflict,
}

impl WriteCheck {
    pub fn of(stored_id: Option<&str>, this_write: &str, unacknowledged: &[String]) -> WriteCheck {
        match stored_id {
            Some(id) if id == this_write => WriteCheck::ThisWriteLanded,
            Some(id) if unacknowledged.iter().any(|earlier| earlier == id) => WriteCheck::EarlierWriteLanded,
            _ => WriteCheck::Conflict,
        }
    }
}

/// A checkpoint move that would go backwards (or sideways) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("refusing to move the checkpoint from {from} to {to}: {reason}")]
pub struct CheckpointRegression {
    pub from: String,
    pub to: String,
    pub reason: String,
}

/// The checkpoint after a batch ending at `last` was delivered. The checkpoint only moves forward:
/// a position at or before the current one is refused (it would re-deliver, or worse, hide a bug).
pub fn advance_checkpoint(
    current: Option<&Checkpoint>,
    last: &Position,
    batch_id: &str,
    rows_in_batch: usize,
    now: DateTime<Utc>,
) -> Result<Checkpoint, CheckpointRegression> {
    if let Some(current) = current {
        let current_position = Position::try_from(&current.cursor).map_err(|reason| CheckpointRegression {
            from: current.cursor.value.to_string(),
            to: last.cursor.to_json().to_string(),
            reason,
        })?;
        let order = last.order(&current_position).map_err(|error| CheckpointRegression {
            from: current.cursor.value.to_string(),
            to: last.cursor.to_json().to_string(),
            reason: error.reason,
        })?;
        if matches!(order, PositionOrder::Before | PositionOrder::Same) {
            return Err(CheckpointRegression {
                from: describe(&current_position),
                to: describe(last),
                reason: "the new position is not after the committed one".to_string(),
            });
        }
    }
    Ok(Checkpoint {
        cursor: CursorJson::from(last),
        last_successful_batch_id: batch_id.to_string(),
        updated_at: now,
        metadata: serde_json::json!({ "row_count": rows_in_batch }),
        extra: current.map(|checkpoint| checkpoint.extra.clone()).unwrap_or_default(),
    })
}

/// A short human form of a position: `42 (id=7)`.
pub fn describe(position: &Position) -> String {
    let keys: Vec<String> = position.pk.iter().map(|(name, value)| format!("{name}={}", value.to_json())).collect();
    format!("{} ({})", position.cursor.to_json(), keys.join(", "))
}

/// When an operator last replayed or purged the quarantine: the quarantines before it no longer
/// count against the quarantine budget ([`super::quarantine_budget`]).
pub fn quarantine_answered_at(history: &[HistoryEntry]) -> Option<DateTime<Utc>> {
    history
        .iter()
        .filter(|entry| matches!(entry.action, Some(HistoryAction::QuarantineReplay | HistoryAction::QuarantinePurge)))
        .map(|entry| entry.at)
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 24, item 15: history entries carry a machine-readable `action`; entries written
    /// before it (no `action`) and actions of a newer build still read, and the latter are kept.
    #[test]
    fn history_actions_read_old_new_and_unknown_entries() {
        let entry = |action: &str| {
            format!(
                r#"{{"version": 1, "poller_name": "p", "source_fingerprint": "f", "checkpoint": null, "lease": null,
                "history": [{{"at": "2026-01-01T00:00:00Z", "who": "a@b", {action} "what": "x", "previous_checkpoint": null}}]}}"#
            )
        };
        let old = StateDocument::parse(entry("").as_bytes()).unwrap();
        assert_eq!(old.history[0].action, None);
        let known = StateDocument::parse(entry(r#""action": "quarantine_purge","#).as_bytes()).unwrap();
        assert_eq!(known.history[0].action, Some(HistoryAction::QuarantinePurge));
        let newer = StateDocument::parse(entry(r#""action": "time_travel","#).as_bytes()).unwrap();
        assert_eq!(newer.history[0].action, Some(HistoryAction::Other("time_travel".into())));
        let rewritten: Value = serde_json::from_slice(&newer.to_bytes()).unwrap();
        assert_eq!(rewritten["history"][0]["action"], "time_travel");
    }

    /// A fixed instant: the domain never reads the clock, its tests neither.
    fn fixed_time() -> DateTime<Utc> {
        DateTime::from_timestamp(1_780_000_000, 0).unwrap()
    }
    use crate::domain::cursor::{CursorValue, PkValue};
    use proptest::prelude::*;

    fn position(cursor: i64, id: i64) -> Position {
        Position { cursor: CursorValue::Integer(cursor), pk: vec![("id".to_string(), PkValue::Integer(id))] }
    }

    #[test]
    fn a_document_round_trips() {
        let mut document = StateDocument::new("orders", "sha256:abc");
        document.checkpoint = Some(advance_checkpoint(None, &position(5, 2), "b1", 10, fixed_time()).unwrap());
        let parsed = StateDocument::parse(&document.to_bytes()).unwrap();
        assert_eq!(parsed, document);
    }

    /// Regression (issue 9, item 9): fields a newer build added to a `version: 1` document
    /// survive a read-modify-write by this build.
    #[test]
    fn unknown_fields_survive_a_read_modify_write() {
        let mut document = StateDocument::new("orders", "sha256:abc");
        document.checkpoint = Some(advance_checkpoint(None, &position(5, 2), "b1", 10, fixed_time()).unwrap());
        let mut stored: Value = serde_json::from_slice(&document.to_bytes()).unwrap();
        stored["lineage"] = serde_json::json!({"value": "load-7", "query": "SELECT max(load_id) FROM load_log"});
        stored["quarantine"] = serde_json::json!({"count": 1, "location": "quarantine/app/orders/"});
        stored["checkpoint"]["generation"] = serde_json::json!("load-7");
        stored["stats"]["replayed"] = serde_json::json!(2);

        let mut read = StateDocument::parse(&serde_json::to_vec(&stored).unwrap()).unwrap();
        read.checkpoint =
            Some(advance_checkpoint(read.checkpoint.as_ref(), &position(6, 1), "b2", 10, fixed_time()).unwrap());
        read.stats.rows_delivered += 10;
        let written: Value = serde_json::from_slice(&read.to_bytes()).unwrap();

        assert_eq!(written["lineage"], stored["lineage"]);
        assert_eq!(written["quarantine"], stored["quarantine"]);
        assert_eq!(written["checkpoint"]["generation"], "load-7");
        assert_eq!(written["stats"]["replayed"], 2);
        assert_eq!(written["checkpoint"]["cursor"]["value"], 6, "and the known fields did change");
    }

    #[test]
    fn invalid_json_is_reported_as_such() {
        assert!(matches!(StateDocument::parse(b"{not json"), Err(DocumentError::InvalidJson(_))));
    }

    #[test]
    fn a_newer_version_is_refused_with_its_number() {
        let error = StateDocument::parse(br#"{"version": 99, "anything": true}"#).unwrap_err();
        assert_eq!(error, DocumentError::NewerVersion { found: 99 });
        assert!(error.to_string().contains("version 99"));
    }

    #[test]
    fn a_missing_version_is_refused() {
        assert_eq!(StateDocument::parse(br#"{"poller_name": "x"}"#).unwrap_err(), DocumentError::MissingVersion);
    }

    #[test]
    fn an_unknown_cursor_kind_is_refused() {
        let mut document = StateDocument::new("orders", "sha256:abc");
        document.checkpoint = Some(advance_checkpoint(None, &position(5, 2), "b1", 10, fixed_time()).unwrap());
        let text = String::from_utf8(document.to_bytes()).unwrap().replace("\"integer\"", "\"text\"");
        assert!(matches!(StateDocument::parse(text.as_bytes()), Err(DocumentError::InvalidCursor(_))));
    }

    #[test]
    fn the_checkpoint_refuses_to_move_backwards_or_stay() {
        let now = fixed_time();
        let first = advance_checkpoint(None, &position(5, 2), "b1", 1, now).unwrap();
        assert!(advance_checkpoint(Some(&first), &position(5, 1), "b2", 1, now).is_err());
        assert!(advance_checkpoint(Some(&first), &position(5, 2), "b2", 1, now).is_err());
        assert!(advance_checkpoint(Some(&first), &position(5, 3), "b2", 1, now).is_ok());
    }

    proptest! {
        /// Whatever sequence of positions is offered, the committed checkpoint never moves
        /// backwards: every accepted move is strictly forward.
        #[test]
        fn the_checkpoint_never_moves_backwards(moves in proptest::collection::vec((0i64..50, 0i64..50), 1..60)) {
            let now = fixed_time();
            let mut current: Option<Checkpoint> = None;
            for (cursor, id) in moves {
                let candidate = position(cursor, id);
                let before = current.as_ref().map(|checkpoint| Position::try_from(&checkpoint.cursor).unwrap());
                if let Ok(next) = advance_checkpoint(current.as_ref(), &candidate, "b", 1, now) {
                    if let Some(before) = before {
                        prop_assert_eq!(candidate.order(&before).unwrap(), PositionOrder::After);
                    }
                    current = Some(next);
                }
            }
        }
    }

    /// Regression (issue 9, item 8): after a 412, a document carrying the id of an earlier write
    /// that answered an error (a heartbeat that landed but timed out) is still ours.
    #[test]
    fn a_412_is_checked_against_every_unacknowledged_write() {
        let unacknowledged = vec!["heartbeat-1".to_string(), "heartbeat-2".to_string()];
        assert_eq!(WriteCheck::of(Some("commit"), "commit", &unacknowledged), WriteCheck::ThisWriteLanded);
        assert_eq!(WriteCheck::of(Some("heartbeat-1"), "commit", &unacknowledged), WriteCheck::EarlierWriteLanded);
        assert_eq!(WriteCheck::of(Some("heartbeat-2"), "commit", &unacknowledged), WriteCheck::EarlierWriteLanded);
        assert_eq!(WriteCheck::of(Some("someone-else"), "commit", &unacknowledged), WriteCheck::Conflict);
        assert_eq!(WriteCheck::of(None, "commit", &unacknowledged), WriteCheck::Conflict);
        assert_eq!(WriteCheck::of(Some("heartbeat-1"), "commit", &[]), WriteCheck::Conflict);
    }
}
