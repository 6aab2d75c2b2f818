//! Every engine (SQLite, PostgreSQL, MariaDB) and every cursor kind, end to end through the tick:
//! each row delivered once, in (cursor, pk) order, across many ticks and batch boundaries that
//! split equal cursor values.

use std::sync::Arc;

use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::StateDocument;
use dbtrigger::domain::cursor::{CursorJson, Position};
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::source::{backlog, last_position};
use dbtrigger::store::StateKey;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, SystemClock, TickOutcome};
use serde_json::{Value, json};

use crate::harness::AppRoot;
use crate::services::{mariadb, postgres};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
    MariaDb,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Integer,
    Timestamptz,
    Naive,
    CompositeKey,
}

pub struct Database {
    pub url: String,
    _directory: Option<tempfile::TempDir>,
}

impl Database {
    /// A server database at `url` (no file of its own).
    pub fn at(url: String) -> Database {
        Database { url, _directory: None }
    }
}

pub async fn database(engine: Engine) -> Database {
    match engine {
        Engine::Sqlite => {
            let directory = tempfile::tempdir().unwrap();
            let path = directory.path().join("items.db");
            std::fs::File::create(&path).unwrap();
            Database { url: format!("sqlite://{}", path.display()), _directory: Some(directory) }
        }
        Engine::Postgres => Database { url: postgres().fresh_database().await, _directory: None },
        Engine::MariaDb => Database { url: mariadb().fresh_database().await, _directory: None },
    }
}

pub async fn execute(url: &str, sql: &str) {
    let statements: Vec<&str> = sql.split(";\n").filter(|statement| !statement.trim().is_empty()).collect();
    if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        for statement in statements {
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_string())).execute(&pool).await.unwrap();
        }
        pool.close().await;
    } else if url.starts_with("mysql") {
        let pool = sqlx::MySqlPool::connect(url).await.unwrap();
        for statement in statements {
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_string())).execute(&pool).await.unwrap();
        }
        pool.close().await;
    } else {
        let pool = sqlx::SqlitePool::connect(url).await.unwrap();
        for statement in statements {
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_string())).execute(&pool).await.unwrap();
        }
        pool.close().await;
    }
}

fn cursor_type(engine: Engine, kind: Kind) -> &'static str {
    match (engine, kind) {
        (_, Kind::Integer | Kind::CompositeKey) => "BIGINT",
        (Engine::Sqlite, _) => "TEXT",
        (Engine::Postgres, Kind::Timestamptz) => "TIMESTAMPTZ",
        (Engine::Postgres, Kind::Naive) => "TIMESTAMP",
        (Engine::MariaDb, Kind::Timestamptz) => "TIMESTAMP(6) NULL",
        (Engine::MariaDb, Kind::Naive) => "DATETIME(6)",
    }
}

fn create_table(engine: Engine, kind: Kind) -> String {
    let text = if engine == Engine::MariaDb { "VARCHAR(20)" } else { "TEXT" };
    let (columns, key) = match kind {
        Kind::CompositeKey => (format!("tenant {text} NOT NULL, id BIGINT NOT NULL"), "tenant, id"),
        _ => ("id BIGINT NOT NULL".to_string(), "id"),
    };
    format!(
        "CREATE TABLE items ({columns}, c {} NOT NULL, note {text}, PRIMARY KEY ({key}));\nCREATE INDEX items_seek ON items (c, {key});\n",
        cursor_type(engine, kind)
    )
}

/// The literal of cursor value number `step` (three rows share each).
fn cursor_literal(kind: Kind, step: i64) -> String {
    match kind {
        Kind::Integer | Kind::CompositeKey => step.to_string(),
        Kind::Timestamptz | Kind::Naive => {
            let at = chrono::NaiveDate::from_ymd_opt(2026, 1, 1).unwrap().and_hms_micro_opt(10, 0, 0, 0).unwrap()
                + chrono::Duration::microseconds(step * 1_250_001);
            format!("'{}'", at.format("%Y-%m-%d %H:%M:%S%.6f"))
        }
    }
}

/// Row number `n`: its key (as delivered) and its insert values.
fn row(kind: Kind, n: i64) -> (Value, String) {
    let cursor = cursor_literal(kind, n / 3);
    match kind {
        Kind::CompositeKey => {
            let tenant = if n % 2 == 0 { "a" } else { "b" };
            (json!({"tenant": tenant, "id": n}), format!("('{tenant}', {n}, {cursor}, 'row {n}')"))
        }
        _ => (json!({"id": n}), format!("({n}, {cursor}, 'row {n}')")),
    }
}

async fn insert(url: &str, kind: Kind, rows: std::ops::RangeInclusive<i64>) {
    let values: Vec<String> = rows.map(|n| row(kind, n).1).collect();
    execute(url, &format!("INSERT INTO items VALUES {};\n", values.join(", "))).await;
}

