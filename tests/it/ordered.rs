//! Per-key order with several batches in flight (issue 38), through the real binary: 100 keys
//! updated 20 times each (one transaction per update), `maxInFlight` 8, a receiver answering after
//! 50 ms on loopback. Every key's versions are first delivered in source order, nothing is lost, and
//! the checkpoint is at the end; `batch.order: "none"` still delivers everything.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::{AppRoot, Receiver, run_dbtrigger};
use crate::logical::{drop_slot, logical_database};
use crate::services::postgres;
use crate::sources::execute;

const KEYS: i64 = 100;
const VERSIONS: i64 = 20;
const DELAY: Duration = Duration::from_millis(50);

/// (key, version) of every event, in the order deliveries reached the receiver.
fn arrivals(receiver: &Receiver, logical: bool) -> Vec<(i64, i64)> {
    let mut received = receiver.acknowledged();
    received.sort_by_key(|received| received.at);
    received
        .iter()
        .flat_map(|received| received.envelope["events"].as_array().unwrap().clone())
        .filter_map(|event| {
            let row = &event["row"];
            let row = if logical { &row["new"] } else { row };
            Some((row.get("id")?.as_i64()?, row.get("qty")?.as_i64()?))
        })
        .collect()
}

/// Each key's versions in the order they were first delivered (a redelivery repeats an earlier
/// one and is left out).
fn first_deliveries(arrivals: &[(i64, i64)]) -> BTreeMap<i64, Vec<i64>> {
    let mut seen = HashSet::new();
    let mut keys: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for (key, version) in arrivals {
        if seen.insert((*key, *version)) {
            keys.entry(*key).or_default().push(*version);
        }
    }
    keys
}

fn out_of_order(keys: &BTreeMap<i64, Vec<i64>>) -> Vec<i64> {
    keys.iter()
        .filter(|(_, versions)| versions.windows(2).any(|pair| pair[0] >= pair[1]))
        .map(|(key, _)| *key)
        .collect()
}

/// Keys whose deliveries overlapped at the receiver: a delivery holding the key arrived before the
/// one before it was answered (each is answered `DELAY` after it arrives).
fn overlapping(receiver: &Receiver, logical: bool) -> Vec<i64> {
    let mut received = receiver.acknowledged();
    received.sort_by_key(|received| received.at);
    let mut last_arrival: BTreeMap<i64, std::time::Instant> = BTreeMap::new();
    let mut overlapping = std::collections::BTreeSet::new();
    for delivery in &received {
        let keys: HashSet<i64> = delivery.envelope["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|event| {
                let row = &event["row"];
                let row = if logical { &row["new"] } else { row };
                row.get("id")?.as_i64()
            })
            .collect();
        for key in keys {
            if let Some(before) = last_arrival.insert(key, delivery.at)
                && delivery.at.duration_since(before) < DELAY
            {
                overlapping.insert(key);
            }
        }
    }
    overlapping.into_iter().collect()
}

fn updates(round: std::ops::Range<i64>) -> String {
    let mut sql = Vec::new();
    for version in round {
        for key in 1..=KEYS {
            sql.push(format!("UPDATE items SET qty = {version}, version = nextval('versions') WHERE id = {key}"));
        }
    }
    sql.join(";\n")
}

fn app(directory: &std::path::Path, source: Value, receiver: &Receiver, order: Option<&str>) -> AppRoot {
    // Unordered, batches of 100 put a key's next version in the next batch, in flight with it.
    let size = if order == Some("none") { 100 } else { 10 };
    let mut batch = json!({"size": size, "maxInFlight": 8, "commitIntervalMs": 0});
    if let Some(order) = order {
        batch["order"] = json!(order);
    }
    AppRoot::write(
        directory,
        json!({"source": source, "batch": batch, "sink": {"type": "webhook", "url": receiver.url},
               "state": {"connection": "STATE"}}),
    )
}

