//! What flows from a source to a sink: a row read at its position, the event made of it, and the
//! batch of events a sink delivers at once. Sources produce [`SourceRow`]s, the tick turns them
//! into a [`Batch`], sinks consume it; none of them depends on another for these types.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::cursor::Position;
use super::ids::EventIds;

/// One row read from the source: where it sits in the poller's order and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceRow {
    pub position: Position,
    pub row: Map<String, Value>,
    /// What the row says happened to it (`upsert` unless the source has a delete rule).
    pub op: Op,
}

/// What happened to a row. Keyset polling sees the latest state of a row, so it delivers
/// `upsert`; `insert`, `update` and `delete` are for sources that say which it was (an outbox's
/// operation column, a soft-delete column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Upsert,
    Insert,
    Update,
    Delete,
}

impl Op {
    /// An operation as an outbox writes it: `insert`, `update`, `upsert` or `delete`.
    pub fn parse(text: &str) -> Option<Op> {
        match text {
            "insert" => Some(Op::Insert),
            "update" => Some(Op::Update),
            "upsert" => Some(Op::Upsert),
            "delete" => Some(Op::Delete),
            _ => None,
        }
    }
}

/// One delivered row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Deterministic: the same row version gets the same id on every redelivery.
    pub event_id: String,
    pub op: Op,
    pub cursor: Value,
    pub pk: Map<String, Value>,
    pub row: Map<String, Value>,
}

/// One batch, as a sink delivers it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Batch {
    pub poller: String,
    pub batch_id: String,
    pub fencing_token: u64,
    /// The source generation (seed 003) the rows were read under, when one is configured:
    /// receivers can drop the data of a superseded load.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<Value>,
    pub events: Vec<Event>,
}

impl Batch {
    /// The batch of `rows`, taking them (their values move into the events, nothing is copied),
    /// with the rows' positions given back in order.
    pub fn from_rows(
        ids: &EventIds,
        poller: &str,
        batch_id: String,
        fencing_token: u64,
        rows: Vec<SourceRow>,
    ) -> (Batch, Vec<Position>) {
        let mut events = Vec::with_capacity(rows.len());
        let mut positions = Vec::with_capacity(rows.len());
        for SourceRow { position, row, op } in rows {
            let cursor = position.cursor.to_json();
            let pk = position.tiebreaker_json();
            let event_id = ids.id(position.cursor.kind(), &cursor, &pk);
            events.push(Event { event_id, op, cursor, pk, row });
            positions.push(position);
        }
        (Batch { poller: poller.to_string(), batch_id, fencing_token, generation: None, events }, positions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::cursor::{CursorValue, PkValue};

    #[test]
    fn an_event_serializes_as_receivers_know_it() {
        let row = SourceRow {
            position: Position { cursor: CursorValue::Integer(4), pk: vec![("id".into(), PkValue::Integer(7))] },
            row: serde_json::json!({"id": 7, "status": "paid"}).as_object().unwrap().clone(),
            op: Op::Upsert,
        };
        let (batch, positions) =
            Batch::from_rows(&EventIds::new("orders", "sha256:x"), "orders", "bat_1".into(), 3, vec![row.clone()]);
        assert_eq!(positions, vec![row.position.clone()]);
        let json = serde_json::to_value(&batch.events[0]).unwrap();
        assert_eq!(json["op"], "upsert");
        assert_eq!(json["cursor"], 4);
        assert_eq!(json["pk"], serde_json::json!({"id": 7}));
        assert!(json["event_id"].as_str().unwrap().starts_with("evt_"));
        let keys: Vec<&String> = json.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["event_id", "op", "cursor", "pk", "row"], "field order is part of the envelope's bytes");
        // The exact bytes receivers see (and de-duplicate on): any change here is a change for them.
        assert_eq!(
            serde_json::to_string(&batch.events).unwrap(),
            r#"[{"event_id":"evt_0db17f472ea5acdfe01a1d7023bb2f6d","op":"upsert","cursor":4,"pk":{"id":7},"row":{"id":7,"status":"paid"}}]"#
        );
    }
}
