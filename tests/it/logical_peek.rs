//! The logical source's read-ahead (issue 29, throughput): a tick peeks the slot for many batches'
//! worth of changes at once and hands batches out of memory; when a tick needs more than one peek,
//! the next peek starts again where the slot is and counts, without decoding, what was read before.
//! On a real PostgreSQL with `wal_level=logical`: changes several peeks long, in transactions of
//! every size (one longer than a whole peek), delivered with batches in flight, arrive exactly as a
//! raw peek of the same slot decodes them: none lost, none repeated, in commit order. Whether the
//! slot moves between the peeks (a commit after every acknowledgement) or not (one commit a second),
//! the result is the same.

use std::sync::Arc;

use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::source::logical::changes::{Assembler, event_row};
use dbtrigger::source::logical::values::parse_lsn;
use dbtrigger::source::logical::{READ_AHEAD_BYTES, read_ahead_rows};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{StopReason, TickOutcome};
use serde_json::{Value, json};
use sqlx::Row;

use crate::harness::AppRoot;
use crate::logical::{confirmed_flush, drop_slot, logical_database, poller};
use crate::sources::execute;

/// (commit LSN, ordinal, op, the event's row) of every change the slot holds, decoded from one
/// unbounded peek: the reference; and how many rows that peek returned.
async fn reference(url: &str, slot: &str) -> (Vec<(u64, u32, String, Value)>, usize) {
    let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(url).await.unwrap();
    sqlx::raw_sql("SET TimeZone = 'UTC'; SET extra_float_digits = 3").execute(&mut connection).await.unwrap();
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, NULL, \
         'proto_version', '1', 'publication_names', 'feed')"
    )))
    .fetch_all(&mut connection)
    .await
    .unwrap();
    let mut assembler = Assembler::default();
    let mut changes = Vec::new();
    for row in &rows {
        let lsn = parse_lsn(&row.get::<String, _>(0)).unwrap();
        if let Some(transaction) = assembler.push(lsn, row.get::<&[u8], _>(1)).unwrap() {
            for change in &transaction.changes {
                let op = json!(change.op).as_str().unwrap().to_string();
                changes.push((transaction.commit_lsn, change.ordinal, op, json!(event_row(&transaction, change))));
            }
        }
    }
    (changes, rows.len())
}