fn poller(url: &str, kind: Kind, directory: &std::path::Path) -> (Poller, Arc<RecordingSink>, Arc<MemoryStore>) {
    let pk = if kind == Kind::CompositeKey { json!(["tenant", "id"]) } else { json!(["id"]) };
    let app = AppRoot::write(
        directory,
        json!({
            "source": {"connection": "ITEMS_DB", "table": "items", "cursor": "c", "pk": pk, "settleSeconds": 0},
            "batch": {"size": 7},
            "sink": {"type": "webhook", "url": "http://127.0.0.1:9/unused"},
            "state": {"connection": "STATE"}
        }),
    );
    let settings = Settings::from_pairs([("ITEMS_DB", url), ("STATE", "file:unused")]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    let sink = Arc::new(RecordingSink::new());
    let store = Arc::new(MemoryStore::new());
    let source = dbtrigger::source::open(&config.source).unwrap();
    let poller = Poller::new(config, source, sink.clone(), store.clone(), Arc::new(SystemClock), "it".into());
    (poller, sink, store)
}

async fn end_to_end(engine: Engine, kind: Kind) {
    end_to_end_in(database(engine).await, engine, kind).await;
}

/// [`end_to_end`] in `database` (of `engine`): the compatibility suite runs it on each
/// PostgreSQL major.
pub(crate) async fn end_to_end_in(database: Database, engine: Engine, kind: Kind) {
    execute(&database.url, &create_table(engine, kind)).await;
    let directory = tempfile::tempdir().unwrap();
    let (poller, sink, store) = poller(&database.url, kind, directory.path());

    // Rows arrive between ticks; 3 rows per cursor value and batches of 7 split the ties.
    for (from, to) in [(1, 20), (21, 22), (23, 60)] {
        insert(&database.url, kind, from..=to).await;
        let outcome = poller.tick().await.unwrap_or_else(|error| panic!("{engine:?} {kind:?}: {error}"));
        assert!(matches!(outcome, TickOutcome::Delivered { .. }), "{engine:?} {kind:?}: {outcome:?}");
    }
    assert_eq!(poller.tick().await.unwrap(), TickOutcome::Idle, "{engine:?} {kind:?}");

    let delivered: Vec<Value> =
        sink.batches().iter().flat_map(|batch| batch.events.iter().map(|event| Value::Object(event.pk()))).collect();
    // Expected: (cursor, pk) order. Cursor steps are n / 3; within a step, the key order.
    let mut expected: Vec<(i64, String, i64, Value)> = (1..=60)
        .map(|n| {
            let key = row(kind, n).0;
            let tenant = key["tenant"].as_str().unwrap_or_default().to_string();
            (n / 3, tenant, n, key)
        })
        .collect();
    expected.sort_by(|left, right| (left.0, &left.1, left.2).cmp(&(right.0, &right.1, right.2)));
    let expected: Vec<Value> = expected.into_iter().map(|(_, _, _, key)| key).collect();
    assert_eq!(delivered, expected, "{engine:?} {kind:?}: every row once, in (cursor, pk) order");

    let document = StateDocument::parse(&store.raw(&StateKey::new("local", "orders")).unwrap()).unwrap();
    let cursor = document.checkpoint.unwrap().cursor;
    let expected_kind = match (engine, kind) {
        (_, Kind::Integer | Kind::CompositeKey) => "integer",
        (Engine::Postgres | Engine::MariaDb, Kind::Naive) => "timestamp_naive",
        _ => "timestamp",
    };
    assert_eq!(cursor.kind, expected_kind, "{engine:?} {kind:?}");
    // The row's values arrive typed.
    let first = &sink.batches()[0].events[0];
    assert_eq!(first.row()["note"], json!(format!("row {}", first.pk()["id"])), "{engine:?} {kind:?}");

    // What `status` and `reset --to-end` ask of the source: the backlog after the checkpoint
    // (counted up to a cap, and its first row) and the last row.
    let source = poller.source.as_ref();
    let checkpoint = Position::try_from(&cursor).unwrap();
    let caught_up = backlog(source, Some(&checkpoint), 1000).await.unwrap();
    assert_eq!((caught_up.rows, caught_up.capped, caught_up.oldest), (0, false, None), "{engine:?} {kind:?}");
    insert(&database.url, kind, 61..=66).await;
    let waiting = backlog(source, Some(&checkpoint), 1000).await.unwrap();
    assert_eq!((waiting.rows, waiting.capped), (6, false), "{engine:?} {kind:?}");
    let capped = backlog(source, Some(&checkpoint), 4).await.unwrap();
    assert_eq!((capped.rows, capped.capped), (4, true), "{engine:?} {kind:?}: counted up to the cap");
    assert_eq!(backlog(source, None, 1000).await.unwrap().rows, 66, "{engine:?} {kind:?}: from the start");
    let last = last_position(source).await.unwrap().expect("a last row");
    assert_eq!(last.pk[last.pk.len() - 1].1.to_json(), json!(66), "{engine:?} {kind:?}: the last row");
    let batches_before = sink.batches().len();
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Delivered { rows: 6, .. }), "{engine:?} {kind:?}");
    let next = &sink.batches()[batches_before].events[0];
    assert_eq!(Some(next.cursor()), waiting.oldest.map(|oldest| oldest.to_json()), "{engine:?} {kind:?}");
    assert_eq!(Position::try_from(&CursorJson::from(&last)).unwrap(), last, "{engine:?} {kind:?}");
    let after_last = backlog(source, Some(&last), 1000).await.unwrap();
    assert_eq!(after_last.rows, 0, "{engine:?} {kind:?}: nothing after the last row");
}

