//! The memory store behind two fault scripts, seen through three handles: the ticks' and the
//! operators' take the faults real blob storage has (each its own script: a write refused, landed
//! but answered an error, landed but answered a conflict as the SDK's own retry of it does, or
//! landed late after answering a timeout; a failing read, list or delete; a delete that landed but
//! answered an error), the observer's (the invariants, `status`) never does. Every state document
//! write that lands is logged with the lease it carries, so that a tick that lost its lease can be
//! asked who took it, and judged as it lands: readable, its fencing token never below the
//! document's it replaces, its checkpoint never backwards within a load unless an operator reset
//! it. Every quarantine entry is judged as it lands too (readable, and was its writer's token
//! already superseded?).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use dbtrigger::domain::StateDocument;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::store::quarantine::QuarantineEntry;
use dbtrigger::store::{Blob, BlobStore, ETag, ListPage, PutMode, StateKey, StoreError};

use super::config::APP;
use super::sink::{SinkState, row_of};
use super::source::cursor_and_key;

/// What the next request of its kind through a faulty handle does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFault {
    /// Refused (a 503): nothing is written.
    RefuseNextWrite,
    /// Written, but the answer is an error (a timeout after the write landed).
    LandNextWriteButFail,
    /// Written, but the answer is a conflict (412; 409 for a create): what the SDK's own retry of
    /// a write whose first answer was lost gets.
    LandNextWriteButConflict,
    /// The answer is a timeout now; the write lands `ms` later, if its condition still holds then
    /// (the service applied a request the client gave up on).
    LandNextWriteLate { ms: u64 },
    /// The next read (`get`) fails with a 503.
    FailNextRead,
    /// The next list fails with a 503.
    FailNextList,
    /// The next delete is refused with a 503: nothing is deleted.
    FailNextDelete,
    /// The next delete lands, but the answer is an error.
    LandNextDeleteButFail,
}

/// The kind of request a fault waits for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Request {
    Write,
    Read,
    List,
    Delete,
}

impl StoreFault {
    fn hits(&self) -> Request {
        match self {
            StoreFault::RefuseNextWrite
            | StoreFault::LandNextWriteButFail
            | StoreFault::LandNextWriteButConflict
            | StoreFault::LandNextWriteLate { .. } => Request::Write,
            StoreFault::FailNextRead => Request::Read,
            StoreFault::FailNextList => Request::List,
            StoreFault::FailNextDelete | StoreFault::LandNextDeleteButFail => Request::Delete,
        }
    }
}

/// Who a handle on the store is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A tick's: takes the ticks' fault script.
    Tick,
    /// An operator command's: takes the operators' fault script; may move a checkpoint back (reset).
    Operator,
    /// The observer's (the invariants, `status`, a rival's write): no faults.
    Clean,
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
    /// The operators' fault script.
    pub operator_faults: Mutex<VecDeque<StoreFault>>,
    pub log: Mutex<Vec<Written>>,
    /// What the receiver acknowledged so far, to judge quarantine entries by as they are written.
    sink: Arc<Mutex<SinkState>>,
    /// Writes that broke an invariant as they landed: (invariant, what happened).
    pub stale_entries: Mutex<Vec<(&'static str, String)>>,
    /// The state documents as the last write of each left them (parsed once, as they landed).
    landed: Mutex<std::collections::BTreeMap<String, StateDocument>>,
}

impl StoreShared {
    pub fn new(sink: Arc<Mutex<SinkState>>) -> Arc<StoreShared> {
        Arc::new(StoreShared {
            memory: MemoryStore::new(),
            faults: Mutex::new(VecDeque::new()),
            operator_faults: Mutex::new(VecDeque::new()),
            log: Mutex::new(Vec::new()),
            sink,
            stale_entries: Mutex::new(Vec::new()),
            landed: Mutex::new(Default::default()),
        })
    }

    fn violation(&self, invariant: &'static str, what: String) {
        self.stale_entries.lock().unwrap().push((invariant, what));
    }

