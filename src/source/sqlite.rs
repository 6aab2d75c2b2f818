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
use serde_json::Value;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions, SqliteRow};
use sqlx::{Row, TypeInfo, ValueRef};
use tokio::sync::OnceCell;

use super::query::{CursorType, SeekPlan, SeekQuery, build_seek};
use super::{Decoded, Role, Source, SourceError, SourceRow, classify, fetch_rows, role_of, warn_missing_index};
use crate::config::{SourceConfig, SourceTarget};
use crate::domain::{CursorValue, Position};

pub struct SqliteSource {
    pool: SqlitePool,
    config: SourceConfig,
    location: String,
    query: OnceCell<SeekQuery>,
}

impl SqliteSource {
    pub fn open(config: &SourceConfig) -> Result<Self, SourceError> {
        let location = config.url.expose().to_string();
        let options = SqliteConnectOptions::from_str(config.url.expose())
            .map_err(|error| SourceError::Unreachable { location: location.clone(), reason: error.to_string() })?
            .create_if_missing(false)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(options);
        Ok(SqliteSource { pool, config: config.clone(), location, query: OnceCell::new() })
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
                .map_err(|error| classify(&self.location, error))?;
        for index in &indexes {
            let index_name: String = index.try_get("name").unwrap_or_default();
            let first: Option<SqliteRow> =
                sqlx::query(sqlx::AssertSqlSafe(format!("PRAGMA {prefix}index_info(\"{index_name}\")")))
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(|error| classify(&self.location, error))?;
            let first_column: Option<String> = first.and_then(|row| row.try_get("name").ok());
            if first_column.as_deref() == Some(self.config.cursor.as_str()) {
                return Ok(());
            }
        }
        warn_missing_index(&self.location, name, &self.config);
        Ok(())
    }
}

fn decode_value(
    row: &SqliteRow,
    index: usize,
    name: &str,
    type_name: &str,
    role: Role,
) -> Result<Decoded, SourceError> {
    let failed = |error: sqlx::Error| SourceError::UnsupportedType {
        column: name.to_string(),
        type_name: format!("{type_name} ({error})"),
    };
    match type_name {
        "NULL" => Ok(Decoded::plain(Value::Null)),
        "INTEGER" | "INT" | "BIGINT" | "BOOLEAN" => Ok(Decoded::integer(row.try_get_unchecked(index).map_err(failed)?)),
        "REAL" | "FLOAT" | "DOUBLE" | "NUMERIC" => {
            let number: f64 = row.try_get_unchecked(index).map_err(failed)?;
            Ok(Decoded::float(number))
        }
        "TEXT" | "DATETIME" | "DATE" | "TIME" => {
            let text: String = row.try_get_unchecked(index).map_err(failed)?;
            if role == Role::Cursor {
                let at = parse_sqlite_timestamp(&text).ok_or_else(|| {
                    SourceError::Position(format!(
                        "cursor column {name:?} holds the text {text:?}, which is not a timestamp (use an integer or a timestamp cursor)"
                    ))
                })?;
                let cursor = CursorValue::Timestamp { at, source_text: Some(text.clone()) };
                return Ok(Decoded { json: cursor.to_json(), cursor: Some(cursor), key: None });
            }
            Ok(Decoded::text(text))
        }
        "BLOB" => {
            let bytes: Vec<u8> = row.try_get_unchecked(index).map_err(failed)?;
            Ok(Decoded::plain(Value::from(base64::engine::general_purpose::STANDARD.encode(bytes))))
        }
        other => Err(SourceError::UnsupportedType { column: name.to_string(), type_name: other.to_string() }),
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
    for format in ["%Y-%m-%d %H:%M:%S%.f", "%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M"] {
        if let Ok(parsed) = NaiveDateTime::parse_from_str(without_zulu, format) {
            return Some(parsed.and_utc());
        }
    }
    None
}

#[async_trait]
impl Source for SqliteSource {
    async fn fetch_after(&self, after: Option<&Position>, limit: usize) -> Result<Vec<SourceRow>, SourceError> {
        let seek = self.seek().await?;
        fetch_rows(&self.pool, &self.config, seek, after, limit, &self.location, |row, index, name| {
            // SQLite: each value has its own storage class, whatever the column declares.
            let raw =
                row.try_get_raw(index).map_err(|error| SourceError::Position(format!("column {name:?}: {error}")))?;
            let type_name =
                if raw.is_null() { "NULL".to_string() } else { raw.type_info().name().to_ascii_uppercase() };
            let value = decode_value(row, index, name, &type_name, role_of(&self.config, name))?;
            Ok((type_name, value))
        })
        .await
    }

    fn describe(&self) -> String {
        self.location.clone()
    }
}

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
            "2024-03-01 10:20:30.5+00:00",
            "2024-03-01T12:20:30.5+02:00",
        ] {
            assert_eq!(parse_sqlite_timestamp(text), Some(expected), "{text}");
        }
        assert_eq!(parse_sqlite_timestamp("yesterday"), None);
    }
}
