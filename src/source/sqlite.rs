//! SQLite through rusqlite (the SQLite library sqlx links too). SQLite values carry their own
//! storage class (INTEGER, REAL, TEXT, BLOB), so rows are decoded by what each value is, not by
//! the column's declared type.
//!
//! Timestamp cursors in SQLite are text. The checkpoint keeps the parsed time (typed, RFC 3339)
//! and the exact stored text, and the seek binds that text back: rows are ordered as SQLite orders
//! them, by their text (BINARY collation), and the checkpoint compares that same text. Text order
//! is time order only when every value has one layout and one offset (UTC, ideally): docs/sources.md
//! says so. A cursor text must be a layout SQLite's date functions read (the settle predicate uses
//! `julianday`); any other is an error naming the row, never a row silently held back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use chrono::SecondsFormat;
use rusqlite::config::DbConfig;
use rusqlite::types::{Value as SqlValue, ValueRef};
use rusqlite::{Connection, ErrorCode, InterruptHandle, OpenFlags};
use serde_json::Value;
use tokio::sync::OnceCell;

use super::late::{self, BucketCheck, BucketRange};
use super::query::{CursorType, Probe, SeekPlan, SeekQuery, Slot, build_seek};
use super::sqlite_time::parse_sqlite_timestamp;
use super::{Collector, Decoded, FetchLimit, Fetched, Layout, Source, SourceError, warn_missing_index};
use crate::config::redact::Redaction;
use crate::config::{SourceConfig, SourceTarget};
use crate::domain::late::{BucketEnd, Tally};
use crate::domain::{CursorValue, PkValue, Position};

/// Connections kept open between questions (a catch-up asks one after another; `status` may ask
/// beside it).
const IDLE_CONNECTIONS: usize = 2;

/// How long a query waits for a writer's lock before it fails.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// A SQLite source. Each question (a batch, a count) runs whole on a blocking thread, on a pooled
/// connection: its rows are stepped and written as JSON where SQLite hands them out, with one
/// hand-off per batch instead of one per row (sqlx's driver copies every value and sends each row
/// across a channel: four to five times the CPU per row; docs/performance.md).
pub struct SqliteSource {
    connections: Arc<Connections>,
    config: Arc<SourceConfig>,
    redaction: Arc<Redaction>,
    query: OnceCell<Arc<SeekQuery>>,
    settle_warned: AtomicBool,
}

/// The source's idle connections, and how to open another.
struct Connections {
    /// A SQLite URI (`file:…`), so that the URL's parameters (`mode`, `immutable`, `cache`,
    /// `vfs`) mean what SQLite says they mean.
    uri: String,
    idle: Mutex<Vec<Connection>>,
}

impl Connections {
    /// An idle connection, or a new one. The database must exist: a poller never creates one.
    fn take(&self) -> rusqlite::Result<Connection> {
        if let Some(connection) = self.idle.lock().unwrap_or_else(|poison| poison.into_inner()).pop() {
            return Ok(connection);
        }
        // Read-only: a poller only reads, so no statement (nor a mistake in `where`) can write.
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_URI | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let connection = Connection::open_with_flags(&self.uri, flags)?;
        connection.busy_timeout(BUSY_TIMEOUT)?;
        // The query planner stability guarantee: a statement keeps the plan it was prepared with.
        // Without it, SQLite (built with STAT4, as here) recompiles the seek on every batch,
        // because a new value is bound to its `LIMIT ?` (about 10 µs a batch, measured), and with
        // statistics (ANALYZE) a bound cursor value could flip the plan from one batch to the next.
        connection.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
        // The late-arrival recount hashes keys in SQL as the detector does in Rust.
        super::late::register_sqlite_key_hash(&connection)?;
        Ok(connection)
    }

    fn give_back(&self, connection: Connection) {
        let mut idle = self.idle.lock().unwrap_or_else(|poison| poison.into_inner());
        if idle.len() < IDLE_CONNECTIONS {
            idle.push(connection);
        }
    }
}

