//! Ticks in-process: a real SQLite table, the memory store (which counts requests) and a
//! recording sink, so each promise of the tick is checked precisely.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::Position;
use dbtrigger::domain::StateDocument;
use dbtrigger::domain::lease::LeaseRecord;
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::sink::{Batch, Sink, SinkError};
use dbtrigger::source::{FetchLimit, Fetched, Probe, Source, SourceError};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::store::{StateKey, StateStore, StoreError};
use dbtrigger::tick::{ManualClock, Poller, StopReason, SystemClock, TickError, TickOutcome};
use serde_json::{Value, json};

use crate::harness::{AppRoot, Fault, FaultyStore, Orders};

struct Fixture {
    _directory: tempfile::TempDir,
    orders: Orders,
    config: PollerConfig,
}

/// A poller that writes its checkpoint as soon as a batch is acknowledged (`commitIntervalMs: 0`),
/// for the tests of how commits and deliveries interleave batch by batch.
fn per_batch_commits(mut poller: Value) -> Value {
    poller["batch"]["commitIntervalMs"] = json!(0);
    poller
}

async fn fixture(rows: i64, poller: Value) -> Fixture {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    if rows > 0 {
        orders.insert(1..=rows, 3).await;
    }
    let app = AppRoot::write(directory.path(), poller);
    let settings = Settings::from_pairs([
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_WEBHOOK".to_string(), "http://127.0.0.1:9/unused".to_string()),
        ("ORDERS_STATE".to_string(), "file:unused".to_string()),
        ("DBTRIGGER_APP_NAME".to_string(), "it".to_string()),
    ]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    Fixture { _directory: directory, orders, config }
}

fn poller(fixture: &Fixture, sink: Arc<dyn Sink>, store: Arc<dyn StateStore>, owner: &str) -> Poller {
    let source = dbtrigger::source::open(&fixture.config.source).unwrap();
    poller_over(fixture, source, sink, store, owner)
}

/// A poller reading from `source` (a wrapper of the fixture's own).
fn poller_over(
    fixture: &Fixture,
    source: Arc<dyn Source>,
    sink: Arc<dyn Sink>,
    store: Arc<dyn StateStore>,
    owner: &str,
) -> Poller {
    Poller::new(fixture.config.clone(), source, sink, store, Arc::new(SystemClock), owner.to_string())
}

fn ids(sink: &RecordingSink) -> Vec<i64> {
    sink.batches()
        .iter()
        .flat_map(|batch| batch.events.iter().map(|event| event.pk()["id"].as_i64().unwrap()))
        .collect()
}

fn key() -> StateKey {
    StateKey::new("it", "orders")
}

#[tokio::test]
async fn an_empty_tick_reads_once_and_writes_nothing() {
    let fixture = fixture(0, AppRoot::orders_poller(100)).await;
    let store = Arc::new(MemoryStore::new());
    let sink = Arc::new(RecordingSink::new());
    let poller = poller(&fixture, sink.clone(), store.clone(), "a");
    assert_eq!(poller.tick().await.unwrap(), TickOutcome::Idle);
    assert_eq!(store.request_counts(), (1, 0), "one GET, no PUT");
    assert!(store.raw(&key()).is_none());

    // Caught up: the same, with a document present.
    fixture.orders.insert(1..=10, 1).await;
    poller.tick().await.unwrap();
    let before = store.raw(&key()).unwrap();
    let (reads, writes) = store.request_counts();
    assert_eq!(poller.tick().await.unwrap(), TickOutcome::Idle);
    assert_eq!(store.request_counts(), (reads + 1, writes));
    assert_eq!(store.raw(&key()).unwrap(), before, "the document is byte for byte unchanged");
}

#[tokio::test]
async fn a_tick_delivering_k_batches_costs_one_read_and_k_plus_one_writes() {
    let fixture = fixture(1000, per_batch_commits(AppRoot::orders_poller(100))).await;
    let store = Arc::new(MemoryStore::new());
    let sink = Arc::new(RecordingSink::new());
    let poller = poller(&fixture, sink.clone(), store.clone(), "a");
    let outcome = poller.tick().await.unwrap();
    let TickOutcome::Delivered { rows, batches, stop, .. } = outcome else { panic!("{outcome:?}") };
    assert_eq!((rows, batches, stop), (1000, 10, StopReason::CaughtUp));
    assert_eq!(store.request_counts(), (1, 11), "1 GET, 1 PUT for the lease, 1 PUT per batch");
    assert_eq!(ids(&sink), (1..=1000).collect::<Vec<i64>>());

    let document = StateDocument::parse(&store.raw(&key()).unwrap()).unwrap();
    let lease = document.lease.unwrap();
    assert_eq!(lease.owner_id, None, "released by the last commit");
    assert_eq!(lease.fencing_token, sink.batches()[0].fencing_token, "and the token kept");
    assert_eq!(document.stats.rows_delivered, 1000);
}

#[tokio::test]
async fn a_released_lease_is_taken_at_once_by_another_instance_with_a_higher_token() {
    let fixture = fixture(10, AppRoot::orders_poller(100)).await;
    let store = Arc::new(MemoryStore::new());
    let first_sink = Arc::new(RecordingSink::new());
    poller(&fixture, first_sink.clone(), store.clone(), "a").tick().await.unwrap();
    fixture.orders.insert(11..=20, 3).await;
    let second_sink = Arc::new(RecordingSink::new());
    let outcome = poller(&fixture, second_sink.clone(), store.clone(), "b").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 10, .. }), "{outcome:?}");
    assert_eq!(second_sink.batches()[0].fencing_token, first_sink.batches()[0].fencing_token + 1);
    assert_eq!(ids(&second_sink), (11..=20).collect::<Vec<i64>>());
}

