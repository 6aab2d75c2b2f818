//! Operator commands where the source's types matter (issue 24, items 5, 6, 7 and part of 15):
//! `reset --to-cursor` on SQLite text timestamps and on naive cursors of PostgreSQL and MariaDB,
//! a primary key changed under a stored checkpoint (status, the status function, the watchdog,
//! `fingerprint accept`, the source itself), and `reset --to-end` before the first tick.

use std::sync::Arc;

use dbtrigger::domain::cursor::{CursorValue, PkValue, Position};
use dbtrigger::operations::reset::{self, ResetTo};
use dbtrigger::operations::{Applied, Operator, Parts, apply};
use dbtrigger::source::SourceError;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{StopReason, TickOutcome};
use serde_json::{Value, json};

use crate::harness::{AppRoot, Handler, Receiver, run_dbtrigger};
use crate::sources::{Engine, database, execute, items_config, poller_with};

const OPERATOR: Operator<'static> = Operator { who: "ops@test", force: false, reason: None };

/// The settings of an app whose `orders` poller reads `url` into `receiver`, state in files.
fn settings(app: &AppRoot, url: &str, receiver: &Receiver) -> Vec<(String, String)> {
    vec![
        ("ORDERS_DB".to_string(), url.to_string()),
        ("ORDERS_WEBHOOK".to_string(), receiver.url.clone()),
        ("ORDERS_STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ]
}

fn poller_section(cursor: &str, pk: &[&str]) -> Value {
    json!({
        "source": {"connection": "ORDERS_DB", "table": "orders", "cursor": cursor, "pk": pk, "settleSeconds": 0},
        "batch": {"size": 100},
        "sink": {"type": "webhook", "url": "%ORDERS_WEBHOOK%", "timeoutSeconds": 5},
        "state": {"connection": "ORDERS_STATE"}
    })
}

async fn state(app: &AppRoot) -> Value {
    app.state_document().await.expect("a state document")
}

/// Regression (issue 24, item 5): `reset --to-cursor` on SQLite timestamps stored as
/// `2020-01-01 12:00:00.000` binds the bound in that layout, so the rest of that day is
/// delivered (bound as RFC 3339 text, `' '` sorted before `'T'` and the day was skipped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_to_a_cursor_on_sqlite_text_timestamps_delivers_the_rest_of_that_day() {
    let database = database(Engine::Sqlite).await;
    execute(
        &database.url,
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, note TEXT, updated_at TEXT NOT NULL);\n\
         INSERT INTO orders VALUES (1, 'a', '2020-01-01 09:00:00.000'), (2, 'b', '2020-01-01 12:00:00.000'),\n\
         (3, 'c', '2020-01-01 18:30:00.000'), (4, 'd', '2020-01-02 08:00:00.000')",
    )
    .await;
    let directory = tempfile::tempdir().unwrap();
    let app = AppRoot::write(directory.path(), poller_section("updated_at", &["id"]));
    let receiver = Receiver::start().await;
    let settings = settings(&app, &database.url, &receiver);
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    assert_eq!(receiver.acknowledged_ids(), vec![1, 2, 3, 4]);

    let arguments = ["reset", "orders", "--to-cursor", "2020-01-01T10:00:00Z", "--pk", "id=0", "--yes"];
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &arguments);
    assert!(ok, "{stdout}{stderr}");
    let cursor = state(&app).await["checkpoint"]["cursor"].clone();
    assert_eq!(cursor["source_text"], "2020-01-01 10:00:00.000", "the stored layout: {cursor}");
    assert_eq!(cursor["kind"], "timestamp");
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    assert_eq!(receiver.acknowledged_ids()[4..], [2, 3, 4], "the rest of that day, then the next");
    let history = state(&app).await["history"].clone();
    assert_eq!(history.as_array().unwrap().last().unwrap()["action"], "reset");
}

