//! A pgoutput value (its type's text form) as JSON, by its type OID: the same JSON the polling
//! PostgreSQL source writes for the same value (integers as numbers, numeric as its exact text,
//! timestamps as RFC 3339 in UTC, naive timestamps without a zone, bytea as base64, json parsed).
//! A type the polling source does not know is delivered as its text form.
//!
//! The text forms assumed are those of a session with `DateStyle=ISO`, `TimeZone=UTC`,
//! `IntervalStyle=postgres` and `extra_float_digits=3`: the logical source sets them on connect.

use base64::Engine as _;
use chrono::{DateTime, NaiveDate, NaiveDateTime, NaiveTime, SecondsFormat, Utc};
use serde_json::Value;

use crate::domain::CursorValue;

pub const BOOL: u32 = 16;
pub const BYTEA: u32 = 17;
pub const INT8: u32 = 20;
pub const INT2: u32 = 21;
pub const INT4: u32 = 23;
pub const OID: u32 = 26;
pub const JSON: u32 = 114;
pub const FLOAT4: u32 = 700;
pub const FLOAT8: u32 = 701;
pub const DATE: u32 = 1082;
pub const TIME: u32 = 1083;
pub const TIMESTAMP: u32 = 1114;
pub const TIMESTAMPTZ: u32 = 1184;
pub const NUMERIC: u32 = 1700;
pub const UUID: u32 = 2950;
pub const JSONB: u32 = 3802;
pub const XID8: u32 = 5069;

/// A value whose text the decoder could not read as its type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("column {column:?} (type OID {type_oid}): {reason}")]
pub struct ValueError {
    pub column: String,
    pub type_oid: u32,
    pub reason: String,
}

/// The JSON of one value of type `type_oid` in its text form.
pub fn to_json(column: &str, type_oid: u32, text: &str) -> Result<Value, ValueError> {
    let failed = |reason: String| ValueError { column: column.to_string(), type_oid, reason };
    let value = match type_oid {
        BOOL => match text {
            "t" => Value::Bool(true),
            "f" => Value::Bool(false),
            other => return Err(failed(format!("{other:?} is not a boolean"))),
        },
        INT2 | INT4 | INT8 | OID => {
            Value::from(text.parse::<i64>().map_err(|_| failed(format!("{text:?} is not an integer")))?)
        }
        FLOAT4 | FLOAT8 => match text {
            // As the polling source: what JSON cannot hold is null.
            "NaN" | "Infinity" | "-Infinity" => Value::Null,
            _ => {
                let number = text.parse::<f64>().map_err(|_| failed(format!("{text:?} is not a number")))?;
                serde_json::Number::from_f64(number).map(Value::Number).unwrap_or(Value::Null)
            }
        },
        JSON | JSONB => serde_json::from_str(text).map_err(|error| failed(format!("not JSON: {error}")))?,
        BYTEA => {
            let hex = text.strip_prefix("\\x").ok_or_else(|| failed("bytea not in hex form (bytea_output)".into()))?;
            Value::from(
                base64::engine::general_purpose::STANDARD
                    .encode(decode_hex(hex).ok_or_else(|| failed("bad hex digits".into()))?),
            )
        }
        DATE => match text {
            "infinity" | "-infinity" => Value::from(text),
            _ => Value::from(
                NaiveDate::parse_from_str(text, "%Y-%m-%d")
                    .map_err(|_| failed(format!("{text:?} is not an ISO date")))?
                    .to_string(),
            ),
        },
        TIME => Value::from(
            NaiveTime::parse_from_str(text, "%H:%M:%S%.f")
                .map_err(|_| failed(format!("{text:?} is not a time")))?
                .to_string(),
        ),
        TIMESTAMP => match text {
            "infinity" | "-infinity" => Value::from(text),
            _ => {
                CursorValue::NaiveTimestamp(naive(text).ok_or_else(|| failed(format!("{text:?} is not a timestamp")))?)
                    .to_json()
            }
        },
        TIMESTAMPTZ => match text {
            "infinity" | "-infinity" => Value::from(text),
            _ => Value::from(
                timestamptz(text)
                    .ok_or_else(|| failed(format!("{text:?} is not a timestamp with time zone")))?
                    .to_rfc3339_opts(SecondsFormat::AutoSi, true),
            ),
        },
        XID8 => Value::from(text),
        // numeric (exact digits), text types, uuid and any other type: the text form.
        _ => Value::from(text),
    };
    Ok(value)
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let digit = |byte: u8| -> Option<u8> { (byte as char).to_digit(16).map(|digit| digit as u8) };
    hex.as_bytes().chunks(2).map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?)).collect()
}

/// `2026-11-26 10:11:12.5`: ISO with a space; BC years are not supported.
fn naive(text: &str) -> Option<NaiveDateTime> {
    NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f").ok()
}