#[tokio::test]
async fn a_live_lease_held_elsewhere_ends_the_tick_without_a_write() {
    let fixture = fixture(10, AppRoot::orders_poller(100)).await;
    let store = Arc::new(MemoryStore::new());
    let mut document = StateDocument::new("orders", &fixture.config.fingerprint);
    let now = chrono::Utc::now();
    document.lease = Some(LeaseRecord {
        owner_id: Some("someone-else".into()),
        fencing_token: 7,
        acquired_at: Some(now),
        heartbeat_at: Some(now),
        expires_at: Some(now + chrono::Duration::seconds(60)),
    });
    store.put_raw(&key(), &document.to_bytes());
    let sink = Arc::new(RecordingSink::new());
    let outcome = poller(&fixture, sink.clone(), store.clone(), "a").tick().await.unwrap();
    assert!(
        matches!(outcome, TickOutcome::LeaseHeld { ref owner_id, .. } if owner_id == "someone-else"),
        "{outcome:?}"
    );
    assert!(sink.batches().is_empty());
    assert_eq!(store.request_counts(), (1, 0));
}

#[tokio::test]
async fn an_expired_lease_is_taken_over_with_the_next_token() {
    let fixture = fixture(10, AppRoot::orders_poller(100)).await;
    let store = Arc::new(MemoryStore::new());
    let mut document = StateDocument::new("orders", &fixture.config.fingerprint);
    let long_ago = chrono::Utc::now() - chrono::Duration::seconds(600);
    document.lease = Some(LeaseRecord {
        owner_id: Some("crashed".into()),
        fencing_token: 7,
        acquired_at: Some(long_ago),
        heartbeat_at: Some(long_ago),
        expires_at: Some(long_ago + chrono::Duration::seconds(60)),
    });
    store.put_raw(&key(), &document.to_bytes());
    let sink = Arc::new(RecordingSink::new());
    poller(&fixture, sink.clone(), store.clone(), "a").tick().await.unwrap();
    assert_eq!(sink.batches()[0].fencing_token, 8);
}

#[tokio::test]
async fn a_changed_source_definition_fails_loudly_and_touches_nothing() {
    let fixture = fixture(10, AppRoot::orders_poller(100)).await;
    let store = Arc::new(MemoryStore::new());
    store.put_raw(&key(), &StateDocument::new("orders", "sha256:older").to_bytes());
    let before = store.raw(&key()).unwrap();
    let sink = Arc::new(RecordingSink::new());
    let error = poller(&fixture, sink.clone(), store.clone(), "a").tick().await.unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, TickError::FingerprintMismatch { .. }));
    assert!(message.contains("sha256:older") && message.contains(&fixture.config.fingerprint), "{message}");
    assert!(sink.batches().is_empty());
    assert_eq!(store.raw(&key()).unwrap(), before);
}

#[tokio::test]
async fn a_corrupted_state_document_stops_the_poller_and_is_left_untouched() {
    let fixture = fixture(10, AppRoot::orders_poller(100)).await;
    for garbage in [&b"{\"version\": 1, \"checkpoint\": "[..], &br#"{"version": 99}"#[..]] {
        let store = Arc::new(MemoryStore::new());
        store.put_raw(&key(), garbage);
        let sink = Arc::new(RecordingSink::new());
        let error = poller(&fixture, sink.clone(), store.clone(), "a").tick().await.unwrap_err();
        assert!(matches!(error, TickError::Store(StoreError::Corrupt { .. })), "{error:?}");
        assert!(error.to_string().contains("left untouched"), "{error}");
        assert!(sink.batches().is_empty(), "nothing delivered");
        assert_eq!(store.raw(&key()).unwrap(), garbage, "nothing overwritten");
        assert_eq!(store.request_counts().1, 0);
    }
}

#[tokio::test]
async fn a_failed_delivery_keeps_the_checkpoint_and_the_next_tick_resends_the_same_batch() {
    let fixture = fixture(250, AppRoot::orders_poller(100)).await;
    let store = Arc::new(MemoryStore::new());
    let sink = Arc::new(RecordingSink::new());
    let poller = poller(&fixture, sink.clone(), store.clone(), "a");
    // Batch 1 lands; batch 2 fails.
    let failing = Arc::new(FailSecond { inner: sink.clone(), calls: Default::default(), failed: Default::default() });
    let failing_poller = Poller::new(
        fixture.config.clone(),
        poller.source.clone(),
        failing.clone(),
        store.clone(),
        Arc::new(SystemClock),
        "a".into(),
    );
    let error = failing_poller.tick().await.unwrap_err();
    assert!(matches!(error, TickError::Delivery { rows_committed: 100, .. }), "{error:?}");
    let document = StateDocument::parse(&store.raw(&key()).unwrap()).unwrap();
    assert_eq!(document.checkpoint.unwrap().cursor.tiebreaker["id"], json!(100));
    assert_eq!(document.lease.unwrap().owner_id, None, "released after the failure");

    poller.tick().await.unwrap();
    let failed_batch = failing.failed.lock().unwrap().clone().unwrap();
    assert_eq!(sink.batches()[1].batch_id, failed_batch.batch_id, "the same batch again");
    assert_eq!(ids(&sink), (1..=250).collect::<Vec<i64>>());
}

/// Delivers the first batch, fails the second, delivers the rest.
struct FailSecond {
    inner: Arc<RecordingSink>,
    calls: std::sync::Mutex<u32>,
    failed: std::sync::Mutex<Option<Batch>>,
}

#[async_trait]
impl Sink for FailSecond {
    async fn deliver(&self, batch: &Batch, deadline: tokio::time::Instant) -> Result<(), SinkError> {
        let call = {
            let mut calls = self.calls.lock().unwrap();
            *calls += 1;
            *calls
        };
        if call == 2 {
            *self.failed.lock().unwrap() = Some(batch.clone());
            return Err(SinkError::Transient { batch_id: batch.batch_id.clone(), reason: "HTTP 503".into() });
        }
        self.inner.deliver(batch, deadline).await
    }

