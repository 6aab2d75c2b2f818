//! Typed cursor values and the (cursor, pk...) position that orders every row a poller reads.
//!
//! A cursor keeps its type from the database to the state document and back: an integer stays an
//! integer, a timestamp is stored as RFC 3339 and bound back as a timestamp. Comparing a timestamp
//! as text is the bug that stalled the project this one learns from, so the kinds never mix.

use std::cmp::Ordering;

use chrono::{DateTime, NaiveDateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The value of the cursor column of one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CursorValue {
    /// integer, bigint, or a version column.
    Integer(i64),
    /// A point in time. `source_text` is the exact text a SQLite row stored (SQLite has no
    /// timestamp type): binding that text back makes the seek predicate agree with the database's
    /// own ORDER BY whatever text layout the column uses.
    Timestamp { at: DateTime<Utc>, source_text: Option<String> },
    /// A timestamp without time zone, kept exactly as the database holds it and bound back as
    /// such: the database compares it natively, whatever zone its values mean.
    NaiveTimestamp(NaiveDateTime),
    /// A PostgreSQL `xid8`: the 64-bit id of the transaction that wrote the row, read only below
    /// the commit horizon. Written as a decimal string in the state document and in events: it is
    /// unsigned and may pass 2^53, past what a JSON number keeps exactly in many receivers.
    Xid(u64),
}

/// The text form of a naive timestamp in the state document and in events.
const NAIVE_FORMAT: &str = "%Y-%m-%dT%H:%M:%S%.f";

impl CursorValue {
    /// The name stored as `checkpoint.cursor.kind`.
    pub fn kind(&self) -> &'static str {
        match self {
            CursorValue::Integer(_) => "integer",
            CursorValue::Timestamp { .. } => "timestamp",
            CursorValue::NaiveTimestamp(_) => "timestamp_naive",
            CursorValue::Xid(_) => "xid",
        }
    }

    /// The value as it appears in the state document and in delivered events.
    pub fn to_json(&self) -> Value {
        match self {
            CursorValue::Integer(number) => Value::from(*number),
            CursorValue::Timestamp { at, .. } => Value::from(at.to_rfc3339_opts(SecondsFormat::AutoSi, true)),
            CursorValue::NaiveTimestamp(at) => Value::from(at.format(NAIVE_FORMAT).to_string()),
            CursorValue::Xid(xid) => Value::from(xid.to_string()),
        }
    }

    /// Orders two cursor values of the same kind the way the database orders them; values of
    /// different kinds are not comparable.
    ///
    /// Two timestamps that both carry the text SQLite stored are ordered by that text, byte by byte:
    /// that is the order of SQLite's index, its ORDER BY and the seek predicate (BINARY collation).
    /// Ordering them by instant instead would call a commit a regression whenever offsets mix
    /// (`10:30+02:00` sorts after `09:00+00:00` but happens before it) and stall the poller.
    pub fn compare(&self, other: &CursorValue) -> Option<Ordering> {
        match (self, other) {
            (CursorValue::Integer(left), CursorValue::Integer(right)) => Some(left.cmp(right)),
            (
                CursorValue::Timestamp { source_text: Some(left), .. },
                CursorValue::Timestamp { source_text: Some(right), .. },
            ) => Some(left.as_bytes().cmp(right.as_bytes())),
            (CursorValue::Timestamp { at: left, .. }, CursorValue::Timestamp { at: right, .. }) => {
                Some(left.cmp(right))
            }
            (CursorValue::NaiveTimestamp(left), CursorValue::NaiveTimestamp(right)) => Some(left.cmp(right)),
            (CursorValue::Xid(left), CursorValue::Xid(right)) => Some(left.cmp(right)),
            _ => None,
        }
    }
}

/// An `xid8` as PostgreSQL prints it: decimal digits only (no sign, no spaces), below 2^64.
pub fn parse_xid(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    text.parse::<u64>().ok()
}

/// The value of one primary-key column: the tiebreaker between rows with equal cursors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PkValue {
    Integer(i64),
    Text(String),
}

impl PkValue {
    pub fn to_json(&self) -> Value {
        match self {
            PkValue::Integer(number) => Value::from(*number),
            PkValue::Text(text) => Value::from(text.clone()),
        }
    }
}

/// Where a row sits in the poller's total order: `ORDER BY cursor, pk1, pk2...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    pub cursor: CursorValue,
    /// (column name, value) in the configured pk order.
    pub pk: Vec<(String, PkValue)>,
}

