//! The logical source at the sizes people choose it for (issue 37), on a real PostgreSQL with
//! `wal_level=logical`: one transaction of a million changes goes through the real binary in
//! bounded memory, a SIGKILL half-way resumes at the next ordinal, and a transaction larger than a
//! peek's old read-ahead never stalls the slot. Run once (not per engine): they are the large cases.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dbtrigger::operations::reset::{self, ResetTo};
use dbtrigger::operations::{Applied, Operator, Parts, apply};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{StopReason, TickOutcome};
use serde_json::json;

use crate::harness::{AppRoot, peak_kib};
use crate::logical::{confirmed_flush, drop_slot, logical_app, logical_database, poller};
use crate::sources::execute;

/// What an order-checking receiver saw: events, the last (commit LSN, ordinal) acknowledged, and
/// how many events came at or before the last one acknowledged before them (repeats).
#[derive(Default)]
struct Seen {
    events: AtomicU64,
    repeats: AtomicU64,
    last: Mutex<(u64, u64)>,
    /// Events that skipped ahead of the next ordinal of their transaction (a loss).
    gaps: AtomicU64,
}

/// A webhook receiver that keeps no event: it counts them and checks they come in (commit LSN,
/// ordinal) order, each ordinal right after the last.
async fn ordered_receiver() -> (String, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let state = seen.clone();
    let router = axum::Router::new()
        .route(
            "/hook",
            axum::routing::post(move |body: axum::body::Bytes| {
                let seen = state.clone();
                async move {
                    let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                    let mut last = seen.last.lock().unwrap();
                    for event in value["events"].as_array().into_iter().flatten() {
                        let key = (event["cursor"].as_u64().unwrap(), event["pk"]["ordinal"].as_u64().unwrap());
                        seen.events.fetch_add(1, Ordering::SeqCst);
                        if key <= *last {
                            seen.repeats.fetch_add(1, Ordering::SeqCst);
                            continue;
                        }
                        if key.0 == last.0 && key.1 != last.1 + 1 || key.0 != last.0 && key.1 != 1 {
                            seen.gaps.fetch_add(1, Ordering::SeqCst);
                        }
                        *last = key;
                    }
                    "{}"
                }
            }),
        )
        .layer(axum::extract::DefaultBodyLimit::disable());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, seen)
}