macro_rules! end_to_end_tests {
    ($($name:ident: $engine:expr, $kind:expr;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                end_to_end($engine, $kind).await;
            }
        )*
    };
}

end_to_end_tests! {
    sqlite_integer_cursor: Engine::Sqlite, Kind::Integer;
    sqlite_timestamp_cursor: Engine::Sqlite, Kind::Timestamptz;
    sqlite_composite_key: Engine::Sqlite, Kind::CompositeKey;
    postgres_integer_cursor: Engine::Postgres, Kind::Integer;
    postgres_timestamptz_cursor: Engine::Postgres, Kind::Timestamptz;
    postgres_naive_timestamp_cursor: Engine::Postgres, Kind::Naive;
    postgres_composite_key: Engine::Postgres, Kind::CompositeKey;
    mariadb_integer_cursor: Engine::MariaDb, Kind::Integer;
    mariadb_timestamp_cursor: Engine::MariaDb, Kind::Timestamptz;
    mariadb_datetime_cursor: Engine::MariaDb, Kind::Naive;
    mariadb_composite_key: Engine::MariaDb, Kind::CompositeKey;
}

/// The configuration of a poller on table `items` (cursor `c`, pk `id`) of `url`, with extra
/// `source` fields and batches of `size`.
pub fn items_config(url: &str, source_extra: Value, size: usize) -> (PollerConfig, tempfile::TempDir) {
    let directory = tempfile::tempdir().unwrap();
    let mut source = json!({"connection": "ITEMS_DB", "table": "items", "cursor": "c", "pk": ["id"]});
    for (key, value) in source_extra.as_object().unwrap() {
        source[key] = value.clone();
    }
    let app = AppRoot::write(
        directory.path(),
        json!({
            "source": source,
            "batch": {"size": size},
            "sink": {"type": "webhook", "url": "http://127.0.0.1:9/unused"},
            "state": {"connection": "STATE"}
        }),
    );
    let settings = Settings::from_pairs([("ITEMS_DB", url), ("STATE", "file:unused")]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    (config, directory)
}

/// A poller of `config` into a recording sink, with its state in `store`.
pub fn poller_with(config: PollerConfig, store: Arc<MemoryStore>) -> (Poller, Arc<RecordingSink>) {
    let sink = Arc::new(RecordingSink::new());
    let source = dbtrigger::source::open(&config.source).unwrap();
    let poller = Poller::new(config, source, sink.clone(), store, Arc::new(SystemClock), "it".into());
    (poller, sink)
}

/// A poller on table `items` (cursor `c`, pk `id`) of `url`, with extra `source` fields.
fn items_poller(url: &str, source_extra: Value) -> (Poller, Arc<RecordingSink>, tempfile::TempDir) {
    let (config, directory) = items_config(url, source_extra, 100);
    let (poller, sink) = poller_with(config, Arc::new(MemoryStore::new()));
    (poller, sink, directory)
}

fn delivered_ids(sink: &RecordingSink) -> Vec<i64> {
    sink.batches()
        .iter()
        .flat_map(|batch| batch.events.iter().map(|event| event.pk()["id"].as_i64().unwrap()))
        .collect()
}

/// The classic keyset-polling loss, and what `settleSeconds` does about it. Transaction A takes
/// its timestamp first but commits after transaction B. Without settle, the poller reads B,
/// moves the checkpoint past A's timestamp, and A is never delivered. With settle, B is too
/// young to read at first; when it is read, A is there too, and both arrive.
async fn late_commit(settle_seconds: u64) -> Vec<i64> {
    let url = postgres().fresh_database().await;
    execute(&url, "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ NOT NULL, note TEXT);\n").await;
    let (poller, sink, _directory) = items_poller(&url, json!({"settleSeconds": settle_seconds}));

    // A is 1 s older than B, but B commits first and a tick runs in between.
    execute(&url, "INSERT INTO items VALUES (2, now(), 'B commits first');\n").await;
    poller.tick().await.unwrap();
    execute(&url, "INSERT INTO items VALUES (1, now() - interval '1 second', 'A commits late');\n").await;
    tokio::time::sleep(std::time::Duration::from_millis(settle_seconds * 1000 + 500)).await;
    poller.tick().await.unwrap();
    sink.batches()
        .iter()
        .flat_map(|batch| batch.events.iter().map(|event| event.pk()["id"].as_i64().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_settle_a_late_commit_is_lost() {
    assert_eq!(late_commit(0).await, vec![2], "A was skipped: this is the loss settle prevents");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_settle_a_late_commit_is_delivered() {
    assert_eq!(late_commit(2).await, vec![1, 2]);
}

/// The server may drop a pooled connection between ticks (a restart, an idle timeout, a
/// failover): a connection idle for a second or more is pinged before it is used, and replaced
/// when it is gone, so the next tick delivers instead of failing on a dead connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_server_dropped_between_ticks_is_replaced() {
    let url = postgres().fresh_database().await;
    execute(&url, "CREATE TABLE items (id BIGINT PRIMARY KEY, c BIGINT NOT NULL);\nINSERT INTO items VALUES (1, 1);\n")
        .await;
    let (poller, sink, _directory) = items_poller(&url, json!({}));
    assert!(matches!(poller.tick().await.unwrap(), TickOutcome::Delivered { rows: 1, .. }));

    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let terminated: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'dbtrigger'",
    )
    .fetch_all(&admin)
    .await
    .unwrap();
    assert!(terminated.contains(&true), "the poller's connection was not there to drop: {terminated:?}");
    sqlx::query("INSERT INTO items VALUES (2, 2)").execute(&admin).await.unwrap();
    admin.close().await;
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;

    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 1, .. }), "{outcome:?}");
    assert_eq!(delivered_ids(&sink), vec![1, 2]);
}