    /// The first fault of `role`'s script waiting for a request of this kind, taken off it.
    fn take(&self, role: Role, request: Request) -> Option<StoreFault> {
        let script = match role {
            Role::Tick => &self.faults,
            Role::Operator => &self.operator_faults,
            Role::Clean => return None,
        };
        let mut script = script.lock().unwrap();
        let index = script.iter().position(|fault| fault.hits() == request)?;
        script.remove(index)
    }

    /// A quarantine entry just landed: it must be readable, its row must not have been delivered
    /// under a newer token already, and its token must still be the poller's (no newer lease, no
    /// reset since).
    async fn judge_entry(&self, path: &str, bytes: &[u8]) {
        let entry = match serde_json::from_slice::<QuarantineEntry>(bytes) {
            Ok(entry) => entry,
            Err(error) => {
                self.violation("every quarantine entry written is readable", format!("{path}: {error}"));
                return;
            }
        };
        let Some(row) = entry.event.get("row").and_then(|row| row.as_object()).and_then(row_of) else {
            let what = format!("{path}: its event holds no row of the table: {}", entry.event);
            self.violation("every quarantine entry written is readable", what);
            return;
        };
        let delivered = self.sink.lock().unwrap().acknowledged.get(&(entry.poller.clone(), row)).copied();
        if let Some(newer) = delivered.filter(|token| *token > entry.fencing_token) {
            let what = format!(
                "{path} (row {row:?}, token {}) written after the row was delivered under token {newer}",
                entry.fencing_token
            );
            self.violation("no quarantine entry for a row delivered under a newer token", what);
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
            self.violation("quarantine entries are written under the current lease only", what);
        }
    }

