//! The connection a tick's delivering reads keep between them (issue 38): a catch-up reads every
//! page of a tick on one connection, gives it back when the tick ends (the target's cap is whole
//! again), and a kept connection the server dropped never loses a row nor fails more than the
//! tick that was using it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use dbtrigger::config::PollerConfig;
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::sink::{Batch, Sink, SinkError};
use dbtrigger::source::Source;
use dbtrigger::source::pools::Pools;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, SystemClock, TickOutcome};
use serde_json::json;

use crate::services::{mariadb, postgres};
use crate::sources::{Engine, execute, items_config};

/// 40 rows of `items` (cursor `c`, one row a value) in a fresh database of `engine`, read through
/// a query that says which session read each row.
async fn items_with_sessions(engine: Engine) -> (String, serde_json::Value) {
    let (url, session) = match engine {
        Engine::MariaDb => (mariadb().fresh_database().await, "CONNECTION_ID()"),
        _ => (postgres().fresh_database().await, "pg_backend_pid()"),
    };
    let rows: Vec<String> = (1..=40).map(|id| format!("({id}, {id})")).collect();
    execute(
        &url,
        &format!(
            "CREATE TABLE items (id BIGINT PRIMARY KEY, c BIGINT NOT NULL);\nINSERT INTO items VALUES {};\n",
            rows.join(", ")
        ),
    )
    .await;
    (url, json!({"table": null, "query": format!("SELECT id, c, {session} AS pid FROM items")}))
}

fn poller(config: PollerConfig, source: Arc<dyn Source>, sink: Arc<dyn Sink>) -> Poller {
    Poller::new(config, source, sink, Arc::new(MemoryStore::new()), Arc::new(SystemClock), "it".into())
}

fn ids_and_pids(batches: &[Batch]) -> (Vec<i64>, Vec<i64>) {
    let events = batches.iter().flat_map(|batch| batch.events.iter());
    events.map(|event| (event.pk()["id"].as_i64().unwrap(), event.row()["pid"].as_i64().unwrap())).unzip()
}

