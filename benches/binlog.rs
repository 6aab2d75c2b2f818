//! The binary-log source's throughput (issue 39): changes per second delivered by real ticks of a
//! binary-log poller (its dump from the checkpoint, decode, batches, checkpoint commits on the file
//! store) to an in-process sink that acknowledges every batch and counts its events, against the
//! **raw limit** measured in the same run on the same events: a dump of the same range of the
//! binary log through the same driver (`mysql_async`'s binlog stream, the source's own connect,
//! column look-up and dump request), every event through the same decoder, tracking GTIDs from
//! the GTID position at the start as a read from a checkpoint does, into the same event rows
//! (`rows_of`, as a read hands them out: JSON, GTID marks, order groups),
//! nothing delivered, nothing committed. Both clocks include connecting and the server's
//! questions a read asks before its dump. The binary log is not consumed by a read: the changes
//! are written once, every poller's first tick having recorded where the log ended before them;
//! the raw read runs before and after each poller's catch-up, and dbtrigger is compared with the
//! mean of the two.
//!
//! Run: `cargo bench --bench binlog` (starts MariaDB with its binary log like the tests).
//! `DBTRIGGER_BENCH_CHANGES` (default 50,000: inserts, updates and deletes in transactions of 10)
//! and `DBTRIGGER_BENCH_ROUNDS` (default 5) change the size; the table shows medians.

mod common;
#[path = "../tests/it/services.rs"]
mod services;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use common::{Acknowledging, env_number, median};
use dbtrigger::domain::binlog::BinlogPos;
use dbtrigger::source::binlog::events::{Decoder, Step};
use dbtrigger::source::binlog::{rows_of, server};
use dbtrigger::tick::{Poller, SystemClock, TickOutcome};
use futures::StreamExt;
use serde_json::json;

/// The allocator the `dbtrigger` binary runs with (both paths use it).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The replica id the raw read registers with (the pollers derive theirs from their names).
const RAW_SERVER_ID: u32 = 77_001;

/// Dumps the binary log from `from` to its end and decodes every change of `tables` to its event
/// row: the changes seen and the seconds it took.
async fn raw(url: &str, tables: &[String], from: BinlogPos) -> (usize, f64) {
    let started = Instant::now();
    let options = server::options_of(url).unwrap();
    let mut conn = mysql_async::Conn::new(options).await.unwrap();
    let (_, names) = server::end_position(&mut conn).await.unwrap().unwrap();
    // MariaDB: the GTID position there, from which the decoder tracks every transaction's GTIDs
    // (each row's position carries its mark), as a tick's read from a checkpoint does.
    let gtid_pos = server::gtid_pos_at(&mut conn, &names, from).await.unwrap().expect("a GTID position at the start");
    let info = server::table_info(&mut conn, tables).await.unwrap();
    let mut stream = server::dump(conn, RAW_SERVER_ID, &names, from).await.unwrap();
    let mut decoder = Decoder::new(tables, info, Some((from, 0)));
    decoder.track_gtids(gtid_pos, None, None);
    let (mut changes, mut bytes) = (0usize, 0usize);
    let mut keys = HashMap::new();
    while let Some(event) = stream.next().await {
        let event = event.unwrap();
        let step = decoder.push(&event, |id| stream.get_tme(id)).unwrap();
        if let Step::Changes(decoded) = step {
            for (_, row) in rows_of(decoder.fields().unwrap(), decoded, &mut keys) {
                assert_eq!(row.position.pk.len(), 3, "a change carries its GTID mark");
                bytes += row.row.len();
                changes += 1;
            }
        }
    }
    std::hint::black_box(bytes);
    (changes, started.elapsed().as_secs_f64())
}

/// A poller of `orders` with batches of `batch` whose first tick has recorded where the log ends.
async fn poller(url: &str, table: &str, batch: usize) -> (tempfile::TempDir, Poller, Arc<Acknowledging>) {
    let poller = json!({
        "source": {"kind": "binlog", "connection": "DB", "tables": [table]},
        "batch": {"size": batch},
        "sink": {"type": "webhook", "url": "http://127.0.0.1:9/unused"},
        "state": {"connection": "STATE"}
    });
    let (directory, config) = common::orders_config(poller, url);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (store, _) = dbtrigger::store::open(&config.state).unwrap();
    let sink = Arc::new(Acknowledging::default());
    let poller = Poller::new(config, source, sink.clone(), store, Arc::new(SystemClock), "bench".into());
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle), "a first tick records where the log ends");
    (directory, poller, sink)
}

