//! The late-arrival detector on real engines (issue 26, sections 3 and 4): a row whose transaction
//! commits after the poller passed its cursor is found by the next check and delivered, marked
//! `late`, and counted; with the detector off it is lost, and these tests say so.
//!
//! PostgreSQL and MariaDB run the real race: a writer opens a transaction and inserts a row (its
//! timestamp, or its identity value, taken then), other rows are inserted, committed and delivered
//! past it, and then the writer commits. SQLite allows one writer at a time, so there the race is
//! emulated: once the checkpoint has passed a cursor value, a row is inserted with that older
//! value, as a late commit would have left it.

use std::sync::Arc;
use std::time::Duration;

use dbtrigger::domain::StateDocument;
use dbtrigger::sink::recording::RecordingSink;
use dbtrigger::store::StateKey;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{LateCheck, Poller, TickReport};
use serde_json::{Value, json};

use crate::sources::{Database, Engine, database, execute, items_config, poller_with};

/// A transaction left open across ticks, on PostgreSQL or MariaDB.
enum Writer {
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>),
    MariaDb(sqlx::Transaction<'static, sqlx::MySql>),
}

impl Writer {
    async fn open(url: &str) -> Writer {
        if url.starts_with("postgres") {
            let pool = sqlx::PgPool::connect(url).await.unwrap();
            Writer::Postgres(pool.begin().await.unwrap())
        } else {
            let pool = sqlx::MySqlPool::connect(url).await.unwrap();
            Writer::MariaDb(pool.begin().await.unwrap())
        }
    }

    async fn execute(&mut self, sql: &str) {
        match self {
            Writer::Postgres(transaction) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string())).execute(&mut **transaction).await.unwrap();
            }
            Writer::MariaDb(transaction) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string())).execute(&mut **transaction).await.unwrap();
            }
        }
    }

    async fn commit(self) {
        match self {
            Writer::Postgres(transaction) => transaction.commit().await.unwrap(),
            Writer::MariaDb(transaction) => transaction.commit().await.unwrap(),
        }
    }
}

struct Case {
    _database: Database,
    url: String,
    poller: Poller,
    sink: Arc<RecordingSink>,
    store: Arc<MemoryStore>,
    _directory: tempfile::TempDir,
}

impl Case {
    async fn new(engine: Engine, table: &str, source_extra: Value) -> Case {
        let database = database(engine).await;
        let url = database.url.clone();
        execute(&url, table).await;
        let (config, directory) = items_config(&url, source_extra, 100);
        let store = Arc::new(MemoryStore::new());
        let (poller, sink) = poller_with(config, store.clone());
        Case { _database: database, url, poller, sink, store, _directory: directory }
    }

    async fn tick(&self) -> TickReport {
        let (result, report) = self.poller.tick_reported().await;
        result.unwrap();
        report
    }

    fn document(&self) -> StateDocument {
        let key = StateKey::new(&self.poller.config.app_name, &self.poller.config.poller_name);
        StateDocument::parse(&self.store.raw(&key).expect("a state document")).unwrap()
    }

    /// Every delivered id, in order, with whether its batch was late.
    fn delivered(&self) -> Vec<(i64, bool)> {
        let mut delivered = Vec::new();
        for batch in self.sink.batches() {
            for event in &batch.events {
                delivered.push((event.pk()["id"].as_i64().unwrap(), batch.late));
            }
        }
        delivered
    }
}

fn timestamp_table(engine: Engine) -> &'static str {
    match engine {
        Engine::Postgres => {
            "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(), note TEXT);\nCREATE INDEX ON items (c, id);\n"
        }
        Engine::MariaDb => {
            "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), note TEXT, INDEX (c, id));\n"
        }
        Engine::Sqlite => {
            "CREATE TABLE items (id INTEGER PRIMARY KEY, c TEXT NOT NULL, note TEXT);\nCREATE INDEX items_c ON items (c, id);\n"
        }
    }
}

fn identity_table(engine: Engine) -> &'static str {
    match engine {
        Engine::Postgres => {
            "CREATE TABLE items (id BIGINT PRIMARY KEY, seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE, note TEXT);\n"
        }
        Engine::MariaDb => "CREATE TABLE items (id BIGINT PRIMARY KEY, seq BIGINT AUTO_INCREMENT UNIQUE, note TEXT);\n",
        Engine::Sqlite => "CREATE TABLE items (id INTEGER PRIMARY KEY, seq INTEGER UNIQUE, note TEXT);\n",
    }
}

/// `INSERT` of rows `ids` stamped now (PostgreSQL, MariaDB: the column's default).
fn insert_now(ids: &[i64]) -> String {
    let values: Vec<String> = ids.iter().map(|id| format!("({id}, 'row {id}')")).collect();
    format!("INSERT INTO items (id, note) VALUES {};\n", values.join(", "))
}

/// SQLite: `INSERT` of row `id` stamped `seconds_ago` before now, in the layout SQLite writes.
fn insert_sqlite(id: i64, seconds_ago: f64) -> String {
    format!(
        "INSERT INTO items (id, c, note) VALUES ({id}, strftime('%Y-%m-%d %H:%M:%f', 'now', '-{seconds_ago} seconds'), 'row {id}');\n"
    )
}