    fn describe(&self) -> String {
        "fail-second".into()
    }
}

#[tokio::test]
async fn a_write_that_landed_but_answered_412_is_recognised_by_its_write_id() {
    let fixture = fixture(300, AppRoot::orders_poller(100)).await;
    // The first update lands but answers 412, as when a retried PUT's first try had landed and its
    // response was lost (seed 001 case G). Write 1 is the lease's create.
    let store = Arc::new(FaultyStore::over(Arc::new(MemoryStore::new()), |number, _| {
        if number == 2 {
            Fault::LandThenAnswer(StoreError::Conflict { location: "lost-response".into() })
        } else {
            Fault::None
        }
    }));
    let sink = Arc::new(RecordingSink::new());
    let outcome = poller(&fixture, sink.clone(), store.clone(), "a").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 300, batches: 3, .. }), "{outcome:?}");
    assert_eq!(ids(&sink), (1..=300).collect::<Vec<i64>>(), "no batch delivered twice");
}

/// A sink that takes its time.
struct SlowSink {
    inner: Arc<RecordingSink>,
    delay: Duration,
    /// Called once, mid-delivery of the first batch.
    during_first: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// A sink that takes `delay` over each delivery into `recording`.
fn slow_sink(recording: &Arc<RecordingSink>, delay: Duration) -> Arc<SlowSink> {
    Arc::new(SlowSink { inner: recording.clone(), delay, during_first: Default::default() })
}

#[async_trait]
impl Sink for SlowSink {
    async fn deliver(&self, batch: &Batch, deadline: tokio::time::Instant) -> Result<(), SinkError> {
        tokio::time::sleep(self.delay / 2).await;
        let action = self.during_first.lock().unwrap().take();
        if let Some(action) = action {
            action();
        }
        tokio::time::sleep(self.delay / 2).await;
        self.inner.deliver(batch, deadline).await
    }

    fn describe(&self) -> String {
        "slow".into()
    }
}

#[tokio::test]
async fn the_tick_budget_ends_a_tick_with_a_commit_and_the_next_tick_continues() {
    let mut settings = AppRoot::orders_poller(10);
    settings["batch"]["tickBudgetSeconds"] = json!(1);
    let fixture = fixture(100, settings).await;
    let store = Arc::new(MemoryStore::new());
    let recording = Arc::new(RecordingSink::new());
    let sink = slow_sink(&recording, Duration::from_millis(300));
    let poller = poller(&fixture, sink, store.clone(), "a");
    let outcome = poller.tick().await.unwrap();
    let TickOutcome::Delivered { batches, stop, .. } = outcome else { panic!("{outcome:?}") };
    assert_eq!(stop, StopReason::BudgetExhausted);
    assert!((3..=5).contains(&batches), "about a second of 300 ms batches: {batches}");
    let document = StateDocument::parse(&store.raw(&key()).unwrap()).unwrap();
    assert_eq!(document.lease.unwrap().owner_id, None, "the lease is released at the budget too");
    loop {
        if let TickOutcome::Delivered { stop: StopReason::CaughtUp, .. } = poller.tick().await.unwrap() {
            break;
        }
    }
    assert_eq!(ids(&recording), (1..=100).collect::<Vec<i64>>());
}

fn short_lease(size: usize) -> Value {
    let mut settings = AppRoot::orders_poller(size);
    settings["lease"] = json!({"ttlSeconds": 3, "heartbeatSeconds": 1, "clockSkewSeconds": 1});
    settings
}

#[tokio::test]
async fn a_long_delivery_renews_the_lease_while_it_runs() {
    let fixture = fixture(5, short_lease(100)).await;
    let store = Arc::new(MemoryStore::new());
    let recording = Arc::new(RecordingSink::new());
    // 4 s of delivery on a 3 s lease: only heartbeats keep it.
    let sink = slow_sink(&recording, Duration::from_secs(4));
    let outcome = poller(&fixture, sink, store.clone(), "a").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 5, .. }), "{outcome:?}");
    let (_, writes) = store.request_counts();
    assert!(writes >= 5, "acquire + about 3 heartbeats + commit, got {writes} writes");
}

#[tokio::test]
async fn a_lease_taken_over_mid_delivery_cancels_the_commit() {
    let fixture = fixture(5, short_lease(100)).await;
    let store = Arc::new(MemoryStore::new());
    let recording = Arc::new(RecordingSink::new());
    let thief_store = store.clone();
    let fingerprint = fixture.config.fingerprint.clone();
    // Mid-delivery, another instance writes the document (say after our lease looked expired to it).
    let steal: Box<dyn FnOnce() + Send> = Box::new(move || {
        let mut document = StateDocument::new("orders", &fingerprint);
        let now = chrono::Utc::now();
        document.lease = Some(LeaseRecord {
            owner_id: Some("thief".into()),
            fencing_token: 99,
            acquired_at: Some(now),
            heartbeat_at: Some(now),
            expires_at: Some(now + chrono::Duration::seconds(60)),
        });
        thief_store.put_raw(&key(), &document.to_bytes());
    });
    let sink = Arc::new(SlowSink {
        inner: recording.clone(),
        delay: Duration::from_secs(3),
        during_first: std::sync::Mutex::new(Some(steal)),
    });
    // Lost before anything was committed: a failure (the next tick would do the same), not a 200.
    let error = poller(&fixture, sink, store.clone(), "a").tick().await.unwrap_err();
    assert!(matches!(error, TickError::NoProgress { .. }), "{error:?}");
    assert!(error.to_string().contains("taken over"), "{error}");
    let document = StateDocument::parse(&store.raw(&key()).unwrap()).unwrap();
    assert!(document.checkpoint.is_none(), "the stale owner committed nothing");
    assert_eq!(document.lease.unwrap().owner_id.as_deref(), Some("thief"));
}

