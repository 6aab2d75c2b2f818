//! What a user's table does that a keyset poller cannot see by itself, on every engine: a truncate
//! and reload (source generations, seed 003: restart, stop, and a reload during a tick), and
//! deletes (a soft-delete column, an outbox's operation column, and a trigger that writes deleted
//! keys to a tombstone table polled by its own poller).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use dbtrigger::domain::StateDocument;
use dbtrigger::domain::event::Op;
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::sink::{Batch, Sink, SinkError};
use dbtrigger::store::StateKey;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, SystemClock, TickError, TickOutcome};
use serde_json::{Value, json};

use crate::sources::{Engine, database, execute, items_config, poller_with};

fn text_type(engine: Engine) -> &'static str {
    if engine == Engine::MariaDb { "VARCHAR(40)" } else { "TEXT" }
}

/// `items(id, c, note, load_id)` and `load_log(load_id)`.
async fn loaded_tables(engine: Engine) -> crate::sources::Database {
    let database = database(engine).await;
    execute(
        &database.url,
        &format!(
            "CREATE TABLE items (id BIGINT NOT NULL PRIMARY KEY, c BIGINT NOT NULL, note {}, load_id BIGINT NOT NULL);\n\
             CREATE TABLE load_log (load_id BIGINT NOT NULL);\n",
            text_type(engine)
        ),
    )
    .await;
    database
}

/// A load: the table emptied, `ids` inserted with `c = id` (so a new load's cursors start again
/// below the old checkpoint), and the load recorded.
async fn load(url: &str, load_id: i64, ids: std::ops::RangeInclusive<i64>) {
    let values: Vec<String> = ids.map(|id| format!("({id}, {id}, 'load {load_id} row {id}', {load_id})")).collect();
    execute(
        url,
        &format!(
            "DELETE FROM items;\nINSERT INTO items VALUES {};\nINSERT INTO load_log VALUES ({load_id});\n",
            values.join(", ")
        ),
    )
    .await;
}

fn generation_source(on_change: &str) -> Value {
    json!({"settleSeconds": 0, "generation": {"query": "SELECT max(load_id) FROM load_log", "onChange": on_change}})
}

fn delivered(sink: &RecordingSink) -> Vec<(i64, Option<Value>)> {
    sink.batches()
        .iter()
        .flat_map(|batch| {
            batch.events.iter().map(|event| (event.pk()["id"].as_i64().unwrap(), batch.generation.clone()))
        })
        .collect()
}

fn document(store: &MemoryStore) -> StateDocument {
    StateDocument::parse(&store.raw(&StateKey::new("local", "orders")).unwrap()).unwrap()
}

async fn reload_under_restart(engine: Engine) {
    let database = loaded_tables(engine).await;
    load(&database.url, 1, 1..=20).await;
    let (config, _directory) = items_config(&database.url, generation_source("restart"), 7);
    let store = Arc::new(MemoryStore::new());
    let (poller, sink) = poller_with(config, store.clone());
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Delivered { rows: 20, .. }));
    assert!(delivered(&sink).iter().all(|(_, generation)| *generation == Some(json!(1))), "{:?}", delivered(&sink));

    // Truncate and reload: the cursors start again below the checkpoint (20).
    load(&database.url, 2, 1..=15).await;
    let outcome = poller.tick().await.unwrap_or_else(|error| panic!("{engine:?}: {error}"));
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 15, .. }), "{engine:?}: {outcome:?}");
    let second: Vec<(i64, Option<Value>)> = delivered(&sink)[20..].to_vec();
    assert_eq!(second, (1..=15).map(|id| (id, Some(json!(2)))).collect::<Vec<_>>(), "{engine:?}: the whole new load");
    let state = document(&store);
    assert_eq!(state.generation.as_ref().unwrap().value, json!(2));
    assert!(state.history.last().unwrap().what.contains("generation changed from 1 to 2"), "{:?}", state.history);
    assert_eq!(poller.tick().await.unwrap(), TickOutcome::Idle);
}

async fn reload_under_stop(engine: Engine) {
    let database = loaded_tables(engine).await;
    load(&database.url, 1, 1..=10).await;
    let (config, _directory) = items_config(&database.url, generation_source("stop"), 100);
    let store = Arc::new(MemoryStore::new());
    let (poller, sink) = poller_with(config, store.clone());
    poller.tick().await.unwrap();
    load(&database.url, 2, 1..=15).await;
    for _ in 0..2 {
        let error = poller.tick().await.unwrap_err();
        assert!(matches!(error, TickError::GenerationChanged { .. }), "{engine:?}: {error:?}");
        let message = error.to_string();
        assert!(message.contains("from 1 to 2") && message.contains("dbtrigger reset"), "{message}");
    }
    assert_eq!(delivered(&sink).len(), 10, "{engine:?}: nothing of the new load");
    assert_eq!(document(&store).checkpoint.unwrap().cursor.value, json!(10), "the checkpoint held");
}

