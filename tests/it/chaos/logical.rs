//! Chaos on the logical source (issue 29): three writers make inserts, updates, hard deletes and a
//! truncate or two on a publication of two tables, in interleaved transactions (some committing
//! late, some rolled back), while `dbtrigger tick` processes are killed with SIGKILL at random
//! moments and the receiver answers 503 now and then. After a final catch-up, judged against the
//! writers' log and a witness slot (`test_decoding`, the server's own account in commit order):
//! every committed change was delivered at least once, the first delivery of each after the first
//! delivery of every change of its row (or truncate) committed before it, and with one batch in
//! flight (even seeds) after every change committed before it; no rolled-back change was ever delivered; hard
//! deletes carry their keys; the checkpoint is at the last commit; the slot is past the last
//! change and holds none of the WAL written before the catch-up.
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
use serde_json::{Value, json};

use super::witness::{Change, Written, check_agreement, parse_test_decoding};
use crate::harness::{AppRoot, run_dbtrigger};
use crate::logical::{confirmed_flush, drop_slot, logical_database};
use crate::services::azurite;
use crate::sources::execute;

const DEFAULT_SEED: u64 = 29;
const DEFAULT_SECONDS: u64 = 15;
const WRITERS: u64 = 3;
const PROCESSES: usize = 3;

/// What the receiver acknowledged, event by event, in the order it acknowledged them.
struct Receiver {
    /// (xid, ordinal, commit LSN, the change).
    acknowledged: Vec<(u64, u64, u64, Change)>,
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
        let xid = event["row"]["xid"].as_u64().unwrap_or(u64::MAX);
        let ordinal = event["pk"]["ordinal"].as_u64().unwrap_or(u64::MAX);
        let commit_lsn = event["cursor"].as_u64().unwrap_or(u64::MAX);
        state.acknowledged.push((xid, ordinal, commit_lsn, Change::of_event(event)));
    }
    (StatusCode::OK, "{}".into())
}