/// `dbtrigger tick orders` as a process; its peak memory sampled every 50 ms until it ends, or
/// until `kill_when` holds (then SIGKILL). Returns (ended on its own, success, peak KiB).
async fn tick_process(
    app: &AppRoot,
    settings: &[(String, String)],
    kill_when: impl Fn() -> bool,
) -> (bool, bool, u64, String) {
    // DBTRIGGER_BIN: a copy of the binary under test, where several worktrees share one target
    // directory (its `dbtrigger` is whichever built last).
    let binary = std::env::var("DBTRIGGER_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dbtrigger").to_string());
    let mut child = Command::new(binary)
        .args(["tick", "orders", "--app-root"])
        .arg(&app.root)
        .envs(settings.iter().map(|(key, value)| (key.as_str(), value.as_str())))
        .env_remove("FUNCTIONS_APP_ROOT_PATH")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut peak = 0;
    let started = Instant::now();
    loop {
        if let Some(kib) = peak_kib(pid) {
            peak = peak.max(kib);
        }
        if let Some(status) = child.try_wait().unwrap() {
            let output = child.wait_with_output().unwrap();
            let text =
                format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
            return (true, status.success(), peak, text);
        }
        if kill_when() {
            child.kill().unwrap();
            child.wait().unwrap();
            return (false, false, peak, String::new());
        }
        assert!(started.elapsed() < Duration::from_secs(600), "the tick ran for ten minutes");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn app(directory: &std::path::Path, url: &str, slot: &str, receiver: &str) -> (AppRoot, Vec<(String, String)>) {
    let app = AppRoot::write(
        directory,
        json!({
            "source": {"kind": "logical", "connection": "FEED_DB", "slot": slot, "publication": "feed"},
            "batch": {"size": 2000, "maxInFlight": 1, "commitIntervalMs": 1000, "tickBudgetSeconds": 500},
            "sink": {"type": "webhook", "url": receiver},
            "state": {"connection": "STATE"}
        }),
    );
    let settings = vec![
        ("FEED_DB".to_string(), url.to_string()),
        ("STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];
    (app, settings)
}

/// The size of the large transaction: inserts, then a DELETE of all of them.
const HALF: u64 = 500_000;

/// One transaction of a million changes (500,000 inserts of 100-byte rows, then a DELETE of all
/// of them) through the real binary: a tick SIGKILLed half-way, the next resumes after the last
/// change committed (the repeats at most one commit interval's worth), nothing is lost, all
/// arrive in (commit LSN, ordinal) order, each tick's peak RSS stays under 160 MiB, and the slot
/// moves past the transaction once it is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_change_transaction_arrives_in_order_in_bounded_memory_through_a_sigkill() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY, body TEXT)", "orders").await;
    let started = Instant::now();
    execute(
        &url,
        // One query string of two statements: one transaction (`execute` splits at ";\n" only).
        &format!("INSERT INTO orders SELECT g, repeat('x', 100) FROM generate_series(1, {HALF}) g; DELETE FROM orders"),
    )
    .await;
    execute(&url, "INSERT INTO orders VALUES (0, 'after')").await;
    let made = started.elapsed();
    let (receiver, seen) = ordered_receiver().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings) = app(directory.path(), &url, &slot, &receiver);
    let slot_before = confirmed_flush(&url, &slot).await;

    let half = seen.clone();
    let (ended, _, first_peak, output) =
        tick_process(&app, &settings, || half.events.load(Ordering::SeqCst) >= HALF).await;
    assert!(!ended, "the tick ended before half of the transaction was delivered: {output}");
    // A request the killed process had sent whole may still be handled after the kill (CI saw a
    // batch land after `last` was read): wait until the receiver has been quiet for a second.
    let mut quiet = (seen.events.load(Ordering::SeqCst), Instant::now());
    while quiet.1.elapsed() < Duration::from_secs(1) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let events = seen.events.load(Ordering::SeqCst);
        if events != quiet.0 {
            quiet = (events, Instant::now());
        }
    }
    let before_kill = quiet.0;
    assert_eq!(seen.repeats.load(Ordering::SeqCst), 0);
    // The killed tick's lease is let expire (as a minute would): the next tick may start.
    let state = app.state_dir.join(format!("state/{}/orders.json", app.app_name));
    let mut document: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    let committed = document["checkpoint"]["cursor"]["tiebreaker"]["ordinal"].as_u64().unwrap();
    let last_received = seen.last.lock().unwrap().1;
    document["lease"]["expires_at"] = json!(chrono::Utc::now() - chrono::Duration::minutes(5));
    std::fs::write(&state, serde_json::to_vec_pretty(&document).unwrap()).unwrap();

    let (ended, ok, second_peak, output) = tick_process(&app, &settings, || false).await;
    assert!(ended && ok, "{output}");
    let took = started.elapsed();
    let repeats = seen.repeats.load(Ordering::SeqCst);
    eprintln!(
        "1M-change transaction: made in {made:?}, delivered in {:?}; peaks {} KiB and {} KiB; {} events before \
         the kill, {repeats} repeated after it; the second tick said: {output}",
        took - made,
        first_peak,
        second_peak,
        before_kill
    );
    assert_eq!(seen.gaps.load(Ordering::SeqCst), 0, "a change was skipped");
    assert_eq!(seen.last.lock().unwrap().1, 1, "the last change is the one-change transaction after it");
    assert_eq!(seen.events.load(Ordering::SeqCst) - repeats, 2 * HALF + 1, "every change, once");
    // The next tick resumes right after the last change committed: what was delivered after it
    // (at most one commit interval's worth, 1 s) comes again, nothing else.
    assert_eq!(repeats, last_received - committed, "resumed after ordinal {committed}");
    assert!(first_peak < 160 * 1024 && second_peak < 160 * 1024, "peaks {first_peak} KiB, {second_peak} KiB");
    assert!(confirmed_flush(&url, &slot).await > slot_before, "the slot moved past the transaction");
    drop_slot(&url, &slot).await;
}

