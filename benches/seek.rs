//! Flat-cost benchmark: the time to fetch one batch must not grow with the depth of the checkpoint.
//!
//! For each engine, a 1,000,000-row table with an index on (cursor, id). The seek of dbtrigger's
//! source is timed at the start of the table and at its end; the ratio last/first is the figure of
//! merit (target <= 1.5). As a baseline in the same run, the predicate the Python project uses,
//! `c > ? OR (c = ? AND id > ?)`, is timed the same way through the raw driver.
//!
//! Run: `cargo bench --bench seek` (starts its own PostgreSQL and MariaDB, like the tests).

#[path = "../tests/it/services.rs"]
mod services;

use std::sync::Arc;
use std::time::{Duration, Instant};

use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::{CursorValue, PkValue, Position};
use dbtrigger::source::{FetchLimit, Source};
use serde_json::json;

const ROWS: i64 = 1_000_000;
const BATCH: usize = 500;
/// The batch size, with a byte budget no row of this table comes near.
const LIMIT: FetchLimit = FetchLimit { rows: BATCH, bytes: usize::MAX };
const REPEAT: u32 = 30;

fn position(row: i64) -> Position {
    Position { cursor: CursorValue::Integer(row / 3), pk: vec![("id".to_string(), PkValue::Integer(row))] }
}

fn source(url: &str) -> Arc<dyn Source> {
    let directory = tempfile::tempdir().unwrap();
    let root = directory.path().join("app");
    std::fs::create_dir_all(root.join("items")).unwrap();
    let function = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 * * * * *"}],
        "poller": {
            "source": {"connection": "DB", "table": "items", "cursor": "c", "pk": ["id"]},
            "batch": {"size": BATCH},
            "sink": {"type": "webhook", "url": "http://127.0.0.1:9/"},
            "state": {"connection": "STATE"}
        }
    });
    std::fs::write(root.join("items/function.json"), function.to_string()).unwrap();
    let settings = Settings::from_pairs([("DB", url), ("STATE", "file:unused")]);
    let config = PollerConfig::load(&root, "items", &settings, None).unwrap();
    dbtrigger::source::open(&config.source).unwrap()
}