/// A timestamp cursor at settleSeconds 1 and a row committed after the poller passed its time:
/// the ids delivered (with their `late` flag), and the last tick's report.
async fn late_timestamp(engine: Engine, detector: bool) -> (Vec<(i64, bool)>, TickReport, StateDocument) {
    let extra = json!({"settleSeconds": 1, "lateArrivals": {"enabled": detector}});
    let case = Case::new(engine, timestamp_table(engine), extra).await;
    let settle = Duration::from_millis(1_300);
    if engine == Engine::Sqlite {
        // Emulated: rows 1-3 ten seconds ago, 11-12 five; once the checkpoint is past them, row 10
        // is inserted seven seconds ago, behind the checkpoint, as a late commit leaves it.
        for (id, ago) in [(1, 10.0), (2, 10.0), (3, 10.0), (11, 5.0), (12, 5.0)] {
            execute(&case.url, &insert_sqlite(id, ago)).await;
        }
        case.tick().await;
        execute(&case.url, &insert_sqlite(10, 7.0)).await;
    } else {
        execute(&case.url, &insert_now(&[1, 2, 3])).await;
        tokio::time::sleep(settle).await;
        case.tick().await;
        // The writer stamps row 10 now, and keeps its transaction open past settleSeconds while
        // rows 11 and 12, stamped later, are committed and delivered.
        let mut writer = Writer::open(&case.url).await;
        writer.execute(&insert_now(&[10])).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        execute(&case.url, &insert_now(&[11, 12])).await;
        tokio::time::sleep(settle).await;
        case.tick().await;
        assert!(!case.delivered().iter().any(|(id, _)| *id == 10), "row 10 was not committed yet");
        writer.commit().await;
    }
    let report = case.tick().await;
    // One more tick: nothing found twice, nothing new.
    let after = case.tick().await;
    assert_eq!(after.late_arrivals, 0);
    (case.delivered(), report, case.document())
}

/// Regression (issue 26, section 4): with the detector on (the default), a row committed after
/// the poller passed its timestamp arrives, marked late, and is counted; the others are not
/// delivered again.
async fn a_late_timestamp_row_is_found(engine: Engine) {
    let (delivered, report, document) = late_timestamp(engine, true).await;
    assert_eq!(delivered, vec![(1, false), (2, false), (3, false), (11, false), (12, false), (10, true)]);
    assert_eq!(report.late_check, LateCheck::Checked);
    assert_eq!(report.late_arrivals, 1);
    // It was stamped more than settleSeconds (1) before it was found.
    assert!(report.max_lateness_seconds.is_some_and(|seconds| seconds >= 2), "{report:?}");
    let late = document.late.expect("the detector's record");
    assert_eq!(late.found, 1);
    assert_eq!(late.max_lateness_seconds, report.max_lateness_seconds);
}

/// Issue 26, section 4, the README's warning measured: with the detector off, the same row is
/// never delivered.
async fn without_the_detector_a_late_timestamp_row_is_lost(engine: Engine) {
    let (delivered, report, document) = late_timestamp(engine, false).await;
    assert_eq!(delivered, vec![(1, false), (2, false), (3, false), (11, false), (12, false)], "row 10 is lost");
    assert_eq!(report.late_check, LateCheck::Skipped);
    assert!(document.late.is_none_or(|late| late.window.is_none() && late.found == 0));
}

/// An identity cursor (`seq`, key `id`): two transactions take `seq` 6 and 7, and 7 commits (and
/// is delivered) first. Row `id`s follow their `seq`.
async fn late_identity(engine: Engine, detector: bool) -> (Vec<(i64, bool)>, TickReport) {
    let extra = json!({"cursor": "seq", "lateArrivals": {"enabled": detector}});
    let case = Case::new(engine, identity_table(engine), extra).await;
    if engine == Engine::Sqlite {
        let seed: Vec<String> = (1..=5).map(|id| format!("({id}, {id}, 'row {id}')")).collect();
        execute(&case.url, &format!("INSERT INTO items (id, seq, note) VALUES {};\n", seed.join(", "))).await;
        case.tick().await;
        // Emulated: 7 is committed and delivered, then 6 appears behind the checkpoint.
        execute(&case.url, "INSERT INTO items (id, seq, note) VALUES (7, 7, 'second');\n").await;
        case.tick().await;
        execute(&case.url, "INSERT INTO items (id, seq, note) VALUES (6, 6, 'first');\n").await;
    } else {
        let seed: Vec<String> = (1..=5).map(|id| format!("({id}, 'row {id}')")).collect();
        execute(&case.url, &format!("INSERT INTO items (id, note) VALUES {};\n", seed.join(", "))).await;
        case.tick().await;
        let mut first = Writer::open(&case.url).await;
        first.execute("INSERT INTO items (id, note) VALUES (6, 'first');\n").await;
        execute(&case.url, "INSERT INTO items (id, note) VALUES (7, 'second');\n").await;
        case.tick().await;
        assert_eq!(case.delivered().last(), Some(&(7, false)), "7 committed first and was delivered");
        first.commit().await;
    }
    let report = case.tick().await;
    (case.delivered(), report)
}

/// Regression (issue 26, section 4): the detector finds the lower id an identity cursor passed.
async fn a_lower_identity_committed_late_is_found(engine: Engine) {
    let (delivered, report) = late_identity(engine, true).await;
    let expected: Vec<(i64, bool)> = (1..=5).map(|id| (id, false)).chain([(7, false), (6, true)]).collect();
    assert_eq!(delivered, expected);
    assert_eq!(report.late_arrivals, 1);
}

/// Issue 26, section 4: without the detector an identity cursor loses the lower id for good.
async fn without_the_detector_a_lower_identity_is_lost(engine: Engine) {
    let (delivered, _) = late_identity(engine, false).await;
    let expected: Vec<(i64, bool)> = (1..=5).chain([7]).map(|id| (id, false)).collect();
    assert_eq!(delivered, expected, "6 is lost");
}

/// Issue 35, finding 1: a table whose cursor `c` is restamped by every update (PostgreSQL: a
/// `BEFORE UPDATE` trigger; MariaDB: `ON UPDATE CURRENT_TIMESTAMP(6)`; SQLite: the update writes
/// it).
fn restamped_table(engine: Engine) -> &'static str {
    match engine {
        Engine::Postgres => {
            "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(), note TEXT);\n\
             CREATE INDEX ON items (c, id);\n\
             CREATE FUNCTION restamp() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN NEW.c := clock_timestamp(); RETURN NEW; END $$;\n\
             CREATE TRIGGER items_restamp BEFORE UPDATE ON items FOR EACH ROW EXECUTE FUNCTION restamp();\n"
        }
        Engine::MariaDb => {
            "CREATE TABLE items (id BIGINT PRIMARY KEY, c TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6), note TEXT, INDEX (c, id));\n"
        }
        Engine::Sqlite => timestamp_table(engine),
    }
}

