//! A row too big to keep (issue 36, section 2): a row over `source.maxRowBytes` stops the poller
//! named by its key, never skipped; a 40 MB row within the bound that the receiver refuses is
//! quarantined whole, and the operator's commands (the real binary) list, show and replay it from
//! Azure Blob Storage (Azurite), although it is larger than any state document may be.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::post;
use serde_json::{Value, json};

use crate::harness::{AppRoot, Orders, run_dbtrigger};
use crate::services::azurite;

/// The big row's note: 40,000,000 characters.
const BIG_NOTE_BYTES: usize = 40_000_000;

#[derive(Default)]
struct Refusing {
    /// Refuse (413) every request larger than a megabyte, as a gateway with a body limit would.
    refuse_large: AtomicBool,
    /// The id and the note's length of every event acknowledged.
    accepted: Mutex<Vec<(i64, usize)>>,
}

async fn receive(State(state): State<Arc<Refusing>>, body: Bytes) -> StatusCode {
    if body.len() > 1 << 20 && state.refuse_large.load(Ordering::SeqCst) {
        return StatusCode::PAYLOAD_TOO_LARGE;
    }
    let envelope: Value = serde_json::from_slice(&body).unwrap();
    let mut accepted = state.accepted.lock().unwrap();
    for event in envelope["events"].as_array().unwrap() {
        let note = event["row"]["note"].as_str().map(str::len).unwrap_or(0);
        accepted.push((event["pk"]["id"].as_i64().unwrap(), note));
    }
    StatusCode::OK
}

/// A receiver on loopback taking bodies up to 100 MB, refusing the large ones while told to.
async fn refusing_receiver() -> (String, Arc<Refusing>) {
    let state = Arc::new(Refusing::default());
    let router = axum::Router::new()
        .route("/hook", post(receive))
        .layer(DefaultBodyLimit::max(100 << 20))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, state)
}

fn settings(app: &AppRoot, orders: &Orders, url: &str) -> Vec<(String, String)> {
    let mut settings = vec![
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_WEBHOOK".to_string(), url.to_string()),
        (
            "ORDERS_STATE".to_string(),
            app.azure_state.clone().unwrap_or_else(|| format!("file:{}", app.state_dir.display())),
        ),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];
    settings.sort();
    settings
}

/// Ticks until one says it is caught up (at most `ticks`); the output of every tick.
fn tick_until_caught_up(app: &AppRoot, settings: &[(String, String)], ticks: usize) -> String {
    let mut said = String::new();
    for _ in 0..ticks {
        let (_, stdout, stderr) = run_dbtrigger(app, settings, &["tick", "orders"]);
        said.push_str(&stdout);
        said.push_str(&stderr);
        if stdout.contains("caught-up") || stdout.contains("caught up") {
            break;
        }
    }
    said
}

/// Regression (issue 36, section 2): one 40 MB row among 19 small ones, refused once with 413, is
/// quarantined whole; `quarantine list`, `show` and `replay --all --yes` (the real binary, the
/// store on Azurite) read the 40 MB entry, and the receiver gets the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forty_megabyte_row_refused_once_is_quarantined_and_replayed() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=20, 1).await;
    // hex() of a zeroblob of n bytes: 2n characters '0', made by SQLite itself.
    sqlx::query("UPDATE orders SET note = hex(zeroblob(?)) WHERE id = 10")
        .bind((BIG_NOTE_BYTES / 2) as i64)
        .execute(&orders.pool)
        .await
        .unwrap();
    let (url, receiver) = refusing_receiver().await;
    receiver.refuse_large.store(true, Ordering::SeqCst);
    let poller = json!({
        "source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]},
        "batch": {"size": 5},
        "sink": {"type": "webhook", "url": "%ORDERS_WEBHOOK%", "timeoutSeconds": 30, "maxBodyBytes": 64 << 20},
        "state": {"connection": "ORDERS_STATE"}
    });
    let app = AppRoot::write(directory.path(), poller).with_azure_state(&azurite().connection_string());
    let settings = settings(&app, &orders, &url);

    let said = tick_until_caught_up(&app, &settings, 5);
    let accepted: Vec<i64> = receiver.accepted.lock().unwrap().iter().map(|(id, _)| *id).collect();
    let expected: Vec<i64> = (1..=20).filter(|id| *id != 10).collect();
    assert_eq!(accepted, expected, "the 19 small rows arrived, in order: {said}");
    let document = app.state_document().await.unwrap();
    assert_eq!(document["checkpoint"]["cursor"]["tiebreaker"]["id"], 20, "past the quarantined row");

    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["quarantine", "list", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains("1 quarantined rows") && stdout.contains("{\"id\":10}"), "{stdout}");
    let name = stdout.lines().nth(1).unwrap().split_whitespace().next().unwrap().to_string();
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["quarantine", "show", "orders", &name]);
    assert!(ok, "{stderr}");
    let shown: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(shown["event"]["row"]["note"].as_str().unwrap().len(), BIG_NOTE_BYTES, "the whole row was kept");
    assert_eq!(shown["status"], 413);

    receiver.refuse_large.store(false, Ordering::SeqCst);
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["quarantine", "replay", "orders", "--all", "--yes"]);
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains("replayed 1 rows, 0 kept"), "{stdout}");
    let last = *receiver.accepted.lock().unwrap().last().unwrap();
    assert_eq!(last, (10, BIG_NOTE_BYTES), "the receiver got the big row whole");
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["quarantine", "list", "orders"]);
    assert!(ok && stdout.contains("0 quarantined rows"), "{stdout}");
}

