//! The ordered window's speed-up (issue 38): 100 keys each updated 20 times, a receiver answering
//! after 50 ms on loopback (no proxies), batches of 10. `maxInFlight` 1, then 8 with the ordered
//! window (`batch.order: "key"`, the default), then 8 unordered (`"none"`), in the same run, on:
//!
//! - a logical source: a table of 100 rows, inserted in one transaction and updated 19 times each,
//!   one transaction per update (2,000 changes; each run reads a fresh slot);
//! - a polling source: an append-only table of the same 2,000 changes (`seq` the cursor, `id` the key,
//!   `batch.orderKey: ["item"]`), as an outbox would hold them.
//!
//! Each ordered run checks that every key's 20 versions were first delivered in source order; the
//! unordered run counts the keys that were not.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dbtrigger::tick::{Poller, SystemClock};
use serde_json::{Value, json};
use tokio::net::TcpListener;

use super::common::{self, env_number, median};
use super::services;

const KEYS: i64 = 100;
const VERSIONS: i64 = 20;
const DELAY: Duration = Duration::from_millis(50);
const BATCH: usize = 10;

/// What the receiver saw: each event's (item, qty) in arrival order, the deliveries in flight per
/// key, and the keys that were in two deliveries at once.
#[derive(Default)]
struct Seen {
    arrivals: Vec<(i64, i64)>,
    in_flight: BTreeMap<i64, usize>,
    overlapped: HashSet<i64>,
}

type Shared = Arc<Mutex<Seen>>;

/// A receiver that records each event's (item, qty) as a delivery arrives and answers 50 ms later.
async fn receiver() -> (String, Shared) {
    let seen: Shared = Arc::default();
    let recorded = seen.clone();
    let router = axum::Router::new()
        .route(
            "/hook",
            axum::routing::post(move |body: axum::body::Bytes| {
                let recorded = recorded.clone();
                async move {
                    let value: Value = serde_json::from_slice(&body).unwrap_or_default();
                    let events = value["events"].as_array().cloned().unwrap_or_default();
                    let mut keys = HashSet::new();
                    {
                        let mut seen = recorded.lock().unwrap();
                        for event in events {
                            let row = &event["row"];
                            // A logical source's row holds the columns under `new`.
                            let row = if row["new"].is_object() { &row["new"] } else { row };
                            let key = row["item"].as_i64().unwrap();
                            seen.arrivals.push((key, row["qty"].as_i64().unwrap()));
                            keys.insert(key);
                        }
                        for key in &keys {
                            let count = seen.in_flight.entry(*key).or_default();
                            *count += 1;
                            if *count > 1 {
                                seen.overlapped.insert(*key);
                            }
                        }
                    }
                    tokio::time::sleep(DELAY).await;
                    let mut seen = recorded.lock().unwrap();
                    for key in &keys {
                        *seen.in_flight.get_mut(key).unwrap() -= 1;
                    }
                    "{}"
                }
            }),
        )
        .layer(axum::extract::DefaultBodyLimit::disable());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (format!("http://127.0.0.1:{port}/hook"), seen)
}

/// Keys whose versions were not first delivered in source order (0, 1, … 19), and whether every
/// key's every version arrived.
fn keys_out_of_order(arrivals: &[(i64, i64)]) -> (usize, bool) {
    let mut seen = HashSet::new();
    let mut keys: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for (key, version) in arrivals {
        if seen.insert((*key, *version)) {
            keys.entry(*key).or_default().push(*version);
        }
    }
    let complete = keys.len() as i64 == KEYS && keys.values().all(|versions| versions.len() as i64 == VERSIONS);
    let out_of_order = keys.values().filter(|versions| versions.windows(2).any(|pair| pair[0] > pair[1])).count();
    (out_of_order, complete)
}

async fn execute(url: &str, sql: &str) {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string())).execute(&pool).await.unwrap();
    pool.close().await;
}

/// A database with the logical source's table, its 2,000 changes waiting in a fresh slot.
async fn logical_feed() -> (String, String) {
    let url = services::postgres().fresh_database().await;
    let slot = format!("s_{}", url.rsplit('/').next().unwrap().trim_start_matches("t_"));
    execute(
        &url,
        "CREATE TABLE items (item BIGINT PRIMARY KEY, qty BIGINT NOT NULL); CREATE PUBLICATION feed FOR TABLE items",
    )
    .await;
    // A slot is made outside a transaction that wrote.
    execute(&url, &format!("SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")).await;
    execute(&url, &format!("INSERT INTO items SELECT g, 0 FROM generate_series(1, {KEYS}) g")).await;
    let mut updates = String::new();
    for version in 1..VERSIONS {
        for key in 1..=KEYS {
            updates.push_str(&format!("BEGIN; UPDATE items SET qty = {version} WHERE item = {key}; COMMIT;\n"));
        }
    }
    execute(&url, &updates).await;
    (url, slot)
}

