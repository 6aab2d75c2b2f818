//! Where documents live, at two levels.
//!
//! - [`BlobStore`]: bytes at paths, with ETag compare-and-swap: `get`, `put` with a [`PutMode`]
//!   (create, update if the ETag matches, overwrite), `list` by prefix in pages, `delete` if the
//!   ETag matches. Implementations: [`azure_blob`] (production), [`file`](mod@file) (local work,
//!   `file:<dir>`, the same layout on disk), and `memory` (tests only). All pass one
//!   `conformance` suite; the memory store and the suite are compiled for tests only (the
//!   `testing` feature, which the integration tests turn on), never into the release binary.
//! - Typed layers, one file a document kind: [`state`] (state documents: parse and validate on
//!   read, never overwrite what cannot be read, list a poller's siblings, and the write-id check
//!   after an ambiguous 412 in [`state::StateWriter`]; every `BlobStore` is a [`StateStore`]) and
//!   [`quarantine`] (rows isolated as poison, one document each).

pub mod azure_blob;
#[cfg(any(test, feature = "testing"))]
pub mod conformance;
pub mod file;
#[cfg(any(test, feature = "testing"))]
pub mod memory;
pub mod quarantine;
pub mod state;

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use crate::config::{StateConfig, StateLocation};
use crate::domain::StateDocument;

pub use state::{StateWriter, WriteFailure};

/// The most bytes one blob read takes: a state document is kilobytes, a quarantine entry one row.
/// A larger blob (planted, or grown past reason) is refused as it is read, never taken whole into
/// memory, so that one blob cannot take down every poller of the instance.
pub const MAX_BLOB_BYTES: usize = 32 * 1024 * 1024;

/// The one rule for every name that becomes part of a store path (app, poller, function,
/// quarantine entry): defined beside the other identities in the pure core, so that the
/// configuration can refuse a bad name early, and applied here by every store to every path.
pub use crate::domain::ids::check_path_name;

/// `path` (segments separated by `/`), every segment checked by [`check_path_name`].
pub(crate) fn check_path(path: &str) -> Result<(), StoreError> {
    for segment in path.split('/') {
        check_path_name(segment).map_err(|reason| StoreError::InvalidPath { path: path.to_string(), reason })?;
    }
    Ok(())
}

/// A list prefix: every complete segment checked; the last, partial one may be empty.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), StoreError> {
    let Some((folders, partial)) = prefix.rsplit_once('/') else {
        return if prefix.is_empty() { Ok(()) } else { check_path(prefix) };
    };
    check_path(folders)?;
    if partial.is_empty() { Ok(()) } else { check_path(partial) }
}

/// A blob larger than `bound` (a store's, [`MAX_BLOB_BYTES`] unless a test set another), refused
/// as it is read.
pub(crate) fn too_large(location: String, size: Option<u64>, bound: usize) -> StoreError {
    let size = size.map(|bytes| format!("{bytes} bytes")).unwrap_or_else(|| "larger".to_string());
    StoreError::Corrupt {
        location,
        reason: format!("it is {size}, more than the {bound} bytes a blob may hold: it was not read"),
    }
}

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

    /// The prefix of every state document of `app`.
    pub fn app_prefix(app: &str) -> String {
        format!("state/{app}/")
    }

    /// The key of a path under [`StateKey::app_prefix`], if it is one.
    pub fn from_blob_path(path: &str) -> Option<StateKey> {
        let rest = path.strip_prefix("state/")?;
        let (app, file) = rest.split_once('/')?;
        let poller = file.strip_suffix(".json")?;
        if app.is_empty() || poller.is_empty() || poller.contains('/') {
            return None;
        }
        Some(StateKey::new(app, poller))
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

/// Bytes and the version they were read at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    pub bytes: Vec<u8>,
    pub etag: ETag,
}

/// How a `put` relates to what is there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutMode {
    /// Only if nothing is there: else [`StoreError::AlreadyExists`].
    Create,
    /// Only over this version: else [`StoreError::Conflict`] (also when nothing is there).
    Update(ETag),
    /// Whatever is there. Operator tools and tests only: a poller never writes unconditionally.
    Overwrite,
}

/// One path a `list` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub path: String,
    pub etag: ETag,
}

/// One page of a `list`, in path order; `next` continues it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ListPage {
    pub items: Vec<Listed>,
    pub next: Option<String>,
}

/// Bytes at paths with ETag compare-and-swap: what every store implements.
#[async_trait]
pub trait BlobStore: Send + Sync {
    /// The bytes at `path` and their ETag, or `None` when there are none; a blob over the
    /// store's bound ([`MAX_BLOB_BYTES`]) is refused as it is read.
    async fn get(&self, path: &str) -> Result<Option<Blob>, StoreError>;

