//! `poller.sink`: a webhook or an Azure Storage queue.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use super::connection::StorageConnection;
use super::function_json::RawSink;
use super::state::is_valid_container_name;
use super::{ConfigError, Located, defaults, in_range, limits};
use crate::settings::Settings;

#[derive(Debug, Clone)]
pub enum SinkConfig {
    Webhook(WebhookConfig),
    Queue(QueueConfig),
}

/// An Azure Storage queue sink.
#[derive(Debug, Clone)]
pub struct QueueConfig {
    pub connection: Box<StorageConnection>,
    pub queue_name: String,
    pub encoding: MessageEncoding,
    pub per: MessagePer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageEncoding {
    /// What a Functions queue trigger expects.
    Base64,
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessagePer {
    Row,
    Batch,
}

#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub url: url::Url,
    /// The signing key, when `secret` names a setting (Standard Webhooks signatures).
    pub signing_key: Option<SigningKey>,
    pub timeout: Duration,
    pub max_retries: u32,
    /// A batch whose JSON body would exceed this is split into several requests.
    pub max_body_bytes: usize,
}

pub(super) fn build_sink(raw: RawSink, settings: &Settings, at: &Located<'_>) -> Result<SinkConfig, ConfigError> {
    let queue_fields = [
        ("connection", raw.connection.is_some()),
        ("queueName", raw.queue_name.is_some()),
        ("messageEncoding", raw.message_encoding.is_some()),
        ("messagePer", raw.message_per.is_some()),
    ];
    let webhook_fields = [
        ("url", raw.url.is_some()),
        ("secret", raw.secret.is_some()),
        ("timeoutSeconds", raw.timeout_seconds.is_some()),
        ("maxRetries", raw.max_retries.is_some()),
        ("maxBodyBytes", raw.max_body_bytes.is_some()),
    ];
    let foreign = match raw.kind.as_str() {
        "webhook" => queue_fields.iter().find(|(_, present)| *present),
        "queue" => webhook_fields.iter().find(|(_, present)| *present),
        _ => None,
    };
    if let Some((field, _)) = foreign {
        return Err(at.error(&format!("poller.sink.{field}"), format!("does not apply to a {} sink", raw.kind)));
    }
    match raw.kind.as_str() {
        "queue" => {
            let connection_name = raw.connection.unwrap_or_else(|| defaults::STATE_CONNECTION.to_string());
            let connection = StorageConnection::from_settings(&connection_name, settings)
                .map_err(|reason| at.error("poller.sink.connection", reason))?;
            let queue_name = raw
                .queue_name
                .ok_or_else(|| at.error("poller.sink.queueName", "missing: a queue sink needs a queueName"))?;
            if !is_valid_container_name(&queue_name) {
                return Err(at.error(
                    "poller.sink.queueName",
                    format!("{queue_name:?} is not a valid queue name: 3-63 lowercase letters, digits and single '-'"),
                ));
            }
            let encoding = match raw.message_encoding.as_deref().unwrap_or("base64") {
                "base64" => MessageEncoding::Base64,
                "none" => MessageEncoding::None,
                other => {
                    return Err(at.error(
                        "poller.sink.messageEncoding",
                        format!("{other:?}: expected \"base64\" (what a queue trigger expects) or \"none\""),
                    ));
                }
            };
            let per = match raw.message_per.as_deref().unwrap_or("row") {
                "row" => MessagePer::Row,
                "batch" => MessagePer::Batch,
                other => {
                    return Err(at.error("poller.sink.messagePer", format!("{other:?}: expected \"row\" or \"batch\"")));
                }
            };
            Ok(SinkConfig::Queue(QueueConfig { connection: Box::new(connection), queue_name, encoding, per }))
        }
        "webhook" => {
            let url_text = raw.url.ok_or_else(|| at.error("poller.sink.url", "missing: a webhook sink needs a url"))?;
            let url = http_url(at, "poller.sink.url", &url_text)?;
            let secret = match raw.secret {
                None => None,
                Some(name) => Some(signing_key(at, "poller.sink.secret", &name, settings)?),
            };
            let timeout = Duration::from_secs(in_range(
                at,
                "poller.sink.timeoutSeconds",
                raw.timeout_seconds,
                defaults::WEBHOOK_TIMEOUT_SECONDS,
                1..=limits::SECONDS,
            )?);
            let max_retries =
                in_range(at, "poller.sink.maxRetries", raw.max_retries, defaults::WEBHOOK_MAX_RETRIES, 0..=20)?;
            let max_body_bytes = in_range(
                at,
                "poller.sink.maxBodyBytes",
                raw.max_body_bytes,
                defaults::WEBHOOK_MAX_BODY_BYTES,
                1024..=limits::WEBHOOK_MAX_BODY_BYTES,
            )?;
            Ok(SinkConfig::Webhook(WebhookConfig { url, signing_key: secret, timeout, max_retries, max_body_bytes }))
        }
        other => {
            Err(at.error("poller.sink.type", format!("unknown sink type {other:?}: expected \"webhook\" or \"queue\"")))
        }
    }
}

/// An `http` or `https` URL (a webhook, an alert), or the error of `field`.
pub(super) fn http_url(at: &Located<'_>, field: &str, text: &str) -> Result<url::Url, ConfigError> {
    let url = url::Url::parse(text).map_err(|error| at.error(field, format!("not a valid URL: {error}")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(at.error(field, format!("scheme {:?} is not http or https", url.scheme())));
    }
    Ok(url)
}

/// The signing key held by app setting `name` (named in `field`), decoded.
pub(super) fn signing_key(
    at: &Located<'_>,
    field: &str,
    name: &str,
    settings: &Settings,
) -> Result<SigningKey, ConfigError> {
    let value = settings
        .get(name)
        .ok_or_else(|| at.error(field, format!("app setting {name} is not set (it must hold the signing secret)")))?;
    if value.is_empty() {
        return Err(at.error(field, format!("app setting {name} is empty")));
    }
    SigningKey::from_secret(value).map_err(|reason| at.error(field, format!("app setting {name}: {reason}")))
}

/// A webhook signing key, decoded once from its app setting: a secret written `whsec_<base64>` is
/// the base64 of the key, any other secret is the key's bytes. Never printed.
#[derive(Clone)]
pub struct SigningKey(Vec<u8>);

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("SigningKey(<redacted>)")
    }
}

/// The shortest signing key accepted, in bytes (the Standard Webhooks guidance: 24 to 64 random
/// bytes). An empty or short key makes every signature forgeable by whoever guesses it.
pub const MIN_SIGNING_KEY_BYTES: usize = 24;

impl SigningKey {
    /// The key a secret holds. Errors say what is wrong with it, never what it is.
    pub fn from_secret(secret: &str) -> Result<SigningKey, String> {
        let key = match secret.strip_prefix("whsec_") {
            Some(encoded) => STANDARD
                .decode(encoded)
                .map_err(|_| "a secret starting with `whsec_` must continue with base64".to_string())?,
            None => secret.as_bytes().to_vec(),
        };
        if key.len() < MIN_SIGNING_KEY_BYTES {
            return Err(format!(
                "the signing key is {} bytes: at least {MIN_SIGNING_KEY_BYTES} are needed (24 to 64 random bytes, \
                 written `whsec_<base64>`, e.g. `whsec_$(openssl rand -base64 32)`)",
                key.len()
            ));
        }
        Ok(SigningKey(key))
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}
