//! `poller.sink`: a webhook or an Azure Storage queue.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use super::connection::StorageConnection;
use super::function_json::RawSink;
use super::redact::shown_endpoint;
use super::state::is_valid_container_name;
use super::{ConfigError, Located, defaults, in_range, ranges};
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
    pub url: OutboundUrl,
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
        ("allowLinkLocal", raw.allow_link_local.is_some()),
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
            let encoding = match raw.message_encoding.as_deref().unwrap_or(defaults::MESSAGE_ENCODING) {
                "base64" => MessageEncoding::Base64,
                "none" => MessageEncoding::None,
                other => {
                    return Err(at.error(
                        "poller.sink.messageEncoding",
                        format!("{other:?}: expected \"base64\" (what a queue trigger expects) or \"none\""),
                    ));
                }
            };
            let per = match raw.message_per.as_deref().unwrap_or(defaults::MESSAGE_PER) {
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
            let url = outbound_url(at, "poller.sink.url", &url_text, raw.allow_link_local.unwrap_or(false), settings)?;
            let secret = match raw.secret {
                None => None,
                Some(name) => Some(signing_key(at, "poller.sink.secret", &name, settings)?),
            };
            let timeout = Duration::from_secs(in_range(
                at,
                "poller.sink.timeoutSeconds",
                raw.timeout_seconds,
                defaults::WEBHOOK_TIMEOUT_SECONDS,
                ranges::WEBHOOK_TIMEOUT_SECONDS,
            )?);
            let max_retries = in_range(
                at,
                "poller.sink.maxRetries",
                raw.max_retries,
                defaults::WEBHOOK_MAX_RETRIES,
                ranges::WEBHOOK_MAX_RETRIES,
            )?;
            let max_body_bytes = in_range(
                at,
                "poller.sink.maxBodyBytes",
                raw.max_body_bytes,
                defaults::WEBHOOK_MAX_BODY_BYTES,
                ranges::WEBHOOK_MAX_BODY_BYTES,
            )?;
            Ok(SinkConfig::Webhook(WebhookConfig { url, signing_key: secret, timeout, max_retries, max_body_bytes }))
        }
        other => {
            Err(at.error("poller.sink.type", format!("unknown sink type {other:?}: expected \"webhook\" or \"queue\"")))
        }
    }
}

