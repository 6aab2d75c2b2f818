//! The binary-log source (issue 39) on a real MariaDB: each change keyed by its row's primary key,
//! so that with several batches in flight a row's changes keep commit order while rows run in
//! parallel (through the real binary); what a partial row image (`binlog_row_image=MINIMAL`,
//! `NOBLOB`) did not log is named, never delivered as null; `status` beside a tick's open read
//! registers with ids of its own and leaves that read alone.

use std::collections::{BTreeMap, HashSet};
use std::process::Stdio;
use std::time::{Duration, Instant};

use dbtrigger::domain::keyed::{Group, group_of};
use dbtrigger::source::{FetchLimit, Probe};
use serde_json::{Value, json};

use crate::binlog::{binlog_app, binlog_database, connection, run};
use crate::harness::{AppRoot, Receiver, dbtrigger_command, run_dbtrigger};
use crate::sources::execute;

const DELAY: Duration = Duration::from_millis(50);

fn app(directory: &std::path::Path, tables: &[String], receiver: &Receiver, batch: Value) -> AppRoot {
    AppRoot::write(
        directory,
        json!({
            "source": {"kind": "binlog", "connection": "FEED_DB", "tables": tables},
            "batch": batch,
            "sink": {"type": "webhook", "url": receiver.url},
            "state": {"connection": "STATE"}
        }),
    )
}

