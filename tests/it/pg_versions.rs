//! The compatibility suite (issue 48): one body run on each PostgreSQL major the suite installs,
//! Debian's 15 and the npm registry's 13, 16, 17 and 18 (scripts/postgresql-versions). It runs the
//! bodies of the suite's own PostgreSQL tests on that major's server: the polling source with
//! every cursor kind (integer, timestamptz, timestamp, a composite key, xid), the logical source
//! (inserts, updates, deletes and truncates in commit order, a writer killed mid-transaction,
//! ticks killed mid-flight), `dbtrigger sql` and `check`, `source.origin` (refused before 16,
//! filtering from 16 on), a failover slot from 17 on and a failover to a promoted standby.
//! A major whose server is not installed fails its test.

use std::sync::Arc;
use std::time::Instant;

use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::TickOutcome;

use crate::logical::{drop_slot, logical_app, logical_database_on};
use crate::services::Postgres;
use crate::sources::{Database, Engine, Kind, end_to_end_in, execute};

mod failover;
mod servers;

/// A writer's session terminated in the middle of its transaction: none of its changes arrive,
/// the changes committed around it do, and the slot moves past them.
async fn a_writer_killed_mid_transaction_delivers_nothing_of_it(server: &Postgres) {
    let (url, slot) = logical_database_on(server, "CREATE TABLE orders (id BIGINT PRIMARY KEY)", "orders").await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let mut killed = pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *killed).await.unwrap();
    sqlx::query("INSERT INTO orders VALUES (1), (2)").execute(&mut *killed).await.unwrap();
    execute(&url, "INSERT INTO orders VALUES (3)").await;
    let terminated: bool =
        sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(pid).fetch_one(&pool).await.unwrap();
    assert!(terminated);
    drop(killed);
    execute(&url, "INSERT INTO orders VALUES (4)").await;
    let directory = tempfile::tempdir().unwrap();
    let config = logical_app(directory.path(), &url, &slot, 10).2;
    let source = dbtrigger::source::open(&config.source).unwrap();
    let (poller, sink) = crate::logical::poller(config, source, Arc::new(MemoryStore::new()));
    while !matches!(poller.tick().await.unwrap(), TickOutcome::Idle) {}
    let ids: Vec<i64> = sink
        .batches()
        .iter()
        .flat_map(|batch| batch.events.iter().map(|event| event.row()["new"]["id"].as_i64().unwrap()))
        .collect();
    assert_eq!(ids, vec![3, 4], "the killed transaction's rows never arrive");
    pool.close().await;
    drop_slot(&url, &slot).await;
}

async fn compatible(major: u32) {
    let started = Instant::now();
    let server = servers::server(major);
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&sqlx::PgPool::connect(&server.url("postgres")).await.unwrap())
        .await
        .unwrap();
    assert!(version.starts_with(&format!("{major}.")), "PostgreSQL {major}'s server says {version}");
    if let Some(pinned) = servers::expected_server_version(major) {
        assert!(version.starts_with(&pinned), "scripts/postgresql-versions pins {pinned}, the server says {version}");
    }
    for kind in [Kind::Integer, Kind::Timestamptz, Kind::Naive, Kind::CompositeKey] {
        end_to_end_in(Database::at(server.fresh_database().await), Engine::Postgres, kind).await;
    }
    crate::horizon::printed_xid_ddl_runs_twice_on(server).await;
    crate::horizon::xid_late_commit_on(server).await;
    crate::logical::commit_order_on(server).await;
    a_writer_killed_mid_transaction_delivers_nothing_of_it(server).await;
    crate::logical_ops::ticks_killed_on(server).await;
    crate::logical_ops::printed_set_up_on(server).await;
    crate::logical_ops::origin_none_on(server).await;
    if major >= 17 {
        failover::a_failover_slot_follows_the_poller_to_the_promoted_standby(major).await;
    }
    eprintln!("PostgreSQL {version}: compatible in {:.1} s", started.elapsed().as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_13() {
    compatible(13).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_15() {
    compatible(15).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_16() {
    compatible(16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_17() {
    compatible(17).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_18() {
    compatible(18).await;
}

/// Every major scripts/postgresql-versions pins has its test above (a pin added without one
/// would install a server nothing runs on).
#[test]
fn every_pinned_major_has_its_test() {
    let source = include_str!("pg_versions.rs");
    for (major, _) in servers::pinned() {
        assert!(source.contains(&format!("async fn postgresql_{major}()")), "no test for PostgreSQL {major}");
    }
}
