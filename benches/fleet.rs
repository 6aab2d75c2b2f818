//! One app, many functions (issue 27, section 2): what `dbtrigger serve` costs before it does
//! anything, and what a burst of catch-ups holds against the app-wide budget of bytes in flight.
//!
//! 1. Ready time and idle RSS of `serve` with 200 pollers (SQLite tables, file state): from the
//!    process's start to its first answer to `GET /` (what the host waits for), and its resident
//!    set then and a second later.
//! 2. Peak RSS of 100 simultaneous catch-ups of 10 KB rows (batch 100 rows, ~1 MB; maxInFlight
//!    4), all invoked at once like the host's timers, under `DBTRIGGER_MAX_BYTES_IN_FLIGHT` of
//!    32 MiB and of 4 GiB (no bound in practice), each in a fresh process: `VmHWM` after the burst,
//!    and the wall time of the burst.
//!
//! 3. A tick's p50 and p90 with no telemetry and with an OTLP endpoint that refuses every
//!    connection (issue 40: exporting never slows a tick): 200 ticks of one poller, each after
//!    10 new rows, metrics exported every second, the receiver answering at once.
//!
//! Run: `cargo bench --bench fleet` (`DBTRIGGER_BENCH_FLEET_ROWS`, default 100 rows a table;
//! `DBTRIGGER_BENCH_FLEET_PART=telemetry` runs part 3 alone).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

const TIMER: &str = include_str!("../tests/fixtures/host/timer_normal.json");

