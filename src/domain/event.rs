//! What flows from a source to a sink: a row read at its position, the event made of it, and the
//! batch of events a sink delivers at once. Sources produce [`SourceRow`]s, the tick turns them
//! into a [`Batch`], sinks consume it; none of them depends on another for these types.
//!
//! A row is encoded as JSON once, where it is read ([`RowJson`]), and an event once, where the
//! batch is made ([`Event`]): sinks copy those bytes into a request body or a queue message
//! without building a JSON tree per row. The bytes are those serde_json writes for the same
//! values (the tests compare them), so receivers cannot tell.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::cursor::{CursorValue, PkValue, Position};
use super::ids::EventIds;

/// A row's columns as one JSON object, `{"id":7,"status":"paid"}`, in the order the query
/// returned them.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct RowJson(Vec<u8>);

impl RowJson {
    /// Bytes a source encoded: one JSON object (the source's row builder writes nothing else).
    pub(crate) fn from_encoded(bytes: Vec<u8>) -> RowJson {
        debug_assert!(bytes.first() == Some(&b'{') && bytes.last() == Some(&b'}'));
        RowJson(bytes)
    }

    /// The row of a JSON object.
    pub fn from_map(map: &Map<String, Value>) -> RowJson {
        RowJson(serde_json::to_vec(map).expect("a JSON object serializes"))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The row's columns as a JSON object (parsed: for tests and messages, not the delivery path).
    pub fn to_map(&self) -> Map<String, Value> {
        serde_json::from_slice(&self.0).expect("a row is a JSON object")
    }
}

/// The one key of a row kept as a reference: a row over `source.maxRowBytes`, of a poller told to
/// keep such rows aside (`source.oversizedRows: "quarantineReference"`), is read as
/// `{"$dbtrigger_oversized":{"bytes":N,"limit":M}}`: its key and cursor, its size, never its
/// payload. No sink delivers it: it is refused as too large, and so quarantined as it is.
pub const OVERSIZED_ROW_KEY: &str = "$dbtrigger_oversized";

impl RowJson {
    /// The reference that stands for a row of `bytes` bytes, over `limit`.
    pub fn oversized_reference(bytes: usize, limit: usize) -> RowJson {
        RowJson(format!("{{\"{OVERSIZED_ROW_KEY}\":{{\"bytes\":{bytes},\"limit\":{limit}}}}}").into_bytes())
    }

    /// Whether this row is such a reference (no source writes that key: a column of that name is
    /// refused).
    pub fn is_oversized_reference(&self) -> bool {
        self.0.starts_with(format!("{{\"{OVERSIZED_ROW_KEY}\":").as_bytes())
    }
}

impl fmt::Debug for RowJson {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&String::from_utf8_lossy(&self.0))
    }
}

/// One row read from the source: where it sits in the poller's order and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceRow {
    pub position: Position,
    pub row: RowJson,
    /// What the row says happened to it (`upsert` unless the source has a delete rule).
    pub op: Op,
    /// Its keys for per-key order, when the source says them (the logical source: the table and
    /// its replica identity's values); `None`: the position's primary key.
    pub group: Option<crate::domain::keyed::Group>,
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
    /// A table emptied at once (the logical source: PostgreSQL's TRUNCATE).
    Truncate,
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

    pub fn as_str(self) -> &'static str {
        match self {
            Op::Upsert => "upsert",
            Op::Insert => "insert",
            Op::Update => "update",
            Op::Delete => "delete",
            Op::Truncate => "truncate",
        }
    }
}

/// One delivered row, encoded once: `{"event_id":…,"op":…,"cursor":…,"pk":{…},"row":{…}}`.
#[derive(Clone, PartialEq)]
pub struct Event {
    pub op: Op,
    /// Everything before the row: `{"event_id":…,"op":…,"cursor":…,"pk":{…},"row":`.
    head: Vec<u8>,
    /// Where the event id ends in `head`.
    id_end: usize,
    row: RowJson,
}