/// Regression (issue 24, item 6): `reset --to-cursor` on a poller with no checkpoint (here no
/// document at all) and a naive cursor takes the kind `timestamp_naive` from the source, so the
/// next tick delivers the rows after it and commits (with `timestamp`, every commit was a
/// CheckpointRegression and the batch was resent forever).
async fn reset_to_a_naive_cursor_without_a_checkpoint(engine: Engine) {
    let database = database(engine).await;
    let column = if engine == Engine::Postgres { "TIMESTAMP" } else { "DATETIME(6)" };
    let rows: Vec<String> = (1..=6).map(|id| format!("({id}, '2020-01-01 0{id}:00:00', 'row {id}')")).collect();
    execute(
        &database.url,
        &format!(
            "CREATE TABLE items (id BIGINT NOT NULL PRIMARY KEY, c {column} NOT NULL, note VARCHAR(20));\n\
             INSERT INTO items VALUES {}",
            rows.join(", ")
        ),
    )
    .await;
    let (config, _directory) = items_config(&database.url, json!({"settleSeconds": 0}), 100);
    let store = Arc::new(MemoryStore::new());
    let (poller, sink) = poller_with(config, store.clone());
    let to = ResetTo::Cursor { value: "2020-01-01T03:00:00".into(), keys: vec![("id".into(), "3".into())] };
    let plan = reset::plan(Parts::of(&poller), &to, OPERATOR).await.unwrap();
    assert!(plan.before.is_none(), "no document yet");
    assert_eq!(plan.after.checkpoint.as_ref().unwrap().cursor.kind, "timestamp_naive");
    assert!(matches!(apply(store.as_ref(), &plan).await.unwrap(), Applied::Written(_)));

    let outcome = poller.tick().await.unwrap_or_else(|error| panic!("{engine:?}: {error}"));
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 3, stop: StopReason::CaughtUp, .. }), "{outcome:?}");
    let delivered: Vec<i64> = sink
        .batches()
        .iter()
        .flat_map(|batch| batch.events.iter().map(|event| event.pk()["id"].as_i64().unwrap()))
        .collect();
    assert_eq!(delivered, vec![4, 5, 6]);
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle), "committed: nothing is sent again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_to_a_naive_cursor_without_a_checkpoint_on_postgres() {
    reset_to_a_naive_cursor_without_a_checkpoint(Engine::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_to_a_naive_cursor_without_a_checkpoint_on_mariadb() {
    reset_to_a_naive_cursor_without_a_checkpoint(Engine::MariaDb).await;
}

/// Issue 24, item 15: `reset --to-end` before a poller's first tick writes its first document
/// (by CAS on its absence), and the first tick then delivers only what came after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_to_the_end_before_the_first_tick_skips_what_is_there() {
    let database = database(Engine::Sqlite).await;
    execute(&database.url, "CREATE TABLE orders (id INTEGER PRIMARY KEY, version INTEGER NOT NULL)").await;
    execute(&database.url, "INSERT INTO orders VALUES (1, 1), (2, 2), (3, 3)").await;
    let directory = tempfile::tempdir().unwrap();
    let app = AppRoot::write(directory.path(), poller_section("version", &["id"]));
    let receiver = Receiver::start().await;
    let settings = settings(&app, &database.url, &receiver);
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["reset", "orders", "--to-end", "--yes"]);
    assert!(ok && stdout.contains("before:\n(none)"), "{stdout}{stderr}");
    assert_eq!(state(&app).await["checkpoint"]["cursor"]["tiebreaker"]["id"], 3);
    execute(&database.url, "INSERT INTO orders VALUES (4, 4)").await;
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    assert_eq!(receiver.acknowledged_ids(), vec![4]);
}

/// What the host posts to an HTTP-triggered function.
fn http_status_request() -> String {
    json!({"Data": {"req": {"Url": "https://app.azurewebsites.net/api/status", "Method": "GET", "Query": {},
                            "Headers": {}, "Params": {}, "Body": null}},
           "Metadata": {"sys": {"MethodName": "status"}}})
    .to_string()
}

