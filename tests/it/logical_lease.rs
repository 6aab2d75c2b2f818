//! Issue 37, finding 4: a logical poller's slot moves only while its tick holds the lease. A
//! store that watches the slot at every write of the state document shows where the slot stood
//! when the lease was taken and when it was given back: it never moves before the first or after
//! the second, and a tick that loses the race for the lease leaves it where it was.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use dbtrigger::domain::StateDocument;
use dbtrigger::domain::lease::LeaseRecord;
use dbtrigger::operations::reset::{self, ResetTo};
use dbtrigger::operations::{Applied, Operator, Parts, apply};
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::store::{ETag, StateKey, StateStore, StoreError, Versioned, WriteCondition};
use dbtrigger::tick::{Poller, SystemClock, TickOutcome};

use crate::logical::{confirmed_flush, drop_slot, logical_app, logical_database};
use crate::sources::execute;

/// The memory store, noting at each write the lease's owner in the document written and where the
/// slot stood as the write began; and, when `beaten`, letting another owner take the lease just
/// before this process's write that takes it (a tick of another process that read the document
/// at the same moment and wrote first).
struct Watched {
    inner: Arc<MemoryStore>,
    url: String,
    slot: String,
    writes: Mutex<Vec<(Option<String>, u64)>>,
    beaten: AtomicBool,
}

impl Watched {
    fn writes(&self) -> Vec<(Option<String>, u64)> {
        std::mem::take(&mut *self.writes.lock().unwrap())
    }
}

#[async_trait]
impl StateStore for Watched {
    async fn read(&self, key: &StateKey) -> Result<Option<Versioned>, StoreError> {
        self.inner.read(key).await
    }

    async fn write(
        &self,
        key: &StateKey,
        document: &StateDocument,
        condition: WriteCondition,
    ) -> Result<ETag, StoreError> {
        let owner = document.lease.as_ref().and_then(|lease| lease.owner_id.clone());
        let at = confirmed_flush(&self.url, &self.slot).await;
        self.writes.lock().unwrap().push((owner.clone(), at));
        if owner.as_deref() == Some("it") && self.beaten.swap(false, Ordering::SeqCst) {
            let current = self.inner.read(key).await?.expect("a document");
            let mut theirs = current.document.clone();
            let now = chrono::Utc::now();
            let token = theirs.lease.as_ref().map(|lease| lease.fencing_token).unwrap_or_default() + 1;
            theirs.lease = Some(LeaseRecord {
                owner_id: Some("other".into()),
                fencing_token: token,
                acquired_at: Some(now),
                heartbeat_at: Some(now),
                expires_at: Some(now + chrono::Duration::seconds(60)),
            });
            self.inner.write(key, &theirs, WriteCondition::Matches(current.etag)).await?;
        }
        self.inner.write(key, document, condition).await
    }

    fn describe(&self) -> String {
        "watched memory store".into()
    }
}

/// The commit LSNs of the transactions the slot holds, in commit order.
async fn commit_lsns(url: &str, slot: &str) -> Vec<u64> {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let rows: Vec<(Vec<u8>,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT data FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, NULL, \
         'proto_version', '1', 'publication_names', 'feed')"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    pool.close().await;
    rows.iter()
        .filter(|(data,)| data[0] == b'C')
        .map(|(data,)| u64::from_be_bytes(data[2..10].try_into().unwrap()))
        .collect()
}

