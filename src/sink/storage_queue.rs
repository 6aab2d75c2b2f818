//! The Azure Storage queue sink: a queue-triggered function, in any language, becomes the handler.
//!
//! Messages are written directly, before the checkpoint commit. (A Functions output binding is
//! written by the host only after the invocation answers, which is after the commit: too late for
//! at least once.) `messagePer: row` sends one message per event (the envelope's fields around one
//! event); `batch` sends the envelope, split into several messages when it would exceed the 64 KiB
//! queue limit. `messageEncoding: base64` (what a Functions queue trigger expects) or `none`.

use std::sync::Arc;

use async_trait::async_trait;
use azure_core::error::ErrorKind;
use azure_core::http::RequestContent;
use azure_storage_queue::models::QueueMessage;
use azure_storage_queue::{QueueClient, QueueClientOptions};
use base64::Engine as _;
use chrono::{SecondsFormat, Utc};
use futures::StreamExt;
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::{Batch, Event, Sink, SinkError};
use crate::azure::{RequestCounter, client_options, token_credential};
use crate::config::{MessageEncoding, MessagePer, QueueConfig};

/// The service's limit on one message, as sent (after encoding).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;
/// Messages in flight at once for one batch.
const CONCURRENCY: usize = 16;

pub struct QueueSink {
    client: QueueClient,
    config: QueueConfig,
    location: String,
}

enum Failure {
    QueueMissing,
    Other { status: Option<u16>, reason: String, retryable: bool },
}

/// The service's answer, in the words dbtrigger keeps (its error code and message are text from a
/// peer: escaped here, where they enter, before any log line or stored error holds them).
fn classify(error: azure_core::Error) -> Failure {
    match classify_unescaped(error) {
        Failure::Other { reason, retryable, status } => {
            Failure::Other { reason: crate::config::redact::escape_peer_text(&reason), retryable, status }
        }
        other => other,
    }
}

fn classify_unescaped(error: azure_core::Error) -> Failure {
    match error.kind() {
        ErrorKind::HttpResponse { status, error_code, .. } => {
            let code = u16::from(*status);
            let error_code = error_code.clone().unwrap_or_default();
            if code == 404 && error_code == "QueueNotFound" {
                return Failure::QueueMissing;
            }
            let retryable = matches!(code, 408 | 429 | 500..=599);
            let reason = if code == 403 {
                format!("HTTP 403 {error_code}: the storage account refused the credentials")
            } else {
                format!("HTTP {code} {error_code}")
            };
            Failure::Other { status: Some(code), reason, retryable }
        }
        _ => Failure::Other { status: None, reason: format!("cannot reach the queue: {error}"), retryable: true },
    }
}

fn key_text(pk: &Map<String, Value>) -> String {
    pk.iter().map(|(name, value)| format!("{name}={value}")).collect::<Vec<_>>().join(", ")
}

impl QueueSink {
    pub fn new(config: QueueConfig) -> Result<Self, String> {
        let mut url = config.connection.queue_endpoint.clone();
        url.path_segments_mut()
            .map_err(|_| "the queue endpoint cannot hold a path".to_string())?
            .pop_if_empty()
            .push(&config.queue_name);
        let options = QueueClientOptions {
            client_options: client_options(&config.connection, Arc::new(RequestCounter::default())),
            ..Default::default()
        };
        let credential = token_credential(&config.connection)?;
        let client = QueueClient::new(url, credential, Some(options))
            .map_err(|error| format!("cannot create the queue client: {error}"))?;
        let location = format!("azure-queue:{}/{}", config.connection.account, config.queue_name);
        Ok(QueueSink { client, config, location })
    }

    fn encode(&self, json: &[u8]) -> String {
        match self.config.encoding {
            MessageEncoding::Base64 => base64::engine::general_purpose::STANDARD.encode(json),
            MessageEncoding::None => String::from_utf8_lossy(json).into_owned(),
        }
    }

    /// The size the service counts: the text as it travels in the request's XML.
    fn sent_size(&self, text: &str) -> usize {
        text.len()
            + text
                .chars()
                .map(|character| match character {
                    '&' => 4,
                    '<' | '>' => 3,
                    '"' | '\'' => 5,
                    _ => 0,
                })
                .sum::<usize>()
    }

