//! Every engine (SQLite, PostgreSQL, MariaDB) and every cursor kind, end to end through the tick:
//! each row delivered once, in (cursor, pk) order, across many ticks and batch boundaries that
//! split equal cursor values.

use std::sync::Arc;

use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::StateDocument;
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::store::StateKey;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, SystemClock, TickOutcome};
use serde_json::{Value, json};

use crate::harness::AppRoot;
use crate::services::{mariadb, postgres};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Sqlite,
    Postgres,
    MariaDb,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Integer,
    Timestamptz,
    Naive,
    CompositeKey,
}

struct Database {
    url: String,
    _directory: Option<tempfile::TempDir>,
}

async fn database(engine: Engine) -> Database {
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

async fn execute(url: &str, sql: &str) {
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
    let database = database(engine).await;
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

    let delivered: Vec<Value> = sink
        .batches()
        .iter()
        .flat_map(|batch| batch.events.iter().map(|event| Value::Object(event.pk.clone())))
        .collect();
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
    assert_eq!(first.row["note"], json!(format!("row {}", first.pk["id"])), "{engine:?} {kind:?}");
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