struct Serve {
    child: Child,
    base: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `VmRSS` and `VmHWM` of a process, in MiB.
fn memory_of(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> f64 {
        let line = status.lines().find(|line| line.starts_with(name)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<f64>().unwrap() / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Starts `serve` in `root` and waits for its first answer: the process and how long that took.
async fn start(root: &Path, settings: &[(&str, String)]) -> (Serve, Duration) {
    let port = free_port();
    let started = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
        .arg("serve")
        .current_dir(root)
        .env("FUNCTIONS_CUSTOMHANDLER_PORT", port.to_string())
        .env("FUNCTIONS_APP_ROOT_PATH", root)
        .env("RUST_LOG", "error")
        .envs(settings.iter().map(|(name, value)| (*name, value.as_str())))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let serve = Serve { child, base: format!("http://127.0.0.1:{port}") };
    let client = reqwest::Client::new();
    loop {
        if let Ok(response) = client.get(format!("{}/", serve.base)).send().await
            && response.status() == 200
        {
            return (serve, started.elapsed());
        }
        assert!(started.elapsed() < Duration::from_secs(60), "serve did not answer within 60 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A SQLite file with `tables` tables `t0`… of `rows` rows of `width` bytes each.
fn write_database(path: &Path, tables: usize, rows: i64, width: usize) {
    let connection = rusqlite::Connection::open(path).unwrap();
    connection.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = OFF").unwrap();
    let body = "x".repeat(width);
    for table in 0..tables {
        connection
            .execute_batch(&format!(
                "CREATE TABLE t{table} (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, body TEXT NOT NULL)"
            ))
            .unwrap();
        let transaction = connection.unchecked_transaction().unwrap();
        {
            let mut insert = transaction.prepare(&format!("INSERT INTO t{table} VALUES (?1, ?1, ?2)")).unwrap();
            for id in 1..=rows {
                insert.execute(rusqlite::params![id, body]).unwrap();
            }
        }
        transaction.commit().unwrap();
    }
}

/// An app root of `functions` pollers `p0`… reading `t0`… into the webhook.
fn write_app(root: &Path, functions: usize, batch: serde_json::Value) {
    std::fs::create_dir_all(root).unwrap();
    std::fs::write(root.join("host.json"), r#"{"version": "2.0", "functionTimeout": "00:10:00"}"#).unwrap();
    for index in 0..functions {
        let function = json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
            "poller": {
                "source": {"connection": "FLEET_DB", "table": format!("t{index}"), "cursor": "version", "pk": ["id"],
                           "lateArrivals": null},
                "batch": batch,
                "sink": {"type": "webhook", "url": "%FLEET_WEBHOOK%", "timeoutSeconds": 60},
                "state": {"connection": "FLEET_STATE"}
            }
        });
        std::fs::create_dir_all(root.join(format!("p{index}"))).unwrap();
        std::fs::write(root.join(format!("p{index}/function.json")), serde_json::to_vec(&function).unwrap()).unwrap();
    }
}

fn settings(directory: &Path, database: &Path, webhook: &str) -> Vec<(&'static str, String)> {
    vec![
        ("FLEET_DB", format!("sqlite://{}", database.display())),
        ("FLEET_WEBHOOK", webhook.to_string()),
        ("FLEET_STATE", format!("file:{}", directory.join("state").display())),
        ("DBTRIGGER_APP_NAME", "fleet-bench".to_string()),
    ]
}

async fn ready_and_idle() {
    let directory = tempfile::tempdir().unwrap();
    let database = directory.path().join("idle.db");
    write_database(&database, 200, 10, 100);
    let root = directory.path().join("app");
    write_app(&root, 200, json!({"size": 500}));
    let settings = settings(directory.path(), &database, "http://127.0.0.1:9/hook");
    let mut ready = Vec::new();
    let mut idle = Vec::new();
    for _ in 0..3 {
        let (serve, took) = start(&root, &settings).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        ready.push(took.as_secs_f64() * 1000.0);
        idle.push(memory_of(serve.child.id()).0);
    }
    println!(
        "serve with 200 pollers: ready in {} ms (3 starts: {ready:.1?}), idle RSS {:.1} MiB ({idle:.1?})",
        median(&ready).round(),
        median(&idle)
    );
}

/// 100 catch-ups at once against a budget: the peak RSS of the process and the burst's time.
async fn burst(directory: &Path, database: &Path, webhook: &str, budget: u64) -> (f64, f64) {
    let root = directory.join(format!("app-{budget}"));
    write_app(&root, 100, json!({"size": 100, "maxInFlight": 4}));
    let state = directory.join(format!("state-{budget}"));
    let mut settings = settings(&state, database, webhook);
    settings.push(("DBTRIGGER_MAX_BYTES_IN_FLIGHT", budget.to_string()));
    let (serve, _) = start(&root, &settings).await;
    let client = reqwest::Client::new();
    let started = Instant::now();
    let mut invocations = Vec::new();
    for index in 0..100 {
        let request = client
            .post(format!("{}/p{index}", serve.base))
            .header("content-type", "application/json")
            .body(TIMER)
            .send();
        invocations.push(tokio::spawn(async move {
            let response = request.await.unwrap();
            let body: serde_json::Value = response.json().await.unwrap();
            let line = body["Logs"][0].as_str().unwrap_or_default().to_string();
            assert!(line.contains("outcome=caught-up"), "{line}");
        }));
    }
    for invocation in invocations {
        invocation.await.unwrap();
    }
    let took = started.elapsed().as_secs_f64();
    (memory_of(serve.child.id()).1, took)
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    if std::env::var("DBTRIGGER_BENCH_FLEET_PART").as_deref() == Ok("telemetry") {
        runtime.block_on(telemetry_cost());
        return;
    }
    runtime.block_on(async {
        ready_and_idle().await;

        let rows: i64 =
            std::env::var("DBTRIGGER_BENCH_FLEET_ROWS").ok().and_then(|text| text.parse().ok()).unwrap_or(100);
        let directory = tempfile::tempdir().unwrap();
        let database: PathBuf = directory.path().join("wide.db");
        write_database(&database, 100, rows, 10_000);
        let (hook, received) = {
            let (router, received) = counting_receiver();
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}/hook", listener.local_addr().unwrap());
            tokio::spawn(async move { axum::serve(listener, router).await });
            (url, received)
        };
        println!(
            "100 catch-ups at once, {rows} rows of 10 KB each ({:.0} MB in all), batch 100, maxInFlight 4:",
            100.0 * rows as f64 * 10_000.0 / 1e6
        );
        for budget in [32u64 << 20, 4u64 << 30] {
            let (peak, took) = burst(directory.path(), &database, &hook, budget).await;
            println!(
                "  DBTRIGGER_MAX_BYTES_IN_FLIGHT={:>4} MiB: peak RSS {peak:.0} MiB, burst {took:.1} s ({:.0} rows/s)",
                budget >> 20,
                100.0 * rows as f64 / took
            );
        }
        println!("  (events received: {})", received.load(std::sync::atomic::Ordering::SeqCst));
    });
    runtime.block_on(telemetry_cost());
}

/// Part 3: a tick's time (the host's request to its answer) with no telemetry, and with an OTLP
/// endpoint nothing listens on.
async fn telemetry_cost() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    let router = axum::Router::new().route("/hook", axum::routing::post(|| async { "{}" }));
    tokio::spawn(async move { axum::serve(listener, router).await });
    let dead = format!("http://127.0.0.1:{}", free_port());
    let cases: [(&str, Vec<(&'static str, String)>); 2] = [
        ("no telemetry", vec![]),
        (
            "unreachable OTLP endpoint",
            vec![
                ("OTEL_EXPORTER_OTLP_ENDPOINT", dead.clone()),
                ("OTEL_METRIC_EXPORT_INTERVAL", "1000".to_string()),
                ("OTEL_BSP_SCHEDULE_DELAY", "200".to_string()),
            ],
        ),
    ];
    println!("a tick of one poller, 10 new rows each, 200 ticks:");
    for (index, (label, extra)) in cases.into_iter().enumerate() {
        let directory = tempfile::tempdir().unwrap();
        let database = directory.path().join(format!("telemetry-{index}.db"));
        write_database(&database, 1, 0, 100);
        let root = directory.path().join("app");
        write_app(&root, 1, json!({"size": 100}));
        let mut settings = settings(directory.path(), &database, &hook);
        settings.extend(extra);
        let (serve, _) = start(&root, &settings).await;
        let connection = rusqlite::Connection::open(&database).unwrap();
        let client = reqwest::Client::new();
        let mut took = Vec::new();
        for tick in 0..200_i64 {
            for id in tick * 10 + 1..=tick * 10 + 10 {
                connection.execute("INSERT INTO t0 VALUES (?1, ?1, 'x')", rusqlite::params![id]).unwrap();
            }
            let started = Instant::now();
            let response = client
                .post(format!("{}/p0", serve.base))
                .header("content-type", "application/json")
                .body(TIMER)
                .send()
                .await
                .unwrap();
            let body: serde_json::Value = response.json().await.unwrap();
            took.push(started.elapsed().as_secs_f64() * 1000.0);
            let line = body["Logs"][0].as_str().unwrap_or_default();
            assert!(line.contains("outcome=caught-up rows=10"), "{line}");
        }
        let mut sorted = took.clone();
        sorted.sort_by(f64::total_cmp);
        println!("  {label:<26} p50 {:.2} ms, p90 {:.2} ms", median(&took), sorted[sorted.len() * 9 / 10]);
    }
}

/// A webhook receiver in this process that counts events, with a 20 ms answer time.
fn counting_receiver() -> (axum::Router, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    let received = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = received.clone();
    let router = axum::Router::new()
        .route(
            "/hook",
            axum::routing::post(move |body: axum::body::Bytes| {
                let counter = counter.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                    let events = value["events"].as_array().map(Vec::len).unwrap_or(0) as u64;
                    counter.fetch_add(events, std::sync::atomic::Ordering::SeqCst);
                    "{}"
                }
            }),
        )
        .layer(axum::extract::DefaultBodyLimit::disable());
    (router, received)
}
