//! Where rows come from: a trait with one question, "the next rows after this position", and its
//! SQL implementations over sqlx for SQLite, PostgreSQL and MySQL/MariaDB. Dialect differences live
//! in [`query`] (the SQL) and in each engine's module (decoding values).
//!
//! Before its first seek a source runs a pre-flight, once: it prepares the query to learn the
//! cursor's type (which shapes the settle predicate and the placeholders' casts), and warns once
//! when no index starts with (cursor, pk...), since the seek's cost then grows with the table.

pub mod mysql;
pub mod postgres;
pub mod query;
pub mod sqlite;

use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use serde_json::{Map, Value};
use sqlx::{Database, Encode, Type};

use crate::config::{Engine, SourceConfig};
use crate::domain::{CursorValue, PkValue, Position};
use query::{SeekQuery, Slot};

/// One row read from the source: where it sits and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceRow {
    pub position: Position,
    pub row: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error("cannot reach the database ({location}): {reason}")]
    Unreachable { location: String, reason: String },
    #[error("the query on {location} failed: {reason}")]
    Query { location: String, reason: String },
    #[error("column {column:?} has type {type_name}, which dbtrigger cannot turn into JSON")]
    UnsupportedType { column: String, type_name: String },
    #[error("cursor/key column problem: {0}")]
    Position(String),
}

#[async_trait]
pub trait Source: Send + Sync {
    /// Up to `limit` rows strictly after `after` (all rows from the start when `None`), in
    /// (cursor, pk...) order.
    async fn fetch_after(&self, after: Option<&Position>, limit: usize) -> Result<Vec<SourceRow>, SourceError>;

    /// Where the source is, for messages; never includes a password.
    fn describe(&self) -> String;
}

/// Opens a source for a poller. Connections are made lazily, on first use, and pooled: the source
/// lives as long as the poller, across ticks.
pub fn open(config: &SourceConfig) -> Result<Arc<dyn Source>, SourceError> {
    match config.engine {
        Engine::Sqlite => Ok(Arc::new(sqlite::SqliteSource::open(config)?)),
        Engine::Postgres => Ok(Arc::new(postgres::PostgresSource::open(config)?)),
        Engine::MySql => Ok(Arc::new(mysql::MySqlSource::open(config)?)),
    }
}

/// A database URL without its password, for messages.
pub fn redacted_location(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        Ok(parsed) => parsed.to_string(),
        Err(_) => url.split('?').next().unwrap_or_default().to_string(),
    }
}

/// What a column is to the poller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Cursor,
    Key(usize),
    Plain,
}

pub(crate) fn role_of(config: &SourceConfig, column: &str) -> Role {
    if column == config.cursor {
        return Role::Cursor;
    }
    match config.pk.iter().position(|key| key == column) {
        Some(index) => Role::Key(index),
        None => Role::Plain,
    }
}

/// A decoded value, and what it means as a cursor or key if the column is one.
pub(crate) struct Decoded {
    pub json: Value,
    pub cursor: Option<CursorValue>,
    pub key: Option<PkValue>,
}

impl Decoded {
    pub fn plain(json: Value) -> Self {
        Decoded { json, cursor: None, key: None }
    }

    pub fn integer(number: i64) -> Self {
        Decoded {
            json: Value::from(number),
            cursor: Some(CursorValue::Integer(number)),
            key: Some(PkValue::Integer(number)),
        }
    }

    pub fn float(number: f64) -> Self {
        Decoded::plain(serde_json::Number::from_f64(number).map(Value::Number).unwrap_or(Value::Null))
    }

    pub fn text(text: String) -> Self {
        Decoded { json: Value::from(text.clone()), cursor: None, key: Some(PkValue::Text(text)) }
    }

    pub fn timestamp(at: DateTime<Utc>) -> Self {
        let cursor = CursorValue::Timestamp { at, source_text: None };
        Decoded { json: cursor.to_json(), cursor: Some(cursor), key: None }
    }

    pub fn naive_timestamp(at: NaiveDateTime) -> Self {
        let cursor = CursorValue::NaiveTimestamp(at);
        Decoded { json: cursor.to_json(), cursor: Some(cursor), key: None }
    }
}

/// The pre-flight's warning when no index starts with the cursor column.
pub(crate) fn warn_missing_index(location: &str, table: &str, config: &SourceConfig) {
    tracing::warn!(
        source = %location,
        table = %table,
        "no index starts with the cursor column {:?}: each batch scans the table; create one on ({}, {})",
        config.cursor,
        config.cursor,
        config.pk.join(", ")
    );
}

/// Puts a row together from its decoded columns: checks that the cursor and every key are there
/// and usable, with errors that name the column.
pub(crate) struct RowBuilder<'a> {
    config: &'a SourceConfig,
    values: Map<String, Value>,
    cursor: Option<CursorValue>,
    keys: Vec<Option<PkValue>>,
}

impl<'a> RowBuilder<'a> {
    pub fn new(config: &'a SourceConfig) -> Self {
        RowBuilder { config, values: Map::new(), cursor: None, keys: vec![None; config.pk.len()] }
    }

