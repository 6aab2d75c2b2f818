//! Issue 27, section 1: one app, many tables of one small database. Sixty pollers on sixty tables
//! of a server that accepts 30 connections, all invoked at once through the real binary, several
//! rounds: every row arrives, the server never refuses a connection, and the app never holds more
//! connections than its cap (sampled from the server while the ticks run). Then, quiet, it holds
//! none.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{Handler, Receiver};
use crate::{many_pollers, services};

const POLLERS: usize = 60;
const ROUNDS: i64 = 3;
const ROWS_PER_ROUND: i64 = 20;
/// The app's cap per database: well under the server's 30 (with 60 pollers, 2 connections each
/// as before this issue would have been 120).
const CAP: usize = 8;
const SERVER_MAX_CONNECTIONS: u32 = 30;

/// Writes an app root with `POLLERS` pollers `f0`… reading tables `t0`… of `FLEET_DB`.
fn write_app(directory: &Path) -> std::path::PathBuf {
    many_pollers::write_app(directory, "f", POLLERS, |index| {
        json!({
            "source": {"connection": "FLEET_DB", "table": format!("t{index}"), "cursor": "version", "pk": ["id"],
                       "lateArrivals": null},
            "batch": {"size": 7},
            "sink": {"type": "webhook", "url": "%FLEET_WEBHOOK%", "timeoutSeconds": 10},
            "state": {"connection": "FLEET_STATE"}
        })
    })
}

/// What the server reports of the app's connections, one sample.
type Sampler = Box<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = usize> + Send>> + Send + Sync>;

/// Samples `count` every 10 ms until `stop`, keeping the largest.
fn sample_max(count: Arc<Sampler>, stop: Arc<AtomicBool>, max: Arc<AtomicUsize>) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut samples = 0;
        while !stop.load(Ordering::SeqCst) {
            let now = count().await;
            max.fetch_max(now, Ordering::SeqCst);
            samples += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        samples
    })
}

