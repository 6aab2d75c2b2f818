//! The commit horizon (issue 26, sections 1, 2 and 4): an `xid` cursor on PostgreSQL and
//! `settle: "auto"` on PostgreSQL and MariaDB deliver a row whose transaction commits long after
//! it was stamped, in order, nothing skipped; the DDL `dbtrigger sql` prints runs twice on a real
//! server and a poller then works on the table; `status` names what holds the horizon back.

use std::sync::Arc;
use std::time::Duration;

use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::horizon::Horizon;
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, TickOutcome};
use serde_json::{Value, json};

mod edges;
mod replicas;

use crate::harness::{AppRoot, Receiver, run_dbtrigger};
use crate::services::{mariadb, postgres};
use crate::sources::{execute, poller_with};

/// The poller `orders` on table `items` (pk `id`) of `url`, with `source` fields added, its app
/// root in `directory`; its settings for the binary.
pub(crate) fn items_app(
    directory: &std::path::Path,
    url: &str,
    source: Value,
) -> (AppRoot, Vec<(String, String)>, PollerConfig) {
    items_app_into(directory, url, source, "http://127.0.0.1:9/unused")
}

/// [`items_app`], delivering to `hook`.
pub(crate) fn items_app_into(
    directory: &std::path::Path,
    url: &str,
    source: Value,
    hook: &str,
) -> (AppRoot, Vec<(String, String)>, PollerConfig) {
    let mut full = json!({"connection": "ITEMS_DB", "table": "items", "cursor": "c", "pk": ["id"]});
    for (key, value) in source.as_object().unwrap() {
        full[key] = value.clone();
    }
    let app = AppRoot::write(
        directory,
        json!({
            "source": full,
            "batch": {"size": 100},
            "sink": {"type": "webhook", "url": hook},
            "state": {"connection": "STATE"}
        }),
    );
    let settings = vec![
        ("ITEMS_DB".to_string(), url.to_string()),
        ("STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];
    let pairs: Vec<(&str, &str)> = settings.iter().map(|(key, value)| (key.as_str(), value.as_str())).collect();
    let config = PollerConfig::load(&app.root, "orders", &Settings::from_pairs(pairs), None).unwrap();
    (app, settings, config)
}

/// The ids delivered so far, in delivery order, with each event's cursor.
pub(crate) fn delivered(sink: &RecordingSink) -> Vec<(i64, Value)> {
    sink.batches()
        .iter()
        .flat_map(|batch| batch.events.iter().map(|event| (event.row()["id"].as_i64().unwrap(), event.cursor())))
        .collect()
}

pub(crate) fn ids(sink: &RecordingSink) -> Vec<i64> {
    delivered(sink).into_iter().map(|(id, _)| id).collect()
}

/// The cursors of the delivered events strictly increase: every row in (cursor, pk) order, none
/// twice, so none could have been passed and delivered late.
pub(crate) fn assert_in_cursor_order(sink: &RecordingSink, as_number: impl Fn(&Value) -> String) {
    let events = delivered(sink);
    for pair in events.windows(2) {
        let (left, right) = (as_number(&pair[0].1), as_number(&pair[1].1));
        assert!(
            (left.len(), &left, pair[0].0) < (right.len(), &right, pair[1].0),
            "out of order: {:?} then {:?}",
            pair[0],
            pair[1]
        );
    }
}

/// What a plain keyset poller does in the same scenario: it delivers `after` and passes `late`
/// (never delivering it, or only after `after`). The control that shows the scenario is the loss.
fn assert_passed(control: &RecordingSink, late: i64, after: i64) {
    let order = ids(control);
    let position = |id: i64| order.iter().position(|delivered| *delivered == id);
    let passed = match (position(late), position(after)) {
        (None, Some(_)) => true,
        (Some(late_at), Some(after_at)) => late_at > after_at,
        _ => false,
    };
    assert!(passed, "the control poller did not pass row {late}: {order:?} (the scenario proves nothing)");
}

pub(crate) fn xid_text(cursor: &Value) -> String {
    cursor.as_str().expect("an xid cursor is a string").to_string()
}

pub(crate) fn timestamp_text(cursor: &Value) -> String {
    // RFC 3339 in UTC with the same layout sorts as text; pad the fraction so lengths agree.
    let text = cursor.as_str().unwrap().trim_end_matches('Z');
    let (seconds, fraction) = text.split_once('.').unwrap_or((text, ""));
    format!("{seconds}.{fraction:0<9}")
}

pub(crate) async fn tick(poller: &Poller) -> TickOutcome {
    poller.tick().await.unwrap()
}

/// Ticks until `sink` holds `expected` (at most ten seconds), then asserts it. An xid cursor's
/// commit horizon is the whole server's: a write transaction another test holds open on the
/// shared PostgreSQL at that moment, in any database, holds these rows back too (it never lets
/// one pass). So delivery is awaited; what must wait is still asserted at once, by the callers.
async fn tick_until(poller: &Poller, sink: &RecordingSink, expected: &[i64], why: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        tick(poller).await;
        let delivered = ids(sink);
        if delivered.len() >= expected.len() || std::time::Instant::now() > deadline {
            assert_eq!(delivered, expected, "{why}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Issue 26, item 2: the DDL `dbtrigger sql` prints for an xid cursor runs twice on PostgreSQL
/// (idempotent), grants the poller's own role what status reads, and a poller connecting as
/// that role then delivers inserts and updates, its checkpoint an `xid`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_printed_xid_ddl_runs_twice_and_the_poller_then_reads_the_table() {
    printed_xid_ddl_runs_twice_on(postgres()).await;
}

/// [`the_printed_xid_ddl_runs_twice_and_the_poller_then_reads_the_table`] on `server`.
pub(crate) async fn printed_xid_ddl_runs_twice_on(server: &crate::services::Postgres) {
    let admin_url = server.fresh_database().await;
    let reader = format!("reader_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    execute(
        &admin_url,
        &format!(
            "CREATE TABLE items (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, note TEXT NOT NULL);\n\
             INSERT INTO items (note) VALUES ('before the column');\n\
             CREATE ROLE {reader} LOGIN;\n\
             GRANT SELECT ON items TO {reader};\n"
        ),
    )
    .await;
    let reader_url = admin_url.replacen("postgres@", &format!("{reader}@"), 1);
    let directory = tempfile::tempdir().unwrap();
    let (app, settings, config) = items_app(directory.path(), &reader_url, json!({"cursorKind": "xid"}));

    let (printed, ddl, stderr) = run_dbtrigger(&app, &settings, &["sql", "orders"]);
    assert!(printed, "dbtrigger sql failed: {stderr}");
    assert!(ddl.contains("xid8 NOT NULL DEFAULT pg_current_xact_id()"), "{ddl}");
    assert!(ddl.contains(&format!("GRANT pg_read_all_stats TO \"{reader}\";")), "{ddl}");
    let admin = sqlx::PgPool::connect(&admin_url).await.unwrap();
    for run in 1..=2 {
        if let Err(error) = sqlx::raw_sql(sqlx::AssertSqlSafe(ddl.clone())).execute(&admin).await {
            panic!("run {run} of the printed DDL failed: {error}\n{ddl}");
        }
    }
    let member: bool = sqlx::query_scalar("SELECT pg_has_role($1, 'pg_read_all_stats', 'USAGE')")
        .bind(&reader)
        .fetch_one(&admin)
        .await
        .unwrap();
    assert!(member, "the grant names the role the poller connects as");

    let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
    // Two transactions (one simple query with two statements would be one transaction).
    sqlx::raw_sql("INSERT INTO items (note) VALUES ('a'), ('b')").execute(&admin).await.unwrap();
    sqlx::raw_sql("UPDATE items SET note = 'touched' WHERE id = 1").execute(&admin).await.unwrap();
    tick_until(&poller, &sink, &[2, 3, 1], "the row restamped by the update comes last").await;
    // The row from before the column was stamped by the ALTER and restamped by the UPDATE (a
    // later transaction than the inserts): it comes last.
    assert_in_cursor_order(&sink, xid_text);
    // An INSERT that writes the column itself is restamped by the trigger: it cannot go behind.
    sqlx::raw_sql("INSERT INTO items (note, c) VALUES ('forged', '3'::xid8)").execute(&admin).await.unwrap();
    tick_until(&poller, &sink, &[2, 3, 1, 4], "the forged xid was restamped").await;
    assert_in_cursor_order(&sink, xid_text);
    let document = poller.store.read(&poller.key()).await.unwrap().unwrap().document;
    let checkpoint = serde_json::to_value(&document.checkpoint.unwrap().cursor).unwrap();
    assert_eq!(checkpoint["kind"], "xid");
    assert_eq!(checkpoint["value"], delivered(&sink)[3].1, "the checkpoint is the last event's xid, as a string");
    admin.close().await;
}

/// Issue 26, items 1, 3 and 4: transaction A takes its xid, and holds it open past any settle
/// while another transaction that took its xid before A commits (delivered) and later ones commit
/// (held behind A). Status names A's session. When A commits, its row and the later ones arrive,
/// in order: nothing passed, nothing late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_cursor_delivers_a_late_commit_in_order() {
    xid_late_commit_on(postgres()).await;
}

/// [`an_xid_cursor_delivers_a_late_commit_in_order`] on `server`.
pub(crate) async fn xid_late_commit_on(server: &crate::services::Postgres) {
    let url = server.fresh_database().await;
    execute(
        &url,
        "CREATE TABLE items (id BIGINT PRIMARY KEY, c xid8 NOT NULL DEFAULT pg_current_xact_id(), note TEXT);\n\
         CREATE INDEX items_seek ON items (c, id);\n\
         INSERT INTO items (id, note) VALUES (1, 'committed first');\n",
    )
    .await;
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) = items_app(directory.path(), &url, json!({"cursorKind": "xid"}));
    let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
    let writers = sqlx::PgPool::connect(&url).await.unwrap();

    let mut before = writers.begin().await.unwrap();
    sqlx::query("INSERT INTO items (id, note) VALUES (2, 'took its xid before A')")
        .execute(&mut *before)
        .await
        .unwrap();
    let mut late = writers.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *late).await.unwrap();
    sqlx::query("INSERT INTO items (id, note) VALUES (3, 'A: commits late')").execute(&mut *late).await.unwrap();
    before.commit().await.unwrap();
    sqlx::raw_sql("INSERT INTO items (id, note) VALUES (4, 'after A')").execute(&writers).await.unwrap();
    sqlx::raw_sql("INSERT INTO items (id, note) VALUES (5, 'after A')").execute(&writers).await.unwrap();
    tick_until(&poller, &sink, &[1, 2], "what took its xid before A is delivered; what came after waits").await;

    // Past the default settle, and more: the horizon does not guess, it waits for A.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(matches!(tick(&poller).await, TickOutcome::Idle), "nothing is passed while A is open");
    // The oldest holder of the server is named: wait out another test's older transaction.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let holder = loop {
        let holder = poller.source.horizon_holder().await.unwrap().expect("A holds the horizon");
        if holder.pid == Some(i64::from(pid)) || std::time::Instant::now() > deadline {
            break holder;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(holder.holds, Horizon::CommitHorizon);
    assert_eq!(holder.pid, Some(i64::from(pid)));
    assert_eq!(holder.state.as_deref(), Some("idle in transaction"));
    assert!(holder.age_seconds.unwrap() >= 2.0, "{holder:?}");
    assert_eq!(holder.query.as_deref(), Some("INSERT INTO items (id, note) VALUES (3, …"), "a short prefix only");
    let status = dbtrigger::status::of_poller("orders", &poller, chrono::Utc::now()).await;
    assert_eq!(status.horizon_holder.as_ref().map(|shown| shown.pid), Some(Some(i64::from(pid))));
    assert_eq!(status.lag_rows, Some(2), "4 and 5 wait (A's row is not visible yet)");

    late.commit().await.unwrap();
    tick_until(&poller, &sink, &[1, 2, 3, 4, 5], "A committed: its row and the later ones").await;
    assert_in_cursor_order(&sink, xid_text);
    let status = dbtrigger::status::of_poller("orders", &poller, chrono::Utc::now()).await;
    assert_eq!((status.lag_rows, status.horizon_holder), (Some(0), None));
    writers.close().await;
}

/// Issue 26, item 4: an identity key taken in one order and committed in the other (the loss an
/// integer cursor cannot see): with an xid cursor neither row is passed; both arrive, in the
/// order of their transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_xid_transactions_committing_out_of_order_both_arrive() {
    let url = postgres().fresh_database().await;
    execute(
        &url,
        "CREATE TABLE items (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
         c xid8 NOT NULL DEFAULT pg_current_xact_id(), k UUID NOT NULL UNIQUE DEFAULT gen_random_uuid(), note TEXT);\n",
    )
    .await;
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) = items_app(directory.path(), &url, json!({"cursorKind": "xid"}));
    let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
    let control_directory = tempfile::tempdir().unwrap();
    let (_, _, control_config) = items_app(control_directory.path(), &url, json!({"cursor": "id", "pk": ["k"]}));
    let (control, control_sink) = poller_with(control_config, Arc::new(MemoryStore::new()));
    let writers = sqlx::PgPool::connect(&url).await.unwrap();
    let mut first = writers.begin().await.unwrap();
    sqlx::query("INSERT INTO items (note) VALUES ('first, commits second')").execute(&mut *first).await.unwrap();
    let mut second = writers.begin().await.unwrap();
    sqlx::query("INSERT INTO items (note) VALUES ('second, commits first')").execute(&mut *second).await.unwrap();
    second.commit().await.unwrap();
    assert!(matches!(tick(&poller).await, TickOutcome::Idle), "the second waits for the first");
    tick(&control).await;
    first.commit().await.unwrap();
    tick(&control).await;
    tick_until(&poller, &sink, &[1, 2], "both transactions ended").await;
    assert_passed(&control_sink, 1, 2);
    assert_in_cursor_order(&sink, xid_text);
    writers.close().await;
}