/// The SQLite URI of a `sqlite://path?params` URL (the path already resolved, the parameters
/// already checked by the configuration): `file:path?params`. The URL's path is percent-decoded
/// (`%3F` for a `?` in a file name), then its `%`, `?` and `#` escaped again for the URI.
fn sqlite_uri(url: &str) -> Result<String, String> {
    let rest = url
        .strip_prefix("sqlite:")
        .ok_or_else(|| "a sqlite URL starts with sqlite://".to_string())?
        .trim_start_matches("//");
    let (path, query) = match rest.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (rest, None),
    };
    if path.is_empty() {
        return Err("a sqlite URL needs a file path: sqlite://path/to/file.db".to_string());
    }
    let path = percent_encoding::percent_decode_str(path)
        .decode_utf8()
        .map_err(|error| format!("the path of a sqlite URL is not UTF-8 once percent-decoded: {error}"))?;
    let mut uri = String::from("file:");
    for character in path.chars() {
        match character {
            '%' => uri.push_str("%25"),
            '?' => uri.push_str("%3f"),
            '#' => uri.push_str("%23"),
            other => uri.push(other),
        }
    }
    if let Some(query) = query {
        uri.push('?');
        uri.push_str(query);
    }
    Ok(uri)
}

/// Interrupts the statement of a question whose future was dropped (its query timeout passed, or
/// the tick that asked stopped), so that the blocking thread and the connection come free.
struct Cancel {
    cancelled: AtomicBool,
    handle: Mutex<Option<InterruptHandle>>,
}

impl Cancel {
    /// Called by the blocking thread once it holds a connection: `false` if the question was
    /// cancelled meanwhile.
    fn arm(&self, connection: &Connection) -> bool {
        *self.handle.lock().unwrap_or_else(|poison| poison.into_inner()) = Some(connection.get_interrupt_handle());
        !self.cancelled.load(Ordering::SeqCst)
    }

    fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        if let Some(handle) = self.handle.lock().unwrap_or_else(|poison| poison.into_inner()).take() {
            handle.interrupt();
        }
    }
}

/// Cancels its question when dropped before it answered.
struct CancelOnDrop {
    cancel: Arc<Cancel>,
    answered: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.answered {
            self.cancel.cancel();
        }
    }
}

impl SqliteSource {
    pub fn open(config: &SourceConfig) -> Result<Self, SourceError> {
        let redaction = Redaction::of_url(config.url.expose());
        let uri = sqlite_uri(config.url.expose())
            .map_err(|reason| SourceError::Unreachable { location: redaction.location.clone(), reason })?;
        Ok(SqliteSource {
            connections: Arc::new(Connections { uri, idle: Mutex::new(Vec::new()) }),
            config: Arc::new(config.clone()),
            redaction: Arc::new(redaction),
            query: OnceCell::new(),
            settle_warned: AtomicBool::new(false),
        })
    }

    /// Runs `work` on a pooled connection, on a blocking thread.
    async fn ask<T, F>(&self, work: F) -> Result<T, SourceError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, &SourceConfig, &Redaction) -> Result<T, SourceError> + Send + 'static,
    {
        let connections = self.connections.clone();
        let config = self.config.clone();
        let redaction = self.redaction.clone();
        let cancel = Arc::new(Cancel { cancelled: AtomicBool::new(false), handle: Mutex::new(None) });
        let mut guard = CancelOnDrop { cancel: cancel.clone(), answered: false };
        let task = tokio::task::spawn_blocking(move || {
            let connection = connections.take().map_err(|error| classify(&redaction, error))?;
            if !cancel.arm(&connection) {
                return Err(SourceError::Query {
                    location: redaction.location.clone(),
                    reason: "cancelled".to_string(),
                });
            }
            let answer = work(&connection, &config, &redaction);
            // An interrupted connection is as good as any other once its statement has ended.
            connections.give_back(connection);
            answer
        });
        let answer = task.await;
        guard.answered = true;
        answer.unwrap_or_else(|join_error| {
            Err(SourceError::Query {
                location: self.redaction.location.clone(),
                reason: format!("the SQLite reader failed: {join_error}"),
            })
        })
    }

    async fn seek(&self) -> Result<Arc<SeekQuery>, SourceError> {
        self.query
            .get_or_try_init(|| async {
                self.ask(|connection, config, redaction| {
                    warn_without_index(connection, config, redaction)?;
                    Ok(Arc::new(build_seek(
                        config,
                        &SeekPlan { cursor_type: CursorType::Dynamic, placeholder_types: None },
                    )))
                })
                .await
            })
            .await
            .cloned()
    }
}

