//! Commit-to-delivery latency (issue 26, item 5): how long a committed row takes to reach the
//! webhook when `dbtrigger dev` fires each poller every second, for three pollers on PostgreSQL,
//! each on a table of its own database:
//!
//! - `timestamptz, settleSeconds 2 (the default)`: a row is read once it is 2 s old;
//! - `timestamptz, settle "auto"` (its margin, settleSeconds, at its default of 1 s): once it is
//!   older than every open transaction's start and 1 s old;
//! - `xid`: once every transaction that took an id before it has ended: no wait of its own.
//!
//! A writer commits one short transaction per table every 100–300 ms for
//! `DBTRIGGER_BENCH_SECONDS` (default 60); the receiver runs in this process and notes when each
//! row arrives; latency is arrival minus the moment the writer's commit returned. The table shows
//! the p50, p90, p99 and max, in milliseconds. Run: `cargo bench --bench latency` (starts
//! PostgreSQL like the tests). A benchmark, not a timed test: nothing here asserts a number.

#[path = "../tests/it/services.rs"]
mod services;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use serde_json::{Value, json};

/// One poller of the run: its name, its table's DDL, and its `source` fields beyond the common ones.
struct Case {
    name: &'static str,
    label: &'static str,
    table: &'static str,
    source: Value,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "settle",
            label: "timestamptz, settleSeconds 2 (default)",
            table: "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ NOT NULL DEFAULT now(), note TEXT);\
                    CREATE INDEX items_seek ON items (c, id);",
            source: json!({}),
        },
        Case {
            name: "auto",
            label: "timestamptz, settle \"auto\" (margin 1 s)",
            table: "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ NOT NULL DEFAULT now(), note TEXT);\
                    CREATE INDEX items_seek ON items (c, id);",
            source: json!({"settle": "auto"}),
        },
        Case {
            name: "xid",
            label: "xid8, cursorKind \"xid\"",
            table: "CREATE TABLE items (id BIGINT PRIMARY KEY, c xid8 NOT NULL DEFAULT pg_current_xact_id(), note TEXT);\
                    CREATE INDEX items_seek ON items (c, id);",
            source: json!({"cursorKind": "xid"}),
        },
    ]
}

/// When each (poller, id) arrived.
type Arrivals = Arc<Mutex<HashMap<(String, i64), Instant>>>;

async fn receive(
    State(arrivals): State<Arrivals>,
    Path(poller): Path<String>,
    body: axum::body::Bytes,
) -> &'static str {
    let at = Instant::now();
    let envelope: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut arrivals = arrivals.lock().unwrap();
    for event in envelope["events"].as_array().into_iter().flatten() {
        if let Some(id) = event["pk"]["id"].as_i64() {
            arrivals.entry((poller.clone(), id)).or_insert(at);
        }
    }
    "{}"
}

fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * fraction).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let seconds: u64 = std::env::var("DBTRIGGER_BENCH_SECONDS").ok().and_then(|value| value.parse().ok()).unwrap_or(60);
    let arrivals: Arrivals = Arc::default();
    let router = axum::Router::new().route("/hook/{poller}", axum::routing::post(receive)).with_state(arrivals.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });

    let directory = tempfile::tempdir().unwrap();
    let root = directory.path().join("app");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(
        root.join("host.json"),
        serde_json::to_vec(&json!({"version": "2.0", "functionTimeout": "00:10:00"})).unwrap(),
    )
    .unwrap();
    let mut settings: Vec<(String, String)> = vec![
        ("STATE".into(), format!("file:{}", directory.path().join("state").display())),
        ("DBTRIGGER_APP_NAME".into(), "latency".into()),
        ("RUST_LOG".into(), "warn".into()),
    ];
    let mut urls = Vec::new();
    for case in cases() {
        let url = services::postgres().fresh_database().await;
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(case.table)).execute(&pool).await.unwrap();
        pool.close().await;
        let mut source = json!({"connection": format!("DB_{}", case.name.to_uppercase()), "table": "items", "cursor": "c", "pk": ["id"]});
        for (key, value) in case.source.as_object().unwrap() {
            source[key] = value.clone();
        }
        std::fs::create_dir_all(root.join(case.name)).unwrap();
        let function = json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "*/1 * * * * *"}],
            "poller": {"source": source, "sink": {"type": "webhook", "url": format!("{hook}/{}", case.name)},
                       "state": {"connection": "STATE"}}
        });
        std::fs::write(root.join(case.name).join("function.json"), serde_json::to_vec(&function).unwrap()).unwrap();
        settings.push((format!("DB_{}", case.name.to_uppercase()), url.clone()));
        urls.push((case.name, url));
    }
    let mut dev = Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
        .args(["dev", "--app-root"])
        .arg(&root)
        .envs(settings.iter().map(|(key, value)| (key.as_str(), value.as_str())))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The writer: one short transaction per table at a time, every 100-300 ms.
    let mut pools = Vec::new();
    for (name, url) in &urls {
        pools.push((*name, sqlx::PgPool::connect(url).await.unwrap()));
    }
    let mut committed: HashMap<(String, i64), Instant> = HashMap::new();
    let started = Instant::now();
    let mut id = 0i64;
    let mut random = 7u64;
    while started.elapsed() < Duration::from_secs(seconds) {
        id += 1;
        for (name, pool) in &pools {
            sqlx::query("INSERT INTO items (id, note) VALUES ($1, 'latency')").bind(id).execute(pool).await.unwrap();
            committed.insert((name.to_string(), id), Instant::now());
        }
        random = random.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        tokio::time::sleep(Duration::from_millis(100 + (random >> 33) % 200)).await;
    }
    // Everything arrives within a few seconds of the last commit.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let _ = dev.kill();
    let _ = dev.wait();

    let arrivals = arrivals.lock().unwrap();
    println!("\n{id} rows per poller over {seconds} s, schedule every second (dbtrigger dev)\n");
    println!("| cursor | rows delivered | p50 ms | p90 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|---|");
    for case in cases() {
        let mut latencies: Vec<f64> = committed
            .iter()
            .filter(|((poller, _), _)| poller == case.name)
            .filter_map(|(key, at)| {
                arrivals.get(key).map(|arrived| arrived.saturating_duration_since(*at).as_secs_f64() * 1000.0)
            })
            .collect();
        latencies.sort_by(f64::total_cmp);
        if latencies.is_empty() {
            println!("| {} | 0 | - | - | - | - |", case.label);
            continue;
        }
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} |",
            case.label,
            latencies.len(),
            percentile(&latencies, 0.5),
            percentile(&latencies, 0.9),
            percentile(&latencies, 0.99),
            latencies.last().unwrap()
        );
    }
}
