//! Throughput with real network latency (issue 27, section 3): the throughput bench's case with
//! the database and the receiver far away. A delaying TCP proxy sits in front of PostgreSQL (2 ms
//! per round trip: 1 ms each way) and another in front of the webhook receiver (20 ms per round
//! trip), and dbtrigger's catch-up is compared with the **pipelined raw limit through the same
//! proxies, in the same run**: the same keyset pages read one after the other on one held
//! connection, running ahead of the posts by up to `window` pages, and up to `window` posts in
//! flight at once (a new one as soon as any finishes and a page is ready); no state, no lease. A-B-A as in
//! `throughput`: the limit runs just before and just after dbtrigger's run, the ratio is to their
//! mean.
//!
//! The arithmetic the table checks: a window of w batches of b rows, each answered in r seconds,
//! moves at most w × b / r rows a second (here b = 100, r ≈ 20 ms: 5,000 rows/s at window 1,
//! 40,000 at window 8), and the reads must keep up: one page per database round trip at least.
//!
//! A second part (`ordered.rs`) times the ordered window (issue 38): 100 keys updated 20 times, a
//! 50 ms receiver, `maxInFlight` 1 and 8, a logical source and a polling one, every key's order
//! checked, and prints the speed-up beside the unordered window's.
//!
//! A third part (`reads.rs`) times the reads alone through the database proxy: raw pages on a held
//! connection or one taken from a pool per page, and dbtrigger's reads with their connection kept
//! or given back after each (where a page's time goes).
//!
//! Run: `cargo bench --bench throughput_latency` (`DBTRIGGER_BENCH_ROWS`, default 20,000;
//! `DBTRIGGER_BENCH_ROUNDS`, default 3; `DBTRIGGER_BENCH_ONLY=latency` runs the first and third
//! parts, `ordered` the second, `reads` the third).

mod common;
#[path = "../tests/it/services.rs"]
mod services;

#[path = "throughput_latency/ordered.rs"]
mod ordered;
#[path = "throughput_latency/reads.rs"]
mod reads;
#[path = "throughput_latency/timed.rs"]
mod timed;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{env_number, median};
use dbtrigger::tick::{Poller, SystemClock};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP proxy on loopback to `upstream` that delays every chunk by `one_way` in each direction,
/// keeping order and letting chunks overlap (latency, not a bandwidth limit). Returns its port.
async fn delaying_proxy(upstream: u16, one_way: Duration) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else { return };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(delayed_copy(client_read, server_write, one_way));
                tokio::spawn(delayed_copy(server_read, client_write, one_way));
            });
        }
    });
    port
}

/// Copies `from` to `to`, each chunk written `delay` after it was read.
async fn delayed_copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    let (sender, mut receiver) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((due, chunk)) = receiver.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    });
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => {
                if sender.send((tokio::time::Instant::now() + delay, buffer[..read].to_vec())).is_err() {
                    break;
                }
            }
        }
    }
    drop(sender);
    let _ = writer.await;
}

/// A receiver that counts events and answers at once (the proxy in front adds the latency).
async fn receiver() -> (u16, Arc<std::sync::atomic::AtomicU64>) {
    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = count.clone();
    let router = axum::Router::new()
        .route(
            "/hook",
            axum::routing::post(move |body: axum::body::Bytes| {
                let counter = counter.clone();
                async move {
                    let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                    let events = value["events"].as_array().map(Vec::len).unwrap_or(0) as u64;
                    counter.fetch_add(events, std::sync::atomic::Ordering::SeqCst);
                    "{}"
                }
            }),
        )
        .layer(axum::extract::DefaultBodyLimit::disable());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (port, count)
}

type RawRow = (i64, i64, String, f64, String);

/// How the raw loop's reads take their connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Connection {
    Held,
    Pooled,
}