/// SQLite: rows `ids` stamped `(200 - id) / 10` seconds ago, in the layout SQLite writes.
fn insert_sqlite_spread(ids: std::ops::RangeInclusive<i64>) -> String {
    ids.map(|id| insert_sqlite(id, (200 - id) as f64 / 10.0)).collect()
}

/// Issue 35, finding 1: 100 rows delivered; row 95 updated (its cursor restamped) by a transaction
/// that stays open while rows 101-130, stamped later, are delivered; then it commits. Its new
/// version arrives, marked late, and is counted once; the other rows are not counted late.
async fn a_late_update_of_a_delivered_row_is_found(engine: Engine) {
    let extra = json!({"settleSeconds": 1});
    let case = Case::new(engine, restamped_table(engine), extra).await;
    let settle = Duration::from_millis(1_300);
    if engine == Engine::Sqlite {
        // Emulated: once the checkpoint is past 101-130, row 95 is updated to a stamp between
        // rows 100 and 101 (as a slow transaction's restamp leaves it).
        execute(&case.url, &insert_sqlite_spread(1..=100)).await;
        case.tick().await;
        execute(&case.url, &insert_sqlite_spread(101..=130)).await;
        case.tick().await;
        execute(
            &case.url,
            "UPDATE items SET note = 'v2', c = strftime('%Y-%m-%d %H:%M:%f', (SELECT c FROM items WHERE id = 100), '+0.05 seconds') WHERE id = 95;\n",
        )
        .await;
    } else {
        execute(&case.url, &insert_now(&(1..=100).collect::<Vec<_>>())).await;
        tokio::time::sleep(settle).await;
        case.tick().await;
        let mut writer = Writer::open(&case.url).await;
        writer.execute("UPDATE items SET note = 'v2' WHERE id = 95;\n").await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        execute(&case.url, &insert_now(&(101..=130).collect::<Vec<_>>())).await;
        tokio::time::sleep(settle).await;
        case.tick().await;
        writer.commit().await;
    }
    assert_eq!(case.delivered().len(), 130, "every row once before the update commits");
    let report = case.tick().await;
    let versions: Vec<(bool, Value)> = case
        .sink
        .batches()
        .iter()
        .flat_map(|batch| batch.events.iter().map(move |event| (batch.late, event.row()["note"].clone())))
        .filter(|(_, note)| note == "v2")
        .collect();
    assert_eq!(versions, vec![(true, json!("v2"))], "the new version of row 95, marked late: {report:?}");
    assert_eq!(report.late_arrivals, 1, "{report:?}");
    assert_eq!(case.tick().await.late_arrivals, 0, "found once");
    assert_eq!(case.document().late.expect("the detector's record").found, 1);
}

macro_rules! per_engine {
    ($($test:ident: $body:ident, $engine:expr;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                $body($engine).await;
            }
        )*
    };
}

per_engine! {
    postgres_late_timestamp_row_is_found: a_late_timestamp_row_is_found, Engine::Postgres;
    mariadb_late_timestamp_row_is_found: a_late_timestamp_row_is_found, Engine::MariaDb;
    sqlite_late_timestamp_row_is_found: a_late_timestamp_row_is_found, Engine::Sqlite;
    postgres_late_timestamp_row_is_lost_without_the_detector: without_the_detector_a_late_timestamp_row_is_lost, Engine::Postgres;
    mariadb_late_timestamp_row_is_lost_without_the_detector: without_the_detector_a_late_timestamp_row_is_lost, Engine::MariaDb;
    sqlite_late_timestamp_row_is_lost_without_the_detector: without_the_detector_a_late_timestamp_row_is_lost, Engine::Sqlite;
    postgres_late_identity_is_found: a_lower_identity_committed_late_is_found, Engine::Postgres;
    mariadb_late_identity_is_found: a_lower_identity_committed_late_is_found, Engine::MariaDb;
    sqlite_late_identity_is_found: a_lower_identity_committed_late_is_found, Engine::Sqlite;
    postgres_late_identity_is_lost_without_the_detector: without_the_detector_a_lower_identity_is_lost, Engine::Postgres;
    mariadb_late_identity_is_lost_without_the_detector: without_the_detector_a_lower_identity_is_lost, Engine::MariaDb;
    sqlite_late_identity_is_lost_without_the_detector: without_the_detector_a_lower_identity_is_lost, Engine::Sqlite;
    postgres_late_update_of_a_delivered_row_is_found: a_late_update_of_a_delivered_row_is_found, Engine::Postgres;
    mariadb_late_update_of_a_delivered_row_is_found: a_late_update_of_a_delivered_row_is_found, Engine::MariaDb;
    sqlite_late_update_of_a_delivered_row_is_found: a_late_update_of_a_delivered_row_is_found, Engine::Sqlite;
}

/// The key hash the database computes is the one the detector records, for integer keys (negative
/// and beyond 2^31 too), text keys (not ASCII too) and composite keys, on every engine: after a
/// delivery the recount finds every bucket as recorded, so nothing is called late.
async fn the_recount_agrees_with_the_record(engine: Engine) {
    let table = match engine {
        Engine::Postgres => {
            "CREATE TABLE items (id BIGINT NOT NULL, code TEXT NOT NULL, c BIGINT NOT NULL, PRIMARY KEY (id, code));\n"
        }
        Engine::MariaDb => {
            "CREATE TABLE items (id BIGINT NOT NULL, code VARCHAR(40) CHARACTER SET utf8mb4 NOT NULL, c BIGINT NOT NULL, PRIMARY KEY (id, code));\n"
        }
        Engine::Sqlite => {
            "CREATE TABLE items (id INTEGER NOT NULL, code TEXT NOT NULL, c INTEGER NOT NULL, PRIMARY KEY (id, code));\n"
        }
    };
    let values = [
        (-5, "naïve", 1),
        (3_000_000_000, "Ωmega", 2),
        (i64::MAX, "x", 3),
        (i64::MIN + 1, "", 4),
        (42, "tab\tand 'quote'", 5),
    ];
    let inserts: Vec<String> =
        values.iter().map(|(id, code, c)| format!("({id}, '{}', {c})", code.replace('\'', "''"))).collect();
    for key_columns in [json!(["id", "code"]), json!(["id"]), json!(["code"])] {
        let table_sql = match key_columns.as_array().unwrap().len() {
            2 => table.to_string(),
            _ => table
                .replace(", PRIMARY KEY (id, code)", &format!(", PRIMARY KEY ({})", key_columns[0].as_str().unwrap())),
        };
        let case = Case::new(engine, &table_sql, json!({"cursor": "c", "pk": key_columns, "settleSeconds": 0})).await;
        execute(&case.url, &format!("INSERT INTO items (id, code, c) VALUES {};\n", inserts.join(", "))).await;
        case.tick().await;
        let report = case.tick().await;
        assert_eq!(report.late_check, LateCheck::Checked, "{engine:?} {key_columns}");
        assert_eq!(report.late_arrivals, 0, "{engine:?} {key_columns}: nothing arrived late");
        assert_eq!(case.sink.batches().len(), 1, "{engine:?} {key_columns}: nothing delivered again");
        let window = case.document().late.unwrap().window.unwrap();
        assert_eq!(window.buckets.iter().map(|bucket| bucket.tally.rows).sum::<u64>(), values.len() as u64);
    }
}

