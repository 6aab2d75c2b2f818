//! Where rows come from: a trait with one question, "the next rows after this position", and its
//! SQL implementations: PostgreSQL and MySQL/MariaDB over sqlx, SQLite over rusqlite. Dialect
//! differences live in [`query`] (the SQL) and in each engine's module (decoding values).
//!
//! Before its first seek a source runs a pre-flight, once: it prepares the query to learn the
//! cursor's type (which shapes the settle predicate and the placeholders' casts), and warns once
//! when no index starts with (cursor, pk...), since the seek's cost then grows with the table.

pub mod ddl;
mod fetch;
pub mod horizon;
pub mod late;
pub mod logical;
pub mod mysql;
pub mod pools;
pub mod position;
pub mod postgres;
pub mod query;
pub mod sqlite;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use serde_json::Value;
use sqlx::{Database, Encode, Type};

use crate::config::redact::Redaction;
use crate::config::{Engine, OpRule, SourceConfig};
use crate::domain::late::Tally;
use crate::domain::{CursorValue, PkValue, Position};
pub(crate) use fetch::{Collector, RowSizes, fetch_rows};
pub use late::{BucketCheck, BucketRange};
use position::bind_position;
pub use query::Probe;
use query::SeekQuery;

use crate::domain::event::Op;
pub use crate::domain::event::{RowJson, SourceRow};

/// How much one fetch may return: a row count (the batch size) and a byte budget (the rows as
/// JSON), whichever is reached first. At least one row is returned whatever its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchLimit {
    pub rows: usize,
    pub bytes: usize,
}

/// What one fetch returned.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Fetched {
    pub rows: Vec<SourceRow>,
    /// The fetch stopped at a limit, so more rows may follow; `false` means the source had no more
    /// rows when it was read (no need to ask again this tick).
    pub full: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error("cannot reach the database ({location}): {reason}")]
    Unreachable { location: String, reason: String },
    #[error("the query on {location} failed: {reason}")]
    Query { location: String, reason: String },
    #[error("column {column:?} has type {type_name}, which dbtrigger cannot turn into JSON")]
    UnsupportedType { column: String, type_name: String },
    #[error("cursor/key column problem: {0}")]
    Position(String),
    #[error("the query on {location} took longer than {seconds} s (source.queryTimeoutSeconds) and was cancelled")]
    Timeout { location: String, seconds: u64 },
    /// A stored position that does not fit the configured key: never bound.
    #[error(transparent)]
    KeyMismatch(#[from] crate::domain::cursor::KeyMismatch),
    /// Every connection the app allows to this database stayed busy for the poller's tick budget.
    #[error(
        "every one of the {cap} connections this app allows to {location} stayed in use for {seconds} s (source.maxConnections, app setting DBTRIGGER_MAX_CONNECTIONS_PER_DATABASE)"
    )]
    Busy { location: String, cap: u32, seconds: u64 },
    /// A row that cannot be delivered, named by its primary key.
    #[error("{error} (in the row with {row})")]
    InRow { row: String, error: Box<SourceError> },
}

#[async_trait]
pub trait Source: Send + Sync {
    /// The rows `probe` asks for, strictly after `after` (from the start when `None`), in
    /// (cursor, pk...) order (the last row first for [`Probe::Last`]), up to `limit`.
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError>;

    /// How many rows come after `after`, settled or not, counted up to `cap`.
    async fn count_after(&self, after: Option<&Position>, cap: u64) -> Result<u64, SourceError>;

    /// The source's load generation (`source.generation`'s one value: text, an integer or null),
    /// or `None` when it has none configured.
    async fn generation(&self) -> Result<Option<Value>, SourceError>;

    /// What holds the source's commit horizon (or its `settle: "auto"` bound) back: the oldest
    /// transaction the database reports open, when the cursor is read below one; `None` otherwise.
    async fn horizon_holder(&self) -> Result<Option<crate::domain::health::HorizonHolder>, SourceError> {
        Ok(None)
    }

    /// Where the source is, for messages; never includes a password.
    fn describe(&self) -> String;

