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
    // What cannot be read is the poller's state document: fixed by hand, or replaced by a reset.
    let advice = |error: StoreError| match error {
        StoreError::Corrupt { location, reason } => StoreError::Corrupt {
            location: format!("the state document at {location}"),
            reason: format!("{reason}; fix or reset it"),
        },
        other => other,
    };
    let Some(blob) = blobs.get(&path).await.map_err(advice)? else {
        return Ok(None);
    };
    let document = StateDocument::parse(&blob.bytes).map_err(|error| {
        advice(StoreError::Corrupt { location: format!("{}/{path}", blobs.describe()), reason: error.to_string() })
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

/// Writes one `write` may take: its own, one after finding an earlier write of ours landed, and
/// a few after finding only an operator's history line added.
const WRITE_ATTEMPTS: usize = 4;

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
///
/// An operator's line in the history (a quarantine replay or purge, written while a tick runs)
/// is not a takeover: after a 412, a stored document that differs from what this writer last
/// wrote only in `history` (and `write_id`) has its history adopted and is written over, by CAS on
/// its version. Any other difference (the lease, the checkpoint, anything) stays a conflict.
pub struct StateWriter<'a> {
    store: &'a dyn StateStore,
    key: &'a StateKey,
    condition: WriteCondition,
    /// Write ids of this tick's writes that answered an error: any of them may have landed.
    unacknowledged: Vec<String>,
    /// The document as this writer's last acknowledged write left it (`None` before the first):
    /// what a document changed only in its history is compared with.
    last_written: Option<StateDocument>,
    /// Someone else wrote the document: nothing more may be written in this tick.
    pub lost: bool,
}

impl<'a> StateWriter<'a> {
    pub fn new(store: &'a dyn StateStore, key: &'a StateKey, etag: Option<ETag>) -> Self {
        let condition = match etag {
            Some(etag) => WriteCondition::Matches(etag),
            None => WriteCondition::Absent,
        };
        StateWriter { store, key, condition, unacknowledged: Vec::new(), last_written: None, lost: false }
    }

    pub async fn write(&mut self, document: &mut StateDocument) -> Result<(), WriteFailure> {
        // A few retries at most: after finding our own earlier write in place of the one we
        // expected, or an operator's history line over our last write.
        for _ in 0..WRITE_ATTEMPTS {
            let write_id = uuid::Uuid::new_v4().simple().to_string();
            document.write_id = Some(write_id.clone());
            match self.store.write(self.key, document, self.condition.clone()).await {
                Ok(etag) => {
                    self.acknowledged(etag, document);
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
                            self.acknowledged(versioned.etag, &versioned.document);
                            return Ok(());
                        }
                        (Some(versioned), WriteCheck::EarlierWriteLanded) => {
                            // Ours, from a write whose answer was an error: write again over it.
                            self.acknowledged(versioned.etag, &versioned.document);
                        }
                        (Some(versioned), WriteCheck::Conflict) if self.only_history_changed(&versioned.document) => {
                            // An operator recorded something beside the tick: keep its line.
                            document.history = versioned.document.history;
                            self.condition = WriteCondition::Matches(versioned.etag);
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

    fn acknowledged(&mut self, etag: ETag, document: &StateDocument) {
        self.condition = WriteCondition::Matches(etag);
        self.unacknowledged.clear();
        self.last_written = Some(document.clone());
    }

    /// Whether `stored` is what this writer last wrote, but for `history` and `write_id`.
    fn only_history_changed(&self, stored: &StateDocument) -> bool {
        let Some(last) = &self.last_written else {
            return false;
        };
        // Compared as stored: both read back from their bytes, so that what serialization does
        // not keep (a null in an optional field) is not taken for a change.
        let Ok(last) = StateDocument::parse(&last.to_bytes()) else {
            return false;
        };
        let mut comparable = stored.clone();
        comparable.history = last.history.clone();
        comparable.write_id = last.write_id.clone();
        comparable == last
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::transitions::{self, HistoryAction, Operator};
    use crate::store::memory::MemoryStore;

    fn at(seconds: i64) -> chrono::DateTime<chrono::Utc> {
        chrono::DateTime::from_timestamp(1_780_000_000 + seconds, 0).unwrap()
    }

    /// Regression (issue 24, item 8): an operator's history line written between two writes of a
    /// tick is adopted, and the tick's next write lands with it; any other change is a conflict.
    #[tokio::test]
    async fn a_history_line_between_two_writes_is_adopted_anything_else_conflicts() {
        let store = MemoryStore::new();
        let key = StateKey::new("app", "orders");
        let mut document = StateDocument::new("orders", "sha256:a");
        let mut writer = StateWriter::new(&store, &key, None);
        writer.write(&mut document).await.ok().unwrap();

        let operator = Operator { who: "ops@host", force: false, reason: None };
        let stored = store.read(&key).await.unwrap().unwrap();
        let audited =
            transitions::audit(&stored.document, operator, HistoryAction::QuarantinePurge, "purged 1".into(), at(1));
        store.write(&key, &audited, WriteCondition::Matches(stored.etag)).await.unwrap();

        document.stats.rows_delivered = 7;
        writer.write(&mut document).await.ok().expect("adopted, not lost");
        assert!(!writer.lost);
        let stored = store.read(&key).await.unwrap().unwrap().document;
        assert_eq!(stored.stats.rows_delivered, 7);
        assert_eq!(stored.history.len(), 1, "the operator's line kept");
        assert_eq!(document.history, stored.history, "the tick's own copy has it too");

        // Someone else took the lease meanwhile: a conflict, as before.
        let current = store.read(&key).await.unwrap().unwrap();
        let mut taken = current.document.clone();
        taken.stats.rows_delivered = 99;
        store.write(&key, &taken, WriteCondition::Matches(current.etag)).await.unwrap();
        document.stats.rows_delivered = 8;
        assert!(matches!(writer.write(&mut document).await, Err(WriteFailure::Conflict(Some(_)))));
        assert!(writer.lost);
    }
}
