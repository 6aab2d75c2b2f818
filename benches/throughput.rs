//! End-to-end throughput: rows per second from a table to a webhook receiver on loopback, through
//! real ticks (keyset fetch, JSON envelopes, HTTP POST, checkpoint commits by CAS), against the
//! **pipelined raw limit** measured in the same run on the same data: the same keyset reads and
//! the same POSTs (the envelope dbtrigger posts, ids included, so that the receiver does the same
//! work) with no state and no lease, reading batch k+1 while batch k is posted, with as many posts
//! in flight as the path it is compared with (`maxInFlight`), each page read through the driver
//! dbtrigger reads that engine with (SQLite: rusqlite, a page per call on a blocking thread;
//! PostgreSQL: sqlx) into typed rows and serialized straight from them: the fastest this machine
//! moves these rows. The limit runs just before and just after each path, and the path is
//! compared with the mean of the two.
//!
//! The receiver runs in a child process (this program again), so the CPU time reported per row
//! is the dbtrigger side's alone (`getrusage` of this process; Azurite and PostgreSQL are other
//! processes too). Peak RSS is this process's high-water mark during each run (reset between runs
//! through `/proc/self/clear_refs`). The receiver counts body bytes too: the table shows them per
//! row, equal for the raw path and dbtrigger's.
//!
//! Last, the memory case: a catch-up of 10 KB rows (batch 1,000, four in flight) by dbtrigger and
//! by the raw limit, each run in a process of its own (this program again) so that its peak RSS is
//! its own (`DBTRIGGER_BENCH_WIDE_ROWS` rows, default 36,000: a 366 MB table).
//!
//! Last, the late-arrival detector's cost (issue 26): an idle tick with the detector off and on (at
//! its defaults: a check every tick, of the fresh buckets and a slice of the older ones), after
//! catch-ups of tables of 1,000, 10,000 and 100,000 rows (all of them in the window), on SQLite,
//! PostgreSQL and MariaDB, with file and Azurite state, in the same run; the table prints both
//! costs and their ratio (`DBTRIGGER_BENCH_ONLY=late` runs only that part).
//!
//! Run: `cargo bench --bench throughput` (starts PostgreSQL and Azurite like the tests). Each engine
//! and batch size runs one round to warm up, then `DBTRIGGER_BENCH_ROUNDS` rounds (default 3); the
//! table shows medians, and the ratio's range. `DBTRIGGER_BENCH_ROWS` changes the table size
//! (default 200,000); `DBTRIGGER_BENCH_ONLY=text` runs only the engines, batch sizes and paths whose
//! description contains `text` (and the raw limits they are compared with), e.g.
//! `Sqlite 1000 dbtrigger, file state, maxInFlight 1` for a profile, or `10 KB` for the memory case.
//!
//! The chart: at the end of a run of every path, rows/s of each configuration beside its raw
//! limit, written as an SVG to `docs/throughput.svg` (linked from docs/performance.md), or to
//! `DBTRIGGER_BENCH_SVG` when set (a run of some paths only writes one only there).

#[path = "../tests/it/services.rs"]
mod services;

mod chart;
mod common;

use common::median;

/// The binary's allocator (src/main.rs), for dbtrigger's paths and the raw one alike.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::routing::get;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::tick::{LateCheck, Poller, StopReason, SystemClock, TickOutcome};
use serde_json::json;
use sha2::{Digest, Sha256};

