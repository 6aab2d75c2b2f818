//! Rows per second of one poller into one Storage queue on Azurite (issue 27, docs/scale-out.md),
//! `messagePer: batch` and `messagePer: row`, through real ticks (SQLite keyset reads, envelopes,
//! base64, the SDK's sends, checkpoints in a memory store), against a **raw baseline** in the same
//! run: the same messages (taken off dbtrigger's queue afterwards) sent to a fresh queue by the
//! Azure SDK directly, as many at once as dbtrigger has in flight (`maxInFlight` 1: one batch
//! message at a time; a batch's row messages 16 at a time), with no reads and no state.
//!
//! Run: `cargo bench --bench queue` (starts Azurite like the tests). Three rounds per mode, medians.

#[path = "../tests/it/services.rs"]
mod services;

use std::sync::Arc;
use std::time::{Duration, Instant};

use azure_storage_queue::models::{QueueClientReceiveMessagesOptions, QueueMessage};
use azure_storage_queue::{QueueClient, QueueClientOptions};
use dbtrigger::azure::{RequestCounter, StorageConnection, client_options};
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, SystemClock, TickOutcome};
use futures::StreamExt;
use serde_json::json;

const BATCH: i64 = 100;

fn client(queue: &str) -> QueueClient {
    let connection = StorageConnection::parse_connection_string(&services::azurite().connection_string()).unwrap();
    let mut url = connection.queue_endpoint.clone();
    url.path_segments_mut().unwrap().push(queue);
    let options = QueueClientOptions {
        client_options: client_options(&connection, Arc::new(RequestCounter::default())),
        ..Default::default()
    };
    QueueClient::new(url, None, Some(options)).unwrap()
}

fn queue_name() -> String {
    format!("bench{}", &uuid::Uuid::new_v4().simple().to_string()[..16])
}

async fn drain(client: &QueueClient) -> Vec<String> {
    let mut texts = Vec::new();
    loop {
        let options = QueueClientReceiveMessagesOptions {
            number_of_messages: Some(32),
            visibility_timeout: Some(600),
            ..Default::default()
        };
        let items =
            client.receive_messages(Some(options)).await.unwrap().into_model().unwrap().items.unwrap_or_default();
        if items.is_empty() {
            return texts;
        }
        texts.extend(items.into_iter().map(|message| message.message_text.unwrap_or_default()));
    }
}

/// One dbtrigger catch-up of the whole table into a fresh queue: (rows/s, the queue).
async fn dbtrigger_run(directory: &std::path::Path, database: &str, per: &str, rows: i64) -> (f64, String) {
    let queue = queue_name();
    let root = directory.join(format!("app-{queue}"));
    std::fs::create_dir_all(root.join("orders")).unwrap();
    std::fs::write(root.join("host.json"), br#"{"version": "2.0"}"#).unwrap();
    let function = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "*/10 * * * * *"}],
        "poller": {
            "source": {"connection": "DB", "table": "orders", "cursor": "version", "pk": ["id"]},
            "batch": {"size": BATCH, "maxInFlight": 1},
            "sink": {"type": "queue", "connection": "QUEUES", "queueName": queue, "messagePer": per},
            "state": {"connection": "STATE"}
        }
    });
    std::fs::write(root.join("orders/function.json"), serde_json::to_vec(&function).unwrap()).unwrap();
    let settings = Settings::from_pairs([
        ("DB".to_string(), database.to_string()),
        ("STATE".to_string(), "file:unused".to_string()),
        ("QUEUES".to_string(), services::azurite().connection_string()),
    ]);
    let config = PollerConfig::load(&root, "orders", &settings, None).unwrap();
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink = dbtrigger::sink::open(&config.sink).unwrap();
    let poller = Poller::new(config, source, sink, Arc::new(MemoryStore::new()), Arc::new(SystemClock), "bench".into());
    // The queue exists before the clock starts, as it would in production.
    client(&queue).create(None).await.unwrap();
    let started = Instant::now();
    let mut delivered = 0;
    while delivered < rows {
        match poller.tick().await.unwrap() {
            TickOutcome::Delivered { rows, .. } => delivered += rows as i64,
            other => panic!("{other:?}"),
        }
    }
    (rows as f64 / started.elapsed().as_secs_f64(), queue)
}

/// The same messages sent by the SDK directly, `at_once` in flight, in groups of `group`
/// (a batch's messages) one group after the other.
async fn raw_run(texts: &[String], group: usize, at_once: usize, rows: i64) -> f64 {
    let queue = client(&queue_name());
    queue.create(None).await.unwrap();
    let started = Instant::now();
    for chunk in texts.chunks(group) {
        let mut sends = futures::stream::iter(chunk.iter().map(|text| {
            let queue = &queue;
            async move {
                let message = QueueMessage { message_text: Some(text.clone()) };
                queue.send_message(message.try_into().unwrap(), None).await.unwrap();
            }
        }))
        .buffer_unordered(at_once);
        while sends.next().await.is_some() {}
    }
    rows as f64 / started.elapsed().as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    values[values.len() / 2]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("orders.db");
        let connection = rusqlite::Connection::open(&path).unwrap();
        connection
            .execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY, note TEXT, version INTEGER NOT NULL)")
            .unwrap();
        println!("| messagePer | rows | messages | dbtrigger rows/s | raw SDK rows/s | ratio |");
        println!("|---|---|---|---|---|---|");
        let mut inserted = 0;
        for (per, rows) in [("batch", 10_000_i64), ("row", 1_000_i64)] {
            // The table holds exactly `rows` rows for this mode.
            connection.execute("DELETE FROM orders", []).unwrap();
            let transaction = connection.unchecked_transaction().unwrap();
            for id in 1..=rows {
                transaction
                    .execute(
                        "INSERT INTO orders (id, note, version) VALUES (?1, ?2, ?3)",
                        rusqlite::params![id, format!("order {id}, a short note"), inserted + id / 3],
                    )
                    .unwrap();
            }
            transaction.commit().unwrap();
            inserted += rows;
            let database = format!("sqlite://{}", path.display());
            let (group, at_once) = if per == "batch" { (1, 1) } else { (BATCH as usize, 16) };
            let (mut ours, mut raws, mut messages) = (Vec::new(), Vec::new(), 0);
            for _round in 0..3 {
                let (rate, queue) = dbtrigger_run(directory.path(), &database, per, rows).await;
                let texts = drain(&client(&queue)).await;
                messages = texts.len();
                ours.push(rate);
                raws.push(raw_run(&texts, group, at_once, rows).await);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let (ours, raw) = (median(ours), median(raws));
            println!("| {per} | {rows} | {messages} | {ours:.0} | {raw:.0} | {:.2} |", ours / raw);
        }
    });
}
