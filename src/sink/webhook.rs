//! The HTTP webhook sink: one POST of the JSON envelope per batch (or per part, when the body would
//! exceed `maxBodyBytes`). 2xx means delivered; 408, 429, 5xx, timeouts and connection errors are
//! retried with backoff within the tick; any other status is a permanent rejection (about the
//! endpoint or the rows: `domain::endpoint` says which).

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use chrono::{SecondsFormat, Utc};
use tokio::time::Instant;
use tracing::warn;

use super::retry::{self, RetryDecision};
use super::{Batch, Event, Sink, SinkError};
use crate::config::WebhookConfig;
use crate::config::redact::escape_peer_text;

/// How much of a refusing receiver's body goes into the error, and so the most of any answer's
/// body that is read: the rest is never received, the connection is dropped instead.
const ERROR_BODY_LIMIT: usize = 1024;

pub struct WebhookSink {
    client: reqwest::Client,
    config: WebhookConfig,
}

/// One request's worth of a batch.
struct Part<'a> {
    id: String,
    events: &'a [Event],
}

/// What one attempt came to.
enum Attempt {
    Delivered,
    Transient { reason: String, retry_after: Option<Duration> },
    Rejected { status: u16, body: String },
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

    /// The JSON body of one request: the envelope (`poller`, `batch_id`, `fencing_token`, the
    /// `generation` when one is configured, `sent_at`, `events`).
    fn body(&self, batch: &Batch, part: &Part<'_>) -> Vec<u8> {
        batch.envelope(&part.id, &sent_at(), part.events)
    }

    /// Splits a batch in halves until every part's body fits. Deterministic for the same rows, so a
    /// redelivered batch is split the same way and its parts keep their ids. A single event larger
    /// than the limit is sent alone (the receiver may refuse it with a 413, a permanent rejection).
    fn split<'a>(&self, batch: &'a Batch) -> Vec<Part<'a>> {
        let mut pending = vec![&batch.events[..]];
        let mut parts: Vec<&'a [Event]> = Vec::new();
        // `sent_at` always has the same length: any one measures the body.
        let sent_at = sent_at();
        while let Some(events) = pending.pop() {
            if events.len() <= 1 || batch.envelope_len(&batch.batch_id, &sent_at, events) <= self.config.max_body_bytes
            {
                parts.push(events);
            } else {
                let (left, right) = events.split_at(events.len() / 2);
                // Pushed right first so that the left half is handled first: parts stay in order.
                pending.push(right);
                pending.push(left);
            }
        }
        let count = parts.len();
        parts
            .into_iter()
            .enumerate()
            .map(|(index, events)| Part {
                id: if count == 1 {
                    batch.batch_id.clone()
                } else {
                    format!("{}-{}of{count}", batch.batch_id, index + 1)
                },
                events,
            })
            .collect()
    }

    /// One POST, never outlasting the tick: its timeout is the configured one or the time left
    /// before `deadline`, whichever is shorter, and no attempt starts once the deadline has passed.
    async fn attempt(&self, batch: &Batch, part: &Part<'_>, deadline: Instant) -> Attempt {
        let time_left = deadline.saturating_duration_since(Instant::now());
        if time_left.is_zero() {
            return Attempt::Transient {
                reason: "the tick budget was used up before this attempt".to_string(),
                retry_after: None,
            };
        }
        let body = self.body(batch, part);
        let timestamp = Utc::now().timestamp();
        let mut request = self
            .client
            .post(self.config.url.expose().clone())
            .timeout(self.config.timeout.min(time_left))
            .header("content-type", "application/json")
            .header("idempotency-key", &part.id)
            .header("x-dbtrigger-poller", &batch.poller)
            .header("x-dbtrigger-fencing-token", batch.fencing_token.to_string())
            .header("webhook-id", &part.id)
            .header("webhook-timestamp", timestamp.to_string());
        if let Some(key) = &self.config.signing_key {
            request = request.header("webhook-signature", super::signing::sign(key, &part.id, timestamp, &body));
        }
        let response = match request.body(body).send().await {
            Ok(response) => response,
            Err(error) => {
                let what = if error.is_timeout() { "timed out" } else { "failed" };
                let error_text = escape_peer_text(&error.without_url().to_string());
                return Attempt::Transient {
                    reason: format!("POST {} {what}: {error_text}", self.config.url.shown()),
                    retry_after: None,
                };
            }
        };
        let status = response.status();
        if status.is_success() {
            // Nothing of a success body is kept, so none of it is read: dropping the response
            // drops the connection, however much the receiver meant to send.
            return Attempt::Delivered;
        }
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| retry::parse_retry_after(value, SystemTime::now()));
        let text = escape_peer_text(&body_start(response, ERROR_BODY_LIMIT).await);
        let code = status.as_u16();
        if code == 408 || code == 429 || status.is_server_error() {
            Attempt::Transient { reason: format!("HTTP {code}: {text}"), retry_after }
        } else {
            Attempt::Rejected { status: code, body: text }
        }
    }

    async fn deliver_part(&self, batch: &Batch, part: &Part<'_>, deadline: Instant) -> Result<(), SinkError> {
        let mut attempt_number: u32 = 0;
        loop {
            attempt_number += 1;
            let (reason, retry_after) = match self.attempt(batch, part, deadline).await {
                Attempt::Delivered => return Ok(()),
                Attempt::Rejected { status, body } => {
                    return Err(SinkError::Rejected { batch_id: part.id.clone(), status, body });
                }
                Attempt::Transient { reason, retry_after } => (reason, retry_after),
            };
            let time_left = deadline.saturating_duration_since(Instant::now());
            match retry::decide(attempt_number, self.config.max_retries, retry_after, fastrand::f64(), time_left) {
                RetryDecision::RetryAfter(wait) => {
                    warn!(
                        poller = %batch.poller,
                        batch = %part.id,
                        attempt = attempt_number,
                        wait_ms = wait.as_millis() as u64,
                        "delivery failed, retrying: {reason}"
                    );
                    tokio::time::sleep(wait).await;
                }
                RetryDecision::GiveUp(why) => {
                    return Err(SinkError::Transient {
                        batch_id: part.id.clone(),
                        reason: format!("{reason} (after {attempt_number} attempts; gave up: {why:?})"),
                    });
                }
            }
        }
    }
}

