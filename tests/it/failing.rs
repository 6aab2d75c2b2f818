//! Every failing tick is visible (issue 24, item 9): whatever failed (the source, the checkpoint,
//! the store), the tick records its attempts and error in the state document, `status` shows them
//! and exits 1, the watchdog reports `failing`; a tick that ends well, or finds nothing to do,
//! clears them. A store that refuses every write cannot record anything: the watchdog's `stalled`
//! finds that poller.

use std::sync::Arc;

use async_trait::async_trait;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::watchdog::{FindingKind, judge};
use dbtrigger::domain::{Position, StateDocument};
use dbtrigger::source::{FetchLimit, Fetched, Probe, Source, SourceError};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::store::{StateKey, StateStore, StoreError};
use dbtrigger::tick::{Poller, SystemClock, TickError, TickOutcome};
use serde_json::{Value, json};

use crate::harness::{AppRoot, Fault, FaultyStore, Orders, Receiver, run_dbtrigger};

/// Regression (issue 24, item 9): a bad `opColumn` value failed every tick on its first fetch with
/// nothing written, so `status` said healthy and the watchdog saw nothing. Now each failed tick is
/// counted in the document: `status` exits 1 with the attempts and the error, the watchdog reports
/// `failing`; once the bad rows are gone, an idle tick clears the record in one write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_op_column_value_is_counted_shown_and_cleared_once_gone() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    // The notes say "order 1"…: no operation an opColumn may hold.
    orders.insert(1..=5, 1).await;
    let receiver = Receiver::start().await;
    let mut poller = AppRoot::orders_poller(100);
    poller["source"]["opColumn"] = json!("note");
    let app = AppRoot::write(directory.path(), poller);
    let settings = app.settings(&orders, &receiver);
    std::fs::create_dir_all(app.root.join("watchdog")).unwrap();
    let watchdog = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
        "watchdog": {"state": {"connection": "ORDERS_STATE"}}
    });
    std::fs::write(app.root.join("watchdog/function.json"), watchdog.to_string()).unwrap();

    for _ in 0..2 {
        let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
        assert!(!ok && stdout.contains("opColumn"), "{stdout}{stderr}");
    }
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["status", "--json", "--poller", "orders"]);
    assert!(!ok, "unhealthy: exit 1: {stdout}");
    let status: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(status[0]["attempts"], 2, "{status}");
    assert!(status[0]["last_error"].as_str().unwrap().contains("opColumn \"note\""), "{status}");
    assert_eq!(status[0]["healthy"], false);
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(!ok && stdout.contains("finding=failing function=orders"), "{stdout}");
    assert!(receiver.acknowledged_ids().is_empty());

    sqlx::query("DELETE FROM orders").execute(&orders.pool).await.unwrap();
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains("outcome=idle") && stdout.contains("blob_writes=1"), "one write clears it: {stdout}");
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["status", "--json", "--poller", "orders"]);
    assert!(ok, "healthy again: {stdout}");
    let status: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!((status[0]["attempts"].as_u64(), &status[0]["last_error"]), (Some(0), &Value::Null));
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok && stdout.contains("blob_writes=0"), "an idle tick with nothing to clear writes nothing: {stdout}");
}

struct Fixture {
    _directory: tempfile::TempDir,
    orders: Orders,
    _receiver: Receiver,
    config: PollerConfig,
}

async fn fixture(rows: i64, size: usize) -> Fixture {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=rows, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(size));
    let mut settings = app.settings(&orders, &receiver);
    settings.push(("DBTRIGGER_APP_NAME".into(), "it".into()));
    let config = PollerConfig::load(&app.root, "orders", &Settings::from_pairs(settings), None).unwrap();
    Fixture { _directory: directory, orders, _receiver: receiver, config }
}

fn poller(fixture: &Fixture, source: Arc<dyn Source>, store: Arc<dyn StateStore>) -> Poller {
    let sink = dbtrigger::sink::open(&fixture.config.sink).unwrap();
    Poller::new(fixture.config.clone(), source, sink, store, Arc::new(SystemClock), "a".into())
}

fn document(store: &MemoryStore) -> StateDocument {
    StateDocument::parse(&store.raw(&StateKey::new("it", "orders")).unwrap()).unwrap()
}

/// A source that reads from the beginning whatever it is asked (a bug, or a stored position it
/// reads differently than it wrote): its second batch goes back over its first.
struct IgnoresTheCheckpoint {
    inner: Arc<dyn Source>,
}

#[async_trait]
impl Source for IgnoresTheCheckpoint {
    async fn read(&self, probe: Probe, _after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        self.inner.read(probe, None, limit).await
    }

    async fn count_after(&self, after: Option<&Position>, cap: u64) -> Result<u64, SourceError> {
        self.inner.count_after(after, cap).await
    }