    /// How long this source waited for a connection (all of its target's were in use) since the
    /// last call: a tick reads it at its end, for its summary line.
    fn connection_wait(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }

    /// A logical source's replication slot, as the server reports it; `None` for the others.
    async fn slot(&self) -> Result<Option<crate::domain::slot::SlotView>, SourceError> {
        Ok(None)
    }

    /// The state document's checkpoint as committed: at the start of a tick (as read) and after
    /// each commit. A source that keeps a position of its own on the server (a logical source's
    /// replication slot) moves it here, never past what is committed; the others have nothing to
    /// do.
    async fn committed(&self, checkpoint: Option<&Position>) -> Result<(), SourceError> {
        let _ = checkpoint;
        Ok(())
    }

    /// The late-arrival recount ([`late`]): one tally per bucket of `check`, over the rows at or
    /// before its checkpoint. `None`: this source cannot recount (a test double), and the detector
    /// stays off for it.
    async fn tally_buckets(&self, check: &BucketCheck) -> Result<Option<Vec<Tally>>, SourceError> {
        let _ = check;
        Ok(None)
    }

    /// Up to `limit` rows of one bucket of the late-arrival window, after `after`, in order.
    async fn read_bucket(
        &self,
        range: &BucketRange,
        after: Option<&Position>,
        limit: FetchLimit,
    ) -> Result<Fetched, SourceError> {
        let _ = (range, after, limit);
        Err(SourceError::Query { location: self.describe(), reason: "this source cannot re-read a bucket".into() })
    }

    /// The next rows to deliver: settled rows strictly after `after`, up to `limit`.
    async fn fetch_after(&self, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        self.read(Probe::Deliver, after, limit).await
    }
}

/// What waits after a checkpoint: `status`'s lag.
#[derive(Debug, Clone, PartialEq)]
pub struct Backlog {
    /// Rows after the checkpoint, settled or not, counted up to the cap.
    pub rows: u64,
    /// The count stopped at the cap: there are at least `rows`.
    pub capped: bool,
    /// The cursor of the first row not yet delivered.
    pub oldest: Option<CursorValue>,
}

/// Counts what waits after `after` (up to `cap` rows) and finds the first of it.
pub async fn backlog(source: &dyn Source, after: Option<&Position>, cap: u64) -> Result<Backlog, SourceError> {
    let rows = source.count_after(after, cap).await?;
    let oldest = if rows == 0 {
        None
    } else {
        let first = source.read(Probe::Pending, after, FetchLimit { rows: 1, bytes: usize::MAX }).await?;
        first.rows.into_iter().next().map(|row| row.position.cursor)
    };
    Ok(Backlog { rows, capped: rows >= cap, oldest })
}

/// The position of the source's last settled row (`None`: the source is empty), for
/// `reset --to-end`.
pub async fn last_position(source: &dyn Source) -> Result<Option<Position>, SourceError> {
    let last = source.read(Probe::Last, None, FetchLimit { rows: 1, bytes: usize::MAX }).await?;
    Ok(last.rows.into_iter().next().map(|row| row.position))
}

/// A pooled connection idle for less than this is handed out without a ping: the back-to-back
/// fetches of a catch-up skip that round trip, while a connection idle since an earlier tick
/// (ticks are seconds apart at least) is checked first, and replaced if the server dropped it.
/// A connection that breaks within the window fails its fetch, and the tick with it: the next
/// tick starts again from the checkpoint.
const PING_AFTER_IDLE: std::time::Duration = std::time::Duration::from_secs(1);

/// The base of every shared pool ([`pools::Target::pool_options`] sets its size and idle time):
/// ten seconds to get a connection once a permit is held (one is free or can be opened), a ping
/// only after [`PING_AFTER_IDLE`] idle.
pub(crate) fn pool_options<DB: Database>() -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::new()
        .max_connections(2)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .test_before_acquire(false)
        .before_acquire(|connection, metadata| {
            Box::pin(async move {
                if metadata.idle_for >= PING_AFTER_IDLE {
                    sqlx::Connection::ping(connection).await?;
                }
                Ok(true)
            })
        })
}