/// The receiver, when this program is started as one: counts events and body bytes, answers `{}`,
/// and says how many of each at `/count`.
async fn serve_receiver() {
    let (hook, received) = services::counting_receiver();
    let router = hook.route(
        "/count",
        get(move || async move {
            format!("{} {}", received.events.load(Ordering::SeqCst), received.bytes.load(Ordering::SeqCst))
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("{}", listener.local_addr().unwrap().port());
    axum::serve(listener, router).await.unwrap();
}

struct ReceiverProcess {
    child: Child,
    base: String,
}

impl ReceiverProcess {
    fn start() -> ReceiverProcess {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env("DBTRIGGER_BENCH_RECEIVER", "1")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        ReceiverProcess { child, base: format!("http://127.0.0.1:{}", line.trim()) }
    }

    fn hook(&self) -> String {
        format!("{}/hook", self.base)
    }

    /// Events and body bytes received so far.
    async fn count(&self) -> (u64, u64) {
        let text = reqwest::get(format!("{}/count", self.base)).await.unwrap().text().await.unwrap();
        let (events, bytes) = text.split_once(' ').unwrap();
        (events.parse().unwrap(), bytes.parse().unwrap())
    }
}

impl Drop for ReceiverProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// This process's peak RSS (`VmHWM`), in MB.
fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

/// What a run is measured from: its start and the process's CPU time then (the peak RSS is reset
/// to the resident memory then).
struct Meter {
    started: Instant,
    cpu_before: u64,
}

impl Meter {
    fn start() -> Meter {
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        Meter { started: Instant::now(), cpu_before: common::cpu_micros() }
    }

    fn finish(self, rows: i64) -> Measured {
        Measured {
            rows_per_second: rows as f64 / self.started.elapsed().as_secs_f64(),
            cpu_micros_per_row: (common::cpu_micros() - self.cpu_before) as f64 / rows as f64,
            peak_rss_mb: peak_rss_mb(),
            blob_writes: 0,
            body_bytes_per_row: 0.0,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Engine {
    Sqlite,
    Postgres,
    /// The late-arrival detector's part only (no raw limit is measured for it).
    MariaDb,
}

/// The rows' `note` column: a short text, as most tables have.
const SHORT_NOTE: &str = "'order number ' || x";

/// A table of `rows` orders whose `note` is the SQL expression `note` of the row number `x`.
async fn table(engine: Engine, directory: &std::path::Path, rows: i64, note: &str) -> String {
    match engine {
        Engine::Sqlite => {
            std::fs::create_dir_all(directory).unwrap();
            let path = directory.join("orders.db");
            let url = format!("sqlite://{}?mode=rwc", path.display());
            let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE orders (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, status TEXT, total REAL, note TEXT);
                 WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < {rows})
                 INSERT INTO orders SELECT x, x / 3, 'paid', x * 1.5, {note} FROM g;
                 CREATE INDEX orders_seek ON orders (version, id);"
            )))
            .execute(&pool)
            .await
            .unwrap();
            pool.close().await;
            format!("sqlite://{}", path.display())
        }
        Engine::Postgres => {
            let url = services::postgres().fresh_database().await;
            let pool = sqlx::PgPool::connect(&url).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE orders (id BIGINT PRIMARY KEY, version BIGINT NOT NULL, status TEXT, total DOUBLE PRECISION, note TEXT);
                 INSERT INTO orders SELECT x, x / 3, 'paid', x * 1.5, {note} FROM generate_series(1, {rows}) AS x;
                 CREATE INDEX orders_seek ON orders (version, id);
                 ANALYZE orders;"
            )))
            .execute(&pool)
            .await
            .unwrap();
            pool.close().await;
            url
        }
        Engine::MariaDb => {
            let url = services::mariadb().fresh_database().await;
            let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(
                "CREATE TABLE orders (id BIGINT PRIMARY KEY, version BIGINT NOT NULL, status TEXT, total DOUBLE, note TEXT, INDEX orders_seek (version, id))".to_string(),
            ))
            .execute(&pool)
            .await
            .unwrap();
            let note = note.replace("'order number ' || x", "CONCAT('order number ', x)");
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "INSERT INTO orders SELECT x, x DIV 3, 'paid', x * 1.5, {note} FROM (SELECT seq AS x FROM seq_1_to_{rows}) AS numbers;
                 ANALYZE TABLE orders;"
            )))
            .execute(&pool)
            .await
            .unwrap();
            pool.close().await;
            url
        }
    }
}

type RawRow = (i64, i64, String, f64, String);

enum RawPool {
    /// One connection, read on a blocking thread a page at a time, as dbtrigger reads SQLite.
    Sqlite(Arc<std::sync::Mutex<rusqlite::Connection>>),
    Postgres(sqlx::PgPool),
}