/// Warns once when no index of the table starts with the cursor column.
fn warn_without_index(
    connection: &Connection,
    config: &SourceConfig,
    redaction: &Redaction,
) -> Result<(), SourceError> {
    let SourceTarget::Table { schema, name } = &config.target else {
        return Ok(());
    };
    let failed = |error| classify(redaction, error);
    let prefix = schema.as_ref().map(|schema| format!("\"{schema}\".")).unwrap_or_default();
    let mut list = connection.prepare(&format!("PRAGMA {prefix}index_list(\"{name}\")")).map_err(failed)?;
    let indexes: Vec<String> = list
        .query_map([], |row| row.get::<_, String>("name"))
        .map_err(failed)?
        .collect::<Result<_, _>>()
        .map_err(failed)?;
    for index_name in indexes {
        // The index name comes from the catalog, not from validated configuration: quoted.
        let quoted_index = index_name.replace('"', "\"\"");
        let mut info = connection.prepare(&format!("PRAGMA {prefix}index_info(\"{quoted_index}\")")).map_err(failed)?;
        let mut rows = info.query([]).map_err(failed)?;
        let first_column: Option<String> = match rows.next().map_err(failed)? {
            Some(row) => row.get("name").ok(),
            None => None,
        };
        if first_column.as_deref() == Some(config.cursor.as_str()) {
            return Ok(());
        }
    }
    warn_missing_index(&redaction.location, name, config);
    Ok(())
}

/// The values a position binds to the seek's placeholders, each as its native type; timestamps
/// without their stored text as text in the layouts SQLite compares (those sqlx wrote before).
/// A position that does not fit the configured key is refused, never bound.
fn position_values(config: &SourceConfig, slots: &[Slot], position: &Position) -> Result<Vec<SqlValue>, SourceError> {
    super::position::check_key(config, position)?;
    let mut values = Vec::with_capacity(slots.len() + 1);
    for slot in slots {
        let value = match slot {
            Slot::Cursor => match &position.cursor {
                CursorValue::Integer(number) => SqlValue::Integer(*number),
                CursorValue::Timestamp { source_text: Some(text), .. } => SqlValue::Text(text.clone()),
                CursorValue::Timestamp { at, source_text: None } => {
                    SqlValue::Text(at.to_rfc3339_opts(SecondsFormat::AutoSi, false))
                }
                CursorValue::NaiveTimestamp(at) => SqlValue::Text(at.format("%F %T%.f").to_string()),
                CursorValue::Xid(_) => {
                    return Err(SourceError::Position(
                        "the checkpoint holds an xid cursor (PostgreSQL's xid8), which a SQLite column cannot be: reset the poller".into(),
                    ));
                }
            },
            Slot::Key(index) => match super::position::key_value(position, *index)? {
                PkValue::Integer(number) => SqlValue::Integer(*number),
                PkValue::Text(text) => SqlValue::Text(text.clone()),
            },
        };
        values.push(value);
    }
    Ok(values)
}

