//! Scale out, the Azure way (issue 27, docs/scale-out.md): several pollers deliver into one Storage
//! queue with `messagePer: batch`, through real ticks, and a consumer written as a queue-triggered
//! function would be (receive, process, delete) takes every message off with the Azure SDK. Per
//! poller, every row arrives and its rows come in (cursor, pk) order across its messages, in the
//! order the messages were enqueued.

use std::collections::BTreeMap;
use std::sync::Arc;

use azure_storage_queue::models::QueueClientReceiveMessagesOptions;
use azure_storage_queue::{QueueClient, QueueClientOptions};
use base64::Engine as _;
use dbtrigger::azure::{RequestCounter, StorageConnection, client_options};
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, SystemClock, TickOutcome};
use serde_json::{Value, json};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};

use crate::services::azurite;

const TABLES: [&str; 3] = ["orders", "invoices", "payments"];

/// The consumer of docs/scale-out.md: what a queue-triggered function does with one message.
/// The Functions host hands the function the message's text decoded from base64 (dbtrigger's
/// default `messageEncoding`); with `messagePer: batch` it is one envelope whose `events` are the
/// batch's rows in (cursor, pk) order.
fn handle_message(body: &[u8], applied: &mut BTreeMap<String, Vec<(i64, i64)>>) {
    let envelope: Value = serde_json::from_slice(body).expect("a batch message is one JSON envelope");
    let poller = envelope["poller"].as_str().expect("the envelope names its poller").to_string();
    assert!(envelope["batch_id"].is_string(), "{envelope}");
    for event in envelope["events"].as_array().expect("the envelope's events") {
        assert_eq!(event["op"], "upsert");
        assert!(event["event_id"].as_str().unwrap().starts_with("evt_"));
        let cursor = event["cursor"].as_i64().expect("an integer cursor");
        let id = event["pk"]["id"].as_i64().expect("the row's key");
        assert_eq!(event["row"]["version"], json!(cursor), "the row carries its cursor");
        applied.entry(poller.clone()).or_default().push((cursor, id));
    }
}

/// A queue trigger's loop, by hand: receive a few messages (hidden from other consumers for the
/// visibility timeout), handle each, then delete it; a message whose handling failed would not be
/// deleted and would come back. Returns once the queue is empty.
async fn consume(client: &QueueClient, applied: &mut BTreeMap<String, Vec<(i64, i64)>>) -> usize {
    let mut handled = 0;
    loop {
        let options = QueueClientReceiveMessagesOptions {
            number_of_messages: Some(16),
            visibility_timeout: Some(2),
            ..Default::default()
        };
        let received = client.receive_messages(Some(options)).await.expect("receiving").into_model().unwrap();
        let messages = received.items.unwrap_or_default();
        if messages.is_empty() {
            return handled;
        }
        for message in messages {
            let text = message.message_text.unwrap_or_default();
            let body = base64::engine::general_purpose::STANDARD.decode(text.trim()).expect("a base64 message");
            handle_message(&body, applied);
            client
                .delete_message(message.message_id.as_deref().unwrap(), message.pop_receipt.as_deref().unwrap(), None)
                .await
                .expect("deleting the handled message");
            handled += 1;
        }
    }
}

fn queue_client(queue: &str) -> QueueClient {
    let connection = StorageConnection::parse_connection_string(&azurite().connection_string()).unwrap();
    let mut url = connection.queue_endpoint.clone();
    url.path_segments_mut().unwrap().push(queue);
    let options = QueueClientOptions {
        client_options: client_options(&connection, Arc::new(RequestCounter::default())),
        ..Default::default()
    };
    QueueClient::new(url, None, Some(options)).unwrap()
}