    /// A state document is about to replace `before` at `path` (written through `role`'s handle):
    /// it must be readable, its fencing token must not be below the one it replaces, and within one
    /// load its checkpoint must not move back unless an operator wrote it (a reset).
    fn judge_state(&self, path: &str, before: Option<&StateDocument>, after: Option<&StateDocument>, role: Role) {
        let invariant = "every state write is readable, its token and checkpoint never backwards";
        let Some(after) = after else {
            return self.violation(invariant, format!("{path}: written unreadable"));
        };
        let position = |document: &StateDocument| -> Result<Option<(i64, i64)>, String> {
            match document.position() {
                Ok(None) => Ok(None),
                Ok(Some(position)) => cursor_and_key(&position)
                    .map(Some)
                    .ok_or_else(|| format!("a checkpoint that is no (cursor, key) of the table: {position:?}")),
                Err(error) => Err(format!("an unparsable checkpoint: {error}")),
            }
        };
        let after_position = match position(after) {
            Ok(position) => position,
            Err(error) => return self.violation(invariant, format!("{path}: written with {error}")),
        };
        let Some(before) = before else {
            return;
        };
        let token = |document: &StateDocument| document.lease.as_ref().map(|lease| lease.fencing_token);
        if token(after) < token(before) {
            let what = format!(
                "{path}: a write carrying token {:?} replaced the document at token {:?} ({role:?}'s handle)",
                token(after),
                token(before)
            );
            return self.violation(invariant, what);
        }
        let load = |document: &StateDocument| document.generation.as_ref().map(|record| record.value.clone());
        let same_load = load(before) == load(after);
        if same_load
            && role != Role::Operator
            && let Ok(before_position) = position(before)
            && after_position < before_position
        {
            let what = format!(
                "{path}: the checkpoint moved back from {before_position:?} to {after_position:?} within load {:?} ({role:?}'s handle, token {:?})",
                load(after),
                token(after)
            );
            self.violation(invariant, what);
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

    fn record(&self, path: &str, document: Option<&StateDocument>, faulted: bool) {
        let lease = document.and_then(|document| document.lease.as_ref());
        let lease = lease.map(|lease| (lease.owner_id.clone(), lease.fencing_token));
        self.log.lock().unwrap().push(Written { path: path.to_string(), lease, faulted });
    }

    /// Writes `bytes` at `path` if `mode` allows, judging and logging what lands.
    async fn land(
        &self,
        path: &str,
        bytes: Vec<u8>,
        mode: PutMode,
        role: Role,
        faulted: bool,
    ) -> Result<ETag, StoreError> {
        let state = path.starts_with("state/");
        let document = if state { StateDocument::parse(&bytes).ok() } else { None };
        let landed = self.memory.put(path, bytes.clone(), mode).await;
        if landed.is_ok() {
            if state {
                let mut landed = self.landed.lock().unwrap();
                self.judge_state(path, landed.get(path), document.as_ref(), role);
                match &document {
                    Some(document) => landed.insert(path.to_string(), document.clone()),
                    None => landed.remove(path),
                };
            }
            self.record(path, document.as_ref(), faulted);
            self.judge(path, &bytes).await;
        }
        landed
    }
}

pub struct SimStore {
    pub shared: Arc<StoreShared>,
    pub role: Role,
}

fn unavailable(path: &str, reason: &str) -> StoreError {
    StoreError::Unavailable { location: format!("sim:{path}"), reason: reason.to_string(), retryable: true }
}

#[async_trait]
impl BlobStore for SimStore {
    async fn get(&self, path: &str) -> Result<Option<Blob>, StoreError> {
        if self.shared.take(self.role, Request::Read).is_some() {
            return Err(unavailable(path, "scripted: the read failed (HTTP 503)"));
        }
        self.shared.memory.get(path).await
    }

    async fn put(&self, path: &str, bytes: Vec<u8>, mode: PutMode) -> Result<ETag, StoreError> {
        let role = self.role;
        match self.shared.take(role, Request::Write) {
            Some(StoreFault::RefuseNextWrite) => {
                self.shared.log.lock().unwrap().push(Written { path: path.to_string(), lease: None, faulted: true });
                Err(unavailable(path, "scripted: the write was refused (HTTP 503)"))
            }
            Some(StoreFault::LandNextWriteButFail) => {
                let landed = self.shared.land(path, bytes, mode, role, true).await;
                landed.and(Err(unavailable(path, "scripted: the write landed but its answer was lost")))
            }
            Some(StoreFault::LandNextWriteButConflict) => {
                let conflict = match mode {
                    PutMode::Create => StoreError::AlreadyExists { location: format!("sim:{path}") },
                    PutMode::Update(_) => StoreError::Conflict { location: format!("sim:{path}") },
                    // An unconditional write's retry simply lands again.
                    PutMode::Overwrite => return self.shared.land(path, bytes, mode, role, false).await,
                };
                let landed = self.shared.land(path, bytes, mode, role, false).await;
                landed.and(Err(conflict))
            }
            Some(StoreFault::LandNextWriteLate { ms }) => {
                self.shared.log.lock().unwrap().push(Written { path: path.to_string(), lease: None, faulted: true });
                let (shared, path_later) = (self.shared.clone(), path.to_string());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    let _ = shared.land(&path_later, bytes, mode, role, true).await;
                });
                Err(unavailable(path, "scripted: the write timed out (it lands later)"))
            }
            Some(other) => unreachable!("{other:?} waits for another kind of request"),
            None => self.shared.land(path, bytes, mode, role, false).await,
        }
    }

    async fn list(&self, prefix: &str, continuation: Option<String>) -> Result<ListPage, StoreError> {
        if self.shared.take(self.role, Request::List).is_some() {
            return Err(unavailable(prefix, "scripted: the list failed (HTTP 503)"));
        }
        self.shared.memory.list(prefix, continuation).await
    }

    async fn delete(&self, path: &str, etag: &ETag) -> Result<(), StoreError> {
        let fault = self.shared.take(self.role, Request::Delete);
        if fault == Some(StoreFault::FailNextDelete) {
            return Err(unavailable(path, "scripted: the delete was refused (HTTP 503)"));
        }
        let deleted = self.shared.memory.delete(path, etag).await;
        if deleted.is_ok() {
            self.shared.landed.lock().unwrap().remove(path);
        }
        match fault {
            Some(_) => deleted.and(Err(unavailable(path, "scripted: the delete landed but its answer was lost"))),
            None => deleted,
        }
    }

    fn describe(&self) -> String {
        "sim store".to_string()
    }
}