/// Runs a source question under the source's query timeout.
pub(crate) async fn timed<T, F>(
    gate: &pools::Gate,
    config: &SourceConfig,
    location: &str,
    work: F,
) -> Result<T, SourceError>
where
    F: Future<Output = Result<T, SourceError>>,
{
    // A connection of the shared target first: waiting for one is not part of the query's time.
    let _permit = gate.enter(location).await?;
    match tokio::time::timeout(config.query_timeout, work).await {
        Ok(result) => result,
        Err(_) => Err(SourceError::Timeout { location: location.to_string(), seconds: config.query_timeout.as_secs() }),
    }
}

/// The [`Source`] of an engine: every engine's source has the same fields (`pool`, `config`,
/// `redaction`, `settle_warned`, `row_sizes`), a `seek()` method (the SQL learnt once) and a [`ColumnDecoder`]
/// for its rows, so one body serves them all.
macro_rules! sql_source {
    ($source:ty) => {
        #[async_trait::async_trait]
        impl $crate::source::Source for $source {
            async fn read(
                &self,
                probe: $crate::source::Probe,
                after: Option<&$crate::domain::Position>,
                limit: $crate::source::FetchLimit,
            ) -> Result<$crate::source::Fetched, $crate::source::SourceError> {
                let fetch = async {
                    let seek = self.seek().await?;
                    // `settle: "auto"`: the bound is asked for before the rows, in its own
                    // statement, so that the rows' snapshot is taken after it (see `horizon`).
                    let bound = if seek.binds_bound(probe) { Some(self.settle_bound().await?) } else { None };
                    $crate::source::fetch_rows(
                        self.pool(),
                        &self.config,
                        seek,
                        probe,
                        after,
                        bound.as_ref(),
                        limit,
                        &self.redaction,
                        self,
                        &self.row_sizes,
                    )
                    .await
                };
                let location = &self.redaction.location;
                match probe {
                    $crate::source::Probe::Deliver => {
                        $crate::source::guarded_fetch(&self.gate, &self.config, location, &self.settle_warned, fetch)
                            .await
                    }
                    $crate::source::Probe::Pending | $crate::source::Probe::Last => {
                        $crate::source::timed(&self.gate, &self.config, location, fetch).await
                    }
                }
            }

            async fn count_after(
                &self,
                after: Option<&$crate::domain::Position>,
                cap: u64,
            ) -> Result<u64, $crate::source::SourceError> {
                let count = async {
                    let seek = self.seek().await?;
                    if let Some(position) = after {
                        $crate::source::position::check_key(&self.config, position)?;
                        $crate::source::position::check_xid_kind(seek.is_xid(), position)?;
                    }
                    $crate::source::count_rows(self.pool(), seek, after, cap, &self.redaction).await
                };
                $crate::source::timed(&self.gate, &self.config, &self.redaction.location, count).await
            }

            async fn generation(&self) -> Result<Option<serde_json::Value>, $crate::source::SourceError> {
                let Some(generation) = &self.config.generation else {
                    return Ok(None);
                };
                let value = $crate::source::fetch_scalar(self.pool(), &generation.query, &self.redaction, self);
                $crate::source::timed(&self.gate, &self.config, &self.redaction.location, value).await.map(Some)
            }

            async fn horizon_holder(
                &self,
            ) -> Result<Option<$crate::domain::health::HorizonHolder>, $crate::source::SourceError> {
                let holder = async {
                    let seek = self.seek().await?;
                    self.holder(seek).await
                };
                $crate::source::timed(&self.gate, &self.config, &self.redaction.location, holder).await
            }

            fn describe(&self) -> String {
                self.redaction.location.clone()
            }

            fn connection_wait(&self) -> std::time::Duration {
                self.gate.take_waited()
            }

            async fn tally_buckets(
                &self,
                check: &$crate::source::BucketCheck,
            ) -> Result<Option<Vec<$crate::domain::late::Tally>>, $crate::source::SourceError> {
                let work = async {
                    let seek = self.seek().await?;
                    $crate::source::late::tally_buckets(self.pool(), &self.config, &seek.plan, check, &self.redaction)
                        .await
                        .map(Some)
                };
                $crate::source::timed(&self.gate, &self.config, &self.redaction.location, work).await
            }

            async fn read_bucket(
                &self,
                range: &$crate::source::BucketRange,
                after: Option<&$crate::domain::Position>,
                limit: $crate::source::FetchLimit,
            ) -> Result<$crate::source::Fetched, $crate::source::SourceError> {
                let work = async {
                    let seek = self.seek().await?;
                    $crate::source::late::read_bucket(
                        self.pool(),
                        &self.config,
                        &seek.plan,
                        range,
                        after,
                        limit,
                        &self.redaction,
                        self,
                    )
                    .await
                };
                $crate::source::timed(&self.gate, &self.config, &self.redaction.location, work).await
            }
        }
    };
}
pub(crate) use sql_source;