/// Two transactions of three inserts each in the slot; a poller whose state document's checkpoint
/// an operator's reset put at `(commit LSN of transaction `through`, 3)` without the slot moving
/// (as when the reset's own move found the slot busy). Its URL, slot, poller, sink and store.
async fn slot_behind_its_checkpoint(
    through: usize,
) -> (String, String, Poller, Arc<RecordingSink>, Arc<Watched>, Vec<u64>) {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY)", "orders").await;
    execute(&url, "INSERT INTO orders SELECT generate_series(1, 3)").await;
    execute(&url, "INSERT INTO orders SELECT generate_series(4, 6)").await;
    let commits = commit_lsns(&url, &slot).await;
    assert_eq!(commits.len(), 2);
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) = logical_app(directory.path(), &url, &slot, 500);
    let store = Arc::new(Watched {
        inner: Arc::new(MemoryStore::new()),
        url: url.clone(),
        slot: slot.clone(),
        writes: Mutex::new(Vec::new()),
        beaten: AtomicBool::new(false),
    });
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink = Arc::new(RecordingSink::new());
    let poller = Poller::new(config, source, sink.clone(), store.clone(), Arc::new(SystemClock), "it".into());
    let operator = Operator { who: "it@test", force: false, reason: None };
    let to = ResetTo::Cursor { value: commits[through].to_string(), keys: vec![("ordinal".into(), "3".into())] };
    let plan = reset::plan(Parts::of(&poller), &to, operator).await.unwrap();
    assert!(matches!(apply(store.as_ref(), &plan).await.unwrap(), Applied::Written(_)));
    store.writes();
    (url, slot, poller, sink, store, commits)
}

/// Regression (issue 37, finding 4): a tick moved the slot to its checkpoint before it took the
/// lease, and past its last commit after the commit that gave the lease back. Now the slot stands
/// where it was when the lease is written, and where it ends when the lease is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_moves_only_while_the_tick_holds_the_lease() {
    let (url, slot, poller, sink, store, commits) = slot_behind_its_checkpoint(0).await;
    let before = confirmed_flush(&url, &slot).await;
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 3, .. }), "{outcome:?}");
    let delivered: Vec<i64> = sink
        .batches()
        .iter()
        .flat_map(|batch| batch.events.iter())
        .map(|event| event.to_value()["row"]["new"]["id"].as_i64().unwrap())
        .collect();
    assert_eq!(delivered, vec![4, 5, 6], "only what the checkpoint does not cover");
    let after = confirmed_flush(&url, &slot).await;
    assert!(after > commits[1], "the slot moved past the last transaction delivered");
    let writes = store.writes();
    let (taken, released) = (writes.first().unwrap(), writes.last().unwrap());
    assert_eq!(taken.0.as_deref(), Some("it"), "the first write takes the lease: {writes:?}");
    assert_eq!(taken.1, before, "the slot moved before the lease was taken: {writes:?}");
    assert_eq!(released.0, None, "the last write gives the lease back: {writes:?}");
    assert_eq!(released.1, after, "the slot moved after the lease was given back: {writes:?}");
    drop_slot(&url, &slot).await;
}

/// Regression (issue 37, finding 4): a tick that read the document, found the lease free and
/// lost the race to take it moved the slot anyway (to the checkpoint it had read, which an
/// operator may have moved since). Now it leaves the slot where it was; an idle tick that owes the
/// slot a move takes the lease for it, and one that owes none writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_that_loses_the_race_for_the_lease_never_moves_the_slot() {
    let (url, slot, poller, sink, store, commits) = slot_behind_its_checkpoint(0).await;
    let before = confirmed_flush(&url, &slot).await;
    store.beaten.store(true, Ordering::SeqCst);
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(&outcome, TickOutcome::LeaseHeld { owner_id, .. } if owner_id == "other"), "{outcome:?}");
    assert_eq!(confirmed_flush(&url, &slot).await, before, "a tick without the lease moved the slot");
    assert!(sink.batches().is_empty());

    // The other owner's tick ends (it delivered the second transaction and gave the lease back),
    // its slot move not made: the next tick here has nothing to deliver and a move owed, and makes
    // it under the lease.
    let operator = Operator { who: "it@test", force: true, reason: None };
    let to = ResetTo::Cursor { value: commits[1].to_string(), keys: vec![("ordinal".into(), "3".into())] };
    let plan = reset::plan(Parts::of(&poller), &to, operator).await.unwrap();
    assert!(matches!(apply(store.as_ref(), &plan).await.unwrap(), Applied::Written(_)));
    let key = poller.key();
    let current = store.inner.read(&key).await.unwrap().unwrap();
    let mut released = current.document.clone();
    released.lease.as_mut().unwrap().owner_id = None;
    store.inner.write(&key, &released, WriteCondition::Matches(current.etag)).await.unwrap();
    assert_eq!(confirmed_flush(&url, &slot).await, before);
    store.writes();
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Idle), "{outcome:?}");
    assert!(sink.batches().is_empty(), "the checkpoint covers every change");
    let after = confirmed_flush(&url, &slot).await;
    assert!(after >= commits[1], "the slot moved to the checkpoint's transaction");
    let writes = store.writes();
    assert_eq!(writes.len(), 2, "the lease taken and given back: {writes:?}");
    assert_eq!(writes[0], (Some("it".to_string()), before), "taken before the slot moved");
    assert_eq!(writes[1], (None, after), "given back after it moved");

    // Nothing owed now: an idle tick writes nothing.
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle));
    assert_eq!(store.writes(), vec![], "an idle tick with no move owed writes nothing");
    drop_slot(&url, &slot).await;
}