impl RawPool {
    async fn open(engine: Engine, url: &str) -> RawPool {
        match engine {
            Engine::Sqlite => {
                let path = url.trim_start_matches("sqlite://");
                let connection = rusqlite::Connection::open(path).unwrap();
                // As dbtrigger opens it: without this, SQLite recompiles the read for each page.
                connection.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true).unwrap();
                RawPool::Sqlite(Arc::new(std::sync::Mutex::new(connection)))
            }
            // No ping before each fetch (dbtrigger pings a connection idle for a second or more).
            Engine::Postgres => RawPool::Postgres(
                sqlx::postgres::PgPoolOptions::new().test_before_acquire(false).connect(url).await.unwrap(),
            ),
            Engine::MariaDb => panic!("no raw limit is measured on MariaDB"),
        }
    }

    async fn page(&self, after: (i64, i64), batch: i64) -> Vec<RawRow> {
        match self {
            RawPool::Sqlite(connection) => {
                let connection = connection.clone();
                tokio::task::spawn_blocking(move || {
                    let connection = connection.lock().unwrap();
                    let mut statement = connection
                        .prepare_cached(
                            "SELECT id, version, status, total, note FROM orders WHERE (version, id) > (?, ?) ORDER BY version, id LIMIT ?",
                        )
                        .unwrap();
                    statement
                        .query_map((after.0, after.1, batch), |row| {
                            Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?))
                        })
                        .unwrap()
                        .collect::<Result<Vec<RawRow>, _>>()
                        .unwrap()
                })
                .await
                .unwrap()
            }
            RawPool::Postgres(pool) => sqlx::query_as(
                "SELECT id, version, status, total, note FROM orders WHERE (version, id) > ($1, $2) ORDER BY version, id LIMIT $3",
            )
            .bind(after.0)
            .bind(after.1)
            .bind(batch)
            .fetch_all(pool)
            .await
            .unwrap(),
        }
    }
}

/// An id as dbtrigger writes one (`evt_` or `bat_` + 32 hex digits of a SHA-256), on the stack.
struct Id([u8; 36]);

impl serde::Serialize for Id {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(std::str::from_utf8(&self.0).unwrap())
    }
}

/// What the raw path needs to write the ids dbtrigger writes: SHA-256 of the poller and source
/// (hashed once) and of each row's cursor and key, in a reused buffer.
struct RawIds {
    prefix: Sha256,
    key: Vec<u8>,
}

impl RawIds {
    fn new() -> RawIds {
        let mut prefix = Sha256::new();
        for part in ["orders", "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"] {
            prefix.update((part.len() as u64).to_be_bytes());
            prefix.update(part.as_bytes());
        }
        RawIds { prefix, key: Vec::with_capacity(64) }
    }

    fn id(&self, tag: &[u8; 4]) -> Id {
        let mut hasher = self.prefix.clone();
        hasher.update((self.key.len() as u64).to_be_bytes());
        hasher.update(&self.key);
        let mut id = [0u8; 36];
        id[..4].copy_from_slice(tag);
        hex::encode_to_slice(&hasher.finalize()[..16], &mut id[4..]).unwrap();
        Id(id)
    }

    fn event(&mut self, version: i64, id: i64) -> Id {
        use std::io::Write;
        self.key.clear();
        write!(self.key, "integer|{version}|{{\"id\":{id}}}").unwrap();
        self.id(b"evt_")
    }

    fn batch(&mut self, rows: &[RawRow]) -> Id {
        use std::io::Write;
        let (first, last) = (&rows[0], &rows[rows.len() - 1]);
        self.key.clear();
        write!(self.key, "{}|{}|{}|{}|{}", first.1, first.0, last.1, last.0, rows.len()).unwrap();
        self.id(b"bat_")
    }
}

#[derive(serde::Serialize)]
struct RawEnvelope<'a> {
    poller: &'static str,
    batch_id: Id,
    fencing_token: u64,
    sent_at: String,
    events: Vec<RawEvent<'a>>,
}

#[derive(serde::Serialize)]
struct RawEvent<'a> {
    event_id: Id,
    op: &'static str,
    cursor: i64,
    pk: RawKey,
    row: RawColumns<'a>,
}

#[derive(serde::Serialize)]
struct RawKey {
    id: i64,
}

#[derive(serde::Serialize)]
struct RawColumns<'a> {
    id: i64,
    version: i64,
    status: &'a str,
    total: f64,
    note: &'a str,
}

/// The body of a page: the envelope dbtrigger posts (the same fields, of the same lengths, so
/// that the receiver does the same work for both), serialized straight from the typed rows (no
/// JSON tree): the least work that turns these rows into that body.
fn body(ids: &mut RawIds, rows: &[RawRow]) -> Vec<u8> {
    let events = rows
        .iter()
        .map(|(id, version, status, total, note)| RawEvent {
            event_id: ids.event(*version, *id),
            op: "upsert",
            cursor: *version,
            pk: RawKey { id: *id },
            row: RawColumns { id: *id, version: *version, status, total: *total, note },
        })
        .collect();
    let envelope = RawEnvelope {
        poller: "orders",
        batch_id: ids.batch(rows),
        fencing_token: 1,
        sent_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        events,
    };
    serde_json::to_vec(&envelope).unwrap()
}