async fn first_row(url: &str, table_sql: &str, insert_sql: &str) -> Result<serde_json::Map<String, Value>, String> {
    execute(url, table_sql).await;
    execute(url, insert_sql).await;
    let (poller, sink, _directory) = items_poller(url, json!({}));
    poller.tick().await.map_err(|error| error.to_string())?;
    Ok(sink.batches()[0].events[0].row())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_values_become_json_without_losing_precision() {
    let url = postgres().fresh_database().await;
    let row = first_row(
        &url,
        "CREATE TABLE items (id INT PRIMARY KEY, c BIGINT NOT NULL, amount NUMERIC(30, 10), ratio DOUBLE PRECISION, \
         small SMALLINT, flag BOOLEAN, name VARCHAR(20), tag UUID, doc JSONB, raw BYTEA, day DATE, at TIMESTAMPTZ, \
         local TIMESTAMP, nothing TEXT);\n",
        "INSERT INTO items VALUES (1, 5, 12345678901234567890.0123456789, 0.5, -3, true, 'Zoë', \
         'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{\"k\": [1, 2]}', '\\x0102ff', '2026-03-04', \
         '2026-03-04 05:06:07.123456+02', '2026-03-04 05:06:07.5', NULL);\n",
    )
    .await
    .unwrap();
    assert_eq!(
        Value::Object(row),
        json!({
            "id": 1, "c": 5, "amount": "12345678901234567890.0123456789", "ratio": 0.5, "small": -3,
            "flag": true, "name": "Zoë", "tag": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "doc": {"k": [1, 2]},
            "raw": "AQL/", "day": "2026-03-04", "at": "2026-03-04T03:06:07.123456Z",
            "local": "2026-03-04T05:06:07.500", "nothing": null
        })
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_values_become_json_without_losing_precision() {
    let url = mariadb().fresh_database().await;
    let row = first_row(
        &url,
        "CREATE TABLE items (id INT PRIMARY KEY, c BIGINT NOT NULL, amount DECIMAL(30, 10), ratio DOUBLE, \
         flag BOOLEAN, name VARCHAR(20), raw VARBINARY(8), day DATE, at TIMESTAMP(6) NULL, local DATETIME(3), nothing TEXT);\n",
        "INSERT INTO items VALUES (1, 5, 12345678901234567890.0123456789, 0.5, true, 'Zoë', x'0102ff', '2026-03-04', \
         '2026-03-04 05:06:07.123456', '2026-03-04 05:06:07.5', NULL);\n",
    )
    .await
    .unwrap();
    assert_eq!(
        Value::Object(row),
        json!({
            "id": 1, "c": 5, "amount": "12345678901234567890.0123456789", "ratio": 0.5, "flag": true,
            "name": "Zoë", "raw": "AQL/", "day": "2026-03-04", "at": "2026-03-04T05:06:07.123456Z",
            "local": "2026-03-04T05:06:07.500", "nothing": null
        })
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsupported_column_type_is_named_in_the_error() {
    let url = postgres().fresh_database().await;
    let error = first_row(
        &url,
        "CREATE TABLE items (id INT PRIMARY KEY, c BIGINT NOT NULL, spot POINT);\n",
        "INSERT INTO items VALUES (1, 1, point(1, 2));\n",
    )
    .await
    .unwrap_err();
    assert!(error.contains("column \"spot\" has type POINT"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_is_a_clear_error_without_the_password() {
    let port = crate::harness::free_port();
    let url = format!("postgres://reader:s3cret-pw@127.0.0.1:{port}/shop");
    let (poller, _sink, _directory) = items_poller(&url, json!({}));
    let error = poller.tick().await.unwrap_err();
    let message = error.to_string();
    assert!(message.contains("cannot reach the database"), "{message}");
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
    assert!(!message.contains("s3cret-pw"), "{message}");
}

/// A `query` source with a `columns` projection and a `where` filter, on PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_source_with_columns_and_a_filter() {
    let url = postgres().fresh_database().await;
    execute(
        &url,
        "CREATE TABLE items (id BIGINT PRIMARY KEY, c BIGINT NOT NULL, tenant INT NOT NULL, secret TEXT, note TEXT);\n\
         INSERT INTO items SELECT g, g / 2, g % 3, 'hidden', 'row ' || g FROM generate_series(1, 40) g;\n",
    )
    .await;
    let (poller, sink, _directory) = items_poller(
        &url,
        json!({
            "table": null,
            "query": "SELECT id, c, tenant, secret, note FROM items WHERE note IS NOT NULL",
            "columns": ["note"],
            "where": "tenant = 1"
        }),
    );
    poller.tick().await.unwrap();
    let events: Vec<_> = sink.batches().iter().flat_map(|batch| batch.events.clone()).collect();
    let ids: Vec<i64> = events.iter().map(|event| event.pk()["id"].as_i64().unwrap()).collect();
    assert_eq!(ids, (1..=40).filter(|id| id % 3 == 1).collect::<Vec<i64>>());
    assert_eq!(Value::Object(events[0].row()), json!({"note": "row 1", "c": 0, "id": 1}), "only the projection");
}

async fn sqlite_items(rows: &[(i64, &str)]) -> Database {
    let database = database(Engine::Sqlite).await;
    execute(&database.url, "CREATE TABLE items (id INTEGER PRIMARY KEY, c TEXT NOT NULL, note TEXT);\n").await;
    for (id, cursor) in rows {
        execute(&database.url, &format!("INSERT INTO items (id, c, note) VALUES ({id}, '{cursor}', 'row {id}');\n"))
            .await;
    }
    database
}

/// Regression (issue 9, item 1): a cursor text in a layout SQLite's `julianday()` cannot read
/// (`+0200`) was filtered out of every fetch by the settle predicate while later rows passed it:
/// silently never delivered. Now the tick fails, naming the row and its text, and nothing after it
/// is delivered past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_cursor_sqlite_cannot_read_as_time_fails_the_tick_naming_the_row() {
    let database =
        sqlite_items(&[(1, "2026-01-01T00:00:00+00:00"), (2, "2026-01-01T00:00:01+0200"), (3, "2026-01-01T00:00:02Z")])
            .await;
    let (poller, sink, _directory) = items_poller(&database.url, json!({"settleSeconds": 2}));
    let message = poller.tick().await.unwrap_err().to_string();
    assert!(message.contains("id=2") && message.contains("+0200"), "{message}");
    assert!(delivered_ids(&sink).is_empty(), "nothing delivered past the unreadable row");

    // Fixed by the owner, the row is delivered in its place.
    execute(&database.url, "UPDATE items SET c = '2026-01-01T00:00:01+02:00' WHERE id = 2;\n").await;
    poller.tick().await.unwrap();
    assert_eq!(delivered_ids(&sink), vec![1, 2, 3]);
}

/// A row is a JSON object: a query returning two columns of one name would lose one of them (a
/// map keeps one value per key), so the tick refuses it, naming the column, and delivers nothing.
/// (PostgreSQL keeps both names in a subquery; SQLite renames the second `note:1`, MariaDB refuses
/// the query itself.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_with_two_columns_of_one_name_is_refused_naming_it() {
    let url = postgres().fresh_database().await;
    execute(
        &url,
        "CREATE TABLE items (id BIGINT PRIMARY KEY, c BIGINT NOT NULL, note TEXT);\n\
         INSERT INTO items VALUES (1, 1, 'row 1');\n",
    )
    .await;
    let (poller, sink, _directory) =
        items_poller(&url, json!({"table": null, "query": "SELECT id, c, note, note FROM items"}));
    let message = poller.tick().await.unwrap_err().to_string();
    assert!(message.contains("two columns named \"note\""), "{message}");
    assert!(delivered_ids(&sink).is_empty());
    assert!(poller.tick().await.is_err(), "refused on every tick, never half delivered");
}

/// The layouts the SQLite source accepts as cursors are exactly those SQLite's own `julianday()`
/// reads (which the settle predicate uses), checked against the real engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlite_cursor_parser_agrees_with_julianday() {
    let database = database(Engine::Sqlite).await;
    let pool = sqlx::SqlitePool::connect(&database.url).await.unwrap();
    for text in [
        "2026-01-01 10:20:30",
        "2026-01-01T10:20:30",
        "2026-01-01 10:20",
        "2026-01-01T10:20:30.123456",
        "2026-01-01T10:20:30Z",
        "2026-01-01T10:20:30z",
        "2026-01-01T10:20:30+02:00",
        "2026-01-01T10:20:30-11:30",
        "2026-01-01T10:20:30+14:00",
        "2026-01-01T10:20:30+15:00",
        "2026-01-01T10:20:30+0200",
        "2026-01-01T10:20:30+02",
        "2026-01-01t10:20:30",
        "2026-01-01T10:20:60",
        "2026-01-01 10:20:30.",
        "2026-01-01 1:20:30",
        "yesterday",
    ] {
        let readable: bool =
            sqlx::query_scalar("SELECT julianday(?) IS NOT NULL").bind(text).fetch_one(&pool).await.unwrap();
        let parsed = dbtrigger::source::sqlite_time::parse_sqlite_timestamp(text);
        assert_eq!(parsed.is_some(), readable, "{text}: parser {parsed:?}, julianday readable {readable}");
        if let Some(at) = parsed {
            let seconds: f64 = sqlx::query_scalar("SELECT (julianday(?) - 2440587.5) * 86400.0")
                .bind(text)
                .fetch_one(&pool)
                .await
                .unwrap();
            let difference = (at.timestamp_micros() as f64 / 1e6 - seconds).abs();
            assert!(difference < 0.01, "{text}: {at} vs {seconds}");
        }
    }
}

/// Regression (issue 9, item 2): the seek orders SQLite timestamps by their text; a checkpoint
/// check by instant called the commit after mixed offsets a regression, failed the tick without
/// releasing the lease, and redelivered the same rows forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_timestamps_with_mixed_offsets_commit_in_the_seek_order() {
    let database = sqlite_items(&[(1, "2026-01-01T09:00:00+00:00")]).await;
    let (poller, sink, _directory) = items_poller(&database.url, json!({}));
    poller.tick().await.unwrap();
    // After 09:00+00:00 in text order, before it in time (08:30 UTC).
    execute(&database.url, "INSERT INTO items (id, c, note) VALUES (2, '2026-01-01T10:30:00+02:00', 'row 2');\n").await;
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 1, .. }), "{outcome:?}");
    assert_eq!(poller.tick().await.unwrap(), TickOutcome::Idle, "and it is not delivered again");
    assert_eq!(delivered_ids(&sink), vec![1, 2]);
}

