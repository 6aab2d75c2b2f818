//! The binary-log source (issue 39) through the real binary on a real MariaDB: a tick SIGKILLed in
//! the middle of a transaction loses nothing and the next resumes after the last change
//! committed; a purged binary log stops the poller loudly until an operator resets it; `status`
//! shows how far behind the checkpoint is; `check` and `sql` say what the server lacks.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::binlog::binlog_database;
use crate::harness::{AppRoot, Receiver, dbtrigger_command, run_dbtrigger};
use crate::services::{BINLOG_ARGUMENTS, MariaDbOptions, mariadb_with};
use crate::sources::execute;

fn app(
    directory: &std::path::Path,
    url: &str,
    tables: &[String],
    receiver: &Receiver,
) -> (AppRoot, Vec<(String, String)>) {
    let app = AppRoot::write(
        directory,
        json!({
            "source": {"kind": "binlog", "connection": "FEED_DB", "tables": tables},
            "batch": {"size": 50},
            "sink": {"type": "webhook", "url": receiver.url},
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

fn document(app: &AppRoot) -> Value {
    let path = app.state_dir.join(format!("state/{}/orders.json", app.app_name));
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn tick(app: &AppRoot, settings: &[(String, String)]) -> (bool, String) {
    let (ok, stdout, stderr) = run_dbtrigger(app, settings, &["tick", "orders"]);
    (ok, format!("{stdout}{stderr}"))
}

/// The ids of every event acknowledged, in arrival order.
fn received(receiver: &Receiver) -> Vec<i64> {
    receiver
        .acknowledged()
        .iter()
        .flat_map(|received| received.envelope["events"].as_array().unwrap().clone())
        .map(|event| event["row"]["new"]["id"].as_i64().unwrap())
        .collect()
}

/// A transaction of 2,000 inserts and one of a single insert; a tick SIGKILLed once its first
/// commit landed inside the transaction. The
/// next tick delivers the rest: every change at least once, first deliveries in commit order,
/// and the repeats exactly those delivered after the checkpoint the killed tick committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_killed_in_the_middle_of_a_transaction_loses_nothing() {
    let (url, database) = binlog_database("CREATE TABLE orders (id INT PRIMARY KEY, note VARCHAR(20))").await;
    let receiver = Receiver::start().await;
    receiver.set_delay(Duration::from_millis(60));
    let directory = tempfile::tempdir().unwrap();
    let (app, settings) = app(directory.path(), &url, &[format!("{database}.orders")], &receiver);
    // The first tick fixes where the poller starts: the end of the binary log.
    let (ok, output) = tick(&app, &settings);
    assert!(ok, "{output}");
    assert!(document(&app)["checkpoint"].is_object(), "the first tick records where it starts: {output}");
    execute(&url, "INSERT INTO orders SELECT seq, 'x' FROM seq_1_to_2000").await;
    execute(&url, "INSERT INTO orders VALUES (2001, 'after')").await;

    let mut child = dbtrigger_command(&app, &settings, &["tick", "orders"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    // Killed once a commit landed inside the transaction (every second by default).
    let ordinal = |app: &AppRoot| document(app)["checkpoint"]["cursor"]["tiebreaker"]["ordinal"].as_i64().unwrap_or(0);
    while ordinal(&app) == 0 {
        assert!(started.elapsed() < Duration::from_secs(60), "too slow: {}", received(&receiver).len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let mut quiet = (received(&receiver).len(), Instant::now());
    while quiet.1.elapsed() < Duration::from_millis(800) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = received(&receiver).len();
        if now != quiet.0 {
            quiet = (now, Instant::now());
        }
    }
    let before = received(&receiver);
    let mut state = document(&app);
    let committed = state["checkpoint"]["cursor"]["tiebreaker"]["ordinal"].as_i64().unwrap();
    assert!(committed > 0 && committed < 2000, "the checkpoint is inside the transaction: ordinal {committed}");
    // The killed tick's lease expires (as a minute would).
    state["lease"]["expires_at"] = json!(chrono::Utc::now() - chrono::Duration::minutes(5));
    let path = app.state_dir.join(format!("state/{}/orders.json", app.app_name));
    std::fs::write(&path, serde_json::to_vec_pretty(&state).unwrap()).unwrap();
    receiver.set_delay(Duration::ZERO);
    let (ok, output) = tick(&app, &settings);
    assert!(ok, "{output}");
    let all = received(&receiver);
    let after = &all[before.len()..];
    // The next tick starts right after the committed ordinal.
    assert_eq!(after.first(), Some(&(committed + 1)), "resumed after ordinal {committed}");
    let mut first_seen = Vec::new();
    for id in &all {
        if !first_seen.contains(id) {
            first_seen.push(*id);
        }
    }
    assert_eq!(first_seen, (1..=2001).collect::<Vec<_>>(), "every change, in commit order");
    assert_eq!(all.len() - 2001, before.len() - committed as usize, "the repeats are what came after the checkpoint");
}

/// The checkpoint's binary log purged: the tick fails naming the file and the gap, records it,
/// and every later tick stops too (even with nothing lost since); `status` shows the poller
/// unhealthy; `reset --to-end` lets it go on from the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_binary_log_stops_the_poller_until_it_is_reset() {
    let server = mariadb_with(&MariaDbOptions { arguments: BINLOG_ARGUMENTS, system_time_zone: None });
    let url = server.fresh_database().await;
    let database = url.rsplit('/').next().unwrap().to_string();
    execute(&url, "CREATE TABLE orders (id INT PRIMARY KEY)").await;
    let receiver = Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings) = app(directory.path(), &url, &[format!("{database}.orders")], &receiver);
    assert!(tick(&app, &settings).0);
    execute(&url, "INSERT INTO orders VALUES (1)").await;
    assert!(tick(&app, &settings).0);
    assert_eq!(received(&receiver), [1]);
    // Retention shows in `status`: the checkpoint's file and what follows it.
    execute(&url, "INSERT INTO orders VALUES (2);\nFLUSH BINARY LOGS").await;
    let (_, status, _) = run_dbtrigger(&app, &settings, &["status"]);
    assert!(status.contains("binary log binlog.000001") && status.contains("1 files after it"), "{status}");
    // Purged before the poller read it.
    execute(&url, "FLUSH BINARY LOGS").await;
    purge_to(&url, "binlog.000003").await;
    let (ok, output) = tick(&app, &settings);
    assert!(!ok, "{output}");
    assert!(
        output.contains("binary log binlog.000001") && output.contains("is lost") && output.contains("purged"),
        "{output}"
    );
    assert!(document(&app)["failure"]["slot_lost"].as_str().unwrap().contains("binlog.000001"));
    let (ok, output) = tick(&app, &settings);
    assert!(!ok && output.contains("no operator has reset the poller"), "{output}");
    let (_, status, _) = run_dbtrigger(&app, &settings, &["status"]);
    assert!(status.contains("unhealthy") || status.contains("lost"), "{status}");
    let (ok, stdout, stderr) =
        run_dbtrigger(&app, &settings, &["reset", "orders", "--to-end", "--yes", "--reason", "gap loaded by hand"]);
    assert!(ok, "{stdout}{stderr}");
    execute(&url, "INSERT INTO orders VALUES (3)").await;
    let (ok, output) = tick(&app, &settings);
    assert!(ok, "{output}");
    assert_eq!(received(&receiver), [1, 3], "2 was in the gap; 3 after the reset");
}

/// `PURGE BINARY LOGS TO file`, again until it took: MariaDB keeps a file until InnoDB has
/// flushed the commits it holds (its binlog checkpoint), which lags here (no flush at commit).
pub(crate) async fn purge_to(url: &str, file: &str) {
    let started = Instant::now();
    loop {
        execute(url, &format!("PURGE BINARY LOGS TO '{file}'")).await;
        let pool = sqlx::MySqlPool::connect(url).await.unwrap();
        let first: String = sqlx::query_scalar("SHOW BINARY LOGS").fetch_one(&pool).await.unwrap();
        pool.close().await;
        if first == file {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "{first} is still kept");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `dbtrigger check` asks the server; `sql` prints the set-up: a server without its binary log
/// is named as missing it, and its poller is not also named `ok:` (one verdict per poller).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_sql_say_what_the_server_lacks() {
    let receiver = Receiver::start().await;
    let (url, database) = binlog_database("CREATE TABLE orders (id INT PRIMARY KEY)").await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings) = app(directory.path(), &url, &[format!("{database}.orders")], &receiver);
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["check"]);
    assert!(ok && stdout.contains("ok orders: log_bin"), "{stdout}{stderr}");
    assert!(stdout.contains("ok: orders (poller orders)"), "{stdout}");
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["sql", "orders"]);
    assert!(ok && stdout.contains("GRANT REPLICATION SLAVE") && stdout.contains("binlog_row_image = FULL"), "{stdout}");
    // The shared MariaDB without a binary log.
    let plain = crate::services::mariadb().fresh_database().await;
    let plain_directory = tempfile::tempdir().unwrap();
    let (app, settings) = self::app(plain_directory.path(), &plain, &["x.orders".into()], &receiver);
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["check"]);
    assert!(!ok && stdout.contains("missing orders: log_bin is OFF"), "{stdout}{stderr}");
    assert!(!stdout.contains("ok: "), "a poller with something missing is not also ok: {stdout}");
}
