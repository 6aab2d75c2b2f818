//! Blobs in Azure Blob Storage (`{container}/<path>`; state documents at
//! `state/{app}/{poller}.json`), with the ETag compare-and-swap of seed 000 §5. A get returns the
//! bytes and their ETag; a create sends `If-None-Match: *`; an update and a delete send
//! `If-Match: <etag>`; a list pages through blobs by prefix with the service's continuation
//! marker. 404 means absent, 412 a conflict, 409 BlobAlreadyExists an existing blob; anything else
//! says whether retrying may help.
//!
//! The container is created the first time a write finds it missing (an existing one is fine), so a
//! steady tick costs exactly the requests of the design's blob budget.

use std::num::NonZero;
use std::sync::Arc;

use async_trait::async_trait;
use azure_core::error::ErrorKind;
use azure_core::http::{Etag, RequestContent};
use azure_storage_blob::models::{
    BlobClientDeleteOptions, BlobClientDownloadOptions, BlobClientUploadOptions, BlobContainerClientListBlobsOptions,
};
use azure_storage_blob::{BlobContainerClient, BlobContainerClientOptions};
use futures::StreamExt;

use super::{
    Blob, BlobStore, ETag, ListPage, Listed, MAX_BLOB_BYTES, PutMode, StateKey, StoreError, check_path, check_prefix,
    too_large,
};
use crate::azure::{RequestCounter, StorageConnection, client_options, token_credential};

/// Blobs a list page holds at most (the service's own maximum is 5,000).
const LIST_PAGE_SIZE: i32 = 1000;

pub struct AzureBlobStore {
    container: BlobContainerClient,
    /// `account/container`, for messages (no secret).
    location: String,
    counter: Arc<RequestCounter>,
    list_page_size: i32,
    max_blob_bytes: usize,
}

/// What an SDK error means here. Classified before anything else touches the error (it is not
/// Clone, and its message may be long).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Failure {
    NotFound { container_missing: bool },
    PreconditionFailed,
    AlreadyExists,
    Other { reason: String, retryable: bool },
}

/// The service's answer, in the words dbtrigger keeps (its error code and message are text from a
/// peer: escaped here, where they enter, before any log line or stored error holds them).
fn classify(error: azure_core::Error) -> Failure {
    match classify_unescaped(error) {
        Failure::Other { reason, retryable } => {
            Failure::Other { reason: crate::config::redact::escape_peer_text(&reason), retryable }
        }
        other => other,
    }
}

fn classify_unescaped(error: azure_core::Error) -> Failure {
    match error.kind() {
        ErrorKind::HttpResponse { status, error_code, .. } => {
            let code = u16::from(*status);
            let error_code = error_code.clone().unwrap_or_default();
            match code {
                404 => Failure::NotFound { container_missing: error_code == "ContainerNotFound" },
                412 => Failure::PreconditionFailed,
                409 if error_code == "BlobAlreadyExists" => Failure::AlreadyExists,
                403 => Failure::Other {
                    reason: format!(
                        "HTTP 403 {error_code}: the storage account refused the credentials (check the account key or the identity's role)"
                    ),
                    retryable: false,
                },
                408 | 429 | 500..=599 => {
                    Failure::Other { reason: format!("HTTP {code} {error_code}"), retryable: true }
                }
                _ => Failure::Other { reason: format!("HTTP {code} {error_code}"), retryable: false },
            }
        }
        ErrorKind::Connection | ErrorKind::Io => {
            Failure::Other { reason: format!("cannot reach the storage account: {error}"), retryable: true }
        }
        ErrorKind::Credential => Failure::Other { reason: format!("cannot get a token: {error}"), retryable: true },
        _ => Failure::Other { reason: error.to_string(), retryable: false },
    }
}

impl AzureBlobStore {
    pub fn new(connection: &StorageConnection, container: &str) -> Result<Self, String> {
        let counter = Arc::new(RequestCounter::default());
        let mut url = connection.blob_endpoint.clone();
        url.path_segments_mut()
            .map_err(|_| "the blob endpoint cannot hold a path".to_string())?
            .pop_if_empty()
            .push(container);
        let options = BlobContainerClientOptions {
            client_options: client_options(connection, counter.clone()),
            ..Default::default()
        };
        let credential = token_credential(connection)?;
        let container_client = BlobContainerClient::new(url, credential, Some(options))
            .map_err(|error| format!("cannot create the blob client: {error}"))?;
        Ok(AzureBlobStore {
            container: container_client,
            location: format!("azure-blob:{}/{container}", connection.account),
            counter,
            list_page_size: LIST_PAGE_SIZE,
            max_blob_bytes: MAX_BLOB_BYTES,
        })
    }

