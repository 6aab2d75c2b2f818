//! The Storage queue sink against Azurite: what a queue-triggered function would receive.

use std::sync::Arc;

use azure_storage_queue::models::QueueClientReceiveMessagesOptions;
use azure_storage_queue::{QueueClient, QueueClientOptions};
use base64::Engine as _;
use dbtrigger::azure::{RequestCounter, StorageConnection, client_options};
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, SystemClock, TickError, TickOutcome};
use serde_json::{Value, json};

use crate::harness::{AppRoot, Orders};
use crate::services::azurite;

fn queue_poller(orders: &Orders, directory: &std::path::Path, queue: &str, sink_extra: Value) -> Poller {
    let mut sink = json!({"type": "queue", "connection": "QUEUES", "queueName": queue});
    for (key, value) in sink_extra.as_object().unwrap() {
        sink[key] = value.clone();
    }
    let app = AppRoot::write(
        directory,
        json!({
            "source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]},
            "batch": {"size": 20},
            "sink": sink,
            "state": {"connection": "ORDERS_STATE"}
        }),
    );
    let settings = Settings::from_pairs([
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_STATE".to_string(), "file:unused".to_string()),
        ("QUEUES".to_string(), azurite().connection_string()),
    ]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink = dbtrigger::sink::open(&config.sink).unwrap();
    Poller::new(config, source, sink, Arc::new(MemoryStore::new()), Arc::new(SystemClock), "it".into())
}

/// Takes every message off the queue (as a consumer would), returning their texts.
pub async fn drain(queue: &str) -> Vec<String> {
    let connection = StorageConnection::parse_connection_string(&azurite().connection_string()).unwrap();
    let mut url = connection.queue_endpoint.clone();
    url.path_segments_mut().unwrap().push(queue);
    let options = QueueClientOptions {
        client_options: client_options(&connection, Arc::new(RequestCounter::default())),
        ..Default::default()
    };
    let client = QueueClient::new(url, None, Some(options)).unwrap();
    let mut texts = Vec::new();
    loop {
        let options = QueueClientReceiveMessagesOptions {
            number_of_messages: Some(32),
            visibility_timeout: Some(300),
            ..Default::default()
        };
        let received = match client.receive_messages(Some(options)).await {
            Ok(response) => response.into_model().unwrap(),
            // No queue: nothing was ever sent.
            Err(error) if error.http_status().map(u16::from) == Some(404) => return texts,
            Err(error) => panic!("receiving: {error}"),
        };
        let items = received.items.unwrap_or_default();
        if items.is_empty() {
            return texts;
        }
        texts.extend(items.into_iter().map(|message| message.message_text.unwrap_or_default()));
    }
}

pub fn queue_name() -> String {
    format!("q{}", &uuid::Uuid::new_v4().simple().to_string()[..20])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_arrive_as_base64_messages_one_per_row() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=45, 2).await;
    let queue = queue_name();
    let poller = queue_poller(&orders, directory.path(), &queue, json!({}));
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 45, batches: 3, .. }), "{outcome:?}");

    let texts = drain(&queue).await;
    assert_eq!(texts.len(), 45, "one message per row");
    let mut ids = Vec::new();
    for text in texts {
        let bytes = base64::engine::general_purpose::STANDARD.decode(&text).expect("a base64 message");
        let message: Value = serde_json::from_slice(&bytes).expect("decodes to the event JSON");
        assert_eq!(message["poller"], "orders");
        assert_eq!(message["op"], "upsert");
        assert!(message["event_id"].as_str().unwrap().starts_with("evt_"));
        assert!(message.get("generation").is_none(), "the fencing token has one name: fencing_token");
        assert_eq!(message["row"]["note"], json!(format!("order {}", message["pk"]["id"])));
        ids.push(message["pk"]["id"].as_i64().unwrap());
    }
    ids.sort_unstable();
    assert_eq!(ids, (1..=45).collect::<Vec<i64>>(), "every row present");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_messages_carry_the_envelope_in_plain_json() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=30, 1).await;
    let queue = queue_name();
    let poller =
        queue_poller(&orders, directory.path(), &queue, json!({"messagePer": "batch", "messageEncoding": "none"}));
    poller.tick().await.unwrap();
    let texts = drain(&queue).await;
    assert_eq!(texts.len(), 2, "two batches of 20 and 10");
    let mut ids: Vec<i64> = Vec::new();
    for text in texts {
        let envelope: Value = serde_json::from_str(&text).unwrap();
        ids.extend(envelope["events"].as_array().unwrap().iter().map(|event| event["pk"]["id"].as_i64().unwrap()));
    }
    ids.sort_unstable();
    assert_eq!(ids, (1..=30).collect::<Vec<i64>>());
}

/// A row over what one queue message carries stops the poller as it is read (source.maxRowBytes
/// defaults to the queue's limit, issue 36 section 2), named by its key, nothing of its batch sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_over_the_queue_limit_is_refused_with_its_key() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=3, 1).await;
    sqlx::query("UPDATE orders SET note = ? WHERE id = 2")
        .bind("x".repeat(60_000))
        .execute(&orders.pool)
        .await
        .unwrap();
    let queue = queue_name();
    let poller = queue_poller(&orders, directory.path(), &queue, json!({}));
    let error = poller.tick().await.unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(
            &error,
            TickError::Source(dbtrigger::source::SourceError::InRow { row, error })
                if row == "id=2" && matches!(**error, dbtrigger::source::SourceError::RowTooLarge { limit: 49_152, .. })
        ),
        "{error:?}"
    );
    assert!(message.contains("id=2") && message.contains("source.maxRowBytes"), "{message}");
    assert!(drain(&queue).await.is_empty(), "nothing of the refused batch was sent");
}
