//! docs/logical-operations.md, "A failover to a standby", on a real PostgreSQL 17+ primary and
//! hot standby: a failover slot, `sync_replication_slots` and `hot_standby_feedback` on the
//! standby, `synchronized_standby_slots` on the primary; the standby is promoted and the poller,
//! pointed at it, goes on from its checkpoint.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{AppRoot, Receiver, run_dbtrigger};
use crate::services::{Postgres, start_postgres_of};
use crate::sources::execute;

use super::servers::{programs, standby_by_copy};

async fn scalar<T>(url: &str, sql: &str) -> T
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let value: T = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string())).fetch_one(&pool).await.unwrap();
    pool.close().await;
    value
}

/// Every acknowledged event's row id, in delivery order.
fn delivered(receiver: &Receiver) -> Vec<i64> {
    receiver
        .acknowledged()
        .iter()
        .flat_map(|received| received.envelope["events"].as_array().unwrap().clone())
        .map(|event| event["row"]["new"]["id"].as_i64().unwrap())
        .collect()
}

fn tick_until_caught_up(app: &AppRoot, settings: &[(String, String)], why: &str) {
    for _ in 0..20 {
        let (ok, stdout, stderr) = run_dbtrigger(app, settings, &["tick", "orders"]);
        assert!(ok, "{why}: the tick failed: {stdout}{stderr}");
        if stdout.contains("nothing new") {
            return;
        }
    }
    panic!("{why}: the poller did not catch up in 20 ticks");
}

fn settings_for(app: &AppRoot, url: &str) -> Vec<(String, String)> {
    vec![
        ("FEED_DB".to_string(), url.to_string()),
        ("STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ]
}

/// The standby's copy of `slot`: (synced, temporary), once it exists.
async fn synced_copy(standby: &Postgres, database: &str, slot: &str) -> Option<(bool, bool)> {
    let pool = sqlx::PgPool::connect(&standby.url(database)).await.unwrap();
    let copy: Option<(bool, bool)> =
        sqlx::query_as("SELECT synced, temporary FROM pg_replication_slots WHERE slot_name = $1")
            .bind(slot)
            .fetch_optional(&pool)
            .await
            .unwrap();
    pool.close().await;
    copy
}

pub(crate) async fn a_failover_slot_follows_the_poller_to_the_promoted_standby(major: u32) {
    let primary = start_postgres_of(&programs(major), 100, "");
    let url = primary.fresh_database().await;
    let database = url.rsplit('/').next().unwrap().to_string();
    let slot = format!("s_{}", database.trim_start_matches("t_"));
    execute(
        &url,
        &format!(
            "CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT);\n\
             CREATE PUBLICATION feed FOR TABLE orders;\n\
             SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput', false, false, true)"
        ),
    )
    .await;
    let failover: bool =
        scalar(&url, &format!("SELECT failover FROM pg_replication_slots WHERE slot_name = '{slot}'")).await;
    assert!(failover, "the fifth argument makes a failover slot");
    let standby =
        standby_by_copy(&primary, "standby", &[("hot_standby_feedback", "on"), ("sync_replication_slots", "on")]).await;
    execute(
        &primary.url("postgres"),
        "ALTER SYSTEM SET synchronized_standby_slots = 'standby';\nSELECT pg_reload_conf()",
    )
    .await;

    let receiver = Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let app = AppRoot::write(
        directory.path(),
        json!({
            "source": {"kind": "logical", "connection": "FEED_DB", "slot": slot, "publication": "feed"},
            "batch": {"size": 10},
            "sink": {"type": "webhook", "url": receiver.url},
            "state": {"connection": "STATE"}
        }),
    );
    let on_primary = settings_for(&app, &url);
    // Changes delivered until the standby holds a synced, persistent copy of the slot (the
    // slotsync worker persists it once the primary's slot has moved past what the standby has).
    let mut expected = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let id = expected.len() as i64 + 1;
        execute(&url, &format!("INSERT INTO orders VALUES ({id}, 'before')")).await;
        expected.push(id);
        tick_until_caught_up(&app, &on_primary, "on the primary");
        if synced_copy(&standby, "postgres", &slot).await == Some((true, false)) {
            break;
        }
        assert!(Instant::now() < deadline, "the standby never held a synced copy of {slot}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(delivered(&receiver), expected);

    // Committed on the primary, replayed by the standby, not yet delivered; then the failover.
    execute(
        &url,
        "INSERT INTO orders VALUES (1001, 'after the last tick');\nINSERT INTO orders VALUES (1002, 'after')",
    )
    .await;
    expected.extend([1001, 1002]);
    let written: String = scalar(&primary.url("postgres"), "SELECT pg_current_wal_lsn()::text").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !scalar::<bool>(&standby.url("postgres"), &format!("SELECT pg_last_wal_replay_lsn() >= '{written}'::pg_lsn"))
        .await
    {
        assert!(Instant::now() < deadline, "the standby did not replay the primary's WAL");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    primary.stop();
    let promoted: bool = scalar(&standby.url("postgres"), "SELECT pg_promote(true, 60)").await;
    assert!(promoted);
    let standby_url = standby.url(&database);
    execute(&standby_url, "INSERT INTO orders VALUES (1003, 'on the new primary')").await;
    expected.push(1003);

    // The connection setting now names the new primary: another host (here, another port) is
    // another source to the fingerprint, and the poller stops until an operator accepts it.
    let on_standby = settings_for(&app, &standby_url);
    let (ok, stdout, stderr) = run_dbtrigger(&app, &on_standby, &["tick", "orders"]);
    assert!(!ok, "a new host is a changed source: {stdout}{stderr}");
    assert!(format!("{stdout}{stderr}").contains("the source definition changed"), "{stdout}{stderr}");
    let (ok, stdout, stderr) = run_dbtrigger(&app, &on_standby, &["fingerprint", "accept", "orders", "--yes"]);
    assert!(ok, "{stdout}{stderr}");
    tick_until_caught_up(&app, &on_standby, "on the promoted standby");
    assert_eq!(delivered(&receiver), expected, "every change once, in commit order, across the failover");
}