per_engine! {
    postgres_recount_agrees_with_the_record: the_recount_agrees_with_the_record, Engine::Postgres;
    mariadb_recount_agrees_with_the_record: the_recount_agrees_with_the_record, Engine::MariaDb;
    sqlite_recount_agrees_with_the_record: the_recount_agrees_with_the_record, Engine::Sqlite;
}

/// Issue 35, finding 5 (the detector's half): a `char(8)` key arrives padded in Rust and unpadded
/// through `::text`; both sides hash it without the padding, so 12 recounts (what 12 idle checks
/// run) of the rows delivered give the tally the detector records of them. The range ends by
/// cursor alone here: the ticks and the checkpoint's end of the last bucket also need the seek's
/// half (binding the key as the column compares it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_char_key_is_hashed_alike_by_the_database_and_the_detector() {
    use dbtrigger::domain::late::{BucketEnd, KeyRow, Tally};
    use dbtrigger::domain::{CursorValue, PkValue, Position};
    use dbtrigger::source::BucketCheck;
    let table = "CREATE TABLE items (code CHAR(8) PRIMARY KEY, c BIGINT NOT NULL, note TEXT);\n";
    let case = Case::new(Engine::Postgres, table, json!({"cursor": "c", "pk": ["code"], "settleSeconds": 0})).await;
    let values: Vec<String> = (1..=40).map(|id| format!("('c{id}', {id}, 'row {id}')")).collect();
    execute(&case.url, &format!("INSERT INTO items (code, c, note) VALUES {};\n", values.join(", "))).await;
    case.tick().await;
    let mut recorded = Tally::default();
    let mut codes = Vec::new();
    for event in case.sink.batches().iter().flat_map(|batch| batch.events.clone()) {
        let code = event.pk()["code"].as_str().unwrap().to_string();
        let cursor = event.row()["c"].as_i64().unwrap();
        if codes.contains(&code) {
            // Delivered twice by the seek's half of finding 5 (a batch boundary read again).
            continue;
        }
        codes.push(code.clone());
        let position =
            Position { cursor: CursorValue::Integer(cursor), pk: vec![("code".into(), PkValue::Text(code))] };
        recorded.add(KeyRow::of(&position).hash);
    }
    assert!(codes.contains(&"c1      ".to_string()), "the key arrives padded: {codes:?}");
    assert_eq!(recorded.rows, 40);
    let checkpoint = case.document().position().unwrap().unwrap();
    for check in 0..12 {
        let range = (CursorValue::Integer(1), BucketEnd::Before(CursorValue::Integer(41)));
        let recount = BucketCheck { ranges: vec![range], checkpoint: checkpoint.clone() };
        let tallies = case.poller.source.tally_buckets(&recount).await.unwrap().unwrap();
        assert_eq!(tallies, vec![recorded], "check {check}");
    }
}

/// Rows updated past the checkpoint and rows deleted make their bucket shrink: not a late
/// arrival. The updated row is delivered once more, in order, as any update; nothing is marked
/// late; the shrunk bucket is adopted, so that a later arrival in it is still seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_and_deletes_behind_the_checkpoint_are_not_late_arrivals() {
    let case = Case::new(Engine::Postgres, timestamp_table(Engine::Postgres), json!({"settleSeconds": 0})).await;
    execute(&case.url, &insert_now(&[1, 2, 3, 4])).await;
    case.tick().await;
    execute(
        &case.url,
        "UPDATE items SET c = clock_timestamp(), note = 'updated' WHERE id = 2;\nDELETE FROM items WHERE id = 3;\n",
    )
    .await;
    let report = case.tick().await;
    assert_eq!(report.late_arrivals, 0);
    assert_eq!(case.delivered(), vec![(1, false), (2, false), (3, false), (4, false), (2, false)]);
    // A row committed late into the shrunk bucket afterwards is found.
    execute(
        &case.url,
        "INSERT INTO items (id, c, note) SELECT 9, c + interval '1 microsecond', 'late' FROM items WHERE id = 1;\n",
    )
    .await;
    let report = case.tick().await;
    assert_eq!(report.late_arrivals, 1);
    assert_eq!(case.delivered().last(), Some(&(9, true)));
}

/// A sink that refuses late batches while told to, and records the rest.
struct RefusesLate {
    inner: RecordingSink,
    refuse: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl dbtrigger::sink::Sink for RefusesLate {
    async fn deliver(
        &self,
        batch: &dbtrigger::domain::Batch,
        deadline: tokio::time::Instant,
    ) -> Result<(), dbtrigger::sink::SinkError> {
        if batch.late && self.refuse.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(dbtrigger::sink::SinkError::Transient {
                batch_id: batch.batch_id.clone(),
                reason: "the receiver is down".into(),
            });
        }
        self.inner.deliver(batch, deadline).await
    }

    fn describe(&self) -> String {
        "refuses late batches".into()
    }
}

