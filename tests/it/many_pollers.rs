//! An app of many pollers invoked at once through the real binary, as the host fires their timers
//! together: the app root, the invocations, and what the fleet and budget tests read back.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Value, json};

use crate::harness::{Handler, host_fixtures};

/// Writes an app root under `directory` with `count` pollers `{prefix}0`, `{prefix}1`…, the poller
/// section of each made by `poller(index)` and checked against the schema.
pub fn write_app(directory: &Path, prefix: &str, count: usize, poller: impl Fn(usize) -> Value) -> PathBuf {
    let root = directory.join("app");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("host.json"), r#"{"version": "2.0", "functionTimeout": "00:10:00"}"#).unwrap();
    for index in 0..count {
        let function = json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
            "poller": poller(index)
        });
        crate::schema::assert_valid_function_json(&function);
        std::fs::create_dir_all(root.join(format!("{prefix}{index}"))).unwrap();
        std::fs::write(
            root.join(format!("{prefix}{index}/function.json")),
            serde_json::to_vec_pretty(&function).unwrap(),
        )
        .unwrap();
    }
    root
}

/// Invokes the pollers `{prefix}0`… `{prefix}{count - 1}` all at once with a normal timer payload;
/// each must answer 200. Returns each tick's summary (its first log line), in poller order.
pub async fn invoke_all(handler: &Arc<Handler>, prefix: &str, count: usize) -> Vec<String> {
    let mut invocations = Vec::new();
    for index in 0..count {
        let handler = handler.clone();
        let function = format!("{prefix}{index}");
        invocations.push(tokio::spawn(async move { handler.invoke(&function, host_fixtures()[2].1).await }));
    }
    let mut lines = Vec::new();
    for invocation in invocations {
        let (status, _, body) = invocation.await.unwrap();
        assert_eq!(status, 200, "{body}");
        lines.push(body["Logs"][0].as_str().unwrap().to_string());
    }
    lines
}

/// Adds the key `id` of every event of a delivered envelope to its poller's set.
pub fn record_ids(by_poller: &mut BTreeMap<String, BTreeSet<i64>>, envelope: &Value) {
    let poller = envelope["poller"].as_str().unwrap().to_string();
    for event in envelope["events"].as_array().unwrap() {
        by_poller.entry(poller.clone()).or_default().insert(event["pk"]["id"].as_i64().unwrap());
    }
}

/// The summaries whose `field` (a `…_wait_ms` of the summary line) is not 0: at least one, and each
/// of them saying `why` it waited.
pub fn assert_some_waited<'a>(lines: &'a [String], field: &str, why: &str, context: &str) -> Vec<&'a String> {
    let waited: Vec<&String> = lines.iter().filter(|line| !line.contains(&format!(" {field}=0 "))).collect();
    assert!(!waited.is_empty(), "{context}: no tick waited ({field})");
    assert!(waited.iter().all(|line| line.contains(why)), "{context}: {waited:?}");
    waited
}
