//! The Azure Blob state store against a real Azurite: the conformance suite, the end-to-end tick
//! through the host protocol, concurrent processes, corrupted blobs, wrong keys, dead accounts, and
//! the blob budget.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dbtrigger::azure::StorageConnection;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::StateDocument;
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::store::azure_blob::AzureBlobStore;
use dbtrigger::store::{StateKey, StateStore, StoreError, WriteCondition, conformance};
use dbtrigger::tick::{Poller, SystemClock, TickError, TickOutcome};
use serde_json::json;

use crate::harness::{AppRoot, Orders, Receiver, race_tick_processes};
use crate::services::azurite;

fn connection() -> StorageConnection {
    StorageConnection::parse_connection_string(&azurite().connection_string()).unwrap()
}

/// A store on a container of its own.
fn store() -> Arc<AzureBlobStore> {
    let container = format!("t{}", uuid::Uuid::new_v4().simple());
    Arc::new(AzureBlobStore::new(&connection(), &container).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_azure_blob_store_passes_the_conformance_suite() {
    let container = format!("t{}", uuid::Uuid::new_v4().simple());
    let store = AzureBlobStore::new(&connection(), &container).unwrap().with_list_page_size(3);
    conformance::run_all(Arc::new(store), "conformance", 3).await;
    let bounded = AzureBlobStore::new(&connection(), &container).unwrap().with_max_blob_bytes(2048);
    conformance::a_blob_over_the_bound_is_refused_on_read_but_listed_and_deletable(&bounded, "bounded", 2048).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_arrives_exactly_once_through_the_host_with_state_in_azurite() {
    crate::host::every_host_payload_runs_a_tick_and_every_row_arrives_exactly_once(Some(azurite().connection_string()))
        .await;
}

#[tokio::test]
async fn a_wrong_account_key_is_a_clear_403_error() {
    let text = azurite().connection_string().replace(
        "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq",
        "AAAAvdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq",
    );
    let wrong = StorageConnection::parse_connection_string(&text).unwrap();
    let store = AzureBlobStore::new(&wrong, "db-state").unwrap();
    let error = store.read(&StateKey::new("app", "orders")).await.unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, StoreError::Unavailable { retryable: false, .. }), "{error:?}");
    assert!(message.contains("403") && message.contains("refused the credentials"), "{message}");
    assert!(!message.contains("AAAAvdM02"), "the key never appears: {message}");
}

#[tokio::test]
async fn a_dead_storage_account_fails_within_seconds() {
    let port = crate::services::free_port();
    let text = format!(
        "AccountName=devstoreaccount1;AccountKey={};BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1",
        dbtrigger::config::connection::DEV_KEY
    );
    let dead = StorageConnection::parse_connection_string(&text).unwrap();
    let store = AzureBlobStore::new(&dead, "db-state").unwrap();
    let started = Instant::now();
    let error = store.read(&StateKey::new("app", "orders")).await.unwrap_err();
    assert!(matches!(error, StoreError::Unavailable { retryable: true, .. }), "{error:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "gave up after {:?}", started.elapsed());
}

#[tokio::test]
async fn a_corrupted_state_blob_stops_the_poller_and_is_left_untouched() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=10, 1).await;
    let store = store();
    let key = StateKey::new("local", "orders");
    for garbage in [&b"{\"version\": 1, \"poller_name\": "[..], &br#"{"version": 99, "poller_name": "orders"}"#[..]] {
        store.write_raw(&key, garbage).await.unwrap();
        let poller = poller(&orders, directory.path(), store.clone(), 100);
        let error = poller.tick().await.unwrap_err();
        assert!(matches!(error, TickError::Store(StoreError::Corrupt { .. })), "{error:?}");
        assert!(error.to_string().contains("left untouched"), "{error}");
        assert_eq!(
            store.read_raw(&key).await.unwrap().as_deref(),
            Some(garbage),
            "the blob is byte for byte as it was"
        );
    }
}

