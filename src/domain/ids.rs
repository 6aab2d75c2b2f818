//! Deterministic identities: the same row version gets the same event id on every redelivery, the
//! same batch the same batch id, so that receivers can de-duplicate.

use serde::Serialize;
use sha2::{Digest, Sha256};

use super::cursor::Position;

fn sha256_hex(parts: &[&str]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        // Length-prefixed, so that ("ab", "c") and ("a", "bc") hash differently.
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    hex::encode(hasher.finalize())
}

fn position_key(position: &Position) -> String {
    format!(
        "{}|{}|{}",
        position.cursor.kind(),
        position.cursor.to_json(),
        serde_json::Value::Object(position.tiebreaker_json())
    )
}

/// Whether `name` may be one segment of a store path: the one rule every name that becomes part
/// of a path is held to (app name, poller name, function name, quarantine entry id), which every
/// store applies to every path it is given, and the configuration to the names it reads. Letters,
/// digits, `-`, `_` and `.`, not starting with `.`, at most 200 bytes: no name can climb out of its
/// folder (`..`, `/`, `\`), hide (`.name`), or carry a character a file system or a blob URL reads
/// differently. `Err` says why, for messages.
pub fn check_path_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("a name in a store path is empty".to_string());
    }
    if name.len() > 200 {
        return Err(format!("a name in a store path is {} bytes long: at most 200", name.len()));
    }
    if name.starts_with('.') {
        return Err(format!("{name:?} starts with '.': a name in a store path never does"));
    }
    let valid = name.chars().all(|character| character.is_ascii_alphanumeric() || matches!(character, '-' | '_' | '.'));
    if !valid {
        return Err(format!("{name:?} is not a name a store path may hold: letters, digits, '-', '_' and '.' only"));
    }
    Ok(())
}

/// `evt_` + 32 hex digits of sha256(poller, fingerprint, cursor, pk): the formula written plainly,
/// which [`EventIds`] (what ticks use) must agree with.
#[cfg(test)]
pub fn event_id(poller: &str, fingerprint: &str, position: &Position) -> String {
    let digest = sha256_hex(&[poller, fingerprint, &position_key(position)]);
    format!("evt_{}", &digest[..32])
}

/// The event ids of one poller: the same ids as [`event_id`], with the poller and fingerprint
/// hashed once instead of once per row.
pub struct EventIds {
    prefix: Sha256,
}

impl EventIds {
    pub fn new(poller: &str, fingerprint: &str) -> Self {
        let mut prefix = Sha256::new();
        for part in [poller, fingerprint] {
            prefix.update((part.len() as u64).to_be_bytes());
            prefix.update(part.as_bytes());
        }
        EventIds { prefix }
    }

    /// Appends the id of the row whose key (`kind|cursor|pk`, as [`super::event::position_key`]
    /// writes it) is `key` to `out`.
    pub fn write_id_of_key(&self, key: &[u8], out: &mut Vec<u8>) {
        let mut hasher = self.prefix.clone();
        hasher.update((key.len() as u64).to_be_bytes());
        hasher.update(key);
        let mut digits = [0u8; 32];
        hex::encode_to_slice(&hasher.finalize()[..16], &mut digits).expect("16 bytes are 32 hex digits");
        out.extend_from_slice(b"evt_");
        out.extend_from_slice(&digits);
    }

    /// The id of the row at `position` (what a batch's events get, one at a time: for the tests).
    #[cfg(test)]
    pub fn for_position(&self, position: &Position) -> String {
        let mut key = Vec::new();
        super::event::position_key(&mut key, position);
        let mut id = Vec::with_capacity(36);
        self.write_id_of_key(&key, &mut id);
        String::from_utf8(id).expect("an event id is ASCII")
    }
}

/// `bat_` + 32 hex digits of sha256(poller, fingerprint, first row, last row, row count).
pub fn batch_id(poller: &str, fingerprint: &str, first: &Position, last: &Position, rows: usize) -> String {
    let digest = sha256_hex(&[poller, fingerprint, &position_key(first), &position_key(last), &rows.to_string()]);
    format!("bat_{}", &digest[..32])
}

