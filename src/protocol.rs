//! What the Functions host posts to the handler (see the host protocol reference): the invocation
//! envelope, a timer's data, an HTTP request's query. Shared by the handler and the app.
//!
//! What the host posts for a timer invocation (azure-webjobs-sdk-extensions
//! `Extensions/Timers/Listener/TimerListener.cs`, `TimerInfo.cs`, `Scheduling/ScheduleStatus.cs`;
//! azure-functions-host `Workers/MessageExtensions/ScriptInvocationContextExtensions.cs`). The body
//! comes with `Transfer-Encoding: chunked` and no `Content-Length`
//! (`HttpScriptInvocationContextExtensions.cs`: an `ObjectContent`). Everything about the timer is
//! informational and parsed leniently; only the envelope's shape is checked:
//! - `ScheduleStatus` is the status stored before this run, or `null` (`useMonitor: false`, or a
//!   schedule firing more often than once a minute): `Next` is the occurrence firing now, `Last`
//!   the previous one, `LastUpdated` equal to `Last`; on fresh storage `Last` and `LastUpdated` are
//!   .NET's default date, `0001-01-01T00:00:00`, with or without an offset;
//! - a run that outlasted its interval is followed at once by another whose `Next` is in the past,
//!   with `IsPastDue: false`; `IsPastDue` is true only for the catch-up at start-up after missed
//!   occurrences;
//! - a `retry` policy in function.json adds `Metadata.RetryContext` to a retried run.

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::Deserialize;
use serde_json::{Map, Value};

#[derive(Debug, Clone, Default, Deserialize)]
pub struct InvocationRequest {
    #[serde(rename = "Data", default)]
    pub data: Map<String, Value>,
    #[serde(rename = "Metadata", default)]
    pub metadata: Option<Value>,
}

impl InvocationRequest {
    /// A JSON object with an optional `Data` object and optional `Metadata`. An empty body is
    /// accepted as an invocation without data (a manual run).
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(InvocationRequest::default());
        }
        let value: Value = serde_json::from_slice(body).map_err(|error| format!("not JSON: {error}"))?;
        let Value::Object(object) = &value else {
            return Err("expected a JSON object with `Data` and `Metadata`".to_string());
        };
        if let Some(data) = object.get("Data")
            && !data.is_object()
            && !data.is_null()
        {
            return Err("`Data` must be an object".to_string());
        }
        let data = match object.get("Data") {
            Some(Value::Object(data)) => data.clone(),
            _ => Map::new(),
        };
        Ok(InvocationRequest { data, metadata: object.get("Metadata").cloned() })
    }

    /// The query parameters of the HTTP request in binding `binding` (`Data.<binding>`): its
    /// `Query` as an object, or as a JSON string holding one, else the query string of its `Url`.
    pub fn http_query(&self, binding: &str) -> BTreeMap<String, String> {
        let mut query = BTreeMap::new();
        let Some(request) = self.data.get(binding) else {
            return query;
        };
        let object = match request.get("Query") {
            Some(Value::Object(object)) => Some(object.clone()),
            Some(Value::String(text)) => serde_json::from_str::<Map<String, Value>>(text).ok(),
            _ => None,
        };
        if let Some(object) = object {
            for (key, value) in object {
                let text = match value {
                    Value::String(text) => text,
                    Value::Array(items) => items.first().and_then(Value::as_str).unwrap_or_default().to_string(),
                    other => other.to_string(),
                };
                query.insert(key, text);
            }
        }
        if query.is_empty()
            && let Some(url) = request.get("Url").and_then(Value::as_str).and_then(|url| url::Url::parse(url).ok())
        {
            for (key, value) in url.query_pairs() {
                query.entry(key.into_owned()).or_insert_with(|| value.into_owned());
            }
        }
        query
    }

    /// The value of header `name` (any case) of the HTTP request in binding `binding`: the host
    /// sends `Headers` as an object of arrays (or of strings); several values are joined by ", ".
    pub fn http_header(&self, binding: &str, name: &str) -> Option<String> {
        let headers = self.data.get(binding)?.get("Headers")?.as_object()?;
        let (_, value) = headers.iter().find(|(key, _)| key.eq_ignore_ascii_case(name))?;
        match value {
            Value::String(text) => Some(text.clone()),
            Value::Array(items) => Some(items.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", ")),
            _ => None,
        }
    }

    /// `IsPastDue` of the first timer binding, if the host sent one.
    pub fn timer_is_past_due(&self) -> bool {
        self.data.values().filter_map(|binding| binding.get("IsPastDue")).any(|flag| flag.as_bool() == Some(true))
    }

    /// The schedule status of the timer binding, when the host keeps one (`None` for
    /// `ScheduleStatus: null`, or no timer).
    pub fn timer_status(&self) -> Option<ScheduleStatus> {
        let status = self.data.values().find_map(|binding| binding.get("ScheduleStatus"))?;
        if !status.is_object() {
            return None;
        }
        let date = |key: &str| status.get(key).and_then(Value::as_str).and_then(host_date);
        Some(ScheduleStatus { last: date("Last"), next: date("Next"), last_updated: date("LastUpdated") })
    }

    /// How late the timer fired: `now` minus the `Next` of its status, when more than a few
    /// seconds (the follow-up of a run that outlasted its interval, or a catch-up).
    pub fn timer_fired_late(&self, now: DateTime<Utc>) -> Option<chrono::Duration> {
        let next = self.timer_status()?.next?;
        let late = now - next;
        (late > chrono::Duration::seconds(5)).then_some(late)
    }

    /// `Metadata.RetryContext`: a retried run of a function with a `retry` policy.
    pub fn retry_context(&self) -> Option<RetryContext> {
        let context = self.metadata.as_ref()?.get("RetryContext")?;
        let count = |key: &str| context.get(key).and_then(Value::as_i64);
        Some(RetryContext { retry_count: count("RetryCount")?, max_retry_count: count("MaxRetryCount") })
    }
}