/// SQLite rows with `seq` (the cursor) and `id` (the key) equal.
async fn sqlite_seq_case(sink: Option<Arc<dyn dbtrigger::sink::Sink>>) -> (Case, Option<Poller>) {
    let case = Case::new(Engine::Sqlite, identity_table(Engine::Sqlite), json!({"cursor": "seq"})).await;
    let seeded: Vec<String> = [10, 20, 30, 40, 50].iter().map(|id| format!("({id}, {id}, 'row {id}')")).collect();
    execute(&case.url, &format!("INSERT INTO items (id, seq, note) VALUES {};\n", seeded.join(", "))).await;
    let other = sink.map(|sink| {
        let source = dbtrigger::source::open(&case.poller.config.source).unwrap();
        Poller::new(
            case.poller.config.clone(),
            source,
            sink,
            case.store.clone(),
            Arc::new(dbtrigger::tick::SystemClock),
            "it".into(),
        )
    });
    (case, other)
}

/// Two rows late in one bucket: the difference of the sums names no single row, so the whole
/// bucket is delivered again (the rows delivered before keep their event ids: a receiver that
/// dedupes sees only the two new ones), and both are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_late_rows_in_one_bucket_send_the_bucket_again() {
    let (case, _) = sqlite_seq_case(None).await;
    case.tick().await;
    let first_ids: Vec<String> =
        case.sink.batches()[0].events.iter().map(|event| event.event_id().to_string()).collect();
    execute(&case.url, "INSERT INTO items (id, seq, note) VALUES (15, 15, 'late'), (25, 25, 'late');\n").await;
    let report = case.tick().await;
    assert_eq!(report.late_arrivals, 2);
    let batches = case.sink.batches();
    let late: Vec<i64> = batches[1..]
        .iter()
        .flat_map(|batch| batch.events.iter().map(|event| event.pk()["id"].as_i64().unwrap()))
        .collect();
    assert_eq!(late, vec![10, 15, 20, 25, 30, 40, 50]);
    assert!(batches[1..].iter().all(|batch| batch.late));
    let again: Vec<String> = batches[1..]
        .iter()
        .flat_map(|batch| batch.events.iter())
        .filter(|event| event.pk()["id"].as_i64().unwrap() % 10 == 0)
        .map(|event| event.event_id().to_string())
        .collect();
    assert_eq!(again, first_ids, "the same rows, the same event ids");
    assert_eq!(case.tick().await.late_arrivals, 0, "recorded: not found twice");
}

/// A late batch the receiver refuses fails the tick after the tick's own rows were delivered and
/// committed (a late row never holds up new ones); the failure is recorded for status and the
/// watchdog, the checkpoint stays where the new rows put it, and the next tick delivers the late
/// row once the receiver takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_late_batch_fails_the_tick_without_holding_up_new_rows() {
    let sink = Arc::new(RefusesLate { inner: RecordingSink::new(), refuse: true.into() });
    let (case, poller) = sqlite_seq_case(Some(sink.clone())).await;
    let poller = poller.unwrap();
    poller.tick().await.unwrap();
    execute(&case.url, "INSERT INTO items (id, seq, note) VALUES (35, 35, 'late'), (60, 60, 'new');\n").await;
    let error = poller.tick().await.unwrap_err();
    assert!(matches!(error, dbtrigger::tick::TickError::LateDelivery { .. }), "{error}");
    assert!(error.to_string().contains("the receiver is down"), "{error}");
    let document = case.document();
    assert_eq!(document.checkpoint.as_ref().unwrap().cursor.value, json!(60), "the new row is committed");
    assert_eq!(document.failure.as_ref().map(|failure| failure.attempts), Some(1));
    assert!(document.lease.as_ref().unwrap().owner_id.is_none(), "the lease is given back");
    sink.refuse.store(false, std::sync::atomic::Ordering::SeqCst);
    let (result, report) = poller.tick_reported().await;
    result.unwrap();
    assert_eq!(report.late_arrivals, 1);
    let delivered: Vec<(i64, bool)> = sink
        .inner
        .batches()
        .iter()
        .flat_map(|batch| {
            batch.events.iter().map(|event| (event.pk()["id"].as_i64().unwrap(), batch.late)).collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(
        delivered,
        vec![(10, false), (20, false), (30, false), (40, false), (50, false), (60, false), (35, true)]
    );
    assert_eq!(case.document().failure, None, "the failure is cleared");
}

/// Issue 35, finding 6: a late bucket whose delivery keeps failing stays in the window however
/// many rows commits add after it (a window of 32 rows, 200 new rows), is checked at every tick
/// (everyTicks 5 notwithstanding), and the failure stays recorded at every tick until it is
/// delivered; then the row arrives, marked late, and the mark and the failure are cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_late_bucket_never_leaves_the_window_undelivered() {
    let extra = json!({"cursor": "seq", "lateArrivals": {"windowRows": 32, "everyTicks": 5}});
    let case = Case::new(Engine::Sqlite, identity_table(Engine::Sqlite), extra).await;
    let seeded: Vec<String> = [10, 20, 30, 40, 50].iter().map(|id| format!("({id}, {id}, 'row {id}')")).collect();
    execute(&case.url, &format!("INSERT INTO items (id, seq, note) VALUES {};\n", seeded.join(", "))).await;
    let sink = Arc::new(RefusesLate { inner: RecordingSink::new(), refuse: true.into() });
    let source = dbtrigger::source::open(&case.poller.config.source).unwrap();
    let clock = Arc::new(dbtrigger::tick::SystemClock);
    let poller = Poller::new(case.poller.config.clone(), source, sink.clone(), case.store.clone(), clock, "it".into());
    poller.tick().await.unwrap();
    execute(&case.url, "INSERT INTO items (id, seq, note) VALUES (35, 35, 'late'), (60, 60, 'new');\n").await;
    // Found at the next check (one tick in five).
    let mut ticks = 0;
    while !matches!(poller.tick().await, Err(dbtrigger::tick::TickError::LateDelivery { .. })) {
        ticks += 1;
        assert!(ticks < 5, "found within everyTicks");
    }
    for round in 0..10 {
        let rows: Vec<String> =
            (0..20).map(|index| 100 + round * 20 + index).map(|id| format!("({id}, {id}, 'new')")).collect();
        execute(&case.url, &format!("INSERT INTO items (id, seq, note) VALUES {};\n", rows.join(", "))).await;
        let result = poller.tick().await;
        assert!(matches!(result, Err(dbtrigger::tick::TickError::LateDelivery { .. })), "round {round}: {result:?}");
        let document = case.document();
        assert!(document.failure.is_some(), "round {round}: the failure stays recorded");
        let late = document.late.unwrap();
        assert!(late.undelivered.is_some(), "round {round}");
        let first = late.window.unwrap().buckets[0].from.clone();
        assert!(
            first.as_i64().unwrap() <= 35,
            "round {round}: the bucket of row 35 is kept, the window starts at {first}"
        );
    }
    sink.refuse.store(false, std::sync::atomic::Ordering::SeqCst);
    let (result, report) = poller.tick_reported().await;
    result.unwrap();
    assert_eq!(report.late_arrivals, 1);
    let late: Vec<(i64, bool)> = sink
        .inner
        .batches()
        .iter()
        .filter(|batch| batch.late)
        .flat_map(|batch| {
            batch.events.iter().map(|event| (event.pk()["id"].as_i64().unwrap(), batch.late)).collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(late, vec![(35, true)]);
    poller.tick().await.unwrap();
    let document = case.document();
    assert_eq!(document.failure, None, "the failure is cleared");
    assert!(document.late.unwrap().undelivered.is_none(), "the mark is cleared");
}

/// Issue 26, section 3: what was found late is in `status` (and its JSON, which the status
/// function serves) and in a watchdog finding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_arrivals_are_in_status_and_the_watchdog() {
    let (case, _) = sqlite_seq_case(None).await;
    case.tick().await;
    execute(&case.url, "INSERT INTO items (id, seq, note) VALUES (35, 35, 'late');\n").await;
    case.tick().await;
    let now = chrono::Utc::now();
    let health = dbtrigger::status::of_poller("orders", &case.poller, now).await;
    assert!(health.healthy, "{:?}", health.problems);
    assert_eq!(health.late_arrivals, 1);
    assert!(health.last_late_arrival_at.is_some());
    let json = serde_json::to_value(&health).unwrap();
    assert_eq!(json["late_arrivals"], 1);
    let (findings, _) = dbtrigger::domain::watchdog::judge(&health, None, 3, None, now);
    let kinds: Vec<_> = findings.iter().map(|finding| finding.kind.name()).collect();
    assert_eq!(kinds, ["late_arrivals"]);
    assert!(findings[0].message.contains("settleSeconds does not apply"), "{}", findings[0].message);
}

/// A table whose integer cursor `seq` the test writes (a row "committed late" is one inserted with
/// a `seq` the checkpoint passed), on every engine.
fn seq_table(engine: Engine) -> &'static str {
    match engine {
        Engine::Postgres => {
            "CREATE TABLE items (id BIGINT PRIMARY KEY, seq BIGINT NOT NULL, note TEXT);\nCREATE INDEX ON items (seq, id);\n"
        }
        Engine::MariaDb => {
            "CREATE TABLE items (id BIGINT PRIMARY KEY, seq BIGINT NOT NULL, note TEXT, INDEX (seq, id));\n"
        }
        Engine::Sqlite => {
            "CREATE TABLE items (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL, note TEXT);\nCREATE INDEX items_seq ON items (seq, id);\n"
        }
    }
}