    /// [`BlobStore::get`] for a kind of document allowed to be larger than the store's bound (a
    /// quarantine entry holds a whole row): refused over `max_bytes` instead. The ETag is the one
    /// `get`, `list` and `delete` know the blob by. A store that cannot read further (a test
    /// double) reads as `get` does.
    async fn get_bounded(&self, path: &str, max_bytes: usize) -> Result<Option<Blob>, StoreError> {
        let _ = max_bytes;
        self.get(path).await
    }

    /// Writes `bytes` at `path` if `mode` allows, returning the new ETag.
    async fn put(&self, path: &str, bytes: Vec<u8>, mode: PutMode) -> Result<ETag, StoreError>;

    /// The paths that start with `prefix`, in order, one page at a time: `continuation` is the
    /// previous page's `next` (`None` for the first page).
    async fn list(&self, prefix: &str, continuation: Option<String>) -> Result<ListPage, StoreError>;

    /// Deletes `path` if its ETag is still `etag`; a changed or missing blob is a
    /// [`StoreError::Conflict`].
    async fn delete(&self, path: &str, etag: &ETag) -> Result<(), StoreError>;

    /// Where the store is, for messages; never includes a secret.
    fn describe(&self) -> String;
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
    /// The stored blob (a state document, a quarantine entry) cannot be read. It is left as it
    /// is; `reason` says what to do about it.
    #[error("{location} cannot be used: {reason}; it was left untouched")]
    Corrupt { location: String, reason: String },
    /// The store could not be reached or failed; `retryable` says whether trying again may help.
    #[error("state store {location}: {reason}")]
    Unavailable { location: String, reason: String, retryable: bool },
    /// A path holds a name no store path may hold ([`check_path_name`]): nothing was read or
    /// written. Never retryable.
    #[error("refusing the store path {path:?}: {reason}")]
    InvalidPath { path: String, reason: String },
}

/// State documents: what the tick reads and writes. Every [`BlobStore`] is one (through the typed
/// layer in [`state`]); a test double may implement it directly to inject faults.
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

#[async_trait]
impl<B: BlobStore + ?Sized> StateStore for B {
    async fn read(&self, key: &StateKey) -> Result<Option<Versioned>, StoreError> {
        state::read(self, key).await
    }

    async fn write(
        &self,
        key: &StateKey,
        document: &StateDocument,
        condition: WriteCondition,
    ) -> Result<ETag, StoreError> {
        state::write(self, key, document, condition).await
    }

    fn describe(&self) -> String {
        BlobStore::describe(self)
    }
}

/// A state store that counts the reads and writes that go through it (a tick's summary line says
/// how many blob requests it made).
pub struct Counted {
    inner: Arc<dyn StateStore>,
    reads: std::sync::atomic::AtomicU64,
    writes: std::sync::atomic::AtomicU64,
}

impl Counted {
    pub fn new(inner: Arc<dyn StateStore>) -> Self {
        Counted { inner, reads: Default::default(), writes: Default::default() }
    }

    /// (reads, writes) so far.
    pub fn counts(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.reads.load(Relaxed), self.writes.load(Relaxed))
    }
}

#[async_trait]
impl StateStore for Counted {
    async fn read(&self, key: &StateKey) -> Result<Option<Versioned>, StoreError> {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.read(key).await
    }

    async fn write(
        &self,
        key: &StateKey,
        document: &StateDocument,
        condition: WriteCondition,
    ) -> Result<ETag, StoreError> {
        self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.write(key, document, condition).await
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// One store seen two ways: as state documents, and as bytes (listing, other document kinds).
pub type Opened = (Arc<dyn StateStore>, Arc<dyn BlobStore>);

/// Opens the store a `state` section names, once: one client behind both views.
pub fn open(config: &StateConfig) -> Result<Opened, StoreError> {
    fn both<S: BlobStore + 'static>(store: S) -> Opened {
        let store = Arc::new(store);
        (store.clone(), store)
    }
    match &config.location {
        StateLocation::File(directory) => Ok(both(file::FileStore::new(directory.clone()))),
        StateLocation::AzureBlob(connection) => Ok(both(azure_store(config, connection)?)),
    }
}

fn azure_store(
    config: &StateConfig,
    connection: &crate::config::StorageConnection,
) -> Result<azure_blob::AzureBlobStore, StoreError> {
    azure_blob::AzureBlobStore::new(connection, &config.container).map_err(|reason| StoreError::Unavailable {
        location: format!("app setting {}", config.connection),
        reason,
        retryable: false,
    })
}