#[tokio::test]
async fn timestamp_cursors_in_sqlite_survive_equal_values_across_batches() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    sqlx::query("ALTER TABLE orders ADD COLUMN updated_at TEXT").execute(&orders.pool).await.unwrap();
    orders.insert(1..=95, 1).await;
    // Seven rows per timestamp, in the text layout of SQLite's own datetime().
    for id in 1..=95i64 {
        let second = id / 7;
        let text = format!("2026-01-01 10:00:{second:02}.250");
        sqlx::query("UPDATE orders SET updated_at = ? WHERE id = ?")
            .bind(text)
            .bind(id)
            .execute(&orders.pool)
            .await
            .unwrap();
    }
    let mut poller_settings = AppRoot::orders_poller(10);
    poller_settings["source"]["cursor"] = json!("updated_at");
    let app = AppRoot::write(directory.path(), poller_settings);
    let settings = Settings::from_pairs([
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_WEBHOOK".to_string(), "http://127.0.0.1:9/unused".to_string()),
        ("ORDERS_STATE".to_string(), "file:unused".to_string()),
    ]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    let store = Arc::new(MemoryStore::new());
    let recording = Arc::new(RecordingSink::new());
    let source = dbtrigger::source::open(&config.source).unwrap();
    let poller = Poller::new(config, source, recording.clone(), store.clone(), Arc::new(SystemClock), "a".into());
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 95, batches: 10, .. }), "{outcome:?}");
    assert_eq!(ids(&recording), (1..=95).collect::<Vec<i64>>());
    let document = StateDocument::parse(&store.raw(&StateKey::new("local", "orders")).unwrap()).unwrap();
    let cursor = document.checkpoint.unwrap().cursor;
    assert_eq!(cursor.kind, "timestamp");
    assert_eq!(cursor.value, json!("2026-01-01T10:00:13.250Z"));
    assert_eq!(poller.tick().await.unwrap(), TickOutcome::Idle);
}

/// Fails the first batch it is given, slowly; delivers the others at once.
struct FirstFailsSlowly {
    inner: Arc<RecordingSink>,
    calls: std::sync::Mutex<u32>,
}

#[async_trait]
impl Sink for FirstFailsSlowly {
    async fn deliver(&self, batch: &Batch, deadline: tokio::time::Instant) -> Result<(), SinkError> {
        let call = {
            let mut calls = self.calls.lock().unwrap();
            *calls += 1;
            *calls
        };
        if call == 1 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            return Err(SinkError::Transient { batch_id: batch.batch_id.clone(), reason: "HTTP 503".into() });
        }
        self.inner.deliver(batch, deadline).await
    }

    fn describe(&self) -> String {
        "first-fails-slowly".into()
    }
}

/// Seed 004's invariant: later batches acknowledged while an earlier one is still in flight do not
/// move the checkpoint past it; when it fails, the checkpoint stays before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_acknowledgement_never_moves_the_checkpoint_past_a_failed_batch() {
    let mut settings = AppRoot::orders_poller(10);
    settings["batch"]["maxInFlight"] = json!(4);
    let fixture = fixture(40, settings).await;
    let store = Arc::new(MemoryStore::new());
    let recording = Arc::new(RecordingSink::new());
    let failing = Arc::new(FirstFailsSlowly { inner: recording.clone(), calls: Default::default() });
    let error = poller(&fixture, failing, store.clone(), "a").tick().await.unwrap_err();
    assert!(matches!(error, TickError::Delivery { rows_committed: 0, .. }), "{error:?}");
    assert!(recording.batches().len() >= 3, "the later batches were acknowledged: {}", recording.batches().len());
    let document = StateDocument::parse(&store.raw(&key()).unwrap()).unwrap();
    assert!(document.checkpoint.is_none(), "nothing committed past the failed first batch");
    assert_eq!(document.lease.unwrap().owner_id, None, "and the lease was released");

    let retry = Arc::new(RecordingSink::new());
    poller(&fixture, retry.clone(), store.clone(), "a").tick().await.unwrap();
    // With four in flight, batches may land in any order: each row once, from the first batch on.
    let mut resent = ids(&retry);
    resent.sort_unstable();
    assert_eq!(resent, (1..=40).collect::<Vec<i64>>(), "the next tick resends from the first batch");
}

#[tokio::test]
async fn a_failed_heartbeat_is_retried_after_a_pause_and_the_tick_goes_on() {
    let mut settings = AppRoot::orders_poller(100);
    settings["lease"] = json!({"ttlSeconds": 4, "heartbeatSeconds": 1, "clockSkewSeconds": 1});
    let fixture = fixture(5, settings).await;
    // Writes fail from 0.9 s to 1.6 s: a passing outage during the first heartbeat.
    let started = std::time::Instant::now();
    let store = Arc::new(FaultyStore::over(Arc::new(MemoryStore::new()), move |number, _| {
        let elapsed = started.elapsed();
        if number > 1 && elapsed > Duration::from_millis(900) && elapsed < Duration::from_millis(1600) {
            Fault::Refuse(StoreError::Unavailable {
                location: "hiccup".into(),
                reason: "HTTP 503".into(),
                retryable: true,
            })
        } else {
            Fault::None
        }
    }));
    let recording = Arc::new(RecordingSink::new());
    let sink = slow_sink(&recording, Duration::from_millis(3500));
    let outcome = poller(&fixture, sink, store.clone(), "a").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 5, .. }), "{outcome:?}");
    let writes = store.writes();
    // Acquire, a failed heartbeat, its retry a second later, another heartbeat, the commit: the
    // outage is not hammered with attempts.
    assert!((4..=7).contains(&writes), "{writes} writes");
}