/// What an event's JSON starts with; its id follows.
const ID_START: &[u8] = b"{\"event_id\":\"";

/// The fields of an event as JSON values: parsed back from its bytes (and, in the tests, the tree
/// serde serializes to the bytes events are encoded as).
#[derive(Serialize, Deserialize)]
struct EventFields {
    event_id: String,
    op: Op,
    cursor: Value,
    pk: Map<String, Value>,
    row: Map<String, Value>,
}

impl Event {
    /// `write_id` writes the event id (letters, digits and `_`: nothing to escape).
    fn encode(write_id: impl FnOnce(&mut Vec<u8>), op: Op, cursor: &[u8], pk: &[u8], row: RowJson) -> Event {
        let mut head = Vec::with_capacity(cursor.len() + pk.len() + 96);
        head.extend_from_slice(ID_START);
        write_id(&mut head);
        let id_end = head.len();
        head.extend_from_slice(b"\",\"op\":\"");
        head.extend_from_slice(op.as_str().as_bytes());
        head.extend_from_slice(b"\",\"cursor\":");
        head.extend_from_slice(cursor);
        head.extend_from_slice(b",\"pk\":");
        head.extend_from_slice(pk);
        head.extend_from_slice(b",\"row\":");
        Event { op, head, id_end, row }
    }

    /// Deterministic: the same row version gets the same id on every redelivery.
    pub fn event_id(&self) -> &str {
        std::str::from_utf8(&self.head[ID_START.len()..self.id_end]).expect("an event id is ASCII")
    }

    /// Whether the event stands for a row too large to keep ([`OVERSIZED_ROW_KEY`]).
    pub fn is_oversized_reference(&self) -> bool {
        self.row.is_oversized_reference()
    }

    /// The event's length as JSON, in bytes.
    pub fn encoded_len(&self) -> usize {
        self.head.len() + self.row.len() + 1
    }

    /// Appends the event's JSON to `out`.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.head);
        out.extend_from_slice(self.row.as_bytes());
        out.push(b'}');
    }

    /// The event's JSON.
    pub fn to_json_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.write_json(&mut out);
        out
    }

    fn fields(&self) -> EventFields {
        serde_json::from_slice(&self.to_json_bytes()).expect("an event is the JSON it was encoded as")
    }

    /// The event as a JSON value (what the quarantine keeps).
    pub fn to_value(&self) -> Value {
        serde_json::from_slice(&self.to_json_bytes()).expect("an event is the JSON it was encoded as")
    }

    /// The cursor value, parsed from the event (for tests and messages).
    pub fn cursor(&self) -> Value {
        self.fields().cursor
    }

    /// The primary key, parsed from the event (for tests and messages).
    pub fn pk(&self) -> Map<String, Value> {
        self.fields().pk
    }

    /// The row, parsed from the event (for tests and messages).
    pub fn row(&self) -> Map<String, Value> {
        self.fields().row
    }

    /// An event as it was stored (the quarantine keeps events as JSON values): encoded again
    /// field by field, in the envelope's order.
    pub fn from_value(value: &Value) -> Result<Event, String> {
        let fields: EventFields = serde_json::from_value(value.clone()).map_err(|error| error.to_string())?;
        if !fields.event_id.bytes().all(|byte| byte.is_ascii_alphanumeric() || byte == b'_') {
            return Err(format!("the event id {:?} is not one dbtrigger makes", fields.event_id));
        }
        let cursor = serde_json::to_vec(&fields.cursor).expect("a JSON value serializes");
        let pk = serde_json::to_vec(&fields.pk).expect("a JSON object serializes");
        let id = fields.event_id.as_bytes();
        Ok(Event::encode(|out| out.extend_from_slice(id), fields.op, &cursor, &pk, RowJson::from_map(&fields.row)))
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&String::from_utf8_lossy(&self.to_json_bytes()))
    }
}