/// The pipelined raw limit: page k+1 is read while page k is posted, with up to `window` posts
/// in flight (dbtrigger's `maxInFlight`); no state, no lease.
async fn raw_pipelined(engine: Engine, url: &str, hook: &str, batch: i64, window: usize, rows: i64) -> Measured {
    let pool = RawPool::open(engine, url).await;
    let client = reqwest::Client::new();
    let mut ids = RawIds::new();
    let meter = Meter::start();
    let mut total = 0i64;
    let mut page = pool.page((-1, -1), batch).await;
    let mut posting = std::collections::VecDeque::new();
    while !page.is_empty() {
        let last = page.last().map(|row| (row.1, row.0)).unwrap();
        let request = client.post(hook).header("content-type", "application/json").body(body(&mut ids, &page));
        total += page.len() as i64;
        posting.push_back(tokio::spawn(async move {
            request.send().await.unwrap().error_for_status().unwrap();
        }));
        let oldest = if posting.len() == window { posting.pop_front() } else { None };
        let (next, _) = tokio::join!(pool.page(last, batch), async {
            if let Some(oldest) = oldest {
                oldest.await.unwrap();
            }
        });
        page = next;
    }
    for post in posting {
        post.await.unwrap();
    }
    assert_eq!(total, rows);
    meter.finish(rows)
}

struct Measured {
    rows_per_second: f64,
    cpu_micros_per_row: f64,
    peak_rss_mb: f64,
    /// State document writes (PUTs) for the whole catch-up.
    blob_writes: u64,
    /// Request body bytes the receiver got, per row.
    body_bytes_per_row: f64,
}

/// Runs one path and adds what the receiver got from it: body bytes per row.
async fn at_receiver(receiver: &ReceiverProcess, rows: i64, run: impl Future<Output = Measured>) -> Measured {
    let (_, before) = receiver.count().await;
    let measured = run.await;
    let (_, after) = receiver.count().await;
    Measured { body_bytes_per_row: (after - before) as f64 / rows as f64, ..measured }
}

/// dbtrigger's catch-up of the table, tick after tick, at its defaults but for the batch size,
/// `maxInFlight` and, where `max_bytes` is given, the batch's and the body's byte limits.
async fn dbtrigger(
    url: &str,
    hook: &str,
    state: &str,
    batch: i64,
    max_in_flight: usize,
    rows: i64,
    max_bytes: Option<usize>,
) -> Measured {
    let (poller, _directory) = bench_poller(url, hook, state, batch, max_in_flight, max_bytes, json!({}));
    let meter = Meter::start();
    let (total, writes) = catch_up(&poller).await;
    assert_eq!(total as i64, rows);
    Measured { blob_writes: writes, ..meter.finish(rows) }
}

/// Ticks until caught up: the rows delivered and the state writes.
async fn catch_up(poller: &Poller) -> (u64, u64) {
    let mut total = 0;
    let mut writes = 0;
    loop {
        let (outcome, report) = poller.tick_reported().await;
        writes += report.blob_writes;
        match outcome.unwrap() {
            TickOutcome::Delivered { rows, stop: StopReason::CaughtUp, .. } => {
                total += rows;
                break;
            }
            TickOutcome::Delivered { rows, .. } => total += rows,
            other => panic!("{other:?}"),
        }
    }
    (total, writes)
}

