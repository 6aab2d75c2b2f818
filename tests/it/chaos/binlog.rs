//! Chaos on the binary-log source (issue 39): three writers make inserts, updates and hard deletes
//! on two tables of a MariaDB database, in interleaved transactions (some committing late, some
//! rolled back, some larger than a batch), the binary log rotates once, while `dbtrigger tick`
//! processes are killed with SIGKILL at random moments and the receiver answers 503 now and then.
//! After a final catch-up, judged against the writers' log (by GTID) and the server's own account
//! of the same range of the binary log (`mariadb-binlog --read-from-remote-server --verbose
//! --base64-output=decode-rows`, a reader independent of dbtrigger's driver), which must agree
//! first: every committed change was delivered at least once, the first delivery of each after
//! the first delivery of every change committed before it; nothing of a rolled-back transaction
//! was ever delivered; each transaction under one position, positions rising in commit order;
//! the checkpoint at the last commit (or, an idle tick having rested it, past it).
//!
//! Seeded: `DBTRIGGER_CHAOS_SEED=<n>` replays one run's choices (timing still varies);
//! `DBTRIGGER_CHAOS_SECONDS` sets how long the chaos lasts.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use dbtrigger::domain::binlog::BinlogPos;
use serde_json::{Value, json};
use sqlx::{Connection, Row};

use super::witness::{Change, Written, check_binlog_agreement, parse_mariadb_binlog};
use crate::binlog::binlog_database;
use crate::harness::{AppRoot, run_dbtrigger};
use crate::services::{azurite, mariadb_binlog};
use crate::sources::execute;

const DEFAULT_SEED: u64 = 39;
const DEFAULT_SECONDS: u64 = 12;
const WRITERS: u64 = 3;
const PROCESSES: usize = 3;
const BATCH: usize = 10;

/// What the receiver acknowledged, event by event, in the order it acknowledged them.
struct Receiver {
    /// (GTID, ordinal, the transaction's position, the change).
    acknowledged: Vec<(String, u64, u64, Change)>,
    faults: u64,
    random: fastrand::Rng,
}

async fn receive(State(state): State<Arc<Mutex<Receiver>>>, body: axum::body::Bytes) -> (StatusCode, String) {
    let Ok(envelope) = serde_json::from_slice::<Value>(&body) else {
        return (StatusCode::BAD_REQUEST, "not JSON".into());
    };
    // A little latency (so that kills land mid-delivery too), and a 503 one time in twelve.
    let (delay, fail) = {
        let mut state = state.lock().unwrap();
        (state.random.u64(2..30), state.random.u32(0..12) == 0)
    };
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let mut state = state.lock().unwrap();
    if fail {
        state.faults += 1;
        return (StatusCode::SERVICE_UNAVAILABLE, "flaky".into());
    }
    for event in envelope["events"].as_array().into_iter().flatten() {
        let gtid = event["row"]["gtid"].as_str().unwrap_or("?").to_string();
        let ordinal = event["pk"]["ordinal"].as_u64().unwrap_or(u64::MAX);
        let position = event["cursor"].as_u64().unwrap_or(u64::MAX);
        state.acknowledged.push((gtid, ordinal, position, Change::of_event(event)));
    }
    (StatusCode::OK, "{}".into())
}

