//! SQLite through sqlx. SQLite values carry their own storage class (INTEGER, REAL, TEXT, BLOB),
//! so rows are decoded by what each value is, not by the column's declared type.
//!
//! Timestamp cursors in SQLite are text. The checkpoint keeps the parsed time (typed, RFC 3339)
//! and the exact stored text, and the seek binds that text back: rows are ordered as SQLite orders
//! them, by their text (BINARY collation), and the checkpoint compares that same text. Text order
//! is time order only when every value has one layout and one offset (UTC, ideally): the README
//! says so. A cursor text must be a layout SQLite's date functions read (the settle predicate uses
//! `julianday`); any other is an error naming the row, never a row silently held back.

use std::str::FromStr;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use base64::Engine as _;
use chrono::{DateTime, NaiveDateTime, Utc};
use serde_json::Value;
use sqlx::sqlite::{Sqlite, SqliteConnectOptions, SqlitePool, SqliteRow, SqliteValueRef};
use sqlx::{Decode, Row, TypeInfo, ValueRef};
use tokio::sync::OnceCell;

use super::query::{CursorType, SeekPlan, SeekQuery, build_seek};
use super::{ColumnDecoder, Decoded, SourceError, classify, warn_missing_index};
use crate::config::redact::Redaction;
use crate::config::{SourceConfig, SourceTarget};
use crate::domain::CursorValue;

pub struct SqliteSource {
    pool: SqlitePool,
    config: SourceConfig,
    redaction: Redaction,
    query: OnceCell<SeekQuery>,
    settle_warned: AtomicBool,
}

impl SqliteSource {
    pub fn open(config: &SourceConfig) -> Result<Self, SourceError> {
        let redaction = Redaction::of_url(config.url.expose());
        let options = SqliteConnectOptions::from_str(config.url.expose())
            .map_err(|error| SourceError::Unreachable {
                location: redaction.location.clone(),
                reason: redaction.scrub(&error.to_string()),
            })?
            .create_if_missing(false)
            .busy_timeout(Duration::from_secs(5))
            .row_buffer_size(config.read_ahead_rows);
        let pool = super::pool_options().connect_lazy_with(options);
        Ok(SqliteSource {
            pool,
            config: config.clone(),
            redaction,
            query: OnceCell::new(),
            settle_warned: AtomicBool::new(false),
        })
    }

    async fn seek(&self) -> Result<&SeekQuery, SourceError> {
        self.query
            .get_or_try_init(|| async {
                self.warn_without_index().await?;
                Ok(build_seek(&self.config, &SeekPlan { cursor_type: CursorType::Dynamic, placeholder_types: None }))
            })
            .await
    }

    /// Warns once when no index of the table starts with the cursor column.
    async fn warn_without_index(&self) -> Result<(), SourceError> {
        let SourceTarget::Table { schema, name } = &self.config.target else {
            return Ok(());
        };
        let prefix = schema.as_ref().map(|schema| format!("\"{schema}\".")).unwrap_or_default();
        let indexes: Vec<SqliteRow> =
            sqlx::query(sqlx::AssertSqlSafe(format!("PRAGMA {prefix}index_list(\"{name}\")")))
                .fetch_all(&self.pool)
                .await
                .map_err(|error| classify(&self.redaction, error))?;
        for index in &indexes {
            let index_name: String = index.try_get("name").unwrap_or_default();
            // The index name comes from the catalog, not from validated configuration: quoted.
            let quoted_index = index_name.replace('"', "\"\"");
            let first: Option<SqliteRow> =
                sqlx::query(sqlx::AssertSqlSafe(format!("PRAGMA {prefix}index_info(\"{quoted_index}\")")))
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(|error| classify(&self.redaction, error))?;
            let first_column: Option<String> = first.and_then(|row| row.try_get("name").ok());
            if first_column.as_deref() == Some(self.config.cursor.as_str()) {
                return Ok(());
            }
        }
        warn_missing_index(&self.redaction.location, name, &self.config);
        Ok(())
    }
}

