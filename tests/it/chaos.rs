//! Chaos on PostgreSQL: four `dbtrigger tick` processes on one poller (a timestamptz cursor with
//! settle, state in Azurite) while a writer inserts and updates rows in concurrent transactions,
//! processes are killed with SIGKILL at random moments, and the receiver answers 5xx, hangs past the
//! timeout, or refuses one poison row for good. At the end the latest version of every row was
//! delivered at least once, the poison row is in the quarantine, and a summary line says so.
//!
//! A second variant (issue 26) reads an `xid` cursor below the commit horizon, with no settle at
//! all, while writers hold their transactions open for up to 1.5 s after taking their id (longer
//! than any settle a timestamp cursor would use): nothing may be lost.
//!
//! A third variant ([`logical`], issue 29) runs the logical source: interleaved inserts, updates,
//! hard deletes and truncates, judged against a witness slot for commit order. A fourth
//! ([`binlog`], issue 39) runs the binary-log source on MariaDB, judged against the server's own
//! `mariadb-binlog` account of the same range.
//!
//! CI runs a short version; `DBTRIGGER_CHAOS_SECONDS=600` runs a long one by hand.

mod binlog;
mod logical;
mod witness;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use serde_json::{Value, json};

use crate::harness::AppRoot;
use crate::services::{azurite, postgres};

/// The id the receiver always refuses.
const POISON_ID: i64 = 17;

#[derive(Default)]
struct Receiver {
    /// Every (id, version) acknowledged, with how many times.
    acknowledged: BTreeMap<(i64, i64), u64>,
    faults: u64,
    random: u64,
}

async fn receive(State(state): State<Arc<Mutex<Receiver>>>, body: axum::body::Bytes) -> (StatusCode, String) {
    let envelope: Value = serde_json::from_slice(&body).unwrap();
    let pairs: Vec<(i64, i64)> = envelope["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| (event["pk"]["id"].as_i64().unwrap(), event["row"]["version"].as_i64().unwrap()))
        .collect();
    // A fixed pseudo-random sequence (an LCG), so that a failing run can be reasoned about.
    let roll = {
        let mut state = state.lock().unwrap();
        state.random = state.random.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state.random >> 33) % 100
    };
    if pairs.iter().any(|(id, _)| *id == POISON_ID) {
        return (StatusCode::UNPROCESSABLE_ENTITY, "poison".into());
    }
    if roll < 8 {
        state.lock().unwrap().faults += 1;
        return (StatusCode::SERVICE_UNAVAILABLE, "flaky".into());
    }
    if roll < 11 {
        state.lock().unwrap().faults += 1;
        // Longer than the sink's timeout: the tick sees a timeout, the receiver keeps nothing.
        tokio::time::sleep(Duration::from_secs(3)).await;
        return (StatusCode::SERVICE_UNAVAILABLE, "too late".into());
    }
    let mut state = state.lock().unwrap();
    for pair in pairs {
        *state.acknowledged.entry(pair).or_default() += 1;
    }
    (StatusCode::OK, "{}".into())
}

async fn execute(url: &str, sql: &str) {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string())).execute(&pool).await.unwrap();
    pool.close().await;
}