/// Runs an engine's fetch under the source's query timeout (a query that does not answer in time
/// is cancelled: its future dropped, which closes the connection), and says once when
/// `settleSeconds` cannot apply to what it returned.
pub(crate) async fn guarded_fetch<F>(
    gate: &pools::Gate,
    config: &SourceConfig,
    location: &str,
    settle_warned: &AtomicBool,
    fetch: F,
) -> Result<Fetched, SourceError>
where
    F: Future<Output = Result<Fetched, SourceError>>,
{
    let fetched = timed(gate, config, location, fetch).await?;
    warn_if_settle_ignored(config, &fetched, settle_warned, location);
    Ok(fetched)
}

/// Warns once per source when `settleSeconds` was set but the cursor turned out to be an integer:
/// settle holds back young timestamps only. What protects an integer cursor from late commits is
/// that its values are handed out in commit order (a sequence read after commit, or a version
/// bumped inside the writing transaction); an identity or auto-increment column alone is not.
fn warn_if_settle_ignored(config: &SourceConfig, fetched: &Fetched, warned: &AtomicBool, location: &str) {
    if !config.settle_configured || config.settle.is_zero() {
        return;
    }
    let Some(first) = fetched.rows.first() else {
        return;
    };
    let kind = &first.position.cursor;
    if matches!(kind, CursorValue::Integer(_) | CursorValue::Xid(_)) && !warned.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            source = %location,
            cursor = %config.cursor,
            settle_seconds = config.settle.as_secs(),
            "settleSeconds applies to timestamp cursors only: this {} cursor is read without it (see the README, \"Sources\")",
            kind.kind()
        );
    }
}

/// Opens a source on pools of its own (a tool, a test): [`open_shared`] with a fresh
/// [`pools::Pools`] and the default tick budget as its wait for a connection.
pub fn open(config: &SourceConfig) -> Result<Arc<dyn Source>, SourceError> {
    let budget = std::time::Duration::from_secs(crate::config::defaults::TICK_BUDGET_SECONDS);
    open_shared(config, &pools::Pools::new(), budget)
}

/// Opens a source for a poller. Connections are made lazily, on first use, from the pool of its
/// database target in `pools`, shared with the app's other pollers of that target; a question
/// that finds them all in use waits up to `wait_limit` (the poller's tick budget). The source
/// lives as long as the poller, across ticks.
pub fn open_shared(
    config: &SourceConfig,
    pools: &pools::Pools,
    wait_limit: std::time::Duration,
) -> Result<Arc<dyn Source>, SourceError> {
    match config.engine {
        Engine::Sqlite => Ok(Arc::new(sqlite::SqliteSource::open(config)?)),
        Engine::Postgres if matches!(config.target, crate::config::SourceTarget::Logical { .. }) => {
            Ok(Arc::new(logical::LogicalSource::open(config)?))
        }
        Engine::Postgres => {
            Ok(Arc::new(postgres::PostgresSource::open(config, pools::Gate::new(pools.target(config), wait_limit))?))
        }
        Engine::MySql => {
            Ok(Arc::new(mysql::MySqlSource::open(config, pools::Gate::new(pools.target(config), wait_limit))?))
        }
    }
}

/// A database URL with every credential masked (user-info password and credential query
/// parameters), for messages.
pub fn redacted_location(url: &str) -> String {
    crate::config::redact::redacted_url(url)
}

