//! The logical source's throughput (issue 29): changes per second delivered by real ticks of a
//! logical poller (peek, decode, batches, checkpoint commits on the file store, the slot advanced
//! after each commit) to an in-process sink that acknowledges every batch and counts its events
//! (keeping nothing: the raw path keeps nothing either), against the **raw limit** measured in the
//! same run on the same changes: `pg_logical_slot_peek_binary_changes` of the same publication,
//! every message decoded as it arrives by the same pgoutput decoder into the same JSON rows,
//! nothing delivered, nothing committed, on one task. Both sides connect, and decode from their
//! slot once, before their clock starts (a poller has ticked once: its connections stay open from
//! tick to tick). Two slots are created together so that both paths read the same changes; the
//! raw path peeks (which consumes nothing) before and after dbtrigger's run, and dbtrigger is
//! compared with the mean of the two. Both allocate with mimalloc, as the binary does.
//!
//! dbtrigger decodes a peek's changes on every core (chunks decoded in parallel, handed out in
//! order), the raw path on one task: the last column, the CPU this process spent on dbtrigger's
//! run over what it spent on a raw one, says what the wall-clock ratio does not (PostgreSQL's own
//! CPU is in neither).
//!
//! Run: `cargo bench --bench logical` (starts PostgreSQL with wal_level=logical like the tests).
//! `DBTRIGGER_BENCH_CHANGES` (default 50,000: inserts, updates and deletes in transactions of 10)
//! and `DBTRIGGER_BENCH_ROUNDS` (default 5) change the size; the table shows medians.
//! `DBTRIGGER_BENCH_SINK=recording` delivers to the tests' recording sink instead (the bench
//! before 2026-11-26's second change, for comparing).

mod common;
#[path = "../tests/it/services.rs"]
mod services;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use futures::TryStreamExt;

use common::{Acknowledging, env_number, median};
use dbtrigger::source::logical::changes::{Assembler, CommitFields, event_row_of};
use dbtrigger::source::logical::values::parse_lsn;
use dbtrigger::tick::{Poller, SystemClock, TickOutcome};
use serde_json::json;
use sqlx::Row;

/// The allocator the `dbtrigger` binary runs with (both paths use it).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Peeks everything the slot holds and decodes it to event rows: the changes seen.
async fn raw(url: &str, slot: &str) -> (usize, f64) {
    let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(url).await.unwrap();
    sqlx::raw_sql("SET TimeZone = 'UTC'; SET extra_float_digits = 3").execute(&mut connection).await.unwrap();
    // A backend that has decoded from a slot before, as dbtrigger's kept peek connection has
    // (both warm up the same way: a peek of the first change, before the clock).
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, 1, \
         'proto_version', '1', 'publication_names', 'feed')"
    )))
    .execute(&mut connection)
    .await
    .unwrap();
    let started = Instant::now();
    // Each row decoded as it arrives (the driver reads the socket ahead), as dbtrigger's peek
    // does: collecting every row first (`fetch_all`, the bench before 2026-11-27's third pass)
    // held 60,000 rows and decoded none of them while they came.
    let sql = format!(
        "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, NULL, \
         'proto_version', '1', 'publication_names', 'feed')"
    );
    let mut rows = sqlx::query(sqlx::AssertSqlSafe(sql)).fetch(&mut connection);
    let mut assembler = Assembler::default();
    let mut changes = 0;
    let mut bytes = 0;
    while let Some(row) = rows.try_next().await.unwrap() {
        let lsn = parse_lsn(&row.get::<String, _>(0)).unwrap();
        if let Some(mut transaction) = assembler.push(lsn, row.get::<&[u8], _>(1)).unwrap() {
            let commit = CommitFields::of(&transaction);
            for change in std::mem::take(&mut transaction.changes) {
                bytes += serde_json::to_vec(&event_row_of(&commit, change)).unwrap().len();
                changes += 1;
            }
        }
    }
    std::hint::black_box(bytes);
    (changes, started.elapsed().as_secs_f64())
}

/// A poller on `slot` that has ticked once: made before the changes are written (the slot is
/// empty then, so its first tick reads to the end, keeps the peek's connection for the next peek
/// and learns where the slot stands, as a running poller has from tick to tick; the raw path
/// also connects, and peeks once, before its clock starts).
struct Ours {
    _directory: tempfile::TempDir,
    poller: Poller,
    sink: Option<Arc<Acknowledging>>,
}

async fn prepare(url: &str, slot: &str, batch: usize) -> Ours {
    let poller = json!({
        "source": {"kind": "logical", "connection": "DB", "slot": slot, "publication": "feed"},
        "batch": {"size": batch},
        "sink": {"type": "webhook", "url": "http://127.0.0.1:9/unused"},
        "state": {"connection": "STATE"}
    });
    let (directory, config) = common::orders_config(poller, url);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (store, _) = dbtrigger::store::open(&config.state).unwrap();
    source.slot().await.unwrap();
    let sink = Arc::new(Acknowledging::default());
    let poller = Poller::new(config, source, sink.clone(), store, Arc::new(SystemClock), "bench".into());
    // A poller that has ticked before, as a running app's has: its first tick, on the empty slot,
    // finds nothing, writes nothing, and leaves the peek's connection open and the slot's
    // position known.
    let first = poller.tick().await.unwrap();
    assert!(matches!(first, TickOutcome::Idle), "the slot is empty when the poller is made: {first:?}");
    if std::env::var("DBTRIGGER_BENCH_SINK").is_ok_and(|sink| sink == "recording") {
        // As the bench was before 2026-11-26's second change: for comparing.
        let recording = Arc::new(dbtrigger::sink::recording::RecordingSink::new());
        let Poller { config, source, store, .. } = poller;
        let poller = Poller::new(config, source, recording, store, Arc::new(SystemClock), "bench".into());
        return Ours { _directory: directory, poller, sink: None };
    }
    Ours { _directory: directory, poller, sink: Some(sink) }
}

