//! The embedded local store: `file:<dir>` keeps each blob at `<dir>/<path>` (state documents at
//! `<dir>/state/{app}/{poller}.json`), mirroring the blob layout, so `cat` shows what Azure would
//! hold.
//!
//! Compare-and-swap holds across processes: a write takes an exclusive OS lock on a sibling
//! `.lock` file, re-reads the document, checks the condition, writes a temporary file, syncs it
//! and renames it over the document (an atomic replace); a delete takes the same lock. Readers never
//! lock: they see the old or the new document, never a half-written one. The ETag is a hash of the
//! bytes; since every write of a tick carries a fresh `write_id`, two versions never share bytes.
//! Lock and temporary files (`*.lock`, `.*.tmp`) are never listed.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use sha2::{Digest, Sha256};

use super::{Blob, BlobStore, ETag, ListPage, Listed, PutMode, StateKey, StoreError};

pub struct FileStore {
    root: PathBuf,
    page_size: usize,
}

impl FileStore {
    pub fn new(root: PathBuf) -> Self {
        FileStore { root, page_size: 1000 }
    }

    /// Lists return at most `size` paths a page (tests exercise paging with a small one).
    pub fn with_page_size(mut self, size: usize) -> Self {
        self.page_size = size.max(1);
        self
    }

    /// A state document's file.
    pub fn path_of(&self, key: &StateKey) -> PathBuf {
        self.file_of(&key.blob_path())
    }

    fn file_of(&self, path: &str) -> PathBuf {
        self.root.join(path)
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

/// The exclusive lock that serializes writers (and deleters) of one blob across processes,
/// released when dropped.
fn lock_blob(path: &Path) -> Result<File, StoreError> {
    let directory = path.parent().expect("a blob path has a parent");
    std::fs::create_dir_all(directory).map_err(|error| unavailable(directory, "create the directory", error))?;
    let file_name = path.file_name().and_then(|name| name.to_str()).unwrap_or("blob");
    let lock_path = directory.join(format!("{file_name}.lock"));
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|error| unavailable(&lock_path, "open the lock file", error))?;
    lock.lock().map_err(|error| unavailable(&lock_path, "lock", error))?;
    Ok(lock)
}

fn write_locked(path: &Path, bytes: &[u8], mode: &PutMode) -> Result<ETag, StoreError> {
    let directory = path.parent().expect("a blob path has a parent");
    let lock = lock_blob(path)?;
    let location = path.display().to_string();
    let current = read_bytes(path)?;
    match (mode, &current) {
        (PutMode::Create, Some(_)) => return Err(StoreError::AlreadyExists { location }),
        (PutMode::Update(_), None) => return Err(StoreError::Conflict { location }),
        (PutMode::Update(expected), Some(current_bytes)) if *expected != etag_of(current_bytes) => {
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

fn delete_locked(path: &Path, etag: &ETag) -> Result<(), StoreError> {
    let lock = lock_blob(path)?;
    let location = path.display().to_string();
    match read_bytes(path)? {
        Some(current) if etag_of(&current) == *etag => {
            std::fs::remove_file(path).map_err(|error| unavailable(path, "delete", error))?;
            drop(lock);
            Ok(())
        }
        _ => Err(StoreError::Conflict { location }),
    }
}

/// Every blob under `directory`, as `/`-separated paths relative to `root`, lock and temporary
/// files left out.
fn walk(root: &Path, directory: &Path, found: &mut Vec<String>) -> Result<(), StoreError> {
    let entries = match std::fs::read_dir(directory) {
        Ok(entries) => entries,
        Err(error) if error.kind() == ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(unavailable(directory, "list", error)),
    };
    for entry in entries {
        let path = entry.map_err(|error| unavailable(directory, "list", error))?.path();
        let name = path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
        if name.starts_with('.') || name.ends_with(".lock") {
            continue;
        }
        if path.is_dir() {
            walk(root, &path, found)?;
        } else if let Ok(relative) = path.strip_prefix(root) {
            let parts: Vec<String> =
                relative.components().map(|part| part.as_os_str().to_string_lossy().into_owned()).collect();
            found.push(parts.join("/"));
        }
    }
    Ok(())
}

#[async_trait]
impl BlobStore for FileStore {
    async fn get(&self, path: &str) -> Result<Option<Blob>, StoreError> {
        let file = self.file_of(path);
        let bytes =
            tokio::task::spawn_blocking(move || read_bytes(&file)).await.expect("the read task does not panic")?;
        Ok(bytes.map(|bytes| Blob { etag: etag_of(&bytes), bytes }))
    }

    async fn put(&self, path: &str, bytes: Vec<u8>, mode: PutMode) -> Result<ETag, StoreError> {
        let file = self.file_of(path);
        tokio::task::spawn_blocking(move || write_locked(&file, &bytes, &mode))
            .await
            .expect("the write task does not panic")
    }

    async fn list(&self, prefix: &str, continuation: Option<String>) -> Result<ListPage, StoreError> {
        let root = self.root.clone();
        let prefix = prefix.to_string();
        let page_size = self.page_size;
        tokio::task::spawn_blocking(move || {
            // Only the directory the prefix names needs walking.
            let directory = match prefix.rfind('/') {
                Some(end) => root.join(&prefix[..end]),
                None => root.clone(),
            };
            let mut paths = Vec::new();
            walk(&root, &directory, &mut paths)?;
            paths.retain(|path| path.starts_with(&prefix) && continuation.as_ref().is_none_or(|after| path > after));
            paths.sort();
            let mut page = ListPage::default();
            for path in paths {
                if page.items.len() == page_size {
                    page.next = page.items.last().map(|last: &Listed| last.path.clone());
                    break;
                }
                // A blob deleted between the walk and this read is simply not listed.
                if let Some(bytes) = read_bytes(&root.join(&path))? {
                    page.items.push(Listed { path, etag: etag_of(&bytes) });
                }
            }
            Ok(page)
        })
        .await
        .expect("the list task does not panic")
    }

    async fn delete(&self, path: &str, etag: &ETag) -> Result<(), StoreError> {
        let file = self.file_of(path);
        let etag = etag.clone();
        tokio::task::spawn_blocking(move || delete_locked(&file, &etag)).await.expect("the delete task does not panic")
    }

    fn describe(&self) -> String {
        format!("file:{}", self.root.display())
    }
}