/// A poller of the bench's table at its defaults but for the batch size, `maxInFlight`, the byte
/// limits (`max_bytes`) and `source.lateArrivals` (`late_arrivals`).
fn bench_poller(
    url: &str,
    hook: &str,
    state: &str,
    batch: i64,
    max_in_flight: usize,
    max_bytes: Option<usize>,
    late_arrivals: serde_json::Value,
) -> (Poller, tempfile::TempDir) {
    let directory = tempfile::tempdir().unwrap();
    let root = directory.path().join("app");
    std::fs::create_dir_all(root.join("orders")).unwrap();
    let mut function = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 * * * * *"}],
        "poller": {
            "source": {"connection": "DB", "table": "orders", "cursor": "version", "pk": ["id"], "lateArrivals": late_arrivals},
            "batch": {"size": batch, "maxInFlight": max_in_flight},
            "sink": {"type": "webhook", "url": hook},
            "state": {"connection": "STATE", "container": format!("b{}", uuid::Uuid::new_v4().simple())}
        }
    });
    if let Some(max_bytes) = max_bytes {
        function["poller"]["batch"]["maxBytes"] = json!(max_bytes);
        function["poller"]["sink"]["maxBodyBytes"] = json!(max_bytes);
    }
    std::fs::write(root.join("orders/function.json"), function.to_string()).unwrap();
    let state =
        if state == "file" { format!("file:{}", directory.path().join("state").display()) } else { state.to_string() };
    let settings = Settings::from_pairs([("DB", url), ("STATE", state.as_str())]);
    let config = PollerConfig::load(&root, "orders", &settings, None).unwrap();
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink = dbtrigger::sink::open(&config.sink).unwrap();
    let (store, _) = dbtrigger::store::open(&config.state).unwrap();
    let poller = Poller::new(config, source, sink, store, Arc::new(SystemClock), "bench".into());
    (poller, directory)
}

/// The late-arrival detector's cost (issue 26): an idle tick (nothing new after the checkpoint:
/// one state read, the seek, and with the detector the recount of its window in one grouped
/// query) with the detector off and on, after a catch-up of a table whose rows all lie in the
/// window (`window` rows: the window's default bound is 100,000 rows). Rounds alternate off and
/// on, `DBTRIGGER_BENCH_IDLE_TICKS` ticks each (default 200); the table shows medians. The
/// catch-up itself is timed too: what keeping the window costs each commit. Returns the rows
/// delivered (to the receiver's count).
async fn late_detector(
    receiver: &ReceiverProcess,
    directory: &std::path::Path,
    azurite: &str,
    rounds: usize,
    only: Option<&str>,
) -> u64 {
    let ticks: u32 = std::env::var("DBTRIGGER_BENCH_IDLE_TICKS").ok().and_then(|text| text.parse().ok()).unwrap_or(200);
    println!();
    println!(
        "late-arrival detector: an idle tick (median of {rounds} rounds of {ticks} ticks) and the catch-up, detector off and on"
    );
    println!(
        "{:<10} {:>8} {:<9} {:>12} {:>12} {:>10} {:>8} {:>7} {:>16} {:>16}",
        "engine",
        "window",
        "state",
        "idle off µs",
        "idle on µs",
        "added µs",
        "added %",
        "on/off",
        "catch-up off s",
        "catch-up on s"
    );
    let mut delivered = 0u64;
    for engine in [Engine::Sqlite, Engine::Postgres, Engine::MariaDb] {
        for window in [1_000i64, 10_000, 100_000] {
            for (state_name, state) in [("file", "file"), ("azurite", azurite)] {
                let path = format!("late detector: {engine:?} {window} rows, {state_name} state");
                if only.is_some_and(|only| !path.contains(only)) {
                    continue;
                }
                let url = table(
                    engine,
                    &directory.join(format!("late-{engine:?}-{window}-{state_name}")),
                    window,
                    SHORT_NOTE,
                )
                .await;
                let mut idle: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
                let mut catch_ups: [f64; 2] = [0.0, 0.0];
                let mut pollers = Vec::new();
                for (index, enabled) in [false, true].into_iter().enumerate() {
                    let (poller, directory) =
                        bench_poller(&url, &receiver.hook(), state, 1000, 1, None, json!({"enabled": enabled}));
                    let started = Instant::now();
                    let (rows, _) = catch_up(&poller).await;
                    catch_ups[index] = started.elapsed().as_secs_f64();
                    assert_eq!(rows as i64, window);
                    delivered += rows;
                    pollers.push((poller, directory));
                }
                for _round in 0..=rounds {
                    for (index, (poller, _)) in pollers.iter().enumerate() {
                        let started = Instant::now();
                        for _ in 0..ticks {
                            let (outcome, report) = poller.tick_reported().await;
                            assert_eq!(outcome.unwrap(), TickOutcome::Idle);
                            assert_eq!(report.late_check == LateCheck::Checked, index == 1, "{report:?}");
                        }
                        idle[index].push(started.elapsed().as_secs_f64() * 1e6 / f64::from(ticks));
                    }
                }
                // The first round warms up.
                let off = median(idle[0][1..].to_vec());
                let on = median(idle[1][1..].to_vec());
                println!(
                    "{:<10} {:>8} {:<9} {:>12.0} {:>12.0} {:>10.0} {:>7.1}% {:>7.3} {:>16.2} {:>16.2}",
                    format!("{engine:?}"),
                    window,
                    state_name,
                    off,
                    on,
                    on - off,
                    100.0 * (on - off) / off,
                    on / off,
                    catch_ups[0],
                    catch_ups[1]
                );
            }
        }
    }
    delivered
}

