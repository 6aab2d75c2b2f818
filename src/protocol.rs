//! What the Functions host posts to the handler (see the host protocol reference): the invocation
//! envelope, a timer's data, an HTTP request's query. Shared by the handler and the app.
//!
//! What the host posts for a timer invocation. Everything about the timer is informational and
//! parsed leniently (first runs carry `0001-01-01T00:00:00` with no offset; `ScheduleStatus` may be
//! null); only the envelope's shape is checked.

use std::collections::BTreeMap;

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

    /// `IsPastDue` of the first timer binding, if the host sent one.
    pub fn timer_is_past_due(&self) -> bool {
        self.data.values().filter_map(|binding| binding.get("IsPastDue")).any(|flag| flag.as_bool() == Some(true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_four_host_fixtures_parse() {
        let fixtures = [
            (include_str!("../tests/fixtures/host/timer_first_run.json"), false),
            (include_str!("../tests/fixtures/host/timer_no_monitor.json"), false),
            (include_str!("../tests/fixtures/host/timer_normal.json"), false),
            (include_str!("../tests/fixtures/host/timer_past_due.json"), true),
        ];
        for (text, past_due) in fixtures {
            let request = InvocationRequest::parse(text.as_bytes()).unwrap();
            assert!(request.data.contains_key("timer"));
            assert_eq!(request.timer_is_past_due(), past_due);
        }
    }

    #[test]
    fn the_http_fixture_gives_its_query() {
        let text = include_str!("../tests/fixtures/host/http_status.json");
        let request = InvocationRequest::parse(text.as_bytes()).unwrap();
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
