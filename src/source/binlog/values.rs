//! A binary log row's values as the JSON the polling MySQL source writes for the same column
//! (`what_mariadb_logs_decodes_to_the_polling_sources_json` compares them over every type):
//! integers as numbers, `TINYINT(1)` as a boolean, `DECIMAL` as its exact text, `DATETIME` as a
//! naive timestamp, `TIMESTAMP` in UTC, binary strings and `BIT` as base64, `ENUM` and `SET` as
//! their text (MariaDB's `JSON`, a `LONGTEXT` the polling source's driver reads as binary, as
//! base64 as there). The binary log names a column's storage type; what it cannot tell (a `TINYINT(1)`
//! from a `TINYINT`, an `ENUM`'s labels, a JSON column on MariaDB) is read from
//! `information_schema.COLUMNS` when a read starts ([`ColumnInfo`]).

use std::collections::HashMap;

use base64::Engine as _;
use chrono::{DateTime, NaiveDate, NaiveTime};
use mysql_async::binlog::row::BinlogRow;
use mysql_async::binlog::value::BinlogValue;
use mysql_async::consts::{ColumnFlags, ColumnType};
use serde_json::{Map, Value};

use crate::domain::CursorValue;

/// What `information_schema.COLUMNS` says of a column: `DATA_TYPE` and `COLUMN_TYPE`, lower case,
/// and whether it is in the primary key (`COLUMN_KEY = 'PRI'`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ColumnInfo {
    pub data_type: String,
    pub column_type: String,
    pub key: bool,
}

/// A table's columns by name.
pub type TableInfo = HashMap<String, ColumnInfo>;

/// The binary character set's number: a string column in it holds bytes.
const BINARY_CHARSET: u16 = 63;

/// A row image as JSON, its columns in the table's order; an error naming the column when the
/// server does not log names (`binlog_row_metadata` is not `FULL`).
pub fn row_json(row: &BinlogRow, info: Option<&TableInfo>) -> Result<Map<String, Value>, String> {
    let mut map = Map::with_capacity(row.len());
    for (index, column) in row.columns_ref().iter().enumerate() {
        let name = column.name_str();
        if let Some(offset) = name.strip_prefix('@') {
            return Err(format!(
                "the binary log does not name the columns of {}.{} (column {offset}): set binlog_row_metadata=FULL",
                column.schema_str(),
                column.table_str(),
            ));
        }
        let known = info.and_then(|info| info.get(name.as_ref()));
        let value = match row.as_ref(index) {
            None => continue,
            // MySQL's partial JSON update (`binlog_row_value_options=PARTIAL_JSON`) logs a diff, not
            // the value: never delivered as the column's value (nor as null).
            Some(BinlogValue::JsonDiff(_)) => {
                return Err(format!(
                    "column {name} of {}.{} is logged as a partial JSON update, not its value: set \
                     binlog_row_value_options='' on the server",
                    column.schema_str(),
                    column.table_str(),
                ));
            }
            Some(value) => value_json(value, column.column_type(), column.flags(), column.character_set(), known)
                .map_err(|reason| {
                    format!("column {name} of {}.{}: {reason}", column.schema_str(), column.table_str())
                })?,
        };
        map.insert(name.into_owned(), value);
    }
    Ok(map)
}

