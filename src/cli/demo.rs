//! `dbtrigger demo`: the whole path with nothing installed. A SQLite table of sample orders, a
//! function app root with one poller, a file state store, a receiver on loopback, and the real
//! handler over HTTP, invoked with the host's own timer payload until the poller is caught up.

use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use axum::Json;
use axum::extract::State;
use axum::routing::post;
use chrono::{TimeZone, Utc};
use serde_json::{Value, json};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

use crate::app::App;
use crate::clock::SystemClock;
use crate::config::{AppConfig, Settings};

#[derive(Default)]
struct Received {
    event_ids: HashSet<String>,
    duplicates: u64,
    batches: u64,
}

async fn receive(State(received): State<Arc<Mutex<Received>>>, Json(envelope): Json<Value>) -> Json<Value> {
    let events = envelope["events"].as_array().cloned().unwrap_or_default();
    let mut state = received.lock().unwrap();
    state.batches += 1;
    for event in &events {
        let id = event["event_id"].as_str().unwrap_or_default().to_string();
        if !state.event_ids.insert(id) {
            state.duplicates += 1;
        }
    }
    let first = events.first().map(|event| event["pk"]["id"].clone()).unwrap_or(Value::Null);
    let last = events.last().map(|event| event["pk"]["id"].clone()).unwrap_or(Value::Null);
    let cursor = events.last().map(|event| event["cursor"].clone()).unwrap_or(Value::Null);
    println!(
        "  receiver: batch {:>3}  {:>4} rows  ids {first}..{last}  up to {cursor}  fencing token {}",
        state.batches,
        events.len(),
        envelope["fencing_token"]
    );
    Json(json!({"ok": true}))
}

async fn insert_orders(pool: &sqlx::SqlitePool, from_id: u32, count: u32) -> anyhow::Result<()> {
    let base = Utc.with_ymd_and_hms(2026, 11, 1, 9, 0, 0).unwrap();
    let statuses = ["new", "paid", "packed", "shipped", "delivered"];
    let mut transaction = pool.begin().await?;
    for id in from_id..from_id + count {
        // Four rows share each timestamp: batches split equal cursors, the pk breaks the tie.
        let updated_at = base + chrono::Duration::milliseconds(i64::from(id / 4) * 250);
        sqlx::query("INSERT INTO orders (id, customer, status, total, updated_at) VALUES (?, ?, ?, ?, ?)")
            .bind(i64::from(id))
            .bind(format!("customer-{}", id % 97))
            .bind(statuses[(id % 5) as usize])
            .bind(f64::from(id % 1000) + 0.99)
            .bind(updated_at.format("%Y-%m-%d %H:%M:%S%.3f").to_string())
            .execute(&mut *transaction)
            .await?;
    }
    transaction.commit().await?;
    Ok(())
}

/// Invokes the function like the host does until a tick finds nothing new. Returns the ticks run.
async fn tick_until_idle(client: &reqwest::Client, handler_url: &str) -> anyhow::Result<u32> {
    for tick in 1..=100 {
        // What the host posts for a timer that fires every minute.
        let now = chrono::Utc::now();
        let status = super::dev::TimerStatus { last: Some(now - chrono::Duration::minutes(1)), next: now };
        let payload = super::dev::timer_payload("orders", Some(status), now);
        let response = client
            .post(format!("{handler_url}/orders"))
            .header("content-type", "application/json")
            .header("x-azure-functions-invocationid", uuid::Uuid::new_v4().to_string())
            .body(payload.to_string())
            .send()
            .await
            .context("invoking the handler")?;
        let status = response.status();
        let outcome = response
            .headers()
            .get("x-dbtrigger-outcome")
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
            .to_string();
        let body: Value = response.json().await.context("reading the handler's answer")?;
        if !status.is_success() {
            bail!("the handler answered {status}: {}", body["error"]);
        }
        println!("  handler:  tick {tick}: {}", body["Logs"][0].as_str().unwrap_or(""));
        if outcome == "idle" {
            return Ok(tick);
        }
    }
    bail!("the poller did not catch up in 100 ticks")
}

