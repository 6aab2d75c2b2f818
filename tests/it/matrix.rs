//! Seed 001's failure matrix, cases A to I, each on real components: a SQLite table, the state in
//! Azurite, a real webhook receiver on loopback, faults injected at exact points (a store or sink
//! wrapper, a tick cut off mid-flight as a crash would) and time moved by the injected clock. Each
//! asserts what the case promises: no row lost, only the duplicates the case allows, the checkpoint
//! where it must be, and the poller not stuck.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;
use dbtrigger::config::{PollerConfig, Settings, StorageConnection};
use dbtrigger::domain::StateDocument;
use dbtrigger::domain::lease::LeaseRecord;
use dbtrigger::sink::{Batch, Sink, SinkError};
use dbtrigger::store::azure_blob::AzureBlobStore;
use dbtrigger::store::{StateKey, StateStore, StoreError, WriteCondition, quarantine};
use dbtrigger::tick::{ManualClock, Poller, StopReason, TickError, TickOutcome};
use serde_json::{Value, json};

use crate::harness::{AppRoot, Fault, FaultyStore, Orders, Receiver};
use crate::services::azurite;

struct Case {
    _directory: tempfile::TempDir,
    orders: Orders,
    receiver: Receiver,
    config: PollerConfig,
    store: Arc<AzureBlobStore>,
    clock: Arc<ManualClock>,
}

async fn case(rows: i64, size: usize, tune: impl FnOnce(&mut Value)) -> Case {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=rows, 1).await;
    let receiver = Receiver::start().await;
    let mut poller = AppRoot::orders_poller(size);
    poller["sink"]["maxRetries"] = json!(0);
    poller["lease"] = json!({"ttlSeconds": 30, "heartbeatSeconds": 10, "clockSkewSeconds": 5});
    tune(&mut poller);
    let app = AppRoot::write(directory.path(), poller);
    let settings = Settings::from_pairs(app.settings(&orders, &receiver)).with("DBTRIGGER_APP_NAME", "matrix");
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    let connection = StorageConnection::parse_connection_string(&azurite().connection_string()).unwrap();
    let container = format!("m{}", uuid::Uuid::new_v4().simple());
    let store = Arc::new(AzureBlobStore::new(&connection, &container).unwrap());
    let clock = Arc::new(ManualClock::at(Utc::now()));
    Case { _directory: directory, orders, receiver, config, store, clock }
}

impl Case {
    fn poller(&self, owner: &str, store: Arc<dyn StateStore>, sink: Option<Arc<dyn Sink>>) -> Poller {
        let sink = sink.unwrap_or_else(|| dbtrigger::sink::open(&self.config.sink).unwrap());
        Poller::new(
            self.config.clone(),
            dbtrigger::source::open(&self.config.source).unwrap(),
            sink,
            store,
            self.clock.clone(),
            owner.into(),
        )
        .with_quarantine(self.store.clone())
    }

    fn plain(&self, owner: &str) -> Poller {
        self.poller(owner, self.store.clone(), None)
    }

    async fn document(&self) -> StateDocument {
        self.store.read(&StateKey::new("matrix", "orders")).await.unwrap().unwrap().document
    }

    async fn checkpoint_id(&self) -> Option<i64> {
        self.document().await.checkpoint.map(|checkpoint| checkpoint.cursor.tiebreaker["id"].as_i64().unwrap())
    }

    /// Every row acknowledged at least once; returns how many acknowledgements were duplicates.
    fn assert_nothing_lost(&self, rows: i64) -> usize {
        let ids = self.receiver.acknowledged_ids();
        let unique: BTreeSet<i64> = ids.iter().copied().collect();
        assert_eq!(unique, (1..=rows).collect::<BTreeSet<i64>>(), "no row lost");
        ids.len() - unique.len()
    }
}

/// Ticks until caught up; a poller that does not get there is stuck.
async fn catch_up(poller: &Poller) {
    for _ in 0..20 {
        if let Ok(TickOutcome::Delivered { stop: StopReason::CaughtUp, .. } | TickOutcome::Idle) = poller.tick().await {
            return;
        }
    }
    panic!("the poller is stuck");
}