/// Regression (issue 9, item 3): an `infinity` date or timestamp made the driver's date arithmetic
/// overflow and panic the tick, every tick. They are delivered as the strings "infinity" and
/// "-infinity"; an infinite cursor is an error naming the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_infinite_dates_are_delivered_as_strings_and_never_panic() {
    let url = postgres().fresh_database().await;
    execute(
        &url,
        "CREATE TABLE items (id BIGINT PRIMARY KEY, c BIGINT NOT NULL, due DATE, starts TIMESTAMP, ends TIMESTAMPTZ);\n\
         INSERT INTO items VALUES (1, 1, 'infinity', '-infinity', 'infinity'), (2, 2, '-infinity', 'infinity', '-infinity'), \
         (3, 3, '2026-01-02', '2026-01-02 10:00:00', '2026-01-02 10:00:00+00');\n",
    )
    .await;
    let (poller, sink, _directory) = items_poller(&url, json!({}));
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 3, .. }), "{outcome:?}");
    let rows: Vec<serde_json::Map<String, Value>> = sink.batches()[0].events.iter().map(|event| event.row()).collect();
    assert_eq!(
        (&rows[0]["due"], &rows[0]["starts"], &rows[0]["ends"]),
        (&json!("infinity"), &json!("-infinity"), &json!("infinity"))
    );
    assert_eq!(
        (&rows[1]["due"], &rows[1]["starts"], &rows[1]["ends"]),
        (&json!("-infinity"), &json!("infinity"), &json!("-infinity"))
    );
    assert_eq!(
        (&rows[2]["due"], &rows[2]["starts"], &rows[2]["ends"]),
        (&json!("2026-01-02"), &json!("2026-01-02T10:00:00"), &json!("2026-01-02T10:00:00Z"))
    );

    let cursor_url = postgres().fresh_database().await;
    execute(
        &cursor_url,
        "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ NOT NULL);\n\
         INSERT INTO items VALUES (1, '2026-01-01 00:00:00+00'), (2, '-infinity');\n",
    )
    .await;
    let (poller, sink, _directory) = items_poller(&cursor_url, json!({}));
    let message = poller.tick().await.unwrap_err().to_string();
    assert!(message.contains("-infinity") && message.contains("id=2"), "{message}");
    assert!(sink.batches().is_empty());
}

