//! `dbtrigger dev`: local work without Azure Functions Core Tools. It runs the handler, as `serve`
//! does, and fires each function's timer schedule at it over HTTP with the host's own payload, as
//! the host would. App settings come from the environment, then from the app root's
//! local.settings.json `Values` (the environment wins).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Value, json};
use tracing::{error, info, warn};

use crate::app::App;
use crate::config::Settings;
use crate::domain::schedule::Schedule;

fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, false)
}

/// The body the host posts for a timer invocation.
pub fn timer_payload(
    function: &str,
    last: Option<DateTime<Utc>>,
    next: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> Value {
    let status = match (last, next) {
        (Some(last), Some(next)) => {
            json!({"Last": timestamp(last), "Next": timestamp(next), "LastUpdated": timestamp(last)})
        }
        (None, Some(next)) => {
            json!({"Last": "0001-01-01T00:00:00", "Next": timestamp(next), "LastUpdated": timestamp(now)})
        }
        _ => Value::Null,
    };
    json!({
        "Data": {"timer": {"Schedule": {"AdjustForDST": true}, "ScheduleStatus": status, "IsPastDue": false}},
        "Metadata": {"sys": {"MethodName": function, "UtcNow": now.to_rfc3339_opts(SecondsFormat::Micros, true),
                             "RandGuid": uuid::Uuid::new_v4().to_string()}}
    })
}

async fn fire(client: &reqwest::Client, base_url: &str, function: &str, payload: &Value) {
    let result = client
        .post(format!("{base_url}/{function}"))
        .header("x-azure-functions-invocationid", uuid::Uuid::new_v4().to_string())
        .json(payload)
        .send()
        .await;
    match result {
        Ok(response) => {
            let status = response.status();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            if status.is_success() {
                info!(function, "[dev] {}", body["Logs"][0].as_str().unwrap_or(""));
            } else {
                warn!(
                    function,
                    status = status.as_u16(),
                    "[dev] invocation failed: {}",
                    body["error"].as_str().unwrap_or("")
                );
            }
        }
        Err(error) => error!(function, "[dev] cannot invoke the handler: {error}"),
    }
}

/// Fires `function` on `schedule` until the process stops.
async fn run_timer(base_url: String, function: String, schedule: Schedule, run_on_startup: bool) {
    let client = reqwest::Client::new();
    let mut last: Option<DateTime<Utc>> = None;
    if run_on_startup {
        let now = Utc::now();
        fire(&client, &base_url, &function, &timer_payload(&function, None, schedule.next_after(now), now)).await;
    }
    loop {
        let Some(next) = schedule.next_after(Utc::now()) else {
            warn!(function = %function, "[dev] the schedule never fires again");
            return;
        };
        let wait = (next - Utc::now()).to_std().unwrap_or_default();
        tokio::time::sleep(wait).await;
        let now = Utc::now();
        let payload = timer_payload(&function, last, schedule.next_after(next), now);
        fire(&client, &base_url, &function, &payload).await;
        last = Some(next);
    }
}

pub async fn run(app_root: &Path, port: Option<u16>) -> anyhow::Result<ExitCode> {
    let settings = Settings::for_app_root(app_root)?;
    let app = Arc::new(App::load(app_root, &settings)?);
    let listener =
        tokio::net::TcpListener::bind(("127.0.0.1", port.unwrap_or(0))).await.context("cannot listen on 127.0.0.1")?;
    let base_url = format!("http://{}", listener.local_addr()?);
    info!(%base_url, app_root = %app_root.display(), "[dev] handler listening; firing timer schedules");
    let mut timers = Vec::new();
    for (name, schedule, run_on_startup) in app.timers() {
        info!(function = %name, schedule = %schedule, "[dev] timer armed");
        timers.push(tokio::spawn(run_timer(base_url.clone(), name, schedule, run_on_startup)));
    }
    crate::handler::serve(listener, app, super::shutdown_signal()).await?;
    for timer in timers {
        timer.abort();
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::InvocationRequest;

    #[test]
    fn the_payload_has_the_host_shape_and_parses() {
        let now = Utc::now();
        for (last, next) in [(None, Some(now)), (Some(now), Some(now)), (None, None)] {
            let payload = timer_payload("orders", last, next, now);
            let request = InvocationRequest::parse(payload.to_string().as_bytes()).unwrap();
            assert!(request.data["timer"]["Schedule"]["AdjustForDST"].as_bool().unwrap());
            assert_eq!(payload["Metadata"]["sys"]["MethodName"], "orders");
        }
    }
}