/// What differs between the chaos runs.
struct Variant {
    name: &'static str,
    default_seconds: u64,
    table: &'static str,
    source: Value,
    lease: Value,
    /// How an update moves a row forward.
    update: &'static str,
    /// How long a writer keeps its transaction open after its writes, by step.
    hold: fn(u64, u64) -> Duration,
    /// Before the final catch-up: past settle, past any lease a killed process left.
    quiet: Duration,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_on_postgres_loses_nothing() {
    run(Variant {
        name: "timestamptz, settle 1 s",
        default_seconds: 20,
        table: "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(), version BIGINT NOT NULL, note TEXT);\n\
                CREATE INDEX items_seek ON items (c, id);",
        source: json!({"connection": "ITEMS_DB", "table": "items", "cursor": "c", "pk": ["id"], "settleSeconds": 1}),
        lease: json!({"ttlSeconds": 6, "heartbeatSeconds": 2, "clockSkewSeconds": 1}),
        update: "UPDATE items SET version = version + 1, c = clock_timestamp() WHERE id = $1",
        // Commit a little later than the rows' timestamps were taken.
        hold: |_, _| Duration::from_millis(40),
        quiet: Duration::from_secs(8),
    })
    .await;
}

/// Issue 26, item 5: an xid cursor, no settle, transactions committing up to 1.5 s after they
/// took their id, in an order of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_on_postgres_with_an_xid_cursor_and_late_commits_loses_nothing() {
    run(Variant {
        name: "xid, late commits",
        default_seconds: 4,
        table: "CREATE TABLE items (id BIGINT PRIMARY KEY, c xid8 NOT NULL DEFAULT pg_current_xact_id(), version BIGINT NOT NULL, note TEXT);\n\
                CREATE FUNCTION stamp() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN NEW.c := pg_current_xact_id(); RETURN NEW; END $$;\n\
                CREATE TRIGGER stamp BEFORE UPDATE ON items FOR EACH ROW EXECUTE FUNCTION stamp();\n\
                CREATE INDEX items_seek ON items (c, id);",
        source: json!({"connection": "ITEMS_DB", "table": "items", "cursor": "c", "pk": ["id"], "cursorKind": "xid"}),
        lease: json!({"ttlSeconds": 3, "heartbeatSeconds": 1, "clockSkewSeconds": 1}),
        update: "UPDATE items SET version = version + 1 WHERE id = $1",
        // A third of the transactions stay open long after taking their id (1 to 1.5 s).
        hold: |step, writer| {
            if (step + writer).is_multiple_of(3) {
                Duration::from_millis(1_000 + (step * 97 + writer * 31) % 500)
            } else {
                Duration::from_millis(20)
            }
        },
        quiet: Duration::from_secs(4),
    })
    .await;
}

