//! Issue 35, findings 2, 4 and 7, on real PostgreSQL: `settle: "auto"` keeps its margin below a
//! stamp a `timestamptz(0)` column rounded down, holds behind a prepared transaction, and a
//! holder whose age this role cannot see is reported by the watchdog all the same.

use std::sync::Arc;
use std::time::Duration;

use dbtrigger::domain::horizon::Horizon;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::TickOutcome;
use serde_json::json;

use super::{
    LateWriter, assert_in_cursor_order, ids, items_app, items_app_into, open_late_writer, tick, timestamp_text,
};
use crate::harness::{Receiver, run_dbtrigger};
use crate::services::{postgres, postgres_with_settings};
use crate::sources::{execute, poller_with};

/// Sleeps until the fraction of the current second is between 0.05 and 0.25 (so that a
/// `timestamptz(0)` stamp taken in the next 0.2 s rounds down, to the same second).
async fn early_in_a_second() {
    let fraction = |now: chrono::DateTime<chrono::Utc>| now.timestamp_subsec_millis();
    let millis = fraction(chrono::Utc::now());
    if !(50..=250).contains(&millis) {
        let wait = (1_050 + 1_000 - millis) % 1_000;
        tokio::time::sleep(Duration::from_millis(u64::from(wait))).await;
    }
}

/// Issue 35, finding 2: transaction T starts at x.1 s and stamps its row x (a `timestamptz(0)`
/// rounds to the second, down here); U starts after it, stamps x too, with a larger key, and
/// commits. The bound used to be T's start (x.1): U's row (x < x.1) was delivered and the
/// checkpoint passed T's row. The margin is taken off T's start too: nothing passes T until it
/// commits, then both arrive in order, none late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_auto_keeps_its_margin_below_a_stamp_rounded_down_by_timestamptz_0() {
    let url = postgres().fresh_database().await;
    execute(&url, "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ(0) NOT NULL DEFAULT now(), note TEXT);\n")
        .await;
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) = items_app(directory.path(), &url, json!({"settle": "auto", "settleSeconds": 1}));
    let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));

    early_in_a_second().await;
    let (late, _) =
        open_late_writer(&url, "BEGIN", "INSERT INTO items (id) VALUES (1)", "SELECT pg_backend_pid()::int8").await;
    execute(&url, "INSERT INTO items (id) VALUES (2);\n").await;
    // Past settleSeconds after T's start: only T's start bounds the read now.
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    let outcome = tick(&poller).await;
    assert_eq!(ids(&sink), Vec::<i64>::new(), "U's row shares T's rounded stamp: it waits for T ({outcome:?})");
    let LateWriter::Postgres(mut connection) = late else { unreachable!() };
    let rounded_down: bool =
        sqlx::query_scalar("SELECT c < now() FROM items WHERE id = 1").fetch_one(&mut connection).await.unwrap();
    assert!(rounded_down, "the scenario: T's stamp is below its own start");
    LateWriter::Postgres(connection).commit().await;
    let stamps: i64 = sqlx::query_scalar("SELECT count(DISTINCT c) FROM items")
        .fetch_one(&sqlx::PgPool::connect(&url).await.unwrap())
        .await
        .unwrap();
    assert_eq!(stamps, 1, "the scenario: both rows carry the same second");
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    tick(&poller).await;
    assert_eq!(ids(&sink), vec![1, 2], "T's row first, then U's: nothing passed, nothing late");
    assert!(sink.batches().iter().all(|batch| !batch.late), "none delivered late");
    assert_in_cursor_order(&sink, timestamp_text);
}