pub async fn run(rows: u32, keep: bool) -> anyhow::Result<ExitCode> {
    println!("{}\n", super::DISCLOSURE);
    let directory = tempfile::Builder::new().prefix("dbtrigger-demo-").tempdir()?;
    let root = directory.path().to_path_buf();
    println!("demo directory: {}", root.display());

    // The database.
    let database = root.join("orders.db");
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(SqliteConnectOptions::new().filename(&database).create_if_missing(true))
        .await?;
    sqlx::query(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, status TEXT NOT NULL, \
         total REAL NOT NULL, updated_at TEXT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    sqlx::query("CREATE INDEX orders_seek ON orders (updated_at, id)").execute(&pool).await?;
    insert_orders(&pool, 1, rows).await?;
    println!("created {} with {rows} orders (cursor updated_at, tiebreaker id)", database.display());

    // The receiver.
    let received = Arc::new(Mutex::new(Received::default()));
    let receiver = axum::Router::new().route("/hook", post(receive)).with_state(received.clone());
    let receiver_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let receiver_url = format!("http://{}/hook", receiver_listener.local_addr()?);
    tokio::spawn(async move { axum::serve(receiver_listener, receiver).await });

    // The function app.
    std::fs::create_dir_all(root.join("app/orders"))?;
    std::fs::write(
        root.join("app/host.json"),
        serde_json::to_vec_pretty(&json!({"version": "2.0", "functionTimeout": "00:10:00"}))?,
    )?;
    let function = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "%DEMO_SCHEDULE%", "useMonitor": true}],
        "poller": {
            "source": {"connection": "DEMO_DB", "table": "orders", "cursor": "updated_at", "pk": ["id"]},
            "batch": {"size": 500},
            "sink": {"type": "webhook", "url": "%DEMO_WEBHOOK_URL%"},
            "state": {"connection": "DEMO_STATE"}
        }
    });
    std::fs::write(root.join("app/orders/function.json"), serde_json::to_vec_pretty(&function)?)?;
    let settings = Settings::from_env()
        .with("DEMO_DB", &format!("sqlite://{}", database.display()))
        .with("DEMO_WEBHOOK_URL", &receiver_url)
        .with("DEMO_STATE", &format!("file:{}", root.join("state").display()))
        .with("DEMO_SCHEDULE", "*/10 * * * * *")
        .with("DBTRIGGER_APP_NAME", "demo");
    let config = AppConfig::load(&root.join("app"), &settings)?;
    let app = Arc::new(App::open(config, &settings, Arc::new(SystemClock)));

    // The handler, on loopback, as the host would start it.
    let handler_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let handler_url = format!("http://{}", handler_listener.local_addr()?);
    tokio::spawn(crate::handler::serve(handler_listener, app, std::future::pending()));
    let client = reqwest::Client::builder().timeout(Duration::from_secs(300)).build()?;
    println!("handler listening on {handler_url}; invoking /orders with the host's timer payload\n");

    let started = Instant::now();
    let ticks = tick_until_idle(&client, &handler_url).await?;
    let elapsed = started.elapsed();
    let state_file = root.join("state/state/demo/orders.json");
    let state: Value = serde_json::from_slice(&std::fs::read(&state_file)?)?;
    let (delivered, batches) = {
        let received = received.lock().unwrap();
        (received.event_ids.len() as u64, received.batches)
    };
    println!(
        "\ncaught up: {delivered} rows in {batches} batches over {ticks} ticks, {:.2} s, {:.0} rows/s",
        elapsed.as_secs_f64(),
        delivered as f64 / elapsed.as_secs_f64().max(1e-9)
    );
    println!("checkpoint ({}):\n{}\n", state_file.display(), serde_json::to_string_pretty(&state["checkpoint"])?);

    let more = 250;
    insert_orders(&pool, rows + 1, more).await?;
    println!("inserted {more} more orders; ticking again\n");
    tick_until_idle(&client, &handler_url).await?;
    let received = received.lock().unwrap();
    let expected = u64::from(rows + more);
    println!(
        "\nreceived {} distinct rows in {} batches, {} duplicates (expected {expected} rows)",
        received.event_ids.len(),
        received.batches,
        received.duplicates
    );
    if received.event_ids.len() as u64 != expected || received.duplicates != 0 {
        bail!("the receiver did not get every row exactly once");
    }
    println!("every row arrived exactly once; only the new rows were delivered on the second run");
    if keep {
        let kept = directory.keep();
        println!("kept {}", kept.display());
    }
    Ok(ExitCode::SUCCESS)
}