async fn run(variant: Variant) {
    let seconds: u64 = std::env::var("DBTRIGGER_CHAOS_SECONDS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(variant.default_seconds);
    let url = postgres().fresh_database().await;
    execute(&url, variant.table).await;

    let state = Arc::new(Mutex::new(Receiver { random: 7, ..Receiver::default() }));
    let router = axum::Router::new().route("/hook", post(receive)).with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });

    let directory = tempfile::tempdir().unwrap();
    let app = AppRoot::write(
        directory.path(),
        json!({
            "source": variant.source,
            "batch": {"size": 50, "tickBudgetSeconds": 20},
            "sink": {"type": "webhook", "url": "%ITEMS_HOOK%", "timeoutSeconds": 1, "maxRetries": 1},
            "lease": variant.lease,
            "poison": {"maxAttempts": 3},
            "state": {"connection": "STATE"}
        }),
    )
    .with_azure_state(&azurite().connection_string());
    let settings = [
        ("ITEMS_DB".to_string(), url.clone()),
        ("ITEMS_HOOK".to_string(), hook),
        ("STATE".to_string(), azurite().connection_string()),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];

    // The writer: inserts and updates in concurrent transactions, until told to stop.
    let stop = Arc::new(AtomicU64::new(0));
    let next_id = Arc::new(AtomicU64::new(1));
    let mut writers = Vec::new();
    let (update, hold) = (variant.update, variant.hold);
    for writer in 0..2u64 {
        let url = url.clone();
        let stop = stop.clone();
        let next_id = next_id.clone();
        writers.push(tokio::spawn(async move {
            let pool = sqlx::PgPool::connect(&url).await.unwrap();
            let mut step = 0u64;
            while stop.load(Ordering::SeqCst) == 0 {
                step += 1;
                let mut transaction = pool.begin().await.unwrap();
                for _ in 0..3 {
                    let id = next_id.fetch_add(1, Ordering::SeqCst) as i64;
                    sqlx::query("INSERT INTO items (id, version, note) VALUES ($1, 1, $2)")
                        .bind(id)
                        .bind(format!("writer {writer}"))
                        .execute(&mut *transaction)
                        .await
                        .unwrap();
                }
                if step.is_multiple_of(2) {
                    let highest = next_id.load(Ordering::SeqCst) as i64;
                    let target = 1 + (step as i64 * 7 + writer as i64) % highest.max(1);
                    sqlx::query(update).bind(target).execute(&mut *transaction).await.unwrap();
                }
                tokio::time::sleep(hold(step, writer)).await;
                transaction.commit().await.unwrap();
            }
            pool.close().await;
        }));
    }

    // Four tick processes, round after round, some killed.
    let spawn_tick = || -> Child {
        Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
            .args(["tick", "orders", "--app-root"])
            .arg(&app.root)
            .envs(settings.iter().map(|(key, value)| (key.as_str(), value.as_str())))
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let started = Instant::now();
    let mut kills = 0u64;
    let mut round = 0u64;
    while started.elapsed() < Duration::from_secs(seconds) {
        round += 1;
        let mut children: Vec<Child> = (0..4).map(|_| spawn_tick()).collect();
        tokio::time::sleep(Duration::from_millis(40 + (round * 37) % 200)).await;
        // Kill one that is still running (the one holding the lease, mid-delivery, more often
        // than not), at a moment that moves from round to round.
        for offset in 0..4 {
            let child = &mut children[((round as usize) + offset) % 4];
            if child.try_wait().unwrap().is_none() {
                child.kill().unwrap();
                kills += 1;
                break;
            }
        }
        for mut child in children {
            let _ = tokio::task::spawn_blocking(move || child.wait()).await;
        }
    }
    stop.store(1, Ordering::SeqCst);
    for writer in writers {
        writer.await.unwrap();
    }

    // The final catch-up, without kills: past settle, past any lease left by a killed process.
    tokio::time::sleep(variant.quiet).await;
    let mut caught_up = false;
    for _ in 0..60 {
        let output = Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
            .args(["tick", "orders", "--app-root"])
            .arg(&app.root)
            .envs(settings.iter().map(|(key, value)| (key.as_str(), value.as_str())))
            .env("RUST_LOG", "error")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout).to_string();
        if text.contains("nothing new") {
            caught_up = true;
            break;
        }
    }
    assert!(caught_up, "the poller did not catch up after the chaos");

    // Compare with the table: the latest version of every row was delivered, or is in the
    // quarantine (the poison row; and a row that failed alone while its batch was isolated).
    let document = app.state_document().await.expect("the state document");
    let connection =
        dbtrigger::config::StorageConnection::parse_connection_string(&azurite().connection_string()).unwrap();
    let blobs = dbtrigger::store::azure_blob::AzureBlobStore::new(&connection, "db-state").unwrap();
    let quarantined: BTreeSet<(i64, i64)> = dbtrigger::store::quarantine::list(&blobs, &app.app_name, "orders")
        .await
        .unwrap()
        .iter()
        .map(|(entry, _)| (entry.event["pk"]["id"].as_i64().unwrap(), entry.event["row"]["version"].as_i64().unwrap()))
        .collect();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let rows: Vec<(i64, i64)> =
        sqlx::query_as("SELECT id, version FROM items ORDER BY id").fetch_all(&pool).await.unwrap();
    pool.close().await;
    let receiver = state.lock().unwrap();
    let mut lost = Vec::new();
    for pair in &rows {
        if !receiver.acknowledged.contains_key(pair) && !quarantined.contains(pair) {
            lost.push(*pair);
        }
    }
    let deliveries: u64 = receiver.acknowledged.values().sum();
    let duplicates = deliveries - receiver.acknowledged.len() as u64;
    let faults = receiver.faults;
    drop(receiver);

    println!(
        "chaos ({}): {} rows, {} s, {round} rounds of 4 processes, {kills} kills, {faults} receiver faults, lost {}, duplicates {duplicates}, quarantined {:?}",
        variant.name,
        rows.len(),
        seconds,
        lost.len(),
        quarantined
    );
    assert!(lost.is_empty(), "rows lost: {lost:?}");
    assert!(kills > 0, "the run killed no process: it proved nothing");
    assert!(rows.iter().any(|(id, _)| *id == POISON_ID), "the poison row was written");
    assert!(quarantined.iter().any(|(id, _)| *id == POISON_ID), "the poison row is in the quarantine: {quarantined:?}");
    assert!(document["stats"]["quarantined"].as_u64().unwrap() >= 1);
}
