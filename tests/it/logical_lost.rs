//! A lost replication slot (issue 29) on a real PostgreSQL: invalidated by the server
//! (`max_slot_wal_keep_size`) or dropped after the poller read from it. The tick fails naming the
//! slot and the gap, the failure is recorded (`status` unhealthy, the watchdog's `slot_lost`), the
//! checkpoint stays and nothing recreates the slot; the poller stays stopped, even once the slot
//! exists again, until an operator resets it. Then the runbook's path works end to end: the
//! slot recreated, `reset --to-end`, the gap loaded again by a polling poller.

use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::{AppRoot, Receiver, run_dbtrigger};
use crate::logical::drop_slot;
use crate::logical_reset::{received_ids, receiving_app};
use crate::sources::execute;

/// `changed` is the backfill's cursor.
const TABLE_SQL: &str =
    "CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT, changed TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())";

fn add_function(app: &AppRoot, name: &str, function: Value) {
    crate::schema::assert_valid_function_json(&function);
    std::fs::create_dir_all(app.root.join(name)).unwrap();
    std::fs::write(app.root.join(format!("{name}/function.json")), serde_json::to_vec_pretty(&function).unwrap())
        .unwrap();
}

/// A watchdog, and a polling poller `backfill` over `orders` into the same receiver (the runbook's
/// load of the gap).
fn add_watchdog_and_backfill(app: &AppRoot, receiver: &Receiver) {
    let timer = json!([{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}]);
    add_function(app, "watchdog", json!({"bindings": timer, "watchdog": {"state": {"connection": "STATE"}}}));
    add_function(
        app,
        "backfill",
        json!({"bindings": timer, "poller": {
            "source": {"connection": "FEED_DB", "table": "orders", "cursor": "changed", "pk": ["id"], "settleSeconds": 0},
            "sink": {"type": "webhook", "url": receiver.url},
            "state": {"connection": "STATE"}
        }}),
    );
}

fn checkpoint(app: &AppRoot) -> Value {
    let path = app.state_dir.join(format!("state/{}/orders.json", app.app_name));
    let document: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    document["checkpoint"]["cursor"].clone()
}

fn tick(app: &AppRoot, settings: &[(String, String)], function: &str) -> (bool, String) {
    let (ok, stdout, stderr) = run_dbtrigger(app, settings, &["tick", function]);
    (ok, format!("{stdout}{stderr}"))
}

/// The slot lost: the tick fails loudly and records it; the checkpoint stays; the watchdog says
/// `slot_lost`; the slot created again does not let the poller go on by itself.
fn assert_stopped_on_a_lost_slot(app: &AppRoot, settings: &[(String, String)], slot: &str, cause: &str) {
    let before = checkpoint(app);
    let (ok, output) = tick(app, settings, "orders");
    assert!(!ok, "{output}");
    assert!(output.contains(&format!("replication slot {slot} on ")), "{output}");
    assert!(output.contains(cause), "{output}");
    assert!(output.contains("are a gap: the poller stops here"), "{output}");
    assert_eq!(checkpoint(app), before, "the checkpoint stays where it was");
    let (ok, status, _) = run_dbtrigger(app, settings, &["status", "--json"]);
    assert!(!ok, "{status}");
    let health: Value = serde_json::from_str(&status).unwrap();
    let orders = health.as_array().unwrap().iter().find(|poller| poller["poller"] == "orders").unwrap();
    assert_eq!(orders["healthy"], json!(false), "{orders}");
    assert_eq!(orders["slot_lost"], json!(slot), "{orders}");
    assert!(orders["last_error"].as_str().unwrap().contains("is lost"), "{orders}");
    let (ok, watchdog) = tick(app, settings, "watchdog");
    assert!(!ok, "{watchdog}");
    assert!(watchdog.contains("finding=slot_lost function=orders poller=orders"), "{watchdog}");
}

