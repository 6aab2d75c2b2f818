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
use opentelemetry::context::FutureExt as _;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tracing::{debug, error, info, warn};

use crate::app::{App, Invocation};
use crate::protocol::InvocationRequest;
use crate::tick::TickOutcome;

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
    // Only the invocation id is read from the headers: they carry the caller's function key
    // (`x-functions-key`) for an HTTP trigger, so none of them is ever logged.
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
    say_how_the_timer_fired(&function, &invocation_id, &request);
    // A span for the invocation, with the host's id, when telemetry is on (the tick puts its
    // facts on it; its deliveries are its children).
    let traced = crate::telemetry::traced::invocation_context(&function, &invocation_id);
    let invocation = match &traced {
        Some(context) => app.invoke_with(&function, &request).with_context(context.clone()).await,
        None => app.invoke_with(&function, &request).await,
    };
    let line = invocation.line();
    if let Some(context) = traced {
        crate::telemetry::traced::finish(context, invocation.succeeded(), &line);
    }
    // A succeeded invocation's line goes into `Logs` only: the host logs each `Logs` entry under
    // the invocation (at Information), and a copy on stdout would be a second trace of every tick.
    // It is on stdout at debug level. A failure goes to stderr (Error), since the host drops the
    // `Logs` of a non-2xx answer; what needs attention is also on stderr, as a warning.
    match &invocation {
        Invocation::Watched { lines, findings, .. } => {
            // Each finding was logged at error level by the run; the host gets them all in Logs.
            debug!(function = %function, invocation = %invocation_id, findings, "{}", lines[0]);
            json_response(StatusCode::OK, json!({"Outputs": {}, "Logs": lines, "ReturnValue": null}))
        }
        Invocation::Answered { response_binding, status_code, body, page, .. } => {
            debug!(function = %function, invocation = %invocation_id, status = status_code, "{line}");
            // The host takes the HTTP answer from the output binding; a 2xx here says the
            // invocation itself worked (a non-2xx would make the host drop the Outputs).
            let answer = match page {
                // The page loads nothing and runs nothing: the policy says so to the browser.
                Some(page) => json!({"statusCode": status_code, "body": page, "headers": {
                    "Content-Type": "text/html; charset=utf-8",
                    "Content-Security-Policy": crate::status::page::CONTENT_SECURITY_POLICY,
                    "X-Content-Type-Options": "nosniff",
                    "Cache-Control": "no-store"}}),
                None => {
                    let text = serde_json::to_string_pretty(body).unwrap_or_default();
                    json!({"statusCode": status_code, "body": text, "headers": {"Content-Type": "application/json"}})
                }
            };
            let mut outputs = serde_json::Map::new();
            outputs.insert(response_binding.clone(), answer);
            json_response(StatusCode::OK, json!({"Outputs": outputs, "Logs": [line], "ReturnValue": null}))
        }
        Invocation::Ticked { outcome, .. } => {
            if needs_attention(outcome) {
                warn!(function = %function, invocation = %invocation_id, outcome = outcome.kind(), "{line}");
            } else {
                debug!(function = %function, invocation = %invocation_id, outcome = outcome.kind(), "{line}");
            }
            let mut response =
                json_response(StatusCode::OK, json!({"Outputs": {}, "Logs": [line], "ReturnValue": null}));
            response.headers_mut().insert("x-dbtrigger-outcome", HeaderValue::from_static(outcome.kind()));
            response
        }
        failed => {
            // The host drops Logs of a failed invocation: stderr is where this is seen.
            error!(function = %function, invocation = %invocation_id, "{line}");
            let status = match failed {
                Invocation::Unknown { .. } => StatusCode::NOT_FOUND,
                Invocation::Abandoned { .. } => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            error_response(status, Some(&function), &line)
        }
    }
}

/// A tick whose outcome someone should look at: rows quarantined, a lease lost to another
/// instance, or a state document that had to be created (a deleted one means redelivery).
fn needs_attention(outcome: &TickOutcome) -> bool {
    match outcome {
        TickOutcome::Delivered { quarantined, new_document, .. } => *quarantined > 0 || *new_document,
        TickOutcome::LeaseLost { .. } => true,
        _ => false,
    }
}

/// What the timer's payload says about why it fires now, when that is not simply its schedule.
fn say_how_the_timer_fired(function: &str, invocation_id: &str, request: &InvocationRequest) {
    if request.timer_is_past_due() {
        info!(function = %function, invocation = %invocation_id, "timer is past due: catching up after a restart");
    } else if let Some(late) = request.timer_fired_late(chrono::Utc::now()) {
        info!(
            function = %function,
            invocation = %invocation_id,
            "timer fired {} s after its occurrence: the previous run outlasted its interval",
            late.num_seconds()
        );
    }
    if let Some(retry) = request.retry_context() {
        info!(
            function = %function,
            invocation = %invocation_id,
            "retry {} of {} (the function's retry policy)",
            retry.retry_count,
            retry.max_retry_count.map(|count| count.to_string()).unwrap_or_else(|| "?".to_string())
        );
    }
}