/// The pipelined raw limit through the proxies: keyset pages read one after the other on one
/// connection (page k+1 needs page k's last key, as dbtrigger's reads do) by a reader that runs
/// ahead of the posts by up to `window` pages, and up to `window` posts in flight at once: a new
/// post starts as soon as any post finishes and a page is ready. Rows a second.
/// `Connection::Pooled`: each page takes a connection from a pool of 10 and gives it back, as
/// dbtrigger's reads did before a tick kept one across them (sqlx pings a connection as it goes
/// back, one more round trip, so the next page takes another idle one meanwhile).
async fn raw_pipelined(url: &str, hook: &str, batch: i64, window: usize, rows: i64, connection: Connection) -> f64 {
    let connections = match connection {
        Connection::Held => 1,
        Connection::Pooled => 10,
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .test_before_acquire(false)
        .connect(url)
        .await
        .unwrap();
    // Connections to the receiver opened before the clock starts, as dbtrigger's are by its warm-up.
    let client = reqwest::Client::builder().pool_max_idle_per_host(64).build().unwrap();
    let started = Instant::now();
    let (pages, mut ready) = tokio::sync::mpsc::channel::<Vec<RawRow>>(window);
    let reader = tokio::spawn({
        let pool = pool.clone();
        async move {
            // One connection held for the whole read, or (`Pooled`) one taken per page.
            let mut held = match connection {
                Connection::Held => Some(pool.acquire().await.unwrap()),
                Connection::Pooled => None,
            };
            let mut after = (-1i64, -1i64);
            loop {
                let mut taken = match held.take() {
                    Some(connection) => connection,
                    None => pool.acquire().await.unwrap(),
                };
                let page = sqlx::query_as::<_, RawRow>(
                    "SELECT id, version, status, total, note FROM orders WHERE (version, id) > ($1, $2) ORDER BY version, id LIMIT $3",
                )
                .bind(after.0)
                .bind(after.1)
                .bind(batch)
                .fetch_all(&mut *taken)
                .await
                .unwrap();
                if connection == Connection::Held {
                    held = Some(taken);
                }
                let Some(last) = page.last() else { return };
                after = (last.1, last.0);
                if pages.send(page).await.is_err() {
                    return;
                }
            }
        }
    });
    let mut total = 0i64;
    let mut posting = tokio::task::JoinSet::new();
    loop {
        // A full window: wait for any post to finish (finished ones count until joined).
        while posting.len() >= window {
            posting.join_next().await.unwrap().unwrap();
        }
        let Some(current) = ready.recv().await else { break };
        let events: Vec<serde_json::Value> = current
            .iter()
            .map(|(id, version, status, total, note)| {
                json!({"event_id": format!("evt_{id:032}"), "op": "upsert", "cursor": version, "pk": {"id": id},
                       "row": {"id": id, "version": version, "status": status, "total": total, "note": note}})
            })
            .collect();
        let body =
            serde_json::to_vec(&json!({"poller": "orders", "batch_id": "bat_0", "fencing_token": 1, "events": events}))
                .unwrap();
        total += current.len() as i64;
        let request = client.post(hook).header("content-type", "application/json").body(body);
        posting.spawn(async move {
            request.send().await.unwrap().error_for_status().unwrap();
        });
    }
    while let Some(post) = posting.join_next().await {
        post.unwrap();
    }
    reader.await.unwrap();
    assert_eq!(total, rows);
    pool.close().await;
    rows as f64 / started.elapsed().as_secs_f64()
}

/// dbtrigger's catch-up through the proxies: ticks of a poller with file state. Rows a second,
/// and its delivering reads: milliseconds each (mean), the share of the catch-up spent reading,
/// and milliseconds from one read's end to the next one's start (mean).
async fn dbtrigger(url: &str, hook: &str, batch: i64, window: usize, rows: i64) -> (f64, [f64; 3]) {
    let poller = json!({
        "source": {"connection": "DB", "table": "orders", "cursor": "version", "pk": ["id"], "lateArrivals": null},
        "batch": {"size": batch, "maxInFlight": window},
        "sink": {"type": "webhook", "url": hook},
        "state": {"connection": "STATE"}
    });
    let (_directory, config) = common::orders_config(poller, url);
    let times = Arc::new(std::sync::Mutex::new(timed::Times::default()));
    let source =
        Arc::new(timed::Timed { inner: dbtrigger::source::open(&config.source).unwrap(), times: times.clone() });
    let sink = dbtrigger::sink::open(&config.sink).unwrap();
    let (store, _) = dbtrigger::store::open(&config.state).unwrap();
    let poller = Poller::new(config, source, sink, store, Arc::new(SystemClock), "bench".into());
    let (total, seconds) = common::catch_up(&poller).await;
    assert_eq!(total as i64, rows);
    let times = *times.lock().unwrap();
    let reads = f64::from(times.reads.max(1));
    let reading = [
        times.reading.as_secs_f64() * 1000.0 / reads,
        times.reading.as_secs_f64() / seconds,
        times.between.as_secs_f64() * 1000.0 / reads,
    ];
    (rows as f64 / seconds, reading)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

async fn run() {
    let only = std::env::var("DBTRIGGER_BENCH_ONLY").ok();
    if only.as_deref() != Some("ordered") {
        window_limit(only.as_deref() == Some("reads")).await;
    }
    if only.is_none() || only.as_deref() == Some("ordered") {
        ordered::speed_up().await;
    }
}

/// dbtrigger against the raw limit through the proxies, `maxInFlight` 1 and 8; then where a read's
/// time goes (`reads`), or only that.
async fn window_limit(reads_only: bool) {
    let rows = env_number("DBTRIGGER_BENCH_ROWS", 20_000) as i64;
    let rounds = env_number("DBTRIGGER_BENCH_ROUNDS", 3).max(1);
    let batch = 100i64;
    let url = services::postgres().fresh_database().await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, version BIGINT NOT NULL, status TEXT, total DOUBLE PRECISION, note TEXT);
         INSERT INTO orders SELECT x, x / 3, 'paid', x * 1.5, 'order number ' || x FROM generate_series(1, {rows}) AS x;
         CREATE INDEX orders_seek ON orders (version, id);
         ANALYZE orders;"
    )))
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let database_proxy = delaying_proxy(services::postgres().port, Duration::from_millis(1)).await;
    let far_url = url.replace(&format!(":{}/", services::postgres().port), &format!(":{database_proxy}/"));
    if reads_only {
        reads::page_costs(&far_url).await;
        return;
    }
    let (receiver_port, received) = receiver().await;
    let receiver_proxy = delaying_proxy(receiver_port, Duration::from_millis(10)).await;
    let hook = format!("http://127.0.0.1:{receiver_proxy}/hook");
    println!(
        "throughput with latency: PostgreSQL behind a 2 ms round trip, the receiver behind 20 ms; {rows} rows, batch {batch}, \
         {rounds} rounds after one to warm up"
    );
    println!("{:<34} {:>9} {:>9} {:>17} {:>12}", "path", "rows/s", "limit", "ratio (min–max)", "w×b/r");
    let mut expected = 0u64;
    for window in [1usize, 8] {
        let (mut runs, mut limits, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let (mut pooled_runs, mut pooled_ratios) = (Vec::new(), Vec::new());
        let (mut read_ms, mut read_share, mut between_ms) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..=rounds {
            let before = raw_pipelined(&far_url, &hook, batch, window, rows, Connection::Held).await;
            let (run, reading) = dbtrigger(&far_url, &hook, batch, window, rows).await;
            // The raw loop taking a pooled connection per page, as dbtrigger's reads did before
            // they kept theirs.
            let pooled = if window > 1 {
                expected += rows as u64;
                Some(raw_pipelined(&far_url, &hook, batch, window, rows, Connection::Pooled).await)
            } else {
                None
            };
            let after = raw_pipelined(&far_url, &hook, batch, window, rows, Connection::Held).await;
            expected += 3 * rows as u64;
            if round == 0 {
                continue;
            }
            let limit = (before + after) / 2.0;
            runs.push(run);
            read_ms.push(reading[0]);
            read_share.push(reading[1]);
            between_ms.push(reading[2]);
            limits.push(limit);
            ratios.push(run / limit);
            if let Some(pooled) = pooled {
                pooled_runs.push(pooled);
                pooled_ratios.push(pooled / limit);
            }
        }
        let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let high = ratios.iter().copied().fold(0.0, f64::max);
        println!(
            "{:<34} {:>9.0} {:>9.0} {:>17} {:>12.0}",
            format!("dbtrigger, maxInFlight {window}"),
            median(runs),
            median(limits),
            format!("{:.2} ({low:.2}–{high:.2})", median(ratios)),
            window as f64 * batch as f64 / 0.020
        );
        println!(
            "    its reads: {:.2} ms each, {:.0}% of the catch-up reading, {:.2} ms from one read's end to the next's start",
            median(read_ms),
            100.0 * median(read_share),
            median(between_ms)
        );
        if !pooled_runs.is_empty() {
            println!(
                "{:<34} {:>9.0} {:>9} {:>17}",
                format!("raw, pooled connection per page, {window}"),
                median(pooled_runs),
                "",
                format!("{:.2}", median(pooled_ratios))
            );
        }
    }
    assert_eq!(received.load(std::sync::atomic::Ordering::SeqCst), expected, "every row reached the receiver");
    println!();
    reads::page_costs(&far_url).await;
}