/// One writer's rows and what it did, until `stop`.
async fn write(url: String, writer: u64, seed: u64, stop: Arc<AtomicBool>) -> Vec<Written> {
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let mut random = fastrand::Rng::with_seed(seed ^ (writer + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    // Each writer touches only its own rows: it knows which exist (a truncate by another writer
    // empties `lines` under it, which its next update or delete of such a row sees as 0 rows).
    let mut orders: Vec<i64> = Vec::new();
    let mut lines: Vec<i64> = Vec::new();
    let mut next_id = writer as i64 * 1_000_000;
    let mut log = Vec::new();
    let mut step = 0u64;
    while !stop.load(Ordering::SeqCst) {
        step += 1;
        let late = random.u32(0..100) < 12;
        let rolled_back = random.u32(0..100) < 12 && step != 5;
        let (mut tentative_orders, mut tentative_lines) = (orders.clone(), lines.clone());
        let mut changes = Vec::new();
        let mut transaction = pool.begin().await.unwrap();
        let xid: i64 = sqlx::query_scalar("SELECT (pg_current_xact_id()::text::bigint % 4294967296)")
            .fetch_one(&mut *transaction)
            .await
            .unwrap();
        // Writer 0 truncates `lines` at steps 5, 55, 105, … (the first one committed), followed
        // by other changes in the same transaction.
        if writer == 0 && step % 50 == 5 {
            sqlx::query("TRUNCATE lines").execute(&mut *transaction).await.unwrap();
            changes.push(Change::new("truncate", "public.lines", None, None));
            tentative_lines.clear();
        }
        // Mostly small transactions; one in twenty larger than a batch (delivered over several,
        // the checkpoint moving by ordinal inside it).
        let size = if random.u32(0..20) == 0 { random.usize(15..=40) } else { random.usize(1..=4) };
        for change in 0..size {
            let tag = format!("w{writer}s{step}c{change}");
            // What to do: 40 % inserts, 33 % updates, 27 % hard deletes; `orders` more than `lines`.
            let roll = random.u32(0..100);
            let table = if roll.is_multiple_of(3) { "lines" } else { "orders" };
            let rows = if table == "orders" { &mut tentative_orders } else { &mut tentative_lines };
            let qualified = format!("public.{table}");
            if roll < 40 || rows.is_empty() {
                next_id += 1;
                sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {table} (id, tag) VALUES ($1, $2)")))
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
                sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {table} WHERE id = $1")))
                    .bind(id)
                    .execute(&mut *transaction)
                    .await
            } else {
                sqlx::query(sqlx::AssertSqlSafe(format!("UPDATE {table} SET tag = $2, n = n + 1 WHERE id = $1")))
                    .bind(id)
                    .bind(&tag)
                    .execute(&mut *transaction)
                    .await
            }
            .unwrap()
            .rows_affected();
            if done == 0 || delete {
                rows.swap_remove(index);
            }
            if done == 0 {
                // Truncated meanwhile: only `lines` is.
                assert_eq!(table, "lines", "writer {writer} lost its own row {id} of {table}");
            } else if delete {
                changes.push(Change::new("delete", &qualified, Some(id), None));
            } else {
                changes.push(Change::new("update", &qualified, Some(id), Some(&tag)));
            }
        }
        let hold = if late { random.u64(700..1_500) } else { random.u64(0..25) };
        tokio::time::sleep(Duration::from_millis(hold)).await;
        if rolled_back {
            transaction.rollback().await.unwrap();
        } else {
            transaction.commit().await.unwrap();
            (orders, lines) = (tentative_orders, tentative_lines);
        }
        log.push(Written { xid: xid as u64, changes, committed: !rolled_back, late });
    }
    pool.close().await;
    log
}

/// How many first deliveries came before one they follow in commit order: a change of the same
/// table and key committed earlier, or a truncate (of anything) committed earlier, or, for a
/// truncate, any change committed earlier.
fn out_of_key_order(
    order: &[(u64, u64)],
    committed: &BTreeMap<(u64, u64), &Change>,
    first_deliveries: &[(u64, u64)],
) -> usize {
    let at: BTreeMap<(u64, u64), usize> =
        first_deliveries.iter().enumerate().map(|(index, key)| (*key, index)).collect();
    let (mut last_of_key, mut latest_truncate, mut latest_any) = (BTreeMap::new(), None::<usize>, None::<usize>);
    let mut broken = 0;
    for key in order {
        let Some(&index) = at.get(key) else { continue };
        let change = committed[key];
        let before = if change.op == "truncate" {
            latest_any
        } else {
            last_of_key.get(&(change.table.clone(), change.id)).copied().max(latest_truncate)
        };
        if before.is_some_and(|before| index < before) {
            broken += 1;
        }
        if change.op == "truncate" {
            latest_truncate = latest_truncate.max(Some(index));
        } else {
            let last = last_of_key.entry((change.table.clone(), change.id)).or_insert(index);
            *last = (*last).max(index);
        }
        latest_any = latest_any.max(Some(index));
    }
    broken
}

async fn scalar(url: &str, sql: &str) -> String {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let value: String = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string())).fetch_one(&pool).await.unwrap();
    pool.close().await;
    value
}

fn lsn(text: &str) -> u64 {
    dbtrigger::source::logical::values::parse_lsn(text).unwrap()
}

