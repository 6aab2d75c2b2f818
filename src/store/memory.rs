//! An in-memory blob store for fast tests. It keeps bytes, so that state documents are parsed
//! exactly as the real stores parse them, and so that tests can plant a corrupted document. It
//! counts requests (a tick's blob budget is asserted on them) and pages lists by a small,
//! settable page size so that paging is exercised.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use async_trait::async_trait;

use super::{
    Blob, BlobStore, ETag, ListPage, Listed, MAX_BLOB_BYTES, PutMode, StateKey, StoreError, check_path, check_prefix,
    too_large,
};

pub struct MemoryStore {
    blobs: Mutex<BTreeMap<String, (Vec<u8>, ETag)>>,
    next_version: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    page_size: AtomicUsize,
    max_blob_bytes: AtomicUsize,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            blobs: Mutex::new(BTreeMap::new()),
            next_version: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            page_size: AtomicUsize::new(1000),
            max_blob_bytes: AtomicUsize::new(MAX_BLOB_BYTES),
        }
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        MemoryStore::default()
    }

    /// Lists return at most `size` paths a page.
    pub fn set_page_size(&self, size: usize) {
        self.page_size.store(size.max(1), Ordering::SeqCst);
    }

    /// Reads refuse blobs over `bytes`, as the real stores refuse blobs over [`MAX_BLOB_BYTES`].
    pub fn set_max_blob_bytes(&self, bytes: usize) {
        self.max_blob_bytes.store(bytes, Ordering::SeqCst);
    }

    /// Stores raw bytes as a state document (a test's corrupted or foreign document).
    pub fn put_raw(&self, key: &StateKey, bytes: &[u8]) -> ETag {
        let etag = self.fresh_etag();
        self.blobs.lock().unwrap().insert(key.blob_path(), (bytes.to_vec(), etag.clone()));
        etag
    }

    /// The stored bytes of a state document, if any.
    pub fn raw(&self, key: &StateKey) -> Option<Vec<u8>> {
        self.blobs.lock().unwrap().get(&key.blob_path()).map(|(bytes, _)| bytes.clone())
    }

    /// Requests served so far: (gets, puts attempted).
    pub fn request_counts(&self) -> (u64, u64) {
        (self.reads.load(Ordering::SeqCst), self.writes.load(Ordering::SeqCst))
    }

    fn fresh_etag(&self) -> ETag {
        ETag(format!("\"m{}\"", self.next_version.fetch_add(1, Ordering::SeqCst) + 1))
    }
}

fn location(path: &str) -> String {
    format!("memory:{path}")
}

#[async_trait]
impl BlobStore for MemoryStore {
    async fn get(&self, path: &str) -> Result<Option<Blob>, StoreError> {
        self.get_bounded(path, self.max_blob_bytes.load(Ordering::SeqCst)).await
    }

    async fn get_bounded(&self, path: &str, max_bytes: usize) -> Result<Option<Blob>, StoreError> {
        check_path(path)?;
        self.reads.fetch_add(1, Ordering::SeqCst);
        let blobs = self.blobs.lock().unwrap();
        let Some((bytes, etag)) = blobs.get(path) else {
            return Ok(None);
        };
        if bytes.len() > max_bytes {
            return Err(too_large(location(path), Some(bytes.len() as u64), max_bytes));
        }
        Ok(Some(Blob { bytes: bytes.clone(), etag: etag.clone() }))
    }

    async fn put(&self, path: &str, bytes: Vec<u8>, mode: PutMode) -> Result<ETag, StoreError> {
        check_path(path)?;
        self.writes.fetch_add(1, Ordering::SeqCst);
        let mut blobs = self.blobs.lock().unwrap();
        match (&mode, blobs.get(path)) {
            (PutMode::Create, Some(_)) => return Err(StoreError::AlreadyExists { location: location(path) }),
            (PutMode::Update(_), None) => return Err(StoreError::Conflict { location: location(path) }),
            (PutMode::Update(expected), Some((_, current))) if expected != current => {
                return Err(StoreError::Conflict { location: location(path) });
            }
            _ => {}
        }
        let etag = self.fresh_etag();
        blobs.insert(path.to_string(), (bytes, etag.clone()));
        Ok(etag)
    }

    async fn list(&self, prefix: &str, continuation: Option<String>) -> Result<ListPage, StoreError> {
        check_prefix(prefix)?;
        let page_size = self.page_size.load(Ordering::SeqCst);
        let blobs = self.blobs.lock().unwrap();
        let mut items = Vec::new();
        let after = continuation.unwrap_or_default();
        for (path, (_, etag)) in
            blobs.range::<String, _>((std::ops::Bound::Excluded(&after), std::ops::Bound::Unbounded))
        {
            if !path.starts_with(prefix) {
                if path.as_str() > prefix {
                    break;
                }
                continue;
            }
            if items.len() == page_size {
                let last: &Listed = items.last().expect("a full page");
                return Ok(ListPage { next: Some(last.path.clone()), items });
            }
            items.push(Listed { path: path.clone(), etag: etag.clone() });
        }
        Ok(ListPage { items, next: None })
    }

    async fn delete(&self, path: &str, etag: &ETag) -> Result<(), StoreError> {
        check_path(path)?;
        let mut blobs = self.blobs.lock().unwrap();
        match blobs.get(path) {
            Some((_, current)) if current == etag => {
                blobs.remove(path);
                Ok(())
            }
            _ => Err(StoreError::Conflict { location: location(path) }),
        }
    }

    fn describe(&self) -> String {
        "memory".to_string()
    }
}