/// What a column is to the poller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Cursor,
    Key(usize),
    Plain,
}

pub(crate) fn role_of(config: &SourceConfig, column: &str) -> Role {
    if column == config.cursor {
        return Role::Cursor;
    }
    match config.pk.iter().position(|key| key == column) {
        Some(index) => Role::Key(index),
        None => Role::Plain,
    }
}

/// A value as JSON: text borrowed from the row (written straight into the row's JSON, never
/// copied into a value of its own), or any other value.
pub(crate) enum Json<'r> {
    Text(&'r str),
    Value(Value),
}

impl Json<'_> {
    fn is_null(&self) -> bool {
        matches!(self, Json::Value(Value::Null))
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Json::Text(text) => serde_json::to_writer(out, text),
            Json::Value(value) => serde_json::to_writer(out, value),
        }
        .expect("writing to memory cannot fail")
    }

    fn to_value(&self) -> Value {
        match self {
            Json::Text(text) => Value::from(*text),
            Json::Value(value) => value.clone(),
        }
    }

    fn into_value(self) -> Value {
        match self {
            Json::Text(text) => Value::from(text),
            Json::Value(value) => value,
        }
    }
}

/// A decoded value, and what it means as a cursor or key if the column is one.
pub(crate) struct Decoded<'r> {
    pub json: Json<'r>,
    pub cursor: Option<CursorValue>,
    /// The value can be a primary key: an integer or text (its [`PkValue`] is made only for
    /// key columns).
    pub keyable: bool,
    /// Why this value cannot be a cursor position, when it looks like one but is not usable
    /// (an unreadable timestamp layout, an infinite timestamp): an error if it is the cursor.
    pub invalid_cursor: Option<String>,
}

impl<'r> Decoded<'r> {
    pub fn plain(json: Value) -> Self {
        Decoded { json: Json::Value(json), cursor: None, keyable: false, invalid_cursor: None }
    }

    pub fn integer(number: i64) -> Self {
        Decoded {
            json: Json::Value(Value::from(number)),
            cursor: Some(CursorValue::Integer(number)),
            keyable: true,
            invalid_cursor: None,
        }
    }

    pub fn float(number: f64) -> Self {
        Decoded::plain(serde_json::Number::from_f64(number).map(Value::Number).unwrap_or(Value::Null))
    }

    pub fn text(text: String) -> Self {
        Decoded { json: Json::Value(Value::String(text)), cursor: None, keyable: true, invalid_cursor: None }
    }

    /// Text borrowed from the row.
    pub fn borrowed_text(text: &'r str) -> Self {
        Decoded { json: Json::Text(text), cursor: None, keyable: true, invalid_cursor: None }
    }

    /// A point in time, delivered as the cursor's JSON form.
    pub fn moment(cursor: CursorValue) -> Self {
        Decoded { json: Json::Value(cursor.to_json()), cursor: Some(cursor), keyable: false, invalid_cursor: None }
    }

    pub fn timestamp(at: DateTime<Utc>) -> Self {
        Decoded::moment(CursorValue::Timestamp { at, source_text: None })
    }

    pub fn naive_timestamp(at: NaiveDateTime) -> Self {
        Decoded::moment(CursorValue::NaiveTimestamp(at))
    }

    /// A PostgreSQL `xid8`, delivered as its decimal digits (see [`CursorValue::Xid`]).
    pub fn xid(xid: u64) -> Self {
        Decoded::moment(CursorValue::Xid(xid))
    }

    /// A value delivered as it is but unusable as a cursor position.
    pub fn not_a_position(json: Value, why: String) -> Self {
        Decoded { json: Json::Value(json), cursor: None, keyable: false, invalid_cursor: Some(why) }
    }

    /// The value as a primary key, when it can be one.
    fn key(&self) -> Option<PkValue> {
        if !self.keyable {
            return None;
        }
        match &self.json {
            Json::Text(text) => Some(PkValue::Text(text.to_string())),
            Json::Value(Value::Number(number)) => number.as_i64().map(PkValue::Integer),
            Json::Value(Value::String(text)) => Some(PkValue::Text(text.clone())),
            Json::Value(_) => None,
        }
    }
}