/// The database's late-commit scenario for `settle: "auto"`: row 1 is delivered; transaction A
/// stamps row 2 and stays open past settleSeconds while rows 3 and 4 are inserted and committed
/// (held behind A's start, not delivered past it); A commits; 2, 3 and 4 arrive in order. A
/// control poller with settleSeconds alone passes row 2 in the same run.
async fn settle_auto_scenario(url: &str, begin_late: &str, insert: &str, pid_sql: &str) {
    let directory = tempfile::tempdir().unwrap();
    let (_app, _settings, config) = items_app(directory.path(), url, json!({"settle": "auto", "settleSeconds": 1}));
    let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
    // The control: the same table read with settleSeconds 1 alone.
    let control_directory = tempfile::tempdir().unwrap();
    let (_, _, control_config) = items_app(control_directory.path(), url, json!({"settleSeconds": 1}));
    let (control, control_sink) = poller_with(control_config, Arc::new(MemoryStore::new()));
    let insert = |id: i64| insert.replace("{id}", &id.to_string());
    execute(url, &format!("{};\n", insert(1))).await;
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    tick(&poller).await;
    tick(&control).await;
    assert_eq!(ids(&sink), vec![1]);

    let (late, late_pid) = open_late_writer(url, begin_late, &insert(2), pid_sql).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    execute(url, &format!("{};\n{};\n", insert(3), insert(4))).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(matches!(tick(&poller).await, TickOutcome::Idle), "3 and 4 wait behind A's start: {:?}", ids(&sink));
    tick(&control).await;
    let holder = poller.source.horizon_holder().await.unwrap().expect("A holds the bound");
    assert_eq!((holder.holds, holder.pid), (Horizon::SettleBound, Some(late_pid)), "{holder:?}");
    assert!(holder.age_seconds.unwrap() >= 1.0, "{holder:?}");

    late.commit().await;
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    tick(&poller).await;
    tick(&control).await;
    assert_eq!(ids(&sink), vec![1, 2, 3, 4], "A's row arrived, in order, before the rows stamped after it");
    assert_passed(&control_sink, 2, 3);
    assert_in_cursor_order(&sink, timestamp_text);
}