fn main() {
    if std::env::var_os("DBTRIGGER_BENCH_RECEIVER").is_some() {
        // Named apart from the measured process's threads, for profiles.
        tokio::runtime::Builder::new_multi_thread()
            .thread_name("receiver")
            .enable_all()
            .build()
            .unwrap()
            .block_on(serve_receiver());
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    if std::env::var_os("DBTRIGGER_BENCH_CHILD").is_some() {
        runtime.block_on(run_as_child());
        return;
    }
    runtime.block_on(run());
}

/// One line of the table: a path's runs (one per round) and their ratios to the limit of the
/// same round and window.
struct Line {
    path: String,
    runs: Vec<Measured>,
    ratios: Vec<f64>,
}

impl Line {
    fn new(path: String) -> Line {
        Line { path, runs: Vec::new(), ratios: Vec::new() }
    }

    /// One A-B-A round: this path's run between two runs of `limit`, compared with their mean.
    fn add_round(&mut self, limit: &mut Line, before: Measured, run: Measured, after: Measured) {
        self.ratios.push(2.0 * run.rows_per_second / (before.rows_per_second + after.rows_per_second));
        self.runs.push(run);
        limit.runs.extend([before, after]);
        limit.ratios.extend([1.0, 1.0]);
    }

    fn print(&self, engine: Engine, batch: i64) {
        let of = |field: fn(&Measured) -> f64| median(self.runs.iter().map(field).collect());
        let low = self.ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let high = self.ratios.iter().copied().fold(0.0, f64::max);
        println!(
            "{:<10} {:>6} {:<40} {:>9.0} {:>17} {:>10.2} {:>8.1} {:>6} {:>7.1}",
            format!("{engine:?}"),
            batch,
            self.path,
            of(|run| run.rows_per_second),
            format!("{:.2} ({low:.2}–{high:.2})", median(self.ratios.clone())),
            of(|run| run.cpu_micros_per_row),
            self.runs.iter().map(|run| run.peak_rss_mb).fold(0.0, f64::max),
            self.runs.iter().map(|run| run.blob_writes).max().unwrap_or(0),
            of(|run| run.body_bytes_per_row),
        );
    }
}

async fn run() {
    let number =
        |name: &str, default: i64| std::env::var(name).ok().and_then(|text| text.parse().ok()).unwrap_or(default);
    let rows = number("DBTRIGGER_BENCH_ROWS", 200_000);
    let rounds = number("DBTRIGGER_BENCH_ROUNDS", 3).max(1) as usize;
    let only = std::env::var("DBTRIGGER_BENCH_ONLY").ok();
    let receiver = ReceiverProcess::start();
    let hook = receiver.hook();
    let azurite = services::azurite().connection_string();
    let directory = tempfile::tempdir().unwrap();
    let mut expected = 0u64;
    let mut bars: Vec<chart::Bar> = Vec::new();
    println!(
        "throughput, {rows} rows to a webhook receiver in another process on loopback, {rounds} rounds after one to warm up"
    );
    println!(
        "{:<10} {:>6} {:<40} {:>9} {:>17} {:>10} {:>8} {:>6} {:>7}",
        "engine", "batch", "path", "rows/s", "ratio (min–max)", "cpu µs/row", "peak MB", "PUTs", "B/row"
    );
    for engine in [Engine::Sqlite, Engine::Postgres] {
        let url = table(engine, &directory.path().join(format!("{engine:?}")), rows, SHORT_NOTE).await;
        for batch in [100i64, 1000] {
            let paths: Vec<(String, &str, usize)> = [("file", "file"), ("azurite", azurite.as_str())]
                .into_iter()
                .flat_map(|(state_name, state)| {
                    [1usize, 4].map(|max_in_flight| {
                        (format!("dbtrigger, {state_name} state, maxInFlight {max_in_flight}"), state, max_in_flight)
                    })
                })
                .filter(|(path, ..)| {
                    only.as_ref().is_none_or(|only| format!("{engine:?} {batch} {path}").contains(only.as_str()))
                })
                .collect();
            let windows: Vec<usize> = paths
                .iter()
                .map(|(.., window)| *window)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            let mut limits: Vec<Line> =
                windows.iter().map(|window| Line::new(format!("raw, pipelined, window {window} (limit)"))).collect();
            let mut lines: Vec<Line> = paths.iter().map(|(path, ..)| Line::new(path.clone())).collect();
            // Round 0 warms up (Azurite's JavaScript is compiled as it is first used, the
            // database's pages come into memory) and is not counted.
            for round in 0..=rounds {
                for ((_, state, max_in_flight), line) in paths.iter().zip(&mut lines) {
                    // A-B-A: the raw limit runs just before and just after the path, and the path
                    // is compared with their mean, so that the machine's drift (rows/s move by a
                    // fifth from one minute to the next on this VM) cancels out.
                    let raw = || {
                        at_receiver(&receiver, rows, raw_pipelined(engine, &url, &hook, batch, *max_in_flight, rows))
                    };
                    let before = raw().await;
                    let run = dbtrigger(&url, &hook, state, batch, *max_in_flight, rows, None);
                    let run = at_receiver(&receiver, rows, run).await;
                    let after = raw().await;
                    expected += 3 * rows as u64;
                    if round == 0 {
                        continue;
                    }
                    let limit = &mut limits[windows.iter().position(|window| window == max_in_flight).unwrap()];
                    line.add_round(limit, before, run, after);
                }
            }
            for line in &limits {
                line.print(engine, batch);
            }
            for line in &lines {
                line.print(engine, batch);
            }
            for ((path, _, max_in_flight), line) in paths.iter().zip(&lines) {
                let limit = &limits[windows.iter().position(|window| window == max_in_flight).unwrap()];
                let rows_per_second = |line: &Line| median(line.runs.iter().map(|run| run.rows_per_second).collect());
                bars.push(chart::Bar {
                    group: format!("{}, batch {batch}", engine_name(engine)),
                    label: path.trim_start_matches("dbtrigger, ").to_string(),
                    rows_per_second: rows_per_second(line),
                    limit_rows_per_second: rows_per_second(limit),
                    ratio: median(line.ratios.clone()),
                });
            }
        }
    }
    write_chart(&bars, rows, rounds, only.is_some());
    expected += wide_rows(&receiver, directory.path(), rounds, only.as_deref()).await;
    expected += late_detector(&receiver, directory.path(), &azurite, rounds, only.as_deref()).await;
    assert_eq!(receiver.count().await.0, expected, "every row reached the receiver");
}

fn engine_name(engine: Engine) -> &'static str {
    match engine {
        Engine::Sqlite => "SQLite",
        Engine::Postgres => "PostgreSQL",
        Engine::MariaDb => "MariaDB",
    }
}