/// `source.maxRowBytes` when left out: the largest row the sink can carry. A webhook sends a
/// row in a body of at most `sink.maxBodyBytes`; a queue message holds 64 KiB as the service
/// counts it, three quarters of that once base64-encoded.
pub(super) fn default_max_row_bytes(sink: &SinkConfig) -> usize {
    match sink {
        SinkConfig::Webhook(webhook) => webhook.max_body_bytes,
        SinkConfig::Queue(queue) => match queue.encoding {
            MessageEncoding::Base64 => defaults::QUEUE_MESSAGE_BYTES / 4 * 3,
            MessageEncoding::None => defaults::QUEUE_MESSAGE_BYTES,
        },
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

/// An outbound URL (a webhook's, an alert's) as [`http_url`] reads it, refused when it points
/// where the handler must not post unless told so (`allow_link_local`): a link-local or cloud
/// metadata address, or the handler's own port ([`outbound_refusal`]).
pub(super) fn outbound_url(
    at: &Located<'_>,
    field: &str,
    text: &str,
    allow_link_local: bool,
    settings: &Settings,
) -> Result<OutboundUrl, ConfigError> {
    let url = http_url(at, field, text)?;
    let handler_port = settings.get(HANDLER_PORT_SETTING).and_then(|port| port.trim().parse::<u16>().ok());
    if !allow_link_local && let Some(reason) = outbound_refusal(&url, handler_port) {
        let allow = field.rsplit_once('.').map(|(section, _)| format!("{section}.allowLinkLocal")).unwrap_or_default();
        return Err(at.error(field, format!("{reason}; set `{allow}: true` if this is meant (docs/security.md)")));
    }
    Ok(OutboundUrl(url))
}

/// The app setting the Functions host puts the handler's port in.
const HANDLER_PORT_SETTING: &str = "FUNCTIONS_CUSTOMHANDLER_PORT";

/// Why the handler must not post to `url` on its own, if it must not: an IPv4 link-local address
/// (169.254.0.0/16, where clouds answer metadata and identity requests: 169.254.169.254), AWS's
/// IPv6 metadata address (fd00:ec2::254), an IPv6 link-local address (fe80::/10), or the loopback
/// at the handler's own port (`handler_port`: the host's invocation endpoint, posting to itself).
/// Only addresses written in the URL are judged: a name is not resolved here.
pub fn outbound_refusal(url: &url::Url, handler_port: Option<u16>) -> Option<String> {
    use std::net::{Ipv4Addr, Ipv6Addr};
    let host = url.host()?;
    let port = url.port_or_known_default();
    let (loopback, why) = match host {
        url::Host::Ipv4(address) => {
            let v4: Ipv4Addr = address;
            (
                v4.is_loopback(),
                v4.is_link_local().then(|| {
                    format!("{v4} is a link-local address (169.254.0.0/16: cloud metadata and identity endpoints)")
                }),
            )
        }
        url::Host::Ipv6(address) => {
            let v6: Ipv6Addr = address;
            let metadata: Ipv6Addr = "fd00:ec2::254".parse().expect("an IPv6 address");
            let why = if v6 == metadata {
                Some(format!("{v6} is a cloud metadata address"))
            } else if (v6.segments()[0] & 0xffc0) == 0xfe80 {
                Some(format!("{v6} is a link-local address (fe80::/10)"))
            } else {
                v6.to_ipv4_mapped()
                    .filter(Ipv4Addr::is_link_local)
                    .map(|v4| format!("{v6} maps the link-local address {v4} (169.254.0.0/16: cloud metadata)"))
            };
            let loopback = v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback());
            (loopback, why)
        }
        url::Host::Domain(name) => {
            (name.eq_ignore_ascii_case("localhost") || name.to_ascii_lowercase().ends_with(".localhost"), None)
        }
    };
    if why.is_some() {
        return why;
    }
    match (loopback, handler_port, port) {
        (true, Some(handler), Some(port)) if handler == port => Some(format!(
            "it is the handler's own port ({HANDLER_PORT_SETTING}={handler}, on the loopback): the handler would post to itself"
        )),
        _ => None,
    }
}

/// A URL the handler posts to (a webhook, an alert). It may hold a token in its path (chat hooks),
/// user info or query (`?code=`), so its `Debug` and `Display` are the redacted form: scheme, host
/// and port ([`shown_endpoint`]); [`OutboundUrl::expose`] gives the whole URL, for the request only.
#[derive(Clone, PartialEq, Eq)]
pub struct OutboundUrl(url::Url);

impl OutboundUrl {
    /// A URL taken as it is (tests and tools; the loader checks it with [`outbound_url`]).
    pub fn new(url: url::Url) -> OutboundUrl {
        OutboundUrl(url)
    }

    /// The whole URL, secrets included: to send a request to, never to print.
    pub fn expose(&self) -> &url::Url {
        &self.0
    }

    /// The redacted form: scheme, host and port.
    pub fn shown(&self) -> String {
        shown_endpoint(&self.0)
    }
}

impl std::fmt::Debug for OutboundUrl {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "OutboundUrl({})", self.shown())
    }
}

impl std::fmt::Display for OutboundUrl {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.shown())
    }
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

#[cfg(test)]
mod tests {
    use super::{OutboundUrl, outbound_refusal};

    /// Regression (issue 36, section 3): an outbound URL's `Debug` and `Display` are the redacted
    /// form; a path token, user info and `?code=` never show.
    #[test]
    fn an_outbound_url_prints_redacted() {
        let url = OutboundUrl::new(url::Url::parse("https://u:pw@hooks.example:8443/services/T0KEN?code=K3y").unwrap());
        for shown in [format!("{url}"), format!("{url:?}"), format!("{:?}", Some(url.clone())), format!("{url:#?}")] {
            assert!(!shown.contains("T0KEN") && !shown.contains("K3y") && !shown.contains("pw"), "{shown}");
            assert!(shown.contains("https://hooks.example:8443"), "{shown}");
        }
        assert!(url.expose().as_str().contains("T0KEN"));
    }

    /// Regression (issue 36, section 3): link-local and metadata addresses, and the handler's own
    /// port on the loopback, are refused; other loopback ports and public hosts are not.
    #[test]
    fn link_local_metadata_and_the_handlers_port_are_refused() {
        let refusal = |text: &str, port: Option<u16>| outbound_refusal(&url::Url::parse(text).unwrap(), port);
        for refused in [
            "http://169.254.169.254/metadata/identity/oauth2/token",
            "http://169.254.0.1:8080/",
            "http://[fd00:ec2::254]/latest/meta-data",
            "http://[fe80::1]/",
            "http://[febf::1]/",
            "http://[::ffff:169.254.169.254]/",
        ] {
            assert!(refusal(refused, None).is_some(), "{refused}");
        }
        assert!(refusal("http://127.0.0.1:7071/api/status", Some(7071)).is_some());
        assert!(refusal("http://localhost:7071/", Some(7071)).is_some());
        assert!(refusal("http://[::1]:7071/", Some(7071)).is_some());
        for allowed in
            ["http://127.0.0.1:7072/hook", "https://hooks.example/x", "http://10.0.0.4/", "http://[fec0::1]/"]
        {
            assert_eq!(refusal(allowed, Some(7071)), None, "{allowed}");
        }
    }
}
