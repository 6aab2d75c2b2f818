//! A loopback stand-in for the App Service managed identity endpoint, as azure_identity's
//! `ManagedIdentityCredential` speaks to it: `GET $IDENTITY_ENDPOINT?api-version=2019-08-01&resource=…`
//! (and `client_id=…` for a user-assigned identity) with header `X-IDENTITY-HEADER: $IDENTITY_HEADER`,
//! answered `{"access_token", "expires_on" (Unix seconds, as text), "resource", "token_type"}`.
//!
//! Each request is given a new token, shaped as Entra's are (a JWT: `aud`, `iss`, `exp`; signed with
//! nothing: the databases here check it as a password, Azurite's `--oauth basic` reads its claims
//! only). A token expires `live` past the five minutes before expiry in which both azure_identity's
//! cache and dbtrigger (`domain::token::REFRESH_MARGIN`) replace it: so it is used for `live`, then
//! asked for again. `on_issue` runs before the answer: a test makes the token the database's
//! password there.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use base64::Engine as _;
use serde_json::json;

pub type OnIssue = Arc<dyn Fn(String) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// What one request asked for.
#[derive(Debug, Clone)]
pub struct Asked {
    pub resource: String,
    pub client_id: Option<String>,
}

struct Endpoint {
    header: String,
    live: Duration,
    tenant: String,
    issued: Mutex<Vec<String>>,
    asked: Mutex<Vec<Asked>>,
    on_issue: Option<OnIssue>,
    down: std::sync::atomic::AtomicBool,
}

pub struct IdentityEndpoint {
    pub url: String,
    /// The `IDENTITY_HEADER` secret the endpoint expects.
    pub header: String,
    endpoint: Arc<Endpoint>,
    task: tokio::task::JoinHandle<()>,
}

async fn token(
    State(endpoint): State<Arc<Endpoint>>,
    Query(query): Query<std::collections::HashMap<String, String>>,
    headers: HeaderMap,
) -> (StatusCode, String) {
    if endpoint.down.load(std::sync::atomic::Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, json!({"error": "down"}).to_string());
    }
    let header = headers.get("x-identity-header").and_then(|value| value.to_str().ok());
    if header != Some(endpoint.header.as_str()) {
        return (StatusCode::UNAUTHORIZED, json!({"error": "no or wrong X-IDENTITY-HEADER"}).to_string());
    }
    if query.get("api-version").map(String::as_str) != Some("2019-08-01") {
        return (StatusCode::BAD_REQUEST, json!({"error": "api-version"}).to_string());
    }
    let Some(resource) = query.get("resource").cloned() else {
        return (StatusCode::BAD_REQUEST, json!({"error": "no resource"}).to_string());
    };
    endpoint
        .asked
        .lock()
        .unwrap()
        .push(Asked { resource: resource.clone(), client_id: query.get("client_id").cloned() });
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs();
    let expires_on = now + 300 + endpoint.live.as_secs();
    let number = endpoint.issued.lock().unwrap().len() + 1;
    let encode = |value: serde_json::Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(value.to_string());
    let claims = json!({
        "aud": resource, "iss": format!("https://sts.windows.net/{}/", endpoint.tenant),
        "iat": now, "nbf": now - 60, "exp": expires_on, "tid": endpoint.tenant,
        "oid": "7d1f3a52-0000-4000-8000-00000000e417", "n": number, "jti": uuid::Uuid::new_v4().to_string(),
    });
    let access_token =
        format!("{}.{}.{}", encode(json!({"typ": "JWT", "alg": "RS256"})), encode(claims), encode(json!(number)));
    if let Some(on_issue) = &endpoint.on_issue {
        on_issue(access_token.clone()).await;
    }
    endpoint.issued.lock().unwrap().push(access_token.clone());
    let body = json!({
        "access_token": access_token, "expires_on": expires_on.to_string(), "resource": resource,
        "token_type": "Bearer", "client_id": query.get("client_id").cloned().unwrap_or_default(),
    });
    (StatusCode::OK, body.to_string())
}

impl IdentityEndpoint {
    pub async fn start(live: Duration, on_issue: Option<OnIssue>) -> IdentityEndpoint {
        let header = format!("identity-header-{}", uuid::Uuid::new_v4().simple());
        let endpoint = Arc::new(Endpoint {
            header: header.clone(),
            live,
            tenant: "72f988bf-86f1-41af-91ab-2d7cd011db47".to_string(),
            issued: Mutex::new(Vec::new()),
            asked: Mutex::new(Vec::new()),
            on_issue,
            down: std::sync::atomic::AtomicBool::new(false),
        });
        let router = axum::Router::new().route("/msi/token", get(token)).with_state(endpoint.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/msi/token", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        IdentityEndpoint { url, header, endpoint, task }
    }

    /// The app settings that point azure_identity at this endpoint.
    pub fn settings(&self) -> Vec<(String, String)> {
        vec![("IDENTITY_ENDPOINT".to_string(), self.url.clone()), ("IDENTITY_HEADER".to_string(), self.header.clone())]
    }

    /// Every token issued so far, oldest first.
    pub fn issued(&self) -> Vec<String> {
        self.endpoint.issued.lock().unwrap().clone()
    }

    pub fn asked(&self) -> Vec<Asked> {
        self.endpoint.asked.lock().unwrap().clone()
    }

    /// Goes down: connections kept alive are answered 503, new ones refused.
    pub fn stop(&self) {
        self.endpoint.down.store(true, std::sync::atomic::Ordering::SeqCst);
        self.task.abort();
    }
}

impl Drop for IdentityEndpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}