/// How an engine reads the values of its rows.
pub(crate) trait ColumnDecoder<R> {
    /// One value of a row: its JSON, and what it means as a cursor or key.
    fn decode_column<'r>(&self, row: &'r R, index: usize, name: &str) -> Result<Decoded<'r>, SourceError>;

    /// The type of one value of a row, for messages.
    fn column_type(&self, row: &R, index: usize) -> String;
}

/// The pre-flight's warning when no index starts with the cursor column.
pub(crate) fn warn_missing_index(location: &str, table: &str, config: &SourceConfig) {
    tracing::warn!(
        source = %location,
        table = %table,
        "no index starts with the cursor column {:?}: each batch scans the table; create one on ({}, {})",
        config.cursor,
        config.cursor,
        config.pk.join(", ")
    );
}

/// The columns of a query's rows, learnt from its first row (every row of a result has the same):
/// what each one is to the poller, and its key as the row's JSON writes it.
pub(crate) struct Layout {
    columns: Vec<LayoutColumn>,
}

struct LayoutColumn {
    name: String,
    role: Role,
    /// `"name":`, with a comma before it after the first column.
    key: Vec<u8>,
    /// The column the source's delete rule reads (`softDelete`, `opColumn`).
    op: bool,
}

impl Layout {
    /// The layout of a result with these column names; two columns of one name are refused (a
    /// row is a JSON object: one of them would be lost).
    pub fn new<'n>(config: &SourceConfig, names: impl Iterator<Item = &'n str>) -> Result<Layout, String> {
        let op_column = match &config.ops {
            OpRule::Upsert => None,
            OpRule::SoftDelete(column) | OpRule::OpColumn(column) => Some(column.as_str()),
        };
        let mut columns: Vec<LayoutColumn> = Vec::new();
        for name in names {
            if columns.iter().any(|column| column.name == name) {
                return Err(format!(
                    "the result has two columns named {name:?}: a row is a JSON object, give them distinct names (AS)"
                ));
            }
            let mut key = Vec::with_capacity(name.len() + 4);
            if !columns.is_empty() {
                key.push(b',');
            }
            serde_json::to_writer(&mut key, name).expect("writing to memory cannot fail");
            key.push(b':');
            columns.push(LayoutColumn {
                name: name.to_string(),
                role: role_of(config, name),
                key,
                op: op_column == Some(name),
            });
        }
        Ok(Layout { columns })
    }
}

/// Puts a row together from its decoded columns, writing its JSON as they come: checks that the
/// cursor and every key are there and usable, with errors that name the column and the row.
pub(crate) struct RowBuilder<'a> {
    config: &'a SourceConfig,
    layout: &'a Layout,
    json: Vec<u8>,
    cursor: Option<CursorValue>,
    keys: Vec<Option<PkValue>>,
    /// What the delete rule's column said, once it was read.
    op: Option<Result<Op, SourceError>>,
    /// The first problem met; reported by `finish` with the row's primary key.
    error: Option<SourceError>,
}

impl<'a> RowBuilder<'a> {
    /// A row of `layout`'s columns, whose JSON is expected to take about `capacity` bytes.
    pub fn new(config: &'a SourceConfig, layout: &'a Layout, capacity: usize) -> Self {
        let mut json = Vec::with_capacity(capacity);
        json.push(b'{');
        RowBuilder { config, layout, json, cursor: None, keys: vec![None; config.pk.len()], op: None, error: None }
    }

    /// A column that could not be decoded: the row fails, named by its key once all is read.
    pub fn fail(&mut self, error: SourceError) {
        self.error.get_or_insert(error);
    }