/// A timer's stored status, as the host sends it. `None` for a date that is .NET's default
/// (`0001-01-01`: fresh storage) or that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleStatus {
    pub last: Option<DateTime<Utc>>,
    pub next: Option<DateTime<Utc>>,
    pub last_updated: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryContext {
    pub retry_count: i64,
    pub max_retry_count: Option<i64>,
}

/// A date as .NET writes it: RFC 3339 with any number of fractional digits, or with no offset at
/// all (taken as UTC). The default date (year 1) is no date.
fn host_date(text: &str) -> Option<DateTime<Utc>> {
    let parsed = match DateTime::parse_from_rfc3339(text) {
        Ok(parsed) => parsed.with_timezone(&Utc),
        Err(_) => NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M:%S%.f").ok()?.and_utc(),
    };
    (parsed.timestamp() > DEFAULT_DATE_CUTOFF).then_some(parsed)
}

/// Dates up to 0002-01-01 are .NET's `default(DateTime)`, whatever offset it was written with.
const DEFAULT_DATE_CUTOFF: i64 = -62_104_060_800;

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn the_host_timer_fixtures_parse() {
        let fixtures = [
            (include_str!("../tests/fixtures/host/timer_first_run.json"), false),
            (include_str!("../tests/fixtures/host/timer_first_run_offset.json"), false),
            (include_str!("../tests/fixtures/host/timer_no_monitor.json"), false),
            (include_str!("../tests/fixtures/host/timer_normal.json"), false),
            (include_str!("../tests/fixtures/host/timer_overrun.json"), false),
            (include_str!("../tests/fixtures/host/timer_past_due.json"), true),
            (include_str!("../tests/fixtures/host/timer_retry.json"), false),
        ];
        for (text, past_due) in fixtures {
            let request = InvocationRequest::parse(text.as_bytes()).unwrap();
            assert!(request.data.contains_key("timer"));
            assert_eq!(request.timer_is_past_due(), past_due);
            assert_eq!(request.metadata.as_ref().unwrap()["sys"]["MethodName"], "orders", "the function's name");
        }
    }

    /// Regression (issue 25, item 6): the statuses as the host sends them: default dates on a
    /// first run (with or without an offset), none without a monitor, `Next` in the past after an
    /// overrun, a retry's context.
    #[test]
    fn timer_statuses_read_as_the_host_means_them() {
        let parse = |text: &str| InvocationRequest::parse(text.as_bytes()).unwrap();
        for first in [
            include_str!("../tests/fixtures/host/timer_first_run.json"),
            include_str!("../tests/fixtures/host/timer_first_run_offset.json"),
        ] {
            let status = parse(first).timer_status().unwrap();
            assert_eq!((status.last, status.last_updated), (None, None), "default dates are no dates");
            assert_eq!(status.next, Some(at("2024-11-30T14:45:00Z")));
        }
        assert_eq!(parse(include_str!("../tests/fixtures/host/timer_no_monitor.json")).timer_status(), None);
        let normal = parse(include_str!("../tests/fixtures/host/timer_normal.json"));
        let status = normal.timer_status().unwrap();
        assert_eq!(status.last, status.last_updated);
        assert_eq!(normal.timer_fired_late(at("2024-11-30T14:45:00.0213Z")), None);
        let overrun = parse(include_str!("../tests/fixtures/host/timer_overrun.json"));
        assert!(!overrun.timer_is_past_due());
        let late = overrun.timer_fired_late(at("2024-11-30T14:53:41.5072Z")).unwrap();
        assert_eq!(late.num_seconds(), 221);
        let retried = parse(include_str!("../tests/fixtures/host/timer_retry.json"));
        assert_eq!(retried.retry_context(), Some(RetryContext { retry_count: 1, max_retry_count: Some(3) }));
        assert_eq!(normal.retry_context(), None);
        assert_eq!(host_date("2024-11-30T14:40:00.0155421+00:00"), Some(at("2024-11-30T14:40:00.0155421Z")));
        assert_eq!(host_date("2024-11-30T14:40:00"), Some(at("2024-11-30T14:40:00Z")));
        assert_eq!(host_date("not a date"), None);
    }

    #[test]
    fn the_http_fixture_gives_its_query() {
        let text = include_str!("../tests/fixtures/host/http_status.json");
        let request = InvocationRequest::parse(text.as_bytes()).unwrap();
        // The query's value, not the JSON-quoted copy the host puts in `Metadata.poller`.
        assert_eq!(request.metadata.as_ref().unwrap()["poller"], "\"orders\"");
        assert!(request.data["req"].get("Body").is_none(), "a GET has no Body key");
        assert_eq!(request.http_query("req").get("poller").map(String::as_str), Some("orders"));
        assert!(request.http_query("other").is_empty());
        let from_url = InvocationRequest::parse(
            br#"{"Data":{"req":{"Url":"https://app.azurewebsites.net/api/status?poller=a%20b&code=k","Query":{}}}}"#,
        )
        .unwrap();
        assert_eq!(from_url.http_query("req").get("poller").map(String::as_str), Some("a b"));
        let as_text = InvocationRequest::parse(br#"{"Data":{"req":{"Query":"{\"poller\":\"x\"}"}}}"#).unwrap();
        assert_eq!(as_text.http_query("req").get("poller").map(String::as_str), Some("x"));
    }

    #[test]
    fn malformed_bodies_are_refused_with_a_reason() {
        assert!(InvocationRequest::parse(b"{nope").unwrap_err().contains("not JSON"));
        assert!(InvocationRequest::parse(b"[1, 2]").unwrap_err().contains("JSON object"));
        assert!(InvocationRequest::parse(br#"{"Data": 3}"#).unwrap_err().contains("Data"));
    }
}