/// Median of `REPEAT` runs of `fetch`.
async fn median<F, Fut>(mut fetch: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = usize>,
{
    let mut times = Vec::new();
    for _ in 0..REPEAT {
        let started = Instant::now();
        let rows = fetch().await;
        times.push(started.elapsed());
        assert_eq!(rows, BATCH, "a full batch");
    }
    times.sort();
    times[times.len() / 2]
}

struct Figures {
    engine: &'static str,
    first: Duration,
    last: Duration,
    baseline_first: Duration,
    baseline_last: Duration,
}

async fn measure_seek(source: &dyn Source) -> (Duration, Duration) {
    let first = median(|| async { source.fetch_after(Some(&position(10)), LIMIT).await.unwrap().rows.len() }).await;
    let last = median(|| async {
        source.fetch_after(Some(&position(ROWS - 2 * BATCH as i64)), LIMIT).await.unwrap().rows.len()
    })
    .await;
    (first, last)
}

async fn postgres() -> Figures {
    let url = services::postgres().fresh_database().await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE items (id BIGINT PRIMARY KEY, c BIGINT NOT NULL, note TEXT);
         INSERT INTO items SELECT g, g / 3, 'row ' || g FROM generate_series(1, 1000000) g;
         CREATE INDEX items_seek ON items (c, id);",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::raw_sql("VACUUM ANALYZE items").execute(&pool).await.unwrap();
    let (first, last) = measure_seek(source(&url).as_ref()).await;
    let or_form = "SELECT * FROM items WHERE c > $1 OR (c = $1 AND id > $2) ORDER BY c, id LIMIT 500";
    let baseline = |row: i64| {
        let pool = pool.clone();
        async move { sqlx::query(or_form).bind(row / 3).bind(row).fetch_all(&pool).await.unwrap().len() }
    };
    let baseline_first = median(|| baseline(10)).await;
    let baseline_last = median(|| baseline(ROWS - 2 * BATCH as i64)).await;
    Figures { engine: "postgresql", first, last, baseline_first, baseline_last }
}

async fn mariadb() -> Figures {
    let url = services::mariadb().fresh_database().await;
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE items (id BIGINT PRIMARY KEY, c BIGINT NOT NULL, note VARCHAR(40), INDEX items_seek (c, id));
         INSERT INTO items SELECT seq, seq DIV 3, CONCAT('row ', seq) FROM seq_1_to_1000000;
         ANALYZE TABLE items;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (first, last) = measure_seek(source(&url).as_ref()).await;
    let or_form = "SELECT * FROM items WHERE c > ? OR (c = ? AND id > ?) ORDER BY c, id LIMIT 500";
    let baseline = |row: i64| {
        let pool = pool.clone();
        async move { sqlx::query(or_form).bind(row / 3).bind(row / 3).bind(row).fetch_all(&pool).await.unwrap().len() }
    };
    let baseline_first = median(|| baseline(10)).await;
    let baseline_last = median(|| baseline(ROWS - 2 * BATCH as i64)).await;
    Figures { engine: "mariadb", first, last, baseline_first, baseline_last }
}

async fn sqlite() -> Figures {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("items.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE items (id INTEGER PRIMARY KEY, c INTEGER NOT NULL, note TEXT);
         WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < 1000000)
         INSERT INTO items SELECT x, x / 3, 'row ' || x FROM g;
         CREATE INDEX items_seek ON items (c, id);
         ANALYZE;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (first, last) = measure_seek(source(&format!("sqlite://{}", path.display())).as_ref()).await;
    let or_form = "SELECT * FROM items WHERE c > ?1 OR (c = ?1 AND id > ?2) ORDER BY c, id LIMIT 500";
    let baseline = |row: i64| {
        let pool = pool.clone();
        async move { sqlx::query(or_form).bind(row / 3).bind(row).fetch_all(&pool).await.unwrap().len() }
    };
    let baseline_first = median(|| baseline(10)).await;
    let baseline_last = median(|| baseline(ROWS - 2 * BATCH as i64)).await;
    Figures { engine: "sqlite", first, last, baseline_first, baseline_last }
}

fn milliseconds(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() {
    let mut figures = Vec::new();
    for engine in std::env::args().skip(1).filter(|argument| !argument.starts_with('-')).chain(
        if std::env::args().skip(1).any(|argument| !argument.starts_with('-')) {
            vec![]
        } else {
            vec!["sqlite".into(), "postgresql".into(), "mariadb".into()]
        },
    ) {
        let started = Instant::now();
        let result = match engine.as_str() {
            "sqlite" => sqlite().await,
            "postgresql" => postgres().await,
            "mariadb" => mariadb().await,
            other => panic!("unknown engine {other}"),
        };
        eprintln!("{engine}: done in {:.1} s", started.elapsed().as_secs_f64());
        figures.push(result);
    }
    println!("batch fetch time, {ROWS} rows, batches of {BATCH}, median of {REPEAT}");
    println!(
        "{:<11} {:>10} {:>10} {:>7}   {:>14} {:>14} {:>7}",
        "engine", "first ms", "last ms", "ratio", "OR-form first", "OR-form last", "ratio"
    );
    for figure in &figures {
        println!(
            "{:<11} {:>10.2} {:>10.2} {:>7.2}   {:>14.2} {:>14.2} {:>7.2}",
            figure.engine,
            milliseconds(figure.first),
            milliseconds(figure.last),
            figure.last.as_secs_f64() / figure.first.as_secs_f64(),
            milliseconds(figure.baseline_first),
            milliseconds(figure.baseline_last),
            figure.baseline_last.as_secs_f64() / figure.baseline_first.as_secs_f64(),
        );
    }
}