/// Ticks until one finds a late row, at most `bound`: how many it took.
async fn ticks_to_find(case: &Case, bound: usize) -> usize {
    for tick in 1..=bound {
        let report = case.tick().await;
        assert_eq!(report.late_check, LateCheck::Checked);
        match report.late_arrivals {
            0 => continue,
            1 => return tick,
            more => panic!("{more} rows found late, one was"),
        }
    }
    panic!("the late row was not found within {bound} ticks");
}

/// docs/late-arrivals.md, the delay bound: a check recounts the newest buckets and a slice of the
/// older ones. A row committed late far behind the checkpoint (in the oldest bucket of 800 rows)
/// is found within `sweepChecks` ticks (`everyTicks` 1); one committed late among the newest rows
/// at the next tick. Each is delivered once, marked late, and counted; nothing else is.
async fn old_and_fresh_late_rows_are_found_within_the_bound(engine: Engine) {
    const SWEEP_CHECKS: usize = 4;
    let extra = json!({"cursor": "seq", "lateArrivals": {"windowRows": 3200, "sweepChecks": SWEEP_CHECKS}});
    let case = Case::new(engine, seq_table(engine), extra).await;
    let rows: Vec<String> = (1..=800).map(|n| format!("({}, {}, 'row')", 10 * n, 10 * n)).collect();
    execute(&case.url, &format!("INSERT INTO items (id, seq, note) VALUES {};\n", rows.join(", "))).await;
    case.tick().await;
    assert_eq!(case.delivered().len(), 800);
    let window = case.document().late.unwrap().window.unwrap();
    // Small buckets behind the checkpoint, merged ones (at most 3200 / 16 rows) further back.
    assert_eq!(window.buckets.iter().map(|bucket| bucket.tally.rows).sum::<u64>(), 800);
    let sizes: Vec<u64> = window.buckets.iter().map(|bucket| bucket.tally.rows).collect();
    assert!(sizes.iter().rev().take(4).all(|rows| *rows <= 16), "{sizes:?}");
    assert!(sizes.iter().all(|rows| *rows <= 200) && sizes.len() < 12, "{sizes:?}");
    for _ in 0..3 {
        assert_eq!(case.tick().await.late_arrivals, 0, "nothing is late yet");
    }

    execute(&case.url, "INSERT INTO items (id, seq, note) VALUES (15, 15, 'late, oldest bucket');\n").await;
    let took = ticks_to_find(&case, SWEEP_CHECKS).await;
    assert!(took <= SWEEP_CHECKS);
    assert_eq!(case.delivered().last(), Some(&(15, true)));

    execute(&case.url, "INSERT INTO items (id, seq, note) VALUES (7995, 7995, 'late, newest bucket');\n").await;
    assert_eq!(ticks_to_find(&case, 1).await, 1, "a fresh late row is found at the next tick");
    assert_eq!(case.delivered().last(), Some(&(7995, true)));

    for _ in 0..(2 * SWEEP_CHECKS) {
        assert_eq!(case.tick().await.late_arrivals, 0, "nothing found twice, nothing else late");
    }
    let late: Vec<i64> = case.delivered().into_iter().filter(|(_, late)| *late).map(|(id, _)| id).collect();
    assert_eq!(late, vec![15, 7995]);
    assert_eq!(case.delivered().len(), 802);
    assert_eq!(case.document().late.unwrap().found, 2);
}