/// The whole scenario on one engine: `insert(table, round)` adds a round's rows to a table,
/// `connections()` counts the app's connections on the server.
async fn fleet_on(url: &str, insert: impl AsyncFn(usize, i64), connections: Arc<Sampler>, engine: &str) {
    let directory = tempfile::tempdir().unwrap();
    let root = write_app(directory.path());
    let receiver = Receiver::start().await;
    let settings = vec![
        ("FLEET_DB".to_string(), url.to_string()),
        ("FLEET_WEBHOOK".to_string(), receiver.url.clone()),
        ("FLEET_STATE".to_string(), format!("file:{}", directory.path().join("state").display())),
        ("DBTRIGGER_APP_NAME".to_string(), format!("fleet-{engine}")),
        ("DBTRIGGER_MAX_CONNECTIONS_PER_DATABASE".to_string(), CAP.to_string()),
    ];
    let handler = Handler::start_binary(Path::new(env!("CARGO_BIN_EXE_dbtrigger")), &root, &settings).await;
    let handler = Arc::new(handler);

    let stop = Arc::new(AtomicBool::new(false));
    let max = Arc::new(AtomicUsize::new(0));
    let sampler = sample_max(connections.clone(), stop.clone(), max.clone());
    let mut lines = Vec::new();
    for round in 0..ROUNDS {
        for table in 0..POLLERS {
            insert(table, round).await;
        }
        // The host fires every timer at once.
        for line in many_pollers::invoke_all(&handler, "f", POLLERS).await {
            assert!(line.contains("outcome=caught-up"), "{engine} round {round}: {line}");
            lines.push(line);
        }
    }
    stop.store(true, Ordering::SeqCst);
    let samples = sampler.await.unwrap();
    let most = max.load(Ordering::SeqCst);

    // Every row of every table, once per poller at least, none missing.
    let mut by_poller: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
    for received in receiver.acknowledged() {
        many_pollers::record_ids(&mut by_poller, &received.envelope);
    }
    let expected: BTreeSet<i64> = (1..=ROUNDS * ROWS_PER_ROUND).collect();
    assert_eq!(by_poller.len(), POLLERS, "{engine}: pollers that delivered");
    for (poller, ids) in &by_poller {
        assert_eq!(ids, &expected, "{engine}: {poller}");
    }
    let log = handler.log();
    assert!(!log.contains("too many") && !log.contains("Too many"), "{engine}: {log}");
    // The app never held more than its cap; it did use connections (the sampler saw them).
    assert!(samples > 10, "{engine}: only {samples} samples");
    assert!((1..=CAP).contains(&most), "{engine}: at most {most} connections at once, the cap is {CAP}");
    // Sixty pollers on eight connections: some ticks waited, and their summary line says so.
    let waited = many_pollers::assert_some_waited(&lines, "connection_wait_ms", "ms for a database connection", engine);
    eprintln!("{engine}: at most {most} connections (cap {CAP}), {} of {} ticks waited", waited.len(), lines.len());

    // Quiet, the app closes its idle connections (after IDLE_CLOSE, checked by the pool's reaper
    // as often).
    let idle_close = dbtrigger::source::pools::IDLE_CLOSE;
    let started = Instant::now();
    loop {
        let now = connections().await;
        if now == 0 {
            break;
        }
        assert!(started.elapsed() < idle_close * 2 + Duration::from_secs(5), "{engine}: {now} connections still open");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_pollers_share_a_capped_pool_of_one_postgres() {
    let server = services::postgres_with_max_connections(SERVER_MAX_CONNECTIONS);
    let url = server.fresh_database().await;
    let admin = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&url).await.unwrap();
    for table in 0..POLLERS {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE t{table} (id bigint PRIMARY KEY, version bigint NOT NULL, note text NOT NULL); \
             CREATE INDEX t{table}_seek ON t{table} (version, id)"
        )))
        .execute(&admin)
        .await
        .unwrap();
    }
    let database: String = sqlx::query_scalar("SELECT current_database()").fetch_one(&admin).await.unwrap();
    let insert = {
        let admin = admin.clone();
        async move |table: usize, round: i64| {
            let first = round * ROWS_PER_ROUND + 1;
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO t{table} SELECT g, g, 'row ' || g FROM generate_series({first}, {}) g",
                first + ROWS_PER_ROUND - 1
            )))
            .execute(&admin)
            .await
            .unwrap();
        }
    };
    let counter = admin.clone();
    let connections: Sampler = Box::new(move || {
        let counter = counter.clone();
        let database = database.clone();
        Box::pin(async move {
            let count: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = 'dbtrigger'",
            )
            .bind(database)
            .fetch_one(&counter)
            .await
            .unwrap();
            count as usize
        })
    });
    fleet_on(&url, insert, Arc::new(connections), "postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_pollers_share_a_capped_pool_of_one_mariadb() {
    let server = services::mariadb_with_max_connections(SERVER_MAX_CONNECTIONS);
    let url = server.fresh_database().await;
    // One connection: the sampler tells its own apart by its id.
    let admin = sqlx::mysql::MySqlPoolOptions::new().max_connections(1).connect(&url).await.unwrap();
    for table in 0..POLLERS {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE t{table} (id bigint PRIMARY KEY, version bigint NOT NULL, note text NOT NULL, \
             INDEX t{table}_seek (version, id))"
        )))
        .execute(&admin)
        .await
        .unwrap();
    }
    let database: String = sqlx::query_scalar("SELECT DATABASE()").fetch_one(&admin).await.unwrap();
    let insert = {
        let admin = admin.clone();
        async move |table: usize, round: i64| {
            let first = round * ROWS_PER_ROUND + 1;
            let values: Vec<String> =
                (first..first + ROWS_PER_ROUND).map(|id| format!("({id}, {id}, 'row {id}')")).collect();
            sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO t{table} VALUES {}", values.join(", "))))
                .execute(&admin)
                .await
                .unwrap();
        }
    };
    let counter = admin.clone();
    let connections: Sampler = Box::new(move || {
        let counter = counter.clone();
        let database = database.clone();
        Box::pin(async move {
            let mut connection = counter.acquire().await.unwrap();
            let count: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM information_schema.PROCESSLIST WHERE DB = ? AND ID <> CONNECTION_ID()",
            )
            .bind(&database)
            .fetch_one(&mut *connection)
            .await
            .unwrap();
            count as usize
        })
    });
    fleet_on(&url, insert, Arc::new(connections), "mariadb").await;
}
