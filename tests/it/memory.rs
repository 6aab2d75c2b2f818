//! Memory stays bounded by what is in flight, not by the table: a catch-up of wide rows through the
//! real binary, its peak RSS (VmHWM) read from the kernel while it runs.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde_json::json;

use crate::harness::AppRoot;
use crate::services::Received;

const ROWS: i64 = 48_000;
const ROW_BYTES: i64 = 10_000;
const BATCH: i64 = 1000;
const MAX_IN_FLIGHT: i64 = 4;
/// The margin of the bound over twice what is in flight, in MB: the process itself and the batches
/// beside the window (two: one ready to send, one being read), with what the two allocators
/// (Rust's, SQLite's) keep of them. Measured 91–177 MB in all on the development machine
/// (2026-11-24 and 25; 140–195 while SQLite was read through sqlx, whose driver buffered a batch of
/// rows). Once 262 MB in all (2026-11-26, the whole suite beside other builds on 2 cores), so the
/// margin is 220 MB and the table 480 MB, which keeps the bound far below what buffering it would
/// hold. That 262 MB, and a 514 MB in a later CI run, were read from `wait4`'s ru_maxrss, which
/// counts the test process's own memory at the spawn; the peak is now VmHWM, the child's own
/// (2026-11-27: 141-168 MB, in MB of 10^6 bytes like the rest), and the margin 180 MB.
const MARGIN_MB: i64 = 180;
// The bound must stay far below the table, or a regression that buffers it would pass.
const _: () = assert!(2 * MAX_IN_FLIGHT * BATCH * ROW_BYTES / 1_000_000 + MARGIN_MB < ROWS * ROW_BYTES / 1_000_000);

/// The counting receiver on a free loopback port: its URL and its count.
async fn counting_receiver() -> (String, Arc<Received>) {
    let (router, received) = crate::services::counting_receiver();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, received)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_of_wide_rows_keeps_memory_near_what_is_in_flight() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("wide.db");
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}?mode=rwc", path.display())).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, note TEXT);
         WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < {ROWS})
         INSERT INTO orders SELECT x, x, hex(randomblob({})) FROM g;
         CREATE INDEX orders_seek ON orders (version, id);",
        ROW_BYTES / 2
    )))
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let (url, received) = counting_receiver().await;
    let app = AppRoot::write(
        directory.path(),
        json!({
            "source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]},
            "batch": {"size": BATCH, "maxInFlight": MAX_IN_FLIGHT, "maxBytes": 64 * 1024 * 1024},
            "sink": {"type": "webhook", "url": "%ORDERS_WEBHOOK%", "maxBodyBytes": 64 * 1024 * 1024},
            "state": {"connection": "ORDERS_STATE"}
        }),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
        .args(["tick", "orders", "--app-root"])
        .arg(&app.root)
        .env("ORDERS_DB", format!("sqlite://{}", path.display()))
        .env("ORDERS_WEBHOOK", &url)
        .env("ORDERS_STATE", format!("file:{}", app.state_dir.display()))
        .env("DBTRIGGER_APP_NAME", &app.app_name)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stdout = child.stdout.take().unwrap();
    let output = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut text).unwrap();
        text
    });
    // VmHWM, the child's own high water mark, sampled until it exits (it only grows; what a
    // process frees as it ends does not raise it). Not `wait4`'s ru_maxrss: that counts this test
    // process's resident memory too, folded into the child's at its exec, which in a full run
    // beside other tests made a 130 MB tick read as 514 MB (2026-11-27).
    let (mut peak_kb, mut samples) = (0, 0);
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(kib) = crate::harness::peak_kib(pid) {
            peak_kb = peak_kb.max(kib as i64);
            samples += 1;
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > std::time::Duration::from_secs(300) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("the tick ran for five minutes");
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    // A run with no sample would pass any bound.
    assert!(samples > 0 && peak_kb > 0, "no VmHWM read from /proc/{pid}/status");
    let output = output.join().unwrap();
    assert!(status.success(), "the tick succeeded: {output}");
    assert_eq!(received.events.load(Ordering::SeqCst) as i64, ROWS, "every row delivered");
    let table_mb = ROWS * ROW_BYTES / 1_000_000;
    let in_flight_mb = MAX_IN_FLIGHT * BATCH * ROW_BYTES / 1_000_000;
    let peak_mb = peak_kb * 1024 / 1_000_000;
    println!("memory: {table_mb} MB table, {in_flight_mb} MB in flight, peak RSS {peak_mb} MB");
    // Loosely: twice what is in flight (the events, plus their request bodies), and a fixed margin
    // for the rest (see MARGIN_MB); far below the table, which a buffering regression would hold.
    let bound_mb = 2 * in_flight_mb + MARGIN_MB;
    assert!(peak_mb < bound_mb, "peak RSS {peak_mb} MB, bound {bound_mb} MB (table {table_mb} MB)");
}