/// The case's store, with write number `fail` (from 1) failing: landing first, or not at all.
fn faulty(case: &Case, fail: u32, land: bool) -> Arc<FaultyStore<AzureBlobStore>> {
    Arc::new(FaultyStore::over(case.store.clone(), move |number, _| {
        let error = StoreError::Unavailable {
            location: "azurite".into(),
            reason: "HTTP 500 (injected)".into(),
            retryable: false,
        };
        match (number == fail, land) {
            (false, _) => Fault::None,
            (true, true) => Fault::LandThenAnswer(error),
            (true, false) => Fault::Refuse(error),
        }
    }))
}

/// Case A: the handler fails. The checkpoint does not move; the next tick delivers the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_a_handler_failure() {
    let case = case(30, 10, |_| {}).await;
    case.receiver.answer_next(500, "boom");
    let poller = case.plain("a");
    assert!(matches!(poller.tick().await.unwrap_err(), TickError::Delivery { rows_committed: 0, .. }));
    assert_eq!(case.checkpoint_id().await, None, "the checkpoint did not move");
    catch_up(&poller).await;
    assert_eq!(case.assert_nothing_lost(30), 0, "a refused delivery is no duplicate");
    assert_eq!(case.checkpoint_id().await, Some(30));
}

/// Case B: the handler succeeds, the commit fails. The tick fails; the batch may come again, but
/// here the lease release that follows the failed commit still records the acknowledged batch, so
/// nothing does. With the release failing too, the batch would be delivered again (case E shows
/// that path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_b_handler_success_commit_failure() {
    let case = case(30, 10, |_| {}).await;
    // Write 1 takes the lease; write 2, the first commit, fails without landing.
    let poller = case.poller("a", faulty(&case, 2, false), None);
    assert!(matches!(poller.tick().await.unwrap_err(), TickError::Store(_)));
    // Batches went on while the failed commit of batch 1 was written: the tick waited for them,
    // and the release carried every acknowledged batch.
    assert!(case.checkpoint_id().await >= Some(10), "the release carried the acknowledged batches");
    assert_eq!(case.document().await.lease.unwrap().owner_id, None, "and gave the lease back");
    catch_up(&case.plain("b")).await;
    assert_eq!(case.assert_nothing_lost(30), 0);
    assert_eq!(case.checkpoint_id().await, Some(30));
}

/// A sink that lets something happen in the middle of its first delivery.
struct Meddling {
    inner: Arc<dyn Sink>,
    during_first: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    pause: Duration,
}

#[async_trait]
impl Sink for Meddling {
    async fn deliver(&self, batch: &Batch, deadline: tokio::time::Instant) -> Result<(), SinkError> {
        let action = self.during_first.lock().unwrap().take();
        if let Some(action) = action {
            action();
            tokio::time::sleep(self.pause).await;
        }
        self.inner.deliver(batch, deadline).await
    }

    fn describe(&self) -> String {
        "meddling".into()
    }
}

/// Case C: the lease is taken over mid-delivery; the stale owner's commit is refused by the ETag
/// and the new owner delivers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_c_commit_after_lease_loss() {
    let case = case(30, 10, |_| {}).await;
    let thief_store = case.store.clone();
    let steal: Box<dyn FnOnce() + Send> = Box::new(move || {
        let key = StateKey::new("matrix", "orders");
        tokio::spawn(async move {
            let mut current = thief_store.read(&key).await.unwrap().unwrap();
            let now = Utc::now();
            current.document.lease = Some(LeaseRecord {
                owner_id: Some("thief".into()),
                fencing_token: current.document.lease.map(|lease| lease.fencing_token + 1).unwrap_or(1),
                acquired_at: Some(now),
                heartbeat_at: Some(now),
                expires_at: Some(now + chrono::Duration::seconds(30)),
            });
            thief_store.write(&key, &current.document, WriteCondition::Matches(current.etag)).await.unwrap();
        });
    });
    let sink = Arc::new(Meddling {
        inner: dbtrigger::sink::open(&case.config.sink).unwrap(),
        during_first: Mutex::new(Some(steal)),
        pause: Duration::from_millis(500),
    });
    let error = case.poller("a", case.store.clone(), Some(sink)).tick().await.unwrap_err();
    assert!(matches!(error, TickError::NoProgress { .. }), "{error:?}");
    assert_eq!(case.checkpoint_id().await, None, "the stale owner committed nothing");
    // The thief's lease expires; whoever comes next delivers everything.
    case.clock.advance(chrono::Duration::seconds(120));
    catch_up(&case.plain("b")).await;
    // Again: what the stale owner sent and could not commit (deliveries go on while a commit is
    // written, so that may be every batch it had read); nothing is lost.
    case.assert_nothing_lost(30);
}

