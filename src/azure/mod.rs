//! Azure Storage plumbing shared by the blob state store and the queue sink: clients built from a
//! validated [`StorageConnection`] (parsed by `config::connection`), one Shared Key signing
//! policy, one set of client options (bounded retries, timeouts).
//!
//! The GA Azure SDK signs only with Entra ID tokens (Azure/azure-sdk-for-rust#2975), so account-key
//! connection strings and Azurite get [`shared_key::SharedKeyPolicy`], a per-try pipeline policy.

pub mod shared_key;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use azure_core::http::policies::{Policy, PolicyResult};
use azure_core::http::{ClientOptions, Context, ExponentialRetryOptions, Method, Request, RetryOptions, Transport};

pub use crate::config::connection::{StorageConnection, StorageCredential};

/// Per-request timeout: a storage call that takes longer is abandoned (and retried).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Requests sent through a client, by method: what a tick costs (design "blob budget").
#[derive(Debug, Default)]
pub struct RequestCounter {
    pub gets: AtomicU64,
    pub puts: AtomicU64,
    pub others: AtomicU64,
}

impl RequestCounter {
    pub fn snapshot(&self) -> (u64, u64) {
        (self.gets.load(Ordering::SeqCst), self.puts.load(Ordering::SeqCst))
    }
}

#[derive(Debug)]
struct CountingPolicy {
    counter: Arc<RequestCounter>,
}

#[async_trait]
impl Policy for CountingPolicy {
    async fn send(&self, ctx: &Context, request: &mut Request, next: &[Arc<dyn Policy>]) -> PolicyResult {
        let slot = match request.method() {
            Method::Get | Method::Head => &self.counter.gets,
            Method::Put => &self.counter.puts,
            _ => &self.counter.others,
        };
        slot.fetch_add(1, Ordering::SeqCst);
        next[0].send(ctx, request, &next[1..]).await
    }
}

/// A few retries within eight seconds.
fn bounded_retry() -> RetryOptions {
    RetryOptions::exponential(ExponentialRetryOptions {
        initial_delay: azure_core::time::Duration::milliseconds(200),
        max_retries: 3,
        max_total_elapsed: azure_core::time::Duration::seconds(8),
        max_delay: azure_core::time::Duration::seconds(2),
    })
}

/// Client options for a storage client: the SDK's retries bounded to a few seconds (its default
/// retries for about 80 s, past a tick's budget), a per-request timeout, Shared Key signing when
/// the connection has an account key, and a request counter.
pub fn client_options(connection: &StorageConnection, counter: Arc<RequestCounter>) -> ClientOptions {
    let http = reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .connect_timeout(CONNECT_TIMEOUT)
        .build()
        .expect("a plain HTTP client builds");
    let mut options = ClientOptions {
        retry: bounded_retry(),
        transport: Some(Transport::new(Arc::new(http))),
        per_call_policies: vec![Arc::new(CountingPolicy { counter })],
        ..Default::default()
    };
    if let StorageCredential::SharedKey { account, key } = &connection.credential {
        options.per_try_policies.push(Arc::new(shared_key::SharedKeyPolicy::new(account.clone(), key.clone())));
    }
    options
}

/// A token credential for identity-based connections (managed identity, user-assigned when a
/// client id is given); `None` for Shared Key connections, which sign with the policy instead.
pub fn token_credential(
    connection: &StorageConnection,
) -> Result<Option<Arc<dyn azure_core::credentials::TokenCredential>>, String> {
    match &connection.credential {
        StorageCredential::SharedKey { .. } => Ok(None),
        StorageCredential::ManagedIdentity { client_id } => managed_identity(client_id.clone()).map(Some),
    }
}

/// The app's managed identity as a token credential (user-assigned when `client_id` is given), for
/// Storage and for the databases (`source::entra`). On App Service and Functions it asks the
/// endpoint in `IDENTITY_ENDPOINT` with the `IDENTITY_HEADER` secret; elsewhere the VM's IMDS.
pub fn managed_identity(
    client_id: Option<String>,
) -> Result<Arc<dyn azure_core::credentials::TokenCredential>, String> {
    let options = azure_identity::ManagedIdentityCredentialOptions {
        user_assigned_id: client_id.map(azure_identity::UserAssignedId::ClientId),
        // The SDK's default retries for over a minute: an endpoint that is down fails the tick
        // within seconds instead, and the next tick asks again.
        client_options: ClientOptions { retry: bounded_retry(), ..Default::default() },
    };
    let credential = azure_identity::ManagedIdentityCredential::new(Some(options))
        .map_err(|error| format!("cannot set up the managed identity: {error}"))?;
    Ok(credential)
}