/// How two positions relate, as far as this process can tell without the database's collation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PositionOrder {
    Before,
    Same,
    After,
    /// Equal cursors and a text primary key: only the database's collation can order them.
    Undetermined,
}

impl Position {
    /// Compares two positions. Cursors are compared by value; when they are equal, integer keys are
    /// compared numerically, but text keys are left to the database (its collation may not be
    /// byte order), so the answer is [`PositionOrder::Undetermined`].
    pub fn order(&self, other: &Position) -> Result<PositionOrder, IncomparablePositions> {
        let cursor_order = self.cursor.compare(&other.cursor).ok_or_else(|| IncomparablePositions {
            reason: format!("cursor kinds differ: {} and {}", self.cursor.kind(), other.cursor.kind()),
        })?;
        match cursor_order {
            Ordering::Less => return Ok(PositionOrder::Before),
            Ordering::Greater => return Ok(PositionOrder::After),
            Ordering::Equal => {}
        }
        if self.pk.len() != other.pk.len() {
            return Err(IncomparablePositions {
                reason: format!("primary keys have {} and {} columns", self.pk.len(), other.pk.len()),
            });
        }
        for ((left_name, left), (right_name, right)) in self.pk.iter().zip(other.pk.iter()) {
            if left_name != right_name {
                return Err(IncomparablePositions {
                    reason: format!("primary key columns differ: {left_name} and {right_name}"),
                });
            }
            match (left, right) {
                (PkValue::Integer(a), PkValue::Integer(b)) => match a.cmp(b) {
                    Ordering::Less => return Ok(PositionOrder::Before),
                    Ordering::Greater => return Ok(PositionOrder::After),
                    Ordering::Equal => {}
                },
                (PkValue::Text(a), PkValue::Text(b)) if a == b => {}
                _ => return Ok(PositionOrder::Undetermined),
            }
        }
        Ok(PositionOrder::Same)
    }

    /// Whether this position can be bound to a seek on `configured` (the poller's key columns, in
    /// order): the same columns, as many, in the same order. A stored checkpoint may not fit after
    /// the key was changed; binding it anyway would index past its end or seek on the wrong column.
    pub fn fits_key(&self, configured: &[String]) -> Result<(), KeyMismatch> {
        let fits = self.pk.len() == configured.len()
            && self.pk.iter().zip(configured).all(|((stored, _), configured)| stored == configured);
        if fits {
            return Ok(());
        }
        Err(KeyMismatch {
            stored: self.pk.iter().map(|(name, _)| name.clone()).collect(),
            configured: configured.to_vec(),
        })
    }

    /// The tiebreaker object of the state document: `{"id": 42}`.
    pub fn tiebreaker_json(&self) -> Map<String, Value> {
        let mut map = Map::new();
        for (name, value) in &self.pk {
            map.insert(name.clone(), value.to_json());
        }
        map
    }
}

/// A position whose key columns are not the configured ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the checkpoint's key ({}) does not fit the configured key ({}): the key changed; reset the poller (`dbtrigger reset`)",
    stored.join(", "),
    configured.join(", ")
)]
pub struct KeyMismatch {
    pub stored: Vec<String>,
    pub configured: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("positions cannot be compared: {reason}")]
pub struct IncomparablePositions {
    pub reason: String,
}

/// The serialized form of a position: `checkpoint.cursor` in the state document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CursorJson {
    pub kind: String,
    pub value: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_text: Option<String>,
    #[serde(default)]
    pub tiebreaker: Map<String, Value>,
}

impl From<&Position> for CursorJson {
    fn from(position: &Position) -> Self {
        let source_text = match &position.cursor {
            CursorValue::Timestamp { source_text, .. } => source_text.clone(),
            CursorValue::Integer(_) | CursorValue::NaiveTimestamp(_) | CursorValue::Xid(_) => None,
        };
        CursorJson {
            kind: position.cursor.kind().to_string(),
            value: position.cursor.to_json(),
            source_text,
            tiebreaker: position.tiebreaker_json(),
        }
    }
}

impl TryFrom<&CursorJson> for Position {
    type Error = String;