fn poller(orders: &Orders, directory: &std::path::Path, store: Arc<AzureBlobStore>, size: usize) -> Poller {
    let app = AppRoot::write(directory, AppRoot::orders_poller(size));
    let settings = Settings::from_pairs([
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_WEBHOOK".to_string(), "http://127.0.0.1:9/unused".to_string()),
        ("ORDERS_STATE".to_string(), "file:unused".to_string()),
    ]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    let source = dbtrigger::source::open(&config.source).unwrap();
    Poller::new(config, source, Arc::new(RecordingSink::new()), store, Arc::new(SystemClock), "it".into())
}

#[tokio::test]
async fn a_tick_costs_what_the_blob_budget_says() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    let store = store();
    let poller = poller(&orders, directory.path(), store.clone(), 100);

    // Empty: 1 GET, 0 PUT.
    assert_eq!(poller.tick().await.unwrap(), TickOutcome::Idle);
    assert_eq!(store.request_counts(), (1, 0));

    // k = 5 batches: 1 GET, 1 PUT for the lease and 1 per batch. The first write also creates the
    // container (one more PUT, once per container's life).
    orders.insert(1..=500, 1).await;
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { batches: 5, .. }), "{outcome:?}");
    let (gets, puts) = store.request_counts();
    assert_eq!(gets - 1, 1, "one GET");
    // At most k + 1: commits coalesce when batches are acknowledged while one is written.
    assert!(
        (1 + 2 + 1..=5 + 1 + 2).contains(&puts),
        "{puts}: at most k + 1 PUTs, plus the container's creation (and the retried first PUT)"
    );

    orders.insert(501..=800, 1).await;
    let before = store.request_counts();
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { batches: 3, .. }), "{outcome:?}");
    let after = store.request_counts();
    assert_eq!(after.0 - before.0, 1, "1 GET");
    assert!((2..=3 + 1).contains(&(after.1 - before.1)), "at most k + 1 PUTs: {after:?} {before:?}");

    let before = store.request_counts();
    assert_eq!(poller.tick().await.unwrap(), TickOutcome::Idle);
    let after = store.request_counts();
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 0));
}

/// Two `dbtrigger tick` processes on the same poller at once, many times, with the state in
/// Azurite: the loser of each race ends as "lease held", every row arrives, none twice, and the
/// fencing token seen by the receiver never goes down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_share_one_poller_through_azurite() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=1500, 2).await;
    let receiver = Receiver::start().await;
    receiver.set_delay(Duration::from_millis(20));
    let app =
        AppRoot::write(directory.path(), AppRoot::orders_poller(50)).with_azure_state(&azurite().connection_string());
    let settings = app.settings(&orders, &receiver);
    let outputs = race_tick_processes(&app, &settings, 2, 30).await;
    let ids = receiver.acknowledged_ids();
    let mut unique = ids.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique, (1..=1500).collect::<Vec<i64>>(), "every row delivered");
    assert_eq!(ids.len(), 1500, "none twice");
    assert!(outputs.iter().any(|line| line.contains("lease held by")), "{outputs:?}");
    let tokens: Vec<u64> =
        receiver.acknowledged().iter().map(|received| received.envelope["fencing_token"].as_u64().unwrap()).collect();
    assert!(tokens.windows(2).all(|pair| pair[0] <= pair[1]), "fencing tokens never go down: {tokens:?}");
    let state = app.state_document().await.unwrap();
    assert_eq!(state["checkpoint"]["cursor"]["tiebreaker"], json!({"id": 1500}));
}

#[tokio::test]
async fn a_document_written_to_azurite_reads_back_with_its_etag() {
    let store = store();
    let key = StateKey::new("app", "orders");
    let etag = store.write(&key, &StateDocument::new("orders", "sha256:x"), WriteCondition::Absent).await.unwrap();
    let read = store.read(&key).await.unwrap().unwrap();
    assert_eq!(read.etag, etag);
    assert_eq!(read.document.poller_name, "orders");
}