/// Regression (issue 9, item 5): `?dbname=` in the URL points the driver at another database while
/// the URL's surface stays the same: the fingerprint follows the database really read, so the old
/// checkpoint is refused instead of skipping rows of another table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dbname_in_the_url_query_is_a_changed_source() {
    let first = postgres().fresh_database().await;
    let second = postgres().fresh_database().await;
    let second_name = second.rsplit('/').next().unwrap().to_string();
    for url in [&first, &second] {
        execute(
            url,
            "CREATE TABLE items (id BIGINT PRIMARY KEY, c BIGINT NOT NULL);\nINSERT INTO items VALUES (1, 1);\n",
        )
        .await;
    }
    let store = Arc::new(MemoryStore::new());
    let (config, _first_directory) = items_config(&first, json!({}), 100);
    let (poller, _sink) = poller_with(config, store.clone());
    poller.tick().await.unwrap();

    let (config, _second_directory) = items_config(&format!("{first}?dbname={second_name}"), json!({}), 100);
    let (poller, sink) = poller_with(config, store);
    let error = poller.tick().await.unwrap_err();
    assert!(matches!(error, dbtrigger::tick::TickError::FingerprintMismatch { .. }), "{error:?}");
    assert!(sink.batches().is_empty());
}

/// Regression (issue 9, item 7): a fetch has a timeout (`source.queryTimeoutSeconds`, also set as
/// PostgreSQL's `statement_timeout`): a query that hangs fails the tick with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_slower_than_its_timeout_fails_the_tick() {
    let url = postgres().fresh_database().await;
    execute(&url, "CREATE TABLE items (id BIGINT PRIMARY KEY, c BIGINT NOT NULL);\nINSERT INTO items VALUES (1, 1);\n")
        .await;
    let (poller, sink, _directory) =
        items_poller(&url, json!({"queryTimeoutSeconds": 1, "where": "(SELECT true FROM pg_sleep(5))"}));
    let started = std::time::Instant::now();
    let message = poller.tick().await.unwrap_err().to_string();
    assert!(started.elapsed() < std::time::Duration::from_secs(4), "{:?}", started.elapsed());
    assert!(message.contains("timeout") || message.contains("took longer than 1 s"), "{message}");
    assert!(sink.batches().is_empty());
}

