//! Foreign-key cascades (issue 45 #4). MariaDB applies a cascade inside InnoDB and logs only the
//! statement's own rows: the children a parent's `ON DELETE CASCADE` deletes (or `SET NULL`
//! updates) have no event in the binary log, so a binary-log poller never sees them; `check`
//! warns of each such key reaching a watched table. PostgreSQL's slot holds cascaded rows as
//! ordinary changes.

use std::sync::Arc;

use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::TickOutcome;
use serde_json::{Value, json};

use crate::binlog::{binlog_app, binlog_database};
use crate::harness::{Receiver, run_dbtrigger};
use crate::sources::execute;

/// (op, table, id) of every event acknowledged, in arrival order.
fn received(receiver: &Receiver) -> Vec<(String, String, i64)> {
    receiver
        .acknowledged()
        .iter()
        .flat_map(|received| received.envelope["events"].as_array().unwrap().clone())
        .map(|event| {
            let row = &event["row"];
            let image = if row["new"].is_object() { &row["new"] } else { &row["old"] };
            let table = row["table"].as_str().unwrap().rsplit('.').next().unwrap().to_string();
            (event["op"].as_str().unwrap().to_string(), table, image["id"].as_i64().unwrap())
        })
        .collect()
}

/// Measured on the suite's MariaDB (ROW format, full images): a parent's delete whose foreign
/// keys cascade deletes two children and sets a third's reference to NULL; the server logs the
/// parent's delete only, so it alone arrives, the children's changes never do. `check` warns
/// of both keys by name (and of neither for the parent), and still passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cascaded_delete_is_not_in_the_binary_log_and_check_warns() {
    let (url, database) = binlog_database(
        "CREATE TABLE parents (id INT PRIMARY KEY);\n\
         CREATE TABLE children (id INT PRIMARY KEY, parent INT, \
           CONSTRAINT children_parent FOREIGN KEY (parent) REFERENCES parents (id) ON DELETE CASCADE);\n\
         CREATE TABLE notes (id INT PRIMARY KEY, parent INT NULL, \
           CONSTRAINT notes_parent FOREIGN KEY (parent) REFERENCES parents (id) ON DELETE SET NULL)",
    )
    .await;
    let receiver = Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let sink = json!({"type": "webhook", "url": receiver.url});
    let tables: Vec<String> =
        ["parents", "children", "notes"].iter().map(|table| format!("{database}.{table}")).collect();
    let (app, settings, _) = binlog_app(directory.path(), &url, &tables, 50, sink);

    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["check"]);
    assert!(ok, "a warning does not fail the check: {stdout}{stderr}");
    let warnings: Vec<&str> = stdout.lines().filter(|line| line.starts_with("warning: orders: ")).collect();
    assert_eq!(warnings.len(), 2, "{stdout}");
    assert!(
        warnings[0].contains(&format!(
            "{database}.children is changed by foreign key children_parent (to {database}.parents, ON DELETE CASCADE)"
        )),
        "{stdout}"
    );
    assert!(
        warnings[1].contains(&format!(
            "{database}.notes is changed by foreign key notes_parent (to {database}.parents, ON DELETE SET NULL)"
        )),
        "{stdout}"
    );
    assert!(stdout.contains("ok: orders (poller orders)"), "{stdout}");

    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    execute(&url, "INSERT INTO parents VALUES (1);\nINSERT INTO children VALUES (10, 1), (11, 1);\nINSERT INTO notes VALUES (20, 1)")
        .await;
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    execute(&url, "DELETE FROM parents WHERE id = 1").await;
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    let children: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM children").fetch_one(&pool).await.unwrap();
    let orphaned: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM notes WHERE parent IS NULL").fetch_one(&pool).await.unwrap();
    pool.close().await;
    assert_eq!((children, orphaned), (0, 1), "the cascade ran");
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    let owned = |op: &str, table: &str, id: i64| (op.to_string(), table.to_string(), id);
    assert_eq!(
        received(&receiver),
        [
            owned("insert", "parents", 1),
            owned("insert", "children", 10),
            owned("insert", "children", 11),
            owned("insert", "notes", 20),
            owned("delete", "parents", 1),
        ],
        "the parent's delete arrives, the cascade's changes do not (they are not in the binary log)"
    );
}

/// PostgreSQL runs a cascade as ordinary row changes, and its slot holds them: the children a
/// parent's `ON DELETE CASCADE` deletes arrive as deletes, the reference `SET NULL` clears as an
/// update, in the parent's transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cascaded_delete_arrives_from_the_slot_as_ordinary_changes() {
    let (url, slot) = crate::logical::logical_database(
        "CREATE TABLE parents (id BIGINT PRIMARY KEY);\n\
         CREATE TABLE children (id BIGINT PRIMARY KEY, parent BIGINT REFERENCES parents (id) ON DELETE CASCADE);\n\
         CREATE TABLE notes (id BIGINT PRIMARY KEY, parent BIGINT NULL REFERENCES parents (id) ON DELETE SET NULL);\n\
         ALTER TABLE children REPLICA IDENTITY FULL;\n\
         ALTER TABLE notes REPLICA IDENTITY FULL",
        "parents, children, notes",
    )
    .await;
    execute(&url, "INSERT INTO parents VALUES (1);\nINSERT INTO children VALUES (10, 1), (11, 1);\nINSERT INTO notes VALUES (20, 1)")
        .await;
    execute(&url, "DELETE FROM parents WHERE id = 1").await;
    let directory = tempfile::tempdir().unwrap();
    let config = crate::logical::logical_app(directory.path(), &url, &slot, 50).2;
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (poller, sink) = crate::logical::poller(config, source, Arc::new(MemoryStore::new()));
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { .. }), "{outcome:?}");
    let delivered: Vec<(String, String, Value, Value)> = sink
        .batches()
        .iter()
        .flat_map(|batch| batch.events.iter())
        .map(|event| {
            let value = event.to_value();
            let row = &value["row"];
            let id = if row["new"].is_object() { row["new"]["id"].clone() } else { row["old"]["id"].clone() };
            let parent = row["new"].get("parent").cloned().unwrap_or(Value::Null);
            (value["op"].as_str().unwrap().to_string(), row["table"].as_str().unwrap().to_string(), id, parent)
        })
        .collect();
    let change =
        |op: &str, table: &str, id: i64, parent: Value| (op.to_string(), format!("public.{table}"), json!(id), parent);
    let deleted = &delivered[4..];
    assert_eq!(delivered.len(), 8, "{delivered:?}");
    assert_eq!(delivered[4], change("delete", "parents", 1, Value::Null), "{delivered:?}");
    for cascaded in [
        change("delete", "children", 10, Value::Null),
        change("delete", "children", 11, Value::Null),
        change("update", "notes", 20, Value::Null),
    ] {
        assert!(deleted.contains(&cascaded), "{cascaded:?} in {delivered:?}");
    }
    crate::logical::drop_slot(&url, &slot).await;
}