per_engine! {
    postgres_old_and_fresh_late_rows_are_found_within_the_bound: old_and_fresh_late_rows_are_found_within_the_bound, Engine::Postgres;
    mariadb_old_and_fresh_late_rows_are_found_within_the_bound: old_and_fresh_late_rows_are_found_within_the_bound, Engine::MariaDb;
    sqlite_old_and_fresh_late_rows_are_found_within_the_bound: old_and_fresh_late_rows_are_found_within_the_bound, Engine::Sqlite;
}

/// A receiver that refuses, with `status`, any late batch holding one of the `refused` ids, and
/// records what it takes.
struct RefusesLateRows {
    inner: RecordingSink,
    refused: std::sync::Mutex<Vec<i64>>,
    status: u16,
}

#[async_trait::async_trait]
impl dbtrigger::sink::Sink for RefusesLateRows {
    async fn deliver(
        &self,
        batch: &dbtrigger::domain::Batch,
        deadline: tokio::time::Instant,
    ) -> Result<(), dbtrigger::sink::SinkError> {
        let refused = self.refused.lock().unwrap().clone();
        if batch.late && batch.events.iter().any(|event| refused.contains(&event.pk()["id"].as_i64().unwrap())) {
            return Err(dbtrigger::sink::SinkError::Rejected {
                batch_id: batch.batch_id.clone(),
                status: self.status,
                body: "refused".into(),
            });
        }
        self.inner.deliver(batch, deadline).await
    }

    fn describe(&self) -> String {
        "refuses some late rows".into()
    }
}

/// Finding 6's case: an identity cursor, rows 1-5 delivered, then rows 6 and 7 (one transaction,
/// their `seq` taken first) commit after row 8 was delivered: two late rows in one bucket. The
/// receiver refuses late batches holding row 6 with `status`; the poller keeps its quarantine in
/// the state store, in `mode`. Returns the case, the poller and its receiver, ready for the tick
/// that finds the late rows.
async fn late_rows_one_refused(
    engine: Engine,
    status: u16,
    mode: dbtrigger::domain::poison::PoisonMode,
) -> (Case, Poller, Arc<RefusesLateRows>) {
    let case = Case::new(engine, identity_table(engine), json!({"cursor": "seq"})).await;
    let mut config = case.poller.config.clone();
    config.poison.mode = mode;
    let sink = Arc::new(RefusesLateRows { inner: RecordingSink::new(), refused: vec![6].into(), status });
    let source = dbtrigger::source::open(&config.source).unwrap();
    let clock = Arc::new(dbtrigger::tick::SystemClock);
    let poller = Poller::new(config, source, sink.clone(), case.store.clone(), clock, "it".into())
        .with_quarantine(case.store.clone());
    if engine == Engine::Sqlite {
        let seed: Vec<String> = (1..=5).map(|id| format!("({id}, {id}, 'row {id}')")).collect();
        execute(&case.url, &format!("INSERT INTO items (id, seq, note) VALUES {};\n", seed.join(", "))).await;
        poller.tick().await.unwrap();
        execute(&case.url, "INSERT INTO items (id, seq, note) VALUES (8, 8, 'third');\n").await;
        poller.tick().await.unwrap();
        execute(&case.url, "INSERT INTO items (id, seq, note) VALUES (6, 6, 'first'), (7, 7, 'second');\n").await;
    } else {
        let seed: Vec<String> = (1..=5).map(|id| format!("({id}, 'row {id}')")).collect();
        execute(&case.url, &format!("INSERT INTO items (id, note) VALUES {};\n", seed.join(", "))).await;
        poller.tick().await.unwrap();
        let mut late = Writer::open(&case.url).await;
        late.execute("INSERT INTO items (id, note) VALUES (6, 'first'), (7, 'second');\n").await;
        execute(&case.url, "INSERT INTO items (id, note) VALUES (8, 'third');\n").await;
        poller.tick().await.unwrap();
        late.commit().await;
    }
    (case, poller, sink)
}

fn ids_of(sink: &RecordingSink, late: bool) -> Vec<i64> {
    let batches = sink.batches();
    let batches = batches.iter().filter(|batch| batch.late == late);
    batches.flat_map(|batch| batch.events.iter().map(|event| event.pk()["id"].as_i64().unwrap())).collect()
}

async fn quarantined_ids(case: &Case) -> Vec<(i64, Option<u16>)> {
    let config = &case.poller.config;
    let entries =
        dbtrigger::store::quarantine::list(case.store.as_ref(), &config.app_name, &config.poller_name).await.unwrap();
    entries.iter().map(|(entry, _)| (entry.event["pk"]["id"].as_i64().unwrap(), entry.status)).collect()
}

/// Regression (issue 35, finding 6): a late row the receiver refuses with 422 is isolated like
/// any poison row: it is quarantined (with its status), the other late row of its bucket is
/// delivered, both are counted, the tick succeeds, and nothing is left marked or failing.
async fn a_late_row_refused_with_422_is_quarantined_and_the_rest_delivered(engine: Engine) {
    let (case, poller, sink) =
        late_rows_one_refused(engine, 422, dbtrigger::domain::poison::PoisonMode::Quarantine).await;
    let (result, report) = poller.tick_reported().await;
    result.unwrap();
    assert_eq!(report.late_arrivals, 2, "{report:?}");
    assert_eq!(quarantined_ids(&case).await, vec![(6, Some(422))]);
    let late = ids_of(&sink.inner, true);
    assert!(late.contains(&7) && !late.contains(&6), "7 delivered late, 6 never taken: {late:?}");
    let document = case.document();
    assert_eq!(document.failure, None);
    assert!(document.late.as_ref().unwrap().undelivered.is_none());
    let (result, report) = poller.tick_reported().await;
    result.unwrap();
    assert_eq!(report.late_arrivals, 0, "settled: not found again");
    assert_eq!(ids_of(&sink.inner, true), late, "nothing sent again");
}

