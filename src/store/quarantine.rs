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

/// Writes an entry (again, if it is there: the same event gives the same entry).
pub async fn put(blobs: &dyn BlobStore, app: &str, entry: &QuarantineEntry) -> Result<(), StoreError> {
    let mut bytes = serde_json::to_vec_pretty(entry).expect("an entry serializes");
    bytes.push(b'\n');
    blobs.put(&path(app, &entry.poller, &entry.id), bytes, PutMode::Overwrite).await.map(|_| ())
}

/// Every entry of a poller, in id order, with the ETag each was read at.
pub async fn list(blobs: &dyn BlobStore, app: &str, poller: &str) -> Result<Vec<(QuarantineEntry, ETag)>, StoreError> {
    let mut entries = Vec::new();
    let mut continuation = None;
    loop {
        let ListPage { items, next } = blobs.list(&prefix(app, poller), continuation).await?;
        for item in items {
            let Some(blob) = blobs.get(&item.path).await? else {
                continue;
            };
            let entry: QuarantineEntry = serde_json::from_slice(&blob.bytes).map_err(|error| StoreError::Corrupt {
                location: format!("{}/{}", blobs.describe(), item.path),
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
