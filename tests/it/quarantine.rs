//! The quarantine's operator commands beside a live poller (issue 24, items 8, 10 and 15; issue
//! 30, item 6): a replay while a tick runs, entries read by name and an unreadable one set aside,
//! paths from the listed names only, and what a replay sends and records when it stops part way.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dbtrigger::operations::quarantine::{self, HistoryLine, Progress, QuarantineOutcome, QuarantineParts, Selection};
use dbtrigger::operations::{Operator, Parts};
use dbtrigger::store::file::FileStore;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::store::quarantine::{QuarantineEntry, put};
use dbtrigger::store::{BlobStore, ETag, ListPage, PutMode, StateKey, StoreError};
use serde_json::{Value, json};

use crate::harness::{AppRoot, Orders, Receiver, run_dbtrigger};
use crate::sources::{Engine, database, execute, items_config, poller_with};

/// A quarantine entry named `name` for row `id` of poller `poller`.
fn entry(poller: &str, name: &str, id: i64) -> QuarantineEntry {
    let at = chrono::Utc::now();
    QuarantineEntry {
        id: name.to_string(),
        poller: poller.to_string(),
        event: json!({"event_id": format!("evt_{id}"), "op": "upsert", "cursor": id, "pk": {"id": id},
                      "row": {"id": id, "note": format!("order {id}")}}),
        error: "422 no address".into(),
        status: Some(422),
        attempts: 1,
        batch_id: "b".into(),
        fencing_token: 1,
        source_fingerprint: "sha256:x".into(),
        first_failure_at: at,
        last_failure_at: at,
        quarantined_at: at,
    }
}

async fn state(app: &AppRoot) -> Value {
    app.state_document().await.expect("a state document")
}

/// Regression (issue 24, item 8): a replay's history line, written while a tick holds the lease
/// and delivers to a slow receiver, does not knock the tick over: it commits every row once,
/// releases its lease, and the line stays in the history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_while_a_tick_runs_leaves_the_tick_whole() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=3, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(5));
    let settings = app.settings(&orders, &receiver);
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0, "a first document");
    let blobs = FileStore::new(app.state_dir.clone());
    for (name, id) in [("q_901", 901), ("q_902", 902)] {
        put(&blobs, &app.app_name, &entry("orders", name, id)).await.unwrap();
    }
    orders.insert(4..=63, 1).await;
    receiver.set_delay(Duration::from_millis(150));

    let tick = {
        let (app_root, settings) = (app.root.clone(), settings.clone());
        tokio::task::spawn_blocking(move || {
            let app =
                AppRoot { root: app_root, state_dir: Default::default(), app_name: String::new(), azure_state: None };
            run_dbtrigger(&app, &settings, &["tick", "orders"])
        })
    };
    // The tick has taken the lease and is sending 12 batches of 5, 150 ms each.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(state(&app).await["lease"]["owner_id"].is_string(), "the tick holds the lease");
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["quarantine", "replay", "orders", "--all", "--yes"]);
    assert!(ok, "{stdout}{stderr}");
    assert!(state(&app).await["lease"]["owner_id"].is_string(), "the replay ended while the tick still runs");
    let (ok, stdout, stderr) = tick.await.unwrap();
    assert!(ok && stdout.contains("outcome=caught-up rows=60 "), "{stdout}{stderr}");

    let document = state(&app).await;
    assert_eq!(document["checkpoint"]["cursor"]["tiebreaker"]["id"], 63);
    assert_eq!(document["lease"]["owner_id"], Value::Null, "released");
    assert_eq!(document["stats"]["rows_delivered"], 63);
    let last = document["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["action"], "quarantine_replay");
    assert!(last["what"].as_str().unwrap().starts_with("replayed 2 quarantined rows"), "{last}");
    let mut ids = receiver.acknowledged_ids();
    ids.sort_unstable();
    let mut expected: Vec<i64> = (1..=63).collect();
    expected.extend([901, 902]);
    assert_eq!(ids, expected, "every row once, nothing resent");
}