/// Wide rows (600 changes of 256 KiB, one transaction): what a peek reads ahead is bounded in
/// bytes as well as in changes (chunks of at most 128 changes or about 1 MiB of pgoutput, at most 16 MiB
/// of pgoutput in the channel: the last bound is pinned by
/// `source::logical::peek::tests::a_chunk_waits_for_room_in_the_channels_bytes`), so that the
/// handler's memory does not grow with the width of the rows it reads ahead, only with what one
/// chunk and the batches in flight hold. Every change arrives once, in order, and the peak stays
/// under 200 MiB. Measured 2026-11-27: 139-141 MiB; 494 MiB with the channel bounded by its count
/// alone (2,048 changes, as before the byte bounds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wide_changes_are_read_ahead_within_the_channels_bytes() {
    const CHANGES: u64 = 600;
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY, body TEXT)", "orders").await;
    execute(
        &url,
        &format!("INSERT INTO orders SELECT g, repeat(md5(g::text), 8192) FROM generate_series(1, {CHANGES}) g"),
    )
    .await;
    let (receiver, seen) = ordered_receiver().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings) = app(directory.path(), &url, &slot, &receiver);
    let (ended, ok, peak, output) = tick_process(&app, &settings, || false).await;
    assert!(ended && ok, "{output}");
    eprintln!("{CHANGES} changes of 256 KiB: peak {peak} KiB");
    assert_eq!(seen.gaps.load(Ordering::SeqCst), 0, "a change was skipped");
    assert_eq!((seen.events.load(Ordering::SeqCst), seen.repeats.load(Ordering::SeqCst)), (CHANGES, 0));
    assert!(peak < 200 * 1024, "peak {peak} KiB");
    drop_slot(&url, &slot).await;
}

/// Regression (issue 37, finding 1): a transaction larger than a peek's read-ahead (16 MiB then),
/// with the checkpoint inside it and the slot before it (a restart, or a reset whose own move
/// failed), was peeked again and again until the tick's timeout, and the slot never moved. Now the
/// rest of it arrives, then what follows, and the slot moves past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_over_the_read_ahead_with_the_checkpoint_inside_it_never_stalls_the_slot() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY, body TEXT)", "orders").await;
    // About 40 MB of pgoutput in one transaction, then two small ones.
    execute(
        &url,
        "INSERT INTO orders SELECT g, repeat(md5(g::text), 12) FROM generate_series(1, 80000) g;\n\
         INSERT INTO orders VALUES (100001, 'a');\nINSERT INTO orders VALUES (100002, 'b')",
    )
    .await;
    let commit_lsn: u64 = {
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, 1, \
             'proto_version', '1', 'publication_names', 'feed')"
        )))
        .fetch_all(&pool)
        .await
        .unwrap();
        pool.close().await;
        let commit = rows.iter().rev().find(|(_, data)| data[0] == b'C').unwrap();
        u64::from_be_bytes(commit.1[2..10].try_into().unwrap())
    };
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) = logical_app(directory.path(), &url, &slot, 500);
    let store = Arc::new(MemoryStore::new());
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (poller, sink) = poller(config, source, store.clone());
    // The checkpoint half-way through it, the slot before it: only the document is written.
    let operator = Operator { who: "it@test", force: false, reason: None };
    let to = ResetTo::Cursor { value: commit_lsn.to_string(), keys: vec![("ordinal".into(), "40000".into())] };
    let plan = reset::plan(Parts::of(&poller), &to, operator).await.unwrap();
    let slot_before = confirmed_flush(&url, &slot).await;
    assert!(matches!(apply(store.as_ref(), &plan).await.unwrap(), Applied::Written(_)));
    assert!(slot_before < commit_lsn);

    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { stop: StopReason::CaughtUp, .. }), "{outcome:?}");
    let ids: Vec<i64> = sink
        .batches()
        .iter()
        .flat_map(|batch| batch.events.iter())
        .map(|event| event.to_value()["row"]["new"]["id"].as_i64().unwrap())
        .collect();
    let expected: Vec<i64> = (40001..=80000).chain([100001, 100002]).collect();
    assert_eq!(ids.len(), expected.len());
    assert!(ids == expected, "the rest of the transaction, then what follows, in order");
    assert!(confirmed_flush(&url, &slot).await > commit_lsn, "the slot moved past the large transaction");
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Idle));
    drop_slot(&url, &slot).await;
}