fn config(
    directory: &std::path::Path,
    url: &str,
    slot: &str,
    commit_interval_ms: u64,
    in_flight: usize,
) -> PollerConfig {
    let app = AppRoot::write(
        directory,
        json!({
            "source": {"kind": "logical", "connection": "FEED_DB", "slot": slot, "publication": "feed"},
            "batch": {"size": 10, "maxInFlight": in_flight, "commitIntervalMs": commit_interval_ms},
            "sink": {"type": "webhook", "url": "http://127.0.0.1:9/unused"},
            "state": {"connection": "STATE"}
        }),
    );
    let state = format!("file:{}", app.state_dir.display());
    let settings =
        Settings::from_pairs([("FEED_DB", url), ("STATE", state.as_str()), ("DBTRIGGER_APP_NAME", &app.app_name)]);
    PollerConfig::load(&app.root, "orders", &settings, None).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_that_reads_several_peeks_worth_with_batches_in_flight_loses_and_repeats_nothing() {
    let (url, slot) = logical_database(
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT);\nCREATE TABLE lines (id BIGINT PRIMARY KEY)",
        "orders, lines",
    )
    .await;
    // A second slot, made before any change: it sees the same changes as the first.
    let other = format!("{slot}_b");
    execute(&url, &format!("SELECT pg_create_logical_replication_slot('{other}', 'pgoutput')")).await;
    // Transactions of 1 to 13 changes (inserts, updates, deletes, across two tables), one of 3,000
    // inserts (longer than a whole peek: read whole), a truncate, and more small ones after it.
    execute(
        &url,
        "DO $$ BEGIN FOR i IN 0..599 LOOP \
           INSERT INTO orders SELECT i * 100 + g, 'new' FROM generate_series(1, 1 + i % 7) g; \
           UPDATE orders SET note = 'paid' WHERE id = i * 100 + 1; \
           IF i % 3 = 0 THEN DELETE FROM orders WHERE id = i * 100 + 1; END IF; \
           INSERT INTO lines SELECT i * 100 + g FROM generate_series(1, i % 5) g; \
           COMMIT; END LOOP; END $$;\n\
         INSERT INTO lines SELECT 100000 + g FROM generate_series(1, 3000) g;\n\
         TRUNCATE lines;\n\
         DO $$ BEGIN FOR i IN 0..99 LOOP \
           UPDATE orders SET note = 'shipped' WHERE id BETWEEN i * 100 + 1 AND i * 100 + 3; COMMIT; END LOOP; END $$",
    )
    .await;
    let (expected, rows) = reference(&url, &slot).await;
    // The precondition: a tick needs several peeks (batches of 10 read 2,560 rows ahead).
    assert!(rows > 3 * read_ahead_rows(10), "{rows} rows: not several peeks' worth");
    assert!(expected.len() > 7000, "{}", expected.len());

    // One batch in flight while the next is read and one commit a second (the slot stays where it
    // was while the tick reads): the receiver gets the changes in commit order. Four in flight
    // and a commit after every acknowledgement (the slot moves between the peeks): batches may
    // arrive in any order, each change once.
    for (slot, commit_interval_ms, in_flight) in [(slot.as_str(), 1000, 1), (other.as_str(), 0, 4)] {
        let directory = tempfile::tempdir().unwrap();
        let config = config(directory.path(), &url, slot, commit_interval_ms, in_flight);
        let source = dbtrigger::source::open(&config.source).unwrap();
        let (poller, sink) = poller(config, source, Arc::new(MemoryStore::new()));
        let outcome = poller.tick().await.unwrap();
        assert!(matches!(outcome, TickOutcome::Delivered { stop: StopReason::CaughtUp, .. }), "{outcome:?}");
        let mut delivered: Vec<(u64, u32, String, Value)> = sink
            .batches()
            .iter()
            .flat_map(|batch| batch.events.iter())
            .map(|event| {
                let value = event.to_value();
                let ordinal = value["pk"]["ordinal"].as_u64().unwrap() as u32;
                (
                    value["cursor"].as_u64().unwrap(),
                    ordinal,
                    value["op"].as_str().unwrap().to_string(),
                    value["row"].clone(),
                )
            })
            .collect();
        assert_eq!(delivered.len(), expected.len(), "commit interval {commit_interval_ms} ms");
        if in_flight > 1 {
            delivered.sort_by_key(|(commit_lsn, ordinal, _, _)| (*commit_lsn, *ordinal));
        }
        if let Some(at) = (0..expected.len()).find(|at| delivered[*at] != expected[*at]) {
            panic!(
                "commit interval {commit_interval_ms} ms: change {at} differs from the slot's: {:?} != {:?}",
                delivered[at], expected[at]
            );
        }
        assert!(sink.batches().iter().all(|batch| batch.events.len() <= 10));
        // Caught up: the slot is past the last commit, and the next tick finds nothing.
        assert!(confirmed_flush(&url, slot).await > expected.last().unwrap().0);
        assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle));
    }
    drop_slot(&url, &other).await;
    drop_slot(&url, &slot).await;
}

/// Rows so wide that a peek's read-ahead bytes end before its rows do: the peek keeps whole
/// transactions up to the bound, and what is past it is read by the next peek, not lost (the
/// slot never moves past what was not handed out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peek_that_stops_at_its_byte_bound_leaves_the_rest_for_the_next() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY, body TEXT)", "orders").await;
    // 32 transactions of one row of about 1 MB each.
    execute(
        &url,
        "DO $$ BEGIN FOR i IN 1..32 LOOP \
           INSERT INTO orders SELECT i, string_agg(md5((i * 100000 + g)::text), '') FROM generate_series(1, 32000) g; \
           COMMIT; END LOOP; END $$",
    )
    .await;
    let (expected, _) = reference(&url, &slot).await;
    let bytes: usize = expected.iter().map(|(_, _, _, row)| row.to_string().len()).sum();
    assert!(bytes > 3 * READ_AHEAD_BYTES / 2, "{bytes} bytes: within one peek's bound");
    let directory = tempfile::tempdir().unwrap();
    let config = config(directory.path(), &url, &slot, 1000, 1);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (poller, sink) = poller(config, source, Arc::new(MemoryStore::new()));
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { stop: StopReason::CaughtUp, .. }), "{outcome:?}");
    let ids: Vec<i64> = sink
        .batches()
        .iter()
        .flat_map(|batch| batch.events.iter())
        .map(|event| event.to_value()["row"]["new"]["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, (1..=32).collect::<Vec<i64>>());
    assert!(confirmed_flush(&url, &slot).await > expected.last().unwrap().0);
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle));
    drop_slot(&url, &slot).await;
}