/// A catch-up of eight pages in one tick reads them all on one session (the read after each page
/// would otherwise take a connection of the pool, which sqlx pings as it gives it back: another
/// one, often), and the tick gives it back as it ends: both permits of the target's cap of 2 are
/// free at once for a second source.
async fn one_session_per_tick(engine: Engine) {
    let (url, mut extra) = items_with_sessions(engine).await;
    extra["maxConnections"] = json!(2);
    let (config, _directory) = items_config(&url, extra, 5);
    let pools = Pools::new();
    let wait = Duration::from_secs(2);
    let source = dbtrigger::source::open_shared(&config.source, &pools, wait).unwrap();
    let other = dbtrigger::source::open_shared(&config.source, &pools, wait).unwrap();
    let sink = Arc::new(RecordingSink::new());
    let poller = poller(config, source, sink.clone());

    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 40, batches: 8, .. }), "{engine:?}: {outcome:?}");
    let (ids, pids) = ids_and_pids(&sink.batches());
    assert_eq!(ids, (1..=40).collect::<Vec<_>>());
    let mut sessions = pids.clone();
    sessions.dedup();
    assert_eq!(sessions.len(), 1, "{engine:?}: the tick's pages were read by the sessions {pids:?}");

    // Both permits of the cap are free: two questions at once, neither waits.
    let (first, second) = tokio::join!(other.count_after(None, 100), other.count_after(None, 100));
    assert_eq!((first.unwrap(), second.unwrap()), (40, 40));
    assert_eq!(other.connection_wait(), Duration::ZERO, "{engine:?}: a question waited for the tick's connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_catch_up_reads_every_page_of_a_tick_on_one_connection_and_gives_it_back() {
    one_session_per_tick(Engine::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_catch_up_reads_every_page_of_a_tick_on_one_connection_and_gives_it_back() {
    one_session_per_tick(Engine::MariaDb).await;
}

/// A sink that, during its first delivery, waits `before`, has the server drop every dbtrigger
/// session (the connection the tick's reads kept among them), and waits `after`; then it records.
struct DropsSessions {
    url: String,
    before: Duration,
    after: Duration,
    dropped: AtomicBool,
    inner: RecordingSink,
}

#[async_trait]
impl Sink for DropsSessions {
    async fn deliver(&self, batch: &Batch, deadline: tokio::time::Instant) -> Result<(), SinkError> {
        if !self.dropped.swap(true, Ordering::SeqCst) {
            tokio::time::sleep(self.before).await;
            let admin = sqlx::PgPool::connect(&self.url).await.unwrap();
            let terminated: Vec<bool> = sqlx::query_scalar(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name = 'dbtrigger'",
            )
            .fetch_all(&admin)
            .await
            .unwrap();
            admin.close().await;
            assert!(terminated.contains(&true), "no dbtrigger session to drop");
            tokio::time::sleep(self.after).await;
        }
        self.inner.deliver(batch, deadline).await
    }

    fn describe(&self) -> String {
        "drops-sessions".into()
    }
}

/// Runs a catch-up of eight pages whose first delivery drops the sessions after `before` and
/// lasts `before + after` in all; ticks (a second apart) until caught up. Returns the ticks'
/// outcomes (errors as text) and what was delivered.
async fn dropped_mid_tick(before: Duration, after: Duration) -> (Vec<Result<String, String>>, Vec<i64>) {
    let (url, extra) = items_with_sessions(Engine::Postgres).await;
    let (config, _directory) = items_config(&url, extra, 5);
    let sink = Arc::new(DropsSessions {
        url: url.clone(),
        before,
        after,
        dropped: AtomicBool::new(false),
        inner: RecordingSink::new(),
    });
    let poller = poller(config.clone(), dbtrigger::source::open(&config.source).unwrap(), sink.clone());
    let mut outcomes = Vec::new();
    for _ in 0..4 {
        let outcome = poller.tick().await;
        let caught_up = matches!(&outcome, Ok(TickOutcome::Delivered { .. } | TickOutcome::Idle))
            && ids_and_pids(&sink.inner.batches()).0.last() == Some(&40);
        outcomes.push(outcome.map(|outcome| format!("{outcome:?}")).map_err(|error| error.to_string()));
        if caught_up {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    (outcomes, ids_and_pids(&sink.inner.batches()).0)
}

/// The tick's kept connection dropped by the server while the tick waited over a second for its
/// receiver: the next read pings it first (as the pool pings a connection idle that long), finds
/// it gone and reads on a new one. The tick delivers everything and does not fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_dropped_during_a_long_wait_is_replaced_within_the_tick() {
    let (outcomes, ids) = dropped_mid_tick(Duration::from_millis(300), Duration::from_millis(1000)).await;
    assert_eq!(outcomes.len(), 1, "{outcomes:?}");
    assert!(outcomes[0].as_ref().is_ok_and(|outcome| outcome.contains("rows: 40")), "{outcomes:?}");
    assert_eq!(ids, (1..=40).collect::<Vec<_>>());
}

/// The tick's kept connection dropped by the server a moment before its next read: that read
/// fails, and the tick with it, after committing what was delivered; the next tick reads on a new
/// connection from the checkpoint, and every row arrives, none skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_dropped_just_before_a_read_fails_that_tick_only() {
    let (outcomes, ids) = dropped_mid_tick(Duration::from_millis(100), Duration::from_millis(100)).await;
    assert_eq!(outcomes.len(), 2, "{outcomes:?}");
    assert!(outcomes[0].is_err(), "{outcomes:?}");
    assert!(outcomes[1].is_ok(), "{outcomes:?}");
    let distinct: std::collections::BTreeSet<i64> = ids.iter().copied().collect();
    assert_eq!(distinct, (1..=40).collect(), "{ids:?}");
}