/// SQLite's fetch has the same timeout: the statement is interrupted when it passes (a unit test
/// in src/source/sqlite.rs shows the connection comes free at once), and the tick fails clearly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_query_slower_than_its_timeout_fails_the_tick() {
    let database = sqlite_items(&[(1, "2026-01-01T00:00:00Z")]).await;
    let slow = "(WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < 2000000000) \
                SELECT count(*) FROM g) > 0";
    let (poller, sink, _directory) = items_poller(&database.url, json!({"queryTimeoutSeconds": 1, "where": slow}));
    let started = std::time::Instant::now();
    let message = poller.tick().await.unwrap_err().to_string();
    assert!(started.elapsed() < std::time::Duration::from_secs(4), "{:?}", started.elapsed());
    assert!(message.contains("took longer than 1 s"), "{message}");
    assert!(sink.batches().is_empty());
}

/// A SQLite file that is not there is an unreachable database (a poller never creates one), and
/// a file that is not a database says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_foreign_sqlite_file_is_a_clear_error() {
    let directory = tempfile::tempdir().unwrap();
    let missing = directory.path().join("missing.db");
    let (poller, sink, _config_directory) = items_poller(&format!("sqlite://{}", missing.display()), json!({}));
    let message = poller.tick().await.unwrap_err().to_string();
    assert!(message.contains("cannot reach the database") && message.contains("unable to open"), "{message}");
    assert!(!missing.exists(), "the poller created the database");

    let foreign = directory.path().join("notes.txt");
    std::fs::write(&foreign, "these are not the rows you are looking for, ".repeat(100)).unwrap();
    let (poller, _sink, _config_directory) = items_poller(&format!("sqlite://{}", foreign.display()), json!({}));
    let message = poller.tick().await.unwrap_err().to_string();
    assert!(message.contains("cannot reach the database") && message.contains("not a database"), "{message}");
    assert!(sink.batches().is_empty());
}