/// Regression (issue 36, section 2): a row over `source.maxRowBytes` (here the default, the
/// webhook's `maxBodyBytes` of 1 MiB) is never skipped: the tick delivers the batches before it
/// and fails naming its key and size, `status` says the poller is unhealthy, and once the bound is
/// raised the row is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_over_the_bound_stops_the_poller_naming_its_key() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=6, 1).await;
    sqlx::query("UPDATE orders SET note = hex(zeroblob(1048576)) WHERE id = 4").execute(&orders.pool).await.unwrap();
    let (url, receiver) = refusing_receiver().await;
    let poller = |sink: Value| {
        json!({
            "source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]},
            "batch": {"size": 2},
            "sink": sink,
            "state": {"connection": "ORDERS_STATE"}
        })
    };
    let app = AppRoot::write(directory.path(), poller(json!({"type": "webhook", "url": "%ORDERS_WEBHOOK%"})));
    let settings = settings(&app, &orders, &url);

    for _ in 0..2 {
        let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
        assert!(!ok, "the tick fails at the row: {stdout}{stderr}");
        let said = format!("{stdout}{stderr}");
        assert!(said.contains("id=4") && said.contains("maxRowBytes") && said.contains("1048576"), "{said}");
    }
    let accepted: Vec<i64> = receiver.accepted.lock().unwrap().iter().map(|(id, _)| *id).collect();
    // The batch that holds it (3 and 4) fails as it is read; nothing after it is delivered.
    assert_eq!(accepted, [1, 2], "the batches before it, and nothing after it");
    let document = app.state_document().await.unwrap();
    assert_eq!(document["checkpoint"]["cursor"]["tiebreaker"]["id"], 2, "held before the row");
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["status", "--json"]);
    let status: Value = serde_json::from_str(&stdout).unwrap();
    let poller_status = &status[0];
    assert!(!ok, "status exits 1: {status:#}");
    assert_eq!(
        (&poller_status["function"], &poller_status["healthy"]),
        (&json!("orders"), &json!(false)),
        "{status:#}"
    );
    assert!(poller_status.to_string().contains("id=4"), "{status:#}");

    // Raised: the row is delivered, and the poller goes on.
    AppRoot::write(
        directory.path(),
        poller(json!({"type": "webhook", "url": "%ORDERS_WEBHOOK%", "maxBodyBytes": 4 << 20})),
    );
    tick_until_caught_up(&app, &settings, 3);
    let accepted: Vec<(i64, usize)> = receiver.accepted.lock().unwrap().clone();
    let ids: Vec<i64> = accepted.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, [1, 2, 3, 4, 5, 6]);
    assert_eq!(accepted[3].1, 2 * 1048576);
}

/// Regression (issue 36, section 2): with `source.oversizedRows: "quarantineReference"`, a row
/// over the bound is quarantined as a reference (its key, cursor and size, never its payload), the
/// rows around it are delivered and the poller goes on; a replay of the reference is refused again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_over_the_bound_can_be_quarantined_as_a_reference() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=6, 1).await;
    sqlx::query("UPDATE orders SET note = hex(zeroblob(1048576)) WHERE id = 4").execute(&orders.pool).await.unwrap();
    let (url, receiver) = refusing_receiver().await;
    let poller = json!({
        "source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"],
                   "oversizedRows": "quarantineReference"},
        "batch": {"size": 2},
        "sink": {"type": "webhook", "url": "%ORDERS_WEBHOOK%"},
        "state": {"connection": "ORDERS_STATE"}
    });
    let app = AppRoot::write(directory.path(), poller);
    let settings = settings(&app, &orders, &url);

    let said = tick_until_caught_up(&app, &settings, 3);
    let accepted: Vec<i64> = receiver.accepted.lock().unwrap().iter().map(|(id, _)| *id).collect();
    assert_eq!(accepted, [1, 2, 3, 5, 6], "every row but the oversized one: {said}");
    let document = app.state_document().await.unwrap();
    assert_eq!(document["checkpoint"]["cursor"]["tiebreaker"]["id"], 6);

    let folder = app.state_dir.join(format!("quarantine/{}/orders", app.app_name));
    let files: Vec<_> = std::fs::read_dir(&folder)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|extension| extension == "json"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let stored = std::fs::read(&files[0]).unwrap();
    assert!(stored.len() < 2048, "a reference, not the payload: {} bytes", stored.len());
    let entry: Value = serde_json::from_slice(&stored).unwrap();
    assert_eq!(entry["event"]["pk"], json!({"id": 4}));
    let reference = &entry["event"]["row"]["$dbtrigger_oversized"];
    assert_eq!(reference["limit"], 1048576, "{entry:#}");
    assert!(reference["bytes"].as_u64().unwrap() > 2 * 1048576, "{entry:#}");
    assert_eq!(entry["status"], 413);
    assert!(entry["error"].as_str().unwrap().contains("maxRowBytes"), "{entry:#}");

    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["quarantine", "replay", "orders", "--all", "--yes"]);
    assert!(!ok && stdout.contains("replayed 0 rows, 1 kept") && stderr.contains("reference"), "{stdout}{stderr}");
    assert_eq!(receiver.accepted.lock().unwrap().len(), 5, "the receiver never gets a stand-in");
}
