//! SQLite through sqlx. SQLite values carry their own storage class (INTEGER, REAL, TEXT, BLOB),
//! so rows are decoded by what each value is, not by the column's declared type.
//!
//! Timestamp cursors in SQLite are text. The checkpoint keeps the parsed time (typed, RFC 3339)
//! and the exact stored text, and the seek binds that text back: the predicate then agrees with
//! SQLite's own ORDER BY for any text layout, so no row is skipped or repeated.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use chrono::{DateTime, NaiveDateTime, Utc};
use serde_json::{Map, Value};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions, SqliteRow};
use sqlx::{Column, Row, TypeInfo, ValueRef};

use super::query::{SeekQuery, build_seek};
use super::{Source, SourceError, SourceRow};
use crate::config::SourceConfig;
use crate::domain::{CursorValue, PkValue, Position};

pub struct SqliteSource {
    pool: SqlitePool,
    query: SeekQuery,
    cursor: String,
    pk: Vec<String>,
    location: String,
}

impl SqliteSource {
    pub fn open(config: &SourceConfig) -> Result<Self, SourceError> {
        let location = config.url.expose().to_string();
        let options = SqliteConnectOptions::from_str(config.url.expose())
            .map_err(|error| SourceError::Unreachable {
                location: location.clone(),
                reason: error.to_string(),
            })?
            .create_if_missing(false)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(options);
        Ok(SqliteSource {
            pool,
            query: build_seek(config),
            cursor: config.cursor.clone(),
            pk: config.pk.clone(),
            location,
        })
    }