async fn restart_lsn(url: &str, slot: &str) -> u64 {
    lsn(&scalar(url, &format!("SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = '{slot}'")).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_on_the_logical_source_delivers_every_committed_change_in_commit_order() {
    let seed: u64 =
        std::env::var("DBTRIGGER_CHAOS_SEED").ok().and_then(|value| value.parse().ok()).unwrap_or(DEFAULT_SEED);
    let seconds: u64 =
        std::env::var("DBTRIGGER_CHAOS_SECONDS").ok().and_then(|value| value.parse().ok()).unwrap_or(DEFAULT_SECONDS);
    // An odd seed (the default among them) runs four batches in flight, where per-key order is what
    // holds (issue 38); an even one a single batch, where every first delivery is in commit order.
    let in_flight: u64 = if seed % 2 == 1 { 4 } else { 1 };
    let (url, slot) = logical_database(
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, tag TEXT NOT NULL, n BIGINT NOT NULL DEFAULT 1);\n\
         CREATE TABLE lines (id BIGINT PRIMARY KEY, tag TEXT NOT NULL, n BIGINT NOT NULL DEFAULT 1)",
        "orders, lines",
    )
    .await;
    // The witness: a second slot from the same point, decoded by the server's test_decoding.
    let witness = format!("w{}", &slot[1..]);
    execute(&url, &format!("SELECT pg_create_logical_replication_slot('{witness}', 'test_decoding')")).await;

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
            "source": {"kind": "logical", "connection": "FEED_DB", "slot": slot, "publication": "feed"},
            "batch": {"size": 10, "tickBudgetSeconds": 20, "maxInFlight": in_flight},
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

    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> =
        (0..WRITERS).map(|writer| tokio::spawn(write(url.clone(), writer, seed, stop.clone()))).collect();

    // Tick processes, round after round, one still running killed at a moment chosen by the seed.
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
    let (mut kills, mut rounds) = (0u64, 0u64);
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
        for mut child in children {
            let _ = tokio::task::spawn_blocking(move || child.wait()).await;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let mut written = Vec::new();
    for writer in writers {
        written.extend(writer.await.unwrap());
    }
    let writes_ended = lsn(&scalar(&url, "SELECT pg_current_wal_lsn()::text").await);

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

    // The witness's account, checked against the writers' log first.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT data FROM pg_logical_slot_get_changes('{witness}', NULL, NULL, 'include-xids', '1', 'skip-empty-xacts', '1')"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    pool.close().await;
    let decoded = parse_test_decoding(&rows).unwrap();
    check_agreement(&written, &decoded).unwrap();
    let order: Vec<(u64, u64)> = decoded
        .iter()
        .flat_map(|transaction| (1..=transaction.changes.len() as u64).map(|ordinal| (transaction.xid, ordinal)))
        .collect();
    let committed: BTreeMap<(u64, u64), &Change> = decoded
        .iter()
        .flat_map(|transaction| {
            transaction.changes.iter().enumerate().map(|(index, change)| ((transaction.xid, index as u64 + 1), change))
        })
        .collect();
    let rolled_back: BTreeSet<u64> =
        written.iter().filter(|transaction| !transaction.committed).map(|transaction| transaction.xid).collect();

    // The deliveries, judged.
    let (acknowledged, faults) = {
        let receiver = state.lock().unwrap();
        (receiver.acknowledged.clone(), receiver.faults)
    };
    let (mut first_deliveries, mut seen) = (Vec::new(), BTreeSet::new());
    let mut commit_lsns: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    for (xid, ordinal, commit_lsn, change) in &acknowledged {
        assert!(!rolled_back.contains(xid), "a change of rolled-back transaction {xid} was delivered: {change:?}");
        match committed.get(&(*xid, *ordinal)) {
            Some(expected) => assert_eq!(*expected, change, "change {ordinal} of xid {xid} as delivered"),
            None => panic!("delivered a change that was never committed: xid {xid}, ordinal {ordinal}, {change:?}"),
        }
        commit_lsns.entry(*xid).or_default().insert(*commit_lsn);
        if seen.insert((*xid, *ordinal)) {
            first_deliveries.push((*xid, *ordinal));
        }
    }
    let deliveries = acknowledged.len();
    let lost: Vec<_> = order.iter().filter(|key| !seen.contains(key)).collect();
    // A first delivery out of order: one whose change committed before a change first delivered
    // earlier.
    let place: BTreeMap<(u64, u64), usize> = order.iter().enumerate().map(|(index, key)| (*key, index)).collect();
    let mut highest = None;
    let mut out_of_order = 0;
    for key in &first_deliveries {
        let index = place[key];
        if highest.is_some_and(|highest| index < highest) {
            out_of_order += 1;
        }
        highest = highest.max(Some(index));
    }
    // Per key: a row's changes first delivered in commit order, a truncate after every change
    // committed before it and before every change committed after it.
    let key_out_of_order = out_of_key_order(&order, &committed, &first_deliveries);
    // Every transaction's changes carry one commit LSN, and the LSNs rise in the server's commit order.
    let lsn_order: Vec<u64> = decoded
        .iter()
        .filter_map(|transaction| {
            let lsns = commit_lsns.get(&transaction.xid)?;
            assert_eq!(lsns.len(), 1, "xid {} delivered under several commit LSNs: {lsns:?}", transaction.xid);
            lsns.first().copied()
        })
        .collect();

    // The slot and the checkpoint. PostgreSQL moves a slot's restart_lsn at a running-transactions
    // record, which it writes at a checkpoint (or every 15 s of activity): the test asks for one
    // rather than waiting, then lets idle ticks move the slot over it. An idle tick moves the slot
    // over unpublished WAL once it is a segment away (issue 37, finding 4: it takes the lease for
    // that), so the test first writes a segment's worth of WAL to a table outside the publication.
    execute(&url, "CREATE TABLE chaos_filler (id INT)").await;
    for id in 0..2 {
        execute(&url, &format!("INSERT INTO chaos_filler VALUES ({id});\nSELECT pg_switch_wal()")).await;
    }
    let document = app.state_document().await.expect("the state document");
    let last = decoded.last().expect("some transaction committed");
    let last_commit = *commit_lsns.get(&last.xid).and_then(|lsns| lsns.first()).expect("the last commit delivered");
    let mut checkpoints = 0;
    for _ in 0..20 {
        if restart_lsn(&url, &slot).await >= writes_ended {
            break;
        }
        checkpoints += 1;
        execute(&url, "INSERT INTO chaos_filler VALUES (2);\nCHECKPOINT").await;
        let (_, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
        assert!(stdout.contains("nothing new") || stdout.contains("lease held"), "{stdout}{stderr}");
    }
    let restart_at = restart_lsn(&url, &slot).await;
    let retained: i64 = scalar(
        &url,
        &format!(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint::text FROM pg_replication_slots \
             WHERE slot_name = '{slot}'"
        ),
    )
    .await
    .parse()
    .unwrap();
    let flushed_to = confirmed_flush(&url, &slot).await;

    let count = |op: &str| committed.values().filter(|change| change.op == op).count();
    println!(
        "chaos (logical, seed {seed}): {} changes ({} inserts, {} updates, {} deletes, {} truncates) in {} transactions \
         ({} late, {} rolled back), {seconds} s, {rounds} rounds of {PROCESSES} processes, {kills} kills, \
         {faults} receiver faults, catch-up {:.1} s, lost {}, duplicates {}, in flight {in_flight}, out of order {out_of_order}, \
         out of key order {key_out_of_order}, slot retains {retained} bytes ({checkpoints} checkpoint(s))",
        order.len(),
        count("insert"),
        count("update"),
        count("delete"),
        count("truncate"),
        decoded.len(),
        written.iter().filter(|transaction| transaction.late && transaction.committed).count(),
        rolled_back.len(),
        catch_up.as_secs_f64(),
        lost.len(),
        deliveries - seen.len(),
    );
    assert!(lost.is_empty(), "committed changes never delivered (xid, ordinal): {lost:?}");
    assert_eq!(key_out_of_order, 0, "first deliveries out of their key's commit order");
    if in_flight == 1 {
        assert_eq!(first_deliveries, order, "first deliveries out of commit order");
    }
    assert!(lsn_order.windows(2).all(|pair| pair[0] < pair[1]), "commit LSNs out of the server's commit order");
    let checkpoint = &document["checkpoint"]["cursor"];
    assert_eq!(checkpoint["value"], json!(last_commit), "the checkpoint is at the last commit: {checkpoint}");
    assert_eq!(checkpoint["tiebreaker"], json!({"ordinal": last.changes.len()}), "{checkpoint}");
    assert!(flushed_to > last_commit, "the slot's confirmed_flush_lsn is past the last commit");
    assert!(restart_at >= writes_ended, "the slot still holds WAL written before the catch-up");
    assert!(kills > 0 && faults > 0, "no kill or no receiver fault: the run proved little");
    assert!(count("delete") > 0 && count("truncate") > 0 && count("update") > 0);
    assert!(!rolled_back.is_empty() && written.iter().any(|transaction| transaction.late && transaction.committed));
    drop_slot(&url, &witness).await;
    drop_slot(&url, &slot).await;
}