/// Runs `sql` with `values` and collects its rows up to `limit`.
fn read_rows(
    connection: &Connection,
    config: &SourceConfig,
    redaction: &Redaction,
    sql: &str,
    values: Vec<SqlValue>,
    limit: FetchLimit,
) -> Result<Fetched, SourceError> {
    let failed = |error| classify(redaction, error);
    let mut statement = connection.prepare_cached(sql).map_err(failed)?;
    let layout = Layout::new(config, statement.column_names().into_iter())
        .map_err(|reason| SourceError::Query { location: redaction.location.clone(), reason })?;
    let mut collector = Collector::new(config, layout, limit);
    let mut rows = statement.query(rusqlite::params_from_iter(values)).map_err(failed)?;
    while let Some(row) = rows.next().map_err(failed)? {
        let at_limit = collector.add(
            |index, name| {
                let value =
                    row.get_ref(index).map_err(|error| SourceError::Position(format!("column {name:?}: {error}")))?;
                decode_value(value, name, name == config.cursor)
            },
            |index| row.get_ref(index).map(storage_class).unwrap_or("unknown").to_string(),
        )?;
        if at_limit {
            // Stop reading: the rest of the LIMIT is left to the next fetch.
            return Ok(collector.finish(true));
        }
    }
    Ok(collector.finish(false))
}

#[async_trait]
impl Source for SqliteSource {
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let after = if probe == Probe::Last { None } else { after };
        let values = after.cloned();
        let fetch = async {
            let seek = self.seek().await?;
            self.ask(move |connection, config, redaction| {
                let mut bound = match &values {
                    Some(position) => position_values(config, &seek.after_slots, position)?,
                    None => Vec::new(),
                };
                bound.push(SqlValue::Integer(limit.rows as i64));
                read_rows(connection, config, redaction, seek.sql(probe, values.is_some()), bound, limit)
            })
            .await
        };
        let location = &self.redaction.location;
        match probe {
            Probe::Deliver => {
                super::guarded_fetch(
                    &super::pools::Gate::open(),
                    &self.config,
                    location,
                    &self.settle_warned,
                    |_no_cap| fetch,
                )
                .await
            }
            Probe::Pending | Probe::Last => {
                super::timed(&super::pools::Gate::open(), &self.config, location, fetch).await
            }
        }
    }

    async fn count_after(&self, after: Option<&Position>, cap: u64) -> Result<u64, SourceError> {
        let after = after.cloned();
        let count = async {
            let seek = self.seek().await?;
            self.ask(move |connection, config, redaction| {
                let mut bound = match &after {
                    Some(position) => position_values(config, &seek.after_slots, position)?,
                    None => Vec::new(),
                };
                bound.push(SqlValue::Integer(i64::try_from(cap).unwrap_or(i64::MAX)));
                let mut statement = connection
                    .prepare_cached(seek.count_sql(after.is_some()))
                    .map_err(|error| classify(redaction, error))?;
                let count: i64 = statement
                    .query_row(rusqlite::params_from_iter(bound), |row| row.get(0))
                    .map_err(|error| classify(redaction, error))?;
                Ok(count.max(0) as u64)
            })
            .await
        };
        super::timed(&super::pools::Gate::open(), &self.config, &self.redaction.location, count).await
    }

    async fn generation(&self) -> Result<Option<Value>, SourceError> {
        if self.config.generation.is_none() {
            return Ok(None);
        }
        let value = self.ask(|connection, config, redaction| {
            let sql = &config.generation.as_ref().expect("checked above").query;
            generation_value(connection, sql, redaction)
        });
        super::timed(&super::pools::Gate::open(), &self.config, &self.redaction.location, value).await.map(Some)
    }

    fn describe(&self) -> String {
        self.redaction.location.clone()
    }

    async fn tally_buckets(&self, check: &BucketCheck) -> Result<Option<Vec<Tally>>, SourceError> {
        let check = check.clone();
        let work = async {
            let seek = self.seek().await?;
            self.ask(move |connection, config, redaction| {
                let late = late::tally_sql_for(config, &seek.plan, &check);
                let values = late::check_values(&late.slots, &check)?;
                let bound = sqlite_values(config, values)?;
                let failed = |error| classify(redaction, error);
                let mut statement = connection.prepare_cached(&late.sql).map_err(failed)?;
                let rows = statement
                    .query_map(rusqlite::params_from_iter(bound), |row| {
                        let mut columns = [0i64; late::TALLY_COLUMNS];
                        for (index, column) in columns.iter_mut().enumerate() {
                            *column = row.get::<_, Option<i64>>(index)?.unwrap_or_default();
                        }
                        Ok(columns)
                    })
                    .map_err(failed)?
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(failed)?;
                late::tallies(check.ranges.len(), &rows).map(Some)
            })
            .await
        };
        super::timed(&super::pools::Gate::open(), &self.config, &self.redaction.location, work).await
    }

    async fn read_bucket(
        &self,
        range: &BucketRange,
        after: Option<&Position>,
        limit: FetchLimit,
    ) -> Result<Fetched, SourceError> {
        let (range, after) = (range.clone(), after.cloned());
        let work = async {
            let seek = self.seek().await?;
            self.ask(move |connection, config, redaction| {
                let late = late::bucket_sql_for(config, &seek.plan, &range, after.is_some());
                let until = match &range.until {
                    BucketEnd::Before(cursor) => Some(cursor),
                    BucketEnd::Checkpoint => None,
                };
                let bounds = [range.from.clone()];
                let values = late::slot_values(
                    &late.slots,
                    &bounds,
                    until,
                    &range.checkpoint,
                    after.as_ref(),
                    range.only,
                    limit.rows as i64,
                )?;
                let bound = sqlite_values(config, values)?;
                read_rows(connection, config, redaction, &late.sql, bound, limit)
            })
            .await
        };
        super::timed(&super::pools::Gate::open(), &self.config, &self.redaction.location, work).await
    }
}