/// Regression (issue 9, item 8): a heartbeat that landed but answered an error (a timeout) left
/// the next write with an old ETag; its 412 was checked against the newest write id only and
/// became a false lease loss. Every unacknowledged write id of the tick is remembered.
#[tokio::test]
async fn a_heartbeat_that_landed_but_answered_an_error_is_not_a_lease_loss() {
    let fixture = fixture(5, short_lease(100)).await;
    // Write 1 takes the lease; write 2, the first heartbeat, lands but answers 503.
    let store = Arc::new(FaultyStore::over(Arc::new(MemoryStore::new()), |number, _| {
        if number == 2 {
            Fault::LandThenAnswer(StoreError::Unavailable {
                location: "timeout".into(),
                reason: "the response was lost".into(),
                retryable: true,
            })
        } else {
            Fault::None
        }
    }));
    let recording = Arc::new(RecordingSink::new());
    let sink = slow_sink(&recording, Duration::from_millis(2600));
    let outcome = poller(&fixture, sink, store.clone(), "a").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 5, .. }), "{outcome:?}");
    let document = StateDocument::parse(&store.inner.raw(&key()).unwrap()).unwrap();
    assert_eq!(document.checkpoint.unwrap().cursor.tiebreaker["id"], json!(5));
}

/// Regression (issue 24, found by the simulation after the fixes, seeds 13318 and 17891): the
/// write recording a failed batch landed but answered an error, and the release ending the tick,
/// built from the document as it was before that write, was written over it (the writer found its
/// own write there and wrote again): the failure was erased, `attempts` stayed 0 and `status`
/// said healthy. The release carries the failure.
#[tokio::test]
async fn a_failure_record_that_landed_but_answered_an_error_is_kept_by_the_release() {
    let fixture = fixture(5, AppRoot::orders_poller(100)).await;
    // Write 1 takes the lease; write 2 records the failure, lands, and answers 503.
    let store = Arc::new(FaultyStore::over(Arc::new(MemoryStore::new()), |number, _| {
        if number == 2 {
            Fault::LandThenAnswer(StoreError::Unavailable {
                location: "timeout".into(),
                reason: "the response was lost".into(),
                retryable: true,
            })
        } else {
            Fault::None
        }
    }));
    let error = poller(&fixture, Arc::new(Unavailable), store.clone(), "a").tick().await.unwrap_err();
    assert!(matches!(error, TickError::Delivery { rows_committed: 0, .. }), "{error:?}");
    let document = StateDocument::parse(&store.inner.raw(&key()).unwrap()).unwrap();
    let poison = document.poison.expect("the failure is recorded");
    assert_eq!(poison.attempts, 1);
    assert!(poison.last_error.contains("HTTP 503"), "{}", poison.last_error);
    assert_eq!(document.lease.unwrap().owner_id, None, "the lease was given back");
}

/// A receiver that answers 503 to every batch.
struct Unavailable;

#[async_trait]
impl Sink for Unavailable {
    async fn deliver(&self, batch: &Batch, _deadline: tokio::time::Instant) -> Result<(), SinkError> {
        Err(SinkError::Transient { batch_id: batch.batch_id.clone(), reason: "HTTP 503".into() })
    }

    fn describe(&self) -> String {
        "unavailable".into()
    }
}

/// Wraps a source: every read after the first takes `delay`, and read number `panic_on` (counted
/// from 1) panics.
struct ScriptedSource {
    inner: Arc<dyn Source>,
    delay: Duration,
    panic_on: Option<u32>,
    reads: std::sync::Mutex<u32>,
}

impl ScriptedSource {
    fn over(fixture: &Fixture, delay: Duration, panic_on: Option<u32>) -> Arc<ScriptedSource> {
        let inner = dbtrigger::source::open(&fixture.config.source).unwrap();
        Arc::new(ScriptedSource { inner, delay, panic_on, reads: Default::default() })
    }
}

#[async_trait]
impl Source for ScriptedSource {
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let read = {
            let mut reads = self.reads.lock().unwrap();
            *reads += 1;
            *reads
        };
        if self.panic_on == Some(read) {
            panic!("a bug in the source's read {read}");
        }
        if read > 1 {
            tokio::time::sleep(self.delay).await;
        }
        self.inner.read(probe, after, limit).await
    }

    async fn count_after(&self, after: Option<&Position>, cap: u64) -> Result<u64, SourceError> {
        self.inner.count_after(after, cap).await
    }

    async fn generation(&self) -> Result<Option<serde_json::Value>, SourceError> {
        self.inner.generation().await
    }

    fn describe(&self) -> String {
        "scripted".into()
    }
}

/// The batches after the first are read while the first is delivered. A read that panics is a
/// failed read: the tick fails with its message, keeps the batch delivered before it (committed,
/// lease released), never says it caught up, and the next tick goes on from there.
#[tokio::test]
async fn a_read_that_panics_fails_the_tick_after_committing_what_was_delivered() {
    let fixture = fixture(250, AppRoot::orders_poller(100)).await;
    let store = Arc::new(MemoryStore::new());
    let recording = Arc::new(RecordingSink::new());
    let source = ScriptedSource::over(&fixture, Duration::ZERO, Some(2));
    let error = poller_over(&fixture, source, recording.clone(), store.clone(), "a").tick().await.unwrap_err();
    assert!(matches!(error, TickError::Source(SourceError::Query { .. })), "{error:?}");
    assert!(error.to_string().contains("panicked: a bug in the source's read 2"), "{error}");
    assert_eq!(ids(&recording), (1..=100).collect::<Vec<i64>>());
    let document = StateDocument::parse(&store.raw(&key()).unwrap()).unwrap();
    assert_eq!(document.checkpoint.unwrap().cursor.tiebreaker["id"], json!(100));
    assert_eq!(document.lease.unwrap().owner_id, None, "the lease was given back");

    let next = Arc::new(RecordingSink::new());
    let outcome = poller(&fixture, next.clone(), store.clone(), "b").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 150, .. }), "{outcome:?}");
    assert_eq!(ids(&next), (101..=250).collect::<Vec<i64>>());
}

