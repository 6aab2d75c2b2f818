//! Storage connections, as Azure Functions names them: an app setting holding a connection string
//! (`UseDevelopmentStorage=true`, or `DefaultEndpointsProtocol=…;AccountName=…;AccountKey=…`), or,
//! when that setting is absent, an identity-based connection described by `<NAME>__blobServiceUri`
//! / `<NAME>__queueServiceUri` / `<NAME>__accountName` and an optional `<NAME>__clientId`.
//!
//! Nothing here ever prints the account key: [`StorageConnection`]'s Debug output redacts it, and
//! parse errors name the offending field, never its value.

use std::fmt;

use base64::Engine as _;

use crate::settings::Settings;

/// The well-known Azurite account and key (public, documented by Microsoft).
pub const DEV_ACCOUNT: &str = "devstoreaccount1";
pub const DEV_KEY: &str = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

#[derive(Clone, PartialEq, Eq)]
pub enum StorageCredential {
    /// The account key (decoded).
    SharedKey { account: String, key: Vec<u8> },
    /// Managed identity; user-assigned when a client id is given.
    ManagedIdentity { client_id: Option<String> },
}

/// Never prints the key.
impl fmt::Debug for StorageCredential {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StorageCredential::SharedKey { account, .. } => {
                write!(formatter, "SharedKey({account}, key redacted)")
            }
            StorageCredential::ManagedIdentity { client_id: Some(id) } => write!(formatter, "ManagedIdentity({id})"),
            StorageCredential::ManagedIdentity { client_id: None } => {
                formatter.write_str("ManagedIdentity(system-assigned)")
            }
        }
    }
}

#[derive(Clone, PartialEq, Eq)]
pub struct StorageConnection {
    pub account: String,
    /// `https://account.blob.core.windows.net` or `http://127.0.0.1:10000/devstoreaccount1`.
    pub blob_endpoint: url::Url,
    pub queue_endpoint: url::Url,
    pub credential: StorageCredential,
}

impl fmt::Debug for StorageConnection {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("StorageConnection")
            .field("account", &self.account)
            .field("blob_endpoint", &self.blob_endpoint.as_str())
            .field("queue_endpoint", &self.queue_endpoint.as_str())
            .field("credential", &self.credential)
            .finish()
    }
}

