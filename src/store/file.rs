//! The embedded local store: `file:<dir>` keeps each document at `<dir>/state/{app}/{poller}.json`,
//! mirroring the blob layout, so `cat` shows what Azure would hold.
//!
//! Compare-and-swap holds across processes: a write takes an exclusive OS lock on a sibling
//! `.lock` file, re-reads the document, checks the condition, writes a temporary file, syncs it
//! and renames it over the document (an atomic replace). Readers never lock: they see the old or
//! the new document, never a half-written one. The ETag is a hash of the bytes; since every write
//! of a tick carries a fresh `write_id`, two versions never share bytes.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use sha2::{Digest, Sha256};

use super::{ETag, StateKey, StateStore, StoreError, Versioned, WriteCondition};
use crate::domain::StateDocument;

pub struct FileStore {
    root: PathBuf,
}

impl FileStore {
    pub fn new(root: PathBuf) -> Self {
        FileStore { root }
    }

    /// The document's path.
    pub fn path_of(&self, key: &StateKey) -> PathBuf {
        self.root.join(key.blob_path())
    }
}

fn etag_of(bytes: &[u8]) -> ETag {
    let digest = Sha256::digest(bytes);
    ETag(format!("\"{}\"", &hex::encode(digest)[..32]))
}

fn unavailable(path: &Path, action: &str, error: std::io::Error) -> StoreError {
    StoreError::Unavailable {
        location: path.display().to_string(),
        reason: format!("cannot {action}: {error}"),
        retryable: matches!(error.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut),
    }
}

fn read_bytes(path: &Path) -> Result<Option<Vec<u8>>, StoreError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(error) if error.kind() == ErrorKind::NotFound => Ok(None),
        Err(error) => Err(unavailable(path, "read", error)),
    }
}

fn write_locked(path: &Path, bytes: &[u8], condition: &WriteCondition) -> Result<ETag, StoreError> {
    let directory = path.parent().expect("a document path has a parent");
    std::fs::create_dir_all(directory).map_err(|error| unavailable(directory, "create the directory", error))?;
    let lock_path = path.with_extension("json.lock");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|error| unavailable(&lock_path, "open the lock file", error))?;
    lock.lock().map_err(|error| unavailable(&lock_path, "lock", error))?;
    let location = path.display().to_string();
    let current = read_bytes(path)?;
    match (condition, &current) {
        (WriteCondition::Absent, Some(_)) => return Err(StoreError::AlreadyExists { location }),
        (WriteCondition::Matches(_), None) => return Err(StoreError::Conflict { location }),
        (WriteCondition::Matches(expected), Some(current_bytes)) if *expected != etag_of(current_bytes) => {
            return Err(StoreError::Conflict { location });
        }
        _ => {}
    }
    let file_name = path.file_name().and_then(|name| name.to_str()).unwrap_or("state.json");
    let temporary = directory.join(format!(".{file_name}.{}.tmp", uuid::Uuid::new_v4().simple()));
    let result = (|| {
        let mut file = File::create(&temporary)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)?;
        // The rename is durable once the directory entry is.
        if let Ok(directory_handle) = File::open(directory) {
            let _ = directory_handle.sync_all();
        }
        Ok::<(), std::io::Error>(())
    })();
    if let Err(error) = result {
        let _ = std::fs::remove_file(&temporary);
        return Err(unavailable(path, "write", error));
    }
    // The lock is released when `lock` is dropped, after the rename.
    drop(lock);
    Ok(etag_of(bytes))
}

#[async_trait]
impl StateStore for FileStore {
    async fn read(&self, key: &StateKey) -> Result<Option<Versioned>, StoreError> {
        let path = self.path_of(key);
        let bytes = tokio::task::spawn_blocking({
            let path = path.clone();
            move || read_bytes(&path)
        })
        .await
        .expect("the read task does not panic")?;
        let Some(bytes) = bytes else {
            return Ok(None);
        };
        let document = StateDocument::parse(&bytes)
            .map_err(|error| StoreError::Corrupt { location: path.display().to_string(), reason: error.to_string() })?;
        Ok(Some(Versioned { document, etag: etag_of(&bytes) }))
    }

    async fn write(
        &self,
        key: &StateKey,
        document: &StateDocument,
        condition: WriteCondition,
    ) -> Result<ETag, StoreError> {
        let path = self.path_of(key);
        let bytes = document.to_bytes();
        tokio::task::spawn_blocking(move || write_locked(&path, &bytes, &condition))
            .await
            .expect("the write task does not panic")
    }

    fn describe(&self) -> String {
        format!("file:{}", self.root.display())
    }
}