/// `2026-11-26 10:11:12.5+00`, `+05:30`, `-03:30:15`: the session's zone (UTC) or any offset.
fn timestamptz(text: &str) -> Option<DateTime<Utc>> {
    let split = text.rfind(['+', '-']).filter(|index| *index > 10)?;
    let (local, offset) = text.split_at(split);
    let sign: i64 = if offset.starts_with('-') { -1 } else { 1 };
    let mut parts = offset[1..].split(':');
    let hours: i64 = parts.next()?.parse().ok()?;
    let minutes: i64 = parts.next().map_or(Some(0), |part| part.parse().ok())?;
    let seconds: i64 = parts.next().map_or(Some(0), |part| part.parse().ok())?;
    if parts.next().is_some() {
        return None;
    }
    let local = naive(local)?;
    let offset = chrono::Duration::seconds(sign * (hours * 3600 + minutes * 60 + seconds));
    Some(local.checked_sub_signed(offset)?.and_utc())
}

/// Microseconds since 2000-01-01 UTC (pgoutput's timestamps) as RFC 3339.
pub fn pg_time(micros: i64) -> Value {
    let epoch = NaiveDate::from_ymd_opt(2000, 1, 1).expect("a valid date").and_hms_opt(0, 0, 0).expect("midnight");
    match epoch.checked_add_signed(chrono::Duration::microseconds(micros)) {
        Some(at) => Value::from(at.and_utc().to_rfc3339_opts(SecondsFormat::AutoSi, true)),
        None => Value::Null,
    }
}

/// An LSN as PostgreSQL prints it: `16/B374D848`.
pub fn lsn_text(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

/// An LSN in PostgreSQL's text form.
pub fn parse_lsn(text: &str) -> Option<u64> {
    let (high, low) = text.split_once('/')?;
    let high = u64::from_str_radix(high, 16).ok().filter(|high| *high <= 0xFFFF_FFFF)?;
    let low = u64::from_str_radix(low, 16).ok().filter(|low| *low <= 0xFFFF_FFFF)?;
    Some(high << 32 | low)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_become_the_json_the_polling_source_writes() {
        let cases: Vec<(u32, &str, Value)> = vec![
            (BOOL, "t", json!(true)),
            (BOOL, "f", json!(false)),
            (INT2, "-7", json!(-7)),
            (INT8, "9223372036854775807", json!(9223372036854775807i64)),
            (FLOAT8, "1.5", json!(1.5)),
            (FLOAT4, "NaN", Value::Null),
            (NUMERIC, "12345678901234567890.0123456789", json!("12345678901234567890.0123456789")),
            (NUMERIC, "7.00", json!("7.00")),
            (25, "hé \"q\"", json!("hé \"q\"")),
            (UUID, "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", json!("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")),
            (JSONB, "{\"a\": [1, 2]}", json!({"a": [1, 2]})),
            (BYTEA, "\\x00ff10", json!("AP8Q")),
            (DATE, "2026-11-26", json!("2026-11-26")),
            (DATE, "infinity", json!("infinity")),
            (TIME, "10:11:12.5", json!("10:11:12.500")),
            (TIMESTAMP, "2026-11-26 10:11:12.123456", json!("2026-11-26T10:11:12.123456")),
            (TIMESTAMP, "2026-11-26 10:11:12", json!("2026-11-26T10:11:12")),
            (TIMESTAMPTZ, "2026-11-26 10:11:12.5+00", json!("2026-11-26T10:11:12.500Z")),
            (TIMESTAMPTZ, "2026-11-26 10:11:12+05:30", json!("2026-11-26T04:41:12Z")),
            (TIMESTAMPTZ, "2026-11-26 01:00:00-03:30:15", json!("2026-11-26T04:30:15Z")),
            (XID8, "18446744073709551615", json!("18446744073709551615")),
        ];
        for (oid, text, expected) in cases {
            assert_eq!(to_json("c", oid, text).unwrap(), expected, "{oid} {text}");
        }
    }

    #[test]
    fn bad_text_is_an_error_naming_the_column() {
        for (oid, text) in
            [(BOOL, "yes"), (INT4, "1.5"), (JSON, "{"), (BYTEA, "\\x0"), (BYTEA, "00"), (TIMESTAMPTZ, "x")]
        {
            let error = to_json("amount", oid, text).unwrap_err();
            assert!(error.to_string().contains("\"amount\""), "{error}");
        }
    }

    #[test]
    fn lsns_print_and_parse_like_postgres() {
        assert_eq!(lsn_text(0x16_B374_D848), "16/B374D848");
        assert_eq!(parse_lsn("16/B374D848"), Some(0x16_B374_D848));
        assert_eq!(parse_lsn("0/0"), Some(0));
        assert_eq!(parse_lsn("1/100000000"), None);
        assert_eq!(parse_lsn("x"), None);
        assert_eq!(pg_time(0), json!("2000-01-01T00:00:00Z"));
        assert_eq!(pg_time(i64::MAX), Value::Null);
    }
}
