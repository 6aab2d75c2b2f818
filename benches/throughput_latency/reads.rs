//! Where a page's time goes behind the 2 ms proxy (issue 38): the catch-up's reads alone, one
//! after the other, no receiver. Each path reads the whole table in pages of 100 rows, seven
//! rounds (`DBTRIGGER_BENCH_ROUNDS`), and prints the median milliseconds a page:
//!
//! - raw, one held connection: the query alone;
//! - raw, a connection of a pool of 10 taken for each page and given back (sqlx pings a
//!   connection as it goes back to the pool): the wait for a connection, the query, and how many
//!   connections the pool opened;
//! - the same with a pool of 1: the next page waits for that ping;
//! - dbtrigger's source, as a tick reads (its connection kept between the reads);
//! - dbtrigger's source giving its connection back after each read (`end_reads` after each: the
//!   way every read went before the connection was kept).

use std::time::{Duration, Instant};

use dbtrigger::source::FetchLimit;
use serde_json::json;

use super::common::{self, env_number, median};

const PAGE: i64 = 100;

/// Milliseconds a page: waiting for a connection, and the query.
#[derive(Default, Clone, Copy)]
struct PageTimes {
    acquire: f64,
    query: f64,
}

/// The raw keyset read of the whole table on a pool of `connections`: one connection held for
/// all the pages (`held`), or one taken for each. Per page means, and the connections opened.
async fn raw(url: &str, connections: u32, held: bool) -> (PageTimes, u32) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .test_before_acquire(false)
        .connect(url)
        .await
        .unwrap();
    let mut kept = if held { Some(pool.acquire().await.unwrap()) } else { None };
    let (mut acquiring, mut querying, mut pages) = (Duration::ZERO, Duration::ZERO, 0u32);
    let mut after = (-1i64, -1i64);
    loop {
        let started = Instant::now();
        let mut connection = match kept.take() {
            Some(connection) => connection,
            None => pool.acquire().await.unwrap(),
        };
        let acquired = Instant::now();
        let page: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT id, version FROM orders WHERE (version, id) > ($1, $2) ORDER BY version, id LIMIT $3",
        )
        .bind(after.0)
        .bind(after.1)
        .bind(PAGE)
        .fetch_all(&mut *connection)
        .await
        .unwrap();
        querying += acquired.elapsed();
        acquiring += acquired - started;
        if held {
            kept = Some(connection);
        }
        let Some(last) = page.last() else { break };
        after = (last.1, last.0);
        pages += 1;
    }
    let opened = pool.size();
    drop(kept);
    pool.close().await;
    let pages = f64::from(pages.max(1));
    (
        PageTimes { acquire: acquiring.as_secs_f64() * 1000.0 / pages, query: querying.as_secs_f64() * 1000.0 / pages },
        opened,
    )
}

/// dbtrigger's delivering reads of the whole table, one after the other; `give_back`: the
/// source's connection goes back to the pool after each read. Milliseconds a read.
async fn dbtrigger(url: &str, give_back: bool) -> f64 {
    let poller = json!({
        "source": {"connection": "DB", "table": "orders", "cursor": "version", "pk": ["id"], "lateArrivals": null},
        "batch": {"size": PAGE},
        "sink": {"type": "webhook", "url": "http://127.0.0.1:9/unused"},
        "state": {"connection": "STATE"}
    });
    let (_directory, config) = common::orders_config(poller, url);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let limit = FetchLimit { rows: PAGE as usize, bytes: usize::MAX };
    // The pre-flight and the first read's connection, off the clock.
    let mut after = source.fetch_after(None, limit).await.unwrap().rows.last().map(|row| row.position.clone());
    let (started, mut reads) = (Instant::now(), 0u32);
    while let Some(position) = after {
        let fetched = source.fetch_after(Some(&position), limit).await.unwrap();
        if give_back {
            source.end_reads();
        }
        reads += 1;
        after = if fetched.full { fetched.rows.last().map(|row| row.position.clone()) } else { None };
    }
    source.end_reads();
    started.elapsed().as_secs_f64() * 1000.0 / f64::from(reads.max(1))
}

/// Prints the medians of each path over the rounds, `far_url` being behind the proxy.
pub async fn page_costs(far_url: &str) {
    let rounds = env_number("DBTRIGGER_BENCH_ROUNDS", 3).max(1);
    let mut paths: [Vec<f64>; 7] = Default::default();
    let mut opened = Vec::new();
    for round in 0..=rounds {
        let (held, _) = raw(far_url, 1, true).await;
        let (pooled, pool_size) = raw(far_url, 10, false).await;
        let (single, _) = raw(far_url, 1, false).await;
        let kept = dbtrigger(far_url, false).await;
        let given_back = dbtrigger(far_url, true).await;
        if round == 0 {
            continue;
        }
        let values = [held.query, pooled.acquire, pooled.query, single.acquire, single.query, kept, given_back];
        for (path, value) in paths.iter_mut().zip(values) {
            path.push(value);
        }
        opened.push(f64::from(pool_size));
    }
    let [held, pooled_acquire, pooled_query, single_acquire, single_query, kept, given_back] = paths.map(median);
    println!("reads alone behind the 2 ms proxy: ms a page of {PAGE} rows (median of {rounds} rounds)");
    println!("{:<58} {:>8} {:>8} {:>8}", "path", "acquire", "query", "page");
    println!("{:<58} {:>8} {:>8.2} {:>8.2}", "raw, one connection held", "", held, held);
    println!(
        "{:<58} {:>8.2} {:>8.2} {:>8.2}",
        format!("raw, pool of 10, a connection per page ({:.0} opened)", median(opened)),
        pooled_acquire,
        pooled_query,
        pooled_acquire + pooled_query
    );
    println!(
        "{:<58} {:>8.2} {:>8.2} {:>8.2}",
        "raw, pool of 1, a connection per page",
        single_acquire,
        single_query,
        single_acquire + single_query
    );
    println!("{:<58} {:>8} {:>8} {:>8.2}", "dbtrigger's reads, connection kept", "", "", kept);
    println!("{:<58} {:>8} {:>8} {:>8.2}", "dbtrigger's reads, connection given back after each", "", "", given_back);
}