fn endpoint(text: &str, field: &str) -> Result<url::Url, String> {
    let trimmed = text.trim_end_matches('/');
    let url = url::Url::parse(trimmed).map_err(|error| format!("{field} is not a valid URL: {error}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.cannot_be_a_base() {
        return Err(format!("{field} must be an http(s) URL"));
    }
    Ok(url)
}

impl StorageConnection {
    /// Parses a connection string. Errors say which part is wrong, never what the key is.
    pub fn parse_connection_string(text: &str) -> Result<StorageConnection, String> {
        let mut parts: Vec<(String, String)> = Vec::new();
        for part in text.split(';').map(str::trim).filter(|part| !part.is_empty()) {
            let Some((name, value)) = part.split_once('=') else {
                return Err("a connection string is `Name=value` pairs separated by `;`".to_string());
            };
            parts.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
        }
        let get = |name: &str| parts.iter().find(|(key, _)| key == name).map(|(_, value)| value.as_str());
        if get("usedevelopmentstorage").is_some_and(|value| value.eq_ignore_ascii_case("true")) {
            return Ok(StorageConnection {
                account: DEV_ACCOUNT.to_string(),
                blob_endpoint: endpoint("http://127.0.0.1:10000/devstoreaccount1", "BlobEndpoint")?,
                queue_endpoint: endpoint("http://127.0.0.1:10001/devstoreaccount1", "QueueEndpoint")?,
                credential: StorageCredential::SharedKey {
                    account: DEV_ACCOUNT.to_string(),
                    key: base64::engine::general_purpose::STANDARD.decode(DEV_KEY).expect("the Azurite key is base64"),
                },
            });
        }
        if get("sharedaccesssignature").is_some() {
            return Err("SharedAccessSignature connection strings are not supported: use an AccountKey or an identity-based connection".to_string());
        }
        let account = get("accountname").ok_or("the connection string has no AccountName")?.to_string();
        let key_text = get("accountkey").ok_or("the connection string has no AccountKey")?;
        let key = base64::engine::general_purpose::STANDARD
            .decode(key_text)
            .map_err(|_| "the AccountKey is not valid base64".to_string())?;
        let protocol = get("defaultendpointsprotocol").unwrap_or("https").to_ascii_lowercase();
        if protocol != "https" && protocol != "http" {
            return Err("DefaultEndpointsProtocol must be https or http".to_string());
        }
        let suffix = get("endpointsuffix").unwrap_or("core.windows.net");
        let blob_endpoint = match get("blobendpoint") {
            Some(value) => endpoint(value, "BlobEndpoint")?,
            None => endpoint(&format!("{protocol}://{account}.blob.{suffix}"), "BlobEndpoint")?,
        };
        let queue_endpoint = match get("queueendpoint") {
            Some(value) => endpoint(value, "QueueEndpoint")?,
            None => endpoint(&format!("{protocol}://{account}.queue.{suffix}"), "QueueEndpoint")?,
        };
        Ok(StorageConnection {
            account: account.clone(),
            blob_endpoint,
            queue_endpoint,
            credential: StorageCredential::SharedKey { account, key },
        })
    }

    /// Resolves the connection named `name` from app settings, the Functions way.
    pub fn from_settings(name: &str, settings: &Settings) -> Result<StorageConnection, String> {
        if let Some(value) = settings.get(name).filter(|value| !value.trim().is_empty()) {
            return StorageConnection::parse_connection_string(value)
                .map_err(|reason| format!("app setting {name}: {reason}"));
        }
        let blob_service_uri = settings.get(&format!("{name}__blobServiceUri"));
        let queue_service_uri = settings.get(&format!("{name}__queueServiceUri"));
        let account_name = settings.get(&format!("{name}__accountName"));
        let client_id = settings.get(&format!("{name}__clientId")).map(str::to_string);
        let blob_endpoint = match (blob_service_uri, account_name) {
            (Some(uri), _) => endpoint(uri, &format!("{name}__blobServiceUri"))?,
            (None, Some(account)) => {
                endpoint(&format!("https://{account}.blob.core.windows.net"), &format!("{name}__accountName"))?
            }
            (None, None) => {
                return Err(format!(
                    "app setting {name} is not set: give a Storage connection string, or {name}__blobServiceUri / {name}__accountName for an identity-based connection"
                ));
            }
        };
        let account = match account_name {
            Some(account) => account.to_string(),
            None => blob_endpoint.host_str().unwrap_or_default().split('.').next().unwrap_or_default().to_string(),
        };
        let queue_endpoint = match queue_service_uri {
            Some(uri) => endpoint(uri, &format!("{name}__queueServiceUri"))?,
            None => {
                endpoint(&format!("https://{account}.queue.core.windows.net"), &format!("{name}__queueServiceUri"))?
            }
        };
        if blob_endpoint.scheme() != "https" {
            return Err(format!("{name}__blobServiceUri must be https for an identity-based connection"));
        }
        Ok(StorageConnection {
            account,
            blob_endpoint,
            queue_endpoint,
            credential: StorageCredential::ManagedIdentity { client_id },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "a2V5LWJ5dGVzLWZvci10ZXN0aW5nLW9ubHk=";

    #[test]
    fn development_storage_is_azurite_on_its_default_ports() {
        let connection = StorageConnection::parse_connection_string("UseDevelopmentStorage=true").unwrap();
        assert_eq!(connection.blob_endpoint.as_str(), "http://127.0.0.1:10000/devstoreaccount1");
        assert_eq!(connection.queue_endpoint.as_str(), "http://127.0.0.1:10001/devstoreaccount1");
        assert!(
            matches!(connection.credential, StorageCredential::SharedKey { ref account, .. } if account == DEV_ACCOUNT)
        );
    }

    #[test]
    fn a_full_connection_string_builds_the_endpoints() {
        let text =
            format!("DefaultEndpointsProtocol=https;AccountName=shop;AccountKey={KEY};EndpointSuffix=core.windows.net");
        let connection = StorageConnection::parse_connection_string(&text).unwrap();
        assert_eq!(connection.blob_endpoint.as_str(), "https://shop.blob.core.windows.net/");
        assert_eq!(connection.queue_endpoint.as_str(), "https://shop.queue.core.windows.net/");
        let text = format!(
            "AccountName=devstoreaccount1;AccountKey={KEY};BlobEndpoint=http://127.0.0.1:4000/devstoreaccount1;"
        );
        let connection = StorageConnection::parse_connection_string(&text).unwrap();
        assert_eq!(connection.blob_endpoint.as_str(), "http://127.0.0.1:4000/devstoreaccount1");
    }

    #[test]
    fn errors_name_the_part_and_never_the_key() {
        let error = StorageConnection::parse_connection_string("AccountName=shop;AccountKey=not*base64!").unwrap_err();
        assert!(error.contains("AccountKey") && !error.contains("not*base64"), "{error}");
        assert!(
            StorageConnection::parse_connection_string(&format!("AccountKey={KEY}"))
                .unwrap_err()
                .contains("AccountName")
        );
        assert!(StorageConnection::parse_connection_string("AccountName=a;SharedAccessSignature=sv=1").is_err());
    }

    #[test]
    fn debug_output_redacts_the_key() {
        let connection =
            StorageConnection::parse_connection_string(&format!("AccountName=shop;AccountKey={KEY}")).unwrap();
        let printed = format!("{connection:?}");
        assert!(!printed.contains(KEY) && printed.contains("redacted"), "{printed}");
    }

    #[test]
    fn identity_based_connections_follow_the_functions_convention() {
        let settings = Settings::from_pairs([("Store__accountName", "shop"), ("Store__clientId", "1234")]);
        let connection = StorageConnection::from_settings("Store", &settings).unwrap();
        assert_eq!(connection.blob_endpoint.as_str(), "https://shop.blob.core.windows.net/");
        assert_eq!(connection.credential, StorageCredential::ManagedIdentity { client_id: Some("1234".into()) });

        let settings = Settings::from_pairs([("Store__blobServiceUri", "https://other.blob.core.windows.net")]);
        let connection = StorageConnection::from_settings("Store", &settings).unwrap();
        assert_eq!(connection.account, "other");
        assert_eq!(connection.credential, StorageCredential::ManagedIdentity { client_id: None });

        let error = StorageConnection::from_settings("Missing", &Settings::default()).unwrap_err();
        assert!(error.contains("Missing__blobServiceUri"), "{error}");
    }
}
