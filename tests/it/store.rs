//! The state store conformance suite against every implementation, and what only files can show.

use std::sync::Arc;

use dbtrigger::domain::StateDocument;
use dbtrigger::store::file::FileStore;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::store::{StateKey, StateStore, StoreError, WriteCondition, conformance};
use serde_json::json;

use crate::harness::{AppRoot, Orders, Receiver, race_tick_processes};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_memory_store_passes_the_conformance_suite() {
    let store = MemoryStore::new();
    store.set_page_size(3);
    conformance::run_all(Arc::new(store), "conformance", 3).await;
    let bounded = MemoryStore::new();
    bounded.set_max_blob_bytes(2048);
    conformance::a_blob_over_the_bound_is_refused_on_read_but_listed_and_deletable(&bounded, "bounded", 2048).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_file_store_passes_the_conformance_suite() {
    let directory = tempfile::tempdir().unwrap();
    let store = FileStore::new(directory.path().to_path_buf()).with_page_size(3);
    conformance::run_all(Arc::new(store), "conformance", 3).await;
    let bounded = FileStore::new(directory.path().to_path_buf()).with_max_blob_bytes(2048);
    conformance::a_blob_over_the_bound_is_refused_on_read_but_listed_and_deletable(&bounded, "bounded", 2048).await;
}

/// Regression (issue 30, item 6): names that climb out of the root (an app name `../../x`, a
/// crafted quarantine id) never make the file store write, lock or delete outside its root.
#[tokio::test]
async fn the_file_store_never_touches_a_file_outside_its_root() {
    use dbtrigger::store::{BlobStore, ETag, PutMode};
    let directory = tempfile::tempdir().unwrap();
    let store = FileStore::new(directory.path().join("root"));
    std::fs::write(directory.path().join("victim.json"), "kept").unwrap();
    for path in [
        "state/../../outside.json",
        "state/../../victim.json",
        "quarantine/app/orders/../../../../outside.json",
        "watchdog/../../x/outside.json",
    ] {
        let put = store.put(path, b"x".to_vec(), PutMode::Overwrite).await;
        assert!(matches!(put, Err(StoreError::InvalidPath { .. })), "{path}: {put:?}");
        let delete = store.delete(path, &ETag("\"x\"".into())).await;
        assert!(matches!(delete, Err(StoreError::InvalidPath { .. })), "{path}: {delete:?}");
    }
    let mut outside: Vec<String> = std::fs::read_dir(directory.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    outside.sort();
    assert_eq!(outside, ["victim.json"], "no file, folder or lock made beside the root");
    assert_eq!(std::fs::read_to_string(directory.path().join("victim.json")).unwrap(), "kept");
}

#[tokio::test]
async fn the_file_store_keeps_documents_where_the_blob_would_be() {
    let directory = tempfile::tempdir().unwrap();
    let store = FileStore::new(directory.path().to_path_buf());
    let key = StateKey::new("myapp", "orders");
    store.write(&key, &StateDocument::new("orders", "sha256:x"), WriteCondition::Absent).await.unwrap();
    let bytes = std::fs::read(directory.path().join("state/myapp/orders.json")).unwrap();
    assert_eq!(StateDocument::parse(&bytes).unwrap().poller_name, "orders");
}

#[tokio::test]
async fn a_corrupted_file_document_is_reported_and_left_untouched() {
    let directory = tempfile::tempdir().unwrap();
    let store = FileStore::new(directory.path().to_path_buf());
    let key = StateKey::new("myapp", "orders");
    let path = store.path_of(&key);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    for garbage in [&b"{\"version\": 1, \"poller_name\": "[..], &br#"{"version": 99, "poller_name": "orders"}"#[..]] {
        std::fs::write(&path, garbage).unwrap();
        let error = store.read(&key).await.unwrap_err();
        let StoreError::Corrupt { location, reason } = &error else { panic!("expected Corrupt, got {error:?}") };
        assert!(location.ends_with("state/myapp/orders.json"), "{location}");
        assert!(!reason.is_empty());
        assert_eq!(std::fs::read(&path).unwrap(), garbage, "left untouched");
    }
    assert!(store.read(&key).await.unwrap_err().to_string().contains("version 99"));
}

/// Four `dbtrigger tick` processes on the same poller at once, over and over: the file store's
/// CAS holds across processes, so no row is lost and none is committed twice by two owners.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tick_processes_share_one_poller_safely() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=3000, 2).await;
    let receiver = Receiver::start().await;
    // A slow receiver makes a drain outlast the start of the other processes.
    receiver.set_delay(std::time::Duration::from_millis(20));
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let settings = app.settings(&orders, &receiver);

    let outputs = race_tick_processes(&app, &settings, 4, 20).await;
    let mut ids = receiver.acknowledged_ids();
    let delivered = ids.len();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids, (1..=3000).collect::<Vec<i64>>(), "every row delivered");
    // Leases are exclusive and every commit precedes its release: no batch was delivered twice.
    assert_eq!(delivered, 3000, "no row delivered twice");
    assert!(
        outputs.iter().any(|line| line.contains("lease held by")),
        "with four ticks at once, some found the lease held: {outputs:?}"
    );
    let state = app.state_document().await.unwrap();
    assert_eq!(state["checkpoint"]["cursor"]["tiebreaker"], json!({"id": 3000}));
}