/// The value `raw` of column `name`, whose storage class is `type_name`.
fn decode_value<'r>(
    raw: SqliteValueRef<'r>,
    name: &str,
    type_name: &str,
    is_cursor: bool,
) -> Result<Decoded<'r>, SourceError> {
    let failed = |error: sqlx::error::BoxDynError| SourceError::UnsupportedType {
        column: name.to_string(),
        type_name: format!("{type_name} ({error})"),
    };
    match type_name {
        "NULL" => Ok(Decoded::plain(Value::Null)),
        "INTEGER" | "INT" | "BIGINT" | "BOOLEAN" => {
            Ok(Decoded::integer(<i64 as Decode<Sqlite>>::decode(raw).map_err(failed)?))
        }
        "REAL" | "FLOAT" | "DOUBLE" | "NUMERIC" => {
            Ok(Decoded::float(<f64 as Decode<Sqlite>>::decode(raw).map_err(failed)?))
        }
        "TEXT" | "DATETIME" | "DATE" | "TIME" => {
            if !is_cursor {
                return Ok(Decoded::borrowed_text(<&str as Decode<Sqlite>>::decode(raw).map_err(failed)?));
            }
            let text = <String as Decode<Sqlite>>::decode(raw).map_err(failed)?;
            let Some(at) = parse_sqlite_timestamp(&text) else {
                let why = format!(
                    "the text {text:?} is not a timestamp layout SQLite's date functions read \
                     (YYYY-MM-DD HH:MM[:SS[.fff]] with ' ' or 'T', then nothing, 'Z' or ±HH:MM): \
                     fix the value, or filter such rows with `where`"
                );
                return Ok(Decoded::not_a_position(Value::from(text), why));
            };
            Ok(Decoded::moment(CursorValue::Timestamp { at, source_text: Some(text) }))
        }
        "BLOB" => {
            let bytes = <Vec<u8> as Decode<Sqlite>>::decode(raw).map_err(failed)?;
            Ok(Decoded::plain(Value::from(base64::engine::general_purpose::STANDARD.encode(bytes))))
        }
        other => Err(SourceError::UnsupportedType { column: name.to_string(), type_name: other.to_string() }),
    }
}

/// A cursor text as a point in time, for exactly the layouts SQLite's `julianday()` also reads,
/// so that the settle predicate (which uses it) and the checkpoint agree on every row:
/// `YYYY-MM-DD`, a space or an upper-case `T`, `HH:MM`, optional `:SS` and `.fraction`, then
/// nothing (UTC), `Z`/`z`, or an offset `±HH:MM` of at most 14 hours. Anything else (`+0200`,
/// `+02`, a lower-case `t`, a date alone) is `None`: the row is reported, not skipped.
pub fn parse_sqlite_timestamp(text: &str) -> Option<DateTime<Utc>> {
    let bytes = text.as_bytes();
    let digits =
        |range: std::ops::Range<usize>| bytes.get(range).is_some_and(|part| part.iter().all(u8::is_ascii_digit));
    // YYYY-MM-DD?HH:MM
    let shape = digits(0..4)
        && bytes.get(4) == Some(&b'-')
        && digits(5..7)
        && bytes.get(7) == Some(&b'-')
        && digits(8..10)
        && matches!(bytes.get(10), Some(b' ' | b'T'))
        && digits(11..13)
        && bytes.get(13) == Some(&b':')
        && digits(14..16);
    if !shape {
        return None;
    }
    let mut end = 16;
    if bytes.get(end) == Some(&b':') {
        if !digits(end + 1..end + 3) {
            return None;
        }
        end += 3;
        if bytes.get(end) == Some(&b'.') {
            let fraction_digits = bytes[end + 1..].iter().take_while(|byte| byte.is_ascii_digit()).count();
            if fraction_digits == 0 {
                return None;
            }
            end += 1 + fraction_digits;
        }
    }
    let offset_seconds: i32 = match &bytes[end..] {
        [] | [b'Z'] | [b'z'] => 0,
        [sign @ (b'+' | b'-'), hours @ ..] if hours.len() == 5 && hours[2] == b':' => {
            if !digits(end + 1..end + 3) || !digits(end + 4..end + 6) {
                return None;
            }
            let hour = i32::from(hours[0] - b'0') * 10 + i32::from(hours[1] - b'0');
            let minute = i32::from(hours[3] - b'0') * 10 + i32::from(hours[4] - b'0');
            if hour > 14 || minute > 59 || (hour == 14 && minute > 0) {
                return None;
            }
            let seconds = hour * 3600 + minute * 60;
            if *sign == b'-' { -seconds } else { seconds }
        }
        _ => return None,
    };
    let local = &text[..end];
    // Seconds of 60 (a leap second to chrono) are not a time to SQLite.
    if end >= 19 && &text[17..19] >= "60" {
        return None;
    }
    let format = if end == 16 { "%Y-%m-%d %H:%M" } else { "%Y-%m-%d %H:%M:%S%.f" };
    let normalized = local.replacen('T', " ", 1);
    let naive = NaiveDateTime::parse_from_str(&normalized, format).ok()?;
    Some(naive.and_utc() - chrono::Duration::seconds(i64::from(offset_seconds)))
}