/// One value as JSON; an error saying what could not be read (never a stand-in value: the
/// read fails, the checkpoint stays before the change).
pub fn value_json(
    value: &BinlogValue<'_>,
    column_type: ColumnType,
    flags: ColumnFlags,
    charset: u16,
    info: Option<&ColumnInfo>,
) -> Result<Value, String> {
    use mysql_async::Value as V;
    let value = match value {
        BinlogValue::Value(value) => value,
        BinlogValue::Jsonb(jsonb) => {
            return serde_json::Value::try_from(jsonb.clone())
                .map_err(|error| format!("its JSON value cannot be converted to JSON text: {error}"));
        }
        BinlogValue::JsonDiff(_) => return Err("a partial JSON update, not its value".into()),
    };
    let data_type = info.map(|info| info.data_type.as_str()).unwrap_or("");
    let boolean = info.is_some_and(|info| info.column_type.starts_with("tinyint(1)"));
    Ok(match (value, column_type) {
        (V::NULL, _) => Value::Null,
        (V::Int(number), _) if boolean => Value::from(*number != 0),
        (V::UInt(number), _) if boolean => Value::from(*number != 0),
        (V::Int(index), ColumnType::MYSQL_TYPE_ENUM) => Value::from(enum_label(info, *index)),
        (V::Int(seconds), ColumnType::MYSQL_TYPE_TIMESTAMP) => timestamp(*seconds, 0),
        (V::Int(number), _) if flags.contains(ColumnFlags::UNSIGNED_FLAG) && *number < 0 => {
            // A BIGINT UNSIGNED past i64: the driver reads the bits as signed.
            Value::from(*number as u64)
        }
        (V::Int(number), _) => Value::from(*number),
        (V::UInt(number), _) => Value::from(*number),
        (V::Float(number), _) => float(f64::from(*number)),
        (V::Double(number), _) => float(*number),
        (V::Date(year, month, day, hour, minute, second, micros), ColumnType::MYSQL_TYPE_DATE)
        | (V::Date(year, month, day, hour, minute, second, micros), ColumnType::MYSQL_TYPE_NEWDATE)
            if (*hour, *minute, *second, *micros) == (0, 0, 0, 0) =>
        {
            match NaiveDate::from_ymd_opt(i32::from(*year), u32::from(*month), u32::from(*day)) {
                Some(date) => Value::from(date.to_string()),
                None => Value::from(format!("{year:04}-{month:02}-{day:02}")),
            }
        }
        (V::Date(year, month, day, hour, minute, second, micros), _) => {
            let at = NaiveDate::from_ymd_opt(i32::from(*year), u32::from(*month), u32::from(*day)).and_then(|date| {
                date.and_hms_micro_opt(u32::from(*hour), u32::from(*minute), u32::from(*second), *micros)
            });
            match at {
                Some(at) => CursorValue::NaiveTimestamp(at).to_json(),
                None => Value::from(format!("{year:04}-{month:02}-{day:02} {hour:02}:{minute:02}:{second:02}")),
            }
        }
        (V::Time(negative, days, hours, minutes, seconds, micros), _) => {
            match NaiveTime::from_hms_micro_opt(u32::from(*hours), u32::from(*minutes), u32::from(*seconds), *micros)
                .filter(|_| !negative && *days == 0)
            {
                Some(time) => Value::from(time.to_string()),
                None => {
                    let hours = u64::from(*days) * 24 + u64::from(*hours);
                    let sign = if *negative { "-" } else { "" };
                    let fraction = if *micros > 0 { format!(".{micros:06}") } else { String::new() };
                    Value::from(format!("{sign}{hours:02}:{minutes:02}:{seconds:02}{fraction}"))
                }
            }
        }
        (V::Bytes(bytes), ColumnType::MYSQL_TYPE_TIMESTAMP2) => timestamp2(bytes)?,
        (V::Bytes(bytes), ColumnType::MYSQL_TYPE_YEAR) => {
            String::from_utf8_lossy(bytes).parse::<u64>().map(Value::from).unwrap_or(Value::Null)
        }
        (V::Bytes(bytes), ColumnType::MYSQL_TYPE_NEWDECIMAL | ColumnType::MYSQL_TYPE_DECIMAL) => {
            Value::from(String::from_utf8_lossy(bytes).into_owned())
        }
        (V::Bytes(bytes), ColumnType::MYSQL_TYPE_SET) => Value::from(set_labels(info, bytes)),
        (V::Bytes(bytes), ColumnType::MYSQL_TYPE_BIT) => base64(bytes),
        (V::Bytes(bytes), _) if charset == BINARY_CHARSET || is_binary(data_type) => base64(bytes),
        (V::Bytes(bytes), _) => Value::from(text(bytes, charset)),
    })
}

