//! The logical source (issue 29) on a real PostgreSQL started with `wal_level=logical`: pgoutput
//! as the server emits it decodes to the JSON the polling source writes; inserts, updates, hard
//! deletes and truncates arrive once each in commit order (a transaction committing late, one
//! rolled back); the slot moves after the state commits, and a crash between the two re-reads and
//! skips what the checkpoint covers.

use std::sync::Arc;

use async_trait::async_trait;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::Position;
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::source::logical::changes::{Assembler, event_row};
use dbtrigger::source::{FetchLimit, Fetched, Probe, Source, SourceError};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, SystemClock, TickOutcome};
use serde_json::{Value, json};
use sqlx::Row;

use crate::harness::AppRoot;
use crate::services::postgres;
use crate::sources::execute;

/// A database with a publication `feed` on `tables` and a pgoutput slot (named after the
/// database, slots being the server's); its URL and the slot's name.
pub(crate) async fn logical_database(tables_sql: &str, tables: &str) -> (String, String) {
    logical_database_on(postgres(), tables_sql, tables).await
}

/// [`logical_database`] on `server`.
pub(crate) async fn logical_database_on(
    server: &crate::services::Postgres,
    tables_sql: &str,
    tables: &str,
) -> (String, String) {
    let url = server.fresh_database().await;
    execute(&url, tables_sql).await;
    let slot = format!("s_{}", url.rsplit('/').next().unwrap().trim_start_matches("t_"));
    execute(
        &url,
        &format!(
            "CREATE PUBLICATION feed FOR TABLE {tables};\n\
             SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        ),
    )
    .await;
    (url, slot)
}

pub(crate) async fn drop_slot(url: &str, slot: &str) {
    execute(url, &format!("SELECT pg_drop_replication_slot('{slot}')")).await;
}

pub(crate) fn logical_app(
    directory: &std::path::Path,
    url: &str,
    slot: &str,
    size: usize,
) -> (AppRoot, Vec<(String, String)>, PollerConfig) {
    let app = AppRoot::write(
        directory,
        json!({
            "source": {"kind": "logical", "connection": "FEED_DB", "slot": slot, "publication": "feed"},
            "batch": {"size": size},
            "sink": {"type": "webhook", "url": "http://127.0.0.1:9/unused"},
            "state": {"connection": "STATE"}
        }),
    );
    let settings = vec![
        ("FEED_DB".to_string(), url.to_string()),
        ("STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];
    let pairs: Vec<(&str, &str)> = settings.iter().map(|(key, value)| (key.as_str(), value.as_str())).collect();
    let config = PollerConfig::load(&app.root, "orders", &Settings::from_pairs(pairs), None).unwrap();
    (app, settings, config)
}

fn logical_config(directory: &std::path::Path, url: &str, slot: &str, size: usize) -> PollerConfig {
    logical_app(directory, url, slot, size).2
}

pub(crate) fn poller(
    config: PollerConfig,
    source: Arc<dyn Source>,
    store: Arc<MemoryStore>,
) -> (Poller, Arc<RecordingSink>) {
    let sink = Arc::new(RecordingSink::new());
    (Poller::new(config, source, sink.clone(), store, Arc::new(SystemClock), "it".into()), sink)
}

/// (op, table, new id, old id) of every event delivered, in order.
fn changes(sink: &RecordingSink) -> Vec<(String, String, Value, Value)> {
    sink.batches()
        .iter()
        .flat_map(|batch| batch.events.iter())
        .map(|event| {
            let value = event.to_value();
            let row = &value["row"];
            (
                value["op"].as_str().unwrap().to_string(),
                row["table"].as_str().unwrap().to_string(),
                row["new"].get("id").cloned().unwrap_or(Value::Null),
                row["old"].get("id").cloned().unwrap_or(Value::Null),
            )
        })
        .collect()
}

fn event_rows(sink: &RecordingSink) -> Vec<Value> {
    sink.batches().iter().flat_map(|batch| batch.events.iter().map(|event| event.to_value())).collect()
}

async fn scalar_text(url: &str, sql: &str) -> String {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let value: String = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string())).fetch_one(&pool).await.unwrap();
    pool.close().await;
    value
}

pub(crate) async fn confirmed_flush(url: &str, slot: &str) -> u64 {
    let text = scalar_text(
        url,
        &format!("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{slot}'"),
    )
    .await;
    dbtrigger::source::logical::values::parse_lsn(&text).unwrap()
}

/// What a real PostgreSQL emits decodes, value for value, to the JSON the polling source writes
/// for the same row; an update that leaves a TOASTed value as it was marks it, never null; a
/// delete under REPLICA IDENTITY FULL carries the whole old row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_postgres_emits_decodes_to_the_polling_sources_json() {
    let (url, slot) = logical_database(
        "CREATE TABLE kinds (id BIGINT PRIMARY KEY, v BIGINT NOT NULL, flag BOOLEAN, small SMALLINT, real4 REAL, \
         double8 DOUBLE PRECISION, amount NUMERIC(30,10), label TEXT, code VARCHAR(8), fixed CHAR(3), u UUID, \
         doc JSONB, raw_json JSON, bytes BYTEA, day DATE, moment TIME, at TIMESTAMP, at_tz TIMESTAMPTZ, big TEXT);\n\
         ALTER TABLE kinds REPLICA IDENTITY FULL;
         ALTER TABLE kinds ALTER COLUMN big SET STORAGE EXTERNAL",
        "kinds",
    )
    .await;
    execute(
        &url,
        "INSERT INTO kinds VALUES (1, 1, true, -3, 1.5, 0.1, 12345678901234567890.0123456789, 'hé \"q\"', 'abc', 'xy', \
         'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{\"a\": [1, 2.5, null]}', '{\"b\" : 1}', '\\x00ff10', '2026-11-26', \
         '10:11:12.5', '2026-11-26 10:11:12.123456', '2026-11-26 10:11:12.5+05:30', \
         (SELECT string_agg(md5(g::text), '') FROM generate_series(1, 3000) g));\n\
         INSERT INTO kinds (id, v) VALUES (2, 2);\n\
         UPDATE kinds SET label = 'changed' WHERE id = 1;\n\
         DELETE FROM kinds WHERE id = 2",
    )
    .await;
    // The slot's messages, decoded.
    let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap();
    sqlx::raw_sql("SET TimeZone = 'UTC'; SET extra_float_digits = 3").execute(&mut connection).await.unwrap();
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, NULL, \
         'proto_version', '1', 'publication_names', 'feed')"
    )))
    .fetch_all(&mut connection)
    .await
    .unwrap();
    let mut assembler = Assembler::default();
    let mut events = Vec::new();
    for row in &rows {
        let lsn = dbtrigger::source::logical::values::parse_lsn(&row.get::<String, _>(0)).unwrap();
        if let Some(transaction) = assembler.push(lsn, row.get::<&[u8], _>(1)).unwrap() {
            for change in &transaction.changes {
                events.push((change.op, json!(event_row(&transaction, change))));
            }
        }
    }
    assert_eq!(events.len(), 4, "{events:?}");
    // The polling source's JSON for row 1 as it was inserted.
    let polled = {
        let directory = tempfile::tempdir().unwrap();
        let app = AppRoot::write(
            directory.path(),
            json!({"source": {"connection": "DB", "table": "kinds", "cursor": "v", "pk": ["id"]},
                   "sink": {"type": "webhook", "url": "http://127.0.0.1:9/unused"}, "state": {"connection": "STATE"}}),
        );
        let settings = Settings::from_pairs(vec![
            ("DB", url.as_str()),
            ("STATE", &format!("file:{}", app.state_dir.display())),
            ("DBTRIGGER_APP_NAME", &app.app_name),
        ]);
        let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
        let source = dbtrigger::source::open(&config.source).unwrap();
        let fetched = source.fetch_after(None, FetchLimit { rows: 10, bytes: usize::MAX }).await.unwrap();
        fetched.rows[0].row.to_map()
    };
    let (op, insert) = &events[0];
    assert_eq!(op.as_str(), "insert");
    let mut inserted = insert["new"].as_object().unwrap().clone();
    // The polling row is as it is now (label changed); everything else is as inserted.
    inserted.insert("label".into(), json!("changed"));
    assert_eq!(Value::Object(inserted), Value::Object(polled), "logical and polling JSON differ");
    assert_eq!(insert["new"]["amount"], json!("12345678901234567890.0123456789"));
    assert_eq!(insert["new"]["at_tz"], json!("2026-11-26T04:41:12.500Z"));
    assert_eq!(insert["table"], json!("public.kinds"));
    // The update left `big` (TOASTed) as it was: left out and named, never null.
    let (op, update) = &events[2];
    assert_eq!(op.as_str(), "update");
    assert_eq!(update["new"]["label"], json!("changed"));
    assert!(update["new"].get("big").is_none(), "{update}");
    assert_eq!(update["unchanged_toast"], json!(["big"]));
    // REPLICA IDENTITY FULL: the delete carries the whole old row.
    let (op, delete) = &events[3];
    assert_eq!(op.as_str(), "delete");
    assert_eq!(delete["old"]["id"], json!(2));
    assert_eq!(delete["old"]["v"], json!(2));
    assert_eq!(delete["new"], Value::Null);
    drop_slot(&url, &slot).await;
}

