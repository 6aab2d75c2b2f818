//! How a tick says it ended (issue 45, finding 7): from what is left when its loop ends, never
//! from where the loop noticed its deadline. A real SQLite table, the memory store, a recording
//! sink, and a clock the test moves.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::{Position, StateDocument};
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::source::{FetchLimit, Fetched, Probe, Source, SourceError};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::store::{ETag, StateKey, StateStore, StoreError, Versioned, WriteCondition};
use dbtrigger::tick::{ManualClock, Poller, StopReason, TickOutcome};
use serde_json::json;
use tokio::sync::Notify;

use crate::harness::{AppRoot, Orders};

const BUDGET_SECONDS: i64 = 10;

/// The second read waits until the store's second write (the heartbeat's commit) has started,
/// and then returns while that write is still running.
struct HeldRead {
    inner: Arc<dyn Source>,
    reads: std::sync::Mutex<u32>,
    commit_started: Arc<Notify>,
}

#[async_trait]
impl Source for HeldRead {
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let read = {
            let mut reads = self.reads.lock().unwrap();
            *reads += 1;
            *reads
        };
        if read == 2 {
            self.commit_started.notified().await;
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
        "held read".into()
    }
}

/// The second write (the commit a heartbeat brings forward) moves the clock past the tick's
/// deadline, lets the held read end, and lands a little later.
struct DeadlineDuringCommit {
    inner: Arc<MemoryStore>,
    clock: Arc<ManualClock>,
    deadline: chrono::DateTime<chrono::Utc>,
    writes: std::sync::Mutex<u32>,
    commit_started: Arc<Notify>,
}

#[async_trait]
impl StateStore for DeadlineDuringCommit {
    async fn read(&self, key: &StateKey) -> Result<Option<Versioned>, StoreError> {
        self.inner.read(key).await
    }

    async fn write(
        &self,
        key: &StateKey,
        document: &StateDocument,
        condition: WriteCondition,
    ) -> Result<ETag, StoreError> {
        let write = {
            let mut writes = self.writes.lock().unwrap();
            *writes += 1;
            *writes
        };
        if write == 2 {
            self.clock.set(self.deadline + chrono::Duration::seconds(1));
            self.commit_started.notify_one();
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        self.inner.write(key, document, condition).await
    }

    fn describe(&self) -> String {
        "deadline during commit".into()
    }
}

/// Regression (issue 45, finding 7): the deadline passed while a commit was written, the batch
/// read meanwhile could no longer be sent, and the loop ended with it unsent: the tick said it
/// had caught up and its summary counted no rows left. It says the budget ran out, counts the
/// row left, and the next tick delivers it.
#[tokio::test]
async fn a_batch_left_unsent_at_the_deadline_is_never_reported_caught_up() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=3, 3).await;
    let mut settings = AppRoot::orders_poller(2);
    settings["batch"]["tickBudgetSeconds"] = json!(BUDGET_SECONDS);
    // Acknowledged batches wait for a heartbeat, which comes after a second: its commit is the one
    // the deadline passes during.
    settings["batch"]["commitIntervalMs"] = json!(60_000);
    settings["lease"] = json!({"ttlSeconds": 300, "heartbeatSeconds": 1, "clockSkewSeconds": 5});
    let app = AppRoot::write(directory.path(), settings);
    let settings = Settings::from_pairs([
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_WEBHOOK".to_string(), "http://127.0.0.1:9/unused".to_string()),
        ("ORDERS_STATE".to_string(), "file:unused".to_string()),
        ("DBTRIGGER_APP_NAME".to_string(), "it".to_string()),
    ]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();

    let start = chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap();
    let clock = Arc::new(ManualClock::at(start));
    let commit_started = Arc::new(Notify::new());
    let source = Arc::new(HeldRead {
        inner: dbtrigger::source::open(&config.source).unwrap(),
        reads: Default::default(),
        commit_started: commit_started.clone(),
    });
    let memory = Arc::new(MemoryStore::new());
    let store = Arc::new(DeadlineDuringCommit {
        inner: memory.clone(),
        clock: clock.clone(),
        deadline: start + chrono::Duration::seconds(BUDGET_SECONDS),
        writes: Default::default(),
        commit_started,
    });
    let sink = Arc::new(RecordingSink::new());
    let poller = Poller::new(config.clone(), source, sink.clone(), store, clock.clone(), "a".into());

    let (result, report) = tokio::time::timeout(Duration::from_secs(30), poller.tick_reported()).await.unwrap();
    let outcome = result.unwrap();
    let delivered: Vec<i64> = sink
        .batches()
        .iter()
        .flat_map(|batch| batch.events.iter().map(|event| event.pk()["id"].as_i64().unwrap()))
        .collect();
    assert_eq!(delivered, vec![1, 2], "the batch read after the deadline is not sent");
    assert!(
        matches!(outcome, TickOutcome::Delivered { stop: StopReason::BudgetExhausted, rows: 2, .. }),
        "a tick that left a batch unsent ran out of budget, it did not catch up: {outcome:?}"
    );
    let lag = report.lag_after.expect("the rows left are counted");
    assert_eq!(lag.rows, 1, "one row is left after the checkpoint");

    // The next tick (the clock well past the lease) delivers the row left.
    clock.set(start + chrono::Duration::seconds(600));
    let source = dbtrigger::source::open(&config.source).unwrap();
    let plain = Poller::new(config, source, sink.clone(), memory, clock, "b".into());
    let next = plain.tick().await.unwrap();
    assert!(matches!(next, TickOutcome::Delivered { stop: StopReason::CaughtUp, rows: 1, .. }), "{next:?}");
}