/// A poller ticked with key `before`, then configured with key `after`: status, the status
/// function and the watchdog report it (no panic), `fingerprint accept` refuses to keep the
/// checkpoint, and a reset then an accept bring the poller back.
async fn a_changed_key_is_reported_never_panics(before: &[&str], after: &[&str]) {
    let database = database(Engine::Sqlite).await;
    execute(
        &database.url,
        "CREATE TABLE orders (tenant INTEGER NOT NULL, id INTEGER NOT NULL, version INTEGER NOT NULL, PRIMARY KEY (tenant, id));\n\
         INSERT INTO orders VALUES (1, 1, 1), (1, 2, 2), (2, 1, 3)",
    )
    .await;
    let directory = tempfile::tempdir().unwrap();
    let app = AppRoot::write(directory.path(), poller_section("version", before));
    let receiver = Receiver::start().await;
    let settings = settings(&app, &database.url, &receiver);
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    assert!(run_dbtrigger(&app, &settings, &["new", "status", "--template", "status"]).0);
    std::fs::create_dir_all(app.root.join("watchdog")).unwrap();
    let watchdog = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
        "watchdog": {"state": {"connection": "ORDERS_STATE"}}
    });
    std::fs::write(app.root.join("watchdog/function.json"), watchdog.to_string()).unwrap();
    let function = app.root.join("orders/function.json");
    let mut document: Value = serde_json::from_slice(&std::fs::read(&function).unwrap()).unwrap();
    document["poller"]["source"]["pk"] = json!(after);
    std::fs::write(&function, serde_json::to_vec_pretty(&document).unwrap()).unwrap();
    execute(&database.url, "INSERT INTO orders VALUES (2, 2, 4)").await;

    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["status", "--json"]);
    assert!(!ok && !stderr.contains("panicked"), "{stdout}{stderr}");
    let statuses: Value = serde_json::from_str(&stdout).unwrap();
    let orders = statuses.as_array().unwrap().iter().find(|status| status["function"] == "orders").unwrap();
    assert_eq!(orders["healthy"], false);
    assert!(orders["error"].as_str().unwrap().contains("does not fit the configured key"), "{orders}");

    let handler = Handler::start(&app, &settings).await;
    let (status, _, response) = handler.invoke("status", &http_status_request()).await;
    assert_eq!(status, 200, "{response}");
    assert_eq!(response["Outputs"]["res"]["statusCode"], 503);
    assert!(response["Outputs"]["res"]["body"].as_str().unwrap().contains("does not fit the configured key"));
    drop(handler);

    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    let output = format!("{stdout}{stderr}");
    assert!(!ok && !output.contains("panicked"), "{output}");
    assert!(output.contains("finding=fingerprint_changed") && output.contains("finding=unreadable"), "{output}");
    assert!(output.contains("does not fit the configured key"), "{output}");

    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["fingerprint", "accept", "orders", "--yes"]);
    assert!(!ok && stderr.contains("does not fit the configured key") && stderr.contains("reset"), "{stderr}");
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(!ok && !stderr.contains("panicked"), "{stdout}{stderr}");

    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["reset", "orders", "--to-beginning", "--yes"]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["fingerprint", "accept", "orders", "--yes"]);
    assert!(ok, "{stderr}");
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    assert_eq!(receiver.acknowledged_ids().len(), 3 + 4, "every row again, from the beginning");
    let history = state(&app).await["history"].clone();
    let actions: Vec<&str> =
        history.as_array().unwrap().iter().map(|entry| entry["action"].as_str().unwrap()).collect();
    assert_eq!(actions, ["reset", "fingerprint_accept"]);
}

/// Regression (issue 24, item 7): the key `id` became `tenant, id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_grown_under_a_checkpoint_is_reported_and_never_panics() {
    a_changed_key_is_reported_never_panics(&["id"], &["tenant", "id"]).await;
}

/// Regression (issue 24, item 7): the key `tenant, id` became `id, tenant` (it used to seek on
/// the wrong column silently).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reordered_under_a_checkpoint_is_reported_and_never_panics() {
    a_changed_key_is_reported_never_panics(&["tenant", "id"], &["id", "tenant"]).await;
}

/// Regression (issue 24, item 7): a source refuses to bind a position of another key, naming
/// both, for a delivery read and for a count, on SQLite and PostgreSQL (two bodies of code).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_refuses_to_bind_a_position_of_another_key() {
    for engine in [Engine::Sqlite, Engine::Postgres] {
        let database = database(engine).await;
        execute(&database.url, "CREATE TABLE items (tenant BIGINT NOT NULL, id BIGINT NOT NULL, c BIGINT NOT NULL)")
            .await;
        let (mut config, _directory) = items_config(&database.url, json!({}), 10);
        config.source.pk = vec!["tenant".into(), "id".into()];
        let source = dbtrigger::source::open(&config.source).unwrap();
        let stored = Position { cursor: CursorValue::Integer(5), pk: vec![("id".into(), PkValue::Integer(7))] };
        let limit = dbtrigger::source::FetchLimit { rows: 10, bytes: 1 << 20 };
        let read = source.fetch_after(Some(&stored), limit).await.unwrap_err();
        assert!(matches!(read, SourceError::KeyMismatch(_)), "{engine:?}: {read}");
        assert!(read.to_string().contains("key (id) does not fit the configured key (tenant, id)"), "{read}");
        let count = source.count_after(Some(&stored), 100).await.unwrap_err();
        assert!(matches!(count, SourceError::KeyMismatch(_)), "{engine:?}: {count}");
    }
}
