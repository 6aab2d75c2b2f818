//! The HTTP webhook sink: one POST of the JSON envelope per batch. 2xx means delivered.

use async_trait::async_trait;

use super::{Batch, Sink, SinkError};
use crate::config::WebhookConfig;

/// How much of a refusing receiver's body goes into the error.
const ERROR_BODY_LIMIT: usize = 1024;

pub struct WebhookSink {
    client: reqwest::Client,
    config: WebhookConfig,
}

impl WebhookSink {
    pub fn new(config: WebhookConfig) -> Result<Self, SinkError> {
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            // A redirect is the receiver's misconfiguration, not a place to resend a batch to.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("dbtrigger/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|error| SinkError::Transient {
                batch_id: String::new(),
                reason: format!("cannot build the HTTP client: {error}"),
            })?;
        Ok(WebhookSink { client, config })
    }
}

/// The part of a URL safe to print: no user info, no query (either may hold a key).
pub fn redacted_url(url: &url::Url) -> String {
    format!(
        "{}://{}{}",
        url.scheme(),
        url.host_str().unwrap_or_default(),
        match url.port() {
            Some(port) => format!(":{port}{}", url.path()),
            None => url.path().to_string(),
        }
    )
}

#[async_trait]
impl Sink for WebhookSink {
    async fn deliver(&self, batch: &Batch) -> Result<(), SinkError> {
        let body = serde_json::to_vec(batch).expect("a batch serializes");
        let response = self
            .client
            .post(self.config.url.clone())
            .header("content-type", "application/json")
            .header("idempotency-key", &batch.batch_id)
            .header("x-dbtrigger-poller", &batch.poller)
            .header("x-dbtrigger-fencing-token", batch.fencing_token.to_string())
            .body(body)
            .send()
            .await
            .map_err(|error| SinkError::Transient {
                batch_id: batch.batch_id.clone(),
                reason: format!(
                    "POST {}: {}",
                    redacted_url(&self.config.url),
                    error.without_url()
                ),
            })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let mut text = response.text().await.unwrap_or_default();
        if text.len() > ERROR_BODY_LIMIT {
            let mut cut = ERROR_BODY_LIMIT;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        let code = status.as_u16();
        if code == 408 || code == 429 || status.is_server_error() {
            Err(SinkError::Transient {
                batch_id: batch.batch_id.clone(),
                reason: format!("HTTP {code}: {text}"),
            })
        } else {
            Err(SinkError::Rejected {
                batch_id: batch.batch_id.clone(),
                status: code,
                body: text,
            })
        }
    }

    fn describe(&self) -> String {
        redacted_url(&self.config.url)
    }
}