/// Regression (issue 9, item 7): the next batch's fetch ran with no heartbeat, so a query slower
/// than the lease lost it every tick after redelivering batch 1. Heartbeats now run while a fetch
/// does, and the tick reads the clock for the lease after its first query.
#[tokio::test]
async fn heartbeats_keep_the_lease_while_a_slow_fetch_runs() {
    let fixture = fixture(250, short_lease(100)).await;
    let store = Arc::new(MemoryStore::new());
    let recording = Arc::new(RecordingSink::new());
    // Longer than the 3 s lease.
    let source = ScriptedSource::over(&fixture, Duration::from_millis(3500), None);
    let outcome = poller_over(&fixture, source, recording.clone(), store.clone(), "a").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 250, batches: 3, .. }), "{outcome:?}");
    assert_eq!(ids(&recording), (1..=250).collect::<Vec<i64>>());
}

/// Regression (issue 9, item 15): a commit that failed left through `?` with the lease held, so
/// every other instance waited ttl + skew. The lease is released on every way out of a tick.
#[tokio::test]
async fn a_failed_commit_releases_the_lease() {
    let fixture = fixture(250, per_batch_commits(AppRoot::orders_poller(100))).await;
    // Write 1 takes the lease; write 2, the first commit, fails without landing.
    let store = Arc::new(FaultyStore::over(Arc::new(MemoryStore::new()), |number, _| {
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
    let recording = Arc::new(RecordingSink::new());
    let error = poller(&fixture, recording, store.clone(), "a").tick().await.unwrap_err();
    assert!(matches!(error, TickError::Store(_)), "{error:?}");
    let document = StateDocument::parse(&store.inner.raw(&key()).unwrap()).unwrap();
    assert_eq!(document.lease.unwrap().owner_id, None, "the lease was given back");
    let next = Arc::new(RecordingSink::new());
    let outcome = poller(&fixture, next.clone(), store.clone(), "b").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { .. }), "another instance goes on at once: {outcome:?}");
    assert_eq!(ids(&next).last(), Some(&250));
}

/// Regression (issue 9, item 3): a panic anywhere in a tick becomes a failed tick with its message,
/// and the lease this process held is released, instead of killing `dbtrigger tick` or blocking
/// the poller until the lease expires.
#[tokio::test]
async fn a_panic_in_a_tick_is_a_failed_tick_and_the_lease_is_released() {
    let fixture = fixture(50, AppRoot::orders_poller(100)).await;
    let store = Arc::new(FaultyStore::over(Arc::new(MemoryStore::new()), |number, _| {
        if number == 2 {
            panic!("a bug in the middle of a commit");
        }
        Fault::None
    }));
    let recording = Arc::new(RecordingSink::new());
    let poller = poller(&fixture, recording, store.clone(), "a");
    let error = poller.tick().await.unwrap_err();
    assert!(matches!(error, TickError::Panicked { .. }), "{error:?}");
    assert!(error.to_string().contains("a bug in the middle of a commit"), "{error}");
    let document = StateDocument::parse(&store.inner.raw(&key()).unwrap()).unwrap();
    assert_eq!(document.lease.unwrap().owner_id, None, "the lease was given back");
    // Issue 24, item 9: and the failed tick is recorded, for status and the watchdog.
    let failure = document.failure.expect("the panic is recorded");
    assert!(failure.last_error.contains("a bug in the middle of a commit"), "{}", failure.last_error);
    assert!(poller.tick().await.is_ok(), "and the poller is usable again");
}

/// Regression (issue 9, item 6): a deleted state document restarted the fencing token at 1, below
/// the tokens receivers had seen, so a receiver fencing on it refused every delivery for good. The
/// first token of a new document comes from the clock, and the tick says it started anew.
#[tokio::test]
async fn a_recreated_state_document_fences_above_every_earlier_token() {
    let fixture = fixture(30, AppRoot::orders_poller(10)).await;
    let directory = tempfile::tempdir().unwrap();
    let store = Arc::new(dbtrigger::store::file::FileStore::new(directory.path().to_path_buf()));
    let mut highest = 0;
    for (round, owner) in ["a", "b", "c"].iter().enumerate() {
        let recording = Arc::new(RecordingSink::new());
        fixture.orders.insert(100 + round as i64..=100 + round as i64, 1).await;
        poller(&fixture, recording.clone(), store.clone(), owner).tick().await.unwrap();
        highest = highest.max(recording.batches().iter().map(|batch| batch.fencing_token).max().unwrap());
    }
    std::fs::remove_file(store.path_of(&key())).unwrap();

    let recording = Arc::new(RecordingSink::new());
    let outcome = poller(&fixture, recording.clone(), store.clone(), "d").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { new_document: true, .. }), "{outcome:?}");
    assert!(outcome.to_string().contains("NEW STATE DOCUMENT"), "{outcome}");
    let token = recording.batches()[0].fencing_token;
    assert!(token > highest, "new token {token} must exceed every earlier one ({highest})");
}

/// Regression (issue 9, item 9): fields a newer build wrote into the state document (poison,
/// history...) survive a tick of this build.
#[tokio::test]
async fn a_tick_keeps_state_fields_it_does_not_know() {
    let fixture = fixture(20, AppRoot::orders_poller(10)).await;
    let store = Arc::new(MemoryStore::new());
    let mut stored: Value =
        serde_json::from_slice(&StateDocument::new("orders", &fixture.config.fingerprint).to_bytes()).unwrap();
    stored["lineage"] = json!({"value": "load-7"});
    stored["quarantine"] = json!({"count": 1, "location": "quarantine/it/orders/"});
    store.put_raw(&key(), &serde_json::to_vec(&stored).unwrap());
    let recording = Arc::new(RecordingSink::new());
    poller(&fixture, recording.clone(), store.clone(), "a").tick().await.unwrap();
    assert_eq!(ids(&recording).len(), 20);
    let written: Value = serde_json::from_slice(&store.raw(&key()).unwrap()).unwrap();
    assert_eq!(written["lineage"], stored["lineage"]);
    assert_eq!(written["quarantine"], stored["quarantine"]);
}