    /// The value of column `index`; `type_name` names its type, for messages.
    pub fn push(&mut self, index: usize, decoded: Decoded<'_>, type_name: impl FnOnce() -> String) {
        let column = &self.layout.columns[index];
        let name = &column.name;
        match column.role {
            Role::Cursor => {
                if decoded.json.is_null() {
                    self.fail(SourceError::Position(format!(
                        "cursor column {name:?} is NULL in a row: a cursor must never be NULL (filter such rows with `where`)"
                    )));
                } else if let Some(invalid) = &decoded.invalid_cursor {
                    self.fail(SourceError::Position(format!("cursor column {name:?}: {invalid}")));
                } else {
                    match decoded.cursor.clone() {
                        Some(cursor) => self.cursor = Some(cursor),
                        None => self.fail(SourceError::Position(format!(
                            "cursor column {name:?} has type {}: use an integer or a timestamp column",
                            type_name()
                        ))),
                    }
                }
            }
            Role::Key(index) => match decoded.key() {
                Some(key) => self.keys[index] = Some(key),
                None => self.fail(SourceError::Position(format!(
                    "primary key column {name:?} holds {} ({}): keys must be integers or text, never NULL",
                    decoded.json.to_value(),
                    type_name()
                ))),
            },
            Role::Plain => {}
        }
        self.json.extend_from_slice(&column.key);
        decoded.json.write(&mut self.json);
        if column.op {
            self.op = Some(op_of(&self.config.ops, Some(&decoded.json.into_value())));
        }
    }

    /// The row's primary key as far as it was read, for messages: `id=7, tenant=?`.
    fn describe_key(&self) -> String {
        let parts: Vec<String> = self
            .config
            .pk
            .iter()
            .zip(&self.keys)
            .map(|(name, key)| match key {
                Some(key) => format!("{name}={}", key.to_json()),
                None => format!("{name}=?"),
            })
            .collect();
        parts.join(", ")
    }

    /// The row and its size as JSON.
    pub fn finish(mut self) -> Result<(SourceRow, usize), SourceError> {
        // The operation the row records: a bad value fails the row like any other, named by its key.
        let op = match self.op.take() {
            Some(result) => result,
            None => op_of(&self.config.ops, None),
        };
        let op = op.unwrap_or_else(|error| {
            self.fail(error);
            Op::Upsert
        });
        if let Some(error) = &self.error {
            return Err(SourceError::InRow { row: self.describe_key(), error: Box::new(error.clone()) });
        }
        let cursor = self.cursor.ok_or_else(|| {
            SourceError::Position(format!("the cursor column {:?} is not in the result", self.config.cursor))
        })?;
        let mut pk = Vec::with_capacity(self.keys.len());
        for (name, key) in self.config.pk.iter().zip(self.keys) {
            let key = key.ok_or_else(|| {
                SourceError::Position(format!("the primary key column {name:?} is not in the result"))
            })?;
            pk.push((name.clone(), key));
        }
        self.json.push(b'}');
        let size = self.json.len() + ROW_OVERHEAD_BYTES;
        Ok((SourceRow { position: Position { cursor, pk }, row: RowJson::from_encoded(self.json), op }, size))
    }
}

/// The operation a row records, by the source's delete rule, from the value of the rule's column
/// (`None`: the column is not in the result).
fn op_of(rule: &OpRule, value: Option<&Value>) -> Result<Op, SourceError> {
    match rule {
        OpRule::Upsert => Ok(Op::Upsert),
        OpRule::SoftDelete(column) => match value {
            None => Err(SourceError::Position(format!("the softDelete column {column:?} is not in the result"))),
            // NULL, false and 0 (a MySQL boolean) mean the row lives.
            Some(Value::Null | Value::Bool(false)) => Ok(Op::Upsert),
            Some(Value::Number(number)) if number.as_f64() == Some(0.0) => Ok(Op::Upsert),
            Some(_) => Ok(Op::Delete),
        },
        OpRule::OpColumn(column) => match value {
            None => Err(SourceError::Position(format!("the opColumn {column:?} is not in the result"))),
            Some(Value::String(text)) => Op::parse(text).ok_or_else(|| {
                SourceError::Position(format!(
                    "opColumn {column:?} holds {text:?}: expected insert, update, upsert or delete"
                ))
            }),
            Some(other) => Err(SourceError::Position(format!(
                "opColumn {column:?} holds {other}: expected the text insert, update, upsert or delete"
            ))),
        },
    }
}

