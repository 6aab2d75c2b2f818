//! A look at a logical slot (`status`'s count of what waits) leaves the tick alone (issue 45,
//! finding 6). On a real PostgreSQL with `wal_level=logical`, one source shared by a poller and a
//! count, as the handler's status page shares it: the tick's first batch arrives while a count of
//! 100,000 changes is still running.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::sink::{Batch, Sink, SinkError};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, SystemClock};
use serde_json::json;
use tokio::sync::Notify;

use crate::harness::AppRoot;
use crate::logical::logical_database;
use crate::sources::execute;

/// Notes, at its first batch, whether the count was still running.
struct FirstBatch {
    inner: RecordingSink,
    count_done: Arc<AtomicBool>,
    count_running_at_first: std::sync::Mutex<Option<(bool, Instant)>>,
    arrived: Notify,
}

#[async_trait]
impl Sink for FirstBatch {
    async fn deliver(&self, batch: &Batch, deadline: tokio::time::Instant) -> Result<(), SinkError> {
        let delivered = self.inner.deliver(batch, deadline).await;
        let mut first = self.count_running_at_first.lock().unwrap();
        if first.is_none() {
            *first = Some((!self.count_done.load(Ordering::SeqCst), Instant::now()));
            self.arrived.notify_one();
        }
        delivered
    }

    fn describe(&self) -> String {
        "first batch".into()
    }
}

/// Regression (issue 45, finding 6): `look` held the source's `reading` lock for its whole
/// count, so the tick's first read waited for the count to end (and, past the query timeout,
/// failed). The count is provably still running (its temporary copy of the slot exists, and it
/// has not returned) when the tick's first batch arrives, and it counts what it should.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_status_count_never_holds_up_the_ticks_read() {
    let (url, slot) =
        logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT NOT NULL)", "orders").await;
    // 1,200 transactions of 100 inserts: a count reads 100,000 changes (and their transactions'
    // begins and commits) of a copy of the slot, a tick's first peek a few thousand rows.
    execute(
        &url,
        "DO $$ BEGIN FOR i IN 0..1199 LOOP \
           INSERT INTO orders SELECT i * 100 + g, repeat('x', 400) FROM generate_series(1, 100) g; \
           COMMIT; END LOOP; END $$",
    )
    .await;
    let directory = tempfile::tempdir().unwrap();
    let app = AppRoot::write(
        directory.path(),
        json!({
            "source": {"kind": "logical", "connection": "FEED_DB", "slot": slot, "publication": "feed",
                       "queryTimeoutSeconds": 60},
            "batch": {"size": 10},
            "sink": {"type": "webhook", "url": "http://127.0.0.1:9/unused"},
            "state": {"connection": "STATE"}
        }),
    );
    let state = format!("file:{}", app.state_dir.display());
    let settings = Settings::from_pairs([
        ("FEED_DB", url.as_str()),
        ("STATE", state.as_str()),
        ("DBTRIGGER_APP_NAME", &app.app_name),
    ]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    let source = dbtrigger::source::open(&config.source).unwrap();

    let count_done = Arc::new(AtomicBool::new(false));
    let counting = {
        let (source, count_done) = (source.clone(), count_done.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let counted = source.count_after(None, 100_000).await;
            count_done.store(true, Ordering::SeqCst);
            (counted, started.elapsed())
        })
    };
    // The count is under way once its temporary copy of the slot exists.
    let copies = format!(
        "SELECT count(*)::bigint FROM pg_replication_slots WHERE temporary AND slot_name <> '{slot}' \
         AND database = current_database()"
    );
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let waited = Instant::now();
    loop {
        let found: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(copies.clone())).fetch_one(&pool).await.unwrap();
        if found > 0 {
            break;
        }
        assert!(!counting.is_finished(), "the count ended before its copy of the slot was seen");
        assert!(waited.elapsed() < Duration::from_secs(30), "no copy of the slot appeared");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let sink = Arc::new(FirstBatch {
        inner: RecordingSink::new(),
        count_done: count_done.clone(),
        count_running_at_first: Default::default(),
        arrived: Notify::new(),
    });
    let poller = Poller::new(
        config,
        source.clone(),
        sink.clone(),
        Arc::new(MemoryStore::new()),
        Arc::new(SystemClock),
        "it".into(),
    );
    let tick_started = Instant::now();
    // The tick runs until its first batch has arrived (what it does after is not this test's).
    tokio::select! {
        _ = poller.tick() => {}
        _ = sink.arrived.notified() => {}
    }
    let (running, at) = sink.count_running_at_first.lock().unwrap().expect("a batch arrived");
    let (counted, count_took) = counting.await.unwrap();
    println!(
        "first batch {} ms after the tick started; the count took {} ms",
        (at - tick_started).as_millis(),
        count_took.as_millis()
    );
    assert!(running, "the tick's first batch waited for the count to end");
    assert_eq!(counted.unwrap(), 100_000, "the count reached its cap of 100,000 changes");
    pool.close().await;
}