/// When a body is written, as the envelope's `sent_at` says it (always 24 characters).
fn sent_at() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// At most the first `limit` bytes of a response's body, read chunk by chunk (never the whole body
/// first), as text cut at a character boundary; then the response is dropped, and with it the
/// connection and whatever the receiver had yet to send. A body that fails part way gives what
/// came before.
async fn body_start(mut response: reqwest::Response, limit: usize) -> String {
    let mut kept: Vec<u8> = Vec::with_capacity(limit.min(16 * 1024));
    while kept.len() < limit {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = limit - kept.len();
                kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    drop(response);
    let mut text = String::from_utf8_lossy(&kept).into_owned();
    if text.len() > limit {
        // Lossy decoding may have grown the text (a replacement character for a cut sequence).
        let mut cut = limit;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

/// The part of a URL safe to print: scheme, host and port ([`crate::config::shown_endpoint`]).
pub fn redacted_url(url: &url::Url) -> String {
    crate::config::shown_endpoint(url)
}

#[async_trait]
impl Sink for WebhookSink {
    async fn deliver(&self, batch: &Batch, deadline: Instant) -> Result<(), SinkError> {
        for part in self.split(batch) {
            self.deliver_part(batch, &part, deadline).await?;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        self.config.url.shown()
    }
}

#[cfg(test)]
mod tests {
    /// Regression (issue 30, item 4): a webhook URL is shown as scheme, host and port: a chat
    /// hook's token in the path, user info and the query never are.
    #[test]
    fn a_webhook_url_shows_scheme_host_and_port_only() {
        let url = url::Url::parse("https://user:pw@hooks.example.com:8443/services/T0KEN/x?code=K3y").unwrap();
        assert_eq!(super::redacted_url(&url), "https://hooks.example.com:8443");
        let url = url::Url::parse("http://127.0.0.1/hook/secret-path").unwrap();
        assert_eq!(super::redacted_url(&url), "http://127.0.0.1");
    }
}