/// A database with the polling source's append-only table of the same 2,000 changes.
async fn polling_feed() -> String {
    let url = services::postgres().fresh_database().await;
    execute(
        &url,
        &format!(
            "CREATE TABLE changes (id BIGINT PRIMARY KEY, seq BIGINT NOT NULL, item BIGINT NOT NULL, qty BIGINT NOT NULL);
             INSERT INTO changes (id, seq, item, qty)
                 SELECT n, n, i, v FROM (SELECT row_number() OVER (ORDER BY v, i) AS n, v, i
                     FROM generate_series(0, {last}) v, generate_series(1, {KEYS}) i) numbered;
             CREATE INDEX changes_seek ON changes (seq, id);
             ANALYZE changes;",
            last = VERSIONS - 1
        ),
    )
    .await;
    url
}

#[derive(Clone, Copy)]
enum Kind {
    Logical,
    Polling,
}

/// One catch-up of the whole feed: rows a second, the keys first delivered out of order and the
/// keys in two deliveries at once (asserting every version arrived, and for the ordered window
/// that both are none).
async fn one_run(kind: Kind, window: usize, order: &str) -> (f64, usize, usize) {
    let (hook, seen) = receiver().await;
    let batch = json!({"size": BATCH, "maxInFlight": window, "order": order});
    let (url, slot, source, batch) = match kind {
        Kind::Logical => {
            let (url, slot) = logical_feed().await;
            let source = json!({"kind": "logical", "connection": "DB", "slot": slot, "publication": "feed"});
            (url, Some(slot), source, batch)
        }
        Kind::Polling => {
            let url = polling_feed().await;
            let source = json!({"connection": "DB", "table": "changes", "cursor": "seq", "pk": ["id"],
                                "lateArrivals": null});
            let mut batch = batch;
            if order == "key" {
                batch["orderKey"] = json!(["item"]);
            }
            (url, None, source, batch)
        }
    };
    let poller = json!({"source": source, "batch": batch, "sink": {"type": "webhook", "url": hook},
                        "state": {"connection": "STATE"}});
    let (_directory, config) = common::orders_config(poller, &url);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink = dbtrigger::sink::open(&config.sink).unwrap();
    let (store, _) = dbtrigger::store::open(&config.state).unwrap();
    let poller = Poller::new(config, source, sink, store, Arc::new(SystemClock), "bench".into());
    let (total, seconds) = common::catch_up(&poller).await;
    drop(poller);
    if let Some(slot) = slot {
        execute(&url, &format!("SELECT pg_drop_replication_slot('{slot}')")).await;
    }
    assert_eq!(total as i64, KEYS * VERSIONS, "every change delivered once");
    let seen = seen.lock().unwrap();
    let (out_of_order, complete) = keys_out_of_order(&seen.arrivals);
    assert!(complete, "a version was lost");
    if order == "key" {
        assert_eq!(out_of_order, 0, "the ordered window delivered a key out of order");
        assert!(seen.overlapped.is_empty(), "the ordered window sent a key in two deliveries at once");
    }
    (total as f64 / seconds, out_of_order, seen.overlapped.len())
}

pub async fn speed_up() {
    let rounds = env_number("DBTRIGGER_BENCH_ROUNDS", 3).clamp(1, 3);
    println!(
        "\nordered window: {KEYS} keys updated {VERSIONS} times, batch {BATCH}, a receiver answering in 50 ms; \
         medians of {rounds} rounds"
    );
    println!(
        "{:<8} {:>10} {:>10} {:>9} {:>12} {:>9} {:>22}",
        "source", "ordered 1", "ordered 8", "speed-up", "unordered 8", "speed-up", "unordered: keys in 2/late"
    );
    for (name, kind) in [("logical", Kind::Logical), ("polling", Kind::Polling)] {
        let (mut one, mut eight, mut unordered) = (Vec::new(), Vec::new(), Vec::new());
        let (mut overlapped, mut disorder) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            one.push(one_run(kind, 1, "key").await.0);
            eight.push(one_run(kind, 8, "key").await.0);
            let (rate, late, overlapping) = one_run(kind, 8, "none").await;
            unordered.push(rate);
            disorder.push(late as f64);
            overlapped.push(overlapping as f64);
        }
        let (one, eight, unordered) = (median(one), median(eight), median(unordered));
        println!(
            "{name:<8} {one:>10.0} {eight:>10.0} {:>8.2}× {unordered:>12.0} {:>8.2}× {:>22}",
            eight / one,
            unordered / one,
            format!("{:.0} / {:.0}", median(overlapped), median(disorder))
        );
    }
    println!("(rows/s; the ordered runs checked: every key's versions first delivered in order, never two at once)");
}