impl Serialize for Event {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let text = String::from_utf8(self.to_json_bytes()).map_err(serde::ser::Error::custom)?;
        let raw = serde_json::value::RawValue::from_string(text).map_err(serde::ser::Error::custom)?;
        raw.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Event {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        Event::from_value(&value).map_err(serde::de::Error::custom)
    }
}

/// Appends a JSON string.
fn write_str(out: &mut Vec<u8>, text: &str) {
    serde_json::to_writer(&mut *out, text).expect("writing to memory cannot fail");
}

fn write_number(out: &mut Vec<u8>, number: i64) {
    serde_json::to_writer(&mut *out, &number).expect("writing to memory cannot fail");
}

/// Appends a cursor value as JSON (what [`CursorValue::to_json`] serializes to).
fn write_cursor(out: &mut Vec<u8>, cursor: &CursorValue) {
    match cursor {
        CursorValue::Integer(number) => write_number(out, *number),
        timestamp => serde_json::to_writer(&mut *out, &timestamp.to_json()).expect("writing to memory cannot fail"),
    }
}

/// Appends a position's primary key as a JSON object (what [`Position::tiebreaker_json`]
/// serializes to).
fn write_pk(out: &mut Vec<u8>, pk: &[(String, PkValue)]) {
    out.push(b'{');
    for (index, (name, value)) in pk.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        write_str(out, name);
        out.push(b':');
        match value {
            PkValue::Integer(number) => write_number(out, *number),
            PkValue::Text(text) => write_str(out, text),
        }
    }
    out.push(b'}');
}

/// Writes the key an event id hashes, `kind|cursor|pk` (cursor and pk as JSON) into `out`, and
/// says where the cursor and the pk are in it.
pub(crate) fn position_key(out: &mut Vec<u8>, position: &Position) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    out.clear();
    out.extend_from_slice(position.cursor.kind().as_bytes());
    out.push(b'|');
    let cursor_start = out.len();
    write_cursor(out, &position.cursor);
    let cursor = cursor_start..out.len();
    out.push(b'|');
    let pk_start = out.len();
    write_pk(out, &position.pk);
    (cursor, pk_start..out.len())
}