/// Interleaved transactions (one committing late, one rolled back), updates, hard deletes and a
/// truncate arrive once each, in commit order, with the right op and keys; the checkpoint is
/// (commit LSN, ordinal); after catch-up the slot has moved past everything delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_arrive_once_in_commit_order_and_the_slot_moves_after_the_commit() {
    commit_order_on(postgres()).await;
}

/// [`changes_arrive_once_in_commit_order_and_the_slot_moves_after_the_commit`] on `server`.
pub(crate) async fn commit_order_on(server: &crate::services::Postgres) {
    let (url, slot) = logical_database_on(
        server,
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT);\nCREATE TABLE lines (id BIGINT PRIMARY KEY)",
        "orders, lines",
    )
    .await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let mut late = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES (1, 'late')").execute(&mut *late).await.unwrap();
    execute(&url, "INSERT INTO orders VALUES (2, 'early');\nINSERT INTO lines VALUES (20)").await;
    let mut rolled_back = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES (3, 'never')").execute(&mut *rolled_back).await.unwrap();
    rolled_back.rollback().await.unwrap();
    sqlx::query("UPDATE orders SET note = 'late, updated' WHERE id = 1").execute(&mut *late).await.unwrap();
    late.commit().await.unwrap();
    execute(&url, "UPDATE orders SET id = 4 WHERE id = 2;\nDELETE FROM orders WHERE id = 1;\nTRUNCATE lines").await;

    let directory = tempfile::tempdir().unwrap();
    let config = logical_config(directory.path(), &url, &slot, 2);
    let store = Arc::new(MemoryStore::new());
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (poller, sink) = poller(config, source, store.clone());
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { .. }), "{outcome:?}");
    let expected = [
        ("insert", "public.orders", json!(2), Value::Null),
        ("insert", "public.lines", json!(20), Value::Null),
        ("insert", "public.orders", json!(1), Value::Null),
        ("update", "public.orders", json!(1), json!(1)),
        ("update", "public.orders", json!(4), json!(2)),
        ("delete", "public.orders", Value::Null, json!(1)),
        ("truncate", "public.lines", Value::Null, Value::Null),
    ];
    let expected: Vec<_> =
        expected.into_iter().map(|(op, table, new, old)| (op.to_string(), table.to_string(), new, old)).collect();
    assert_eq!(changes(&sink), expected);
    // Commit order: commit LSNs never go back; ordinals count within a transaction.
    let rows = event_rows(&sink);
    let positions: Vec<(u64, i64)> = rows
        .iter()
        .map(|event| (event["cursor"].as_u64().unwrap(), event["pk"]["ordinal"].as_i64().unwrap()))
        .collect();
    assert!(positions.windows(2).all(|pair| pair[0] < pair[1]), "{positions:?}");
    assert!(rows.iter().all(|event| event["row"]["xid"].is_u64() && event["row"]["commit_time"].is_string()));
    // Caught up: the slot is past the last commit delivered; a second tick delivers nothing.
    let last_commit = positions.last().unwrap().0;
    assert!(confirmed_flush(&url, &slot).await > last_commit);
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle));
    assert_eq!(changes(&sink).len(), expected.len());
    // A quiet publication on a busy database: the slot still moves with the WAL, once it would
    // pass a WAL segment (an idle tick takes the lease for it: two writes, not at every tick).
    let before = confirmed_flush(&url, &slot).await;
    execute(&url, "CREATE TABLE other (id INT);\nINSERT INTO other SELECT generate_series(1, 1000)").await;
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle));
    assert_eq!(confirmed_flush(&url, &slot).await, before, "less than a segment: no lease taken for it");
    for id in 0..2 {
        execute(&url, &format!("INSERT INTO other VALUES ({id});\nSELECT pg_switch_wal()")).await;
    }
    execute(&url, "INSERT INTO other VALUES (3)").await;
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle));
    let moved = confirmed_flush(&url, &slot).await;
    assert!(moved >= before + 16 * 1024 * 1024, "the slot stayed behind unpublished WAL: {before} to {moved}");
    pool.close().await;
    drop_slot(&url, &slot).await;
}