fn settings(app: &AppRoot, url: &str) -> Vec<(String, String)> {
    vec![
        ("FEED_DB".to_string(), url.to_string()),
        ("STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ]
}

/// Every event the receiver acknowledged, in the order the deliveries arrived, with the delivery's
/// arrival.
fn events(receiver: &Receiver) -> Vec<(Instant, Value)> {
    let mut received = receiver.acknowledged();
    received.sort_by_key(|received| received.at);
    received
        .iter()
        .flat_map(|received| {
            received.envelope["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|event| (received.at, event.clone()))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A row's `origin` and version: `qty` of the new row, or one past the old row's for a delete.
fn version(event: &Value) -> (i64, i64) {
    let row = &event["row"];
    match row["new"].as_object() {
        Some(new) => (new["origin"].as_i64().unwrap(), new["qty"].as_i64().unwrap()),
        None => (row["old"]["origin"].as_i64().unwrap(), row["old"]["qty"].as_i64().unwrap() + 1),
    }
}

/// 40 rows of a keyed table updated 25 times (a statement per round, each its own transaction),
/// ten of them then moved to a new key and updated twice more, ten deleted, beside a table without
/// a primary key updated every round; 8 batches of 10 in flight, a receiver answering after 50 ms.
/// Every row's versions are first delivered in commit order, across its key change (the change
/// waits for its old key and its new); no row is in two deliveries at once; the table without a
/// key arrives whole in commit order; and deliveries ran in parallel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binlog_rows_keep_commit_order_with_eight_batches_in_flight() {
    let (url, database) = binlog_database(
        "CREATE TABLE items (id BIGINT PRIMARY KEY, origin BIGINT NOT NULL, qty BIGINT NOT NULL);\n\
         CREATE TABLE bare (origin BIGINT NOT NULL, qty BIGINT NOT NULL)",
    )
    .await;
    let receiver = Receiver::start().await;
    receiver.set_delay(DELAY);
    let directory = tempfile::tempdir().unwrap();
    let tables = [format!("{database}.items"), format!("{database}.bare")];
    let batch = json!({"size": 10, "maxInFlight": 8, "commitIntervalMs": 0});
    let app = app(directory.path(), &tables, &receiver, batch);
    let settings = settings(&app, &url);
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "the first tick records where the log ends: {stdout}{stderr}");
    const ROWS: i64 = 40;
    const ROUNDS: i64 = 25;
    let mut sql = vec![
        format!("INSERT INTO items SELECT seq, seq, 0 FROM seq_1_to_{ROWS}"),
        "INSERT INTO bare SELECT seq, 0 FROM seq_1_to_3".to_string(),
    ];
    for _ in 0..ROUNDS {
        sql.push("UPDATE items SET qty = qty + 1".into());
        sql.push("UPDATE bare SET qty = qty + 1".into());
    }
    // A key change: the rows' versions go on under their new keys.
    sql.push("UPDATE items SET id = id + 1000, qty = qty + 1 WHERE origin <= 10".into());
    sql.push("UPDATE items SET qty = qty + 1".into());
    sql.push("UPDATE items SET qty = qty + 1".into());
    sql.push(format!("DELETE FROM items WHERE origin > {}", ROWS - 10));
    execute(&url, &sql.join(";\n")).await;

    let started = Instant::now();
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    let wall = started.elapsed();
    assert!(ok, "{stdout}{stderr}");
    let events = events(&receiver);
    let table = |event: &Value| event["row"]["table"].as_str().unwrap().rsplit('.').next().unwrap().to_string();
    // Each row's versions, first deliveries only, in arrival order.
    let mut seen = HashSet::new();
    let mut rows: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    let mut bare: Vec<(i64, i64)> = Vec::new();
    for (_, event) in &events {
        let id = event["event_id"].as_str().unwrap().to_string();
        if !seen.insert(id) {
            continue;
        }
        let (origin, version) = version(event);
        if table(event) == "bare" {
            bare.push((version, origin));
        } else {
            rows.entry(origin).or_default().push(version);
        }
    }
    assert_eq!(rows.len() as i64, ROWS);
    for (origin, versions) in &rows {
        let expected: Vec<i64> = match origin {
            // The insert, the rounds, the key change, two more rounds.
            1..=10 => (0..=ROUNDS + 3).collect(),
            // The insert, the rounds, two more, and the delete.
            _ if *origin > ROWS - 10 => (0..=ROUNDS + 3).collect(),
            _ => (0..=ROUNDS + 2).collect(),
        };
        assert_eq!(versions, &expected, "row {origin}: versions first delivered out of commit order, or lost");
    }
    // The table without a primary key is one key: its changes arrive in commit order.
    let mut sorted = bare.clone();
    sorted.sort();
    assert_eq!(bare, sorted, "the table without a key left commit order");
    assert_eq!(bare.len() as i64, 3 * (ROUNDS + 1));
    // No row in two deliveries at once: a delivery holding it arrived only after the one before
    // it was answered.
    let mut last: BTreeMap<i64, Instant> = BTreeMap::new();
    let mut deliveries: Vec<(Instant, HashSet<i64>)> = Vec::new();
    for (at, event) in &events {
        if table(event) == "bare" {
            continue;
        }
        match deliveries.last_mut() {
            Some((delivery, origins)) if delivery == at => {
                origins.insert(version(event).0);
            }
            _ => deliveries.push((*at, HashSet::from([version(event).0]))),
        }
    }
    let mut overlapping = Vec::new();
    for (at, origins) in &deliveries {
        for origin in origins {
            if let Some(before) = last.insert(*origin, *at)
                && at.duration_since(before) < DELAY
            {
                overlapping.push(*origin);
            }
        }
    }
    assert!(overlapping.is_empty(), "rows in two deliveries at once: {overlapping:?}");
    // The window ran in parallel: a table was not one key.
    let concurrent = receiver.max_concurrent();
    let batches = receiver.acknowledged().len();
    eprintln!(
        "{} events in {batches} deliveries, {wall:?} for the tick ({:?} if one at a time), at most {concurrent} at once",
        events.len(),
        DELAY * batches as u32
    );
    assert!(concurrent > 1, "deliveries one at a time");
    let document = app.state_document().await.unwrap();
    assert!(document["checkpoint"].is_object(), "{document}");
}

/// A writer's session under `binlog_row_image=MINIMAL`, then `NOBLOB`: each image holds what the
/// server logged, and the table's other columns are named in `not_logged` (never sent as null);
/// a row keeps its key whichever image holds it (an update's after image without the key, a
/// delete's before image with the key only), a key change has both; so does a `batch.orderKey`
/// column either image holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_row_image_names_the_columns_it_did_not_log() {
    let (url, database) =
        binlog_database("CREATE TABLE notes (id INT PRIMARY KEY, title VARCHAR(20), body TEXT, n INT DEFAULT 7)").await;
    let directory = tempfile::tempdir().unwrap();
    let tables = vec![format!("{database}.notes")];
    let sink = json!({"type": "webhook", "url": "http://127.0.0.1:9/unused"});
    let (_app, _, config) = binlog_app(directory.path(), &url, &tables, 100, sink);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let limit = FetchLimit { rows: 100, bytes: usize::MAX };
    assert!(source.read(Probe::Deliver, None, limit).await.unwrap().rows.is_empty());
    let start = source.resting_position(None).await.unwrap().expect("the end of the log");
    source.tick_ended().await.unwrap();
    let mut writer = connection(&url).await;
    run(&mut writer, "INSERT INTO notes VALUES (1, 'a', 'long text', 1), (2, 'b', 'more text', 2)").await;
    run(&mut writer, "SET SESSION binlog_row_image = MINIMAL").await;
    run(&mut writer, "UPDATE notes SET title = 'a2' WHERE id = 1").await;
    run(&mut writer, "UPDATE notes SET id = 3 WHERE id = 2").await;
    run(&mut writer, "INSERT INTO notes (id, title) VALUES (4, 'd')").await;
    run(&mut writer, "UPDATE notes SET title = NULL WHERE id = 4").await;
    run(&mut writer, "DELETE FROM notes WHERE id = 1").await;
    run(&mut writer, "SET SESSION binlog_row_image = NOBLOB").await;
    run(&mut writer, "UPDATE notes SET title = 'c2' WHERE id = 3").await;
    let rows = source.read(Probe::Deliver, Some(&start), limit).await.unwrap().rows;
    let values: Vec<Value> = rows.iter().map(|row| Value::Object(row.row.to_map())).collect();
    let shown = serde_json::to_string_pretty(&values).unwrap();
    assert_eq!(values.len(), 8, "{shown}");
    let columns = ["id", "title", "body", "n"];
    for value in &values {
        // What an image holds and what it lacks are the table's columns, once each.
        for side in ["old", "new"] {
            let Some(image) = value[side].as_object() else { continue };
            let missing: Vec<&str> = value["not_logged"][side]
                .as_array()
                .map(|names| names.iter().map(|name| name.as_str().unwrap()).collect())
                .unwrap_or_default();
            let mut all: Vec<&str> = image.keys().map(String::as_str).chain(missing.iter().copied()).collect();
            all.sort();
            let mut expected = columns.to_vec();
            expected.sort();
            assert_eq!(all, expected, "{side} of {value}");
        }
    }
    let image = |index: usize, side: &str| values[index][side].clone();
    let not_logged = |index: usize| values[index].get("not_logged").cloned().unwrap_or(Value::Null);
    // FULL: whole images, nothing named.
    assert_eq!(image(0, "new"), json!({"id": 1, "title": "a", "body": "long text", "n": 1}));
    assert_eq!(not_logged(0), Value::Null);
    // MINIMAL update: the key before, the column set after.
    assert_eq!(image(2, "old"), json!({"id": 1}), "{shown}");
    assert_eq!(image(2, "new"), json!({"title": "a2"}), "{shown}");
    assert_eq!(not_logged(2), json!({"old": ["title", "body", "n"], "new": ["id", "body", "n"]}));
    // MINIMAL key change.
    assert_eq!((image(3, "old"), image(3, "new")), (json!({"id": 2}), json!({"id": 3})), "{shown}");
    // MINIMAL insert: the columns the statement gave; those left to their defaults are named.
    assert_eq!(image(4, "new"), json!({"id": 4, "title": "d"}), "{shown}");
    assert_eq!(not_logged(4), json!({"old": [], "new": ["body", "n"]}));
    // A column set to NULL is null; one not logged is absent.
    assert_eq!(image(5, "new"), json!({"title": null}), "{shown}");
    // MINIMAL delete: the key only.
    assert_eq!((image(6, "old"), image(6, "new")), (json!({"id": 1}), Value::Null), "{shown}");
    assert_eq!(not_logged(6), json!({"old": ["title", "body", "n"], "new": []}));
    // NOBLOB: every column but the TEXT the statement did not set.
    assert_eq!(image(7, "old"), json!({"id": 3, "title": "b", "n": 2}), "{shown}");
    assert_eq!(image(7, "new"), json!({"id": 3, "title": "c2", "n": 2}), "{shown}");
    assert_eq!(not_logged(7), json!({"old": ["body"], "new": ["body"]}));
    // Keys: row 1's insert, MINIMAL update and delete share one; the key change has 2's and 3's.
    let group = |index: usize| rows[index].group.clone().unwrap();
    let keys = |index: usize| match group(index) {
        Group::Keys(keys) => keys,
        Group::All => panic!("event {index} is a barrier: {shown}"),
    };
    assert_eq!(keys(0).len(), 1);
    assert_eq!(group(2), group(0));
    assert_eq!(group(6), group(0));
    assert_eq!(keys(3), [keys(1)[0], keys(7)[0]], "the key change waits for 2 and 3");
    assert_ne!(keys(1), keys(7));
    assert_eq!(group(5), group(4), "row 4's update without its key in the after image");
    // `batch.orderKey` (the tick's grouping of these rows): a column the after image lacks is the
    // before image's; one neither image holds makes the change wait for every other.
    let ordered = |columns: &[&str], index: usize| {
        let columns: Vec<String> = columns.iter().map(|column| column.to_string()).collect();
        group_of(Some(&columns), rows[index].group.as_ref(), b"", rows[index].row.as_bytes())
    };
    assert_ne!(ordered(&["id"], 0), Group::All);
    assert_eq!(ordered(&["id"], 2), ordered(&["id"], 0), "{shown}");
    assert_eq!(ordered(&["id"], 6), ordered(&["id"], 0), "{shown}");
    assert_eq!(ordered(&["n"], 2), Group::All, "{shown}");
}

/// `dbtrigger status` while a tick's dump is open on the server (a transaction of 20 MB read by a
/// slow receiver): status counts and looks at the first change waiting with replica ids of its
/// own, so the server keeps the tick's dump; the tick delivers every change once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_beside_an_open_read_leaves_the_ticks_dump_alone() {
    let (url, database) = binlog_database("CREATE TABLE orders (id INT PRIMARY KEY, body MEDIUMTEXT)").await;
    let receiver = Receiver::start().await;
    receiver.set_delay(Duration::from_millis(100));
    let directory = tempfile::tempdir().unwrap();
    let app = app(directory.path(), &[format!("{database}.orders")], &receiver, json!({"size": 100}));
    let settings = settings(&app, &url);
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}{stderr}");
    const ROWS: i64 = 5000;
    execute(&url, &format!("INSERT INTO orders SELECT seq, REPEAT('x', 4000) FROM seq_1_to_{ROWS}")).await;
    let mut child = dbtrigger_command(&app, &settings, &["tick", "orders"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while receiver.acknowledged().len() < 3 {
        assert!(started.elapsed() < Duration::from_secs(60), "no deliveries");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dumps = || async {
        let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
        let count: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND = 'Binlog Dump' AND DB = ?",
        )
        .bind(&database)
        .fetch_one(&pool)
        .await
        .unwrap();
        pool.close().await;
        count
    };
    assert!(dumps().await >= 1, "the tick's dump is open on the server while status runs");
    for run in 0..3 {
        let (_, status, stderr) = run_dbtrigger(&app, &settings, &["status"]);
        assert!(status.contains("orders"), "{status}{stderr}");
        if run == 0 {
            assert!(child.try_wait().unwrap().is_none(), "status ran while the tick read");
        }
    }
    let output = child.wait_with_output().unwrap();
    let ok = output.status.success();
    let output = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(ok, "the tick failed: {output}");
    let ids: Vec<i64> =
        events(&receiver).iter().map(|(_, event)| event["row"]["new"]["id"].as_i64().unwrap()).collect();
    assert_eq!(ids, (1..=ROWS).collect::<Vec<_>>(), "every change once, in order ({output})");
}