/// What identifies a source: if any of it changes, the checkpoint no longer means what it did.
/// The password is never part of it.
#[derive(Debug, Clone, Serialize)]
pub struct FingerprintInput<'a> {
    pub engine: &'a str,
    pub host: &'a str,
    pub port: Option<u16>,
    pub database: &'a str,
    pub user: &'a str,
    /// A Unix socket path, when the driver connects through one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket: Option<&'a str>,
    /// PostgreSQL's `options` (`-c search_path=…` changes which table a name means).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub options: Option<&'a str>,
    /// `table:schema.name` or `query:<sql>`.
    pub target: String,
    pub cursor: &'a str,
    pub pk: &'a [String],
    pub columns: Option<&'a [String]>,
    pub where_clause: Option<&'a str>,
}

/// `sha256:<hex>` of the canonical JSON of the input.
pub fn source_fingerprint(input: &FingerprintInput<'_>) -> String {
    let canonical = serde_json::to_string(input).expect("fingerprint input serializes");
    let digest = Sha256::digest(canonical.as_bytes());
    format!("sha256:{}", hex::encode(digest))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::cursor::{CursorValue, PkValue};

    fn position(cursor: i64, id: i64) -> Position {
        Position { cursor: CursorValue::Integer(cursor), pk: vec![("id".to_string(), PkValue::Integer(id))] }
    }

    #[test]
    fn event_ids_are_stable_and_distinct() {
        let first = event_id("orders", "sha256:x", &position(1, 1));
        // The per-poller form gives the very same ids (receivers de-duplicate on them).
        let ids = EventIds::new("orders", "sha256:x");
        let composite = Position {
            cursor: crate::domain::cursor::CursorValue::Timestamp {
                at: chrono::DateTime::from_timestamp(1_780_000_000, 5_000).unwrap(),
                source_text: Some("2026-05-28 20:26:40.000005".into()),
            },
            pk: vec![("tenant".into(), PkValue::Text("a\"b\\ é".into())), ("id".into(), PkValue::Integer(3))],
        };
        let naive = Position {
            cursor: crate::domain::cursor::CursorValue::NaiveTimestamp(
                chrono::DateTime::from_timestamp(1_780_000_000, 0).unwrap().naive_utc(),
            ),
            pk: vec![("code".into(), PkValue::Text(String::new()))],
        };
        for position in [position(1, 1), position(-7, 300), position(i64::MAX, 0), composite, naive] {
            assert_eq!(ids.for_position(&position), event_id("orders", "sha256:x", &position));
        }
        assert_eq!(first, event_id("orders", "sha256:x", &position(1, 1)));
        assert_ne!(first, event_id("orders", "sha256:x", &position(1, 2)));
        assert_ne!(first, event_id("orders", "sha256:x", &position(2, 1)));
        assert_ne!(first, event_id("invoices", "sha256:x", &position(1, 1)));
        assert!(first.starts_with("evt_") && first.len() == 36);
    }

    fn input<'a>(pk: &'a [String], where_clause: Option<&'a str>) -> FingerprintInput<'a> {
        FingerprintInput {
            engine: "sqlite",
            host: "",
            port: None,
            database: "/data/app.db",
            user: "",
            socket: None,
            options: None,
            target: "table:orders".to_string(),
            cursor: "updated_at",
            pk,
            columns: None,
            where_clause,
        }
    }

    #[test]
    fn the_fingerprint_changes_with_the_source_definition() {
        let pk = vec!["id".to_string()];
        let base = source_fingerprint(&input(&pk, None));
        assert!(base.starts_with("sha256:"));
        assert_eq!(base, source_fingerprint(&input(&pk, None)));
        assert_ne!(base, source_fingerprint(&input(&pk, Some("tenant = 7"))));
        let other_pk = vec!["code".to_string()];
        assert_ne!(base, source_fingerprint(&input(&other_pk, None)));
    }
}
