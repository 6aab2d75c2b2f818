//! End-to-end throughput: rows per second from a table to a webhook receiver on loopback, through
//! a real tick (keyset fetch, JSON envelopes, HTTP POST, checkpoint commits by CAS), against a raw
//! baseline in the same run: the same keyset queries and the same POSTs with no state at all.
//!
//! Run: `cargo bench --bench throughput` (starts Azurite like the tests, for the blob-state run).

#[path = "../tests/it/services.rs"]
mod services;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use axum::routing::post;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::tick::{Poller, StopReason, SystemClock, TickOutcome};
use serde_json::{Value, json};

const ROWS: i64 = 100_000;
const BATCH: i64 = 500;

async fn receiver() -> (String, Arc<AtomicU64>) {
    let received = Arc::new(AtomicU64::new(0));
    let counter = received.clone();
    let router = axum::Router::new().route(
        "/hook",
        post(move |body: axum::Json<Value>| {
            let counter = counter.clone();
            async move {
                let events = body["events"].as_array().map(Vec::len).unwrap_or(0) as u64;
                counter.fetch_add(events, Ordering::SeqCst);
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, received)
}

async fn table(path: &std::path::Path) -> String {
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, status TEXT, total REAL, note TEXT);
         WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < 100000)
         INSERT INTO orders SELECT x, x / 3, 'paid', x * 1.5, 'order number ' || x FROM g;
         CREATE INDEX orders_seek ON orders (version, id);",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    format!("sqlite://{}", path.display())
}

/// The baseline: keyset pages and POSTs, nothing else.
async fn raw(database: &str, hook: &str) -> f64 {
    let pool = sqlx::SqlitePool::connect(database).await.unwrap();
    let client = reqwest::Client::new();
    let started = Instant::now();
    let (mut version, mut id) = (-1i64, -1i64);
    let mut total = 0;
    loop {
        let rows: Vec<(i64, i64, String, f64, String)> = sqlx::query_as(
            "SELECT id, version, status, total, note FROM orders WHERE (version, id) > (?, ?) ORDER BY version, id LIMIT ?",
        )
        .bind(version)
        .bind(id)
        .bind(BATCH)
        .fetch_all(&pool)
        .await
        .unwrap();
        if rows.is_empty() {
            break;
        }
        let events: Vec<Value> = rows
            .iter()
            .map(|(row_id, row_version, status, amount, note)| {
                json!({"cursor": row_version, "pk": {"id": row_id},
                       "row": {"id": row_id, "version": row_version, "status": status, "total": amount, "note": note}})
            })
            .collect();
        client.post(hook).json(&json!({"events": events})).send().await.unwrap().error_for_status().unwrap();
        total += rows.len();
        let last = rows.last().unwrap();
        (version, id) = (last.1, last.0);
    }
    assert_eq!(total as i64, ROWS);
    total as f64 / started.elapsed().as_secs_f64()
}

async fn dbtrigger(database: &str, hook: &str, state: &str, max_in_flight: usize) -> f64 {
    let directory = tempfile::tempdir().unwrap();
    let root = directory.path().join("app");
    std::fs::create_dir_all(root.join("orders")).unwrap();
    let function = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 * * * * *"}],
        "poller": {
            "source": {"connection": "DB", "table": "orders", "cursor": "version", "pk": ["id"]},
            "batch": {"size": BATCH, "maxInFlight": max_in_flight},
            "sink": {"type": "webhook", "url": hook},
            "state": {"connection": "STATE", "container": format!("b{}", uuid::Uuid::new_v4().simple())}
        }
    });
    std::fs::write(root.join("orders/function.json"), function.to_string()).unwrap();
    let state =
        if state == "file" { format!("file:{}", directory.path().join("state").display()) } else { state.to_string() };
    let settings = Settings::from_pairs([("DB", database), ("STATE", state.as_str())]);
    let config = PollerConfig::load(&root, "orders", &settings, None).unwrap();
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink = dbtrigger::sink::open(&config.sink).unwrap();
    let store = dbtrigger::store::open(&config.state).unwrap();
    let poller = Poller::new(config, source, sink, store, Arc::new(SystemClock), "bench".into());
    let started = Instant::now();
    let mut total = 0;
    loop {
        match poller.tick().await.unwrap() {
            TickOutcome::Delivered { rows, stop: StopReason::CaughtUp, .. } => {
                total += rows;
                break;
            }
            TickOutcome::Delivered { rows, .. } => total += rows,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(total as i64, ROWS);
    total as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let directory = tempfile::tempdir().unwrap();
    let database = table(&directory.path().join("orders.db")).await;
    let (hook, received) = receiver().await;
    let raw_rate = raw(&database, &hook).await;
    let file_rate = dbtrigger(&database, &hook, "file", 1).await;
    let blob_rate = dbtrigger(&database, &hook, &services::azurite().connection_string(), 1).await;
    let windowed_rate = dbtrigger(&database, &hook, &services::azurite().connection_string(), 4).await;
    assert_eq!(received.load(Ordering::SeqCst) as i64, 4 * ROWS);
    println!("throughput, {ROWS} SQLite rows to a loopback webhook, batches of {BATCH}");
    println!("{:<40} {:>12} {:>8}", "path", "rows/s", "ratio");
    println!("{:<40} {:>12.0} {:>8.2}", "raw: keyset query + POST, no state", raw_rate, 1.0);
    println!("{:<40} {:>12.0} {:>8.2}", "dbtrigger tick, file state", file_rate, file_rate / raw_rate);
    println!("{:<40} {:>12.0} {:>8.2}", "dbtrigger tick, blob state (Azurite)", blob_rate, blob_rate / raw_rate);
    println!("{:<40} {:>12.0} {:>8.2}", "  the same, maxInFlight 4", windowed_rate, windowed_rate / raw_rate);
}