/// Regression (issue 24, item 10; issue 30, item 6): entries are listed page by page and read by
/// name; an unreadable one is named and set aside while the others are listed, shown and
/// replayed; an entry whose `id` inside walks out of the store is acted on by its own name, and
/// nothing is written outside the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_entry_is_named_and_the_others_go_on_by_their_own_names() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=3, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(5));
    let settings = app.settings(&orders, &receiver);
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    let blobs = FileStore::new(app.state_dir.clone());
    let folder = format!("quarantine/{}/orders", app.app_name);
    let bytes = |entry: &QuarantineEntry| serde_json::to_vec_pretty(entry).unwrap();
    blobs.put(&format!("{folder}/q_a.json"), bytes(&entry("orders", "q_a", 901)), PutMode::Create).await.unwrap();
    let crafted = entry("orders", "../../../../outside", 902);
    blobs.put(&format!("{folder}/q_evil.json"), bytes(&crafted), PutMode::Create).await.unwrap();
    blobs.put(&format!("{folder}/q_bad.json"), b"{ not an entry".to_vec(), PutMode::Create).await.unwrap();

    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["quarantine", "list", "orders", "--json"]);
    assert!(!ok && stderr.contains("q_bad cannot be read"), "{stderr}");
    let listed: Value = serde_json::from_str(&stdout).unwrap_or_else(|_| panic!("pure JSON: {stdout}"));
    let names: Vec<&str> = listed.as_array().unwrap().iter().map(|entry| entry["id"].as_str().unwrap()).collect();
    assert_eq!(names, ["q_a", "q_evil"], "listed by their names");
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["quarantine", "show", "orders", "q_a"]);
    assert!(ok && stdout.contains("\"evt_901\""), "{stdout}");
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["quarantine", "show", "orders", "q_bad"]);
    assert!(!ok && stderr.contains("q_bad cannot be read"), "{stderr}");
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["quarantine", "show", "orders", "../../../../outside"]);
    assert!(!ok && stderr.contains("no quarantine entry"), "{stderr}");

    let arguments = ["quarantine", "replay", "orders", "--all", "--yes"];
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &arguments);
    assert!(!ok && stdout.contains("replayed 2 rows, 0 kept") && stderr.contains("q_bad"), "{stdout}{stderr}");
    assert_eq!(receiver.acknowledged_ids()[3..], [901, 902]);
    let left = blobs.list(&format!("{folder}/"), None).await.unwrap();
    let left: Vec<&str> = left.items.iter().map(|item| item.path.as_str()).collect();
    assert_eq!(left, [format!("{folder}/q_bad.json")], "the unreadable entry is left as it is");
    let outside: Vec<String> = std::fs::read_dir(directory.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains("outside"))
        .collect();
    assert!(outside.is_empty(), "nothing written outside the store: {outside:?}");
    let last = state(&app).await["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["what"], "replayed 2 quarantined rows: q_a, q_evil");
}

/// Deletes that fail after the first `allowed`, as a store that becomes unreachable part way.
struct DeletesFailAfter {
    inner: Arc<MemoryStore>,
    allowed: AtomicUsize,
}

#[async_trait::async_trait]
impl BlobStore for DeletesFailAfter {
    async fn get(&self, path: &str) -> Result<Option<dbtrigger::store::Blob>, StoreError> {
        self.inner.get(path).await
    }

    async fn put(&self, path: &str, bytes: Vec<u8>, mode: PutMode) -> Result<ETag, StoreError> {
        self.inner.put(path, bytes, mode).await
    }

    async fn list(&self, prefix: &str, continuation: Option<String>) -> Result<ListPage, StoreError> {
        self.inner.list(prefix, continuation).await
    }

    async fn delete(&self, path: &str, etag: &ETag) -> Result<(), StoreError> {
        if self.allowed.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1)).is_err() {
            return Err(StoreError::Unavailable { location: "test".into(), reason: "gone".into(), retryable: true });
        }
        self.inner.delete(path, etag).await
    }

    fn describe(&self) -> String {
        "deletes fail".into()
    }
}