/// Issue 35, finding 4: T inserts row 2 and is prepared (`PREPARE TRANSACTION`) 1.5 s later: it
/// leaves `pg_stat_activity`. 40 rows committed after its start (one before it was prepared) wait
/// behind it (its start, which the server no
/// longer shows, is below them), `status` names it (gid, owner, age); `COMMIT PREPARED` lets row 2
/// and then the 40 through, in order, none late: the checkpoint never passed it. A poller that
/// first reads while T is prepared cannot know T's start: it waits for T.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_auto_holds_behind_a_prepared_transaction_until_it_commits() {
    let server = postgres_with_settings(&[("max_prepared_transactions", "4")]);
    let url = server.fresh_database().await;
    execute(&url, "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ NOT NULL DEFAULT now(), note TEXT);\n")
        .await;
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) = items_app(directory.path(), &url, json!({"settle": "auto", "settleSeconds": 1}));
    let (poller, sink) = poller_with(config.clone(), Arc::new(MemoryStore::new()));
    execute(&url, "INSERT INTO items (id) VALUES (1);\n").await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    tick(&poller).await;
    assert_eq!(ids(&sink), vec![1]);

    let (late, _) =
        open_late_writer(&url, "BEGIN", "INSERT INTO items (id) VALUES (2)", "SELECT pg_backend_pid()::int8").await;
    let LateWriter::Postgres(mut connection) = late else { unreachable!() };
    // Committed while T is open, before it is prepared: above T's start, below `prepared - 1 s`
    // (a bound taken from the time of preparation would let it pass T's row).
    execute(&url, "INSERT INTO items (id) VALUES (3);\n").await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    sqlx::raw_sql("PREPARE TRANSACTION 'late-two'").execute(&mut connection).await.unwrap();
    let mut later = String::new();
    for id in 4..=42 {
        later.push_str(&format!("INSERT INTO items (id) VALUES ({id});\n"));
    }
    execute(&url, &later).await;
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    assert!(
        matches!(tick(&poller).await, TickOutcome::Idle),
        "the 40 wait behind the prepared transaction: {:?}",
        ids(&sink)
    );
    let status = dbtrigger::status::of_poller("orders", &poller, chrono::Utc::now()).await;
    let holder = status.horizon_holder.expect("the prepared transaction holds the bound");
    assert_eq!(holder.holds, Horizon::SettleBound);
    assert_eq!((holder.gid.as_deref(), holder.role.as_deref(), holder.pid), (Some("late-two"), Some("postgres"), None));
    assert!(holder.age_seconds.is_some_and(|age| age >= 1.0), "{holder:?}");
    assert!(
        holder.describe().starts_with("prepared transaction \"late-two\" (owner postgres, database t_"),
        "{}",
        holder.describe()
    );

    // A poller of its own, starting now: T's start is unknown to it, it lets nothing through.
    let fresh_directory = tempfile::tempdir().unwrap();
    let (_, _, fresh_config) = items_app(fresh_directory.path(), &url, json!({"settle": "auto", "settleSeconds": 1}));
    let (fresh, fresh_sink) = poller_with(fresh_config, Arc::new(MemoryStore::new()));
    tick(&fresh).await;
    assert_eq!(ids(&fresh_sink), Vec::<i64>::new(), "a prepared transaction of unknown start holds everything");

    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::raw_sql("COMMIT PREPARED 'late-two'").execute(&admin).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    tick(&poller).await;
    tick(&fresh).await;
    let expected: Vec<i64> = (1..=42).collect();
    assert_eq!(ids(&sink), expected, "row 2 in its place, before the 40 committed after it");
    assert!(sink.batches().iter().all(|batch| !batch.late), "none delivered late");
    assert_in_cursor_order(&sink, timestamp_text);
    assert_eq!(ids(&fresh_sink), expected);
    admin.close().await;
}

/// Issue 35, finding 7: a role without `pg_read_all_stats` sees another role's transaction hold
/// the commit horizon (its xid) but not its start: the holder's age is unknown, not 0, and the
/// watchdog reports `horizon_held` once it has seen that same transaction hold for
/// `horizonHeldAfterSeconds`, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_age_this_role_cannot_see_is_still_reported_by_the_watchdog() {
    // A server of its own: the transaction held here would hold every xid poller of a shared one.
    let server = postgres_with_settings(&[]);
    let admin_url = server.fresh_database().await;
    let reader = format!("reader_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    execute(
        &admin_url,
        &format!(
            "CREATE TABLE items (id BIGINT PRIMARY KEY, c xid8 NOT NULL DEFAULT pg_current_xact_id());\n\
             CREATE ROLE {reader} LOGIN;\nGRANT SELECT ON items TO {reader};\n"
        ),
    )
    .await;
    let reader_url = admin_url.replacen("postgres@", &format!("{reader}@"), 1);
    let receiver = Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings, config) =
        items_app_into(directory.path(), &reader_url, json!({"cursorKind": "xid"}), &receiver.url);
    std::fs::create_dir_all(app.root.join("watchdog")).unwrap();
    let watchdog = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
        "watchdog": {"horizonHeldAfterSeconds": 2, "state": {"connection": "STATE"}}
    });
    std::fs::write(app.root.join("watchdog/function.json"), serde_json::to_vec(&watchdog).unwrap()).unwrap();

    let (holder_writer, pid) =
        open_late_writer(&admin_url, "BEGIN", "INSERT INTO items (id) VALUES (1)", "SELECT pg_backend_pid()::int8")
            .await;
    execute(&admin_url, "INSERT INTO items (id) VALUES (2);\n").await;
    let (poller, _sink) = poller_with(config, Arc::new(MemoryStore::new()));
    // The oldest holder of the server is named: wait out another test's older transaction.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let holder = loop {
        let holder = poller.source.horizon_holder().await.unwrap().expect("a transaction holds the horizon");
        if holder.pid == Some(pid) || std::time::Instant::now() > deadline {
            break holder;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(holder.pid, Some(pid), "{holder:?}");
    assert_eq!(holder.age_seconds, None, "this role cannot see its start: unknown, never 0");
    assert_eq!(holder.role.as_deref(), Some("postgres"), "who it is stays visible");
    assert!(holder.transaction.is_some(), "its xid is visible: the watchdog recognises it");

    let (quiet, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(quiet && stdout.contains("findings=0"), "first sight: {stdout}");
    tokio::time::sleep(Duration::from_millis(2_300)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let stdout = loop {
        let (_, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
        if stdout.contains(&format!("held by pid {pid} ")) || std::time::Instant::now() > deadline {
            break stdout;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(stdout.contains("finding=horizon_held function=orders poller=orders"), "{stdout}");
    assert!(
        stdout.contains("open for a time this role cannot see") && stdout.contains("seen holding for at least"),
        "{stdout}"
    );
    assert!(!stdout.contains("INSERT INTO items"), "no other session's query in the watchdog's output: {stdout}");
    holder_writer.commit().await;
}