/// A `TIMESTAMP2` as the driver gives it: `seconds` since the epoch, `.micros` (six digits)
/// after them when not zero.
fn timestamp2(bytes: &[u8]) -> Result<Value, String> {
    let unreadable = || format!("a TIMESTAMP value that does not parse: {:?}", String::from_utf8_lossy(bytes));
    let text = std::str::from_utf8(bytes).map_err(|_| unreadable())?;
    let (seconds, fraction) = text.split_once('.').unwrap_or((text, ""));
    let seconds: i64 = seconds.parse().map_err(|_| unreadable())?;
    let micros = match fraction {
        "" => 0,
        digits if digits.len() <= 6 && digits.bytes().all(|byte| byte.is_ascii_digit()) => {
            format!("{digits:0<6}").parse::<u32>().map_err(|_| unreadable())?
        }
        _ => return Err(unreadable()),
    };
    Ok(timestamp(seconds, micros))
}

/// latin1's collations (MySQL's latin1 is Windows-1252).
const LATIN1_COLLATIONS: &[u16] = &[5, 8, 15, 31, 47, 48, 49, 94];

/// Windows-1252's characters at 0x80..=0x9F (the rest of latin1 is Unicode's first 256).
const CP1252_HIGH: [char; 32] = [
    '€', '\u{81}', '‚', 'ƒ', '„', '…', '†', '‡', 'ˆ', '‰', 'Š', '‹', 'Œ', '\u{8d}', 'Ž', '\u{8f}', '\u{90}', '‘', '’',
    '“', '”', '•', '–', '—', '˜', '™', 'š', '›', 'œ', '\u{9d}', 'ž', 'Ÿ',
];

/// A string column's bytes as text: latin1 decoded, anything else read as UTF-8 (utf8mb3 and
/// utf8mb4 are; another character set's non-ASCII bytes come out as U+FFFD).
fn text(bytes: &[u8], charset: u16) -> String {
    if LATIN1_COLLATIONS.contains(&charset) {
        return bytes
            .iter()
            .map(|byte| match byte {
                0x80..=0x9F => CP1252_HIGH[usize::from(byte - 0x80)],
                _ => char::from(*byte),
            })
            .collect();
    }
    String::from_utf8_lossy(bytes).into_owned()
}

fn is_binary(data_type: &str) -> bool {
    matches!(data_type, "binary" | "varbinary" | "tinyblob" | "blob" | "mediumblob" | "longblob" | "bit")
}