    /// Every message of a batch, or the permanent rejection of a row that cannot fit.
    fn messages(&self, batch: &Batch) -> Result<Vec<String>, SinkError> {
        let sent_at = Utc::now().to_rfc3339_opts(SecondsFormat::Millis, true);
        match self.config.per {
            MessagePer::Row => {
                let mut messages = Vec::with_capacity(batch.events.len());
                for event in &batch.events {
                    let text = self.encode(&batch.row_message(&sent_at, event));
                    let size = self.sent_size(&text);
                    if size > MAX_MESSAGE_BYTES {
                        return Err(oversize(batch, event, size));
                    }
                    messages.push(text);
                }
                Ok(messages)
            }
            MessagePer::Batch => {
                let render = |batch_id: String, events: &[Event]| -> String {
                    self.encode(&batch.envelope(&batch_id, &sent_at, events))
                };
                // Halve until every part fits; the probe id is as long as any real part id.
                let mut pending = vec![&batch.events[..]];
                let mut slices: Vec<&[Event]> = Vec::new();
                while let Some(events) = pending.pop() {
                    let size = self.sent_size(&render(format!("{}-9999of9999", batch.batch_id), events));
                    if size <= MAX_MESSAGE_BYTES {
                        slices.push(events);
                    } else if events.len() == 1 {
                        return Err(oversize(batch, &events[0], size));
                    } else {
                        let (left, right) = events.split_at(events.len() / 2);
                        pending.push(right);
                        pending.push(left);
                    }
                }
                let count = slices.len();
                Ok(slices
                    .iter()
                    .enumerate()
                    .map(|(index, events)| {
                        let id = if count == 1 {
                            batch.batch_id.clone()
                        } else {
                            format!("{}-{}of{count}", batch.batch_id, index + 1)
                        };
                        render(id, events)
                    })
                    .collect())
            }
        }
    }

    async fn send(&self, text: String) -> Result<(), Failure> {
        let content: RequestContent<QueueMessage, _> =
            QueueMessage { message_text: Some(text) }.try_into().map_err(|error: azure_core::Error| {
                Failure::Other { status: None, reason: format!("cannot encode the message: {error}"), retryable: false }
            })?;
        self.client.send_message(content, None).await.map(|_| ()).map_err(classify)
    }

    async fn send_creating_queue(&self, text: String) -> Result<(), Failure> {
        match self.send(text.clone()).await {
            Err(Failure::QueueMissing) => {
                if let Err(error) = self.client.create(None).await {
                    let already_there =
                        matches!(error.kind(), ErrorKind::HttpResponse { status, .. } if u16::from(*status) == 409);
                    if !already_there {
                        return Err(classify(error));
                    }
                }
                self.send(text).await
            }
            other => other,
        }
    }
}

fn oversize(batch: &Batch, event: &Event, size: usize) -> SinkError {
    SinkError::Rejected {
        batch_id: batch.batch_id.clone(),
        status: 413,
        body: format!(
            "the row with primary key {} is {size} bytes as a queue message, over the {MAX_MESSAGE_BYTES}-byte limit: \
             deliver fewer columns (source.columns) or use a webhook sink",
            key_text(&event.pk())
        ),
    }
}

#[async_trait]
impl Sink for QueueSink {
    /// Sends every message of the batch; none outlasts `deadline` (the tick's budget): what has not
    /// been acknowledged by then fails the batch as a transient error, retried next tick.
    async fn deliver(&self, batch: &Batch, deadline: Instant) -> Result<(), SinkError> {
        let messages = self.messages(batch)?;
        let mut sends = futures::stream::iter(messages.into_iter().map(|text| async move {
            match tokio::time::timeout_at(deadline, self.send_creating_queue(text)).await {
                Ok(result) => result,
                Err(_) => Err(Failure::Other {
                    status: None,
                    reason: "the tick budget was used up before the queue answered".to_string(),
                    retryable: true,
                }),
            }
        }))
        .buffer_unordered(CONCURRENCY);
        while let Some(result) = sends.next().await {
            match result {
                Ok(()) => {}
                Err(Failure::Other { status, reason, retryable }) => {
                    let reason = format!("{}: {reason}", self.location);
                    return Err(match (retryable, status) {
                        (false, Some(status)) => {
                            SinkError::Rejected { batch_id: batch.batch_id.clone(), status, body: reason }
                        }
                        _ => SinkError::Transient { batch_id: batch.batch_id.clone(), reason },
                    });
                }
                Err(Failure::QueueMissing) => {
                    return Err(SinkError::Transient {
                        batch_id: batch.batch_id.clone(),
                        reason: format!("{}: the queue does not exist and could not be created", self.location),
                    });
                }
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        self.location.clone()
    }
}