/// Case D: a row updated again before it was delivered: only its latest state is seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_d_row_updated_again() {
    let case = case(5, 10, |_| {}).await;
    for round in 1..=2 {
        sqlx::query("UPDATE orders SET note = ?, version = version + 100 WHERE id = 3")
            .bind(format!("edit {round}"))
            .execute(&case.orders.pool)
            .await
            .unwrap();
    }
    catch_up(&case.plain("a")).await;
    assert_eq!(case.assert_nothing_lost(5), 0);
    let deliveries = case.receiver.acknowledged();
    let notes: Vec<&Value> = deliveries
        .iter()
        .flat_map(|received| received.envelope["events"].as_array().unwrap())
        .filter(|event| event["pk"]["id"] == 3)
        .map(|event| &event["row"]["note"])
        .collect();
    assert_eq!(notes, [&json!("edit 2")], "once, in its latest state");
}

/// Waits (bounded) until `condition` holds.
async fn until(what: &str, condition: impl Fn() -> bool) {
    for _ in 0..500 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Case E: a crash after the fetch, before the handler answered: the tick is cut off (its task
/// aborted, as a killed process stops) while the receiver holds the request, the lease it took
/// expires, and the next owner delivers the same batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_e_crash_after_fetch_before_handler() {
    let case = case(30, 10, |_| {}).await;
    case.receiver.set_delay(Duration::from_secs(5));
    let crashed = Arc::new(case.plain("crashed"));
    let running = tokio::spawn({
        let crashed = crashed.clone();
        async move { crashed.tick().await }
    });
    until("the first batch reached the receiver", || case.receiver.max_concurrent() >= 1).await;
    running.abort();
    case.receiver.set_delay(Duration::ZERO);
    let next = case.plain("b");
    assert!(
        matches!(next.tick().await.unwrap(), TickOutcome::LeaseHeld { .. }),
        "the crashed owner's lease still holds"
    );
    case.clock.advance(chrono::Duration::seconds(36));
    catch_up(&next).await;
    // Again: what the stale owner sent and could not commit (deliveries go on while a commit is
    // written, so that may be every batch it had read); nothing is lost.
    case.assert_nothing_lost(30);
    assert_eq!(case.checkpoint_id().await, Some(30));
}

/// Case F: a crash after partial side effects: the batch is sent in parts (maxBodyBytes), the
/// receiver takes the first part and holds the second when the process dies; the whole batch is
/// delivered again, the landed part included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_f_crash_after_partial_side_effects() {
    let case = case(20, 20, |poller| poller["sink"]["maxBodyBytes"] = json!(2048)).await;
    // The receiver answers the first request at once and holds the next ones.
    let gate = Arc::new(Mutex::new(0u32));
    let hook = {
        let gate = gate.clone();
        let receiver_url = case.receiver.url.clone();
        move |body: axum::body::Bytes| {
            let gate = gate.clone();
            let receiver_url = receiver_url.clone();
            async move {
                let number = {
                    let mut count = gate.lock().unwrap();
                    *count += 1;
                    *count
                };
                if number == 2 {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                // Hand it to the recording receiver, which acknowledges it.
                let answer = reqwest::Client::new().post(receiver_url).body(body).send().await.unwrap();
                (axum::http::StatusCode::from_u16(answer.status().as_u16()).unwrap(), "{}")
            }
        }
    };
    let router = axum::Router::new().route("/hook", axum::routing::post(hook));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    let mut config = case.config.clone();
    if let dbtrigger::config::SinkConfig::Webhook(webhook) = &mut config.sink {
        webhook.url = dbtrigger::config::OutboundUrl::new(url::Url::parse(&url).unwrap());
    }
    let sink = dbtrigger::sink::open(&config.sink).unwrap();
    let crashed = Arc::new(case.poller("crashed", case.store.clone(), Some(sink)));
    let running = tokio::spawn({
        let crashed = crashed.clone();
        async move { crashed.tick().await }
    });
    until("the second part is held", || *gate.lock().unwrap() >= 2).await;
    running.abort();
    let landed_before = case.receiver.acknowledged_ids().len();
    assert!(landed_before > 0 && landed_before < 20, "one part landed before the crash: {landed_before}");
    case.clock.advance(chrono::Duration::seconds(36));
    catch_up(&case.plain("b")).await;
    let duplicates = case.assert_nothing_lost(20);
    assert_eq!(duplicates, landed_before, "the landed part came again, nothing else twice");
}

/// Case G: the commit's answer is lost although it landed. The tick fails, yet the next one
/// starts after that commit: no duplicate, no loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_g_commit_response_timeout() {
    let case = case(30, 10, |_| {}).await;
    // Write 2, the first commit, lands but answers an error.
    let poller = case.poller("a", faulty(&case, 2, true), None);
    assert!(poller.tick().await.is_err());
    // The commit landed; the release, recognising it by its write id, also recorded the batches
    // delivered while it was written.
    assert!(case.checkpoint_id().await >= Some(10), "the commit landed");
    catch_up(&case.plain("a")).await;
    assert_eq!(case.assert_nothing_lost(30), 0, "nothing delivered twice");
}

