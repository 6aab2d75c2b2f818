//! The custom handler: the HTTP server the Functions host starts and calls.
//!
//! - `GET /` answers 200 at once (the host polls it for readiness and keeps pinging it);
//! - `POST /{function}` runs one tick of that poller (or, for a `status` function, answers its
//!   HTTP request in `Outputs.<http output binding>`) and answers the host's JSON shape;
//! - anything else answers JSON too, never an empty body (an empty body makes the host hang).

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tracing::{error, info};

use crate::app::{App, Invocation};
use crate::protocol::InvocationRequest;

/// The router, with the app passed in (tests call it on a port-0 listener).
pub fn router(app: Arc<App>) -> Router {
    Router::new().route("/", get(ready)).route("/{function}", post(invoke)).fallback(not_found).with_state(app)
}

/// Serves until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(app)).with_graceful_shutdown(shutdown).await
}

fn json_response(status: StatusCode, body: Value) -> Response {
    (status, axum::Json(body)).into_response()
}

fn error_response(status: StatusCode, function: Option<&str>, message: &str) -> Response {
    json_response(
        status,
        json!({"error": message, "function": function, "Outputs": {}, "Logs": [message], "ReturnValue": null}),
    )
}

async fn ready(State(app): State<Arc<App>>) -> Response {
    json_response(StatusCode::OK, json!({"status": "ok", "functions": app.function_names()}))
}

async fn not_found() -> Response {
    error_response(StatusCode::NOT_FOUND, None, "not found: the handler serves GET / and POST /{function}")
}

async fn invoke(
    State(app): State<Arc<App>>,
    Path(function): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let invocation_id =
        headers.get("x-azure-functions-invocationid").and_then(|value| value.to_str().ok()).unwrap_or("-").to_string();
    let request = match InvocationRequest::parse(&body) {
        Ok(request) => request,
        Err(reason) => {
            let message = format!("{function}: malformed invocation body: {reason}");
            error!(function = %function, invocation = %invocation_id, "{message}");
            return error_response(StatusCode::BAD_REQUEST, Some(&function), &message);
        }
    };
    if request.timer_is_past_due() {
        info!(function = %function, invocation = %invocation_id, "timer is past due: catching up");
    }
    let invocation = app.invoke_with(&function, &request).await;
    let line = invocation.line();
    match &invocation {
        Invocation::Watched { lines, findings, .. } => {
            // Each finding was logged at error level by the run; the host gets them all in Logs.
            info!(function = %function, invocation = %invocation_id, findings, "{}", lines[0]);
            json_response(StatusCode::OK, json!({"Outputs": {}, "Logs": lines, "ReturnValue": null}))
        }
        Invocation::Answered { response_binding, status_code, body, .. } => {
            info!(function = %function, invocation = %invocation_id, status = status_code, "{line}");
            // The host takes the HTTP answer from the output binding; a 2xx here says the
            // invocation itself worked (a non-2xx would make the host drop the Outputs).
            let text = serde_json::to_string_pretty(body).unwrap_or_default();
            let mut outputs = serde_json::Map::new();
            outputs.insert(
                response_binding.clone(),
                json!({"statusCode": status_code, "body": text, "headers": {"Content-Type": "application/json"}}),
            );
            json_response(StatusCode::OK, json!({"Outputs": outputs, "Logs": [line], "ReturnValue": null}))
        }
        Invocation::Ticked { outcome, .. } => {
            info!(function = %function, invocation = %invocation_id, outcome = outcome.kind(), "{line}");
            let mut response =
                json_response(StatusCode::OK, json!({"Outputs": {}, "Logs": [line], "ReturnValue": null}));
            response.headers_mut().insert("x-dbtrigger-outcome", HeaderValue::from_static(outcome.kind()));
            response
        }
        failed => {
            // The host drops Logs of a failed invocation: stdout is where this is seen.
            error!(function = %function, invocation = %invocation_id, "{line}");
            let status = match failed {
                Invocation::Unknown { .. } => StatusCode::NOT_FOUND,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            error_response(status, Some(&function), &line)
        }
    }
}