/// The runbook after the slot is created again: the poller still refuses until `reset --to-end`;
/// then it delivers what follows the reset, and the polling poller loads the gap.
async fn recover(app: &AppRoot, settings: &[(String, String)], url: &str, receiver: &Receiver, delivered: &[i64]) {
    let (ok, output) = tick(app, settings, "orders");
    assert!(!ok, "a slot created again is not an operator's reset: {output}");
    assert!(output.contains("no operator has reset the poller since"), "{output}");
    assert_eq!(received_ids(receiver), delivered, "nothing delivered from the new slot before the reset");
    let (ok, stdout, stderr) = run_dbtrigger(app, settings, &["reset", "orders", "--to-end", "--yes"]);
    assert!(ok, "{stdout}{stderr}");
    execute(url, "INSERT INTO orders VALUES (100, 'after the reset')").await;
    let (ok, output) = tick(app, settings, "orders");
    assert!(ok, "{output}");
    let mut expected = delivered.to_vec();
    expected.push(100);
    assert_eq!(received_ids(receiver), expected);
    let (ok, watchdog) = tick(app, settings, "watchdog");
    assert!(!watchdog.contains("slot_lost"), "{ok} {watchdog}");
    // The gap, loaded again: every row as it is now, through the polling poller.
    let (ok, output) = tick(app, settings, "backfill");
    assert!(ok, "{output}");
    let rows: Vec<i64> = received_ids(receiver)[expected.len()..].to_vec();
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let now: Vec<i64> = sqlx::query_scalar("SELECT id FROM orders ORDER BY id").fetch_all(&pool).await.unwrap();
    pool.close().await;
    assert_eq!(rows, now, "the backfill delivers every row as it is");
}

async fn create_slot(url: &str, slot: &str) {
    execute(url, &format!("SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_dropped_after_use_stops_the_poller_until_an_operator_resets_it() {
    let (url, slot) = crate::logical::logical_database(TABLE_SQL, "orders").await;
    let receiver = Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings) = receiving_app(directory.path(), &url, &slot, &receiver);
    add_watchdog_and_backfill(&app, &receiver);
    execute(&url, "INSERT INTO orders VALUES (1, 'a'), (2, 'b')").await;
    assert!(tick(&app, &settings, "orders").0);
    assert_eq!(received_ids(&receiver), vec![1, 2]);

    drop_slot(&url, &slot).await;
    // The gap: changes made while there is no slot.
    execute(&url, "INSERT INTO orders VALUES (3, 'gap');\nUPDATE orders SET note = 'gap' WHERE id = 2").await;
    assert_stopped_on_a_lost_slot(&app, &settings, &slot, "it does not exist, and the poller has a checkpoint");
    // Nothing recreated the slot.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1")
        .bind(&slot)
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    assert_eq!(slots, 0);

    create_slot(&url, &slot).await;
    execute(&url, "INSERT INTO orders VALUES (4, 'after the new slot, before the reset')").await;
    recover(&app, &settings, &url, &receiver, &[1, 2]).await;
    drop_slot(&url, &slot).await;
}

async fn scalar(url: &str, sql: &str) -> Option<String> {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let value: Option<String> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string())).fetch_optional(&pool).await.unwrap().flatten();
    pool.close().await;
    value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_the_server_invalidated_stops_the_poller_until_an_operator_resets_it() {
    // A server of its own: max_slot_wal_keep_size is the server's, and would invalidate the other
    // tests' slots.
    let server = crate::services::postgres_with_max_connections(40);
    let url = server.fresh_database().await;
    let slot = "lost_here";
    execute(&url, &format!("{TABLE_SQL};\nCREATE PUBLICATION feed FOR TABLE orders")).await;
    create_slot(&url, slot).await;
    execute(&url, "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'").await;
    execute(&url, "SELECT pg_reload_conf()").await;
    let receiver = Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings) = receiving_app(directory.path(), &url, slot, &receiver);
    add_watchdog_and_backfill(&app, &receiver);
    execute(&url, "INSERT INTO orders VALUES (1, 'a')").await;
    assert!(tick(&app, &settings, "orders").0);
    assert_eq!(received_ids(&receiver), vec![1]);

    // Changes the slot holds, then WAL past what it may keep: the server invalidates it.
    execute(&url, "INSERT INTO orders VALUES (2, 'lost with the slot')").await;
    let wal_status = format!("SELECT wal_status FROM pg_replication_slots WHERE slot_name = '{slot}'");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while scalar(&url, &wal_status).await.as_deref() != Some("lost") {
        assert!(std::time::Instant::now() < deadline, "the server never invalidated the slot");
        execute(&url, "CREATE TABLE IF NOT EXISTS filler (v TEXT);\nINSERT INTO filler SELECT repeat('w', 500) FROM generate_series(1, 3000)").await;
        execute(&url, "SELECT pg_switch_wal()").await;
        execute(&url, "CHECKPOINT").await;
    }
    assert_stopped_on_a_lost_slot(&app, &settings, slot, "the server invalidated it (wal_status lost");
    let (_, status, _) = run_dbtrigger(&app, &settings, &["status"]);
    assert!(status.contains("wal_status lost"), "{status}");

    // The runbook: the slot dropped and created again, then the operator's reset.
    drop_slot(&url, slot).await;
    create_slot(&url, slot).await;
    recover(&app, &settings, &url, &receiver, &[1]).await;
    drop_slot(&url, slot).await;
}