/// Regression (issue 9, item 10): a batch is bounded by bytes (`batch.maxBytes`) as well as rows,
/// so big rows cannot hold gigabytes in memory; the rows still arrive once each, in order.
#[tokio::test]
async fn big_rows_are_split_into_batches_bounded_by_bytes() {
    let mut settings = AppRoot::orders_poller(500);
    settings["batch"]["maxBytes"] = json!(300_000);
    let fixture = fixture(20, settings).await;
    sqlx::query("UPDATE orders SET note = printf('%.100000c', 'x')").execute(&fixture.orders.pool).await.unwrap();
    let store = Arc::new(MemoryStore::new());
    let recording = Arc::new(RecordingSink::new());
    let outcome = poller(&fixture, recording.clone(), store, "a").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 20, stop: StopReason::CaughtUp, .. }), "{outcome:?}");
    let sizes: Vec<usize> = recording.batches().iter().map(|batch| batch.events.len()).collect();
    // 100 kB rows, 300 kB per batch: a batch ends with the row that reaches the budget.
    assert!(sizes.iter().all(|size| *size <= 3), "{sizes:?}");
    assert!(sizes.len() >= 7, "{sizes:?}");
    assert_eq!(ids(&recording), (1..=20).collect::<Vec<i64>>());
}

/// Regression (issue 9, item 11): a webhook attempt ignored the tick budget (only retries looked
/// at it), so a hanging receiver held a tick for `timeoutSeconds` past its budget and past the
/// host's functionTimeout. Every attempt now ends at the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_receiver_cannot_hold_a_tick_past_its_budget() {
    let receiver = crate::harness::Receiver::start().await;
    receiver.set_delay(Duration::from_secs(30));
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=5, 1).await;
    let mut poller_settings = AppRoot::orders_poller(100);
    poller_settings["batch"]["tickBudgetSeconds"] = json!(2);
    poller_settings["sink"]["timeoutSeconds"] = json!(60);
    let app = AppRoot::write(directory.path(), poller_settings);
    let settings = Settings::from_pairs(app.settings(&orders, &receiver));
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink = dbtrigger::sink::open(&config.sink).unwrap();
    let store = Arc::new(MemoryStore::new());
    let poller = Poller::new(config, source, sink, store, Arc::new(SystemClock), "a".into());
    let started = std::time::Instant::now();
    let error = poller.tick().await.unwrap_err();
    let elapsed = started.elapsed();
    assert!(matches!(error, TickError::Delivery { .. }), "{error:?}");
    assert!(elapsed < Duration::from_secs(6), "the 2 s budget bounds the attempt: {elapsed:?}");
}

/// One clock: every decision about time comes from the injected clock, so a lease expires when
/// that clock says so (here moved by hand, with no sleep), skew margin included.
#[tokio::test]
async fn a_lease_expires_when_the_injected_clock_says_so() {
    let fixture = fixture(10, AppRoot::orders_poller(100)).await;
    let store = Arc::new(MemoryStore::new());
    let start = chrono::DateTime::from_timestamp(1_780_000_000, 0).unwrap();
    let mut document = StateDocument::new("orders", &fixture.config.fingerprint);
    document.lease = Some(LeaseRecord {
        owner_id: Some("crashed".into()),
        fencing_token: 7,
        acquired_at: Some(start),
        heartbeat_at: Some(start),
        expires_at: Some(start + chrono::Duration::seconds(60)),
    });
    store.put_raw(&key(), &document.to_bytes());
    let clock = Arc::new(ManualClock::at(start + chrono::Duration::seconds(30)));
    let sink = Arc::new(RecordingSink::new());
    let source = dbtrigger::source::open(&fixture.config.source).unwrap();
    let poller = Poller::new(fixture.config.clone(), source, sink.clone(), store.clone(), clock.clone(), "a".into());

    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::LeaseHeld { ref owner_id, .. } if owner_id == "crashed"), "{outcome:?}");
    // Expired by 4 s, but within the 5 s skew margin: still not taken.
    clock.set(start + chrono::Duration::seconds(64));
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::LeaseHeld { .. }));
    clock.set(start + chrono::Duration::seconds(66));
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 10, .. }), "{outcome:?}");
    assert_eq!(sink.batches()[0].fencing_token, 8);
    let written = StateDocument::parse(&store.raw(&key()).unwrap()).unwrap();
    assert_eq!(written.stats.last_tick_at, Some(start + chrono::Duration::seconds(66)), "written by the same clock");
}

/// A state store whose writes take a while, logging when each starts and ends.
struct SlowWrites {
    inner: Arc<MemoryStore>,
    delay: Duration,
    log: Arc<std::sync::Mutex<Vec<String>>>,
}

#[async_trait]
impl StateStore for SlowWrites {
    async fn read(&self, key: &StateKey) -> Result<Option<dbtrigger::store::Versioned>, dbtrigger::store::StoreError> {
        self.inner.read(key).await
    }

    async fn write(
        &self,
        key: &StateKey,
        document: &StateDocument,
        condition: dbtrigger::store::WriteCondition,
    ) -> Result<dbtrigger::store::ETag, dbtrigger::store::StoreError> {
        tokio::time::sleep(self.delay).await;
        let written = self.inner.write(key, document, condition).await;
        let at = document.checkpoint.as_ref().map(|checkpoint| checkpoint.cursor.tiebreaker["id"].clone());
        self.log.lock().unwrap().push(format!("written {}", at.map(|id| id.to_string()).unwrap_or("lease".into())));
        written
    }

