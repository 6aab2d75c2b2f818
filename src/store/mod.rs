//! Where state documents live, behind one small trait with ETag compare-and-swap semantics.
//!
//! Implementations: [`azure_blob`] (production), [`file`](mod@file) (local work, `file:<dir>`), and
//! `memory` (tests). Every implementation passes the same `conformance` suite, including a race of
//! tasks incrementing through CAS. The memory store and the suite are compiled for tests only (the
//! `testing` feature, which the integration tests turn on), never into the release binary.

pub mod azure_blob;
#[cfg(any(test, feature = "testing"))]
pub mod conformance;
pub mod file;
#[cfg(any(test, feature = "testing"))]
pub mod memory;

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use crate::config::{StateConfig, StateLocation};
use crate::domain::StateDocument;

/// Which document: `state/{app}/{poller}.json`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StateKey {
    pub app: String,
    pub poller: String,
}

impl StateKey {
    pub fn new(app: &str, poller: &str) -> Self {
        StateKey { app: app.to_string(), poller: poller.to_string() }
    }

    /// The path inside the container (or under the file store's directory).
    pub fn blob_path(&self) -> String {
        format!("state/{}/{}.json", self.app, self.poller)
    }
}

/// An opaque version tag. Two reads return the same tag only if nothing was written in between.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ETag(pub String);

impl fmt::Display for ETag {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

/// The precondition of a write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteCondition {
    /// Create: fails with [`StoreError::AlreadyExists`] if a document is there.
    Absent,
    /// Update: fails with [`StoreError::Conflict`] unless the stored version is this one.
    Matches(ETag),
}

/// A document and the version it was read at.
#[derive(Debug, Clone)]
pub struct Versioned {
    pub document: StateDocument,
    pub etag: ETag,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The document changed since it was read (HTTP 412).
    #[error("the state document at {location} changed since it was read")]
    Conflict { location: String },
    /// A create found a document already there (HTTP 409).
    #[error("the state document at {location} already exists")]
    AlreadyExists { location: String },
    /// The stored document cannot be read. It is left as it is.
    #[error("the state document at {location} cannot be used: {reason}; it was left untouched, fix or reset it")]
    Corrupt { location: String, reason: String },
    /// The store could not be reached or failed; `retryable` says whether trying again may help.
    #[error("state store {location}: {reason}")]
    Unavailable { location: String, reason: String, retryable: bool },
}

#[async_trait]
pub trait StateStore: Send + Sync {
    /// The document and its ETag, or `None` when there is none.
    async fn read(&self, key: &StateKey) -> Result<Option<Versioned>, StoreError>;

    /// Writes the document if the condition holds, returning the new ETag.
    async fn write(
        &self,
        key: &StateKey,
        document: &StateDocument,
        condition: WriteCondition,
    ) -> Result<ETag, StoreError>;

    /// Where the store is, for messages; never includes a secret.
    fn describe(&self) -> String;
}

/// Opens the store a poller's `state` section names.
pub fn open(config: &StateConfig) -> Result<Arc<dyn StateStore>, StoreError> {
    match &config.location {
        StateLocation::File(directory) => Ok(Arc::new(file::FileStore::new(directory.clone()))),
        StateLocation::AzureBlob(connection) => {
            let store = azure_blob::AzureBlobStore::new(connection, &config.container).map_err(|reason| {
                StoreError::Unavailable {
                    location: format!("app setting {}", config.connection),
                    reason,
                    retryable: false,
                }
            })?;
            Ok(Arc::new(store))
        }
    }
}