async fn dbtrigger(ours: Ours) -> (usize, f64) {
    let (delivered, seconds) = common::catch_up(&ours.poller).await;
    if let Some(sink) = &ours.sink {
        assert_eq!(sink.events.load(Ordering::Relaxed), delivered);
    }
    (delivered, seconds)
}

/// Runs each statement (separated by `;` and a line break) on its own: a slot is created, and a
/// DO block commits, only outside a transaction block.
async fn execute(url: &str, sql: &str) {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    for statement in sql.split(";\n") {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_string())).execute(&pool).await.unwrap();
    }
    pool.close().await;
}

async fn run() {
    let changes = env_number("DBTRIGGER_BENCH_CHANGES", 50_000);
    let rounds = env_number("DBTRIGGER_BENCH_ROUNDS", 5).max(1);
    let url = services::postgres().fresh_database().await;
    execute(&url, "CREATE TABLE orders (id BIGINT PRIMARY KEY, status TEXT, total NUMERIC(12,2), at TIMESTAMPTZ);\nCREATE PUBLICATION feed FOR TABLE orders").await;
    println!("logical source, {changes} changes (transactions of 10), {}, loopback, {rounds} rounds", machine());
    println!(
        "{:<10} {:>14} {:>14} {:>8} {:>24} {:>14}",
        "batch", "raw changes/s", "dbtrigger c/s", "ratio", "", "CPU ratio"
    );
    for batch in [500usize, 5000] {
        let (mut raws, mut ours, mut ratios, mut cpus) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for round in 0..=rounds {
            let (raw_slot, our_slot) = (format!("bench_raw_{round}_{batch}"), format!("bench_ours_{round}_{batch}"));
            execute(&url, &format!(
                "SELECT pg_create_logical_replication_slot('{raw_slot}', 'pgoutput');\nSELECT pg_create_logical_replication_slot('{our_slot}', 'pgoutput')"
            )).await;
            let prepared = prepare(&url, &our_slot, batch).await;
            // Inserts, then updates of half of them, then deletes of a quarter, ten per transaction.
            let inserts = changes * 4 / 7;
            execute(&url, &format!(
                "TRUNCATE orders;\nDO $$ BEGIN FOR i IN 0..{} LOOP \
                 INSERT INTO orders SELECT g, 'new', g * 1.5, now() FROM generate_series(i * 10 + 1, i * 10 + 10) g; COMMIT; END LOOP; END $$;\n\
                 DO $$ BEGIN FOR i IN 0..{} LOOP UPDATE orders SET status = 'paid' WHERE id BETWEEN i * 10 + 1 AND i * 10 + 10; COMMIT; END LOOP; END $$;\n\
                 DO $$ BEGIN FOR i IN 0..{} LOOP DELETE FROM orders WHERE id BETWEEN i * 10 + 1 AND i * 10 + 10; COMMIT; END LOOP; END $$",
                inserts / 10 - 1, inserts / 20 - 1, inserts / 40 - 1
            )).await;
            let cpu = common::cpu_micros();
            let (seen_before, raw_before) = raw(&url, &raw_slot).await;
            let cpu_raw_before = common::cpu_micros() - cpu;
            let (delivered, ours_seconds) = dbtrigger(prepared).await;
            let cpu_ours = common::cpu_micros() - cpu - cpu_raw_before;
            let (seen_after, raw_after) = raw(&url, &raw_slot).await;
            let cpu_raw_after = common::cpu_micros() - cpu - cpu_raw_before - cpu_ours;
            // TRUNCATE is a change too: one event.
            assert_eq!(seen_before, delivered);
            assert_eq!(seen_after, delivered);
            execute(
                &url,
                &format!(
                    "SELECT pg_drop_replication_slot('{raw_slot}');\nSELECT pg_drop_replication_slot('{our_slot}')"
                ),
            )
            .await;
            if round == 0 {
                continue; // warm-up
            }
            let raw_rate = delivered as f64 / ((raw_before + raw_after) / 2.0);
            let our_rate = delivered as f64 / ours_seconds;
            raws.push(raw_rate);
            ours.push(our_rate);
            ratios.push(our_rate / raw_rate);
            cpus.push(cpu_ours as f64 / ((cpu_raw_before + cpu_raw_after) as f64 / 2.0));
        }
        let (low, high) = (ratios.iter().cloned().fold(f64::MAX, f64::min), ratios.iter().cloned().fold(0.0, f64::max));
        println!(
            "{:<10} {:>14.0} {:>14.0} {:>8.2}  (ratio {low:.2}-{high:.2}) {:>14.2}",
            batch,
            median(raws),
            median(ours),
            median(ratios.clone()),
            median(cpus)
        );
    }
}

/// This machine's cores and processor, as /proc/cpuinfo names them.
fn machine() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|line| line.strip_prefix("model name"))
        .map(|rest| rest.trim_start_matches([' ', '\t', ':']));
    format!(
        "{} cores, {}",
        std::thread::available_parallelism().map_or(0, |cores| cores.get()),
        model.unwrap_or("unknown processor")
    )
}

fn main() {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(run());
}