/// The backends (pid, start time) of the idle connections to `url`'s database whose last
/// statement was a peek (or the drop of a look's copy of the slot, after its peek).
async fn idle_peek_backends(url: &str) -> Vec<(i32, String)> {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let backends: Vec<(i32, String)> = sqlx::query_as(
        "SELECT pid, backend_start::text FROM pg_stat_activity WHERE state = 'idle' \
         AND (query LIKE '%pg_logical_slot_peek_binary_changes%' OR query LIKE 'SELECT pg_drop_replication_slot($1)') \
         AND query NOT LIKE '%pg_stat_activity%' \
         AND datname = current_database()",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    pool.close().await;
    backends
}

/// A peek read to its end keeps its connection for the next peek (no new backend a tick: a fork,
/// an authentication, cold catalog caches); a kept connection the server ended is replaced, and
/// the tick that finds it so delivers as any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peeks_connection_is_kept_from_tick_to_tick_and_replaced_when_the_server_ended_it() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY)", "orders").await;
    let directory = tempfile::tempdir().unwrap();
    let config = config(directory.path(), &url, &slot, 1000, 1);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (poller, sink) = poller(config, source, Arc::new(MemoryStore::new()));
    let delivered = |sink: &dbtrigger::sink::recording::RecordingSink| -> Vec<i64> {
        sink.batches()
            .iter()
            .flat_map(|batch| batch.events.iter().map(|event| event.row()["new"]["id"].as_i64().unwrap()))
            .collect()
    };
    let mut expected = Vec::new();
    let mut backends = Vec::new();
    for round in 0..3i64 {
        execute(
            &url,
            &format!("INSERT INTO orders SELECT g FROM generate_series({}, {}) g", round * 25 + 1, round * 25 + 25),
        )
        .await;
        expected.extend(round * 25 + 1..=round * 25 + 25);
        while !matches!(poller.tick().await.unwrap(), TickOutcome::Idle) {}
        assert_eq!(delivered(&sink), expected, "round {round}");
        let kept = idle_peek_backends(&url).await;
        assert_eq!(kept.len(), 1, "one kept peek connection after round {round}: {kept:?}");
        backends.push(kept[0].clone());
        if round == 1 {
            // The server ends the kept backend (a restart, an administrator, an idle limit).
            execute(&url, &format!("SELECT pg_terminate_backend({})", kept[0].0)).await;
        }
    }
    assert_eq!(backends[0], backends[1], "the same backend served the ticks of rounds 0 and 1");
    assert_ne!(backends[1], backends[2], "the ended backend was replaced");
    // A look (status's count) reads a temporary copy of the slot on the kept connection: the copy
    // is dropped before the connection is kept again, so that it holds no WAL meanwhile.
    execute(&url, "INSERT INTO orders VALUES (1000), (1001)").await;
    let health = dbtrigger::status::of_poller("orders", &poller, chrono::Utc::now()).await;
    assert_eq!(health.lag_rows, Some(2), "{:?}", health.problems);
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let copies: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'dbtrigger_look_%'")
            .fetch_one(&pool)
            .await
            .unwrap();
    pool.close().await;
    assert_eq!(copies, 0, "no copy of the slot outlives its look");
    assert_eq!(idle_peek_backends(&url).await.len(), 1, "the look's connection is kept");
    drop_slot(&url, &slot).await;
}