    fn decode(&self, row: &SqliteRow) -> Result<SourceRow, SourceError> {
        let mut values = Map::new();
        let mut cursor = None;
        let mut keys: Vec<Option<PkValue>> = vec![None; self.pk.len()];
        for (index, column) in row.columns().iter().enumerate() {
            let name = column.name();
            let (json, storage) = decode_value(row, index, name)?;
            if name == self.cursor {
                cursor = Some(cursor_value(name, &json, storage)?);
            }
            if let Some(key_index) = self.pk.iter().position(|key| key == name) {
                keys[key_index] = Some(pk_value(name, &json)?);
            }
            values.insert(name.to_string(), json);
        }
        let cursor = cursor.ok_or_else(|| {
            SourceError::Position(format!(
                "the cursor column {:?} is not in the result",
                self.cursor
            ))
        })?;
        let mut pk = Vec::with_capacity(self.pk.len());
        for (name, value) in self.pk.iter().zip(keys) {
            let value = value.ok_or_else(|| {
                SourceError::Position(format!(
                    "the primary key column {name:?} is not in the result"
                ))
            })?;
            pk.push((name.clone(), value));
        }
        Ok(SourceRow {
            position: Position { cursor, pk },
            row: values,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Storage {
    Null,
    Integer,
    Real,
    Text,
    Blob,
}

fn decode_value(
    row: &SqliteRow,
    index: usize,
    name: &str,
) -> Result<(Value, Storage), SourceError> {
    let raw = row
        .try_get_raw(index)
        .map_err(|error| SourceError::Position(format!("column {name:?}: {error}")))?;
    if raw.is_null() {
        return Ok((Value::Null, Storage::Null));
    }
    let type_name = raw.type_info().name().to_ascii_uppercase();
    let failed = |error: sqlx::Error| SourceError::UnsupportedType {
        column: name.to_string(),
        type_name: format!("{type_name} ({error})"),
    };
    match type_name.as_str() {
        "INTEGER" | "INT" | "BIGINT" | "BOOLEAN" => {
            let number: i64 = row.try_get_unchecked(index).map_err(failed)?;
            Ok((Value::from(number), Storage::Integer))
        }
        "REAL" | "FLOAT" | "DOUBLE" | "NUMERIC" => {
            let number: f64 = row.try_get_unchecked(index).map_err(failed)?;
            Ok((
                serde_json::Number::from_f64(number)
                    .map(Value::Number)
                    .unwrap_or(Value::Null),
                Storage::Real,
            ))
        }
        "TEXT" | "DATETIME" | "DATE" | "TIME" => {
            let text: String = row.try_get_unchecked(index).map_err(failed)?;
            Ok((Value::from(text), Storage::Text))
        }
        "BLOB" => {
            let bytes: Vec<u8> = row.try_get_unchecked(index).map_err(failed)?;
            Ok((
                Value::from(base64::engine::general_purpose::STANDARD.encode(bytes)),
                Storage::Blob,
            ))
        }
        _ => Err(SourceError::UnsupportedType {
            column: name.to_string(),
            type_name,
        }),
    }
}

fn cursor_value(name: &str, json: &Value, storage: Storage) -> Result<CursorValue, SourceError> {
    match (storage, json) {
        (Storage::Integer, Value::Number(number)) => {
            Ok(CursorValue::Integer(number.as_i64().unwrap_or_default()))
        }
        (Storage::Text, Value::String(text)) => {
            let at = parse_sqlite_timestamp(text).ok_or_else(|| {
                SourceError::Position(format!(
                    "cursor column {name:?} holds the text {text:?}, which is not a timestamp (use an integer or a timestamp cursor)"
                ))
            })?;
            Ok(CursorValue::Timestamp {
                at,
                source_text: Some(text.clone()),
            })
        }
        (Storage::Null, _) => Err(SourceError::Position(format!(
            "cursor column {name:?} is NULL in a row: a cursor must never be NULL (filter such rows with `where`)"
        ))),
        _ => Err(SourceError::Position(format!(
            "cursor column {name:?} holds a {storage:?} value: use an integer or a timestamp cursor"
        ))),
    }
}

fn pk_value(name: &str, json: &Value) -> Result<PkValue, SourceError> {
    match json {
        Value::Number(number) if number.is_i64() => {
            Ok(PkValue::Integer(number.as_i64().unwrap_or_default()))
        }
        Value::String(text) => Ok(PkValue::Text(text.clone())),
        other => Err(SourceError::Position(format!(
            "primary key column {name:?} holds {other}: keys must be integers or text, never NULL"
        ))),
    }
}

/// The layouts SQLite's date functions and common drivers write: with a space or a `T`, optional
/// fraction, optional `Z` or offset. Text without an offset is UTC.
pub fn parse_sqlite_timestamp(text: &str) -> Option<DateTime<Utc>> {
    if let Ok(parsed) = DateTime::parse_from_rfc3339(text) {
        return Some(parsed.with_timezone(&Utc));
    }
    for format in ["%Y-%m-%d %H:%M:%S%.f%:z", "%Y-%m-%d %H:%M:%S%.f%#z"] {
        if let Ok(parsed) = DateTime::parse_from_str(text, format) {
            return Some(parsed.with_timezone(&Utc));
        }
    }
    let without_zulu = text.strip_suffix('Z').unwrap_or(text);
    for format in [
        "%Y-%m-%d %H:%M:%S%.f",
        "%Y-%m-%dT%H:%M:%S%.f",
        "%Y-%m-%d %H:%M",
        "%Y-%m-%dT%H:%M",
    ] {
        if let Ok(parsed) = NaiveDateTime::parse_from_str(without_zulu, format) {
            return Some(parsed.and_utc());
        }
    }
    None
}

#[async_trait]
impl Source for SqliteSource {
    async fn fetch_after(
        &self,
        after: Option<&Position>,
        limit: usize,
    ) -> Result<Vec<SourceRow>, SourceError> {
        let rows = match after {
            None => {
                sqlx::query(sqlx::AssertSqlSafe(self.query.from_start.as_str()))
                    .bind(limit as i64)
                    .fetch_all(&self.pool)
                    .await
            }
            Some(position) => {
                let mut query = sqlx::query(sqlx::AssertSqlSafe(self.query.after.as_str()));
                query = match &position.cursor {
                    CursorValue::Integer(number) => query.bind(*number),
                    CursorValue::Timestamp {
                        source_text: Some(text),
                        ..
                    } => query.bind(text.clone()),
                    CursorValue::Timestamp {
                        at,
                        source_text: None,
                    } => query.bind(at.format("%Y-%m-%d %H:%M:%S%.f").to_string()),
                };
                for (_, key) in &position.pk {
                    query = match key {
                        PkValue::Integer(number) => query.bind(*number),
                        PkValue::Text(text) => query.bind(text.clone()),
                    };
                }
                query.bind(limit as i64).fetch_all(&self.pool).await
            }
        };
        let rows = rows.map_err(|error| classify(&self.location, error))?;
        let mut decoded = Vec::with_capacity(rows.len());
        for row in &rows {
            decoded.push(self.decode(row)?);
        }
        Ok(decoded)
    }

    fn describe(&self) -> String {
        self.location.clone()
    }
}

fn classify(location: &str, error: sqlx::Error) -> SourceError {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_) => SourceError::Unreachable {
            location: location.to_string(),
            reason: error.to_string(),
        },
        sqlx::Error::Database(database_error)
            if database_error.message().contains("unable to open") =>
        {
            SourceError::Unreachable {
                location: location.to_string(),
                reason: database_error.message().to_string(),
            }
        }
        other => SourceError::Query {
            location: location.to_string(),
            reason: other.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_timestamp_layouts_parse_as_utc() {
        let expected = DateTime::parse_from_rfc3339("2024-03-01T10:20:30.5Z")
            .unwrap()
            .with_timezone(&Utc);
        for text in [
            "2024-03-01 10:20:30.5",
            "2024-03-01T10:20:30.5",
            "2024-03-01T10:20:30.500Z",
            "2024-03-01 10:20:30.5+00:00",
            "2024-03-01T12:20:30.5+02:00",
        ] {
            assert_eq!(parse_sqlite_timestamp(text), Some(expected), "{text}");
        }
        assert_eq!(parse_sqlite_timestamp("yesterday"), None);
    }
}