fn settings(app: &AppRoot, url: &str) -> Vec<(String, String)> {
    vec![
        ("FEED_DB".to_string(), url.to_string()),
        ("STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ]
}

const TABLE: &str = "CREATE SEQUENCE versions;\n\
     CREATE TABLE items (id BIGINT PRIMARY KEY, qty BIGINT NOT NULL, version BIGINT NOT NULL DEFAULT nextval('versions'))";

async fn logical_run(order: Option<&str>) -> (BTreeMap<i64, Vec<i64>>, Vec<i64>, Value) {
    let (url, slot) = logical_database(TABLE, "items").await;
    execute(&url, "INSERT INTO items (id, qty) SELECT g, 0 FROM generate_series(1, 100) g").await;
    execute(&url, &updates(1..VERSIONS)).await;
    let receiver = Receiver::start().await;
    receiver.set_delay(DELAY);
    let directory = tempfile::tempdir().unwrap();
    let source = json!({"kind": "logical", "connection": "FEED_DB", "slot": slot, "publication": "feed"});
    let app = app(directory.path(), source, &receiver, order);
    let settings = settings(&app, &url);
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    let document = app.state_document().await.unwrap();
    drop_slot(&url, &slot).await;
    (first_deliveries(&arrivals(&receiver, true)), overlapping(&receiver, true), document)
}

/// The logical source: every key's 20 versions (the insert and 19 updates) first delivered in
/// commit order, none lost, the checkpoint at the last change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logical_keys_arrive_in_commit_order_with_eight_batches_in_flight() {
    let (keys, overlapping, document) = logical_run(None).await;
    assert_eq!(keys.len() as i64, KEYS);
    assert!(overlapping.is_empty(), "keys in two deliveries at once: {overlapping:?}");
    for (key, versions) in &keys {
        assert_eq!(
            versions,
            &(0..VERSIONS).collect::<Vec<_>>(),
            "key {key}: versions first delivered out of order or lost"
        );
    }
    assert!(out_of_order(&keys).is_empty());
    assert!(document["checkpoint"].is_object(), "{document}");
    assert_eq!(
        document["stats"]["rows_delivered"].as_u64().map(|rows| rows >= (KEYS * VERSIONS) as u64),
        Some(true),
        "{document}"
    );
}

/// `batch.order: "none"` is today's window: everything still arrives at least once, and keys do
/// travel in deliveries in flight at the same time (the check the ordered tests pass has teeth).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logical_unordered_window_still_delivers_everything() {
    let (keys, overlapping, _) = logical_run(Some("none")).await;
    assert_eq!(keys.len() as i64, KEYS);
    // What the ordered window prevents: a key in two deliveries the receiver handles at once.
    eprintln!(
        "unordered window: {} of {KEYS} keys in two deliveries at once, {} first delivered out of commit order",
        overlapping.len(),
        out_of_order(&keys).len()
    );
    assert!(!overlapping.is_empty(), "the check above sees overlap when there is some");
    for (key, versions) in &keys {
        let mut sorted = versions.clone();
        sorted.sort();
        assert_eq!(sorted, (0..VERSIONS).collect::<Vec<_>>(), "key {key} lost a version");
    }
}

/// PostgreSQL polling (cursor `version`, from a sequence each update takes): the updates run
/// while ticks deliver, so a key comes again later in a tick; every key's versions are first
/// delivered in cursor order and each key's last version arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_keys_arrive_in_cursor_order_with_eight_batches_in_flight() {
    let url = postgres().fresh_database().await;
    execute(&url, TABLE).await;
    execute(&url, "INSERT INTO items (id, qty) SELECT g, 0 FROM generate_series(1, 100) g").await;
    let receiver = Receiver::start().await;
    receiver.set_delay(DELAY);
    let directory = tempfile::tempdir().unwrap();
    let source = json!({"connection": "FEED_DB", "table": "items", "cursor": "version",
                        "pk": ["id"], "columns": ["id", "qty", "version"]});
    let app = app(directory.path(), source, &receiver, None);
    let settings = settings(&app, &url);
    let writer = {
        let url = url.clone();
        tokio::spawn(async move {
            for round in 0..((VERSIONS - 1) / 2) {
                execute(&url, &updates(1 + round * 2..3 + round * 2)).await;
            }
            execute(&url, &updates(VERSIONS - 1..VERSIONS)).await;
        })
    };
    loop {
        let finished = writer.is_finished();
        let (ok, stdout, stderr) = tokio::task::block_in_place(|| run_dbtrigger(&app, &settings, &["tick", "orders"]));
        assert!(ok, "{stdout}{stderr}");
        if finished {
            break;
        }
    }
    writer.await.unwrap();
    let keys = first_deliveries(&arrivals(&receiver, false));
    let overlapping = overlapping(&receiver, false);
    assert!(overlapping.is_empty(), "keys in two deliveries at once: {overlapping:?}");
    assert_eq!(keys.len() as i64, KEYS);
    assert!(out_of_order(&keys).is_empty(), "keys out of order: {:?}", out_of_order(&keys));
    // The ticks saw keys again as they were updated (not only each key's last version).
    let versions: usize = keys.values().map(Vec::len).sum();
    eprintln!("polling: {versions} versions first delivered for {KEYS} keys");
    assert!(versions > 2 * KEYS as usize, "{versions} versions: the updates did not overlap the ticks");
    for (key, versions) in &keys {
        assert_eq!(versions.last(), Some(&(VERSIONS - 1)), "key {key}: its last version was lost");
    }
    let document = app.state_document().await.unwrap();
    assert!(document["checkpoint"].is_object(), "{document}");
}
