//! State documents in Azure Blob Storage: `{container}/state/{app}/{poller}.json`, with the ETag
//! compare-and-swap of seed 000 §5. A read returns the document and its ETag; a create sends
//! `If-None-Match: *`; an update sends `If-Match: <etag>`. 404 means absent, 412 a conflict, 409
//! BlobAlreadyExists an existing document; anything else says whether retrying may help.
//!
//! The container is created the first time a write finds it missing (an existing one is fine), so a
//! steady tick costs exactly the requests of the design's blob budget.

use std::num::NonZero;
use std::sync::Arc;

use async_trait::async_trait;
use azure_core::error::ErrorKind;
use azure_core::http::{Etag, RequestContent};
use azure_storage_blob::models::{BlobClientDownloadOptions, BlobClientUploadOptions};
use azure_storage_blob::{BlobContainerClient, BlobContainerClientOptions};

use super::{ETag, StateKey, StateStore, StoreError, Versioned, WriteCondition};
use crate::azure::{RequestCounter, StorageConnection, client_options, token_credential};
use crate::domain::StateDocument;

pub struct AzureBlobStore {
    container: BlobContainerClient,
    /// `account/container`, for messages (no secret).
    location: String,
    counter: Arc<RequestCounter>,
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

fn classify(error: azure_core::Error) -> Failure {
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
        })
    }

    /// Writes bytes unconditionally, creating the container if needed. For tests and operator
    /// tools that plant or restore a document: the poller itself never writes without a condition.
    pub async fn write_raw(&self, key: &StateKey, bytes: &[u8]) -> Result<(), StoreError> {
        let blob = self.container.blob_client(&key.blob_path());
        let upload = || async {
            let content: RequestContent<azure_core::Bytes, azure_core::http::NoFormat> =
                azure_core::Bytes::from(bytes.to_vec()).into();
            blob.upload(content, None).await.map_err(classify)
        };
        let mut result = upload().await;
        if matches!(result, Err(Failure::NotFound { container_missing: true })) {
            self.create_container(key).await?;
            result = upload().await;
        }
        result.map(|_| ()).map_err(|failure| self.unavailable(key, format!("{failure:?}"), false))
    }

    /// The stored bytes, unparsed (`None` when absent).
    pub async fn read_raw(&self, key: &StateKey) -> Result<Option<Vec<u8>>, StoreError> {
        let blob = self.container.blob_client(&key.blob_path());
        let options = BlobClientDownloadOptions { parallel: NonZero::new(1), ..Default::default() };
        match blob.download(Some(options)).await.map_err(classify) {
            Ok(result) => {
                let bytes = result
                    .body
                    .collect()
                    .await
                    .map_err(|error| self.unavailable(key, format!("reading failed: {error}"), true))?;
                Ok(Some(bytes.to_vec()))
            }
            Err(Failure::NotFound { .. }) => Ok(None),
            Err(failure) => Err(self.unavailable(key, format!("{failure:?}"), true)),
        }
    }

    /// Requests sent so far: (GET/HEAD, PUT).
    pub fn request_counts(&self) -> (u64, u64) {
        self.counter.snapshot()
    }

    fn location_of(&self, key: &StateKey) -> String {
        format!("{}/{}", self.location, key.blob_path())
    }

    fn unavailable(&self, key: &StateKey, reason: String, retryable: bool) -> StoreError {
        StoreError::Unavailable { location: self.location_of(key), reason, retryable }
    }

    async fn create_container(&self, key: &StateKey) -> Result<(), StoreError> {
        match self.container.create(None).await {
            Ok(_) => Ok(()),
            Err(error) => match error.kind() {
                ErrorKind::HttpResponse { status, .. } if u16::from(*status) == 409 => Ok(()),
                _ => match classify(error) {
                    Failure::Other { reason, retryable } => {
                        Err(self.unavailable(key, format!("cannot create the container: {reason}"), retryable))
                    }
                    other => Err(self.unavailable(key, format!("cannot create the container: {other:?}"), false)),
                },
            },
        }
    }

    async fn upload(&self, key: &StateKey, bytes: Vec<u8>, condition: &WriteCondition) -> Result<ETag, Failure> {
        let mut options =
            BlobClientUploadOptions { blob_content_type: Some("application/json".to_string()), ..Default::default() };
        match condition {
            WriteCondition::Absent => options.if_none_match = Some(Etag::from("*")),
            WriteCondition::Matches(etag) => options.if_match = Some(Etag::from(etag.0.as_str())),
        }
        let blob = self.container.blob_client(&key.blob_path());
        let content: RequestContent<azure_core::Bytes, azure_core::http::NoFormat> =
            azure_core::Bytes::from(bytes).into();
        let result = blob.upload(content, Some(options)).await.map_err(classify)?;
        let etag = result
            .etag
            .ok_or_else(|| Failure::Other { reason: "the upload answered no ETag".into(), retryable: true })?;
        Ok(ETag(etag.to_string()))
    }
}

#[async_trait]
impl StateStore for AzureBlobStore {
    async fn read(&self, key: &StateKey) -> Result<Option<Versioned>, StoreError> {
        let blob = self.container.blob_client(&key.blob_path());
        let options = BlobClientDownloadOptions { parallel: NonZero::new(1), ..Default::default() };
        let result = match blob.download(Some(options)).await {
            Ok(result) => result,
            Err(error) => {
                return match classify(error) {
                    Failure::NotFound { .. } => Ok(None),
                    Failure::Other { reason, retryable } => Err(self.unavailable(key, reason, retryable)),
                    other => Err(self.unavailable(key, format!("unexpected answer to a read: {other:?}"), true)),
                };
            }
        };
        let etag = result
            .properties
            .etag
            .clone()
            .ok_or_else(|| self.unavailable(key, "the read answered no ETag".into(), true))?;
        let bytes = result
            .body
            .collect()
            .await
            .map_err(|error| self.unavailable(key, format!("reading the document failed: {error}"), true))?;
        let document = StateDocument::parse(&bytes)
            .map_err(|error| StoreError::Corrupt { location: self.location_of(key), reason: error.to_string() })?;
        Ok(Some(Versioned { document, etag: ETag(etag.to_string()) }))
    }

    async fn write(
        &self,
        key: &StateKey,
        document: &StateDocument,
        condition: WriteCondition,
    ) -> Result<ETag, StoreError> {
        let bytes = document.to_bytes();
        let mut result = self.upload(key, bytes.clone(), &condition).await;
        if matches!(result, Err(Failure::NotFound { container_missing: true })) {
            self.create_container(key).await?;
            result = self.upload(key, bytes, &condition).await;
        }
        match (result, &condition) {
            (Ok(etag), _) => Ok(etag),
            (Err(Failure::AlreadyExists | Failure::PreconditionFailed), WriteCondition::Absent) => {
                Err(StoreError::AlreadyExists { location: self.location_of(key) })
            }
            (Err(Failure::PreconditionFailed | Failure::NotFound { .. }), WriteCondition::Matches(_)) => {
                Err(StoreError::Conflict { location: self.location_of(key) })
            }
            (Err(Failure::Other { reason, retryable }), _) => Err(self.unavailable(key, reason, retryable)),
            (Err(other), _) => Err(self.unavailable(key, format!("unexpected answer to a write: {other:?}"), false)),
        }
    }

    fn describe(&self) -> String {
        self.location.clone()
    }
}
