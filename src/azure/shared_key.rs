//! The Storage "Shared Key" authorization scheme, as a per-try azure_core pipeline policy: each try
//! gets a fresh `x-ms-date` and a signature over the request exactly as it will be sent.
//!
//! StringToSign (Blob and Queue services, version 2009-09-19 and later):
//! `VERB \n Content-Encoding \n Content-Language \n Content-Length (empty if 0) \n Content-MD5 \n
//! Content-Type \n Date \n If-Modified-Since \n If-Match \n If-None-Match \n If-Unmodified-Since \n
//! Range \n CanonicalizedHeaders CanonicalizedResource`, where the headers are every `x-ms-*` header,
//! lowercased and sorted, `name:value\n`, and the resource is `/{account}{path as sent}` followed by
//! each query parameter, lowercased and sorted, as `\nname:value`.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use azure_core::http::policies::{Policy, PolicyResult};
use azure_core::http::{Context, Request};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

pub struct SharedKeyPolicy {
    account: String,
    key: Vec<u8>,
}

impl fmt::Debug for SharedKeyPolicy {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.debug_struct("SharedKeyPolicy").field("account", &self.account).finish_non_exhaustive()
    }
}

impl SharedKeyPolicy {
    pub fn new(account: String, key: Vec<u8>) -> Self {
        SharedKeyPolicy { account, key }
    }
}

/// The string the signature covers. `headers` are (lowercase name, value) pairs as they will be
/// sent, `content_length` the body's length.
pub fn string_to_sign(
    method: &str,
    headers: &[(String, String)],
    content_length: u64,
    account: &str,
    url: &url::Url,
) -> String {
    let header = |name: &str| -> &str {
        headers.iter().find(|(key, _)| key == name).map(|(_, value)| value.as_str()).unwrap_or("")
    };
    let length = if content_length == 0 { String::new() } else { content_length.to_string() };
    let mut canonical_headers: Vec<(String, String)> = headers
        .iter()
        .filter(|(name, _)| name.starts_with("x-ms-"))
        .map(|(name, value)| (name.clone(), value.split_whitespace().collect::<Vec<_>>().join(" ")))
        .collect();
    canonical_headers.sort();
    let mut text = String::new();
    for part in [
        method,
        header("content-encoding"),
        header("content-language"),
        &length,
        header("content-md5"),
        header("content-type"),
        "", // Date: x-ms-date is used instead
        header("if-modified-since"),
        header("if-match"),
        header("if-none-match"),
        header("if-unmodified-since"),
        header("range"),
    ] {
        text.push_str(part);
        text.push('\n');
    }
    for (name, value) in canonical_headers {
        text.push_str(&name);
        text.push(':');
        text.push_str(&value);
        text.push('\n');
    }
    text.push('/');
    text.push_str(account);
    text.push_str(url.path());
    let mut parameters: Vec<(String, Vec<String>)> = Vec::new();
    for (name, value) in url.query_pairs() {
        let name = name.to_ascii_lowercase();
        match parameters.iter_mut().find(|(existing, _)| *existing == name) {
            Some((_, values)) => values.push(value.into_owned()),
            None => parameters.push((name, vec![value.into_owned()])),
        }
    }
    parameters.sort();
    for (name, mut values) in parameters {
        values.sort();
        text.push('\n');
        text.push_str(&name);
        text.push(':');
        text.push_str(&values.join(","));
    }
    text
}

/// `SharedKey account:base64(HMAC-SHA256(key, string_to_sign))`.
pub fn authorization(account: &str, key: &[u8], string_to_sign: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(string_to_sign.as_bytes());
    let signature = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    format!("SharedKey {account}:{signature}")
}

#[async_trait]
impl Policy for SharedKeyPolicy {
    async fn send(&self, ctx: &Context, request: &mut Request, next: &[Arc<dyn Policy>]) -> PolicyResult {
        request.insert_header("x-ms-date", httpdate::fmt_http_date(SystemTime::now()));
        let headers: Vec<(String, String)> = request
            .headers()
            .iter()
            .map(|(name, value)| (name.as_str().to_ascii_lowercase(), value.as_str().to_string()))
            .collect();
        let length = request.body().len().unwrap_or(0);
        let method = request.method().to_string().to_ascii_uppercase();
        let text = string_to_sign(&method, &headers, length, &self.account, request.url());
        request.insert_header("authorization", authorization(&self.account, &self.key, &text));
        next[0].send(ctx, request, &next[1..]).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_string_to_sign_has_the_documented_shape() {
        let url = url::Url::parse(
            "http://127.0.0.1:10000/devstoreaccount1/db-state/state/app/orders.json?comp=metadata&Timeout=5",
        )
        .unwrap();
        let headers = vec![
            ("x-ms-version".to_string(), "2025-11-05".to_string()),
            ("x-ms-date".to_string(), "Sun, 22 Nov 2026 12:00:00 GMT".to_string()),
            ("if-match".to_string(), "\"0x8D\"".to_string()),
            ("content-type".to_string(), "application/octet-stream".to_string()),
            ("x-ms-blob-type".to_string(), "BlockBlob".to_string()),
        ];
        let text = string_to_sign("PUT", &headers, 42, "devstoreaccount1", &url);
        assert_eq!(
            text,
            "PUT\n\n\n42\n\napplication/octet-stream\n\n\n\"0x8D\"\n\n\n\n\
             x-ms-blob-type:BlockBlob\nx-ms-date:Sun, 22 Nov 2026 12:00:00 GMT\nx-ms-version:2025-11-05\n\
             /devstoreaccount1/devstoreaccount1/db-state/state/app/orders.json\ncomp:metadata\ntimeout:5"
        );
    }

    #[test]
    fn a_zero_length_body_signs_an_empty_content_length() {
        let url = url::Url::parse("https://shop.blob.core.windows.net/c/b").unwrap();
        let text = string_to_sign("GET", &[], 0, "shop", &url);
        assert!(text.starts_with("GET\n\n\n\n"), "{text:?}");
    }

    /// Microsoft's documented example key and a fixed string give a fixed signature.
    #[test]
    fn the_signature_is_hmac_sha256_of_the_string() {
        let key = base64::engine::general_purpose::STANDARD.decode(crate::config::connection::DEV_KEY).unwrap();
        let header = authorization("devstoreaccount1", &key, "GET\n");
        assert!(header.starts_with("SharedKey devstoreaccount1:"));
        assert_eq!(header, authorization("devstoreaccount1", &key, "GET\n"));
        assert_ne!(header, authorization("devstoreaccount1", &key, "PUT\n"));
    }
}
