//! State documents over a [`BlobStore`]: `state/{app}/{poller}.json`. A read parses and validates
//! (an unreadable or newer document is [`StoreError::Corrupt`], and nothing overwrites it); a
//! write is a conditional put of the document's pretty JSON. [`StateWriter`] carries a tick's
//! writes: each conditional on the version the previous one left, and the write-id check after an
//! ambiguous 412 made here, in one place.

use super::{BlobStore, ETag, ListPage, PutMode, StateKey, StateStore, StoreError, Versioned, WriteCondition};
use crate::domain::StateDocument;
use crate::domain::state::WriteCheck;

pub(super) async fn read<B: BlobStore + ?Sized>(blobs: &B, key: &StateKey) -> Result<Option<Versioned>, StoreError> {
    let path = key.blob_path();
    let Some(blob) = blobs.get(&path).await? else {
        return Ok(None);
    };
    let document = StateDocument::parse(&blob.bytes).map_err(|error| StoreError::Corrupt {
        location: format!("{}/{path}", blobs.describe()),
        reason: error.to_string(),
    })?;
    Ok(Some(Versioned { document, etag: blob.etag }))
}

pub(super) async fn write<B: BlobStore + ?Sized>(
    blobs: &B,
    key: &StateKey,
    document: &StateDocument,
    condition: WriteCondition,
) -> Result<ETag, StoreError> {
    let mode = match condition {
        WriteCondition::Absent => PutMode::Create,
        WriteCondition::Matches(etag) => PutMode::Update(etag),
    };
    blobs.put(&key.blob_path(), document.to_bytes(), mode).await
}

/// Every state document of `app` (its pollers), in order, through as many pages as there are.
pub async fn list(blobs: &dyn BlobStore, app: &str) -> Result<Vec<StateKey>, StoreError> {
    let prefix = StateKey::app_prefix(app);
    let mut keys = Vec::new();
    let mut continuation = None;
    loop {
        let ListPage { items, next } = blobs.list(&prefix, continuation).await?;
        keys.extend(items.iter().filter_map(|item| StateKey::from_blob_path(&item.path)));
        match next {
            Some(token) => continuation = Some(token),
            None => return Ok(keys),
        }
    }
}

/// A write that did not land.
pub enum WriteFailure {
    /// Someone else wrote first; this is what is there now (if anything).
    Conflict(Option<Box<StateDocument>>),
    Store(StoreError),
}

/// Writes one poller's state document for the length of a tick: each write is conditional on
/// the version the previous read or write left, and carries a fresh write id. A conditional write
/// can answer 412 although it landed (a retry after a lost response, seed 001 case G), and a write
/// can land although it answered an error (a timeout): so the ids of every write not yet
/// acknowledged are remembered, and a 412 is checked against them before it counts as a conflict.
pub struct StateWriter<'a> {
    store: &'a dyn StateStore,
    key: &'a StateKey,
    condition: WriteCondition,
    /// Write ids of this tick's writes that answered an error: any of them may have landed.
    unacknowledged: Vec<String>,
    /// Someone else wrote the document: nothing more may be written in this tick.
    pub lost: bool,
}

impl<'a> StateWriter<'a> {
    pub fn new(store: &'a dyn StateStore, key: &'a StateKey, etag: Option<ETag>) -> Self {
        let condition = match etag {
            Some(etag) => WriteCondition::Matches(etag),
            None => WriteCondition::Absent,
        };
        StateWriter { store, key, condition, unacknowledged: Vec::new(), lost: false }
    }

    pub async fn write(&mut self, document: &mut StateDocument) -> Result<(), WriteFailure> {
        // At most one retry: after finding our own earlier write in place of the one we expected.
        for _ in 0..2 {
            let write_id = uuid::Uuid::new_v4().simple().to_string();
            document.write_id = Some(write_id.clone());
            match self.store.write(self.key, document, self.condition.clone()).await {
                Ok(etag) => {
                    self.acknowledged(etag);
                    return Ok(());
                }
                Err(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. }) => {
                    let stored = match self.store.read(self.key).await {
                        Ok(stored) => stored,
                        Err(error) => {
                            self.unacknowledged.push(write_id);
                            return Err(WriteFailure::Store(error));
                        }
                    };
                    let stored_id = stored.as_ref().and_then(|versioned| versioned.document.write_id.clone());
                    match (stored, WriteCheck::of(stored_id.as_deref(), &write_id, &self.unacknowledged)) {
                        (Some(versioned), WriteCheck::ThisWriteLanded) => {
                            self.acknowledged(versioned.etag);
                            return Ok(());
                        }
                        (Some(versioned), WriteCheck::EarlierWriteLanded) => {
                            // Ours, from a write whose answer was an error: write again over it.
                            self.acknowledged(versioned.etag);
                        }
                        (stored, _) => {
                            self.lost = true;
                            return Err(WriteFailure::Conflict(stored.map(|versioned| Box::new(versioned.document))));
                        }
                    }
                }
                Err(error) => {
                    self.unacknowledged.push(write_id);
                    return Err(WriteFailure::Store(error));
                }
            }
        }
        self.lost = true;
        Err(WriteFailure::Conflict(None))
    }

    fn acknowledged(&mut self, etag: ETag) {
        self.condition = WriteCondition::Matches(etag);
        self.unacknowledged.clear();
    }
}