/// The values of a late-arrival question, as SQLite binds them.
fn sqlite_values(config: &SourceConfig, values: Vec<late::SlotValue>) -> Result<Vec<SqlValue>, SourceError> {
    let mut bound = Vec::with_capacity(values.len());
    for value in values {
        match value {
            late::SlotValue::Position(position, slot) => {
                bound.extend(position_values(config, std::slice::from_ref(&slot), &position)?);
            }
            late::SlotValue::Integer(number) => bound.push(SqlValue::Integer(number)),
        }
    }
    Ok(bound)
}

/// `source.generation.query`'s one value: the first column of the first row (`null` without a
/// row), which must be text, an integer or null.
fn generation_value(connection: &Connection, sql: &str, redaction: &Redaction) -> Result<Value, SourceError> {
    let failed = |error| classify(redaction, error);
    let mut statement = connection.prepare(sql).map_err(failed)?;
    if statement.column_count() != 1 {
        return Err(super::generation_columns_error(statement.column_count(), redaction));
    }
    let name = statement.column_name(0).map_err(failed)?.to_string();
    let mut rows = statement.query([]).map_err(failed)?;
    let Some(row) = rows.next().map_err(failed)? else {
        return Ok(Value::Null);
    };
    let value = row.get_ref(0).map_err(failed)?;
    super::generation_of(decode_value(value, &name, false)?, || storage_class(value).to_string(), redaction)
}

/// What a SQLite error means for the poller: a database that cannot be opened is unreachable,
/// anything else a failed query.
fn classify(redaction: &Redaction, error: rusqlite::Error) -> SourceError {
    let location = redaction.location.clone();
    let reason = redaction.scrub(&error.to_string());
    match error.sqlite_error_code() {
        Some(ErrorCode::CannotOpen | ErrorCode::NotADatabase | ErrorCode::PermissionDenied) => {
            SourceError::Unreachable { location, reason }
        }
        _ => SourceError::Query { location, reason },
    }
}

