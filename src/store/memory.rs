//! An in-memory store for fast tests. It keeps bytes, not values, so that it parses what it
//! returns exactly as the real stores do, and so that tests can plant a corrupted document.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;

use super::{ETag, StateKey, StateStore, StoreError, Versioned, WriteCondition};
use crate::domain::StateDocument;

#[derive(Default)]
pub struct MemoryStore {
    documents: Mutex<HashMap<StateKey, (Vec<u8>, ETag)>>,
    next_version: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
}

impl MemoryStore {
    pub fn new() -> Self {
        MemoryStore::default()
    }

    /// Stores raw bytes as they are (a test's corrupted or foreign document).
    pub fn put_raw(&self, key: &StateKey, bytes: &[u8]) -> ETag {
        let etag = self.fresh_etag();
        self.documents.lock().unwrap().insert(key.clone(), (bytes.to_vec(), etag.clone()));
        etag
    }

    /// The stored bytes, if any.
    pub fn raw(&self, key: &StateKey) -> Option<Vec<u8>> {
        self.documents.lock().unwrap().get(key).map(|(bytes, _)| bytes.clone())
    }

    /// Requests served so far: (reads, writes attempted).
    pub fn request_counts(&self) -> (u64, u64) {
        (self.reads.load(Ordering::SeqCst), self.writes.load(Ordering::SeqCst))
    }

    fn fresh_etag(&self) -> ETag {
        ETag(format!("\"m{}\"", self.next_version.fetch_add(1, Ordering::SeqCst) + 1))
    }
}

#[async_trait]
impl StateStore for MemoryStore {
    async fn read(&self, key: &StateKey) -> Result<Option<Versioned>, StoreError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        let stored = self.documents.lock().unwrap().get(key).cloned();
        let Some((bytes, etag)) = stored else {
            return Ok(None);
        };
        let document = StateDocument::parse(&bytes).map_err(|error| StoreError::Corrupt {
            location: format!("memory:{}", key.blob_path()),
            reason: error.to_string(),
        })?;
        Ok(Some(Versioned { document, etag }))
    }

    async fn write(
        &self,
        key: &StateKey,
        document: &StateDocument,
        condition: WriteCondition,
    ) -> Result<ETag, StoreError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        let location = format!("memory:{}", key.blob_path());
        let mut documents = self.documents.lock().unwrap();
        match (&condition, documents.get(key)) {
            (WriteCondition::Absent, Some(_)) => {
                return Err(StoreError::AlreadyExists { location });
            }
            (WriteCondition::Matches(_), None) => return Err(StoreError::Conflict { location }),
            (WriteCondition::Matches(expected), Some((_, current))) if expected != current => {
                return Err(StoreError::Conflict { location });
            }
            _ => {}
        }
        let etag = self.fresh_etag();
        documents.insert(key.clone(), (document.to_bytes(), etag.clone()));
        Ok(etag)
    }

    fn describe(&self) -> String {
        "memory".to_string()
    }
}
