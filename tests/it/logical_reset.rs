//! Resetting a logical poller (issue 29) on a real PostgreSQL: `reset --to-end` skips every
//! change committed before it for good and delivers those after, moving the slot; a slot cannot
//! go back, so `--to-beginning` and a position behind the slot are refused in words; a crash
//! between the document's write and the slot's move loses and repeats nothing.

use std::sync::Arc;

use dbtrigger::operations::reset::{self, ResetTo};
use dbtrigger::operations::{Applied, Operator, Parts, apply};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::TickOutcome;
use serde_json::{Value, json};

use crate::harness::{AppRoot, Receiver, run_dbtrigger};
use crate::logical::{confirmed_flush, drop_slot, logical_app, logical_database, poller};
use crate::sources::execute;

/// The id of every change a receiver acknowledged, in order: a logical event's new row (else its
/// old key), a polling event's row.
pub(crate) fn received_ids(receiver: &Receiver) -> Vec<i64> {
    receiver
        .acknowledged()
        .iter()
        .flat_map(|received| received.envelope["events"].as_array().unwrap().clone())
        .map(|event| {
            let row = &event["row"];
            row.get("new")
                .and_then(|new| new.get("id"))
                .or_else(|| row.get("old").and_then(|old| old.get("id")))
                .or_else(|| row.get("id"))
                .and_then(Value::as_i64)
                .unwrap()
        })
        .collect()
}

pub(crate) async fn restart_lsn(url: &str, slot: &str) -> u64 {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let text: String = sqlx::query_scalar("SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = $1")
        .bind(slot)
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    dbtrigger::source::logical::values::parse_lsn(&text).unwrap()
}

/// A logical poller delivering to `receiver`, its state in files: the app and its settings.
pub(crate) fn receiving_app(
    directory: &std::path::Path,
    url: &str,
    slot: &str,
    receiver: &Receiver,
) -> (AppRoot, Vec<(String, String)>) {
    let app = AppRoot::write(
        directory,
        json!({
            "source": {"kind": "logical", "connection": "FEED_DB", "slot": slot, "publication": "feed"},
            "batch": {"size": 10},
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

/// `reset --to-end` through the binary: the plan says what it skips; the changes committed before
/// it are never delivered (one of them in a transaction still open at the reset is, since it
/// commits after), those after it are; the slot's confirmed and restart positions moved; the
/// history says who reset it. A live tick's lease, `--to-beginning` and a position behind the slot
/// are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_to_the_end_skips_what_committed_before_it_and_moves_the_slot() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT)", "orders").await;
    let receiver = Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings) = receiving_app(directory.path(), &url, &slot, &receiver);
    execute(&url, "INSERT INTO orders VALUES (1, 'a'), (2, 'b')").await;
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    assert_eq!(received_ids(&receiver), vec![1, 2]);

    // Pending at the reset: three changes committed, one transaction open.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let mut open = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES (6, 'open at the reset')").execute(&mut *open).await.unwrap();
    execute(&url, "INSERT INTO orders VALUES (3, 'x'), (4, 'x');\nDELETE FROM orders WHERE id = 1").await;
    // WAL past the slot's restart position (a checkpoint logs the running transactions it moves by).
    execute(
        &url,
        "CREATE TABLE filler (v TEXT);\nINSERT INTO filler SELECT repeat('f', 100) FROM generate_series(1, 2000)",
    )
    .await;
    execute(&url, "CHECKPOINT").await;
    let confirmed_before = confirmed_flush(&url, &slot).await;
    let restart_before = restart_lsn(&url, &slot).await;

    // While a live tick holds the lease, the reset is refused and the slot stays.
    let state = app.state_dir.join(format!("state/{}/orders.json", app.app_name));
    let unleased = std::fs::read(&state).unwrap();
    let mut document: serde_json::Value = serde_json::from_slice(&unleased).unwrap();
    let until = chrono::Utc::now() + chrono::Duration::minutes(5);
    document["lease"] = json!({"owner_id": "worker-9/77-live", "fencing_token": document["lease"]["fencing_token"],
                               "acquired_at": chrono::Utc::now(), "heartbeat_at": chrono::Utc::now(), "expires_at": until});
    std::fs::write(&state, serde_json::to_vec_pretty(&document).unwrap()).unwrap();
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["reset", "orders", "--to-end", "--yes"]);
    assert!(!ok);
    assert!(stderr.contains("worker-9/77-live") && stderr.contains("a tick is running"), "{stderr}");
    assert_eq!(confirmed_flush(&url, &slot).await, confirmed_before, "the slot stays while the reset is refused");
    std::fs::write(&state, unleased).unwrap();

    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["reset", "orders", "--to-end", "--yes"]);
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains(&format!("replication slot {slot} is at ")), "{stdout}");
    assert!(stdout.contains("3 changes wait after the current checkpoint"), "{stdout}");
    assert!(stdout.contains("is skipped for good"), "{stdout}");
    assert!(stdout.contains(&format!("written; replication slot {slot} moved to ")), "{stdout}");
    let confirmed_after = confirmed_flush(&url, &slot).await;
    assert!(confirmed_after > confirmed_before, "the slot's confirmed position moved");
    // The slot releases WAL: its restart position moves on once the server logs where its
    // running transactions stand (the open one still holds it back until it ends).
    sqlx::query("INSERT INTO orders VALUES (7, 'after')").execute(&pool).await.unwrap();
    open.commit().await.unwrap();
    execute(&url, "CHECKPOINT").await;

    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    assert_eq!(received_ids(&receiver), vec![1, 2, 7, 6], "only what committed after the reset, in commit order");
    assert!(restart_lsn(&url, &slot).await > restart_before, "the slot's restart position moved");
    assert!(confirmed_flush(&url, &slot).await > confirmed_after);
    let (_, document, _) = run_dbtrigger(&app, &settings, &["inspect", "orders"]);
    assert!(document.contains("\"action\": \"reset\""), "{document}");

    // A slot cannot go back.
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["reset", "orders", "--to-beginning", "--yes"]);
    assert!(!ok);
    assert!(stderr.contains("cannot go back to the beginning"), "{stderr}");
    assert!(stderr.contains("first load"), "{stderr}");
    let (ok, _, stderr) =
        run_dbtrigger(&app, &settings, &["reset", "orders", "--to-cursor", "1", "--pk", "ordinal=1", "--yes"]);
    assert!(!ok);
    assert!(stderr.contains("a slot cannot go back"), "{stderr}");
    // A position at or after the slot, and not past the WAL's end, is taken (written as
    // PostgreSQL writes an LSN).
    execute(&url, "INSERT INTO orders VALUES (8, 'WAL past the slot')").await;
    let ahead = dbtrigger::source::logical::values::lsn_text(confirmed_flush(&url, &slot).await + 1);
    let (ok, stdout, stderr) =
        run_dbtrigger(&app, &settings, &["reset", "orders", "--to-cursor", &ahead, "--pk", "ordinal=2", "--yes"]);
    assert!(ok, "{stdout}{stderr}");
    pool.close().await;
    drop_slot(&url, &slot).await;
}

