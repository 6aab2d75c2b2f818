//! Issue 35, finding 3: `settle: "auto"` is refused, with its reason, on a server that is not
//! where the rows are written: a real PostgreSQL hot standby (`pg_basebackup -R`), a real MariaDB
//! replica, a read_only MariaDB. Finding 8: MariaDB's `trx_started` (local system time) is read
//! at its earliest UTC moment, on a server whose system zone has a daylight-saving fall-back.

use std::sync::Arc;
use std::time::Duration;

use dbtrigger::store::memory::MemoryStore;
use serde_json::json;

use super::{ids, items_app, open_late_writer, tick};
use crate::services::{MariaDbOptions, hot_standby_of, mariadb_with, postgres_with_settings};
use crate::sources::{execute, poller_with};

/// Polls `sql` (one boolean) on `url` until it answers true (at most 30 s).
async fn wait_until(url: &str, sql: &str, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let answer: Option<bool> = if url.starts_with("postgres") {
            match sqlx::PgPool::connect(url).await {
                Ok(pool) => sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string())).fetch_one(&pool).await.ok(),
                Err(_) => None,
            }
        } else {
            match sqlx::MySqlPool::connect(url).await {
                Ok(pool) => sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string())).fetch_one(&pool).await.ok(),
                Err(_) => None,
            }
        };
        if answer == Some(true) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: not within 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A tick of a `settle: "auto"` poller on `url` fails, its error naming `reason`; so does
/// `status` (unhealthy), and a poller with a fixed `settleSeconds` reads the same table.
async fn assert_refused(url: &str, reason: &str) {
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) = items_app(directory.path(), url, json!({"settle": "auto", "settleSeconds": 1}));
    let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
    let error = poller.tick().await.expect_err("settle auto is refused here").to_string();
    assert!(error.contains("settle \"auto\" is refused") && error.contains(reason), "{error}");
    assert!(ids(&sink).is_empty());
    let status = dbtrigger::status::of_poller("orders", &poller, chrono::Utc::now()).await;
    assert!(!status.healthy && status.problems.iter().any(|problem| problem.contains(reason)), "{:?}", status.problems);
    let fixed_directory = tempfile::tempdir().unwrap();
    let (_, _, fixed) = items_app(fixed_directory.path(), url, json!({"settleSeconds": 1}));
    let (fixed, fixed_sink) = poller_with(fixed, Arc::new(MemoryStore::new()));
    tick(&fixed).await;
    assert!(!ids(&fixed_sink).is_empty(), "the server is readable: only auto is refused");
}

/// Issue 35, finding 3, PostgreSQL: on a hot standby, `pg_stat_activity` does not list the
/// primary's open transaction (the scenario: the bound would be `now - settleSeconds`, a guess),
/// and `settle: "auto"` is refused, naming the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_auto_is_refused_on_a_postgres_hot_standby() {
    let primary = postgres_with_settings(&[]);
    let primary_url = primary.fresh_database().await;
    execute(
        &primary_url,
        "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ NOT NULL DEFAULT now(), note TEXT);\n",
    )
    .await;
    execute(&primary_url, "INSERT INTO items (id, c) VALUES (1, now() - interval '1 minute');\n").await;
    let standby = hot_standby_of(&primary);
    let database = primary_url.rsplit('/').next().unwrap();
    let standby_url = standby.url(database);
    wait_until(&standby_url, "SELECT count(*) = 1 FROM items", "the standby replays the table").await;

    let (late, _) =
        open_late_writer(&primary_url, "BEGIN", "INSERT INTO items (id) VALUES (2)", "SELECT pg_backend_pid()::int8")
            .await;
    let standby_pool = sqlx::PgPool::connect(&standby_url).await.unwrap();
    let (in_recovery, listed): (bool, i64) = sqlx::query_as(
        "SELECT pg_is_in_recovery(), (SELECT count(*) FROM pg_stat_activity WHERE xact_start IS NOT NULL AND pid <> pg_backend_pid() \
         AND datname = current_database())",
    )
    .fetch_one(&standby_pool)
    .await
    .unwrap();
    assert_eq!((in_recovery, listed), (true, 0), "the scenario: the primary's open transaction is not listed here");
    assert_refused(&standby_url, "hot standby (pg_is_in_recovery())").await;
    late.commit().await;
    standby_pool.close().await;
}

