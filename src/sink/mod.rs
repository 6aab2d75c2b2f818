//! Where batches go: a trait with one verb, and its implementations ([`webhook`],
//! [`storage_queue`], and `recording` for tests, compiled only with the `testing` feature). A sink either acknowledges a whole batch or says why not, and whether
//! trying again may help.

#[cfg(any(test, feature = "testing"))]
pub mod recording;
pub mod retry;
pub mod signing;
pub mod storage_queue;
pub mod webhook;

use std::sync::Arc;

use crate::config::SinkConfig;
pub use crate::domain::event::{Batch, Event};
use async_trait::async_trait;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// The receiver refused the batch for good (a 4xx other than 408/429, a redirect): retrying the
    /// same batch will not help. Whether the refusal is about the endpoint (hold) or the rows
    /// (isolate) is `domain::endpoint`'s table, from `status`.
    #[error("the receiver rejected batch {batch_id}: HTTP {status}: {body}")]
    Rejected { batch_id: String, status: u16, body: String },
    /// A failure that may pass: a timeout, a refused connection, 408, 429, 5xx.
    #[error("delivery of batch {batch_id} failed: {reason}")]
    Transient { batch_id: String, reason: String },
}

#[async_trait]
pub trait Sink: Send + Sync {
    /// Delivers the whole batch; `Ok` only once the receiver acknowledged it. Retries of transient
    /// failures never wait past `deadline` (the tick's budget).
    async fn deliver(&self, batch: &Batch, deadline: tokio::time::Instant) -> Result<(), SinkError>;

    /// Where batches go, for messages; never includes a secret.
    fn describe(&self) -> String;
}

/// Opens the sink a poller's `sink` section names. Its HTTP client lives as long as the poller.
pub fn open(config: &SinkConfig) -> Result<Arc<dyn Sink>, SinkError> {
    let sink: Arc<dyn Sink> = match config {
        SinkConfig::Webhook(webhook) => Arc::new(webhook::WebhookSink::new(webhook.clone())?),
        SinkConfig::Queue(queue) => {
            let sink = storage_queue::QueueSink::new(queue.clone())
                .map_err(|reason| SinkError::Transient { batch_id: String::new(), reason })?;
            Arc::new(sink)
        }
    };
    Ok(Arc::new(RefusesReferences { inner: sink }))
}

/// A sink that refuses, as too large (413), every batch holding a row kept only as a reference
/// (over `source.maxRowBytes`, [`crate::domain::event::OVERSIZED_ROW_KEY`]): the receiver never
/// gets a stand-in for a row, and the poller's isolation quarantines the reference as it is, with
/// its key and size, while the rows around it are delivered.
struct RefusesReferences {
    inner: Arc<dyn Sink>,
}

#[async_trait]
impl Sink for RefusesReferences {
    async fn deliver(&self, batch: &Batch, deadline: tokio::time::Instant) -> Result<(), SinkError> {
        if let Some(event) = batch.events.iter().find(|event| event.is_oversized_reference()) {
            let row = event.row();
            let size = &row[crate::domain::event::OVERSIZED_ROW_KEY];
            return Err(SinkError::Rejected {
                batch_id: batch.batch_id.clone(),
                status: 413,
                body: format!(
                    "the row with primary key {} is {} bytes as an event, over the {} bytes source.maxRowBytes allows: \
                     kept as a reference (its key and size), not delivered; fix the row (the next change to it is \
                     delivered as usual), then purge this entry",
                    serde_json::Value::Object(event.pk()),
                    size["bytes"],
                    size["limit"]
                ),
            });
        }
        self.inner.deliver(batch, deadline).await
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}
