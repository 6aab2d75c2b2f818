//! The one test suite every [`StateStore`] passes (memory, file, and Azure Blob on Azurite).
//! Each check panics with a message naming what broke. Keys are namespaced so that several runs
//! can share one container.

use std::sync::Arc;

use super::{StateKey, StateStore, StoreError, WriteCondition};
use crate::domain::StateDocument;

/// Runs every check against `store`, under app name `namespace`.
pub async fn run_all(store: Arc<dyn StateStore>, namespace: &str) {
    read_of_a_missing_document_is_none(store.as_ref(), namespace).await;
    create_then_read_returns_the_document(store.as_ref(), namespace).await;
    create_twice_is_already_exists(store.as_ref(), namespace).await;
    update_with_the_current_etag_succeeds(store.as_ref(), namespace).await;
    update_with_a_stale_etag_conflicts(store.as_ref(), namespace).await;
    update_of_a_missing_document_conflicts(store.as_ref(), namespace).await;
    concurrent_increments_lose_no_update(store.clone(), namespace, 8, 10).await;
}

fn document(poller: &str, counter: u64) -> StateDocument {
    let mut document = StateDocument::new(poller, "sha256:conformance");
    document.stats.batches_delivered = counter;
    document
}

pub async fn read_of_a_missing_document_is_none(store: &dyn StateStore, namespace: &str) {
    let key = StateKey::new(namespace, "missing");
    assert!(store.read(&key).await.expect("read of a missing document").is_none());
}

pub async fn create_then_read_returns_the_document(store: &dyn StateStore, namespace: &str) {
    let key = StateKey::new(namespace, "create-read");
    let etag = store.write(&key, &document("create-read", 7), WriteCondition::Absent).await.expect("create");
    let read = store.read(&key).await.expect("read").expect("the created document");
    assert_eq!(read.document, document("create-read", 7));
    assert_eq!(read.etag, etag, "the ETag of a read equals the ETag the write returned");
}

pub async fn create_twice_is_already_exists(store: &dyn StateStore, namespace: &str) {
    let key = StateKey::new(namespace, "create-twice");
    store.write(&key, &document("create-twice", 1), WriteCondition::Absent).await.expect("first create");
    let second = store.write(&key, &document("create-twice", 2), WriteCondition::Absent).await;
    assert!(matches!(second, Err(StoreError::AlreadyExists { .. })), "second create gave {second:?}");
    let read = store.read(&key).await.unwrap().unwrap();
    assert_eq!(read.document.stats.batches_delivered, 1, "a refused create changes nothing");
}

pub async fn update_with_the_current_etag_succeeds(store: &dyn StateStore, namespace: &str) {
    let key = StateKey::new(namespace, "update");
    let first = store.write(&key, &document("update", 1), WriteCondition::Absent).await.unwrap();
    let second = store
        .write(&key, &document("update", 2), WriteCondition::Matches(first.clone()))
        .await
        .expect("update with the current ETag");
    assert_ne!(first, second, "a write changes the ETag");
    let read = store.read(&key).await.unwrap().unwrap();
    assert_eq!(read.document.stats.batches_delivered, 2);
    assert_eq!(read.etag, second);
}

pub async fn update_with_a_stale_etag_conflicts(store: &dyn StateStore, namespace: &str) {
    let key = StateKey::new(namespace, "stale");
    let first = store.write(&key, &document("stale", 1), WriteCondition::Absent).await.unwrap();
    store.write(&key, &document("stale", 2), WriteCondition::Matches(first.clone())).await.unwrap();
    let stale = store.write(&key, &document("stale", 3), WriteCondition::Matches(first)).await;
    assert!(matches!(stale, Err(StoreError::Conflict { .. })), "a stale update gave {stale:?}");
    let read = store.read(&key).await.unwrap().unwrap();
    assert_eq!(read.document.stats.batches_delivered, 2, "a refused update changes nothing");
}

pub async fn update_of_a_missing_document_conflicts(store: &dyn StateStore, namespace: &str) {
    let key = StateKey::new(namespace, "never-created");
    let etag = {
        let other = StateKey::new(namespace, "etag-donor");
        store.write(&other, &document("etag-donor", 1), WriteCondition::Absent).await.unwrap()
    };
    let result = store.write(&key, &document("never-created", 1), WriteCondition::Matches(etag)).await;
    assert!(matches!(result, Err(StoreError::Conflict { .. })), "update of a missing document gave {result:?}");
    assert!(store.read(&key).await.unwrap().is_none());
}

/// `workers` tasks each add 1 to a counter `increments` times by read, modify, CAS, retrying on
/// conflict. The final counter equals workers x increments: CAS lost no update.
pub async fn concurrent_increments_lose_no_update(
    store: Arc<dyn StateStore>,
    namespace: &str,
    workers: u64,
    increments: u64,
) {
    let key = StateKey::new(namespace, "race");
    match store.write(&key, &document("race", 0), WriteCondition::Absent).await {
        Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
        Err(error) => panic!("creating the race document: {error}"),
    }
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let store = store.clone();
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let mut conflicts = 0u64;
            for _ in 0..increments {
                loop {
                    let current = store.read(&key).await.expect("read").expect("the race document");
                    let mut next = current.document.clone();
                    next.stats.batches_delivered += 1;
                    next.write_id = Some(uuid::Uuid::new_v4().to_string());
                    match store.write(&key, &next, WriteCondition::Matches(current.etag)).await {
                        Ok(_) => break,
                        Err(StoreError::Conflict { .. }) => conflicts += 1,
                        Err(error) => panic!("increment: {error}"),
                    }
                }
            }
            conflicts
        }));
    }
    for task in tasks {
        task.await.expect("a worker panicked");
    }
    let read = store.read(&key).await.unwrap().unwrap();
    assert_eq!(read.document.stats.batches_delivered, workers * increments, "concurrent CAS increments lost updates");
}