fn base64(bytes: &[u8]) -> Value {
    Value::from(base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn float(number: f64) -> Value {
    serde_json::Number::from_f64(number).map(Value::Number).unwrap_or(Value::Null)
}

fn timestamp(seconds: i64, micros: u32) -> Value {
    match DateTime::from_timestamp(seconds, micros.saturating_mul(1000)) {
        Some(at) => CursorValue::Timestamp { at, source_text: None }.to_json(),
        None => Value::from(seconds),
    }
}

/// The labels of an `enum(…)` or `set(…)` column type, in order.
fn labels(info: Option<&ColumnInfo>) -> Vec<String> {
    let Some(info) = info else { return Vec::new() };
    let inside = info
        .column_type
        .split_once('(')
        .and_then(|(_, rest)| rest.rsplit_once(')'))
        .map(|(inside, _)| inside)
        .unwrap_or("");
    let mut labels = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    let mut characters = inside.chars().peekable();
    while let Some(character) = characters.next() {
        match (character, quoted) {
            ('\'', false) => quoted = true,
            ('\'', true) if characters.peek() == Some(&'\'') => {
                characters.next();
                current.push('\'');
            }
            ('\'', true) => {
                quoted = false;
                labels.push(std::mem::take(&mut current));
            }
            (_, true) => current.push(character),
            _ => {}
        }
    }
    labels
}

/// An `ENUM` value's label (index 0 is the empty string of an invalid value).
fn enum_label(info: Option<&ColumnInfo>, index: i64) -> String {
    usize::try_from(index)
        .ok()
        .and_then(|index| index.checked_sub(1))
        .and_then(|index| labels(info).get(index).cloned())
        .unwrap_or_else(|| if index == 0 { String::new() } else { index.to_string() })
}

/// A `SET` value's labels, comma-separated as the server writes them (the bits little-endian).
fn set_labels(info: Option<&ColumnInfo>, bits: &[u8]) -> String {
    let labels = labels(info);
    let mut chosen = Vec::new();
    for (index, label) in labels.iter().enumerate() {
        if bits.get(index / 8).is_some_and(|byte| byte & (1 << (index % 8)) != 0) {
            chosen.push(label.as_str());
        }
    }
    chosen.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(column_type: &str) -> ColumnInfo {
        ColumnInfo {
            data_type: column_type.split('(').next().unwrap().into(),
            column_type: column_type.into(),
            key: false,
        }
    }

    #[test]
    fn enum_and_set_labels_come_from_the_column_type() {
        let colour = info("enum('red','it''s','blue')");
        assert_eq!(enum_label(Some(&colour), 2), "it's");
        assert_eq!(enum_label(Some(&colour), 0), "");
        let flags = info("set('a','b','c')");
        assert_eq!(set_labels(Some(&flags), &[0b101]), "a,c");
    }

    fn row(column_type: ColumnType, value: BinlogValue<'static>) -> BinlogRow {
        let column = mysql_async::Column::new(column_type).with_schema(b"shop").with_table(b"orders").with_name(b"at");
        BinlogRow::new(vec![Some(value)], vec![column].into())
    }

    /// A value the decoder cannot read fails the read naming the column (the reader adds the
    /// event's position), never delivered as a stand-in: a JSON value's conversion error was
    /// its text, an unparsable TIMESTAMP 1970-01-01 (issue 45 #5).
    #[test]
    fn a_value_that_cannot_be_read_fails_naming_its_column() {
        let opaque = mysql_async::binlog::jsonb::Value::Opaque(mysql_async::binlog::jsonb::OpaqueValue::new(
            ColumnType::MYSQL_TYPE_NEWDECIMAL,
            &b"\x01"[..],
        ));
        let error = row_json(&row(ColumnType::MYSQL_TYPE_JSON, BinlogValue::Jsonb(opaque)), None).unwrap_err();
        assert!(error.starts_with("column at of shop.orders: its JSON value cannot be converted"), "{error}");
        assert!(error.contains("opaque"), "{error}");
        let invalid_utf8 =
            mysql_async::binlog::jsonb::Value::String(mysql_async::binlog::jsonb::JsonbString::new(&b"\xff\xfe"[..]));
        let error = row_json(&row(ColumnType::MYSQL_TYPE_JSON, BinlogValue::Jsonb(invalid_utf8)), None).unwrap_err();
        assert!(error.contains("column at of shop.orders") && error.contains("UTF-8"), "{error}");
        for unreadable in
            [&b"soon"[..], &b"17000000x"[..], &b"1700000000.12x"[..], &b"1700000000.1234567"[..], &b"\xff"[..]]
        {
            let value = BinlogValue::Value(mysql_async::Value::Bytes(unreadable.to_vec()));
            let error = row_json(&row(ColumnType::MYSQL_TYPE_TIMESTAMP2, value), None).unwrap_err();
            assert!(error.starts_with("column at of shop.orders: a TIMESTAMP value that does not parse"), "{error}");
        }
        for (bytes, seconds, micros) in
            [(&b"1700000000"[..], 1_700_000_000, 0), (&b"1700000000.000123"[..], 1_700_000_000, 123)]
        {
            let value = BinlogValue::Value(mysql_async::Value::Bytes(bytes.to_vec()));
            let read = row_json(&row(ColumnType::MYSQL_TYPE_TIMESTAMP2, value), None).unwrap();
            assert_eq!(read["at"], timestamp(seconds, micros));
        }
        let good = mysql_async::binlog::jsonb::Value::I32(7);
        assert_eq!(row_json(&row(ColumnType::MYSQL_TYPE_JSON, BinlogValue::Jsonb(good)), None).unwrap()["at"], 7);
    }

    #[test]
    fn latin1_text_is_decoded_and_utf8_read_as_it_is() {
        assert_eq!(text(&[b'h', 0xE9, 0x80], 8), "hé€");
        assert_eq!(text("hé".as_bytes(), 45), "hé");
    }
}