/// The storage class of a value (SQLite: each value has its own, whatever the column declares).
fn storage_class(raw: &sqlx::sqlite::SqliteValueRef<'_>) -> std::borrow::Cow<'static, str> {
    if raw.is_null() {
        return "NULL".into();
    }
    let type_info = raw.type_info();
    let name = type_info.name();
    // sqlx names a value's own class in capitals: those need no search.
    match name {
        "INTEGER" => return "INTEGER".into(),
        "REAL" => return "REAL".into(),
        "TEXT" => return "TEXT".into(),
        "BLOB" => return "BLOB".into(),
        _ => {}
    }
    match [
        "INTEGER", "REAL", "TEXT", "BLOB", "NUMERIC", "BOOLEAN", "DATE", "TIME", "DATETIME", "INT", "BIGINT", "FLOAT",
        "DOUBLE",
    ]
    .into_iter()
    .find(|known| known.eq_ignore_ascii_case(name))
    {
        Some(known) => known.into(),
        None => name.to_ascii_uppercase().into(),
    }
}

impl ColumnDecoder<SqliteRow> for SqliteSource {
    fn decode_column<'r>(&self, row: &'r SqliteRow, index: usize, name: &str) -> Result<Decoded<'r>, SourceError> {
        let raw = row.try_get_raw(index).map_err(|error| SourceError::Position(format!("column {name:?}: {error}")))?;
        let class = storage_class(&raw);
        decode_value(raw, name, &class, name == self.config.cursor)
    }

    fn column_type(&self, row: &SqliteRow, index: usize) -> String {
        row.try_get_raw(index).map(|raw| storage_class(&raw).into_owned()).unwrap_or_else(|error| error.to_string())
    }
}

super::sql_source!(SqliteSource);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_timestamp_layouts_parse_as_utc() {
        let expected = DateTime::parse_from_rfc3339("2024-03-01T10:20:30.5Z").unwrap().with_timezone(&Utc);
        for text in [
            "2024-03-01 10:20:30.5",
            "2024-03-01T10:20:30.5",
            "2024-03-01T10:20:30.500Z",
            "2024-03-01T10:20:30.500z",
            "2024-03-01 10:20:30.5+00:00",
            "2024-03-01T12:20:30.5+02:00",
            "2024-03-01T08:50:30.5-01:30",
        ] {
            assert_eq!(parse_sqlite_timestamp(text), Some(expected), "{text}");
        }
        assert_eq!(
            parse_sqlite_timestamp("2024-03-01 10:20"),
            Some(DateTime::parse_from_rfc3339("2024-03-01T10:20:00Z").unwrap().with_timezone(&Utc))
        );
        // Layouts julianday() cannot read are not timestamps here either.
        for text in [
            "yesterday",
            "2024-03-01T10:20:30+0200",
            "2024-03-01T10:20:30+02",
            "2024-03-01t10:20:30",
            "2024-03-01",
            "2024-03-01 10:20:60",
            "2024-03-01 10:20:30.",
            "2024-03-01 10:20:30+15:00",
            "2024-03-01 1:20:30",
        ] {
            assert_eq!(parse_sqlite_timestamp(text), None, "{text}");
        }
    }
}
