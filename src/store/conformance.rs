//! The one test suite every [`BlobStore`] passes (memory, file, and Azure Blob on Azurite): the
//! bytes level (get, put in each mode, list by prefix across pages, delete by ETag) and the state
//! documents over it, including a race of tasks incrementing a counter through CAS. Each check
//! panics with a message naming what broke. Paths and keys are namespaced so that several runs
//! can share one container.

use std::sync::Arc;

use super::{BlobStore, ETag, PutMode, StateKey, StateStore, StoreError, WriteCondition};
use crate::domain::StateDocument;

/// Runs every check against `blobs`, under `namespace`. `page_size` is the store's list page size
/// (listing is checked across more than two pages of it).
pub async fn run_all(blobs: Arc<dyn BlobStore>, namespace: &str, page_size: usize) {
    get_of_a_missing_blob_is_none(blobs.as_ref(), namespace).await;
    put_modes_compare_and_swap(blobs.as_ref(), namespace).await;
    delete_needs_the_current_etag(blobs.as_ref(), namespace).await;
    list_finds_exactly_the_prefix_in_order_across_pages(blobs.as_ref(), namespace, page_size).await;
    let store = blobs.as_ref();
    read_of_a_missing_document_is_none(store, namespace).await;
    create_then_read_returns_the_document(store, namespace).await;
    create_twice_is_already_exists(store, namespace).await;
    update_with_the_current_etag_succeeds(store, namespace).await;
    update_with_a_stale_etag_conflicts(store, namespace).await;
    update_of_a_missing_document_conflicts(store, namespace).await;
    state_documents_are_listed_by_app(store, namespace).await;
    concurrent_increments_lose_no_update(blobs.clone(), namespace, 8, 10).await;
    paths_with_names_that_are_not_path_names_are_refused(blobs.as_ref(), namespace).await;
}

/// Regression (issue 30, item 6): a path holding a name that could climb out of its folder or
/// hide (`..`, `.name`, an empty segment, a space or a newline) is refused by every operation of
/// every store, before it touches anything: `DBTRIGGER_APP_NAME=../../x` wrote outside the file
/// store's root, and a crafted quarantine id made a lock file outside it.
pub async fn paths_with_names_that_are_not_path_names_are_refused(blobs: &dyn BlobStore, namespace: &str) {
    let bad_paths = [
        format!("{namespace}/../escaped.json"),
        format!("{namespace}/app/../../escaped.json"),
        format!("{namespace}/.hidden.json"),
        format!("{namespace}//empty.json"),
        format!("{namespace}/with space.json"),
        format!("{namespace}/new\nline.json"),
        format!("/{namespace}/absolute.json"),
        format!("{namespace}/back\\slash.json"),
    ];
    let refused = |result: Result<(), StoreError>, what: &str, path: &str| match result {
        Err(StoreError::InvalidPath { .. }) => {}
        other => panic!("{what} of {path:?} was not refused as an invalid path: {other:?}"),
    };
    for path in &bad_paths {
        refused(blobs.get(path).await.map(|_| ()), "get", path);
        refused(blobs.put(path, b"x".to_vec(), PutMode::Overwrite).await.map(|_| ()), "put", path);
        refused(blobs.delete(path, &ETag("\"x\"".into())).await, "delete", path);
    }
    refused(blobs.list(&format!("{namespace}/../"), None).await.map(|_| ()), "list", "../");
    let listed = blobs.list(&format!("{namespace}/"), None).await.expect("list the namespace");
    assert!(
        listed.items.iter().all(|item| !item.path.contains("escaped") && !item.path.contains("hidden")),
        "nothing was written: {listed:?}"
    );
}

