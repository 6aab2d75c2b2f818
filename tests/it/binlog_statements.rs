//! The binary-log source's paths that are not row events (issue 45), on a real MariaDB through the
//! real binary: a change a session logged as a statement stops the poller loudly, naming its place
//! and table, and nothing after it is delivered or passed; a read refuses a server whose global
//! `binlog_format` is not ROW; a `TRUNCATE` of a watched table is an event in commit order.

use std::time::Duration;

use serde_json::{Value, json};

use crate::binlog::{binlog_database, connection, run};
use crate::harness::{AppRoot, Receiver, run_dbtrigger};
use crate::services::{BINLOG_ARGUMENTS, MariaDbOptions, mariadb_with};
use crate::sources::execute;

fn app(
    directory: &std::path::Path,
    url: &str,
    tables: &[String],
    receiver: &Receiver,
) -> (AppRoot, Vec<(String, String)>) {
    app_with(directory, url, tables, receiver, json!({"size": 50}))
}

fn app_with(
    directory: &std::path::Path,
    url: &str,
    tables: &[String],
    receiver: &Receiver,
    batch: Value,
) -> (AppRoot, Vec<(String, String)>) {
    let app = AppRoot::write(
        directory,
        json!({
            "source": {"kind": "binlog", "connection": "FEED_DB", "tables": tables},
            "batch": batch,
            "sink": {"type": "webhook", "url": receiver.url},
            "state": {"connection": "STATE"}
        }),
    );
    let settings = vec![
        ("FEED_DB".to_string(), url.to_string()),
        ("STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];
    (app, settings)
}

fn document(app: &AppRoot) -> Value {
    let path = app.state_dir.join(format!("state/{}/orders.json", app.app_name));
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn tick(app: &AppRoot, settings: &[(String, String)]) -> (bool, String) {
    let (ok, stdout, stderr) = run_dbtrigger(app, settings, &["tick", "orders"]);
    (ok, format!("{stdout}{stderr}"))
}

/// (op, table, id) of every event acknowledged, in arrival order (the id `new`'s, else `old`'s;
/// null for a truncate).
fn received(receiver: &Receiver) -> Vec<(String, String, Value)> {
    receiver
        .acknowledged()
        .iter()
        .flat_map(|received| received.envelope["events"].as_array().unwrap().clone())
        .map(|event| {
            let row = &event["row"];
            let id = row["new"].get("id").or_else(|| row["old"].get("id")).cloned().unwrap_or(Value::Null);
            let table = row["table"].as_str().unwrap().split('.').nth(1).unwrap().to_string();
            (event["op"].as_str().unwrap().to_string(), table, id)
        })
        .collect()
}

fn ids(pairs: &[(&str, &str, Value)]) -> Vec<(String, String, Value)> {
    pairs.iter().map(|(op, table, id)| (op.to_string(), table.to_string(), id.clone())).collect()
}

/// The binary log's events as the server lists them: (file, start, type, info).
async fn binlog_events(url: &str) -> Vec<(String, u64, String, String)> {
    let pool = sqlx::MySqlPool::connect(url).await.unwrap();
    let files: Vec<(String, u64)> = sqlx::query_as("SHOW BINARY LOGS").fetch_all(&pool).await.unwrap();
    let mut events = Vec::new();
    for (file, _) in files {
        let rows: Vec<(String, u64, String, u32, u64, String)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SHOW BINLOG EVENTS IN '{file}'")))
                .fetch_all(&pool)
                .await
                .unwrap();
        events.extend(rows.into_iter().map(|(file, pos, kind, _, _, info)| (file, pos, kind, info)));
    }
    pool.close().await;
    events
}

/// The checkpoint's transaction start as a (file number, offset) pair.
fn checkpoint_at(app: &AppRoot) -> (u64, u64) {
    let cursor = document(app)["checkpoint"]["cursor"]["value"].as_i64().unwrap() as u64;
    (cursor >> 32, cursor & 0xffff_ffff)
}

fn file_number(file: &str) -> u64 {
    file.rsplit('.').next().unwrap().parse().unwrap()
}

/// A session that sets `binlog_format=STATEMENT` (any session may: the global ROW says nothing of
/// it) updates a watched table: the tick that reaches it fails naming the statement's place and
/// the table, every later tick too, nothing after it is delivered, the checkpoint stays before its
/// transaction and `status` shows the poller failing with the reason. A statement on a table the
/// poller does not watch is passed. A server whose global format is not ROW is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_logged_as_a_statement_stops_the_poller_naming_it() {
    // A server of its own: the test sets the global binlog_format.
    let server = mariadb_with(&MariaDbOptions { arguments: BINLOG_ARGUMENTS, system_time_zone: None });
    let url = server.fresh_database().await;
    let database = url.rsplit('/').next().unwrap().to_string();
    execute(&url, "CREATE TABLE items (id INT PRIMARY KEY, n INT);\nCREATE TABLE other (id INT PRIMARY KEY, n INT)")
        .await;
    let receiver = Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings) = app(directory.path(), &url, &[format!("{database}.items")], &receiver);
    let (ok, output) = tick(&app, &settings);
    assert!(ok, "{output}");
    execute(&url, "INSERT INTO items VALUES (1, 0), (2, 0), (3, 0), (4, 0)").await;
    let mut session = connection(&url).await;
    run(&mut session, "SET SESSION binlog_format = 'STATEMENT'").await;
    // A table the poller does not watch: passed.
    run(&mut session, "INSERT INTO other VALUES (1, 0)").await;
    run(&mut session, "BEGIN").await;
    run(&mut session, "UPDATE items SET n = n + 1 WHERE id <= 4").await;
    run(&mut session, "COMMIT").await;
    execute(&url, "INSERT INTO items VALUES (5, 0)").await;
    let events = binlog_events(&url).await;
    let statement = events
        .iter()
        .position(|(_, _, kind, info)| kind == "Query" && info.contains("UPDATE items SET n = n + 1"))
        .expect("the update is logged as a statement");
    let (file, at, ..) = events[statement].clone();
    // Its transaction starts at the GTID event before it.
    let start = events[..statement].iter().rev().find(|(_, _, kind, _)| kind == "Gtid").unwrap().1;

    let (ok, output) = tick(&app, &settings);
    assert!(!ok, "the tick must fail: {output}");
    let place = format!("{file}:{at}");
    assert!(output.contains(&place) && output.contains(&format!("{database}.items")), "{output}");
    assert!(output.contains("logged as a statement"), "{output}");
    let inserts: Vec<(&str, &str, Value)> = (1..=4).map(|id| ("insert", "items", json!(id))).collect();
    assert_eq!(received(&receiver), ids(&inserts), "nothing at or after the statement is delivered");
    let checkpoint = checkpoint_at(&app);
    assert!(checkpoint < (file_number(&file), start), "the checkpoint {checkpoint:?} stays before {file}:{start}");
    // Every later tick stops the same way, and the checkpoint does not move.
    let (ok, output) = tick(&app, &settings);
    assert!(!ok && output.contains(&place), "{output}");
    assert_eq!(checkpoint_at(&app), checkpoint);
    assert_eq!(received(&receiver).len(), 4);
    let (ok, status, stderr) = run_dbtrigger(&app, &settings, &["status"]);
    assert!(!ok, "status exits non-zero: {status}{stderr}");
    assert!(status.contains("logged as a statement") && status.contains(&place), "{status}");

    // Past it by hand; a server whose global format is not ROW is refused before any read.
    let (ok, stdout, stderr) = run_dbtrigger(
        &app,
        &settings,
        &["reset", "orders", "--to-end", "--yes", "--reason", "updates applied by hand"],
    );
    assert!(ok, "{stdout}{stderr}");
    execute(&url, "SET GLOBAL binlog_format = 'MIXED'").await;
    let (ok, output) = tick(&app, &settings);
    execute(&url, "SET GLOBAL binlog_format = 'ROW'").await;
    assert!(!ok && output.contains("binlog_format is MIXED"), "{output}");
    execute(&url, "INSERT INTO items VALUES (6, 0)").await;
    let (ok, output) = tick(&app, &settings);
    assert!(ok, "{output}");
    assert_eq!(received(&receiver).last().unwrap(), &("insert".to_string(), "items".to_string(), json!(6)));
}

/// `TRUNCATE TABLE` of a watched table (always logged as a statement) is one event, `op:
/// "truncate"`, in commit order: with batches of one and four in flight, every change before it is
/// acknowledged before it and every change after it after it (a barrier for the per-key window).
/// A truncate of a table not watched delivers nothing; nothing is delivered twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncate_of_a_watched_table_is_an_event_in_commit_order() {
    let (url, database) =
        binlog_database("CREATE TABLE items (id INT PRIMARY KEY, n INT);\nCREATE TABLE other (id INT PRIMARY KEY)")
            .await;
    let receiver = Receiver::start().await;
    receiver.set_delay(Duration::from_millis(30));
    let directory = tempfile::tempdir().unwrap();
    let batch = json!({"size": 1, "maxInFlight": 4, "commitIntervalMs": 0});
    let (app, settings) = app_with(directory.path(), &url, &[format!("{database}.items")], &receiver, batch);
    let (ok, output) = tick(&app, &settings);
    assert!(ok, "{output}");
    execute(
        &url,
        "INSERT INTO items VALUES (1, 0), (2, 0), (3, 0);\nINSERT INTO other VALUES (1);\nTRUNCATE TABLE other;\n\
         TRUNCATE TABLE items;\nINSERT INTO items VALUES (1, 1), (4, 1), (5, 1)",
    )
    .await;
    let events = binlog_events(&url).await;
    let truncate = events
        .iter()
        .position(|(_, _, kind, info)| kind == "Query" && info.contains("TRUNCATE TABLE items"))
        .expect("the truncate is logged");
    let start = events[..truncate].iter().rev().find(|(_, _, kind, _)| kind == "Gtid").unwrap().clone();
    let (ok, output) = tick(&app, &settings);
    assert!(ok, "{output}");
    let got = received(&receiver);
    assert_eq!(got.len(), 7, "{got:?}");
    let mut before: Vec<Value> = got[..3].iter().map(|(_, _, id)| id.clone()).collect();
    before.sort_by_key(|id| id.as_i64());
    assert!(got[..3].iter().all(|(op, _, _)| op == "insert"), "{got:?}");
    assert_eq!(before, [json!(1), json!(2), json!(3)], "{got:?}");
    assert_eq!(got[3], ("truncate".to_string(), "items".to_string(), Value::Null), "{got:?}");
    let mut after: Vec<Value> = got[4..].iter().map(|(_, _, id)| id.clone()).collect();
    after.sort_by_key(|id| id.as_i64());
    assert_eq!(after, [json!(1), json!(4), json!(5)], "{got:?}");
    // The event: its table, no images, its transaction's place.
    let event = receiver
        .acknowledged()
        .iter()
        .flat_map(|received| received.envelope["events"].as_array().unwrap().clone())
        .find(|event| event["op"] == "truncate")
        .unwrap();
    assert_eq!(event["row"]["table"], format!("{database}.items"));
    assert!(event["row"]["new"].is_null() && event["row"]["old"].is_null(), "{event}");
    assert_eq!(event["row"]["binlog_file"], start.0.as_str());
    assert_eq!(event["row"]["binlog_position"], start.1);
    assert_eq!(event["pk"]["ordinal"], 1);
    assert!(event["row"]["gtid"].as_str().unwrap().starts_with("0-1-"), "{event}");
    // Nothing again.
    let (ok, output) = tick(&app, &settings);
    assert!(ok, "{output}");
    assert_eq!(received(&receiver).len(), 7);
}