/// Regression (issue 35, finding 6): with `poison.mode: stop` a late row the receiver refuses
/// alone is held, never quarantined: every tick fails saying so while new rows are still
/// delivered, the failure stays recorded through those ticks, and once the receiver takes it the
/// row arrives, marked late, and the failure is cleared.
async fn with_poison_mode_stop_a_refused_late_row_is_held_not_quarantined(engine: Engine) {
    let (case, poller, sink) = late_rows_one_refused(engine, 422, dbtrigger::domain::poison::PoisonMode::Stop).await;
    for (round, id) in [(0, 9), (1, 10), (2, 11)] {
        let error = poller.tick().await.unwrap_err();
        assert!(matches!(error, dbtrigger::tick::TickError::LatePoisonStop { .. }), "round {round}: {error}");
        assert!(quarantined_ids(&case).await.is_empty(), "round {round}: nothing quarantined");
        let document = case.document();
        assert!(document.failure.is_some(), "round {round}: the failure stays recorded");
        assert!(document.late.as_ref().unwrap().undelivered.is_some(), "round {round}: the bucket stays marked");
        // A new row is still delivered at the next tick (a late row never holds up new ones).
        if engine == Engine::Sqlite {
            execute(&case.url, &format!("INSERT INTO items (id, seq, note) VALUES ({id}, {id}, 'new');\n")).await;
        } else {
            execute(&case.url, &format!("INSERT INTO items (id, note) VALUES ({id}, 'new');\n")).await;
        }
    }
    assert!(ids_of(&sink.inner, false).ends_with(&[8, 9, 10]), "{:?}", ids_of(&sink.inner, false));
    sink.refused.lock().unwrap().clear();
    let (result, report) = poller.tick_reported().await;
    result.unwrap();
    assert!(report.late_arrivals >= 1, "{report:?}");
    assert!(ids_of(&sink.inner, true).contains(&6), "6 arrives, marked late");
    let document = case.document();
    assert_eq!(document.failure, None, "the failure is cleared once delivered");
    assert!(document.late.unwrap().undelivered.is_none());
    assert!(quarantined_ids(&case).await.is_empty());
}

/// Regression (issue 35, finding 6, as issue 36 for any batch): a late batch the endpoint refuses
/// (401: a rotated token) is held: nothing isolated or quarantined, the tick fails saying so, the
/// failure stays recorded, and the rows arrive once the endpoint answers again.
async fn an_endpoint_refusing_a_late_batch_holds_it_and_quarantines_nothing(engine: Engine) {
    let (case, poller, sink) =
        late_rows_one_refused(engine, 401, dbtrigger::domain::poison::PoisonMode::Quarantine).await;
    for round in 0..2 {
        let error = poller.tick().await.unwrap_err();
        assert!(matches!(error, dbtrigger::tick::TickError::LateEndpointRefused { status: 401, .. }), "{error}");
        assert!(quarantined_ids(&case).await.is_empty(), "round {round}");
        assert!(case.document().failure.is_some(), "round {round}");
    }
    sink.refused.lock().unwrap().clear();
    let (result, report) = poller.tick_reported().await;
    result.unwrap();
    assert_eq!(report.late_arrivals, 2, "{report:?}");
    let late = ids_of(&sink.inner, true);
    assert!(late.contains(&6) && late.contains(&7), "{late:?}");
    assert_eq!(case.document().failure, None);
}

/// A late bucket held undelivered (the endpoint refusing it) when late arrivals are then turned
/// off: nothing would deliver it any more, so the next tick drops the mark, and the failure it
/// kept visible clears (it stayed for ever before).
async fn turning_late_arrivals_off_drops_an_undelivered_mark_and_its_failure(engine: Engine) {
    let (case, poller, sink) =
        late_rows_one_refused(engine, 401, dbtrigger::domain::poison::PoisonMode::Quarantine).await;
    assert!(poller.tick().await.is_err());
    assert!(case.document().late.as_ref().is_some_and(|late| late.undelivered.is_some()));
    assert!(case.document().failure.is_some());
    let mut config = poller.config.clone();
    config.late_arrivals.enabled = false;
    let source = dbtrigger::source::open(&config.source).unwrap();
    let clock = Arc::new(dbtrigger::tick::SystemClock);
    let off = Poller::new(config, source, sink.clone(), case.store.clone(), clock, "it".into())
        .with_quarantine(case.store.clone());
    off.tick().await.unwrap();
    assert!(case.document().late.as_ref().is_none_or(|late| late.undelivered.is_none()));
    assert_eq!(case.document().failure, None);
}

per_engine! {
    sqlite_turning_late_arrivals_off_drops_an_undelivered_mark_and_its_failure: turning_late_arrivals_off_drops_an_undelivered_mark_and_its_failure, Engine::Sqlite;
    sqlite_a_late_row_refused_with_422_is_quarantined_and_the_rest_delivered: a_late_row_refused_with_422_is_quarantined_and_the_rest_delivered, Engine::Sqlite;
    postgres_a_late_row_refused_with_422_is_quarantined_and_the_rest_delivered: a_late_row_refused_with_422_is_quarantined_and_the_rest_delivered, Engine::Postgres;
    sqlite_with_poison_mode_stop_a_refused_late_row_is_held_not_quarantined: with_poison_mode_stop_a_refused_late_row_is_held_not_quarantined, Engine::Sqlite;
    sqlite_an_endpoint_refusing_a_late_batch_holds_it_and_quarantines_nothing: an_endpoint_refusing_a_late_batch_holds_it_and_quarantines_nothing, Engine::Sqlite;
}