    fn try_from(json: &CursorJson) -> Result<Self, Self::Error> {
        let cursor = match json.kind.as_str() {
            "integer" => match json.value.as_i64() {
                Some(number) => CursorValue::Integer(number),
                None => {
                    return Err(format!("integer cursor value {} is not an integer", json.value));
                }
            },
            "timestamp" => {
                let text = json
                    .value
                    .as_str()
                    .ok_or_else(|| format!("timestamp cursor value {} is not a string", json.value))?;
                let at = DateTime::parse_from_rfc3339(text)
                    .map_err(|error| format!("timestamp cursor value {text:?}: {error}"))?
                    .with_timezone(&Utc);
                CursorValue::Timestamp { at, source_text: json.source_text.clone() }
            }
            "timestamp_naive" => {
                let text = json
                    .value
                    .as_str()
                    .ok_or_else(|| format!("naive timestamp cursor value {} is not a string", json.value))?;
                let at = NaiveDateTime::parse_from_str(text, NAIVE_FORMAT)
                    .map_err(|error| format!("naive timestamp cursor value {text:?}: {error}"))?;
                CursorValue::NaiveTimestamp(at)
            }
            "xid" => {
                let text =
                    json.value.as_str().ok_or_else(|| format!("xid cursor value {} is not a string", json.value))?;
                CursorValue::Xid(parse_xid(text).ok_or_else(|| {
                    format!("xid cursor value {text:?} is not a transaction id (decimal digits, below 2^64)")
                })?)
            }
            other => return Err(format!("unknown cursor kind {other:?}")),
        };
        let mut pk = Vec::with_capacity(json.tiebreaker.len());
        for (name, value) in &json.tiebreaker {
            let pk_value = match value {
                Value::Number(number) => match number.as_i64() {
                    Some(integer) => PkValue::Integer(integer),
                    None => return Err(format!("tiebreaker {name} = {number} is not an integer")),
                },
                Value::String(text) => PkValue::Text(text.clone()),
                other => {
                    return Err(format!("tiebreaker {name} = {other} is neither an integer nor text"));
                }
            };
            pk.push((name.clone(), pk_value));
        }
        Ok(Position { cursor, pk })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixed instant: the domain never reads the clock, its tests neither.
    fn fixed_time() -> DateTime<Utc> {
        DateTime::from_timestamp(1_780_000_000, 0).unwrap()
    }

    fn int_position(cursor: i64, id: i64) -> Position {
        Position { cursor: CursorValue::Integer(cursor), pk: vec![("id".to_string(), PkValue::Integer(id))] }
    }

    /// Regression (issue 24, item 7): a key of other columns, another count or another order does
    /// not fit, and the refusal names both keys.
    #[test]
    fn a_position_fits_only_the_key_it_was_made_for() {
        let key = |columns: &[&str]| columns.iter().map(|column| column.to_string()).collect::<Vec<_>>();
        let position = Position {
            cursor: CursorValue::Integer(1),
            pk: vec![("tenant".into(), PkValue::Integer(1)), ("id".into(), PkValue::Integer(2))],
        };
        assert_eq!(position.fits_key(&key(&["tenant", "id"])), Ok(()));
        let reordered = position.fits_key(&key(&["id", "tenant"])).unwrap_err();
        assert_eq!(
            reordered.to_string(),
            "the checkpoint's key (tenant, id) does not fit the configured key (id, tenant): the key changed; reset the poller (`dbtrigger reset`)"
        );
        assert!(int_position(1, 2).fits_key(&key(&["tenant", "id"])).is_err());
        assert!(position.fits_key(&key(&["id"])).is_err());
        assert!(position.fits_key(&key(&["tenant", "code"])).is_err());
    }

    #[test]
    fn positions_order_by_cursor_then_pk() {
        assert_eq!(int_position(1, 9).order(&int_position(2, 1)), Ok(PositionOrder::Before));
        assert_eq!(int_position(2, 1).order(&int_position(2, 2)), Ok(PositionOrder::Before));
        assert_eq!(int_position(2, 2).order(&int_position(2, 2)), Ok(PositionOrder::Same));
        assert_eq!(int_position(3, 0).order(&int_position(2, 5)), Ok(PositionOrder::After));
    }

    #[test]
    fn text_keys_with_equal_cursors_are_left_to_the_database() {
        let left =
            Position { cursor: CursorValue::Integer(1), pk: vec![("code".to_string(), PkValue::Text("a".into()))] };
        let right =
            Position { cursor: CursorValue::Integer(1), pk: vec![("code".to_string(), PkValue::Text("B".into()))] };
        assert_eq!(left.order(&right), Ok(PositionOrder::Undetermined));
    }

    #[test]
    fn timestamp_round_trips_with_its_kind_and_source_text() {
        let position = Position {
            cursor: CursorValue::Timestamp {
                at: DateTime::parse_from_rfc3339("2026-04-07T01:23:45.123456Z").unwrap().with_timezone(&Utc),
                source_text: Some("2026-04-07 01:23:45.123456".into()),
            },
            pk: vec![("id".to_string(), PkValue::Integer(12093))],
        };
        let json = serde_json::to_value(CursorJson::from(&position)).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"kind": "timestamp", "value": "2026-04-07T01:23:45.123456Z",
                               "source_text": "2026-04-07 01:23:45.123456", "tiebreaker": {"id": 12093}})
        );
        let back: CursorJson = serde_json::from_value(json).unwrap();
        assert_eq!(Position::try_from(&back).unwrap(), position);
    }

    #[test]
    fn an_integer_cursor_stays_an_integer() {
        let json = serde_json::to_value(CursorJson::from(&int_position(42, 7))).unwrap();
        assert_eq!(json["value"], serde_json::json!(42));
        assert_eq!(json["kind"], "integer");
    }

    /// Regression (issue 9, item 2): SQLite timestamps with mixed offsets are ordered as SQLite's
    /// seek orders them (by their text), so a commit after such a row is not a "regression".
    #[test]
    fn sqlite_timestamps_order_by_their_stored_text_like_the_seek() {
        let stored = |text: &str| CursorValue::Timestamp {
            at: DateTime::parse_from_rfc3339(text).unwrap().with_timezone(&Utc),
            source_text: Some(text.to_string()),
        };
        let earlier_text = stored("2026-01-01T09:00:00+00:00");
        // 08:30 UTC: earlier in time, later in text order (and so later in the seek).
        let later_text = stored("2026-01-01T10:30:00+02:00");
        assert_eq!(later_text.compare(&earlier_text), Some(Ordering::Greater));
        assert_eq!(earlier_text.compare(&later_text), Some(Ordering::Less));
        let position = |cursor: CursorValue| Position { cursor, pk: vec![("id".to_string(), PkValue::Integer(1))] };
        assert_eq!(position(later_text).order(&position(earlier_text)), Ok(PositionOrder::After));
        // Without stored text (PostgreSQL, MySQL) timestamps are instants.
        let instant = |text: &str| CursorValue::Timestamp {
            at: DateTime::parse_from_rfc3339(text).unwrap().with_timezone(&Utc),
            source_text: None,
        };
        assert_eq!(
            instant("2026-01-01T10:30:00+02:00").compare(&instant("2026-01-01T09:00:00+00:00")),
            Some(Ordering::Less)
        );
    }

    /// Issue 26, item 1: an xid cursor is stored with its own kind, as a decimal string (no
    /// precision lost past 2^53), read back as the same value, and never compared with another kind.
    #[test]
    fn an_xid_cursor_round_trips_as_a_string_and_never_meets_another_kind() {
        let large = Position { cursor: CursorValue::Xid(u64::MAX - 1), pk: vec![("id".into(), PkValue::Integer(3))] };
        let json = serde_json::to_value(CursorJson::from(&large)).unwrap();
        assert_eq!(json, serde_json::json!({"kind": "xid", "value": "18446744073709551614", "tiebreaker": {"id": 3}}));
        let back: CursorJson = serde_json::from_value(json).unwrap();
        assert_eq!(Position::try_from(&back).unwrap(), large);
        let small = Position { cursor: CursorValue::Xid(740), pk: vec![("id".into(), PkValue::Integer(9))] };
        assert_eq!(small.order(&large), Ok(PositionOrder::Before));
        // Unsigned order, not the order of the signed integers the bits would make.
        assert_eq!(CursorValue::Xid(1 << 63).compare(&CursorValue::Xid(1)), Some(Ordering::Greater));
        assert!(small.order(&int_position(740, 9)).is_err(), "an xid never compares with an integer");
        assert_eq!(CursorValue::Xid(740).compare(&CursorValue::Integer(740)), None);
        for bad in [
            serde_json::json!(740),
            serde_json::json!("-1"),
            serde_json::json!("7 40"),
            serde_json::json!("18446744073709551616"),
            serde_json::json!(""),
        ] {
            let stored =
                CursorJson { kind: "xid".into(), value: bad.clone(), source_text: None, tiebreaker: Map::new() };
            assert!(Position::try_from(&stored).is_err(), "{bad} is not an xid");
        }
    }

    #[test]
    fn mixed_kinds_are_an_error_not_an_order() {
        let timestamp = Position {
            cursor: CursorValue::Timestamp { at: fixed_time(), source_text: None },
            pk: vec![("id".to_string(), PkValue::Integer(1))],
        };
        assert!(int_position(1, 1).order(&timestamp).is_err());
    }
}