/// Runs each statement (separated by `;` and a line break) on its own.
async fn execute(url: &str, sql: &str) {
    let pool = sqlx::MySqlPool::connect(url).await.unwrap();
    for statement in sql.split(";\n") {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_string())).execute(&pool).await.unwrap();
    }
    pool.close().await;
}

async fn run() {
    let changes = env_number("DBTRIGGER_BENCH_CHANGES", 50_000);
    let rounds = env_number("DBTRIGGER_BENCH_ROUNDS", 5).max(1);
    let url = services::mariadb_binlog().fresh_database().await;
    let database = url.rsplit('/').next().unwrap().to_string();
    let table = format!("{database}.orders");
    let tables = vec![table.clone()];
    execute(
        &url,
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, status VARCHAR(20), total DECIMAL(12,2), at DATETIME(6))",
    )
    .await;
    let batches = [500usize, 5000];
    // Every poller (a warm-up round and the measured ones, per batch size) starts here.
    let mut pollers = Vec::new();
    for batch in batches {
        for _ in 0..=rounds {
            pollers.push((batch, poller(&url, &table, batch).await));
        }
    }
    let from = {
        let mut conn = mysql_async::Conn::new(server::options_of(&url).unwrap()).await.unwrap();
        server::end_position(&mut conn).await.unwrap().unwrap().0
    };
    // Inserts, then updates of half of them, then deletes of a quarter, ten per transaction.
    let inserts = changes * 4 / 7;
    execute(
        &url,
        &format!(
            "CREATE PROCEDURE fill() BEGIN DECLARE i INT DEFAULT 0; \
             WHILE i < {} DO START TRANSACTION; \
             INSERT INTO orders SELECT i * 10 + seq, 'new', (i * 10 + seq) * 1.5, NOW(6) FROM seq_1_to_10; COMMIT; SET i = i + 1; END WHILE; \
             SET i = 0; WHILE i < {} DO START TRANSACTION; \
             UPDATE orders SET status = 'paid' WHERE id BETWEEN i * 10 + 1 AND i * 10 + 10; COMMIT; SET i = i + 1; END WHILE; \
             SET i = 0; WHILE i < {} DO START TRANSACTION; \
             DELETE FROM orders WHERE id BETWEEN i * 10 + 1 AND i * 10 + 10; COMMIT; SET i = i + 1; END WHILE; END;\n\
             CALL fill()",
            inserts / 10,
            inserts / 20,
            inserts / 40
        ),
    )
    .await;
    let expected = inserts / 10 * 10 + inserts / 20 * 10 + inserts / 40 * 10;
    println!(
        "binlog source, {expected} changes (transactions of 10), MariaDB {}, {} cores, loopback, {rounds} rounds",
        server_version(&url).await,
        std::thread::available_parallelism().map(usize::from).unwrap_or(0)
    );
    println!("{:<10} {:>14} {:>14} {:>8}", "batch", "raw changes/s", "dbtrigger c/s", "ratio");
    let mut pollers = pollers.into_iter();
    for batch in batches {
        let (mut raws, mut ours, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..=rounds {
            let (size, (_directory, poller, sink)) = pollers.next().unwrap();
            assert_eq!(size, batch);
            let (seen_before, raw_before) = raw(&url, &tables, from).await;
            let (delivered, ours_seconds) = common::catch_up(&poller).await;
            let (seen_after, raw_after) = raw(&url, &tables, from).await;
            assert_eq!(sink.events.load(Ordering::Relaxed), delivered);
            assert_eq!((seen_before, seen_after, delivered), (expected, expected, expected));
            if round == 0 {
                continue; // warm-up
            }
            let raw_rate = delivered as f64 / ((raw_before + raw_after) / 2.0);
            let our_rate = delivered as f64 / ours_seconds;
            raws.push(raw_rate);
            ours.push(our_rate);
            ratios.push(our_rate / raw_rate);
        }
        let (low, high) = (ratios.iter().cloned().fold(f64::MAX, f64::min), ratios.iter().cloned().fold(0.0, f64::max));
        println!(
            "{:<10} {:>14.0} {:>14.0} {:>8.2}  (ratio {low:.2}-{high:.2})",
            batch,
            median(raws),
            median(ours),
            median(ratios.clone())
        );
    }
}

async fn server_version(url: &str) -> String {
    let pool = sqlx::MySqlPool::connect(url).await.unwrap();
    let version: String = sqlx::query_scalar("SELECT VERSION()").fetch_one(&pool).await.unwrap();
    pool.close().await;
    version
}

fn main() {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(run());
}
