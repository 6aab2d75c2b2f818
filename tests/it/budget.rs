//! Issue 27, section 2: the app-wide budget of bytes in flight. Twenty pollers catching up on
//! 10 KB rows, all invoked at once through the real binary, under a budget of 160 KiB: the
//! receiver never holds more than the budget in bodies being answered at once (unbounded, the
//! app would have 20 pollers × 2 batches × ~50 KB in flight), every row arrives, and a tick that
//! waited for the budget caught up all the same and says it waited.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use serde_json::{Value, json};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

use crate::harness::Handler;
use crate::many_pollers;

const POLLERS: usize = 20;
const ROWS: i64 = 30;
const BUDGET: usize = 160 * 1024;

/// A receiver that answers after 30 ms and keeps the most body bytes it was answering at once.
#[derive(Default)]
struct Holding {
    now: AtomicUsize,
    most: AtomicUsize,
    ids: Mutex<BTreeMap<String, BTreeSet<i64>>>,
}

async fn start_receiver() -> (String, Arc<Holding>) {
    let holding = Arc::new(Holding::default());
    let state = holding.clone();
    let router = axum::Router::new()
        .route(
            "/hook",
            axum::routing::post(move |body: Bytes| {
                let state = state.clone();
                async move {
                    let now = state.now.fetch_add(body.len(), Ordering::SeqCst) + body.len();
                    state.most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    let envelope: Value = serde_json::from_slice(&body).unwrap();
                    many_pollers::record_ids(&mut state.ids.lock().unwrap(), &envelope);
                    state.now.fetch_sub(body.len(), Ordering::SeqCst);
                    "{}"
                }
            }),
        )
        .layer(axum::extract::DefaultBodyLimit::disable());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, holding)
}

async fn write_tables(path: &Path) {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(SqliteConnectOptions::new().filename(path).create_if_missing(true))
        .await
        .unwrap();
    let wide = "x".repeat(10_000);
    for table in 0..POLLERS {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE t{table} (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, body TEXT NOT NULL)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let mut transaction = pool.begin().await.unwrap();
        for id in 1..=ROWS {
            sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO t{table} VALUES (?, ?, ?)")))
                .bind(id)
                .bind(id)
                .bind(&wide)
                .execute(&mut *transaction)
                .await
                .unwrap();
        }
        transaction.commit().await.unwrap();
    }
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_app_holds_no_more_bytes_in_flight_than_its_budget() {
    let directory = tempfile::tempdir().unwrap();
    let database = directory.path().join("wide.db");
    write_tables(&database).await;
    let root = many_pollers::write_app(directory.path(), "w", POLLERS, |index| {
        json!({
            "source": {"connection": "WIDE_DB", "table": format!("t{index}"), "cursor": "version", "pk": ["id"],
                       "lateArrivals": null},
            "batch": {"size": 5, "maxInFlight": 2},
            "sink": {"type": "webhook", "url": "%WIDE_WEBHOOK%", "timeoutSeconds": 30},
            "state": {"connection": "WIDE_STATE"}
        })
    });
    let (url, holding) = start_receiver().await;
    let settings = vec![
        ("WIDE_DB".to_string(), format!("sqlite://{}", database.display())),
        ("WIDE_WEBHOOK".to_string(), url),
        ("WIDE_STATE".to_string(), format!("file:{}", directory.path().join("state").display())),
        ("DBTRIGGER_APP_NAME".to_string(), "budget".to_string()),
        ("DBTRIGGER_MAX_BYTES_IN_FLIGHT".to_string(), BUDGET.to_string()),
    ];
    let handler = Arc::new(Handler::start_binary(Path::new(env!("CARGO_BIN_EXE_dbtrigger")), &root, &settings).await);
    let lines = many_pollers::invoke_all(&handler, "w", POLLERS).await;
    for line in &lines {
        assert!(line.contains("outcome=caught-up rows=30 "), "{line}");
    }
    let expected: BTreeSet<i64> = (1..=ROWS).collect();
    let ids = holding.ids.lock().unwrap().clone();
    assert_eq!(ids.len(), POLLERS);
    assert!(ids.values().all(|delivered| delivered == &expected), "{ids:?}");
    // Bodies carry an envelope beyond the rows the budget counts: a few hundred bytes a batch.
    let most = holding.most.load(Ordering::SeqCst);
    assert!(most <= BUDGET + 4 * 1024, "the receiver held {most} bytes at once, the budget is {BUDGET}");
    assert!(most >= 40 * 1024, "{most}: not even one batch at a time?");
    many_pollers::assert_some_waited(&lines, "budget_wait_ms", "for the app's budget of bytes in flight", "budget");
}