    fn describe(&self) -> String {
        "slow writes".into()
    }
}

/// A sink that logs each delivery as it starts.
struct LoggingSink {
    inner: RecordingSink,
    log: Arc<std::sync::Mutex<Vec<String>>>,
}

#[async_trait]
impl Sink for LoggingSink {
    async fn deliver(
        &self,
        batch: &dbtrigger::sink::Batch,
        deadline: tokio::time::Instant,
    ) -> Result<(), dbtrigger::sink::SinkError> {
        let first = batch.events[0].pk()["id"].clone();
        self.log.lock().unwrap().push(format!("deliver from {first}"));
        self.inner.deliver(batch, deadline).await
    }

    fn describe(&self) -> String {
        "logging".into()
    }
}

/// Issue 15: at maxInFlight 1 the receiver still sees batches one at a time and in order, but a
/// batch's commit no longer holds up the next delivery: batch k+1 is sent while the commit of
/// batch k is being written, and the blob budget stays 1 GET and k + 1 PUTs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_does_not_hold_up_the_next_delivery() {
    let fixture = fixture(30, per_batch_commits(AppRoot::orders_poller(10))).await;
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let memory = Arc::new(MemoryStore::new());
    let store = Arc::new(SlowWrites { inner: memory.clone(), delay: Duration::from_millis(150), log: log.clone() });
    let sink = Arc::new(LoggingSink { inner: RecordingSink::new(), log: log.clone() });
    let started = std::time::Instant::now();
    let outcome = poller(&fixture, sink.clone(), store, "a").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 30, batches: 3, .. }), "{outcome:?}");
    assert_eq!(ids(&sink.inner), (1..=30).collect::<Vec<i64>>(), "in order, each once");
    // Regression: batches acknowledged while a commit was written were left waiting for the
    // heartbeat timer (15 s) before their own commit.
    assert!(started.elapsed() < Duration::from_secs(10), "the tick waited: {:?}", started.elapsed());
    let log = log.lock().unwrap().clone();
    let position =
        |entry: &str| log.iter().position(|line| line == entry).unwrap_or_else(|| panic!("{entry}: {log:?}"));
    assert!(
        position("deliver from 11") < position("written 10"),
        "batch 2 went out while batch 1's commit was written: {log:?}"
    );
    // Commits in order, the last at the end; batches acknowledged while a commit was written are
    // covered by the next one, so there may be fewer than k + 1 PUTs, never more.
    let written: Vec<i64> =
        log.iter().filter_map(|line| line.strip_prefix("written ").and_then(|id| id.parse().ok())).collect();
    assert!(written.windows(2).all(|pair| pair[0] < pair[1]) && written.last() == Some(&30), "{log:?}");
    let (reads, writes) = memory.request_counts();
    assert_eq!(reads, 1, "1 GET");
    assert!((2..=4).contains(&writes), "at most k + 1 PUTs: {log:?}");
}

/// Issue 15: with the default commit interval (1 s), a catch-up faster than that writes its
/// checkpoint once, at its end: 1 GET and 2 PUTs for 10 batches, the lease given back.
#[tokio::test]
async fn a_fast_catch_up_writes_its_checkpoint_once_at_the_end() {
    let fixture = fixture(1000, AppRoot::orders_poller(100)).await;
    let store = Arc::new(MemoryStore::new());
    let sink = Arc::new(RecordingSink::new());
    let outcome = poller(&fixture, sink.clone(), store.clone(), "a").tick().await.unwrap();
    assert!(
        matches!(outcome, TickOutcome::Delivered { rows: 1000, batches: 10, stop: StopReason::CaughtUp, .. }),
        "{outcome:?}"
    );
    assert_eq!(store.request_counts(), (1, 2), "1 GET, the lease, one commit that gives it back");
    assert_eq!(ids(&sink), (1..=1000).collect::<Vec<i64>>());
    let document = StateDocument::parse(&store.raw(&key()).unwrap()).unwrap();
    assert_eq!(document.stats.rows_delivered, 1000);
    assert_eq!(document.lease.unwrap().owner_id, None);
}

/// A catch-up slower than the commit interval writes its checkpoint as it goes, about once per
/// interval and never once per batch, in order: what a crash sends again stays within an interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_catch_up_commits_about_once_per_interval() {
    let mut settings = AppRoot::orders_poller(10);
    settings["batch"]["commitIntervalMs"] = json!(300);
    // 12 batches of 100 ms each: 1.2 s of deliveries.
    let fixture = fixture(120, settings).await;
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let memory = Arc::new(MemoryStore::new());
    let store = Arc::new(SlowWrites { inner: memory.clone(), delay: Duration::ZERO, log: log.clone() });
    let recording = Arc::new(RecordingSink::new());
    let outcome = poller(&fixture, slow_sink(&recording, Duration::from_millis(100)), store, "a").tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 120, batches: 12, .. }), "{outcome:?}");
    assert_eq!(ids(&recording), (1..=120).collect::<Vec<i64>>());
    let log = log.lock().unwrap().clone();
    let written: Vec<i64> =
        log.iter().filter_map(|line| line.strip_prefix("written ").and_then(|id| id.parse().ok())).collect();
    // About four commits (at 0.3, 0.6, 0.9 s and the end); at least one before the end, far fewer
    // than one per batch.
    assert!((2..=7).contains(&written.len()), "{log:?}");
    assert!(written.windows(2).all(|pair| pair[0] < pair[1]) && written.last() == Some(&120), "{log:?}");
    assert!(written[0] < 120, "the checkpoint moved while the tick was still delivering: {log:?}");
}