/// Loads generation 2 while the first batch of a tick is being delivered.
struct ReloadingSink {
    inner: RecordingSink,
    url: String,
    reloaded: AtomicBool,
}

#[async_trait]
impl Sink for ReloadingSink {
    async fn deliver(&self, batch: &Batch, deadline: tokio::time::Instant) -> Result<(), SinkError> {
        if !self.reloaded.swap(true, Ordering::SeqCst) {
            load(&self.url, 2, 1..=4).await;
        }
        self.inner.deliver(batch, deadline).await
    }

    fn describe(&self) -> String {
        "reloading".into()
    }
}

async fn reload_during_a_tick(engine: Engine) {
    let database = loaded_tables(engine).await;
    load(&database.url, 1, 1..=20).await;
    let (config, _directory) = items_config(&database.url, generation_source("restart"), 5);
    let store = Arc::new(MemoryStore::new());
    let sink = Arc::new(ReloadingSink {
        inner: RecordingSink::new(),
        url: database.url.clone(),
        reloaded: AtomicBool::new(false),
    });
    let source = dbtrigger::source::open(&config.source).unwrap();
    let poller = Poller::new(config, source, sink.clone(), store.clone(), Arc::new(SystemClock), "it".into());
    let outcome = poller.tick().await.unwrap();
    assert_eq!(
        outcome,
        TickOutcome::Superseded { bound: json!(1), current: Some(json!(2)) },
        "{engine:?}: the tick stands down before its next commit"
    );
    // Deliveries went on while batch 1's commit (and its generation check) ran: what the tick sent
    // carries the generation it was bound to, so receivers can drop it; nothing was committed.
    let sent = sink.inner.batches();
    assert!((1..=4).contains(&sent.len()), "{engine:?}: {} batches", sent.len());
    assert!(sent.iter().all(|batch| batch.generation == Some(json!(1))), "{engine:?}");
    let state = document(&store);
    assert_eq!(state.checkpoint, None, "{engine:?}: nothing committed");
    assert_eq!(state.lease.as_ref().unwrap().owner_id, None, "the lease was given back");
    // The next tick restarts on the new load.
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Delivered { rows: 4, .. }));
    let last: Vec<(i64, Option<Value>)> = delivered(&sink.inner)[sent.len() * 5..].to_vec();
    assert_eq!(last, (1..=4).map(|id| (id, Some(json!(2)))).collect::<Vec<_>>());
}

/// `softDelete`: NULL (or false) lives, anything else is a delete, its row included.
async fn soft_deletes(engine: Engine) {
    let database = database(engine).await;
    execute(
        &database.url,
        &format!(
            "CREATE TABLE items (id BIGINT NOT NULL PRIMARY KEY, c BIGINT NOT NULL, deleted_at {} NULL, gone BOOLEAN NOT NULL);\n\
             INSERT INTO items VALUES (1, 1, NULL, false), (2, 2, '2026-11-23 10:00:00', false), (3, 3, NULL, true), (4, 4, NULL, false);\n",
            text_type(engine)
        ),
    )
    .await;
    for (column, deleted) in [("deleted_at", vec![2]), ("gone", vec![3])] {
        let (config, _directory) = items_config(&database.url, json!({"settleSeconds": 0, "softDelete": column}), 100);
        let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
        poller.tick().await.unwrap_or_else(|error| panic!("{engine:?}: {error}"));
        let events: Vec<(i64, Op, Value)> = sink.batches()[0]
            .events
            .iter()
            .map(|event| (event.pk()["id"].as_i64().unwrap(), event.op, event.row()[column].clone()))
            .collect();
        for (id, op, value) in &events {
            let expected = if deleted.contains(id) { Op::Delete } else { Op::Upsert };
            assert_eq!(*op, expected, "{engine:?} {column}: row {id} ({value})");
        }
        assert_eq!(events.len(), 4, "the deleted row is delivered, with its row");
    }
}