/// The value of column `name`, by its storage class.
fn decode_value<'r>(value: ValueRef<'r>, name: &str, is_cursor: bool) -> Result<Decoded<'r>, SourceError> {
    match value {
        ValueRef::Null => Ok(Decoded::plain(Value::Null)),
        ValueRef::Integer(number) => Ok(Decoded::integer(number)),
        ValueRef::Real(number) => Ok(Decoded::float(number)),
        ValueRef::Text(bytes) => {
            let text = std::str::from_utf8(bytes).map_err(|error| SourceError::UnsupportedType {
                column: name.to_string(),
                type_name: format!("TEXT ({error})"),
            })?;
            if !is_cursor {
                return Ok(Decoded::borrowed_text(text));
            }
            let Some(at) = parse_sqlite_timestamp(text) else {
                let why = format!(
                    "the text {text:?} is not a timestamp layout SQLite's date functions read \
                     (YYYY-MM-DD HH:MM[:SS[.fff]] with ' ' or 'T', then nothing, 'Z' or ±HH:MM): \
                     fix the value, or filter such rows with `where`"
                );
                return Ok(Decoded::not_a_position(Value::from(text), why));
            };
            Ok(Decoded::moment(CursorValue::Timestamp { at, source_text: Some(text.to_string()) }))
        }
        ValueRef::Blob(bytes) => {
            Ok(Decoded::plain(Value::from(base64::engine::general_purpose::STANDARD.encode(bytes))))
        }
    }
}