/// Regression (issue 37, finding 2): `reset --to-cursor` took a commit LSN past the end of the
/// WAL (the server moved the slot to the end, and every change committed before the checkpoint's
/// LSN was skipped silently), and a number above i64::MAX became a negative cursor. Both are
/// refused, the slot stays, and what comes after arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_refuses_a_commit_lsn_past_the_end_of_the_wal() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY)", "orders").await;
    let receiver = crate::harness::Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings) = crate::logical_reset::receiving_app(directory.path(), &url, &slot, &receiver);
    execute(&url, "INSERT INTO orders VALUES (1)").await;
    let (ok, stdout, stderr) = crate::harness::run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    let slot_before = confirmed_flush(&url, &slot).await;
    for cursor in ["FFFFFF/0", "9223372036854775808", "18446744073709551615"] {
        let (ok, stdout, stderr) = crate::harness::run_dbtrigger(
            &app,
            &settings,
            &["reset", "orders", "--to-cursor", cursor, "--pk", "ordinal=0", "--yes"],
        );
        assert!(!ok, "{cursor}: {stdout}");
        assert!(stderr.contains("past the end of the WAL") || stderr.contains("above the largest"), "{stderr}");
    }
    assert_eq!(confirmed_flush(&url, &slot).await, slot_before, "the slot stays");
    execute(&url, "INSERT INTO orders SELECT generate_series(2, 11)").await;
    let (ok, stdout, stderr) = crate::harness::run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    assert_eq!(crate::logical_reset::received_ids(&receiver), (1..=11).collect::<Vec<i64>>());
    drop_slot(&url, &slot).await;
}

/// Regression (issue 37, finding 3): values PostgreSQL takes and chrono does not (`time
/// '24:00:00'`, years past 9999, BC dates and timestamps) made every tick fail on the same change
/// for good. They arrive: dates and timestamps as the polling source writes chrono's values,
/// `24:00:00` as PostgreSQL writes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_chrono_cannot_read_no_longer_stop_the_poller() {
    let (url, slot) = logical_database(
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, t TIME, d DATE, ts TIMESTAMP, tz TIMESTAMPTZ)",
        "orders",
    )
    .await;
    execute(
        &url,
        "INSERT INTO orders VALUES \
           (1, '24:00:00', '10000-01-01', '10000-01-01 10:00:00', '10000-01-01 10:00:00+00'), \
           (2, '23:59:59.5', '0044-03-15 BC', '0044-03-15 12:00:00 BC', '0044-03-15 12:00:00+00 BC')",
    )
    .await;
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) = logical_app(directory.path(), &url, &slot, 10);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (poller, sink) = poller(config, source, Arc::new(MemoryStore::new()));
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 2, .. }), "{outcome:?}");
    let rows: Vec<serde_json::Value> = sink
        .batches()
        .iter()
        .flat_map(|batch| batch.events.iter())
        .map(|event| event.to_value()["row"]["new"].clone())
        .collect();
    assert_eq!(
        rows,
        vec![
            json!({"id": 1, "t": "24:00:00", "d": "+10000-01-01", "ts": "+10000-01-01T10:00:00",
                   "tz": "+10000-01-01T10:00:00Z"}),
            json!({"id": 2, "t": "23:59:59.500", "d": "-0043-03-15", "ts": "-0043-03-15T12:00:00",
                   "tz": "-0043-03-15T12:00:00Z"}),
        ]
    );
    drop_slot(&url, &slot).await;
}

/// Regression (issue 37, findings 4 and 5): `status` counted a logical poller's lag by decoding up
/// to 100,000 changes into memory, and showed the capped count as exact. It counts by tag now,
/// and says "≥ 100,000".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_a_logical_lag_past_the_count_cap_as_at_least() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY)", "orders").await;
    let receiver = crate::harness::Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings) = crate::logical_reset::receiving_app(directory.path(), &url, &slot, &receiver);
    execute(&url, "INSERT INTO orders VALUES (0)").await;
    let (ok, stdout, stderr) = crate::harness::run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    execute(&url, "INSERT INTO orders SELECT generate_series(1, 100500)").await;
    let (ok, stdout, stderr) = crate::harness::run_dbtrigger(&app, &settings, &["status"]);
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains("≥ 100,000"), "{stdout}");
    drop_slot(&url, &slot).await;
}