    /// Lists return at most `size` blobs a page (tests exercise paging with a small one).
    pub fn with_list_page_size(mut self, size: i32) -> Self {
        self.list_page_size = size.max(1);
        self
    }

    /// Reads refuse blobs over `bytes` (tests check the bound with a small one).
    pub fn with_max_blob_bytes(mut self, bytes: usize) -> Self {
        self.max_blob_bytes = bytes;
        self
    }

    /// Writes a state document's bytes unconditionally (tests and operator tools plant or restore
    /// a document this way: the poller itself never writes without a condition).
    pub async fn write_raw(&self, key: &StateKey, bytes: &[u8]) -> Result<(), StoreError> {
        self.put(&key.blob_path(), bytes.to_vec(), PutMode::Overwrite).await.map(|_| ())
    }

    /// A state document's stored bytes, unparsed (`None` when absent).
    pub async fn read_raw(&self, key: &StateKey) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.get(&key.blob_path()).await?.map(|blob| blob.bytes))
    }

    /// Requests sent so far: (GET/HEAD, PUT).
    pub fn request_counts(&self) -> (u64, u64) {
        self.counter.snapshot()
    }

    fn location_of(&self, path: &str) -> String {
        format!("{}/{path}", self.location)
    }

    fn unavailable(&self, path: &str, reason: String, retryable: bool) -> StoreError {
        StoreError::Unavailable { location: self.location_of(path), reason, retryable }
    }

    async fn create_container(&self, path: &str) -> Result<(), StoreError> {
        match self.container.create(None).await {
            Ok(_) => Ok(()),
            Err(error) => match error.kind() {
                ErrorKind::HttpResponse { status, .. } if u16::from(*status) == 409 => Ok(()),
                _ => match classify(error) {
                    Failure::Other { reason, retryable } => {
                        Err(self.unavailable(path, format!("cannot create the container: {reason}"), retryable))
                    }
                    other => Err(self.unavailable(path, format!("cannot create the container: {other:?}"), false)),
                },
            },
        }
    }

    async fn upload(&self, path: &str, bytes: azure_core::Bytes, mode: &PutMode) -> Result<ETag, Failure> {
        let content_type = if path.ends_with(".json") { "application/json" } else { "application/octet-stream" };
        let mut options =
            BlobClientUploadOptions { blob_content_type: Some(content_type.to_string()), ..Default::default() };
        match mode {
            PutMode::Create => options.if_none_match = Some(Etag::from("*")),
            PutMode::Update(etag) => options.if_match = Some(Etag::from(etag.0.as_str())),
            PutMode::Overwrite => {}
        }
        let blob = self.container.blob_client(path);
        let content: RequestContent<azure_core::Bytes, azure_core::http::NoFormat> = bytes.into();
        let result = blob.upload(content, Some(options)).await.map_err(classify)?;
        let etag = result
            .etag
            .ok_or_else(|| Failure::Other { reason: "the upload answered no ETag".into(), retryable: true })?;
        Ok(ETag(etag.to_string()))
    }
}

#[async_trait]
impl BlobStore for AzureBlobStore {
    async fn get(&self, path: &str) -> Result<Option<Blob>, StoreError> {
        self.get_bounded(path, self.max_blob_bytes).await
    }

