//! Where rows come from: a trait with one question, "the next rows after this position", and its
//! SQL implementation over sqlx. The seek is a keyset query (design "One tick", step 2): constant
//! cost per batch at any depth, given an index on (cursor, pk...).

pub mod query;
pub mod sqlite;

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{Map, Value};

use crate::config::{Engine, SourceConfig};
use crate::domain::Position;

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
    #[error("this build cannot read {engine} sources yet")]
    UnsupportedEngine { engine: &'static str },
}

impl SourceError {
    /// Whether trying again later may help.
    pub fn is_retryable(&self) -> bool {
        matches!(self, SourceError::Unreachable { .. })
    }
}

#[async_trait]
pub trait Source: Send + Sync {
    /// Up to `limit` rows strictly after `after` (all rows from the start when `None`), in
    /// (cursor, pk...) order.
    async fn fetch_after(
        &self,
        after: Option<&Position>,
        limit: usize,
    ) -> Result<Vec<SourceRow>, SourceError>;

    /// Where the source is, for messages; never includes a password.
    fn describe(&self) -> String;
}

/// Opens a source for a poller. Connections are made lazily, on first use, and pooled: the source
/// lives as long as the poller, across ticks.
pub fn open(config: &SourceConfig) -> Result<Arc<dyn Source>, SourceError> {
    match config.engine {
        Engine::Sqlite => Ok(Arc::new(sqlite::SqliteSource::open(config)?)),
        other => Err(SourceError::UnsupportedEngine {
            engine: other.name(),
        }),
    }
}