/// A generation query must name one load with one value of text or an integer: two columns, or a
/// REAL, fail the tick saying so, and nothing is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_query_that_is_not_one_text_or_integer_fails_the_tick() {
    let database = sqlite_items(&[(1, "2026-01-01T00:00:00Z")]).await;
    for (query, expected) in [
        ("SELECT 1, 2", "source.generation.query returned 2 columns: it must return one value"),
        ("SELECT 1.5", "source.generation.query returned 1.5 (REAL): it must return text or an integer"),
    ] {
        let (poller, sink, _directory) = items_poller(&database.url, json!({"generation": {"query": query}}));
        let message = poller.tick().await.unwrap_err().to_string();
        assert!(message.contains(expected), "{query}: {message}");
        assert!(sink.batches().is_empty());
    }
}

/// Regression (issue 35, finding 8): a question that times out on the client leaves its pooled
/// connection busy until the server finishes (MariaDB runs the statement on), and the permit of
/// the target's cap is kept until then: the next question waits for the permit, outside its query
/// timeout, and then reads; it used to be handed the permit at once and spend its own timeout
/// waiting for the busy connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_question_keeps_its_connection_permit_until_the_connection_is_back() {
    let database = database(Engine::MariaDb).await;
    execute(
        &database.url,
        "CREATE TABLE items (id BIGINT PRIMARY KEY, c BIGINT NOT NULL);\nINSERT INTO items VALUES (1, 1);\n",
    )
    .await;
    let cap = json!({"maxConnections": 1, "queryTimeoutSeconds": 1});
    let mut slow_extra = cap.clone();
    slow_extra["where"] = json!("SLEEP(3) = 0");
    let (slow_config, _slow_directory) = items_config(&database.url, slow_extra, 10);
    let (fast_config, _fast_directory) = items_config(&database.url, cap, 10);
    let pools = dbtrigger::source::pools::Pools::new();
    let wait = std::time::Duration::from_secs(30);
    let slow = dbtrigger::source::open_shared(&slow_config.source, &pools, wait).unwrap();
    let fast = dbtrigger::source::open_shared(&fast_config.source, &pools, wait).unwrap();
    assert_eq!(pools.len(), 1, "one target, capped at one connection");
    let limit = dbtrigger::source::FetchLimit { rows: 10, bytes: usize::MAX };
    assert_eq!(fast.fetch_after(None, limit).await.unwrap().rows.len(), 1);
    fast.connection_wait();

    let error = slow.fetch_after(None, limit).await.unwrap_err().to_string();
    assert!(error.contains("took longer than 1 s"), "{error}");
    let started = std::time::Instant::now();
    let fetched = fast.fetch_after(None, limit).await;
    let waited = fast.connection_wait();
    assert_eq!(fetched.map(|fetched| fetched.rows.len()).map_err(|error| error.to_string()), Ok(1));
    assert!(
        waited >= std::time::Duration::from_millis(1500),
        "waited {waited:?} for the permit (the busy connection ends about 2 s after the timeout), {:?} in all",
        started.elapsed()
    );
}

/// A text column with a binary collation (`utf8mb4_bin`, which MariaDB's `JSON` also has) is text, not bytes:
/// the wire marks such columns with the BINARY flag, so the column's character set, not the flag, decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_text_with_a_binary_collation_stays_text() {
    let url = mariadb().fresh_database().await;
    let row = first_row(
        &url,
        "CREATE TABLE items (id INT PRIMARY KEY, c BIGINT NOT NULL, code VARCHAR(20) COLLATE utf8mb4_bin, \
         fixed CHAR(3) COLLATE utf8mb4_bin, note LONGTEXT COLLATE utf8mb4_bin, doc JSON, raw VARBINARY(8), \
         blobby BLOB, padded BINARY(2));\n",
        "INSERT INTO items VALUES (1, 5, 'Zoë', 'abc', 'long Zoë', '{\"k\": [1, 2]}', x'0102ff', x'00ff', x'0102');\n",
    )
    .await
    .unwrap();
    assert_eq!(
        Value::Object(row),
        json!({
            "id": 1, "c": 5, "code": "Zoë", "fixed": "abc", "note": "long Zoë", "doc": "{\"k\": [1, 2]}",
            "raw": "AQL/", "blobby": "AP8=", "padded": "AQI="
        })
    );
}
