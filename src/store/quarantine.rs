//! Quarantine entries over a [`BlobStore`]: one document per row isolated as poison, at
//! `quarantine/{app}/{poller}/{id}.json` beside the state documents. An entry holds the event
//! exactly as it would have been delivered (the row included), the error, and where it came from.
//! Its id is derived from the event id, so a tick that crashed between writing the entry and moving
//! the checkpoint writes the same entry again: never a lost row, never a duplicate entry.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{BlobStore, ETag, ListPage, PutMode, StoreError};

/// One quarantined row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuarantineEntry {
    pub id: String,
    pub poller: String,
    /// The event as the sink would have received it: `event_id`, `op`, `cursor`, `pk`, `row`.
    pub event: Value,
    /// The receiver's answer (the first KiB of its body), or why the delivery failed.
    pub error: String,
    /// The HTTP status of a refusal, when there was one.
    pub status: Option<u16>,
    /// Failed ticks on the batch before it was isolated.
    pub attempts: u32,
    pub batch_id: String,
    pub fencing_token: u64,
    pub source_fingerprint: String,
    pub first_failure_at: DateTime<Utc>,
    pub last_failure_at: DateTime<Utc>,
    pub quarantined_at: DateTime<Utc>,
}

/// The most bytes one quarantine entry may take when read: an entry holds one row within
/// `source.maxRowBytes` (at most [`crate::config::limits::ROW_MAX_BYTES`]) as an event, whose key
/// and cursor come again beside the row, and the error. Every entry a tick can write is read
/// whole by the operator's commands (`list`, `show`, `replay`, `purge`), one at a time, whatever
/// the store's bound for state documents ([`super::MAX_BLOB_BYTES`]).
pub const MAX_ENTRY_BYTES: usize = 2 * crate::config::limits::ROW_MAX_BYTES + (1 << 20);

/// The entry id of an event: stable, path-safe.
pub fn entry_id(event_id: &str) -> String {
    format!("q_{}", event_id.trim_start_matches("evt_"))
}

/// Where a poller's entries live.
pub fn prefix(app: &str, poller: &str) -> String {
    format!("quarantine/{app}/{poller}/")
}

pub fn path(app: &str, poller: &str, id: &str) -> String {
    format!("{}{id}.json", prefix(app, poller))
}

/// Writes an entry (again, if it is there: the same event gives the same entry). Compact JSON:
/// indenting a row's arrays line by line could make its entry several times the row.
pub async fn put(blobs: &dyn BlobStore, app: &str, entry: &QuarantineEntry) -> Result<(), StoreError> {
    let mut bytes = serde_json::to_vec(entry).expect("an entry serializes");
    bytes.push(b'\n');
    blobs.put(&path(app, &entry.poller, &entry.id), bytes, PutMode::Overwrite).await.map(|_| ())
}

/// An entry as stored: its name (the blob's, which is what the entry is read, replayed and purged
/// by, never the `id` written inside it), its path, and the ETag it was read at.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredEntry {
    pub name: String,
    pub path: String,
    pub entry: QuarantineEntry,
    pub etag: ETag,
}

/// An entry that is there but cannot be read as one: reported by name, never acted on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnreadableEntry {
    pub name: String,
    pub reason: String,
}

/// One page of a poller's entries, in name order; `next` continues it.
#[derive(Debug, Clone, Default)]
pub struct EntryPage {
    pub entries: Vec<StoredEntry>,
    pub unreadable: Vec<UnreadableEntry>,
    pub next: Option<String>,
}

/// Whether `name` can be an entry's name, and so part of a path: letters, digits, `_`, `-` and
/// inner dots, nothing that walks out of the poller's folder (`/`, `\`, `..`), at most 200 bytes.
pub fn is_entry_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && !name.contains("..")
        && name.chars().all(|character| character.is_ascii_alphanumeric() || matches!(character, '_' | '-' | '.'))
}

/// The entry at `path`, named `name`: `Ok(None)` when it is gone.
async fn read_at(
    blobs: &dyn BlobStore,
    name: &str,
    path: &str,
) -> Result<Option<Result<StoredEntry, UnreadableEntry>>, StoreError> {
    let blob = match blobs.get_bounded(path, MAX_ENTRY_BYTES).await {
        Ok(Some(blob)) => blob,
        Ok(None) => return Ok(None),
        // More than any tick writes (planted, or written by hand): named, and left to `purge`.
        Err(StoreError::Corrupt { reason, .. }) => {
            return Ok(Some(Err(UnreadableEntry {
                name: name.to_string(),
                reason: format!("{reason}; `dbtrigger quarantine purge` removes it"),
            })));
        }
        Err(error) => return Err(error),
    };
    match serde_json::from_slice::<QuarantineEntry>(&blob.bytes) {
        Ok(entry) => {
            Ok(Some(Ok(StoredEntry { name: name.to_string(), path: path.to_string(), entry, etag: blob.etag })))
        }
        Err(error) => Ok(Some(Err(UnreadableEntry {
            name: name.to_string(),
            reason: format!("not a quarantine entry: {error}"),
        }))),
    }
}