/// Writes the chart of `bars` to `DBTRIGGER_BENCH_SVG`, else (for a run of every path) to
/// `docs/throughput.svg`, with when and where it was measured.
fn write_chart(bars: &[chart::Bar], rows: i64, rounds: usize, partial: bool) {
    let path = match std::env::var("DBTRIGGER_BENCH_SVG") {
        Ok(path) => std::path::PathBuf::from(path),
        Err(_) if partial || bars.is_empty() => return,
        Err(_) => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/throughput.svg"),
    };
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split(':').nth(1))
                .map(str::trim)
                .map(String::from)
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map(|cores| cores.get()).unwrap_or(1);
    let caption = format!(
        "cargo bench --bench throughput, {} UTC: {rows} rows to a webhook receiver on loopback, medians of {rounds} rounds; {cores} cores, {cpu}",
        chrono::Utc::now().format("%Y-%m-%d %H:%M"),
    );
    let svg = chart::svg("Rows/s by configuration, against the raw limit of the same run", &caption, bars);
    std::fs::write(&path, svg).unwrap_or_else(|error| panic!("cannot write the chart to {}: {error}", path.display()));
    println!("chart: {}", path.display());
}

/// Memory on wide rows: a catch-up of 10 KB rows at batch 1,000 with four batches in flight
/// (about 40 MB of bodies), dbtrigger with file state between two runs of the raw limit with the
/// same window, as above, each run in a process of its own (this program again), so that its peak
/// RSS is its own: in one process, the allocator keeps what an earlier run freed and the next run
/// reuses it. The peak RSS column is the point; the line after the table says what was in flight.
/// `tests/it/memory.rs` asserts a bound on it, through the real binary. Returns the events sent.
async fn wide_rows(receiver: &ReceiverProcess, directory: &std::path::Path, rounds: usize, only: Option<&str>) -> u64 {
    const BATCH: i64 = 1000;
    const WINDOW: usize = 4;
    let path = format!("10 KB rows: file state, maxInFlight {WINDOW}");
    if only.is_some_and(|only| !format!("{:?} {BATCH} {path}", Engine::Sqlite).contains(only)) {
        return 0;
    }
    let rows: i64 =
        std::env::var("DBTRIGGER_BENCH_WIDE_ROWS").ok().and_then(|text| text.parse().ok()).unwrap_or(36_000);
    // Hex digits: 10,000 bytes of text a row, nothing to escape.
    let url = table(Engine::Sqlite, &directory.join("wide"), rows, "hex(randomblob(5000))").await;
    let hook = receiver.hook();
    let arguments = |path: &str| {
        [path.to_string(), url.clone(), hook.clone(), BATCH.to_string(), WINDOW.to_string(), rows.to_string()]
    };
    let mut limit = Line::new(format!("10 KB rows: raw, window {WINDOW} (limit)"));
    let mut line = Line::new(path);
    for round in 0..=rounds {
        let before = at_receiver(receiver, rows, in_child(arguments("raw"))).await;
        let run = at_receiver(receiver, rows, in_child(arguments("dbtrigger"))).await;
        let after = at_receiver(receiver, rows, in_child(arguments("raw"))).await;
        if round == 0 {
            continue;
        }
        line.add_round(&mut limit, before, run, after);
    }
    limit.print(Engine::Sqlite, BATCH);
    line.print(Engine::Sqlite, BATCH);
    let body_bytes = median(line.runs.iter().map(|run| run.body_bytes_per_row).collect());
    println!(
        "10 KB rows: {:.0} MB of bodies in flight at maxInFlight {WINDOW}, a table of {:.0} MB; each run in a process of its own",
        body_bytes * (BATCH as usize * WINDOW) as f64 / 1e6,
        body_bytes * rows as f64 / 1e6,
    );
    3 * (rounds as u64 + 1) * rows as u64
}

