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

/// The JSON of one value of type `type_oid` in its text form. Every value PostgreSQL can send
/// becomes JSON: a text form the decoder cannot read as its type (`time '24:00:00'`, a date past
/// chrono's years, a malformed value) is delivered as that text, as a type it does not know is.
pub fn to_json(type_oid: u32, text: &str) -> Value {
    typed(type_oid, text).unwrap_or_else(|| Value::from(text))
}

fn typed(type_oid: u32, text: &str) -> Option<Value> {
    let value = match type_oid {
        BOOL => match text {
            "t" => Value::Bool(true),
            "f" => Value::Bool(false),
            _ => return None,
        },
        INT2 | INT4 | INT8 | OID => Value::from(text.parse::<i64>().ok()?),
        FLOAT4 | FLOAT8 => match text {
            // As the polling source: what JSON cannot hold is null.
            "NaN" | "Infinity" | "-Infinity" => Value::Null,
            _ => serde_json::Number::from_f64(text.parse::<f64>().ok()?).map(Value::Number).unwrap_or(Value::Null),
        },
        JSON | JSONB => serde_json::from_str(text).ok()?,
        BYTEA => Value::from(base64::engine::general_purpose::STANDARD.encode(decode_hex(text.strip_prefix("\\x")?)?)),
        DATE | TIMESTAMP | TIMESTAMPTZ if matches!(text, "infinity" | "-infinity") => Value::from(text),
        // As the polling source writes chrono's dates: `+10000-01-01`, `-0043-03-15` (44 BC).
        DATE => Value::from(date(text)?.to_string()),
        TIME => Value::from(NaiveTime::parse_from_str(text, "%H:%M:%S%.f").ok()?.to_string()),
        TIMESTAMP => CursorValue::NaiveTimestamp(naive(text)?).to_json(),
        TIMESTAMPTZ => Value::from(timestamptz(text)?.to_rfc3339_opts(SecondsFormat::AutoSi, true)),
        // numeric (exact digits), xid8, text types, uuid and any other type: the text form.
        _ => Value::from(text),
    };
    Some(value)
}

/// `2026-11-26`, `10000-01-01`, `0044-03-15 BC` (ISO, any number of year digits; 1 BC is year 0
/// as chrono counts).
fn date(text: &str) -> Option<NaiveDate> {
    let (text, bc) = match text.strip_suffix(" BC") {
        Some(text) => (text, true),
        None => (text, false),
    };
    let mut parts = text.splitn(3, '-');
    let year: i32 = parts.next().filter(|year| year.bytes().all(|byte| byte.is_ascii_digit()))?.parse().ok()?;
    let month: u32 = parts.next()?.parse().ok()?;
    let day: u32 = parts.next()?.parse().ok()?;
    NaiveDate::from_ymd_opt(if bc { 1 - year } else { year }, month, day)
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let digit = |byte: u8| -> Option<u8> { (byte as char).to_digit(16).map(|digit| digit as u8) };
    hex.as_bytes().chunks(2).map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?)).collect()
}

/// `2026-11-26 10:11:12.5`: ISO with a space, any number of year digits, ` BC` at the end.
fn naive(text: &str) -> Option<NaiveDateTime> {
    let (text, bc) = match text.strip_suffix(" BC") {
        Some(text) => (text, " BC"),
        None => (text, ""),
    };
    let (day, time) = text.split_once(' ')?;
    Some(date(&format!("{day}{bc}"))?.and_time(NaiveTime::parse_from_str(time, "%H:%M:%S%.f").ok()?))
}

/// `2026-11-26 10:11:12.5+00`, `+05:30`, `-03:30:15`: the session's zone (UTC) or any offset.
fn timestamptz(text: &str) -> Option<DateTime<Utc>> {
    let (text, bc) = match text.strip_suffix(" BC") {
        Some(text) => (text, " BC"),
        None => (text, ""),
    };
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
    let local = naive(&format!("{local}{bc}"))?;
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
            assert_eq!(to_json(oid, text), expected, "{oid} {text}");
        }
    }

    /// Regression (issue 37, finding 3): values PostgreSQL sends that chrono cannot read as their
    /// type (or reads only with a year past 9999 or before 1) stopped the poller for good.
    #[test]
    fn every_value_postgres_can_send_decodes() {
        let cases: Vec<(u32, &str, Value)> = vec![
            (TIME, "24:00:00", json!("24:00:00")),
            (DATE, "10000-01-01", json!("+10000-01-01")),
            (DATE, "0044-03-15 BC", json!("-0043-03-15")),
            (DATE, "5874897-12-31", json!("5874897-12-31")),
            (TIMESTAMP, "10000-01-01 00:00:00", json!("+10000-01-01T00:00:00")),
            (TIMESTAMP, "0044-03-15 12:00:00 BC", json!("-0043-03-15T12:00:00")),
            (TIMESTAMPTZ, "0044-03-15 12:00:00+00 BC", json!("-0043-03-15T12:00:00Z")),
            (TIMESTAMPTZ, "10000-01-01 00:00:00+00", json!("+10000-01-01T00:00:00Z")),
            // Text a type's reader does not take: its text form, never an error.
            (BOOL, "yes", json!("yes")),
            (INT4, "1.5", json!("1.5")),
            (JSON, "{", json!("{")),
            (BYTEA, "\\x0", json!("\\x0")),
        ];
        for (oid, text, expected) in cases {
            assert_eq!(to_json(oid, text), expected, "{oid} {text}");
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