/// A transaction left open on its own connection.
pub(crate) enum LateWriter {
    Postgres(sqlx::PgConnection),
    MySql(sqlx::MySqlConnection),
}

impl LateWriter {
    pub(crate) async fn commit(self) {
        match self {
            LateWriter::Postgres(mut connection) => {
                sqlx::raw_sql("COMMIT").execute(&mut connection).await.unwrap();
            }
            LateWriter::MySql(mut connection) => {
                sqlx::raw_sql("COMMIT").execute(&mut connection).await.unwrap();
            }
        }
    }
}

pub(crate) async fn open_late_writer(url: &str, begin: &str, insert: &str, pid_sql: &str) -> (LateWriter, i64) {
    use sqlx::Connection as _;
    if url.starts_with("postgres") {
        let mut connection = sqlx::PgConnection::connect(url).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(begin.to_string())).execute(&mut connection).await.unwrap();
        let pid: i64 =
            sqlx::query_scalar(sqlx::AssertSqlSafe(pid_sql.to_string())).fetch_one(&mut connection).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(insert.to_string())).execute(&mut connection).await.unwrap();
        (LateWriter::Postgres(connection), pid)
    } else {
        let mut connection = sqlx::MySqlConnection::connect(url).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(begin.to_string())).execute(&mut connection).await.unwrap();
        let pid: i64 =
            sqlx::query_scalar(sqlx::AssertSqlSafe(pid_sql.to_string())).fetch_one(&mut connection).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(insert.to_string())).execute(&mut connection).await.unwrap();
        (LateWriter::MySql(connection), pid)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_auto_on_postgres_delivers_a_late_commit_in_order() {
    let url = postgres().fresh_database().await;
    execute(&url, "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ NOT NULL DEFAULT now(), note TEXT);\n")
        .await;
    settle_auto_scenario(&url, "BEGIN", "INSERT INTO items (id) VALUES ({id})", "SELECT pg_backend_pid()::int8").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_auto_on_mariadb_delivers_a_late_commit_in_order() {
    let url = mariadb().fresh_database().await;
    execute(
        &url,
        "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) \
         ON UPDATE CURRENT_TIMESTAMP(6), note TEXT);\n",
    )
    .await;
    settle_auto_scenario(
        &url,
        "BEGIN",
        "INSERT INTO items (id) VALUES ({id})",
        "SELECT CAST(CONNECTION_ID() AS SIGNED)",
    )
    .await;
}

/// Issue 26, item 2: the settle "auto" DDL runs twice on PostgreSQL and on MariaDB, grants the
/// poller's account what the bound reads, and the poller (connecting as that account) delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_printed_settle_auto_ddl_runs_twice_on_postgres_and_mariadb() {
    let reader = format!("reader_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    // PostgreSQL: the column is added by the DDL.
    let admin_url = postgres().fresh_database().await;
    execute(
        &admin_url,
        &format!(
            "CREATE TABLE items (id BIGINT PRIMARY KEY, note TEXT);\nCREATE ROLE {reader} LOGIN;\nGRANT SELECT ON items TO {reader};\n"
        ),
    )
    .await;
    let reader_url = admin_url.replacen("postgres@", &format!("{reader}@"), 1);
    // MariaDB: the column exists (MySQL cannot add one only if missing); the DDL makes it stamped.
    let maria_admin_url = mariadb().fresh_database().await;
    let database = maria_admin_url.rsplit('/').next().unwrap().to_string();
    execute(
        &maria_admin_url,
        &format!(
            "CREATE TABLE items (id BIGINT PRIMARY KEY, c DATETIME NULL, note TEXT);\n\
             CREATE USER '{reader}'@'%';\n\
             GRANT SELECT ON {database}.* TO '{reader}'@'%';\n"
        ),
    )
    .await;
    let maria_reader_url = maria_admin_url.replacen("root@", &format!("{reader}@"), 1);

    for (admin, url) in [(&admin_url, &reader_url), (&maria_admin_url, &maria_reader_url)] {
        let directory = tempfile::tempdir().unwrap();
        let (app, settings, config) = items_app(directory.path(), url, json!({"settle": "auto"}));
        let (printed, ddl, stderr) = run_dbtrigger(&app, &settings, &["sql", "orders"]);
        assert!(printed, "dbtrigger sql failed: {stderr}");
        for run in 1..=2 {
            let result = if admin.starts_with("postgres") {
                let pool = sqlx::PgPool::connect(admin).await.unwrap();
                sqlx::raw_sql(sqlx::AssertSqlSafe(ddl.clone())).execute(&pool).await.map(|_| ())
            } else {
                let pool = sqlx::MySqlPool::connect(admin).await.unwrap();
                sqlx::raw_sql(sqlx::AssertSqlSafe(ddl.clone())).execute(&pool).await.map(|_| ())
            };
            if let Err(error) = result {
                panic!("run {run} of the printed DDL failed: {error}\n{ddl}");
            }
        }
        execute(
            admin,
            "INSERT INTO items (id, note) VALUES (1, 'a');\nINSERT INTO items (id, note) VALUES (2, 'b');\n",
        )
        .await;
        let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        tick(&poller).await;
        assert_eq!(ids(&sink), vec![1, 2], "{url}");
        // The account sees what the bound needs: no fallback to settleSeconds alone. A held
        // transaction of the admin account is named by the holder query, which needs it too.
        let (writer, pid) = if admin.starts_with("postgres") {
            open_late_writer(
                admin,
                "BEGIN",
                "UPDATE items SET note = 'held' WHERE id = 1",
                "SELECT pg_backend_pid()::int8",
            )
            .await
        } else {
            open_late_writer(
                admin,
                "BEGIN",
                "UPDATE items SET note = 'held' WHERE id = 1",
                "SELECT CAST(CONNECTION_ID() AS SIGNED)",
            )
            .await
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let holder = poller.source.horizon_holder().await.unwrap().expect("another account's transaction is visible");
        assert_eq!(holder.pid, Some(pid), "{url}: {holder:?}");
        writer.commit().await;
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        tick(&poller).await;
        assert_eq!(ids(&sink), vec![1, 2, 1], "{url}: the update restamped the row");
    }
}

/// Issue 26, item 4: an account that cannot see other sessions (PostgreSQL without
/// pg_read_all_stats, MariaDB without PROCESS) still polls under `settle: "auto"`, bounded by
/// settleSeconds alone for what it cannot see, and the tick says so in its log, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_privilege_settle_auto_falls_back_to_settle_seconds_and_says_so() {
    let reader = format!("reader_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let postgres_admin = postgres().fresh_database().await;
    execute(
        &postgres_admin,
        &format!(
            "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ NOT NULL DEFAULT now());\n\
             CREATE ROLE {reader} LOGIN;\nGRANT SELECT ON items TO {reader};\n"
        ),
    )
    .await;
    let maria_admin = mariadb().fresh_database().await;
    let database = maria_admin.rsplit('/').next().unwrap().to_string();
    execute(
        &maria_admin,
        &format!(
            "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6));\n\
             CREATE USER '{reader}'@'%';\nGRANT SELECT ON {database}.* TO '{reader}'@'%';\n"
        ),
    )
    .await;
    let cases = [
        (postgres_admin.clone(), postgres_admin.replacen("postgres@", &format!("{reader}@"), 1), "pg_read_all_stats"),
        (maria_admin.clone(), maria_admin.replacen("root@", &format!("{reader}@"), 1), "PROCESS"),
    ];
    for (admin, url, privilege) in cases {
        let receiver = Receiver::start().await;
        let directory = tempfile::tempdir().unwrap();
        let (app, settings, _) = items_app_into(directory.path(), &url, json!({"settle": "auto"}), &receiver.url);
        execute(&admin, "INSERT INTO items (id) VALUES (1);\nINSERT INTO items (id) VALUES (2);\n").await;
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        let (ticked, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
        assert!(ticked, "{url}: {stdout}{stderr}");
        assert_eq!(receiver.acknowledged_ids(), vec![1, 2], "{url}");
        assert_eq!(stderr.matches(privilege).count(), 1, "{url}: one warning naming {privilege}: {stderr}");
        assert!(stderr.contains("bounded by settleSeconds alone"), "{stderr}");
    }
}

/// Issue 26, item 3, through the real binary: while a transaction holds the commit horizon with
/// rows waiting behind it, `status` names its session, and the watchdog reports `horizon_held`
/// once it is older than `horizonHeldAfterSeconds`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_the_watchdog_name_what_holds_the_horizon() {
    let url = postgres().fresh_database().await;
    execute(&url, "CREATE TABLE items (id BIGINT PRIMARY KEY, c xid8 NOT NULL DEFAULT pg_current_xact_id());\n").await;
    let receiver = Receiver::start().await;
    let directory = tempfile::tempdir().unwrap();
    let (app, settings, _) = items_app_into(directory.path(), &url, json!({"cursorKind": "xid"}), &receiver.url);
    std::fs::create_dir_all(app.root.join("watchdog")).unwrap();
    let watchdog = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
        "watchdog": {"horizonHeldAfterSeconds": 5, "state": {"connection": "STATE"}}
    });
    std::fs::write(app.root.join("watchdog/function.json"), serde_json::to_vec(&watchdog).unwrap()).unwrap();

    let (mut holder, pid) =
        open_late_writer(&url, "BEGIN", "INSERT INTO items (id) VALUES (1)", "SELECT pg_backend_pid()::int8").await;
    let opened = std::time::Instant::now();
    execute(&url, "INSERT INTO items (id) VALUES (2);\n").await;
    let (ticked, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ticked, "{stdout}{stderr}");
    // The oldest holder of the server is named: wait out another test's older transaction.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        let (_, status, _) = run_dbtrigger(&app, &settings, &["status"]);
        if status.contains(&format!("held by pid {pid} ")) || std::time::Instant::now() > deadline {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        status.contains(&format!(
            "orders: rows wait behind the commit horizon (cluster-wide), held by pid {pid} (role postgres, database t_"
        )),
        "{status}"
    );
    assert!(
        status.contains("idle in transaction") && status.contains(": INSERT INTO items (id) VALUES (1)"),
        "{status}"
    );
    let (quiet, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(quiet && stdout.contains("findings=0"), "younger than the threshold: {stdout}");

    tokio::time::sleep(Duration::from_millis(5_300).saturating_sub(opened.elapsed())).await;
    let (found, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(!found, "a finding exits 1: {stdout}");
    assert!(stdout.contains("finding=horizon_held function=orders poller=orders"), "{stdout}");
    assert!(stdout.contains(&format!("1 rows wait behind the commit horizon (cluster-wide: it holds every xid poller of the server), held by pid {pid}")), "{stdout}");
    assert!(!stdout.contains("INSERT INTO items"), "the watchdog never shows another session's query: {stdout}");
    if let LateWriter::Postgres(connection) = &mut holder {
        sqlx::raw_sql("ROLLBACK").execute(connection).await.unwrap();
    }
    // Row 2 is delivered once no older transaction of the server is open (another test's may be).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (ticked, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
        assert!(ticked, "{stdout}{stderr}");
        if !receiver.acknowledged_ids().is_empty() || std::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(receiver.acknowledged_ids(), vec![2]);
    let (quiet, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(quiet && stdout.contains("findings=0"), "the horizon moved on: {stdout}");
}