/// Regression (issue 24, item 15): a replay sends the generation the checkpoint belongs to, takes
/// a name given twice once, says how far it is, and a replay or a purge that stops part way still
/// records in the history what it removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_sends_the_generation_once_per_entry_and_records_what_it_removed_when_it_stops() {
    let database = database(Engine::Sqlite).await;
    execute(
        &database.url,
        "CREATE TABLE items (id INTEGER PRIMARY KEY, c INTEGER NOT NULL);\nCREATE TABLE load_log (load_id INTEGER);\n\
         INSERT INTO items VALUES (1, 1), (2, 2);\nINSERT INTO load_log VALUES (7)",
    )
    .await;
    let generation = json!({"generation": {"query": "SELECT max(load_id) FROM load_log", "onChange": "stop"}});
    let (config, _directory) = items_config(&database.url, generation, 10);
    let store = Arc::new(MemoryStore::new());
    let (poller, sink) = poller_with(config, store.clone());
    poller.tick().await.unwrap();
    let app = poller.config.app_name.clone();
    for (name, id) in [("q_1", 901), ("q_2", 902), ("q_3", 903)] {
        put(store.as_ref(), &app, &entry("orders", name, id)).await.unwrap();
    }
    let blobs = DeletesFailAfter { inner: store.clone(), allowed: AtomicUsize::new(1) };
    let parts = QuarantineParts { poller: Parts::of(&poller), blobs: &blobs, sink: sink.as_ref() };
    let operator = Operator { who: "ops@test", force: false, reason: None };

    let names = Selection::Names(vec!["q_1".into(), "q_1".into(), "q_2".into(), "q_3".into()]);
    let chosen = quarantine::choose(&blobs, &app, "orders", &names).await.unwrap();
    assert_eq!(chosen.entries.len(), 3, "q_1 once");
    let mut seen = Vec::new();
    let mut progress = |progress: Progress| seen.push(progress.done);
    let delivered_before = sink.batches().len();
    let outcome = quarantine::replay(parts, &chosen.entries, operator, &mut progress).await;
    let QuarantineOutcome::Interrupted { tally, error } = outcome else {
        panic!("the second removal failed: {outcome:?}");
    };
    assert!(error.contains("q_2: delivered, but not removed"), "{error}");
    assert_eq!((tally.removed.as_slice(), &tally.history), (&["q_1".to_string()][..], &HistoryLine::Written));
    assert_eq!(seen, [1], "progress after each entry handled");
    let replayed: Vec<(i64, Option<Value>)> = sink.batches()[delivered_before..]
        .iter()
        .map(|batch| (batch.events[0].pk()["id"].as_i64().unwrap(), batch.generation.clone()))
        .collect();
    assert_eq!(replayed, [(901, Some(json!(7))), (902, Some(json!(7)))]);
    let key = StateKey::new(&app, "orders");
    let document = dbtrigger::domain::StateDocument::parse(&store.raw(&key).unwrap()).unwrap();
    let last = document.history.last().unwrap();
    assert!(last.what.starts_with("replayed 1 quarantined rows (stopped part way: q_2"), "{}", last.what);
    assert!(last.what.ends_with(": q_1"), "{}", last.what);

    blobs.allowed.store(1, Ordering::SeqCst);
    let rest = quarantine::choose(&blobs, &app, "orders", &Selection::All).await.unwrap();
    let QuarantineOutcome::Interrupted { tally, .. } = quarantine::purge(parts, &rest.entries, operator).await else {
        panic!("the second removal failed");
    };
    assert_eq!(tally.removed, ["q_2"]);
    let document = dbtrigger::domain::StateDocument::parse(&store.raw(&key).unwrap()).unwrap();
    let last = document.history.last().unwrap();
    assert_eq!(last.action, Some(dbtrigger::domain::state::HistoryAction::QuarantinePurge));
    assert!(last.what.starts_with("purged 1 quarantined rows (stopped part way: q_3"), "{}", last.what);
}
