//! Operating a logical source (issue 29) on a real PostgreSQL: a slot another process reads is a
//! clear error naming that process; `status` shows the WAL the slot holds and the watchdog's
//! finding past its threshold; `dbtrigger sql` prints a set-up that runs twice, and `check` asks
//! the live server what is missing.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use dbtrigger::domain::watchdog::FindingKind;
use dbtrigger::store::memory::MemoryStore;

use crate::harness::run_dbtrigger;
use crate::logical::{drop_slot, logical_app, logical_database, poller};
use crate::sources::execute;

async fn active_pid(url: &str, slot: &str) -> Option<i32> {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let pid: Option<i32> = sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
        .bind(slot)
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    pid
}

/// `pg_recvlogical` reading `slot` (see [`another_reader`]), once the slot is active for it: the
/// process and its backend's pid.
// The caller kills and waits for the reader it is given.
#[allow(clippy::zombie_processes)]
pub(crate) async fn reader_holding(url: &str, slot: &str) -> (Child, i32) {
    let mut reader = another_reader(url, slot);
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(pid) = active_pid(url, slot).await {
            return (reader, pid);
        }
        if std::time::Instant::now() >= deadline {
            let _ = reader.kill();
            let _ = reader.wait();
            panic!("pg_recvlogical never took the slot");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until no session holds `slot`: the server ends a killed reader's walsender a moment after
/// the process.
pub(crate) async fn until_released(url: &str, slot: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while active_pid(url, slot).await.is_some() {
        assert!(std::time::Instant::now() < deadline, "the killed reader's walsender kept the slot");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `pg_recvlogical` reading `slot`: another consumer holding it (and, sending no feedback, never
/// moving it).
fn another_reader(url: &str, slot: &str) -> Child {
    let program = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is installed under /usr/lib/postgresql")
        .filter_map(|entry| Some(entry.ok()?.path().join("bin/pg_recvlogical")))
        .find(|path| path.exists())
        .expect("pg_recvlogical is installed with PostgreSQL");
    Command::new(program)
        .args(["-d", url, "--slot", slot, "--start", "-f", "/dev/null"])
        .args(["-o", "proto_version=1", "-o", "publication_names=feed"])
        // No feedback for an hour: it holds the slot and never moves it.
        .args(["--status-interval", "3600", "--fsync-interval", "3600"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_read_by_another_process_is_a_clear_error_naming_its_pid() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY)", "orders").await;
    execute(&url, "INSERT INTO orders VALUES (1)").await;
    let (mut other, pid) = reader_holding(&url, &slot).await;
    let directory = tempfile::tempdir().unwrap();
    let (_, _, config) = logical_app(directory.path(), &url, &slot, 10);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (poller, sink) = poller(config, source, Arc::new(MemoryStore::new()));
    let error = poller.tick().await.expect_err("the slot is someone else's").to_string();
    let _ = other.kill();
    let _ = other.wait();
    assert!(error.contains(&format!("PID {pid}")), "{error}");
    assert!(error.contains("in use by another process"), "{error}");
    assert!(sink.batches().is_empty());
    until_released(&url, &slot).await;
    drop_slot(&url, &slot).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_wal_a_slot_holds_and_the_watchdog_reports_it_past_the_threshold() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT)", "orders").await;
    execute(&url, "INSERT INTO orders SELECT g, repeat('x', 200) FROM generate_series(1, 20000) g").await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings, config) = logical_app(directory.path(), &url, &slot, 5000);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (poller, _sink) = poller(config, source, Arc::new(MemoryStore::new()));
    let health = dbtrigger::status::of_poller("orders", &poller, chrono::Utc::now()).await;
    let view = health.slot.clone().expect("a logical poller's status shows its slot");
    assert_eq!(view.slot, slot);
    assert_eq!(view.wal_status.as_deref(), Some("reserved"));
    let held = view.retained_bytes.expect("a restart position");
    assert!(held > 4 << 20, "20000 rows of 200 bytes are held: {held}");
    let finding = dbtrigger::domain::watchdog::judge_slot(&health, 1 << 20).expect("past 1 MiB");
    assert_eq!(finding.kind, FindingKind::SlotRetention);
    assert!(dbtrigger::domain::watchdog::judge_slot(&health, 1 << 30).is_none(), "below 1 GiB");
    // Caught up, the slot's confirmed position is where the WAL ends.
    while !matches!(poller.tick().await.unwrap(), dbtrigger::tick::TickOutcome::Idle) {}
    let after = dbtrigger::status::of_poller("orders", &poller, chrono::Utc::now()).await;
    assert!(after.healthy, "{:?}", after.problems);
    // And the command says it in words.
    let (_, status, stderr) = run_dbtrigger(&app, &settings, &["status"]);
    assert!(status.contains(&format!("orders: replication slot {slot}: ")), "{status}{stderr}");
    assert!(status.contains("wal_status reserved, idle"), "{status}{stderr}");
    drop_slot(&url, &slot).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_printed_set_up_runs_twice_and_check_then_finds_nothing_missing() {
    printed_set_up_on(crate::services::postgres()).await;
}

/// [`the_printed_set_up_runs_twice_and_check_then_finds_nothing_missing`] on `server`; on
/// PostgreSQL 17 and later the slot it creates is a failover slot.
pub(crate) async fn printed_set_up_on(server: &crate::services::Postgres) {
    let url = server.fresh_database().await;
    execute(&url, "CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT)").await;
    let slot = format!("s_{}", url.rsplit('/').next().unwrap().trim_start_matches("t_"));
    let directory = tempfile::tempdir().unwrap();
    let (app, settings, _) = logical_app(directory.path(), &url, &slot, 10);
    // Before the set-up: check names the slot and the publication as missing.
    let (ok, before, _) = run_dbtrigger(&app, &settings, &["check"]);
    assert!(!ok, "{before}");
    assert!(before.contains(&format!("missing orders: slot {slot} does not exist")), "{before}");
    assert!(before.contains("missing orders: publication feed does not exist"), "{before}");
    assert!(!before.contains("ok: "), "a poller with something missing is not also ok: {before}");
    let (printed, ddl, stderr) = run_dbtrigger(&app, &settings, &["sql", "orders"]);
    assert!(printed, "{stderr}");
    assert!(ddl.contains("pg_create_logical_replication_slot"), "{ddl}");
    assert!(ddl.contains("REPLICA IDENTITY FULL"), "{ddl}");
    assert!(ddl.contains("WITH REPLICATION"), "{ddl}");
    // ALTER SYSTEM is the server's and needs a restart: the shared test server already runs
    // with wal_level=logical, so those two lines are left out here.
    let runnable: String = ddl.lines().filter(|line| !line.starts_with("ALTER SYSTEM")).collect::<Vec<_>>().join("\n");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    for run in 1..=2 {
        // One statement at a time, as psql sends them (each paragraph holds one).
        for statement in runnable.split("\n\n") {
            if let Err(error) = sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_string())).execute(&pool).await {
                panic!("run {run} of the printed set-up failed: {error}\n{statement}");
            }
        }
    }
    let version: i32 =
        sqlx::query_scalar("SELECT current_setting('server_version_num')::int").fetch_one(&pool).await.unwrap();
    if version >= 170_000 {
        let failover: bool = sqlx::query_scalar("SELECT failover FROM pg_replication_slots WHERE slot_name = $1")
            .bind(&slot)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(failover, "on PostgreSQL {} the printed slot is a failover slot", version / 10_000);
    }
    pool.close().await;
    let (ok, after, _) = run_dbtrigger(&app, &settings, &["check"]);
    assert!(ok, "{after}");
    assert!(after.contains("ok: orders (poller orders)"), "{after}");
    assert!(after.contains("ok orders: wal_level is logical"), "{after}");
    assert!(after.contains("ok orders: publication feed has 1 table(s)"), "{after}");
    drop_slot(&url, &slot).await;
}

/// Tick processes killed with SIGKILL at moments that move from round to round (mid-read,
/// mid-delivery, between the state commit and the slot's advance): once ticks run undisturbed,
/// every change was acknowledged at least once, none is missing, their positions follow commit
/// order, and the slot is past the last of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ticks_killed_at_any_moment_lose_no_change_and_the_slot_ends_past_them() {
    ticks_killed_on(crate::services::postgres()).await;
}

/// [`ticks_killed_at_any_moment_lose_no_change_and_the_slot_ends_past_them`] on `server`.
pub(crate) async fn ticks_killed_on(server: &crate::services::Postgres) {
    let (url, slot) =
        crate::logical::logical_database_on(server, "CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT)", "orders")
            .await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let mut expected: Vec<(String, i64)> = Vec::new();
    for step in 0..60i64 {
        let mut transaction = pool.begin().await.unwrap();
        for id in [2 * step + 1, 2 * step + 2] {
            sqlx::query("INSERT INTO orders VALUES ($1, 'x')").bind(id).execute(&mut *transaction).await.unwrap();
            expected.push(("insert".into(), id));
        }
        if step % 3 == 2 {
            sqlx::query("DELETE FROM orders WHERE id = $1").bind(step).execute(&mut *transaction).await.unwrap();
            expected.push(("delete".into(), step));
        }
        transaction.commit().await.unwrap();
    }
    pool.close().await;
    let receiver = crate::harness::Receiver::start().await;
    receiver.set_delay(Duration::from_millis(25));
    let directory = tempfile::tempdir().unwrap();
    let app = crate::harness::AppRoot::write(
        directory.path(),
        serde_json::json!({
            "source": {"kind": "logical", "connection": "FEED_DB", "slot": slot, "publication": "feed"},
            "batch": {"size": 4},
            "sink": {"type": "webhook", "url": receiver.url},
            "lease": {"ttlSeconds": 3, "heartbeatSeconds": 1, "clockSkewSeconds": 1},
            "state": {"connection": "STATE"}
        }),
    );
    let settings = vec![
        ("FEED_DB".to_string(), url.clone()),
        ("STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];
    let mut kills = 0;
    for round in 0..8u64 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
            .args(["tick", "orders", "--app-root"])
            .arg(&app.root)
            .envs(settings.iter().map(|(key, value)| (key.as_str(), value.as_str())))
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(60 + round * 45)).await;
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            kills += 1;
        }
        let _ = tokio::task::spawn_blocking(move || child.wait()).await;
        // A killed holder's lease expires (3 s) before the next round can take it: some rounds
        // then find it held, which is part of what is exercised.
    }
    assert!(kills > 0, "no tick was killed while it ran: the test proves nothing");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut caught_up = false;
    for _ in 0..40 {
        let (_, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
        if stdout.contains("nothing new") {
            caught_up = true;
            break;
        }
    }
    assert!(caught_up, "the poller did not catch up after the kills");
    // Every change, once by its event id, in position order: exactly the changes, in commit order.
    let mut seen = std::collections::BTreeMap::new();
    for received in receiver.acknowledged() {
        for event in received.envelope["events"].as_array().unwrap() {
            let position = (event["cursor"].as_u64().unwrap(), event["pk"]["ordinal"].as_u64().unwrap());
            let row = &event["row"];
            let id = row["new"].get("id").or_else(|| row["old"].get("id")).and_then(|id| id.as_i64()).unwrap();
            seen.insert(position, (event["op"].as_str().unwrap().to_string(), id));
        }
    }
    let delivered: Vec<(String, i64)> = seen.values().cloned().collect();
    assert_eq!(delivered, expected, "after {kills} kills");
    let last = seen.keys().last().unwrap().0;
    assert!(crate::logical::confirmed_flush(&url, &slot).await > last, "the slot is past the last change");
    drop_slot(&url, &slot).await;
}

/// `source.origin: "none"` asks pgoutput for the changes made without a replication origin,
/// an option PostgreSQL has from 16 on. On an older server (the suite's is 15) the real binary's
/// tick fails naming the field and the server's version, delivers nothing and leaves the slot
/// where it was, and `check` reports it; on 16 and later, a write made under a replication origin
/// is not delivered and the others are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_origin_none_leaves_out_writes_under_an_origin_and_is_refused_before_postgresql_16() {
    origin_none_on(crate::services::postgres()).await;
}

/// [`source_origin_none_leaves_out_writes_under_an_origin_and_is_refused_before_postgresql_16`]
/// on `server`: the refusal before 16, the filter from 16 on.
pub(crate) async fn origin_none_on(server: &crate::services::Postgres) {
    let (url, slot) =
        crate::logical::logical_database_on(server, "CREATE TABLE orders (id BIGINT PRIMARY KEY)", "orders").await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let version: i32 =
        sqlx::query_scalar("SELECT current_setting('server_version_num')::int").fetch_one(&pool).await.unwrap();
    let confirmed = || async {
        let lsn: String =
            sqlx::query_scalar("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1")
                .bind(&slot)
                .fetch_one(&pool)
                .await
                .unwrap();
        lsn
    };
    let before = confirmed().await;
    execute(&url, "INSERT INTO orders VALUES (1)").await;
    let directory = tempfile::tempdir().unwrap();
    let app = crate::harness::AppRoot::write(
        directory.path(),
        serde_json::json!({
            "source": {"kind": "logical", "connection": "FEED_DB", "slot": slot, "publication": "feed", "origin": "none"},
            "sink": {"type": "webhook", "url": "http://127.0.0.1:9/unused"},
            "state": {"connection": "STATE"}
        }),
    );
    let settings = vec![
        ("FEED_DB".to_string(), url.clone()),
        ("STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];
    if version < 160_000 {
        let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
        let said = format!("{stdout}{stderr}");
        assert!(!ok, "{said}");
        assert!(said.contains("source.origin \"none\" needs PostgreSQL 16 or later"), "{said}");
        assert!(said.contains(&format!("this server is PostgreSQL {}", version / 10_000)), "{said}");
        assert_eq!(confirmed().await, before, "the slot stays where it was");
        let (ok, checked, _) = run_dbtrigger(&app, &settings, &["check"]);
        assert!(!ok, "{checked}");
        assert!(checked.contains("missing orders: source.origin \"none\" needs PostgreSQL 16 or later"), "{checked}");
    } else {
        // A write under a replication origin (as a function's session declares one), then one
        // without: only the second is delivered.
        execute(
            &url,
            "SELECT pg_replication_origin_create('dbtrigger_writeback');\n\
             BEGIN; SELECT pg_replication_origin_session_setup('dbtrigger_writeback'); \
             INSERT INTO orders VALUES (2); SELECT pg_replication_origin_session_reset(); COMMIT;\n\
             INSERT INTO orders VALUES (3)",
        )
        .await;
        let config = dbtrigger::config::PollerConfig::load(
            &app.root,
            "orders",
            &dbtrigger::config::Settings::from_pairs(
                settings.iter().map(|(key, value)| (key.as_str(), value.as_str())),
            ),
            None,
        )
        .unwrap();
        let source = dbtrigger::source::open(&config.source).unwrap();
        let (poller, sink) = poller(config, source, Arc::new(MemoryStore::new()));
        while !matches!(poller.tick().await.unwrap(), dbtrigger::tick::TickOutcome::Idle) {}
        let ids: Vec<i64> = sink
            .batches()
            .iter()
            .flat_map(|batch| batch.events.iter().map(|event| event.row()["new"]["id"].as_i64().unwrap()))
            .collect();
        assert_eq!(ids, vec![1, 3]);
        execute(&url, "SELECT pg_replication_origin_drop('dbtrigger_writeback')").await;
    }
    pool.close().await;
    drop_slot(&url, &slot).await;
}

/// `status` counts a logical poller's lag on a temporary copy of its slot: while another session
/// reads the slot (as a tick of another process does), the count is still made, and the reader
/// keeps the slot (before, the count failed with "active for PID", or took the slot from a tick).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_the_lag_while_another_session_reads_the_slot() {
    let (url, slot) = logical_database("CREATE TABLE orders (id BIGINT PRIMARY KEY)", "orders").await;
    execute(&url, "INSERT INTO orders VALUES (1)").await;
    let directory = tempfile::tempdir().unwrap();
    let (_, _, config) = logical_app(directory.path(), &url, &slot, 10);
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (poller, sink) = poller(config, source, Arc::new(MemoryStore::new()));
    while !matches!(poller.tick().await.unwrap(), dbtrigger::tick::TickOutcome::Idle) {}
    assert_eq!(sink.batches().iter().map(|batch| batch.events.len()).sum::<usize>(), 1);
    execute(&url, "INSERT INTO orders VALUES (2), (3)").await;
    execute(&url, "INSERT INTO orders VALUES (4)").await;
    let (mut other, pid) = reader_holding(&url, &slot).await;
    let health = dbtrigger::status::of_poller("orders", &poller, chrono::Utc::now()).await;
    let still = active_pid(&url, &slot).await;
    let _ = other.kill();
    let _ = other.wait();
    assert_eq!(health.lag_rows, Some(3), "three changes wait: {:?}", health.problems);
    assert_eq!(still, Some(pid), "the reader keeps the slot");
    until_released(&url, &slot).await;
    drop_slot(&url, &slot).await;
}