/// Runs one path of `wide_rows` in a child process (`arguments`: raw or dbtrigger, the database,
/// the hook, batch, window, rows) and reads back what it measured.
async fn in_child(arguments: [String; 6]) -> Measured {
    let output = tokio::process::Command::new(std::env::current_exe().unwrap())
        .env("DBTRIGGER_BENCH_CHILD", "1")
        .args(arguments)
        .stderr(Stdio::inherit())
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "a child run failed: {}", output.status);
    let text = String::from_utf8(output.stdout).unwrap();
    let numbers: Vec<f64> = text.split_whitespace().map(|number| number.parse().unwrap()).collect();
    let [rows_per_second, cpu_micros_per_row, peak_rss_mb, blob_writes] = numbers[..] else {
        panic!("a child run printed {text:?}");
    };
    Measured {
        rows_per_second,
        cpu_micros_per_row,
        peak_rss_mb,
        blob_writes: blob_writes as u64,
        body_bytes_per_row: 0.0,
    }
}

/// A child process of `in_child`: one run, its measures printed on one line.
async fn run_as_child() {
    let arguments: Vec<String> = std::env::args().skip(1).collect();
    let [path, url, hook, batch, window, rows] = &arguments[..] else {
        panic!("a child run takes raw|dbtrigger, a database, a hook, batch, window and rows: {arguments:?}");
    };
    let (batch, window, rows) = (batch.parse().unwrap(), window.parse().unwrap(), rows.parse().unwrap());
    let measured = match path.as_str() {
        "raw" => raw_pipelined(Engine::Sqlite, url, hook, batch, window, rows).await,
        "dbtrigger" => dbtrigger(url, hook, "file", batch, window, rows, Some(64 * 1024 * 1024)).await,
        other => panic!("a child run is raw or dbtrigger, not {other:?}"),
    };
    println!(
        "{} {} {} {}",
        measured.rows_per_second, measured.cpu_micros_per_row, measured.peak_rss_mb, measured.blob_writes
    );
}