    async fn get_bounded(&self, path: &str, max_bytes: usize) -> Result<Option<Blob>, StoreError> {
        check_path(path)?;
        let blob = self.container.blob_client(path);
        let options = BlobClientDownloadOptions { parallel: NonZero::new(1), ..Default::default() };
        let result = match blob.download(Some(options)).await {
            Ok(result) => result,
            Err(error) => {
                return match classify(error) {
                    Failure::NotFound { .. } => Ok(None),
                    Failure::Other { reason, retryable } => Err(self.unavailable(path, reason, retryable)),
                    other => Err(self.unavailable(path, format!("unexpected answer to a read: {other:?}"), true)),
                };
            }
        };
        let etag = result
            .properties
            .etag
            .clone()
            .ok_or_else(|| self.unavailable(path, "the read answered no ETag".into(), true))?;
        let size = result.properties.content_length;
        if size.is_some_and(|size| size > max_bytes as u64) {
            return Err(too_large(self.location_of(path), size, max_bytes));
        }
        // Read chunk by chunk up to the bound: a length header is not what bounds memory (it
        // only sizes the buffer, within the bound, so that a large blob is not copied as it grows).
        let mut body = result.body;
        let expected = size.and_then(|size| usize::try_from(size).ok()).unwrap_or(0).min(max_bytes);
        let mut bytes = Vec::with_capacity(expected);
        while let Some(chunk) = body.next().await {
            let chunk =
                chunk.map_err(|error| self.unavailable(path, format!("reading the blob failed: {error}"), true))?;
            if bytes.len() + chunk.len() > max_bytes {
                return Err(too_large(self.location_of(path), size, max_bytes));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(Some(Blob { bytes, etag: ETag(etag.to_string()) }))
    }

    async fn put(&self, path: &str, bytes: Vec<u8>, mode: PutMode) -> Result<ETag, StoreError> {
        check_path(path)?;
        // Shared, not copied: a retry after creating the container sends the same bytes.
        let bytes = azure_core::Bytes::from(bytes);
        let mut result = self.upload(path, bytes.clone(), &mode).await;
        if matches!(result, Err(Failure::NotFound { container_missing: true })) {
            self.create_container(path).await?;
            result = self.upload(path, bytes, &mode).await;
        }
        match (result, &mode) {
            (Ok(etag), _) => Ok(etag),
            (Err(Failure::AlreadyExists | Failure::PreconditionFailed), PutMode::Create) => {
                Err(StoreError::AlreadyExists { location: self.location_of(path) })
            }
            (Err(Failure::PreconditionFailed | Failure::NotFound { .. }), PutMode::Update(_)) => {
                Err(StoreError::Conflict { location: self.location_of(path) })
            }
            (Err(Failure::Other { reason, retryable }), _) => Err(self.unavailable(path, reason, retryable)),
            (Err(other), _) => Err(self.unavailable(path, format!("unexpected answer to a write: {other:?}"), false)),
        }
    }

    async fn list(&self, prefix: &str, continuation: Option<String>) -> Result<ListPage, StoreError> {
        check_prefix(prefix)?;
        let options = BlobContainerClientListBlobsOptions {
            prefix: Some(prefix.to_string()),
            marker: continuation,
            maxresults: Some(self.list_page_size),
            ..Default::default()
        };
        let failed = |error: azure_core::Error| match classify(error) {
            Failure::Other { reason, retryable } => {
                self.unavailable(prefix, format!("listing failed: {reason}"), retryable)
            }
            other => self.unavailable(prefix, format!("listing failed: {other:?}"), true),
        };
        let pager = self.container.list_blobs(Some(options)).map_err(failed)?;
        let mut pages = pager.into_pages();
        let page = match pages.next().await {
            None => return Ok(ListPage::default()),
            Some(Ok(response)) => response.into_model().map_err(failed)?,
            // No container yet: nothing in it.
            Some(Err(error)) => match classify(error) {
                Failure::NotFound { .. } => return Ok(ListPage::default()),
                Failure::Other { reason, retryable } => {
                    return Err(self.unavailable(prefix, format!("listing failed: {reason}"), retryable));
                }
                other => return Err(self.unavailable(prefix, format!("listing failed: {other:?}"), true)),
            },
        };
        let mut items = Vec::new();
        for item in page.blob_items {
            let (Some(path), Some(etag)) = (item.name, item.properties.and_then(|properties| properties.etag)) else {
                continue;
            };
            // The listing's XML gives the ETag bare, the headers quoted: one form, the headers'.
            let etag = etag.to_string();
            let etag = if etag.starts_with('"') { etag } else { format!("\"{etag}\"") };
            items.push(Listed { path, etag: ETag(etag) });
        }
        let next = page.next_marker.filter(|marker| !marker.is_empty());
        Ok(ListPage { items, next })
    }

    async fn delete(&self, path: &str, etag: &ETag) -> Result<(), StoreError> {
        check_path(path)?;
        let options = BlobClientDeleteOptions { if_match: Some(Etag::from(etag.0.as_str())), ..Default::default() };
        match self.container.blob_client(path).delete(Some(options)).await.map_err(classify) {
            Ok(_) => Ok(()),
            Err(Failure::PreconditionFailed | Failure::NotFound { .. }) => {
                Err(StoreError::Conflict { location: self.location_of(path) })
            }
            Err(Failure::Other { reason, retryable }) => Err(self.unavailable(path, reason, retryable)),
            Err(other) => Err(self.unavailable(path, format!("unexpected answer to a delete: {other:?}"), false)),
        }
    }

    fn describe(&self) -> String {
        self.location.clone()
    }
}