    pub fn push(&mut self, name: &str, type_name: &str, decoded: Decoded) -> Result<(), SourceError> {
        match role_of(self.config, name) {
            Role::Cursor => {
                if decoded.json.is_null() {
                    return Err(SourceError::Position(format!(
                        "cursor column {name:?} is NULL in a row: a cursor must never be NULL (filter such rows with `where`)"
                    )));
                }
                let cursor = decoded.cursor.clone().ok_or_else(|| {
                    SourceError::Position(format!(
                        "cursor column {name:?} has type {type_name}: use an integer or a timestamp column"
                    ))
                })?;
                self.cursor = Some(cursor);
            }
            Role::Key(index) => {
                let key = decoded.key.clone().ok_or_else(|| {
                    SourceError::Position(format!(
                        "primary key column {name:?} holds {} ({type_name}): keys must be integers or text, never NULL",
                        decoded.json
                    ))
                })?;
                self.keys[index] = Some(key);
            }
            Role::Plain => {}
        }
        self.values.insert(name.to_string(), decoded.json);
        Ok(())
    }

    pub fn finish(self) -> Result<SourceRow, SourceError> {
        let cursor = self.cursor.ok_or_else(|| {
            SourceError::Position(format!("the cursor column {:?} is not in the result", self.config.cursor))
        })?;
        let mut pk = Vec::with_capacity(self.keys.len());
        for (name, key) in self.config.pk.iter().zip(self.keys) {
            let key = key.ok_or_else(|| {
                SourceError::Position(format!("the primary key column {name:?} is not in the result"))
            })?;
            pk.push((name.clone(), key));
        }
        Ok(SourceRow { position: Position { cursor, pk }, row: self.values })
    }
}

/// Runs the seek, from the start or after `after`, and decodes every row with `decode_value`
/// (which names each value's type and turns it into JSON). One body for every engine.
pub(crate) async fn fetch_rows<DB, F>(
    pool: &sqlx::Pool<DB>,
    config: &SourceConfig,
    seek: &SeekQuery,
    after: Option<&Position>,
    limit: usize,
    location: &str,
    decode_value: F,
) -> Result<Vec<SourceRow>, SourceError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    DateTime<Utc>: for<'t> Encode<'t, DB> + Type<DB>,
    NaiveDateTime: for<'t> Encode<'t, DB> + Type<DB>,
    F: Fn(&DB::Row, usize, &str) -> Result<(String, Decoded), SourceError>,
{
    let query = match after {
        None => sqlx::query(sqlx::AssertSqlSafe(seek.from_start.as_str())),
        Some(position) => {
            bind_position(sqlx::query(sqlx::AssertSqlSafe(seek.after.as_str())), &seek.after_slots, position)
        }
    };
    let rows = query.bind(limit as i64).fetch_all(pool).await.map_err(|error| classify(location, error))?;
    let mut decoded = Vec::with_capacity(rows.len());
    for row in &rows {
        let mut builder = RowBuilder::new(config);
        for (index, column) in sqlx::Row::columns(row).iter().enumerate() {
            let name = sqlx::Column::name(column);
            let (type_name, value) = decode_value(row, index, name)?;
            builder.push(name, &type_name, value)?;
        }
        decoded.push(builder.finish()?);
    }
    Ok(decoded)
}

/// Binds a position's values to the seek's placeholders, each as its native type.
pub(crate) fn bind_position<'q, DB>(
    mut query: sqlx::query::Query<'q, DB, <DB as Database>::Arguments>,
    slots: &[Slot],
    position: &Position,
) -> sqlx::query::Query<'q, DB, <DB as Database>::Arguments>
where
    DB: Database,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    DateTime<Utc>: for<'t> Encode<'t, DB> + Type<DB>,
    NaiveDateTime: for<'t> Encode<'t, DB> + Type<DB>,
{
    for slot in slots {
        query = match slot {
            Slot::Cursor => match &position.cursor {
                CursorValue::Integer(number) => query.bind(*number),
                // SQLite: the exact stored text, so the seek agrees with its ORDER BY.
                CursorValue::Timestamp { source_text: Some(text), .. } => query.bind(text.clone()),
                CursorValue::Timestamp { at, source_text: None } => query.bind(*at),
                CursorValue::NaiveTimestamp(at) => query.bind(*at),
            },
            Slot::Key(index) => match &position.pk[*index].1 {
                PkValue::Integer(number) => query.bind(*number),
                PkValue::Text(text) => query.bind(text.clone()),
            },
        };
    }
    query
}

/// Maps a driver error to what it means for the poller.
pub(crate) fn classify(location: &str, error: sqlx::Error) -> SourceError {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Configuration(_) => {
            SourceError::Unreachable { location: location.to_string(), reason: error.to_string() }
        }
        sqlx::Error::Database(database_error) => {
            let message = database_error.message().to_string();
            let unreachable = message.contains("unable to open")
                || message.contains("password authentication failed")
                || message.contains("Access denied")
                || message.contains("does not exist") && message.contains("database");
            if unreachable {
                SourceError::Unreachable { location: location.to_string(), reason: message }
            } else {
                SourceError::Query { location: location.to_string(), reason: message }
            }
        }
        other => SourceError::Query { location: location.to_string(), reason: other.to_string() },
    }
}