/// `count` new rows of `table` from id `first`; the cursor (`version`) does not follow the key,
/// several rows share a value, and every value is above `floor`, so that the next tick sees them.
async fn insert(pool: &SqlitePool, table: &str, first: i64, count: i64, floor: i64) -> Vec<(i64, i64)> {
    let mut rows = Vec::new();
    let mut transaction = pool.begin().await.unwrap();
    for id in first..first + count {
        let version = floor + 1 + (id * 7) % 23;
        sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {table} (id, note, version) VALUES (?, ?, ?)")))
            .bind(id)
            .bind(format!("{table} {id}"))
            .bind(version)
            .execute(&mut *transaction)
            .await
            .unwrap();
        rows.push((version, id));
    }
    transaction.commit().await.unwrap();
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_pollers_into_one_queue_arrive_complete_and_in_order_per_poller() {
    let directory = tempfile::tempdir().unwrap();
    let database = directory.path().join("app.db");
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(SqliteConnectOptions::new().filename(&database).create_if_missing(true))
        .await
        .unwrap();
    let queue = format!("scale{}", &uuid::Uuid::new_v4().simple().to_string()[..16]);

    let root = directory.path().join("app");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("host.json"), br#"{"version": "2.0"}"#).unwrap();
    for table in TABLES {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {table} (id INTEGER PRIMARY KEY, note TEXT, version INTEGER NOT NULL)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let function = json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "*/10 * * * * *"}],
            "poller": {
                "source": {"connection": "APP_DB", "table": table, "cursor": "version", "pk": ["id"]},
                "batch": {"size": 7, "maxInFlight": 1},
                "sink": {"type": "queue", "connection": "QUEUES", "queueName": queue, "messagePer": "batch"},
                "state": {"connection": "APP_STATE"}
            }
        });
        crate::schema::assert_valid_function_json(&function);
        std::fs::create_dir_all(root.join(table)).unwrap();
        std::fs::write(root.join(table).join("function.json"), serde_json::to_vec(&function).unwrap()).unwrap();
    }
    let settings = Settings::from_pairs([
        ("APP_DB".to_string(), format!("sqlite://{}", database.display())),
        ("APP_STATE".to_string(), "file:unused".to_string()),
        ("QUEUES".to_string(), azurite().connection_string()),
    ]);
    let pollers: Vec<Poller> = TABLES
        .iter()
        .map(|table| {
            let config = PollerConfig::load(&root, table, &settings, None).unwrap();
            let source = dbtrigger::source::open(&config.source).unwrap();
            let sink = dbtrigger::sink::open(&config.sink).unwrap();
            Poller::new(config, source, sink, Arc::new(MemoryStore::new()), Arc::new(SystemClock), "it".into())
        })
        .collect();

    // Two rounds: rows, every poller ticks at once (the host fires one schedule's timers
    // together), more rows above the first round's cursors, every poller ticks again.
    let mut expected: BTreeMap<String, Vec<(i64, i64)>> = BTreeMap::new();
    for (round, (first, floor)) in [(1, 0), (60, 100)].into_iter().enumerate() {
        for (index, table) in TABLES.iter().enumerate() {
            let count = 40 + 5 * index as i64 + round as i64;
            let rows = insert(&pool, table, first, count, floor).await;
            expected.entry(table.to_string()).or_default().extend(rows);
        }
        let outcomes = futures::future::join_all(pollers.iter().map(|poller| poller.tick())).await;
        for outcome in outcomes {
            let outcome = outcome.unwrap();
            assert!(matches!(outcome, TickOutcome::Delivered { .. }), "{outcome:?}");
        }
    }
    for rows in expected.values_mut() {
        rows.sort_unstable();
    }

    let client = queue_client(&queue);
    let mut applied = BTreeMap::new();
    let handled = consume(&client, &mut applied).await;
    let batches: usize = expected.values().map(|rows| rows.len().div_ceil(7)).sum::<usize>() + 1;
    assert!(handled >= 6 * 3 && handled <= batches + 3, "{handled} messages, about one a batch");
    assert_eq!(applied.keys().collect::<Vec<_>>(), expected.keys().collect::<Vec<_>>(), "every poller delivered");
    for (poller, rows) in &expected {
        // Exactly the table's rows, each once, in (cursor, pk) order across the poller's messages
        // taken in the order they were enqueued.
        assert_eq!(&applied[poller], rows, "poller {poller}: complete and in order");
    }

    // Every handled message was deleted: once the visibility timeout is over, nothing comes back.
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let mut again = BTreeMap::new();
    assert_eq!(consume(&client, &mut again).await, 0, "a deleted message does not come back: {again:?}");
}