/// A source whose commits are never reported: the process dies between the state document's
/// commit and the slot's advance.
struct DiesBeforeAdvance(Arc<dyn Source>);

#[async_trait]
impl Source for DiesBeforeAdvance {
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        self.0.read(probe, after, limit).await
    }
    async fn count_after(&self, after: Option<&Position>, cap: u64) -> Result<u64, SourceError> {
        self.0.count_after(after, cap).await
    }
    async fn generation(&self) -> Result<Option<Value>, SourceError> {
        self.0.generation().await
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}

/// A crash between the state commit and the slot's advance: the next process re-reads from the
/// slot, skips what the checkpoint covers, delivers the rest once, and moves the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_state_commit_and_the_advance_loses_and_repeats_nothing() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY)", "orders").await;
    execute(&url, "INSERT INTO orders SELECT generate_series(1, 5);\nDELETE FROM orders WHERE id = 2").await;
    let directory = tempfile::tempdir().unwrap();
    let config = logical_config(directory.path(), &url, &slot, 2);
    let store = Arc::new(MemoryStore::new());
    let slot_before = confirmed_flush(&url, &slot).await;
    let dying = Arc::new(DiesBeforeAdvance(dbtrigger::source::open(&config.source).unwrap()));
    let (first, first_sink) = poller(config.clone(), dying, store.clone());
    assert!(matches!(first.tick().await.unwrap(), TickOutcome::Delivered { .. }));
    assert_eq!(changes(&first_sink).len(), 6);
    assert_eq!(confirmed_flush(&url, &slot).await, slot_before, "the slot moved without the hook");

    execute(&url, "INSERT INTO orders VALUES (6);\nDELETE FROM orders WHERE id = 1").await;
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (second, second_sink) = poller(config, source, store);
    assert!(matches!(second.tick().await.unwrap(), TickOutcome::Delivered { .. }));
    let again = changes(&second_sink);
    assert_eq!(
        again,
        vec![
            ("insert".to_string(), "public.orders".to_string(), json!(6), Value::Null),
            ("delete".to_string(), "public.orders".to_string(), Value::Null, json!(1)),
        ],
        "only what the checkpoint did not cover"
    );
    assert!(confirmed_flush(&url, &slot).await > slot_before, "the slot moved once the next commit was made");
    drop_slot(&url, &slot).await;
}