    async fn generation(&self) -> Result<Option<Value>, SourceError> {
        self.inner.generation().await
    }

    fn describe(&self) -> String {
        "ignores-the-checkpoint".into()
    }
}

/// Regression (issue 24, item 9): a checkpoint regression failed every tick after its first batch
/// with nothing recorded. It is now counted, tick after tick, and `status` shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_regression_is_counted_and_shown_by_status() {
    let fixture = fixture(10, 5).await;
    let store = Arc::new(MemoryStore::new());
    let inner = dbtrigger::source::open(&fixture.config.source).unwrap();
    let buggy = poller(&fixture, Arc::new(IgnoresTheCheckpoint { inner }), store.clone());
    for attempt in 1..=2u32 {
        let error = buggy.tick().await.unwrap_err();
        assert!(matches!(error, TickError::Checkpoint(_)), "{error:?}");
        let document = document(&store);
        let failure = document.failure.expect("recorded");
        assert_eq!(failure.attempts, attempt);
        assert!(failure.last_error.contains("refusing to move the checkpoint"), "{}", failure.last_error);
        assert_eq!(document.lease.unwrap().owner_id, None, "given back in the same write");
    }
    let health = dbtrigger::status::of_poller("orders", &buggy, chrono::Utc::now()).await;
    assert!(!health.healthy, "{health:?}");
    assert_eq!(health.attempts, 2);
    assert!(health.last_error.unwrap().contains("refusing to move the checkpoint"));
    drop(fixture.orders);
}

/// Regression (issue 24, item 9): a commit that failed with a store error (not a lost lease) left
/// nothing for `status`. The write that gives the lease back now records it; the next tick that
/// ends well clears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_is_recorded_with_the_release_and_cleared_by_a_good_tick() {
    let fixture = fixture(10, 100).await;
    let memory = Arc::new(MemoryStore::new());
    // Write 1 takes the lease; write 2, the commit, fails without landing; write 3 releases.
    let store = Arc::new(FaultyStore::over(memory.clone(), |number, _| {
        if number == 2 {
            Fault::Refuse(StoreError::Unavailable {
                location: "blob".into(),
                reason: "HTTP 500".into(),
                retryable: false,
            })
        } else {
            Fault::None
        }
    }));
    let source = dbtrigger::source::open(&fixture.config.source).unwrap();
    let failing = poller(&fixture, source.clone(), store.clone());
    let error = failing.tick().await.unwrap_err();
    assert!(matches!(error, TickError::Store(_)), "{error:?}");
    let failure = document(&memory).failure.expect("recorded");
    assert_eq!(failure.attempts, 1);
    assert!(failure.last_error.contains("HTTP 500"), "{}", failure.last_error);
    let health = dbtrigger::status::of_poller("orders", &failing, chrono::Utc::now()).await;
    assert_eq!((health.healthy, health.attempts), (false, 1));

    // The release recorded the rows acknowledged: the next tick has new rows only.
    fixture.orders.insert(11..=12, 1).await;
    let outcome = failing.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { .. }), "{outcome:?}");
    assert_eq!(document(&memory).failure, None, "cleared by the tick that ended well");
}

/// Issue 24, item 9: a storage identity that may read but not write cannot record anything; such
/// a poller is still found: rows wait behind a checkpoint that never moves, and the watchdog's
/// `stalled` reports it (while `status`, a single look with nothing recorded, cannot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_refuses_every_write_is_found_stalled_by_the_watchdog() {
    let fixture = fixture(5, 100).await;
    let store = Arc::new(FaultyStore::over(Arc::new(MemoryStore::new()), |_, _| {
        Fault::Refuse(StoreError::Unavailable {
            location: "blob".into(),
            reason: "HTTP 403: this identity may not write".into(),
            retryable: false,
        })
    }));
    let source = dbtrigger::source::open(&fixture.config.source).unwrap();
    let read_only = poller(&fixture, source, store.clone());
    let interval = chrono::Duration::minutes(5);
    let started = chrono::Utc::now();
    let mut seen = None;
    for look in 0..4 {
        let error = read_only.tick().await.unwrap_err();
        assert!(error.to_string().contains("may not write"), "{error}");
        let now = started + interval * look;
        let health = dbtrigger::status::of_poller("orders", &read_only, now).await;
        assert_eq!(health.lag_rows, Some(5));
        let (findings, remembered) = judge(&health, Some(interval), 3, seen.as_ref(), now);
        let stalled = findings.iter().any(|finding| finding.kind == FindingKind::Stalled);
        assert_eq!(stalled, look == 3, "stalled after three intervals, not before: {findings:?}");
        seen = Some(remembered);
    }
    assert!(store.writes() >= 8, "every tick tried to write (the lease, then the failure)");
}