/// `stored` read again, whole, by its path: `Ok(None)` when it is gone. A replay chooses entries
/// without keeping their rows, and reads each again, alone, to deliver it.
pub async fn read_again(
    blobs: &dyn BlobStore,
    stored: &StoredEntry,
) -> Result<Option<Result<StoredEntry, UnreadableEntry>>, StoreError> {
    read_at(blobs, &stored.name, &stored.path).await
}

/// The largest entry a selection keeps whole ([`StoredEntry::for_selection`]).
pub const KEPT_WHOLE_BYTES: usize = 64 * 1024;

impl StoredEntry {
    /// What a selection keeps of an entry it chose: the entry itself when it is small, else the
    /// entry without its row (`event.row` set to null), so that memory holds about one large row
    /// at a time however many entries are chosen; a replay reads every entry again, whole.
    pub fn for_selection(mut self) -> StoredEntry {
        if let Some(row) = self.entry.event.get_mut("row")
            && serde_json::to_vec(row).map(|bytes| bytes.len()).unwrap_or(usize::MAX) > KEPT_WHOLE_BYTES
        {
            *row = Value::Null;
        }
        self
    }
}

/// The entry named `name` (as `list` names it), read alone: `Ok(None)` when there is none. No
/// entry has a name that [`is_entry_name`] refuses: such a name never comes near a path.
pub async fn read_entry(
    blobs: &dyn BlobStore,
    app: &str,
    poller: &str,
    name: &str,
) -> Result<Option<Result<StoredEntry, UnreadableEntry>>, StoreError> {
    if !is_entry_name(name) {
        return Ok(None);
    }
    read_at(blobs, name, &path(app, poller, name)).await
}

/// One page of a poller's entries (`continuation`: the previous page's `next`), each read by the
/// path the listing gave. An entry that cannot be read is reported in `unreadable`, and the page
/// goes on.
pub async fn page(
    blobs: &dyn BlobStore,
    app: &str,
    poller: &str,
    continuation: Option<String>,
) -> Result<EntryPage, StoreError> {
    let (listed, next) = listed_page(blobs, app, poller, continuation).await?;
    let mut page = EntryPage { next, ..EntryPage::default() };
    for listed in listed {
        match read_listed(blobs, &listed).await? {
            None => {}
            Some(Ok(stored)) => page.entries.push(stored),
            Some(Err(unreadable)) => page.unreadable.push(unreadable),
        }
    }
    Ok(page)
}

/// An entry as a listing names it, not read yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedEntry {
    pub name: String,
    pub path: String,
}

/// One page of a poller's entries as the store lists them, none read: a caller reads them one at
/// a time ([`read_listed`]), so that memory holds one entry, whatever their sizes and number.
pub async fn listed_page(
    blobs: &dyn BlobStore,
    app: &str,
    poller: &str,
    continuation: Option<String>,
) -> Result<(Vec<ListedEntry>, Option<String>), StoreError> {
    let folder = prefix(app, poller);
    let ListPage { items, next } = blobs.list(&folder, continuation).await?;
    let mut listed = Vec::with_capacity(items.len());
    for item in items {
        let file = item.path.strip_prefix(&folder).unwrap_or(&item.path);
        let Some(name) = file.strip_suffix(".json").filter(|name| !name.contains('/')) else {
            // Not an entry (a folder below, a file of another kind): not ours to act on.
            continue;
        };
        listed.push(ListedEntry { name: name.to_string(), path: item.path.clone() });
    }
    Ok((listed, next))
}

/// The entry a listing named: `Ok(None)` when it is gone since.
pub async fn read_listed(
    blobs: &dyn BlobStore,
    listed: &ListedEntry,
) -> Result<Option<Result<StoredEntry, UnreadableEntry>>, StoreError> {
    read_at(blobs, &listed.name, &listed.path).await
}

/// Every entry of a poller, in id order, with the ETag each was read at.
pub async fn list(blobs: &dyn BlobStore, app: &str, poller: &str) -> Result<Vec<(QuarantineEntry, ETag)>, StoreError> {
    let mut entries = Vec::new();
    let mut continuation = None;
    loop {
        let ListPage { items, next } = blobs.list(&prefix(app, poller), continuation).await?;
        for item in items {
            let Some(blob) = blobs.get_bounded(&item.path, MAX_ENTRY_BYTES).await? else {
                continue;
            };
            let entry: QuarantineEntry = serde_json::from_slice(&blob.bytes).map_err(|error| StoreError::Corrupt {
                location: format!("the quarantine entry at {}/{}", blobs.describe(), item.path),
                reason: format!("not a quarantine entry: {error}"),
            })?;
            entries.push((entry, blob.etag));
        }
        match next {
            Some(token) => continuation = Some(token),
            None => return Ok(entries),
        }
    }
}