/// The document is written first, the slot moved after: a process that dies between the two
/// leaves a checkpoint the next tick honours (it skips what the reset skipped, delivers what came
/// after, and moves the slot itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_resets_write_and_the_slots_move_skips_what_was_asked_only() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY)", "orders").await;
    execute(&url, "INSERT INTO orders SELECT generate_series(1, 5)").await;
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) = logical_app(directory.path(), &url, &slot, 2);
    let store = Arc::new(MemoryStore::new());
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (poller, sink) = poller(config, source, store.clone());
    let operator = Operator { who: "it@test", force: false, reason: None };
    let plan = reset::plan(Parts::of(&poller), &ResetTo::End, operator).await.unwrap();
    let slot_before = confirmed_flush(&url, &slot).await;
    // Only the document: the process "dies" before the slot is moved.
    assert!(matches!(apply(store.as_ref(), &plan).await.unwrap(), Applied::Written(_)));
    assert_eq!(confirmed_flush(&url, &slot).await, slot_before);
    execute(&url, "INSERT INTO orders VALUES (6);\nDELETE FROM orders WHERE id = 2").await;
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Delivered { rows: 2, .. }));
    let delivered: Vec<String> = sink
        .batches()
        .iter()
        .flat_map(|batch| batch.events.iter().map(|event| event.to_value()))
        .map(|event| {
            format!(
                "{} {}",
                event["op"].as_str().unwrap(),
                event["row"]["new"]["id"].as_i64().or(event["row"]["old"]["id"].as_i64()).unwrap()
            )
        })
        .collect();
    assert_eq!(delivered, vec!["insert 6", "delete 2"]);
    assert!(confirmed_flush(&url, &slot).await > slot_before, "the tick moved the slot itself");
    drop_slot(&url, &slot).await;
}