/// Regression (issue 30, item 9): a blob larger than the store's bound (`bound`, as the store was
/// built with) is refused as it is read, never taken whole; it is still listed, and deleted by the
/// ETag its listing gives, so that an operator can remove it.
pub async fn a_blob_over_the_bound_is_refused_on_read_but_listed_and_deletable(
    blobs: &dyn BlobStore,
    namespace: &str,
    bound: usize,
) {
    let path = format!("{namespace}/oversized/blob.json");
    blobs.put(&path, vec![b' '; bound + 1], PutMode::Overwrite).await.expect("an oversized blob can be written");
    match blobs.get(&path).await {
        Err(StoreError::Corrupt { reason, .. }) => {
            assert!(reason.contains(&format!("more than the {bound} bytes")), "{reason}")
        }
        other => panic!("a blob over the bound was read: {:?}", other.map(|found| found.map(|blob| blob.bytes.len()))),
    }
    let fits = format!("{namespace}/oversized/fits.json");
    blobs.put(&fits, vec![b' '; bound], PutMode::Overwrite).await.unwrap();
    assert_eq!(blobs.get(&fits).await.unwrap().map(|blob| blob.bytes.len()), Some(bound), "at the bound: read");
    let listed = blobs.list(&format!("{namespace}/oversized/"), None).await.expect("list");
    let item = listed.items.iter().find(|item| item.path == path).expect("the oversized blob is listed");
    blobs.delete(&path, &item.etag).await.expect("deleted by its listed ETag");
    assert!(
        blobs.list(&format!("{namespace}/oversized/"), None).await.unwrap().items.iter().all(|item| item.path != path)
    );
}

pub async fn get_of_a_missing_blob_is_none(blobs: &dyn BlobStore, namespace: &str) {
    assert!(blobs.get(&format!("{namespace}/missing")).await.expect("get of a missing blob").is_none());
}

pub async fn put_modes_compare_and_swap(blobs: &dyn BlobStore, namespace: &str) {
    let path = format!("{namespace}/modes/blob");
    let first = blobs.put(&path, b"one".to_vec(), PutMode::Create).await.expect("create");
    let got = blobs.get(&path).await.unwrap().expect("the created blob");
    assert_eq!((got.bytes.as_slice(), &got.etag), (&b"one"[..], &first), "get returns the bytes and the put's ETag");
    let again = blobs.put(&path, b"two".to_vec(), PutMode::Create).await;
    assert!(matches!(again, Err(StoreError::AlreadyExists { .. })), "a second create gave {again:?}");
    let second = blobs.put(&path, b"two".to_vec(), PutMode::Update(first.clone())).await.expect("update");
    assert_ne!(second, first, "an update gives a new ETag");
    let stale = blobs.put(&path, b"three".to_vec(), PutMode::Update(first)).await;
    assert!(matches!(stale, Err(StoreError::Conflict { .. })), "a stale update gave {stale:?}");
    assert_eq!(blobs.get(&path).await.unwrap().unwrap().bytes, b"two", "a refused update changes nothing");
    let missing = blobs.put(&format!("{namespace}/modes/never"), b"x".to_vec(), PutMode::Update(second.clone())).await;
    assert!(matches!(missing, Err(StoreError::Conflict { .. })), "an update of a missing blob gave {missing:?}");
    let overwritten = blobs.put(&path, b"four".to_vec(), PutMode::Overwrite).await.expect("overwrite");
    assert_eq!(blobs.get(&path).await.unwrap().unwrap().etag, overwritten);
    blobs.put(&format!("{namespace}/modes/fresh"), b"x".to_vec(), PutMode::Overwrite).await.expect("overwrite creates");
}

pub async fn delete_needs_the_current_etag(blobs: &dyn BlobStore, namespace: &str) {
    let path = format!("{namespace}/delete/blob");
    let first = blobs.put(&path, b"one".to_vec(), PutMode::Create).await.unwrap();
    let second = blobs.put(&path, b"two".to_vec(), PutMode::Update(first.clone())).await.unwrap();
    let stale = blobs.delete(&path, &first).await;
    assert!(matches!(stale, Err(StoreError::Conflict { .. })), "a delete with a stale ETag gave {stale:?}");
    assert!(blobs.get(&path).await.unwrap().is_some(), "and deleted nothing");
    blobs.delete(&path, &second).await.expect("a delete with the current ETag");
    assert!(blobs.get(&path).await.unwrap().is_none());
    let gone = blobs.delete(&path, &second).await;
    assert!(matches!(gone, Err(StoreError::Conflict { .. })), "a delete of a missing blob gave {gone:?}");
}

