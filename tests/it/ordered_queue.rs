//! The order a Storage queue consumer sees for one key (issue 38), through the real binary and
//! Azurite: the logical source, 40 keys updated 10 times each (one transaction per update),
//! `maxInFlight` 8 with the ordered window (the default).
//!
//! What holds (docs/receivers.md, "Order on a queue"): a key's events are enqueued batch after
//! batch in commit order, so with `messagePer: "batch"` the queue holds a key's versions in commit
//! order; with `messagePer: "row"` a batch's messages are sent 16 at a time, so within a batch the
//! queue may hold them in another order; either way every event carries its position, `cursor`
//! then `pk`, which grows in source order within a key, and a consumer restores the order from it.

use std::collections::{BTreeMap, HashSet};

use serde_json::{Value, json};

use crate::harness::{AppRoot, run_dbtrigger};
use crate::logical::{drop_slot, logical_database};
use crate::queue::{drain, queue_name};
use crate::services::azurite;
use crate::sources::execute;

const KEYS: i64 = 40;
const VERSIONS: i64 = 10;
const TABLE: &str = "CREATE TABLE items (id BIGINT PRIMARY KEY, qty BIGINT NOT NULL)";

/// One event as a consumer reads it: (key, version, (cursor, ordinal), event id).
type Seen = (i64, i64, (i64, i64), String);

fn seen(event: &Value) -> Seen {
    let new = &event["row"]["new"];
    (
        new["id"].as_i64().unwrap(),
        new["qty"].as_i64().unwrap(),
        (event["cursor"].as_i64().unwrap(), event["pk"]["ordinal"].as_i64().unwrap()),
        event["event_id"].as_str().unwrap().to_string(),
    )
}

/// Runs the feed into a fresh queue and returns every event in the order the queue handed it out.
async fn run(message_per: &str) -> Vec<Seen> {
    let (url, slot) = logical_database(TABLE, "items").await;
    execute(&url, &format!("INSERT INTO items (id, qty) SELECT g, 0 FROM generate_series(1, {KEYS}) g")).await;
    let mut updates = Vec::new();
    for version in 1..VERSIONS {
        for key in 1..=KEYS {
            updates.push(format!("UPDATE items SET qty = {version} WHERE id = {key}"));
        }
    }
    execute(&url, &updates.join(";\n")).await;
    let queue = queue_name();
    let directory = tempfile::tempdir().unwrap();
    let app = AppRoot::write(
        directory.path(),
        json!({
            "source": {"kind": "logical", "connection": "FEED_DB", "slot": slot, "publication": "feed"},
            "batch": {"size": 10, "maxInFlight": 8, "commitIntervalMs": 0},
            "sink": {"type": "queue", "connection": "QUEUES", "queueName": queue,
                     "messagePer": message_per, "messageEncoding": "none"},
            "state": {"connection": "STATE"}
        }),
    );
    let settings = vec![
        ("FEED_DB".to_string(), url.clone()),
        ("STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("QUEUES".to_string(), azurite().connection_string()),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];
    let (ok, stdout, stderr) = tokio::task::block_in_place(|| run_dbtrigger(&app, &settings, &["tick", "orders"]));
    assert!(ok, "{stdout}{stderr}");
    drop_slot(&url, &slot).await;
    let mut events = Vec::new();
    for text in drain(&queue).await {
        let message: Value = serde_json::from_str(&text).unwrap();
        match message["events"].as_array() {
            Some(batch) => events.extend(batch.iter().map(seen)),
            None => events.push(seen(&message)),
        }
    }
    events
}

/// Each key's events, first sightings only (a redelivery repeats an event id), in `events`' order.
fn per_key(events: &[Seen]) -> BTreeMap<i64, Vec<Seen>> {
    let mut ids = HashSet::new();
    let mut keys: BTreeMap<i64, Vec<Seen>> = BTreeMap::new();
    for event in events {
        if ids.insert(event.3.clone()) {
            keys.entry(event.0).or_default().push(event.clone());
        }
    }
    keys
}

/// What the docs tell a consumer to do: order a key's events by (`cursor`, `pk`); that order is
/// the key's commit order, every version present.
fn assert_restored(keys: &BTreeMap<i64, Vec<Seen>>) {
    assert_eq!(keys.len() as i64, KEYS);
    for (key, events) in keys {
        let mut restored = events.clone();
        restored.sort_by_key(|event| event.2);
        let versions: Vec<i64> = restored.iter().map(|event| event.1).collect();
        assert_eq!(versions, (0..VERSIONS).collect::<Vec<_>>(), "key {key}: (cursor, pk) is not its commit order");
    }
}

fn queue_order(keys: &BTreeMap<i64, Vec<Seen>>) -> usize {
    keys.values().filter(|events| events.windows(2).any(|pair| pair[0].1 > pair[1].1)).count()
}

/// `messagePer: "row"` (the default): restoring by (`cursor`, `pk`) gives every key's commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_consumer_restores_each_keys_commit_order_from_cursor_and_pk() {
    let keys = per_key(&run("row").await);
    eprintln!("messagePer row: {} of {KEYS} keys not in commit order as the queue handed them out", queue_order(&keys));
    assert_restored(&keys);
}

/// `messagePer: "batch"`: a key's events are enqueued batch after batch in commit order, so the
/// queue itself hands a key's versions out in commit order (one consumer reading in queue order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_messages_hold_each_keys_versions_in_commit_order_on_the_queue() {
    let keys = per_key(&run("batch").await);
    assert_eq!(queue_order(&keys), 0, "a key's versions left the queue out of commit order");
    assert_restored(&keys);
}
