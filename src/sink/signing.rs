//! Standard Webhooks signatures: `webhook-signature: v1,<base64 HMAC-SHA256("{id}.{timestamp}.{body}")>`.
//! The key comes decoded from the configuration ([`SigningKey`]).

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

pub use crate::config::sink::SigningKey;

/// The `webhook-signature` header value of a request.
pub fn sign(key: &SigningKey, id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key.bytes()).expect("HMAC takes a key of any length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the Standard Webhooks specification.
    #[test]
    fn the_specification_example_verifies() {
        let key = SigningKey::from_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            sign(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn a_bad_whsec_secret_is_refused_without_echoing_it() {
        let error = SigningKey::from_secret("whsec_!!!not-base64!!!").unwrap_err();
        assert!(!error.contains("not-base64"));
    }
}