/// The memory store, where another owner takes the lease just after this tick's first read (its
/// tick read the document at the same moment, wrote first, and is reading the slot).
struct TakenAfterRead {
    inner: Arc<MemoryStore>,
    fingerprint: String,
    taken: AtomicBool,
}

#[async_trait]
impl StateStore for TakenAfterRead {
    async fn read(&self, key: &StateKey) -> Result<Option<Versioned>, StoreError> {
        let read = self.inner.read(key).await?;
        if !self.taken.swap(true, Ordering::SeqCst) {
            let mut theirs = StateDocument::new("orders", &self.fingerprint);
            if let Some(current) = &read {
                theirs = current.document.clone();
            }
            let now = chrono::Utc::now();
            theirs.lease = Some(LeaseRecord {
                owner_id: Some("other".into()),
                fencing_token: 1,
                acquired_at: Some(now),
                heartbeat_at: Some(now),
                expires_at: Some(now + chrono::Duration::seconds(60)),
            });
            let condition =
                read.as_ref().map_or(WriteCondition::Absent, |current| WriteCondition::Matches(current.etag.clone()));
            self.inner.write(key, &theirs, condition).await?;
        }
        Ok(read)
    }

    async fn write(
        &self,
        key: &StateKey,
        document: &StateDocument,
        condition: WriteCondition,
    ) -> Result<ETag, StoreError> {
        self.inner.write(key, document, condition).await
    }

    fn describe(&self) -> String {
        "memory store, its lease taken after the first read".into()
    }
}

/// Finding 4's last collision: a tick's first peek runs before it takes the lease, so it can meet
/// the slot read by the tick that took the lease after this one read the document. That tick
/// stands down (the lease is held), records no failure and delivers nothing; the same busy slot
/// with no live lease stays the error `logical_ops::a_slot_read_by_another_process_is_a_clear_error_naming_its_pid`
/// pins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_that_meets_the_lease_holders_read_on_the_slot_stands_down() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY)", "orders").await;
    execute(&url, "INSERT INTO orders VALUES (1)").await;
    // The holder's read of the slot, here another session's.
    let (mut holder, _) = crate::logical_ops::reader_holding(&url, &slot).await;
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) = logical_app(directory.path(), &url, &slot, 500);
    let inner = Arc::new(MemoryStore::new());
    let fingerprint = config.fingerprint.clone();
    let store = Arc::new(TakenAfterRead { inner: inner.clone(), fingerprint, taken: AtomicBool::new(false) });
    let key = dbtrigger::store::StateKey::new(&config.app_name, &config.poller_name);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink = Arc::new(RecordingSink::new());
    let poller = Poller::new(config, source, sink.clone(), store, Arc::new(SystemClock), "it".into());
    let outcome = poller.tick().await;
    let _ = holder.kill();
    let _ = holder.wait();
    match outcome {
        Ok(TickOutcome::LeaseHeld { owner_id, .. }) => assert_eq!(owner_id, "other"),
        other => panic!("the tick stands down for the holder: {other:?}"),
    }
    assert!(sink.batches().is_empty());
    let document = inner.read(&key).await.unwrap().expect("the holder's document").document;
    assert!(document.failure.is_none(), "no failure recorded: {:?}", document.failure);
    assert_eq!(document.lease.and_then(|lease| lease.owner_id).as_deref(), Some("other"));
    crate::logical_ops::until_released(&url, &slot).await;
    drop_slot(&url, &slot).await;
}