/// One writer's rows and what it did (with the GTID of each commit), until `stop`.
async fn write(
    url: String,
    database: String,
    writer: u64,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> Vec<(Option<String>, Written)> {
    let mut connection = sqlx::MySqlConnection::connect(&url).await.unwrap();
    let mut random = fastrand::Rng::with_seed(seed ^ (writer + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    // Each writer touches only its own rows, so it knows which exist.
    let mut orders: Vec<i64> = Vec::new();
    let mut items: Vec<i64> = Vec::new();
    let mut next_id = writer as i64 * 1_000_000;
    let mut log = Vec::new();
    let mut step = 0u64;
    while !stop.load(Ordering::SeqCst) {
        step += 1;
        let late = random.u32(0..100) < 12;
        let rolled_back = random.u32(0..100) < 12;
        let (mut tentative_orders, mut tentative_items) = (orders.clone(), items.clone());
        let mut changes = Vec::new();
        let mut transaction = connection.begin().await.unwrap();
        // Mostly small transactions; one in twelve larger than a batch (delivered over several,
        // the checkpoint moving by ordinal inside it).
        let size = if random.u32(0..12) == 0 { random.usize(BATCH + 5..=40) } else { random.usize(1..=4) };
        for change in 0..size {
            let tag = format!("w{writer}s{step}c{change}");
            // What to do: 40 % inserts, 33 % updates, 27 % hard deletes; `orders` more than `items`.
            let roll = random.u32(0..100);
            let table = if roll.is_multiple_of(3) { "items" } else { "orders" };
            let rows = if table == "orders" { &mut tentative_orders } else { &mut tentative_items };
            let qualified = format!("{database}.{table}");
            if roll < 40 || rows.is_empty() {
                next_id += 1;
                sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {table} (id, tag) VALUES (?, ?)")))
                    .bind(next_id)
                    .bind(&tag)
                    .execute(&mut *transaction)
                    .await
                    .unwrap();
                changes.push(Change::new("insert", &qualified, Some(next_id), Some(&tag)));
                rows.push(next_id);
                continue;
            }
            let index = random.usize(0..rows.len());
            let id = rows[index];
            let delete = roll >= 73;
            let done = if delete {
                sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {table} WHERE id = ?")))
                    .bind(id)
                    .execute(&mut *transaction)
                    .await
            } else {
                sqlx::query(sqlx::AssertSqlSafe(format!("UPDATE {table} SET tag = ?, n = n + 1 WHERE id = ?")))
                    .bind(&tag)
                    .bind(id)
                    .execute(&mut *transaction)
                    .await
            }
            .unwrap()
            .rows_affected();
            assert_eq!(done, 1, "writer {writer} lost its own row {id} of {table}");
            if delete {
                rows.swap_remove(index);
                changes.push(Change::new("delete", &qualified, Some(id), None));
            } else {
                changes.push(Change::new("update", &qualified, Some(id), Some(&tag)));
            }
        }
        let hold = if late { random.u64(700..1_500) } else { random.u64(0..25) };
        tokio::time::sleep(Duration::from_millis(hold)).await;
        let gtid = if rolled_back {
            transaction.rollback().await.unwrap();
            None
        } else {
            transaction.commit().await.unwrap();
            (orders, items) = (tentative_orders, tentative_items);
            let gtid: String = sqlx::query_scalar("SELECT @@last_gtid").fetch_one(&mut connection).await.unwrap();
            Some(gtid)
        };
        log.push((gtid, Written { xid: step, changes, committed: !rolled_back, late }));
    }
    let _ = connection.close().await;
    log
}

/// The end of the binary log: (file, offset).
async fn end_of_log(url: &str) -> (String, u64) {
    let mut connection = sqlx::MySqlConnection::connect(url).await.unwrap();
    let row = sqlx::query("SHOW MASTER STATUS").fetch_one(&mut connection).await.unwrap();
    let (file, offset): (String, u64) = (row.get(0), row.get(1));
    let _ = connection.close().await;
    (file, offset)
}

/// The server's own account of its binary log from `from` to its end, as `mariadb-binlog` prints it.
fn server_account(port: u16, from: &(String, u64)) -> String {
    let program = ["mariadb-binlog", "mysqlbinlog"]
        .into_iter()
        .find(|program| Command::new(program).arg("--version").output().is_ok_and(|output| output.status.success()))
        .expect("mariadb-binlog (MariaDB's client) is installed with the server: run scripts/test");
    let output = Command::new(program)
        .args(["--read-from-remote-server", "--host=127.0.0.1", "--user=root", "--to-last-log"])
        .args(["--verbose", "--base64-output=decode-rows"])
        .arg(format!("--port={port}"))
        .arg(format!("--start-position={}", from.1))
        .arg(&from.0)
        .output()
        .unwrap();
    assert!(output.status.success(), "{program}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

fn packed(file: &str, offset: u64) -> BinlogPos {
    let (_, number) = dbtrigger::domain::binlog::FileNames::parse(file).unwrap();
    BinlogPos { file: number, offset: u32::try_from(offset).unwrap() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_on_the_binlog_source_delivers_every_committed_change_in_commit_order() {
    let seed: u64 =
        std::env::var("DBTRIGGER_CHAOS_SEED").ok().and_then(|value| value.parse().ok()).unwrap_or(DEFAULT_SEED);
    let seconds: u64 =
        std::env::var("DBTRIGGER_CHAOS_SECONDS").ok().and_then(|value| value.parse().ok()).unwrap_or(DEFAULT_SECONDS);
    println!("chaos (binlog): seed {seed} (DBTRIGGER_CHAOS_SEED={seed} replays its choices), {seconds} s");
    let (url, database) = binlog_database(
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, tag VARCHAR(40) NOT NULL, n BIGINT NOT NULL DEFAULT 1);\n\
         CREATE TABLE items (id BIGINT PRIMARY KEY, tag VARCHAR(40) NOT NULL, n BIGINT NOT NULL DEFAULT 1)",
    )
    .await;

    let state = Arc::new(Mutex::new(Receiver {
        acknowledged: Vec::new(),
        faults: 0,
        random: fastrand::Rng::with_seed(seed.wrapping_add(1)),
    }));
    let router = axum::Router::new().route("/hook", post(receive)).with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });

    let directory = tempfile::tempdir().unwrap();
    let app = AppRoot::write(
        directory.path(),
        json!({
            "source": {"kind": "binlog", "connection": "FEED_DB",
                       "tables": [format!("{database}.orders"), format!("{database}.items")]},
            "batch": {"size": BATCH, "tickBudgetSeconds": 20},
            "sink": {"type": "webhook", "url": "%FEED_HOOK%", "timeoutSeconds": 2, "maxRetries": 1},
            "lease": {"ttlSeconds": 3, "heartbeatSeconds": 1, "clockSkewSeconds": 1},
            "poison": {"maxAttempts": 3},
            "state": {"connection": "STATE"}
        }),
    )
    .with_azure_state(&azurite().connection_string());
    let settings = vec![
        ("FEED_DB".to_string(), url.clone()),
        ("FEED_HOOK".to_string(), hook),
        ("STATE".to_string(), azurite().connection_string()),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];
    // The first tick records where the poller starts; the server's account starts after it.
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    let from = end_of_log(&url).await;

    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| tokio::spawn(write(url.clone(), database.clone(), writer, seed, stop.clone())))
        .collect();

    // Tick processes, round after round, one still running killed at a moment chosen by the seed;
    // the binary log rotates once, halfway.
    let spawn_tick = || -> Child {
        Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
            .args(["tick", "orders", "--app-root"])
            .arg(&app.root)
            .envs(settings.iter().map(|(key, value)| (key.as_str(), value.as_str())))
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut random = fastrand::Rng::with_seed(seed);
    let started = Instant::now();
    let (mut kills, mut rounds, mut rotated) = (0u64, 0u64, false);
    while started.elapsed() < Duration::from_secs(seconds) {
        rounds += 1;
        let mut children: Vec<Child> = (0..PROCESSES).map(|_| spawn_tick()).collect();
        tokio::time::sleep(Duration::from_millis(random.u64(20..400))).await;
        let first = random.usize(0..PROCESSES);
        for offset in 0..PROCESSES {
            let child = &mut children[(first + offset) % PROCESSES];
            if child.try_wait().unwrap().is_none() {
                child.kill().unwrap();
                kills += 1;
                break;
            }
        }
        if !rotated && started.elapsed() > Duration::from_secs(seconds) / 2 {
            execute(&url, "FLUSH BINARY LOGS").await;
            rotated = true;
        }
        for mut child in children {
            let _ = tokio::task::spawn_blocking(move || child.wait()).await;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let mut written = Vec::new();
    for writer in writers {
        written.extend(writer.await.unwrap());
    }

    // The final catch-up, without kills (the receiver still fails now and then): ticks until one
    // finds nothing new, past any lease a killed process left.
    let catching_up = Instant::now();
    let deadline = catching_up + Duration::from_secs(180);
    loop {
        let (_, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
        if stdout.contains("nothing new") {
            break;
        }
        assert!(Instant::now() < deadline, "the poller did not catch up after the chaos: {stdout}{stderr}");
        if stdout.contains("lease held") {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    let catch_up = catching_up.elapsed();
    let document = app.state_document().await.expect("the state document");
    let end = end_of_log(&url).await;

    // The server's account, checked against the writers' log first.
    let account = server_account(mariadb_binlog().port, &from);
    let logged = parse_mariadb_binlog(&account, &database).unwrap();
    let by_writer: Vec<(Option<String>, &Written)> =
        written.iter().map(|(gtid, transaction)| (gtid.clone(), transaction)).collect();
    check_binlog_agreement(&by_writer, &logged).unwrap();
    let order: Vec<(String, u64)> = logged
        .iter()
        .flat_map(|transaction| {
            (1..=transaction.changes.len() as u64).map(|ordinal| (transaction.gtid.clone(), ordinal))
        })
        .collect();
    let committed: BTreeMap<(String, u64), &Change> = logged
        .iter()
        .flat_map(|transaction| {
            transaction
                .changes
                .iter()
                .enumerate()
                .map(|(index, change)| ((transaction.gtid.clone(), index as u64 + 1), change))
        })
        .collect();
    let rolled_back: BTreeSet<&Change> = written
        .iter()
        .filter(|(_, transaction)| !transaction.committed)
        .flat_map(|(_, transaction)| &transaction.changes)
        .filter(|change| change.tag.is_some())
        .collect();

    // The deliveries, judged.
    let (acknowledged, faults) = {
        let receiver = state.lock().unwrap();
        (receiver.acknowledged.clone(), receiver.faults)
    };
    let (mut first_deliveries, mut seen) = (Vec::new(), BTreeSet::new());
    let mut positions: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    for (gtid, ordinal, position, change) in &acknowledged {
        assert!(!rolled_back.contains(change), "a change of a rolled-back transaction was delivered: {change:?}");
        match committed.get(&(gtid.clone(), *ordinal)) {
            Some(expected) => assert_eq!(*expected, change, "change {ordinal} of {gtid} as delivered"),
            None => panic!("delivered a change that was never committed: {gtid}, ordinal {ordinal}, {change:?}"),
        }
        positions.entry(gtid.clone()).or_default().insert(*position);
        if seen.insert((gtid.clone(), *ordinal)) {
            first_deliveries.push((gtid.clone(), *ordinal));
        }
    }
    let deliveries = acknowledged.len();
    let lost: Vec<_> = order.iter().filter(|key| !seen.contains(*key)).collect();
    let place: BTreeMap<&(String, u64), usize> = order.iter().enumerate().map(|(index, key)| (key, index)).collect();
    let (mut highest, mut out_of_order) = (None, 0);
    for key in &first_deliveries {
        let index = place[key];
        if highest.is_some_and(|highest| index < highest) {
            out_of_order += 1;
        }
        highest = highest.max(Some(index));
    }
    // Every transaction's changes carry one position, rising in the server's commit order.
    let position_order: Vec<u64> = logged
        .iter()
        .filter_map(|transaction| {
            let seen = positions.get(&transaction.gtid)?;
            assert_eq!(seen.len(), 1, "{} delivered under several positions: {seen:?}", transaction.gtid);
            seen.first().copied()
        })
        .collect();

    // The checkpoint: at the last commit (its transaction, its last ordinal), or rested by an idle
    // tick at a place past it and not past the end of the log.
    let last = logged.last().expect("some transaction committed");
    let last_start = *positions[&last.gtid].first().unwrap();
    let checkpoint = {
        let document = dbtrigger::domain::StateDocument::parse(&serde_json::to_vec(&document).unwrap()).unwrap();
        dbtrigger::source::binlog::key_of(&document.position().unwrap().expect("a checkpoint")).unwrap()
    };
    let last_end = packed(&last.end.0, last.end.1);
    let at_last_commit = checkpoint.0.cursor() as u64 == last_start && checkpoint.1 as usize == last.changes.len();
    let rested_past_it = checkpoint.1 == 0 && checkpoint.0 >= last_end && checkpoint.0 <= packed(&end.0, end.1);

    let count = |op: &str| committed.values().filter(|change| change.op == op).count();
    let larger = logged.iter().filter(|transaction| transaction.changes.len() > BATCH).count();
    let files = logged.iter().map(|transaction| transaction.end.0.clone()).collect::<BTreeSet<_>>();
    println!(
        "chaos (binlog, seed {seed}): {} changes ({} inserts, {} updates, {} deletes) in {} transactions \
         ({} late, {} rolled back, {larger} larger than a batch) over {} binary log files, {seconds} s, \
         {rounds} rounds of {PROCESSES} processes, {kills} kills, {faults} receiver faults, catch-up {:.1} s, \
         lost {}, duplicates {}, out of order {out_of_order}, checkpoint {checkpoint:?}",
        order.len(),
        count("insert"),
        count("update"),
        count("delete"),
        logged.len(),
        written.iter().filter(|(_, transaction)| transaction.late && transaction.committed).count(),
        written.iter().filter(|(_, transaction)| !transaction.committed).count(),
        files.len(),
        catch_up.as_secs_f64(),
        lost.len(),
        deliveries - seen.len(),
    );
    assert!(lost.is_empty(), "committed changes never delivered (GTID, ordinal): {lost:?}");
    assert_eq!(first_deliveries, order, "first deliveries out of commit order");
    assert!(position_order.windows(2).all(|pair| pair[0] < pair[1]), "positions out of the server's commit order");
    assert!(
        at_last_commit || rested_past_it,
        "the checkpoint {checkpoint:?} is neither at the last commit ({last_start}, {}) nor past its end {last_end:?}",
        last.changes.len()
    );
    assert!(kills > 0 && faults > 0, "no kill or no receiver fault: the run proved little");
    assert!(rotated && files.len() > 1, "the binary log did not rotate under the writers: {files:?}");
    assert!(count("delete") > 0 && count("update") > 0 && larger > 0);
    assert!(written.iter().any(|(_, transaction)| !transaction.committed));
    assert!(written.iter().any(|(_, transaction)| transaction.late && transaction.committed));
}
