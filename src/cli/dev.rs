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
use crate::domain::schedule::{Schedule, ScheduleZone};

fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, false)
}

/// What the host keeps between two runs of a timer (azure-webjobs-sdk-extensions
/// `Extensions/Timers/Listener/TimerListener.cs`): the last run's occurrence (`None` on fresh
/// storage) and the next occurrence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimerStatus {
    pub last: Option<DateTime<Utc>>,
    pub next: DateTime<Utc>,
}

impl TimerStatus {
    /// After a run that started at `invoked` (not a past-due nor a startup run): its occurrence is
    /// `next` unless the run started after it, and the following occurrence counts from there. A
    /// run that outlasted its interval so leaves a `next` in the past: the host fires again at once.
    pub fn after_run(self, invoked: DateTime<Utc>, schedule: &Schedule, zone: &ScheduleZone) -> Option<TimerStatus> {
        let occurrence = if self.next > invoked { self.next } else { invoked };
        Some(TimerStatus { last: Some(occurrence), next: schedule.next_after_in(occurrence, zone)? })
    }
}

/// The body the host posts for a timer invocation: `status` is the one kept before this run, or
/// `None` when the host keeps none (`useMonitor: false`, or a schedule more often than a minute):
/// then `ScheduleStatus` is null. `Last` and `LastUpdated` are .NET's default date on fresh storage.
pub fn timer_payload(function: &str, status: Option<TimerStatus>, now: DateTime<Utc>) -> Value {
    let schedule_status = match status {
        Some(TimerStatus { last, next }) => {
            let last = last.map(timestamp).unwrap_or_else(|| "0001-01-01T00:00:00".to_string());
            json!({"Last": last, "Next": timestamp(next), "LastUpdated": last})
        }
        None => Value::Null,
    };
    json!({
        "Data": {"timer": {"Schedule": {"AdjustForDST": true}, "ScheduleStatus": schedule_status, "IsPastDue": false}},
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

/// One timer as the host runs it.
struct Timer {
    function: String,
    schedule: Schedule,
    zone: ScheduleZone,
    run_on_startup: bool,
    /// The host keeps a schedule status (`useMonitor`, and not more often than once a minute).
    monitor: bool,
}

/// Fires the timer until the process stops: at each occurrence, or at once after a run that
/// outlasted its interval; one run at a time, as the host's listener does.
async fn run_timer(base_url: String, timer: Timer) {
    let client = reqwest::Client::new();
    let Some(first) = timer.schedule.next_after_in(Utc::now(), &timer.zone) else {
        warn!(function = %timer.function, "[dev] the schedule never fires");
        return;
    };
    let mut status = TimerStatus { last: None, next: first };
    if timer.run_on_startup {
        let invoked = Utc::now();
        fire(
            &client,
            &base_url,
            &timer.function,
            &timer_payload(&timer.function, timer.monitor.then_some(status), invoked),
        )
        .await;
        // A startup run's occurrence is when it started.
        let Some(next) = timer.schedule.next_after_in(invoked, &timer.zone) else {
            return;
        };
        status = TimerStatus { last: Some(invoked), next };
    }
    loop {
        let wait = (status.next - Utc::now()).to_std().unwrap_or_default();
        tokio::time::sleep(wait).await;
        let invoked = Utc::now();
        let payload = timer_payload(&timer.function, timer.monitor.then_some(status), invoked);
        fire(&client, &base_url, &timer.function, &payload).await;
        let Some(after) = status.after_run(invoked, &timer.schedule, &timer.zone) else {
            warn!(function = %timer.function, "[dev] the schedule never fires again");
            return;
        };
        status = after;
    }
}

/// The timer binding's `useMonitor` (default true) in `<app_root>/<function>/function.json`.
fn use_monitor(app_root: &Path, function: &str) -> bool {
    let path = app_root.join(function).join("function.json");
    let Ok(document) = std::fs::read_to_string(&path).map(|text| serde_json::from_str::<Value>(&text)) else {
        return true;
    };
    let bindings = document.ok().and_then(|document| document.get("bindings").cloned());
    let Some(Value::Array(bindings)) = bindings else {
        return true;
    };
    for binding in bindings {
        let is_timer =
            binding.get("type").and_then(Value::as_str).is_some_and(|kind| kind.eq_ignore_ascii_case("timerTrigger"));
        if is_timer {
            return binding.get("useMonitor").and_then(Value::as_bool).unwrap_or(true);
        }
    }
    true
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
        info!(function = %name, schedule = %schedule, zone = app.schedule_zone.name(), "[dev] timer armed");
        let monitor = use_monitor(app_root, &name) && !schedule.monitor_off_by_frequency();
        let timer = Timer { function: name, schedule, zone: app.schedule_zone.clone(), run_on_startup, monitor };
        timers.push(tokio::spawn(run_timer(base_url.clone(), timer)));
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

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn the_payload_has_the_host_shape_and_parses() {
        let now = at("2024-11-30T14:45:00.01Z");
        let first = TimerStatus { last: None, next: at("2024-11-30T14:45:00Z") };
        let payload = timer_payload("orders", Some(first), now);
        let request = InvocationRequest::parse(payload.to_string().as_bytes()).unwrap();
        assert!(request.data["timer"]["Schedule"]["AdjustForDST"].as_bool().unwrap());
        assert_eq!(payload["Metadata"]["sys"]["MethodName"], "orders");
        let status = &payload["Data"]["timer"]["ScheduleStatus"];
        assert_eq!(status["Last"], "0001-01-01T00:00:00");
        assert_eq!(status["LastUpdated"], "0001-01-01T00:00:00");
        assert_eq!(request.timer_status().unwrap().next, Some(first.next), "Next is the occurrence firing now");
        assert_eq!(timer_payload("orders", None, now)["Data"]["timer"]["ScheduleStatus"], Value::Null);
    }

    /// Regression (issue 25, item 6): dev sends what the host sends after each run: `Last` the
    /// occurrence that ran, `Next` the one after; and after a run that outlasted its interval, a
    /// `Next` in the past, fired at once.
    #[test]
    fn the_status_moves_as_the_hosts_does() {
        let schedule = Schedule::parse("0 */5 * * * *").unwrap();
        let zone = ScheduleZone::Utc;
        let status = TimerStatus { last: None, next: at("2024-11-30T14:45:00Z") };
        // The timer fires a little early: the occurrence is still 14:45.
        let after = status.after_run(at("2024-11-30T14:44:59.990Z"), &schedule, &zone).unwrap();
        assert_eq!(after, TimerStatus { last: Some(at("2024-11-30T14:45:00Z")), next: at("2024-11-30T14:50:00Z") });
        // It started at 14:50:00.02 and ran 7 minutes: the next occurrence, counted from its start,
        // is 14:55, already past when it ends at 14:57.
        let overran = after.after_run(at("2024-11-30T14:50:00.02Z"), &schedule, &zone).unwrap();
        assert_eq!(overran.next, at("2024-11-30T14:55:00Z"));
        let payload = timer_payload("orders", Some(overran), at("2024-11-30T14:57:03Z"));
        let request = InvocationRequest::parse(payload.to_string().as_bytes()).unwrap();
        assert!(!request.timer_is_past_due());
        assert_eq!(request.timer_fired_late(at("2024-11-30T14:57:03Z")).unwrap().num_seconds(), 123);
        assert_eq!(
            payload["Data"]["timer"]["ScheduleStatus"]["LastUpdated"],
            payload["Data"]["timer"]["ScheduleStatus"]["Last"]
        );
    }
}