/// The storage class of a value (SQLite: each value has its own, whatever the column declares).
fn storage_class(value: ValueRef<'_>) -> &'static str {
    match value {
        ValueRef::Null => "NULL",
        ValueRef::Integer(_) => "INTEGER",
        ValueRef::Real(_) => "REAL",
        ValueRef::Text(_) => "TEXT",
        ValueRef::Blob(_) => "BLOB",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sqlite_url_becomes_a_sqlite_uri_with_its_parameters() {
        assert_eq!(sqlite_uri("sqlite:///srv/app/orders.db").unwrap(), "file:/srv/app/orders.db");
        assert_eq!(
            sqlite_uri("sqlite://data/orders.db?mode=ro&immutable=1").unwrap(),
            "file:data/orders.db?mode=ro&immutable=1"
        );
        // A decoded `?`, `#` or `%` in a file name is escaped again, so SQLite opens that file.
        assert_eq!(sqlite_uri("sqlite:///tmp/a%3Fb%23c%25d.db?mode=ro").unwrap(), "file:/tmp/a%3fb%23c%25d.db?mode=ro");
        assert!(sqlite_uri("sqlite://?mode=ro").unwrap_err().contains("needs a file path"));
    }

    fn config(url: &str) -> SourceConfig {
        SourceConfig {
            url: crate::config::Secret::new(url),
            target: SourceTarget::Table { schema: None, name: "t".into() },
            cursor: "c".into(),
            pk: vec!["id".into()],
            ..crate::source::query::tests::config(crate::config::Engine::Sqlite, None, None)
        }
    }

    /// A question whose future is dropped (its timeout passed) interrupts its statement: the
    /// blocking thread and the connection come free at once, not when the query would have ended.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_question_dropped_before_its_answer_interrupts_its_statement() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("slow.db");
        Connection::open(&path).unwrap().execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, c INTEGER)").unwrap();
        let source = SqliteSource::open(&config(&format!("sqlite://{}", path.display()))).unwrap();
        let (sender, receiver) = std::sync::mpsc::channel();
        // About a minute of work, uninterrupted.
        let slow = source.ask(move |connection, _, _| {
            let result = connection.query_row(
                "WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < 2000000000) SELECT count(*) FROM g",
                [],
                |row| row.get::<_, i64>(0),
            );
            sender.send(result.map_err(|error| error.to_string())).unwrap();
            Ok(())
        });
        assert!(tokio::time::timeout(Duration::from_millis(300), slow).await.is_err());
        let ended = tokio::task::spawn_blocking(move || receiver.recv_timeout(Duration::from_secs(5))).await.unwrap();
        let message = ended.expect("the statement ended within 5 s of its question being dropped").unwrap_err();
        assert!(message.contains("interrupted"), "{message}");
        let one = source
            .ask(|connection, _, _| Ok(connection.query_row("SELECT 1", [], |row| row.get::<_, i64>(0)).unwrap()))
            .await
            .unwrap();
        assert_eq!(one, 1);
        assert_eq!(source.connections.idle.lock().unwrap().len(), 1, "the interrupted connection was reused");
    }

    /// The seek is prepared once per connection, not recompiled for each batch's bound values.
    #[test]
    fn the_seek_is_not_recompiled_for_each_batch() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("seek.db");
        Connection::open(&path)
            .unwrap()
            .execute_batch(
                "CREATE TABLE t (id INTEGER PRIMARY KEY, c INTEGER NOT NULL);
                 WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < 1000) INSERT INTO t SELECT x, x / 3 FROM g;
                 CREATE INDEX t_seek ON t (c, id); ANALYZE;",
            )
            .unwrap();
        let config = config(&format!("sqlite://{}", path.display()));
        let seek = build_seek(&config, &SeekPlan { cursor_type: CursorType::Dynamic, placeholder_types: None });
        let connections = Connections { uri: sqlite_uri(config.url.expose()).unwrap(), idle: Mutex::new(Vec::new()) };
        let connection = connections.take().unwrap();
        let mut statement = connection.prepare(seek.sql(Probe::Deliver, true)).unwrap();
        for batch in 0..20i64 {
            let mut rows = statement.query((batch * 10, batch * 30, 10 + batch)).unwrap();
            while rows.next().unwrap().is_some() {}
        }
        assert_eq!(statement.get_status(rusqlite::StatementStatus::RePrepare), 0);
    }

    #[test]
    fn a_file_with_a_question_mark_in_its_name_is_opened() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("odd?name#1%.db");
        Connection::open(&path).unwrap().execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY)").unwrap();
        let encoded = path.to_str().unwrap().replace('%', "%25").replace('?', "%3F").replace('#', "%23");
        let connections = Connections {
            uri: sqlite_uri(&format!("sqlite://{encoded}?mode=ro")).unwrap(),
            idle: Mutex::new(Vec::new()),
        };
        let connection = connections.take().unwrap();
        let count: i64 = connection.query_row("SELECT count(*) FROM t", [], |row| row.get(0)).unwrap();
        assert_eq!(count, 0);
        assert!(
            Connections { uri: sqlite_uri("sqlite:///nonexistent/dir/x.db").unwrap(), idle: Mutex::new(Vec::new()) }
                .take()
                .is_err()
        );
    }

    /// Regression (issue 30, item 9): the poller's connections are read-only, even on a database
    /// file it could write: no statement through them can change the database.
    #[test]
    fn connections_are_opened_read_only() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("items.db");
        Connection::open(&path).unwrap().execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY)").unwrap();
        let connections = Connections {
            uri: sqlite_uri(&format!("sqlite://{}", path.display())).unwrap(),
            idle: Mutex::new(Vec::new()),
        };
        let connection = connections.take().unwrap();
        let count: i64 = connection.query_row("SELECT count(*) FROM t", [], |row| row.get(0)).unwrap();
        assert_eq!(count, 0, "it reads");
        let write = connection.execute("INSERT INTO t (id) VALUES (1)", []);
        assert!(
            matches!(&write, Err(rusqlite::Error::SqliteFailure(error, _)) if error.code == ErrorCode::ReadOnly),
            "{write:?}"
        );
    }
}