pub async fn list_finds_exactly_the_prefix_in_order_across_pages(
    blobs: &dyn BlobStore,
    namespace: &str,
    page_size: usize,
) {
    let count = page_size * 2 + 1;
    let mut expected = Vec::new();
    for index in 0..count {
        let path = format!("{namespace}/list/app/item-{index:04}.json");
        let etag = blobs.put(&path, vec![b'x'; index % 7], PutMode::Overwrite).await.unwrap();
        expected.push((path, etag));
    }
    // Siblings that share the beginning of the prefix but are outside it.
    blobs.put(&format!("{namespace}/list/app2/item.json"), b"x".to_vec(), PutMode::Overwrite).await.unwrap();
    blobs.put(&format!("{namespace}/list/ap"), b"x".to_vec(), PutMode::Overwrite).await.unwrap();
    let mut found: Vec<(String, ETag)> = Vec::new();
    let mut continuation = None;
    let mut pages = 0;
    loop {
        let page = blobs.list(&format!("{namespace}/list/app/"), continuation).await.expect("list");
        pages += 1;
        assert!(page.items.len() <= page_size, "a page of {} items, over {page_size}", page.items.len());
        found.extend(page.items.into_iter().map(|item| (item.path, item.etag)));
        match page.next {
            Some(next) => continuation = Some(next),
            None => break,
        }
        assert!(pages <= count, "listing does not end");
    }
    assert!(pages >= 3, "{count} blobs in pages of {page_size} took {pages} pages");
    assert_eq!(found, expected, "every blob of the prefix once, in order, with its ETag, and nothing else");
    let empty = blobs.list(&format!("{namespace}/list/nothing-here/"), None).await.expect("list of nothing");
    assert!(empty.items.is_empty() && empty.next.is_none());
}

pub async fn state_documents_are_listed_by_app(blobs: &dyn BlobStore, namespace: &str) {
    let app = format!("{namespace}-listing");
    for poller in ["b", "a", "c"] {
        let key = StateKey::new(&app, poller);
        StateStore::write(blobs, &key, &document(poller, 1), WriteCondition::Absent).await.unwrap();
    }
    StateStore::write(
        blobs,
        &StateKey::new(&format!("{app}x"), "other"),
        &document("other", 1),
        WriteCondition::Absent,
    )
    .await
    .unwrap();
    let keys = super::state::list(blobs, &app).await.expect("list the app's documents");
    let pollers: Vec<&str> = keys.iter().map(|key| key.poller.as_str()).collect();
    assert_eq!(pollers, ["a", "b", "c"], "the app's pollers, no other app's");
}

fn document(poller: &str, counter: u64) -> StateDocument {
    let mut document = StateDocument::new(poller, "sha256:conformance");
    document.stats.batches_delivered = counter;
    document
}

pub async fn read_of_a_missing_document_is_none(store: &dyn BlobStore, namespace: &str) {
    let key = StateKey::new(namespace, "missing");
    assert!(store.read(&key).await.expect("read of a missing document").is_none());
}

pub async fn create_then_read_returns_the_document(store: &dyn BlobStore, namespace: &str) {
    let key = StateKey::new(namespace, "create-read");
    let etag = store.write(&key, &document("create-read", 7), WriteCondition::Absent).await.expect("create");
    let read = store.read(&key).await.expect("read").expect("the created document");
    assert_eq!(read.document, document("create-read", 7));
    assert_eq!(read.etag, etag, "the ETag of a read equals the ETag the write returned");
}

pub async fn create_twice_is_already_exists(store: &dyn BlobStore, namespace: &str) {
    let key = StateKey::new(namespace, "create-twice");
    store.write(&key, &document("create-twice", 1), WriteCondition::Absent).await.expect("first create");
    let second = store.write(&key, &document("create-twice", 2), WriteCondition::Absent).await;
    assert!(matches!(second, Err(StoreError::AlreadyExists { .. })), "second create gave {second:?}");
    let read = store.read(&key).await.unwrap().unwrap();
    assert_eq!(read.document.stats.batches_delivered, 1, "a refused create changes nothing");
}

pub async fn update_with_the_current_etag_succeeds(store: &dyn BlobStore, namespace: &str) {
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

pub async fn update_with_a_stale_etag_conflicts(store: &dyn BlobStore, namespace: &str) {
    let key = StateKey::new(namespace, "stale");
    let first = store.write(&key, &document("stale", 1), WriteCondition::Absent).await.unwrap();
    store.write(&key, &document("stale", 2), WriteCondition::Matches(first.clone())).await.unwrap();
    let stale = store.write(&key, &document("stale", 3), WriteCondition::Matches(first)).await;
    assert!(matches!(stale, Err(StoreError::Conflict { .. })), "a stale update gave {stale:?}");
    let read = store.read(&key).await.unwrap().unwrap();
    assert_eq!(read.document.stats.batches_delivered, 2, "a refused update changes nothing");
}

pub async fn update_of_a_missing_document_conflicts(store: &dyn BlobStore, namespace: &str) {
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
    store: Arc<dyn BlobStore>,
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