/// `opColumn`: an outbox says each operation; anything else is an error naming the row.
async fn outbox_operations(engine: Engine) {
    let database = database(engine).await;
    execute(
        &database.url,
        &format!(
            "CREATE TABLE items (id BIGINT NOT NULL PRIMARY KEY, c BIGINT NOT NULL, op {} NOT NULL);\n\
             INSERT INTO items VALUES (1, 1, 'insert'), (2, 2, 'update'), (3, 3, 'delete'), (4, 4, 'upsert');\n",
            text_type(engine)
        ),
    )
    .await;
    let (config, _directory) =
        items_config(&database.url, json!({"settleSeconds": 0, "opColumn": "op", "columns": ["c"]}), 100);
    let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
    poller.tick().await.unwrap_or_else(|error| panic!("{engine:?}: {error}"));
    let ops: Vec<Op> = sink.batches()[0].events.iter().map(|event| event.op).collect();
    assert_eq!(ops, [Op::Insert, Op::Update, Op::Delete, Op::Upsert], "{engine:?}");
    assert_eq!(sink.batches()[0].events[0].row()["op"], "insert", "the op column is selected with `columns`");
    execute(&database.url, "INSERT INTO items VALUES (5, 5, 'merge');\n").await;
    let error = poller.tick().await.unwrap_err().to_string();
    assert!(error.contains("\"merge\"") && error.contains("id=5"), "{engine:?}: {error}");
}

/// The tombstone pattern: a trigger writes each deleted key to its own table, polled with
/// `opColumn` by a poller of its own.
async fn tombstones(engine: Engine) {
    let database = database(engine).await;
    let setup = match engine {
        Engine::Sqlite => {
            "CREATE TABLE items (id BIGINT NOT NULL PRIMARY KEY, c BIGINT NOT NULL);\n\
             CREATE TABLE items_tombstones (seq INTEGER PRIMARY KEY AUTOINCREMENT, id BIGINT NOT NULL, op TEXT NOT NULL DEFAULT 'delete');\n\
             CREATE TRIGGER items_deleted AFTER DELETE ON items BEGIN INSERT INTO items_tombstones (id) VALUES (OLD.id); END;\n"
        }
        Engine::Postgres => {
            "CREATE TABLE items (id BIGINT NOT NULL PRIMARY KEY, c BIGINT NOT NULL);\n\
             CREATE TABLE items_tombstones (seq BIGSERIAL PRIMARY KEY, id BIGINT NOT NULL, op TEXT NOT NULL DEFAULT 'delete');\n\
             CREATE FUNCTION items_tombstone() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN INSERT INTO items_tombstones (id) VALUES (OLD.id); RETURN OLD; END $$;\n\
             CREATE TRIGGER items_deleted AFTER DELETE ON items FOR EACH ROW EXECUTE FUNCTION items_tombstone();\n"
        }
        Engine::MariaDb => {
            "CREATE TABLE items (id BIGINT NOT NULL PRIMARY KEY, c BIGINT NOT NULL);\n\
             CREATE TABLE items_tombstones (seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, id BIGINT NOT NULL, op VARCHAR(10) NOT NULL DEFAULT 'delete');\n\
             CREATE TRIGGER items_deleted AFTER DELETE ON items FOR EACH ROW INSERT INTO items_tombstones (id) VALUES (OLD.id);\n"
        }
    };
    execute(&database.url, setup).await;
    execute(&database.url, "INSERT INTO items VALUES (1, 1), (2, 2), (3, 3);\nDELETE FROM items WHERE id IN (1, 3);\n")
        .await;
    let (config, _directory) = items_config(
        &database.url,
        json!({"table": "items_tombstones", "cursor": "seq", "pk": ["id"], "opColumn": "op", "settleSeconds": 0}),
        100,
    );
    let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
    poller.tick().await.unwrap_or_else(|error| panic!("{engine:?}: {error}"));
    let deleted: Vec<(i64, Op)> =
        sink.batches()[0].events.iter().map(|event| (event.pk()["id"].as_i64().unwrap(), event.op)).collect();
    assert_eq!(deleted, [(1, Op::Delete), (3, Op::Delete)], "{engine:?}");
}

macro_rules! per_engine {
    ($($name:ident: $function:ident;)*) => {
        $(
            mod $name {
                use super::*;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    $function(Engine::Sqlite).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    $function(Engine::Postgres).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn mariadb() {
                    $function(Engine::MariaDb).await;
                }
            }
        )*
    };
}

per_engine! {
    a_reload_under_restart_delivers_the_whole_new_load_with_its_generation: reload_under_restart;
    a_reload_under_stop_fails_naming_both_generations_and_delivers_nothing_of_it: reload_under_stop;
    a_reload_during_a_tick_makes_it_stand_down_before_its_next_commit: reload_during_a_tick;
    soft_deleted_rows_arrive_as_deletes: soft_deletes;
    an_outbox_says_each_operation: outbox_operations;
    a_trigger_fed_tombstone_table_delivers_deletes: tombstones;
}
