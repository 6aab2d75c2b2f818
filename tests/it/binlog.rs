//! The binary-log source (issue 39) on a real MariaDB with `log_bin`, ROW events, full images and
//! column names: what the server logs decodes to the JSON the polling MySQL source writes; a
//! first tick records where the log ends; inserts, updates, hard deletes arrive once each in
//! commit order (a transaction committing late, one rolled back, two tables in one).

use std::sync::Arc;

use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::source::FetchLimit;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, SystemClock, TickOutcome};
use serde_json::{Value, json};

use crate::harness::AppRoot;
use crate::services::mariadb_binlog;
use crate::sources::execute;

/// A fresh database on the binlog server, with `tables_sql` run in it; its URL and name.
pub(crate) async fn binlog_database(tables_sql: &str) -> (String, String) {
    let url = mariadb_binlog().fresh_database().await;
    if !tables_sql.is_empty() {
        execute(&url, tables_sql).await;
    }
    let name = url.rsplit('/').next().unwrap().to_string();
    (url, name)
}

/// An app whose poller `orders` reads `tables` of `database` from the binary log.
pub(crate) fn binlog_app(
    directory: &std::path::Path,
    url: &str,
    tables: &[String],
    size: usize,
    sink: Value,
) -> (AppRoot, Vec<(String, String)>, PollerConfig) {
    let app = AppRoot::write(
        directory,
        json!({
            "source": {"kind": "binlog", "connection": "FEED_DB", "tables": tables},
            "batch": {"size": size},
            "sink": sink,
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

fn unused_sink() -> Value {
    json!({"type": "webhook", "url": "http://127.0.0.1:9/unused"})
}

pub(crate) fn poller(config: PollerConfig, store: Arc<MemoryStore>) -> (Poller, Arc<RecordingSink>) {
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink = Arc::new(RecordingSink::new());
    (Poller::new(config, source, sink.clone(), store, Arc::new(SystemClock), "it".into()), sink)
}

/// (op, table, new id, old id) of every event delivered, in order.
pub(crate) fn changes(sink: &RecordingSink) -> Vec<(String, String, Value, Value)> {
    event_values(sink)
        .iter()
        .map(|value| {
            let row = &value["row"];
            (
                value["op"].as_str().unwrap().to_string(),
                row["table"].as_str().unwrap().split('.').nth(1).unwrap().to_string(),
                row["new"].get("id").cloned().unwrap_or(Value::Null),
                row["old"].get("id").cloned().unwrap_or(Value::Null),
            )
        })
        .collect()
}

pub(crate) fn event_values(sink: &RecordingSink) -> Vec<Value> {
    sink.batches().iter().flat_map(|batch| batch.events.iter().map(|event| event.to_value())).collect()
}

async fn tick_until_idle(poller: &Poller) {
    for _ in 0..20 {
        match poller.tick().await.unwrap() {
            TickOutcome::Idle => return,
            TickOutcome::Delivered { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    panic!("never idle");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_mariadb_logs_decodes_to_the_polling_sources_json() {
    let (url, database) = binlog_database(
        "CREATE TABLE kinds (id BIGINT PRIMARY KEY, v BIGINT NOT NULL, flag BOOLEAN, tiny TINYINT, small SMALLINT, \
         medium MEDIUMINT, u_big BIGINT UNSIGNED, real4 FLOAT, double8 DOUBLE, amount DECIMAL(30,10), label TEXT, \
         code VARCHAR(8), fixed CHAR(3), doc JSON, bytes VARBINARY(8), blobby BLOB, bits BIT(10), colour ENUM('red','blue'), \
         tags SET('a','b','c'), day DATE, moment TIME(1), at DATETIME(6), at_ts TIMESTAMP(3) NULL, yr YEAR)",
    )
    .await;
    let directory = tempfile::tempdir().unwrap();
    let tables = vec![format!("{database}.kinds")];
    let (_app, _, config) = binlog_app(directory.path(), &url, &tables, 100, unused_sink());
    let store = Arc::new(MemoryStore::new());
    let (poller, sink) = poller(config, store.clone());
    // The first tick finds nothing and records where the log ends: what follows is delivered.
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle));
    execute(
        &url,
        "SET time_zone = '+00:00';\n\
         INSERT INTO kinds VALUES (1, 1, true, -3, -300, 70000, 18446744073709551615, 1.5, 0.1, \
         12345678901234567890.0123456789, 'hé \"q\"', 'abc', 'xy', '{\"a\": [1, 2.5, null]}', x'00ff10', x'0102', \
         b'1010101010', 'blue', 'a,c', '2026-11-26', '10:11:12.5', '2026-11-26 10:11:12.123456', \
         '2026-11-26 10:11:12.500', 2026);\n\
         INSERT INTO kinds (id, v) VALUES (2, 2)",
    )
    .await;
    tick_until_idle(&poller).await;
    let events = event_values(&sink);
    assert_eq!(events.len(), 2, "{events:#?}");
    // The polling source's JSON for the same rows.
    let polled = {
        let directory = tempfile::tempdir().unwrap();
        let app = AppRoot::write(
            directory.path(),
            json!({"source": {"connection": "DB", "table": "kinds", "cursor": "v", "pk": ["id"]},
                   "sink": unused_sink(), "state": {"connection": "STATE"}}),
        );
        let settings = Settings::from_pairs(vec![
            ("DB", url.as_str()),
            ("STATE", &format!("file:{}", app.state_dir.display())),
            ("DBTRIGGER_APP_NAME", &app.app_name),
        ]);
        let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
        let source = dbtrigger::source::open(&config.source).unwrap();
        let fetched = source.fetch_after(None, FetchLimit { rows: 10, bytes: usize::MAX }).await.unwrap();
        fetched.rows.iter().map(|row| Value::Object(row.row.to_map())).collect::<Vec<_>>()
    };
    for (event, polled) in events.iter().zip(&polled) {
        assert_eq!(event["op"], "insert");
        let new = &event["row"]["new"];
        for (column, value) in polled.as_object().unwrap() {
            assert_eq!(&new[column], value, "column {column}: binlog {} vs polling {value}", new[column]);
        }
        assert_eq!(new.as_object().unwrap().len(), polled.as_object().unwrap().len());
    }
}

pub(crate) async fn connection(url: &str) -> sqlx::MySqlConnection {
    <sqlx::MySqlConnection as sqlx::Connection>::connect(url).await.unwrap()
}

pub(crate) async fn run(connection: &mut sqlx::MySqlConnection, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string())).execute(connection).await.unwrap();
}

/// Interleaved transactions on two sessions: the one that commits first is delivered first
/// whatever began first; a rolled-back one is never seen; a transaction over two tables comes
/// whole with its ordinals; updates carry the old row and the new, deletes the old; a table not
/// configured is never delivered; an `ALTER TABLE` between changes is followed (the new column
/// named from the next change on). Each change once, with batches smaller than a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_arrive_once_each_in_commit_order_with_their_images() {
    let (url, database) = binlog_database(
        "CREATE TABLE orders (id INT PRIMARY KEY, note VARCHAR(20));\n\
         CREATE TABLE items (id INT PRIMARY KEY, order_id INT);\n\
         CREATE TABLE other (id INT PRIMARY KEY)",
    )
    .await;
    let directory = tempfile::tempdir().unwrap();
    let tables = vec![format!("{database}.orders"), format!("{database}.items")];
    let (_app, _, config) = binlog_app(directory.path(), &url, &tables, 2, unused_sink());
    let store = Arc::new(MemoryStore::new());
    let (poller, sink) = poller(config, store.clone());
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle));
    let (mut early, mut late) = (connection(&url).await, connection(&url).await);
    // `late` begins first and commits last.
    run(&mut late, "BEGIN").await;
    run(&mut late, "INSERT INTO orders VALUES (10, 'late')").await;
    run(&mut early, "BEGIN").await;
    run(&mut early, "INSERT INTO orders VALUES (1, 'a')").await;
    run(&mut early, "INSERT INTO items VALUES (100, 1)").await;
    run(&mut early, "INSERT INTO other VALUES (7)").await;
    run(&mut early, "INSERT INTO items VALUES (101, 1)").await;
    run(&mut early, "COMMIT").await;
    let mut rolled_back = connection(&url).await;
    run(&mut rolled_back, "BEGIN").await;
    run(&mut rolled_back, "INSERT INTO orders VALUES (666, 'never')").await;
    run(&mut rolled_back, "ROLLBACK").await;
    run(&mut late, "UPDATE orders SET note = 'late2' WHERE id = 10").await;
    run(&mut late, "COMMIT").await;
    run(&mut early, "UPDATE orders SET note = 'b' WHERE id = 1").await;
    run(&mut early, "ALTER TABLE orders ADD COLUMN extra INT DEFAULT 5").await;
    run(&mut early, "DELETE FROM items WHERE order_id = 1").await;
    run(&mut early, "UPDATE orders SET id = 2 WHERE id = 1").await;
    tick_until_idle(&poller).await;
    let expected: Vec<(&str, &str, Value, Value)> = vec![
        ("insert", "orders", json!(1), Value::Null),
        ("insert", "items", json!(100), Value::Null),
        ("insert", "items", json!(101), Value::Null),
        ("insert", "orders", json!(10), Value::Null),
        ("update", "orders", json!(10), json!(10)),
        ("update", "orders", json!(1), json!(1)),
        ("delete", "items", Value::Null, json!(100)),
        ("delete", "items", Value::Null, json!(101)),
        ("update", "orders", json!(2), json!(1)),
    ];
    let expected: Vec<(String, String, Value, Value)> =
        expected.into_iter().map(|(op, table, new, old)| (op.into(), table.into(), new, old)).collect();
    assert_eq!(changes(&sink), expected);
    let events = event_values(&sink);
    // The multi-table transaction: one position, ordinals 1..3 (the other table's row not counted).
    let first: Vec<(Value, Value)> =
        events[..3].iter().map(|event| (event["cursor"].clone(), event["pk"]["ordinal"].clone())).collect();
    assert!(first.iter().all(|(cursor, _)| *cursor == first[0].0), "{first:?}");
    assert_eq!(first.iter().map(|(_, ordinal)| ordinal.clone()).collect::<Vec<_>>(), [json!(1), json!(2), json!(3)]);
    assert_eq!(events[4]["row"]["old"]["note"], "late");
    assert_eq!(events[4]["row"]["new"]["note"], "late2");
    assert!(events[0]["row"]["gtid"].as_str().unwrap().starts_with("0-1-"), "{}", events[0]["row"]);
    assert!(events[0]["row"]["binlog_file"].as_str().unwrap().starts_with("binlog."));
    assert!(events[5]["row"]["new"].get("extra").is_none(), "before the ALTER");
    assert_eq!(events[8]["row"]["new"]["extra"], 5, "after the ALTER");
    let at = chrono::DateTime::parse_from_rfc3339(events[0]["row"]["commit_time"].as_str().unwrap()).unwrap();
    assert!((chrono::Utc::now() - at.with_timezone(&chrono::Utc)).num_seconds().abs() < 60);
    // Nothing more, nothing again.
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle));
    assert_eq!(changes(&sink).len(), expected.len());
}