/// Issue 35, finding 3, MariaDB: a real replica (binary log replication from a primary of its
/// own): its INNODB_TRX does not list the primary's open transaction, and `settle: "auto"` is
/// refused while its replication threads run; stopped but read_only, still refused; neither,
/// accepted. Finding 8 on the same server, whose system zone is Europe/Paris.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_auto_is_refused_on_a_mariadb_replica_and_a_read_only_server() {
    let primary = mariadb_with(&MariaDbOptions { arguments: &["--log-bin", "--server-id=1"], system_time_zone: None });
    let replica =
        mariadb_with(&MariaDbOptions { arguments: &["--server-id=2"], system_time_zone: Some("Europe/Paris") });
    let replica_admin = replica.url("mysql");
    execute(
        &replica_admin,
        &format!(
            "CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={}, MASTER_USER='root', MASTER_USE_GTID=slave_pos;\n\
             START SLAVE;\n",
            primary.port
        ),
    )
    .await;
    let primary_url = primary.fresh_database().await;
    let database = primary_url.rsplit('/').next().unwrap().to_string();
    execute(
        &primary_url,
        "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), note TEXT);\n\
         INSERT INTO items (id, c) VALUES (1, CURRENT_TIMESTAMP(6) - INTERVAL 1 MINUTE);\n",
    )
    .await;
    let replica_url = replica.url(&database);
    wait_until(&replica_url, "SELECT COUNT(*) = 1 FROM items", "the replica applies the table").await;

    let (late, _) = open_late_writer(
        &primary_url,
        "BEGIN",
        "INSERT INTO items (id) VALUES (2)",
        "SELECT CAST(CONNECTION_ID() AS SIGNED)",
    )
    .await;
    let replica_pool = sqlx::MySqlPool::connect(&replica_url).await.unwrap();
    let listed: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM information_schema.INNODB_TRX")
        .fetch_one(&replica_pool)
        .await
        .unwrap();
    assert_eq!(listed, 0, "the scenario: the primary's open transaction is not listed on the replica");
    assert_refused(&replica_url, "replica (its replication threads run)").await;
    late.commit().await;

    execute(&replica_admin, "STOP SLAVE;\nSET GLOBAL read_only = ON;\n").await;
    assert_refused(&replica_url, "read_only").await;
    execute(&replica_admin, "SET GLOBAL read_only = OFF;\n").await;
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) =
        items_app(directory.path(), &replica_url, json!({"settle": "auto", "settleSeconds": 1}));
    let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
    tick(&poller).await;
    assert_eq!(ids(&sink).first(), Some(&1), "neither replicating nor read_only: auto bounds what this server writes");

    // Finding 8: on the fall-back day of Europe/Paris, 02:00-03:00 local happens twice. T1 began
    // at 02:50 CEST (00:50Z), T2 at 02:10 CET (01:10Z): the oldest began at 00:50Z.
    let (old, new, plain): (chrono::NaiveDateTime, chrono::NaiveDateTime, chrono::NaiveDateTime) =
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT CONVERT_TZ(MIN(trx_started), 'SYSTEM', '+00:00'), MIN({}), \
             (SELECT {} FROM (SELECT CAST('2026-11-27 10:00:00' AS DATETIME) AS trx_started) AS winter) \
             FROM (SELECT CAST('2026-10-25 02:50:00' AS DATETIME) AS trx_started \
                   UNION ALL SELECT CAST('2026-10-25 02:10:00' AS DATETIME)) AS started",
            dbtrigger::source::horizon::mysql_started_utc("trx_started"),
            dbtrigger::source::horizon::mysql_started_utc("trx_started")
        )))
        .fetch_one(&replica_pool)
        .await
        .unwrap();
    let oldest = chrono::NaiveDate::from_ymd_opt(2026, 10, 25).unwrap().and_hms_opt(0, 50, 0).unwrap();
    assert!(old > oldest, "the scenario: the minimum of local times converted is later than the oldest start ({old})");
    assert!(new <= oldest, "the earliest reading is never later than the truth: {new}");
    assert_eq!(
        plain,
        chrono::NaiveDate::from_ymd_opt(2026, 11, 27).unwrap().and_hms_opt(9, 0, 0).unwrap(),
        "outside a change, the exact moment"
    );
    replica_pool.close().await;
}
