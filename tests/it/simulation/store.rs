//! The memory store behind a fault script, seen through two handles: the ticks' (their writes
//! take the faults: refused, or landed but answered an error) and the observer's (operators, the
//! invariants), which never does. Every state document write that lands is logged with the lease
//! it carries, so that a tick that lost its lease can be asked who took it; every quarantine entry
//! written is judged as it lands (was its writer's token already superseded?).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use dbtrigger::domain::StateDocument;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::store::quarantine::QuarantineEntry;
use dbtrigger::store::{Blob, BlobStore, ETag, ListPage, PutMode, StateKey, StoreError};

use super::config::APP;
use super::sink::{SinkState, row_of};

/// What the next write through the ticks' handle does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFault {
    /// Refused (a 503): nothing is written.
    RefuseNextWrite,
    /// Written, but the answer is an error (a timeout after the write landed).
    LandNextWriteButFail,
}

/// One entry of the write log.
#[derive(Debug, Clone)]
pub struct Written {
    pub path: String,
    /// The lease the document carries: (owner, fencing token); `None` for no lease.
    pub lease: Option<(Option<String>, u64)>,
    /// A scripted fault hit this write.
    pub faulted: bool,
}

pub struct StoreShared {
    pub memory: MemoryStore,
    pub faults: Mutex<VecDeque<StoreFault>>,
    pub log: Mutex<Vec<Written>>,
    /// What the receiver acknowledged so far, to judge quarantine entries by as they are written.
    sink: Arc<Mutex<SinkState>>,
    /// Quarantine entries written by a superseded writer: (invariant, what happened).
    pub stale_entries: Mutex<Vec<(&'static str, String)>>,
}

impl StoreShared {
    pub fn new(sink: Arc<Mutex<SinkState>>) -> Arc<StoreShared> {
        Arc::new(StoreShared {
            memory: MemoryStore::new(),
            faults: Mutex::new(VecDeque::new()),
            log: Mutex::new(Vec::new()),
            sink,
            stale_entries: Mutex::new(Vec::new()),
        })
    }

    /// A quarantine entry just landed: its row must not have been delivered under a newer token
    /// already, and its token must still be the poller's (no newer lease, no reset since).
    async fn judge_entry(&self, path: &str, bytes: &[u8]) {
        let Ok(entry) = serde_json::from_slice::<QuarantineEntry>(bytes) else {
            return;
        };
        let Some(row) = entry.event.get("row").and_then(|row| row.as_object()).and_then(row_of) else {
            return;
        };
        let delivered = self.sink.lock().unwrap().acknowledged.get(&(entry.poller.clone(), row)).copied();
        if let Some(newer) = delivered.filter(|token| *token > entry.fencing_token) {
            let what = format!(
                "{path} (row {row:?}, token {}) written after the row was delivered under token {newer}",
                entry.fencing_token
            );
            self.stale_entries
                .lock()
                .unwrap()
                .push(("no quarantine entry for a row delivered under a newer token", what));
        }
        let state = StateKey::new(APP, &entry.poller).blob_path();
        let current = match self.memory.get(&state).await {
            Ok(Some(blob)) => StateDocument::parse(&blob.bytes).ok().and_then(|document| document.lease),
            _ => None,
        };
        if let Some(lease) = current.filter(|lease| lease.fencing_token > entry.fencing_token) {
            let what = format!(
                "{path} (row {row:?}) written under token {} while the document's lease was at token {} ({:?})",
                entry.fencing_token, lease.fencing_token, lease.owner_id
            );
            self.stale_entries
                .lock()
                .unwrap()
                .push(("quarantine entries are written under the current lease only", what));
        }
    }

    /// Entries logged so far: a tick's writes are those between two of these.
    pub fn log_len(&self) -> usize {
        self.log.lock().unwrap().len()
    }

    async fn judge(&self, path: &str, bytes: &[u8]) {
        if path.starts_with("quarantine/") {
            self.judge_entry(path, bytes).await;
        }
    }

    fn record(&self, path: &str, bytes: &[u8], faulted: bool) {
        let lease = if path.starts_with("state/") {
            StateDocument::parse(bytes)
                .ok()
                .and_then(|document| document.lease)
                .map(|lease| (lease.owner_id, lease.fencing_token))
        } else {
            None
        };
        self.log.lock().unwrap().push(Written { path: path.to_string(), lease, faulted });
    }
}

pub struct SimStore {
    pub shared: Arc<StoreShared>,
    pub faulty: bool,
}

fn unavailable(path: &str, reason: &str) -> StoreError {
    StoreError::Unavailable { location: format!("sim:{path}"), reason: reason.to_string(), retryable: true }
}

#[async_trait]
impl BlobStore for SimStore {
    async fn get(&self, path: &str) -> Result<Option<Blob>, StoreError> {
        self.shared.memory.get(path).await
    }

    async fn put(&self, path: &str, bytes: Vec<u8>, mode: PutMode) -> Result<ETag, StoreError> {
        let fault = if self.faulty { self.shared.faults.lock().unwrap().pop_front() } else { None };
        match fault {
            Some(StoreFault::RefuseNextWrite) => {
                self.shared.log.lock().unwrap().push(Written { path: path.to_string(), lease: None, faulted: true });
                Err(unavailable(path, "scripted: the write was refused (HTTP 503)"))
            }
            Some(StoreFault::LandNextWriteButFail) => {
                let landed = self.shared.memory.put(path, bytes.clone(), mode).await;
                if landed.is_ok() {
                    self.shared.record(path, &bytes, true);
                    self.shared.judge(path, &bytes).await;
                }
                landed.and(Err(unavailable(path, "scripted: the write landed but its answer was lost")))
            }
            None => {
                let written = self.shared.memory.put(path, bytes.clone(), mode).await;
                if written.is_ok() {
                    self.shared.record(path, &bytes, false);
                    self.shared.judge(path, &bytes).await;
                }
                written
            }
        }
    }

    async fn list(&self, prefix: &str, continuation: Option<String>) -> Result<ListPage, StoreError> {
        self.shared.memory.list(prefix, continuation).await
    }

    async fn delete(&self, path: &str, etag: &ETag) -> Result<(), StoreError> {
        self.shared.memory.delete(path, etag).await
    }

    fn describe(&self) -> String {
        "sim store".to_string()
    }
}