/// A sink that takes a while, so that heartbeats are due.
struct Slow {
    inner: Arc<dyn Sink>,
    delay: Duration,
}

#[async_trait]
impl Sink for Slow {
    async fn deliver(&self, batch: &Batch, deadline: tokio::time::Instant) -> Result<(), SinkError> {
        tokio::time::sleep(self.delay).await;
        self.inner.deliver(batch, deadline).await
    }

    fn describe(&self) -> String {
        "slow".into()
    }
}

/// Case H: heartbeats fail, the lease is lost while the handler still runs: nothing is committed
/// and the next owner delivers the batch again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_h_lease_lost_through_heartbeat_failure() {
    let case = case(5, 10, |poller| {
        poller["lease"] = json!({"ttlSeconds": 3, "heartbeatSeconds": 1, "clockSkewSeconds": 1});
    })
    .await;
    case.clock.set(Utc::now());
    // Write 2, the first heartbeat, fails for good.
    let sink =
        Arc::new(Slow { inner: dbtrigger::sink::open(&case.config.sink).unwrap(), delay: Duration::from_millis(3000) });
    // This case runs on the system clock: heartbeats are timed by it.
    let poller = Poller::new(
        case.config.clone(),
        dbtrigger::source::open(&case.config.source).unwrap(),
        sink,
        faulty(&case, 2, false),
        Arc::new(dbtrigger::tick::SystemClock),
        "a".into(),
    );
    assert!(poller.tick().await.is_err());
    assert_eq!(case.checkpoint_id().await, None, "nothing committed");
    case.clock.advance(chrono::Duration::seconds(60));
    catch_up(&case.plain("b")).await;
    assert!(case.assert_nothing_lost(5) <= 5);
}

/// Case I: a permanently failing batch. The row refused alone is quarantined with its event, the
/// others delivered, the checkpoint moves past the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_i_poison_batch() {
    let case = case(2, 10, |_| {}).await;
    // The batch (rows 1 and 2) is refused; alone, row 1 is taken and row 2 refused again.
    case.receiver.answer_next(422, "bad row");
    case.receiver.answer_next(200, "{}");
    case.receiver.answer_next(422, "row 2 has no address");
    let poller = case.plain("a");
    let outcome = poller.tick().await.unwrap();
    assert!(
        matches!(outcome, TickOutcome::Delivered { stop: StopReason::Isolated, quarantined: 1, .. }),
        "{outcome:?}"
    );
    assert_eq!(case.receiver.acknowledged_ids(), vec![1]);
    let entries = quarantine::list(case.store.as_ref(), "matrix", "orders").await.unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].0.event["pk"]["id"], 2);
    assert!(entries[0].0.error.contains("row 2 has no address"));
    assert_eq!(case.checkpoint_id().await, Some(2), "not stuck: past the batch");
    assert_eq!(case.document().await.stats.quarantined, 1);
}