/// What an event adds around its row (event id, op, cursor, pk), roughly, in bytes.
const ROW_OVERHEAD_BYTES: usize = 128;

/// Runs `sql` and returns its one value: the first column of the first row (`null` without a
/// row), which must be text, an integer or null.
pub(crate) async fn fetch_scalar<DB, D>(
    pool: &sqlx::Pool<DB>,
    sql: &str,
    redaction: &Redaction,
    decoder: &D,
) -> Result<Value, SourceError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    D: ColumnDecoder<DB::Row> + Sync,
{
    let row =
        sqlx::query(sqlx::AssertSqlSafe(sql)).fetch_optional(pool).await.map_err(|error| classify(redaction, error))?;
    let Some(row) = row else {
        return Ok(Value::Null);
    };
    let columns = sqlx::Row::columns(&row);
    if columns.len() != 1 {
        return Err(generation_columns_error(columns.len(), redaction));
    }
    let name = sqlx::Column::name(&columns[0]).to_string();
    let decoded = decoder.decode_column(&row, 0, &name)?;
    generation_of(decoded, || decoder.column_type(&row, 0), redaction)
}

/// A generation query must return one column.
pub(crate) fn generation_columns_error(columns: usize, redaction: &Redaction) -> SourceError {
    SourceError::Query {
        location: redaction.location.clone(),
        reason: format!("source.generation.query returned {columns} columns: it must return one value"),
    }
}

/// The generation a generation query's value names: text, an integer or null (`type_name` names
/// the value's type for the error).
pub(crate) fn generation_of(
    decoded: Decoded<'_>,
    type_name: impl FnOnce() -> String,
    redaction: &Redaction,
) -> Result<Value, SourceError> {
    match decoded.json.into_value() {
        value @ (Value::Null | Value::String(_)) => Ok(value),
        Value::Number(number) if number.is_i64() || number.is_u64() => Ok(Value::Number(number)),
        other => Err(SourceError::Query {
            location: redaction.location.clone(),
            reason: format!(
                "source.generation.query returned {other} ({}): it must return text or an integer",
                type_name()
            ),
        }),
    }
}

/// Counts the rows after `after` (settled or not), up to `cap`.
pub(crate) async fn count_rows<DB>(
    pool: &sqlx::Pool<DB>,
    seek: &SeekQuery,
    after: Option<&Position>,
    cap: u64,
    redaction: &Redaction,
) -> Result<u64, SourceError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    i64: for<'t> Encode<'t, DB> + Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    DateTime<Utc>: for<'t> Encode<'t, DB> + Type<DB>,
    NaiveDateTime: for<'t> Encode<'t, DB> + Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let query = match after {
        None => sqlx::query(sqlx::AssertSqlSafe(seek.count_sql(false))),
        Some(position) => {
            bind_position(sqlx::query(sqlx::AssertSqlSafe(seek.count_sql(true))), &seek.after_slots, position)?
        }
    };
    let cap = i64::try_from(cap).unwrap_or(i64::MAX);
    let row = query.bind(cap).fetch_one(pool).await.map_err(|error| classify(redaction, error))?;
    let count: i64 = sqlx::Row::try_get_unchecked(&row, 0usize).map_err(|error| classify(redaction, error))?;
    Ok(count.max(0) as u64)
}

/// Maps a driver error to what it means for the poller, scrubbed of the URL's secrets (a driver
/// may quote its configuration).
pub(crate) fn classify(redaction: &Redaction, error: sqlx::Error) -> SourceError {
    let location = redaction.location.clone();
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Configuration(_) => {
            SourceError::Unreachable { location, reason: redaction.scrub(&error.to_string()) }
        }
        sqlx::Error::Database(database_error) => {
            let message = redaction.scrub(database_error.message());
            let unreachable = message.contains("unable to open")
                || message.contains("password authentication failed")
                || message.contains("Access denied")
                || message.contains("does not exist") && message.contains("database");
            if unreachable {
                SourceError::Unreachable { location, reason: message }
            } else {
                SourceError::Query { location, reason: message }
            }
        }
        other => SourceError::Query { location, reason: redaction.scrub(&other.to_string()) },
    }
}