/// One batch, as a sink delivers it.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub poller: String,
    pub batch_id: String,
    pub fencing_token: u64,
    /// The source generation (seed 003) the rows were read under, when one is configured:
    /// receivers can drop the data of a superseded load.
    pub generation: Option<Value>,
    /// Rows delivered again because the late-arrival detector found rows committed behind the
    /// checkpoint (`"late": true` in the envelope and in every row message); their event ids are
    /// the ones they always had.
    pub late: bool,
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
        let mut key = Vec::with_capacity(96);
        for SourceRow { position, row, op, .. } in rows {
            let (cursor, pk) = position_key(&mut key, &position);
            let id = |out: &mut Vec<u8>| ids.write_id_of_key(&key, out);
            events.push(Event::encode(id, op, &key[cursor], &key[pk], row));
            positions.push(position);
        }
        (
            Batch { poller: poller.to_string(), batch_id, fencing_token, generation: None, late: false, events },
            positions,
        )
    }

    /// `{"poller":…,"batch_id":…,"fencing_token":…,["generation":…,]["late":true,]"sent_at":…` : what an
    /// envelope and a row message start with.
    fn write_head(&self, out: &mut Vec<u8>, batch_id: &str, sent_at: &str) {
        out.extend_from_slice(b"{\"poller\":");
        write_str(out, &self.poller);
        out.extend_from_slice(b",\"batch_id\":");
        write_str(out, batch_id);
        out.extend_from_slice(b",\"fencing_token\":");
        serde_json::to_writer(&mut *out, &self.fencing_token).expect("writing to memory cannot fail");
        if let Some(generation) = &self.generation {
            out.extend_from_slice(b",\"generation\":");
            serde_json::to_writer(&mut *out, generation).expect("writing to memory cannot fail");
        }
        if self.late {
            out.extend_from_slice(b",\"late\":true");
        }
        out.extend_from_slice(b",\"sent_at\":");
        write_str(out, sent_at);
    }

    /// The envelope of `events` (a webhook body, a batch message):
    /// `{"poller":…,"batch_id":…,"fencing_token":…,["generation":…,]"sent_at":…,"events":[…]}`.
    pub fn envelope(&self, batch_id: &str, sent_at: &str, events: &[Event]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.envelope_len(batch_id, sent_at, events));
        self.write_head(&mut out, batch_id, sent_at);
        out.extend_from_slice(b",\"events\":[");
        for (index, event) in events.iter().enumerate() {
            if index > 0 {
                out.push(b',');
            }
            event.write_json(&mut out);
        }
        out.extend_from_slice(b"]}");
        out
    }

    /// The length of [`Batch::envelope`], without writing it.
    pub fn envelope_len(&self, batch_id: &str, sent_at: &str, events: &[Event]) -> usize {
        let mut head = Vec::with_capacity(128);
        self.write_head(&mut head, batch_id, sent_at);
        let events_len: usize = events.iter().map(Event::encoded_len).sum();
        head.len() + ",\"events\":[".len() + events_len + events.len().saturating_sub(1) + "]}".len()
    }

    /// One event with the envelope's fields around it (a queue message per row):
    /// `{"poller":…,"batch_id":…,"fencing_token":…,["generation":…,]"sent_at":…,"event_id":…,…}`.
    pub fn row_message(&self, sent_at: &str, event: &Event) -> Vec<u8> {
        let mut out = Vec::with_capacity(event.encoded_len() + 160);
        self.write_head(&mut out, &self.batch_id, sent_at);
        out.push(b',');
        // The event's fields, without its opening brace.
        out.extend_from_slice(&event.head[1..]);
        out.extend_from_slice(event.row.as_bytes());
        out.push(b'}');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::cursor::{CursorValue, PkValue};
    use chrono::DateTime;
    use serde_json::json;

    /// An event as it was built before events were encoded once: a tree of JSON values,
    /// serialized by serde. The bytes must not change.
    type TreeEvent = EventFields;

    #[derive(Serialize)]
    struct TreeEnvelope<'a> {
        poller: &'a str,
        batch_id: &'a str,
        fencing_token: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        generation: Option<&'a Value>,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        late: bool,
        sent_at: &'a str,
        events: &'a [TreeEvent],
    }

    #[derive(Serialize)]
    struct TreeRowMessage<'a> {
        poller: &'a str,
        batch_id: &'a str,
        fencing_token: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        generation: Option<&'a Value>,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        late: bool,
        sent_at: &'a str,
        #[serde(flatten)]
        event: &'a TreeEvent,
    }

    fn tree(ids: &EventIds, row: &SourceRow) -> TreeEvent {
        let cursor = row.position.cursor.to_json();
        let pk = row.position.tiebreaker_json();
        TreeEvent { event_id: ids.for_position(&row.position), op: row.op, cursor, pk, row: row.row.to_map() }
    }

    fn rows() -> Vec<SourceRow> {
        let at = DateTime::from_timestamp(1_780_000_000, 5_000).unwrap();
        vec![
            SourceRow {
                position: Position { cursor: CursorValue::Integer(4), pk: vec![("id".into(), PkValue::Integer(7))] },
                row: RowJson::from_map(json!({"id": 7, "status": "paid"}).as_object().unwrap()),
                op: Op::Upsert,
                group: None,
            },
            SourceRow {
                position: Position {
                    cursor: CursorValue::Timestamp { at, source_text: Some("2026-05-28 20:26:40.000005".into()) },
                    pk: vec![
                        ("tenant \"t\"".into(), PkValue::Text("a\"b\\ é\u{1}\n".into())),
                        ("id".into(), PkValue::Integer(-3)),
                    ],
                },
                row: RowJson::from_map(
                    json!({"note": "tab\t \u{2028} 😀 </script>", "total": 1.5e300, "small": -0.000001,
                           "none": null, "flag": true, "doc": {"z": [1, "two", null], "a": {}}, "big": u64::MAX})
                    .as_object()
                    .unwrap(),
                ),
                op: Op::Delete,
                group: None,
            },
            SourceRow {
                position: Position {
                    cursor: CursorValue::NaiveTimestamp(at.naive_utc()),
                    pk: vec![("code".into(), PkValue::Text(String::new()))],
                },
                row: RowJson::from_map(&Map::new()),
                op: Op::Insert,
                group: None,
            },
        ]
    }

    #[test]
    fn an_event_serializes_as_receivers_know_it() {
        let row = rows().remove(0);
        let (batch, positions) =
            Batch::from_rows(&EventIds::new("orders", "sha256:x"), "orders", "bat_1".into(), 3, vec![row.clone()]);
        assert_eq!(positions, vec![row.position.clone()]);
        let json = batch.events[0].to_value();
        let keys: Vec<&String> = json.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["event_id", "op", "cursor", "pk", "row"], "field order is part of the envelope's bytes");
        // The exact bytes receivers see (and de-duplicate on): any change here is a change for them.
        assert_eq!(
            serde_json::to_string(&batch.events).unwrap(),
            r#"[{"event_id":"evt_0db17f472ea5acdfe01a1d7023bb2f6d","op":"upsert","cursor":4,"pk":{"id":7},"row":{"id":7,"status":"paid"}}]"#
        );
        assert_eq!(batch.events[0].pk(), *json!({"id": 7}).as_object().unwrap());
        assert_eq!(batch.events[0].cursor(), json!(4));
    }

    #[test]
    fn events_encoded_once_are_the_bytes_serde_wrote_for_the_tree() {
        let ids = EventIds::new("orders", "sha256:x");
        let rows = rows();
        let trees: Vec<TreeEvent> = rows.iter().map(|row| tree(&ids, row)).collect();
        let (mut batch, _) = Batch::from_rows(&ids, "or\"ders", "bat_1".into(), 3, rows);
        for (event, tree) in batch.events.iter().zip(&trees) {
            assert_eq!(String::from_utf8(event.to_json_bytes()).unwrap(), serde_json::to_string(tree).unwrap());
            assert_eq!(event.encoded_len(), serde_json::to_vec(tree).unwrap().len());
            // What the quarantine stores comes back as the same bytes.
            assert_eq!(&Event::from_value(&event.to_value()).unwrap(), event);
        }
        for (generation, late) in
            [(None, false), (Some(json!(2)), true), (Some(json!("load \"7\"")), false), (None, true)]
        {
            batch.generation = generation.clone();
            batch.late = late;
            let sent_at = "2026-11-23T10:00:00.123Z";
            let envelope = batch.envelope("bat_1-1of2", sent_at, &batch.events);
            let expected = serde_json::to_vec(&TreeEnvelope {
                poller: &batch.poller,
                batch_id: "bat_1-1of2",
                fencing_token: batch.fencing_token,
                generation: generation.as_ref(),
                late,
                sent_at,
                events: &trees,
            })
            .unwrap();
            assert_eq!(String::from_utf8(envelope.clone()).unwrap(), String::from_utf8(expected).unwrap());
            assert_eq!(batch.envelope_len("bat_1-1of2", sent_at, &batch.events), envelope.len());
            let empty = batch.envelope("bat_1", sent_at, &[]);
            assert_eq!(batch.envelope_len("bat_1", sent_at, &[]), empty.len());
            assert_eq!(serde_json::from_slice::<Value>(&empty).unwrap()["events"], json!([]));
            for (event, tree) in batch.events.iter().zip(&trees) {
                let message = TreeRowMessage {
                    poller: &batch.poller,
                    batch_id: &batch.batch_id,
                    fencing_token: batch.fencing_token,
                    generation: generation.as_ref(),
                    late,
                    sent_at,
                    event: tree,
                };
                assert_eq!(
                    String::from_utf8(batch.row_message(sent_at, event)).unwrap(),
                    serde_json::to_string(&message).unwrap()
                );
            }
        }
    }
}
