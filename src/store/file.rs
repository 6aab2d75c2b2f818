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
//!
//! Every path is checked name by name ([`super::check_path`]) before it touches the disk, so no
//! name can reach outside the root; a blob over [`super::MAX_BLOB_BYTES`] is refused as it is read.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use sha2::{Digest, Sha256};

use super::{
    Blob, BlobStore, ETag, ListPage, Listed, MAX_BLOB_BYTES, PutMode, StateKey, StoreError, check_path, check_prefix,
    too_large,
};

pub struct FileStore {
    root: PathBuf,
    page_size: usize,
    max_blob_bytes: usize,
}

impl FileStore {
    pub fn new(root: PathBuf) -> Self {
        FileStore { root, page_size: 1000, max_blob_bytes: MAX_BLOB_BYTES }
    }

    /// Reads refuse blobs over `bytes` (tests check the bound with a small one).
    pub fn with_max_blob_bytes(mut self, bytes: usize) -> Self {
        self.max_blob_bytes = bytes;
        self
    }

    /// Lists return at most `size` paths a page (tests exercise paging with a small one).
    pub fn with_page_size(mut self, size: usize) -> Self {
        self.page_size = size.max(1);
        self
    }

    /// A state document's file.
    pub fn path_of(&self, key: &StateKey) -> PathBuf {
        self.root.join(key.blob_path())
    }

    /// The file of a blob path, once every name in it is checked.
    fn file_of(&self, path: &str) -> Result<PathBuf, StoreError> {
        check_path(path)?;
        Ok(self.root.join(path))
    }
}

/// What a blob's file holds, read up to a bound, with its ETag.
enum Stored {
    Absent,
    Bytes(Vec<u8>, ETag),
    /// More than the bound: its length and its ETag, and nothing of it kept.
    Oversized(u64, ETag),
}

impl Stored {
    /// The ETag of what is stored: the digest of every byte, whether the blob was kept or only
    /// hashed (over the bound), so that a blob has one ETag whatever bound it is read with: a
    /// delete (an operator purging it) names it by what any read or listing gave.
    fn etag(&self) -> Option<ETag> {
        match self {
            Stored::Absent => None,
            Stored::Bytes(_, etag) | Stored::Oversized(_, etag) => Some(etag.clone()),
        }
    }
}

fn etag_of(bytes: &[u8]) -> ETag {
    etag_of_digest(&Sha256::digest(bytes))
}

fn etag_of_digest(digest: &[u8]) -> ETag {
    ETag(format!("\"{}\"", &hex::encode(digest)[..32]))
}

fn unavailable(path: &Path, action: &str, error: std::io::Error) -> StoreError {
    StoreError::Unavailable {
        location: path.display().to_string(),
        reason: format!("cannot {action}: {error}"),
        retryable: matches!(error.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut),
    }
}

/// A blob's bytes, at most `max` of them: a longer file is [`Stored::Oversized`], hashed to its
/// end in chunks but never held.
fn read_stored(path: &Path, max: usize) -> Result<Stored, StoreError> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == ErrorKind::NotFound => return Ok(Stored::Absent),
        Err(error) => return Err(unavailable(path, "read", error)),
    };
    let expected = file.metadata().map(|metadata| metadata.len()).unwrap_or(0);
    let mut bytes = Vec::with_capacity(usize::try_from(expected).unwrap_or(usize::MAX).min(max));
    let mut digest = Sha256::new();
    let mut length: u64 = 0;
    let mut oversized = false;
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let read = match file.read(&mut chunk) {
            Ok(0) => break,
            Ok(read) => read,
            Err(error) if error.kind() == ErrorKind::Interrupted => continue,
            Err(error) => return Err(unavailable(path, "read", error)),
        };
        digest.update(&chunk[..read]);
        length += read as u64;
        if !oversized && bytes.len() + read > max {
            oversized = true;
            bytes = Vec::new();
        }
        if !oversized {
            bytes.extend_from_slice(&chunk[..read]);
        }
    }
    let etag = etag_of_digest(&digest.finalize());
    if oversized {
        return Ok(Stored::Oversized(length, etag));
    }
    Ok(Stored::Bytes(bytes, etag))
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

fn write_locked(path: &Path, bytes: &[u8], mode: &PutMode, max: usize) -> Result<ETag, StoreError> {
    let directory = path.parent().expect("a blob path has a parent");
    let lock = lock_blob(path)?;
    let location = path.display().to_string();
    let current = read_stored(path, max)?.etag();
    match (mode, &current) {
        (PutMode::Create, Some(_)) => return Err(StoreError::AlreadyExists { location }),
        (PutMode::Update(_), None) => return Err(StoreError::Conflict { location }),
        (PutMode::Update(expected), Some(current_etag)) if expected != current_etag => {
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

fn delete_locked(path: &Path, etag: &ETag, max: usize) -> Result<(), StoreError> {
    let lock = lock_blob(path)?;
    let location = path.display().to_string();
    match read_stored(path, max)?.etag() {
        Some(current) if current == *etag => {
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
        let entry = entry.map_err(|error| unavailable(directory, "list", error))?;
        let path = entry.path();
        let name = path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
        if name.starts_with('.') || name.ends_with(".lock") {
            continue;
        }
        // The entry's own type, links not followed: a link inside the store is not walked into.
        let Ok(file_type) = entry.file_type() else {
            continue;
        };
        if file_type.is_symlink() {
            continue;
        }
        if file_type.is_dir() {
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
        self.get_bounded(path, self.max_blob_bytes).await
    }

    async fn get_bounded(&self, path: &str, max: usize) -> Result<Option<Blob>, StoreError> {
        let file = self.file_of(path)?;
        let read = tokio::task::spawn_blocking(move || read_stored(&file, max).map(|stored| (stored, file)))
            .await
            .expect("the read task does not panic")?;
        match read {
            (Stored::Absent, _) => Ok(None),
            (Stored::Bytes(bytes, etag), _) => Ok(Some(Blob { etag, bytes })),
            (Stored::Oversized(length, _), file) => Err(too_large(file.display().to_string(), Some(length), max)),
        }
    }

    async fn put(&self, path: &str, bytes: Vec<u8>, mode: PutMode) -> Result<ETag, StoreError> {
        let file = self.file_of(path)?;
        let max = self.max_blob_bytes;
        tokio::task::spawn_blocking(move || write_locked(&file, &bytes, &mode, max))
            .await
            .expect("the write task does not panic")
    }

    async fn list(&self, prefix: &str, continuation: Option<String>) -> Result<ListPage, StoreError> {
        check_prefix(prefix)?;
        let max = self.max_blob_bytes;
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
                if let Some(etag) = read_stored(&root.join(&path), max)?.etag() {
                    page.items.push(Listed { path, etag });
                }
            }
            Ok(page)
        })
        .await
        .expect("the list task does not panic")
    }

    async fn delete(&self, path: &str, etag: &ETag) -> Result<(), StoreError> {
        let file = self.file_of(path)?;
        let etag = etag.clone();
        let max = self.max_blob_bytes;
        tokio::task::spawn_blocking(move || delete_locked(&file, &etag, max))
            .await
            .expect("the delete task does not panic")
    }

    fn describe(&self) -> String {
        format!("file:{}", self.root.display())
    }
}
