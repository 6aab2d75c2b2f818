//! The late-arrival detector's two questions to the database (the window and its buckets are in
//! [`crate::domain::late`]):
//!
//! - **the recount**: for each bucket a check covers (the fresh ones and a slice of the older
//!   ones, [`crate::domain::late::sweep`]), its rows (the last bucket's up to the checkpoint)
//!   counted with the sums of their key hashes, in one statement: an aggregate a bucket over its
//!   own range scan of the `(cursor, pk…)` index, joined by `UNION ALL`;
//! - **the re-read** of one bucket: its rows, in order, after a position, as batches are read (or
//!   only the rows of one key hash).
//!
//! The key hash is computed in SQL as [`crate::domain::late::hash`] computes it: integer
//! arithmetic for one integer key, SHA-256 of the key's text otherwise; SQLite calls
//! `dbtrigger_key_hash`, which the SQLite source registers on its connections (the same Rust
//! function). The SQL is built from validated identifiers and binds every value.

use chrono::{DateTime, NaiveDateTime, Utc};
use futures::TryStreamExt;
use sqlx::{Database, Encode, Type};

use super::fetch::Collector;
use super::position::bind_position;
use super::query::{CursorType, SeekPlan, Slot, quote_identifier};
use super::{ColumnDecoder, FetchLimit, Fetched, Layout, SourceError, classify};
use crate::config::redact::Redaction;
use crate::config::{Engine, SourceConfig, SourceTarget};
use crate::domain::late::hash::{CURSOR_MULTIPLIER, KEY_HASH_MODULUS};
use crate::domain::late::{BucketEnd, KeyHash, KeyHashKind, Tally};
use crate::domain::{CursorValue, PkValue, Position};

/// The SQLite function that hashes a key (`u << 31 | v`): registered on every SQLite connection.
pub const SQLITE_KEY_HASH_FUNCTION: &str = "dbtrigger_key_hash";

/// A recount: some buckets of the window (each its first cursor and where it ends, oldest first)
/// and the checkpoint the last bucket ends at.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketCheck {
    pub ranges: Vec<(CursorValue, BucketEnd)>,
    pub checkpoint: Position,
}

/// The rows of one bucket at or before the checkpoint; with `only`, just the rows of that key hash.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketRange {
    pub from: CursorValue,
    pub until: BucketEnd,
    pub checkpoint: Position,
    pub only: Option<KeyHash>,
}

impl BucketCheck {
    fn key_kind(&self) -> KeyHashKind {
        KeyHashKind::of(&self.checkpoint.pk.iter().map(|(_, value)| value).collect::<Vec<&PkValue>>())
    }
}

impl BucketRange {
    fn key_kind(&self) -> KeyHashKind {
        KeyHashKind::of(&self.checkpoint.pk.iter().map(|(_, value)| value).collect::<Vec<&PkValue>>())
    }
}

/// What a placeholder of these queries binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LateSlot {
    /// The n-th bucket's first cursor.
    Bound(usize),
    /// The first cursor after the n-th bucket of a recount (the next bucket's).
    End(usize),
    /// The first cursor of the bucket after the one read.
    Until,
    /// The checkpoint's cursor or key column.
    Checkpoint(Slot),
    /// The position a re-read goes on after.
    After(Slot),
    /// The key hash a re-read looks for.
    HashU,
    HashV,
    Limit,
}

/// A query and what its placeholders bind, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LateSql {
    pub sql: String,
    pub slots: Vec<LateSlot>,
}

/// Builds SQL with numbered (PostgreSQL, cast to the column's type) or positional placeholders.
struct Builder<'a> {
    engine: Engine,
    plan: &'a SeekPlan,
    slots: Vec<LateSlot>,
    /// PostgreSQL: each value in a scalar subquery, `(SELECT $n)`, so that the planner cannot
    /// plan for the values bound: the prepared statement's generic plan (the same index range
    /// scan, its bounds read at run time) is then as cheap as a custom one, and is kept after five
    /// runs instead of planning the recount again at every check (about 0.2 ms a time).
    generic: bool,
}

impl Builder<'_> {
    fn placeholder(&mut self, slot: LateSlot) -> String {
        self.slots.push(slot);
        if self.engine != Engine::Postgres {
            return "?".to_string();
        }
        let typed = match slot {
            LateSlot::Bound(_)
            | LateSlot::End(_)
            | LateSlot::Until
            | LateSlot::Checkpoint(Slot::Cursor)
            | LateSlot::After(Slot::Cursor) => Some(0),
            LateSlot::Checkpoint(Slot::Key(index)) | LateSlot::After(Slot::Key(index)) => Some(index + 1),
            LateSlot::HashU | LateSlot::HashV | LateSlot::Limit => None,
        };
        let cast = typed
            .and_then(|index| self.plan.placeholder_types.as_ref().and_then(|types| types.get(index)))
            .map(|name| format!("::{}", super::query::postgres_type_name(name)))
            .unwrap_or_default();
        if self.generic {
            return format!("(SELECT ${}{cast})", self.slots.len());
        }
        format!("${}{cast}", self.slots.len())
    }

    /// `(c, k…) <= checkpoint` (`Le`) or `(c, k…) > after` (`Gt`), in the form the engine seeks on.
    fn compare(&mut self, columns: &[String], greater: bool, slot: fn(Slot) -> LateSlot) -> String {
        let cursor = &columns[0];
        let keys = &columns[1..];
        match self.engine {
            Engine::Postgres | Engine::Sqlite => {
                let mut values = vec![self.placeholder(slot(Slot::Cursor))];
                for index in 0..keys.len() {
                    values.push(self.placeholder(slot(Slot::Key(index))));
                }
                let operator = if greater { ">" } else { "<=" };
                format!("({}) {operator} ({})", columns.join(", "), values.join(", "))
            }
            Engine::MySql => {
                let (outer, strict, last) = if greater { (">=", ">", ">") } else { ("<=", "<", "<=") };
                let bound = format!("{cursor} {outer} {}", self.placeholder(slot(Slot::Cursor)));
                let mut alternatives = vec![format!("{cursor} {strict} {}", self.placeholder(slot(Slot::Cursor)))];
                for depth in 0..keys.len() {
                    let mut terms = vec![format!("{cursor} = {}", self.placeholder(slot(Slot::Cursor)))];
                    for (index, key) in keys.iter().enumerate().take(depth) {
                        terms.push(format!("{key} = {}", self.placeholder(slot(Slot::Key(index)))));
                    }
                    let operator = if depth + 1 == keys.len() { last } else { strict };
                    terms.push(format!("{} {operator} {}", keys[depth], self.placeholder(slot(Slot::Key(depth)))));
                    alternatives.push(format!("({})", terms.join(" AND ")));
                }
                format!("{bound} AND ({})", alternatives.join(" OR "))
            }
        }
    }
}

/// The quoted cursor and key columns, and the source's FROM.
fn columns_and_from(config: &SourceConfig) -> (Vec<String>, String) {
    let quote = |identifier: &str| quote_identifier(config.engine, identifier);
    let mut columns = vec![quote(&config.cursor)];
    columns.extend(config.pk.iter().map(|key| quote(key)));
    let from = match &config.target {
        SourceTarget::Table { schema: Some(schema), name } => format!("{}.{}", quote(schema), quote(name)),
        SourceTarget::Table { schema: None, name } => quote(name),
        SourceTarget::Query(query) => format!("({query}) AS dbtrigger_source"),
        // Never read by a seek (see `source::logical`): a name that cannot be a table's.
        SourceTarget::Logical { slot, .. } => quote(&format!("logical slot {slot}")),
        SourceTarget::Binlog { .. } => quote("binary log"),
    };
    (columns, from)
}

/// The key's text, as [`crate::domain::late::hash::key_hash`] joins it: each column's text
/// without its trailing spaces (PostgreSQL's `::text` drops a `char(n)`'s padding, Rust keeps it;
/// both sides drop every trailing space).
fn key_text(engine: Engine, keys: &[String]) -> String {
    match (engine, keys) {
        (Engine::Postgres, [key]) => format!("rtrim({key}::text, ' ')"),
        (Engine::Postgres, _) => {
            let parts: Vec<String> = keys.iter().map(|key| format!("rtrim({key}::text, ' ')")).collect();
            format!("concat_ws(chr(31), {})", parts.join(", "))
        }
        (_, [key]) => format!("TRIM(TRAILING ' ' FROM CONVERT({key} USING utf8mb4))"),
        (_, _) => {
            let parts: Vec<String> =
                keys.iter().map(|key| format!("TRIM(TRAILING ' ' FROM CONVERT({key} USING utf8mb4))")).collect();
            format!("CONCAT_WS(CHAR(31), {})", parts.join(", "))
        }
    }
}

/// `x`: what the key's hash is computed from, once a row: `u` for an integer key, the digest's
/// hex for another (PostgreSQL, MySQL); on SQLite the whole version's hash, `u << 31 | v`, from
/// the cursor and the key (`columns`: the cursor, then the key).
fn hash_source(engine: Engine, kind: KeyHashKind, columns: &[String]) -> String {
    let modulus = KEY_HASH_MODULUS;
    let keys = &columns[1..];
    match (engine, kind) {
        (Engine::Sqlite, _) => format!("{SQLITE_KEY_HASH_FUNCTION}({})", columns.join(", ")),
        (Engine::Postgres, KeyHashKind::Integer) => {
            format!("((({}::bigint % {modulus}) + {modulus}) % {modulus})", keys[0])
        }
        (Engine::MySql, KeyHashKind::Integer) => format!("MOD(MOD({}, {modulus}) + {modulus}, {modulus})", keys[0]),
        (Engine::Postgres, KeyHashKind::Digest) => {
            format!("encode(sha256(convert_to({}, 'UTF8')), 'hex')", key_text(engine, keys))
        }
        (Engine::MySql, KeyHashKind::Digest) => format!("SHA2({}, 256)", key_text(engine, keys)),
    }
}

/// `w`: the cursor's word ([`crate::domain::late::hash::cursor_word`]) in SQL, modulo P and
/// non-negative: the integer, a timestamp's microseconds since 1970 (PostgreSQL's `extract` is
/// exact; MySQL's session runs in UTC), an `xid8`'s value. SQLite computes it in its function.
fn cursor_word_sql(engine: Engine, plan: &SeekPlan, cursor: &str) -> String {
    let modulus = KEY_HASH_MODULUS;
    match (engine, plan.cursor_type) {
        (Engine::Postgres, CursorType::Timestamp | CursorType::NaiveTimestamp) => {
            format!("((((extract(epoch from {cursor}) * 1000000)::bigint % {modulus}) + {modulus}) % {modulus})")
        }
        (Engine::Postgres, CursorType::Xid) => format!("(({cursor})::text::numeric % {modulus})::bigint"),
        (Engine::Postgres, _) => format!("((({cursor})::bigint % {modulus} + {modulus}) % {modulus})"),
        (_, CursorType::Timestamp | CursorType::NaiveTimestamp) => format!(
            "MOD(MOD(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {cursor}), {modulus}) + {modulus}, {modulus})"
        ),
        (_, _) => format!("MOD(MOD({cursor}, {modulus}) + {modulus}, {modulus})"),
    }
}

/// A row version's `u` and `v`, from the key's `x` ([`hash_source`]) and the cursor's `w`
/// ([`cursor_word_sql`]): the key's `(k_u, k_v)`, then
/// `u = (k_u + w·M mod P) mod P`, `v = (k_v + u² mod P) mod P`.
fn hash_parts(engine: Engine, kind: KeyHashKind, x: &str, w: &str) -> (String, String) {
    let modulus = KEY_HASH_MODULUS;
    let multiplier = CURSOR_MULTIPLIER;
    let (key_u, key_v) = match (engine, kind) {
        (Engine::Sqlite, _) => return (format!("({x} >> 31)"), format!("({x} & {modulus})")),
        (Engine::Postgres, KeyHashKind::Integer) => (format!("({x})"), format!("(({x}) * ({x}) % {modulus})")),
        (Engine::MySql, KeyHashKind::Integer) => (format!("({x})"), format!("(({x}) * ({x}) % {modulus})")),
        (Engine::Postgres, KeyHashKind::Digest) => {
            let word = |start: usize| format!("(('x' || substr({x}, {start}, 8))::bit(32)::bigint >> 1)");
            (word(1), word(9))
        }
        (Engine::MySql, KeyHashKind::Digest) => {
            let word = |start: usize| {
                format!("CAST(CAST(CONV(SUBSTRING({x}, {start}, 8), 16, 10) AS UNSIGNED) >> 1 AS SIGNED)")
            };
            (word(1), word(9))
        }
    };
    let u = format!("(({key_u} + ({w}) * {multiplier} % {modulus}) % {modulus})");
    let v = format!("(({key_v} + {u} * {u} % {modulus}) % {modulus})");
    match engine {
        Engine::Postgres => (format!("({u})::int"), format!("({v})::int")),
        _ => (u, v),
    }
}

/// `v²`, `v³`, `v⁴` modulo P of a row's `dbtrigger_v` ([`crate::domain::late::moments::powers`]):
/// under 2^62 before each `%`, so exact in a signed 64-bit integer on every engine.
fn moment_terms(engine: Engine) -> [String; 3] {
    let modulus = KEY_HASH_MODULUS;
    let v = match engine {
        Engine::Postgres => "dbtrigger_v::bigint",
        _ => "dbtrigger_v",
    };
    let square = format!("({v} * {v} % {modulus})");
    let terms = [square.clone(), format!("({square} * {v} % {modulus})"), format!("({square} * {square} % {modulus})")];
    // PostgreSQL sums an `int` into a `bigint` (a `bigint` into a `numeric`).
    terms.map(|term| match engine {
        Engine::Postgres => format!("({term})::int"),
        _ => term,
    })
}

/// The recount of buckets whose ranges end as `ends` says (`true`: at the checkpoint, included;
/// `false`: before the next bucket's first cursor): `(bucket, rows, Σu, Σv)` for each, one
/// aggregate a bucket over its own range of the `(cursor, pk…)` index, joined by `UNION ALL` (no
/// bucket is computed per row, no row outside the buckets asked for is read).
pub fn tally_sql(config: &SourceConfig, plan: &SeekPlan, ends: &[bool], kind: KeyHashKind) -> LateSql {
    let engine = config.engine;
    let (columns, from) = columns_and_from(config);
    let mut builder = Builder { engine, plan, slots: Vec::new(), generic: engine == Engine::Postgres };
    let x = hash_source(engine, kind, &columns);
    let w = match engine {
        Engine::Sqlite => "0".to_string(),
        _ => cursor_word_sql(engine, plan, &columns[0]),
    };
    let (u, v) = hash_parts(engine, kind, "dbtrigger_x", "dbtrigger_w");
    let mut parts = Vec::with_capacity(ends.len());
    for (index, until_checkpoint) in ends.iter().enumerate() {
        let mut predicates = vec![format!("{} >= {}", columns[0], builder.placeholder(LateSlot::Bound(index)))];
        if *until_checkpoint {
            if engine == Engine::Postgres {
                // The range's upper end beside the row comparison: the planner estimates a range
                // (`>=` and `<=` of one column) as narrow, and keeps to the index.
                predicates.push(format!(
                    "{} <= {}",
                    columns[0],
                    builder.placeholder(LateSlot::Checkpoint(Slot::Cursor))
                ));
            }
            predicates.push(builder.compare(&columns, false, LateSlot::Checkpoint));
        } else {
            predicates.push(format!("{} < {}", columns[0], builder.placeholder(LateSlot::End(index))));
        }
        if let Some(clause) = &config.where_clause {
            predicates.push(format!("({clause})"));
        }
        let sums: Vec<String> = ["dbtrigger_u", "dbtrigger_v"]
            .iter()
            .map(|column| column.to_string())
            .chain(moment_terms(engine))
            .map(|term| match engine {
                Engine::MySql => format!("CAST(SUM({term}) AS SIGNED)"),
                _ => format!("sum({term})"),
            })
            .collect();
        let (bucket, count) = match engine {
            Engine::MySql => (format!("CAST({index} AS SIGNED)"), "CAST(COUNT(*) AS SIGNED)".to_string()),
            Engine::Postgres => (format!("{index}::bigint"), "count(*)".to_string()),
            Engine::Sqlite => (index.to_string(), "count(*)".to_string()),
        };
        // `u` and `v` computed once a row in their own subquery, which PostgreSQL and SQLite
        // would otherwise flatten into every moment that names them (`OFFSET 0` keeps it apart).
        let fence = match engine {
            Engine::Postgres => " OFFSET 0",
            Engine::Sqlite => " LIMIT -1 OFFSET 0",
            Engine::MySql => "",
        };
        parts.push(format!(
            "SELECT {bucket}, {count}, {} FROM (SELECT {u} AS dbtrigger_u, {v} AS dbtrigger_v FROM (SELECT {x} AS dbtrigger_x, {w} AS dbtrigger_w FROM {from} WHERE {}) AS dbtrigger_keys{index}{fence}) AS dbtrigger_versions{index}",
            sums.join(", "),
            predicates.join(" AND ")
        ));
    }
    LateSql { sql: parts.join(" UNION ALL "), slots: builder.slots }
}

/// The re-read of a bucket: its rows from `from` to the next bucket (`until`) or the checkpoint,
/// after a position (`after`), of one key hash (`only`), in order, up to a bound limit.
pub fn bucket_sql(
    config: &SourceConfig,
    plan: &SeekPlan,
    until_checkpoint: bool,
    after: bool,
    only: Option<KeyHashKind>,
) -> LateSql {
    let engine = config.engine;
    let (columns, from) = columns_and_from(config);
    let mut builder = Builder { engine, plan, slots: Vec::new(), generic: false };
    let mut predicates = vec![format!("{} >= {}", columns[0], builder.placeholder(LateSlot::Bound(0)))];
    if until_checkpoint {
        predicates.push(builder.compare(&columns, false, LateSlot::Checkpoint));
    } else {
        predicates.push(format!("{} < {}", columns[0], builder.placeholder(LateSlot::Until)));
    }
    if after {
        predicates.push(builder.compare(&columns, true, LateSlot::After));
    }
    if let Some(kind) = only {
        let x = hash_source(engine, kind, &columns);
        let w = cursor_word_sql(engine, plan, &columns[0]);
        let (u, v) = hash_parts(engine, kind, &x, &w);
        predicates.push(format!("{u} = {}", builder.placeholder(LateSlot::HashU)));
        predicates.push(format!("{v} = {}", builder.placeholder(LateSlot::HashV)));
    }
    if let Some(clause) = &config.where_clause {
        predicates.push(format!("({clause})"));
    }
    let projection = match &config.columns {
        None => "*".to_string(),
        Some(selected) => {
            let mut names: Vec<&String> = Vec::new();
            let op_column = config.ops.column().map(str::to_string);
            for column in
                selected.iter().chain(std::iter::once(&config.cursor)).chain(config.pk.iter()).chain(op_column.iter())
            {
                if !names.contains(&column) {
                    names.push(column);
                }
            }
            names.iter().map(|name| quote_identifier(engine, name)).collect::<Vec<_>>().join(", ")
        }
    };
    let limit = builder.placeholder(LateSlot::Limit);
    let sql = format!(
        "SELECT {projection} FROM {from} WHERE {} ORDER BY {} LIMIT {limit}",
        predicates.join(" AND "),
        columns.join(", ")
    );
    LateSql { sql, slots: builder.slots }
}

/// The recount's SQL for `check`.
pub(crate) fn tally_sql_for(config: &SourceConfig, plan: &SeekPlan, check: &BucketCheck) -> LateSql {
    let ends: Vec<bool> = check.ranges.iter().map(|(_, end)| matches!(end, BucketEnd::Checkpoint)).collect();
    tally_sql(config, plan, &ends, check.key_kind())
}

/// The values a recount's slots bind.
pub(crate) fn check_values(slots: &[LateSlot], check: &BucketCheck) -> Result<Vec<SlotValue>, SourceError> {
    let at = |cursor: &CursorValue| Position { cursor: cursor.clone(), pk: check.checkpoint.pk.clone() };
    let mut values = Vec::with_capacity(slots.len());
    for slot in slots {
        let value = match slot {
            LateSlot::Bound(index) => match check.ranges.get(*index) {
                Some((from, _)) => SlotValue::Position(at(from), Slot::Cursor),
                None => return Err(SourceError::Position(format!("no bucket {index} in the recount"))),
            },
            LateSlot::End(index) => match check.ranges.get(*index) {
                Some((_, BucketEnd::Before(until))) => SlotValue::Position(at(until), Slot::Cursor),
                _ => return Err(SourceError::Position(format!("bucket {index} of the recount has no end"))),
            },
            LateSlot::Checkpoint(slot) => SlotValue::Position(check.checkpoint.clone(), *slot),
            other => return Err(SourceError::Position(format!("a recount does not bind {other:?}"))),
        };
        values.push(value);
    }
    Ok(values)
}

/// The re-read's SQL for `range`.
pub(crate) fn bucket_sql_for(config: &SourceConfig, plan: &SeekPlan, range: &BucketRange, after: bool) -> LateSql {
    let until_checkpoint = matches!(range.until, BucketEnd::Checkpoint);
    bucket_sql(config, plan, until_checkpoint, after, range.only.map(|_| range.key_kind()))
}

/// What one slot binds: a position (and which of its values), or an integer.
pub(crate) enum SlotValue {
    Position(Position, Slot),
    Integer(i64),
}

/// The value each slot binds, for a recount or a re-read.
pub(crate) fn slot_values(
    slots: &[LateSlot],
    bounds: &[CursorValue],
    until: Option<&CursorValue>,
    checkpoint: &Position,
    after: Option<&Position>,
    only: Option<KeyHash>,
    limit: i64,
) -> Result<Vec<SlotValue>, SourceError> {
    let at = |cursor: &CursorValue| Position { cursor: cursor.clone(), pk: checkpoint.pk.clone() };
    let mut values = Vec::with_capacity(slots.len());
    for slot in slots {
        let value = match slot {
            LateSlot::Bound(index) => match bounds.get(*index) {
                Some(cursor) => SlotValue::Position(at(cursor), Slot::Cursor),
                None => return Err(SourceError::Position(format!("no bucket bound {index}"))),
            },
            LateSlot::End(_) => return Err(SourceError::Position("a re-read does not bind a recount's end".into())),
            LateSlot::Until => match until {
                Some(cursor) => SlotValue::Position(at(cursor), Slot::Cursor),
                None => return Err(SourceError::Position("a bucket range without its end".into())),
            },
            LateSlot::Checkpoint(slot) => SlotValue::Position(checkpoint.clone(), *slot),
            LateSlot::After(slot) => match after {
                Some(position) => SlotValue::Position(position.clone(), *slot),
                None => return Err(SourceError::Position("a re-read without its position".into())),
            },
            LateSlot::HashU => SlotValue::Integer(only.map(|hash| i64::from(hash.u)).unwrap_or_default()),
            LateSlot::HashV => SlotValue::Integer(only.map(|hash| i64::from(hash.v)).unwrap_or_default()),
            LateSlot::Limit => SlotValue::Integer(limit),
        };
        values.push(value);
    }
    Ok(values)
}

/// Binds the values of a recount or a re-read (sqlx engines).
fn bind_values<'q, DB>(
    mut query: sqlx::query::Query<'q, DB, <DB as Database>::Arguments>,
    values: &[SlotValue],
) -> Result<sqlx::query::Query<'q, DB, <DB as Database>::Arguments>, SourceError>
where
    DB: Database,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    DateTime<Utc>: for<'t> Encode<'t, DB> + Type<DB>,
    NaiveDateTime: for<'t> Encode<'t, DB> + Type<DB>,
{
    for value in values {
        query = match value {
            SlotValue::Position(position, slot) => bind_position(query, std::slice::from_ref(slot), position)?,
            SlotValue::Integer(number) => query.bind(*number),
        };
    }
    Ok(query)
}

/// The columns of a recount's row: the bucket, the count, `Σu`, `Σv` and the three moments.
pub(crate) const TALLY_COLUMNS: usize = 7;

/// The recount's rows as one tally per bucket (a bucket without a row has none).
pub(crate) fn tallies(buckets: usize, rows: &[[i64; TALLY_COLUMNS]]) -> Result<Vec<Tally>, SourceError> {
    let mut tallies = vec![Tally::default(); buckets];
    for [bucket, count, sum_u, sum_v, v2, v3, v4] in rows {
        let tally = usize::try_from(*bucket)
            .ok()
            .and_then(|index| tallies.get_mut(index))
            .ok_or_else(|| SourceError::Position(format!("the recount returned bucket {bucket} of {buckets}")))?;
        let number = |value: &i64| (*value).max(0) as u64;
        *tally = Tally {
            rows: number(count),
            sum_u: number(sum_u),
            sum_v: number(sum_v),
            moments: Some([number(v2), number(v3), number(v4)]),
        };
    }
    Ok(tallies)
}

/// Runs a recount (PostgreSQL, MySQL).
pub(crate) async fn tally_buckets<DB>(
    pool: &sqlx::Pool<DB>,
    config: &SourceConfig,
    plan: &SeekPlan,
    check: &BucketCheck,
    redaction: &Redaction,
) -> Result<Vec<Tally>, SourceError>
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
    super::position::check_key(config, &check.checkpoint)?;
    let late = tally_sql_for(config, plan, check);
    let values = check_values(&late.slots, check)?;
    let query = bind_values(sqlx::query(sqlx::AssertSqlSafe(late.sql)), &values)?;
    let rows = query.fetch_all(pool).await.map_err(|error| classify(redaction, error))?;
    let mut numbers = Vec::with_capacity(rows.len());
    for row in &rows {
        let get = |index: usize| -> Result<i64, SourceError> {
            sqlx::Row::try_get_unchecked::<Option<i64>, usize>(row, index)
                .map(Option::unwrap_or_default)
                .map_err(|error| SourceError::Query { location: redaction.location.clone(), reason: error.to_string() })
        };
        let mut columns = [0i64; TALLY_COLUMNS];
        for (index, column) in columns.iter_mut().enumerate() {
            *column = get(index)?;
        }
        numbers.push(columns);
    }
    tallies(check.ranges.len(), &numbers)
}

/// Runs a re-read (PostgreSQL, MySQL): up to `limit` rows of the bucket after `after`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn read_bucket<DB, D>(
    pool: &sqlx::Pool<DB>,
    config: &SourceConfig,
    plan: &SeekPlan,
    range: &BucketRange,
    after: Option<&Position>,
    limit: FetchLimit,
    redaction: &Redaction,
    decoder: &D,
) -> Result<Fetched, SourceError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    DateTime<Utc>: for<'t> Encode<'t, DB> + Type<DB>,
    NaiveDateTime: for<'t> Encode<'t, DB> + Type<DB>,
    D: ColumnDecoder<DB::Row> + Sync,
{
    super::position::check_key(config, &range.checkpoint)?;
    let late = bucket_sql_for(config, plan, range, after.is_some());
    let until = match &range.until {
        BucketEnd::Before(cursor) => Some(cursor),
        BucketEnd::Checkpoint => None,
    };
    let bounds = [range.from.clone()];
    let values = slot_values(&late.slots, &bounds, until, &range.checkpoint, after, range.only, limit.rows as i64)?;
    let query = bind_values(sqlx::query(sqlx::AssertSqlSafe(late.sql)), &values)?;
    let mut connection = pool.acquire().await.map_err(|error| classify(redaction, error))?;
    let mut stream = sqlx::Executor::fetch(&mut *connection, query);
    let mut collector: Option<Collector<'_>> = None;
    while let Some(row) = stream.try_next().await.map_err(|error| classify(redaction, error))? {
        if collector.is_none() {
            let names = sqlx::Row::columns(&row).iter().map(sqlx::Column::name);
            let layout = Layout::new(config, names)
                .map_err(|reason| SourceError::Query { location: redaction.location.clone(), reason })?;
            collector = Some(Collector::new(config, layout, limit));
        }
        let collected = collector.as_mut().expect("made at the first row");
        let at_limit = collected
            .add(|index, name| decoder.decode_column(&row, index, name), |index| decoder.column_type(&row, index))?;
        if at_limit {
            drop(stream);
            return Ok(collector.take().expect("made at the first row").finish(true));
        }
    }
    Ok(collector.map(|collected| collected.finish(false)).unwrap_or_default())
}

/// Registers [`SQLITE_KEY_HASH_FUNCTION`] on a SQLite connection: the version hash of its
/// arguments (the cursor, an integer or a timestamp's text, then the key's columns, integers or
/// text), as `u << 31 | v`; NULL for a value that cannot be a cursor or a key.
pub(crate) fn register_sqlite_key_hash(connection: &rusqlite::Connection) -> rusqlite::Result<()> {
    use rusqlite::functions::FunctionFlags;
    use rusqlite::types::ValueRef;
    let flags = FunctionFlags::SQLITE_UTF8 | FunctionFlags::SQLITE_DETERMINISTIC;
    connection.create_scalar_function(SQLITE_KEY_HASH_FUNCTION, -1, flags, |context| {
        let pack = |hash: KeyHash| Some((i64::from(hash.u) << 31) | i64::from(hash.v));
        if context.len() < 2 {
            return Ok(None);
        }
        let cursor = match context.get_raw(0) {
            ValueRef::Integer(number) => CursorValue::Integer(number),
            ValueRef::Text(bytes) => {
                match std::str::from_utf8(bytes).ok().and_then(super::sqlite_time::parse_sqlite_timestamp) {
                    Some(at) => CursorValue::Timestamp { at, source_text: None },
                    None => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        let mut values = Vec::with_capacity(context.len() - 1);
        for index in 1..context.len() {
            match context.get_raw(index) {
                ValueRef::Integer(number) => values.push(PkValue::Integer(number)),
                ValueRef::Text(bytes) => match std::str::from_utf8(bytes) {
                    Ok(text) => values.push(PkValue::Text(text.to_string())),
                    Err(_) => return Ok(None),
                },
                _ => return Ok(None),
            }
        }
        let keys: Vec<&PkValue> = values.iter().collect();
        Ok(pack(crate::domain::late::version_hash(crate::domain::late::key_hash(&keys), &cursor)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::query::tests::config;

    fn plan() -> SeekPlan {
        SeekPlan { cursor_type: CursorType::Timestamp, placeholder_types: None }
    }

    fn typed_plan() -> SeekPlan {
        SeekPlan {
            cursor_type: CursorType::Timestamp,
            placeholder_types: Some(vec!["TIMESTAMPTZ".into(), "INT4".into(), "INT8".into()]),
        }
    }

    #[test]
    fn postgres_recounts_each_bucket_over_its_own_range_with_a_digest_for_a_composite_key() {
        let late = tally_sql(
            &config(Engine::Postgres, None, Some("tenant = 7")),
            &typed_plan(),
            &[false, true],
            KeyHashKind::Digest,
        );
        let x = "encode(sha256(convert_to(concat_ws(chr(31), rtrim(\"tenant\"::text, ' '), rtrim(\"id\"::text, ' ')), 'UTF8')), 'hex') \
                 AS dbtrigger_x, ((((extract(epoch from \"updated_at\") * 1000000)::bigint % 2147483647) + 2147483647) % 2147483647)";
        let word = |start: usize| format!("(('x' || substr(dbtrigger_x, {start}, 8))::bit(32)::bigint >> 1)");
        let u = format!("(({} + (dbtrigger_w) * 1103515245 % 2147483647) % 2147483647)", word(1));
        let v = format!("(({} + {u} * {u} % 2147483647) % 2147483647)", word(9));
        let square = "(dbtrigger_v::bigint * dbtrigger_v::bigint % 2147483647)";
        let sums = format!(
            "sum(dbtrigger_u), sum(dbtrigger_v), sum(({square})::int), \
             sum((({square} * dbtrigger_v::bigint % 2147483647))::int), sum((({square} * {square} % 2147483647))::int)"
        );
        let versions = format!("SELECT ({u})::int AS dbtrigger_u, ({v})::int AS dbtrigger_v");
        assert_eq!(
            late.sql,
            format!(
                "SELECT 0::bigint, count(*), {sums} FROM ({versions} FROM (SELECT {x} AS dbtrigger_w FROM \"public\".\"orders\" \
                 WHERE \"updated_at\" >= (SELECT $1::TIMESTAMPTZ) AND \"updated_at\" < (SELECT $2::TIMESTAMPTZ) AND (tenant = 7)) AS dbtrigger_keys0 OFFSET 0) AS dbtrigger_versions0 \
                 UNION ALL SELECT 1::bigint, count(*), {sums} FROM ({versions} FROM (SELECT {x} AS dbtrigger_w FROM \"public\".\"orders\" \
                 WHERE \"updated_at\" >= (SELECT $3::TIMESTAMPTZ) AND \"updated_at\" <= (SELECT $4::TIMESTAMPTZ) \
                 AND (\"updated_at\", \"tenant\", \"id\") <= ((SELECT $5::TIMESTAMPTZ), (SELECT $6::INT4), (SELECT $7::INT8)) AND (tenant = 7)) AS dbtrigger_keys1 OFFSET 0) AS dbtrigger_versions1"
            )
        );
        assert_eq!(
            late.slots,
            vec![
                LateSlot::Bound(0),
                LateSlot::End(0),
                LateSlot::Bound(1),
                LateSlot::Checkpoint(Slot::Cursor),
                LateSlot::Checkpoint(Slot::Cursor),
                LateSlot::Checkpoint(Slot::Key(0)),
                LateSlot::Checkpoint(Slot::Key(1))
            ]
        );
    }

    #[test]
    fn mysql_and_sqlite_recount_with_integer_arithmetic_or_the_registered_function() {
        let mut source = config(Engine::MySql, None, None);
        source.pk = vec!["id".into()];
        let late = tally_sql(&source, &plan(), &[false, true], KeyHashKind::Integer);
        assert!(late.sql.starts_with("SELECT CAST(0 AS SIGNED), CAST(COUNT(*) AS SIGNED)"), "{}", late.sql);
        assert!(
            late.sql.contains(
                "MOD(MOD(`id`, 2147483647) + 2147483647, 2147483647) AS dbtrigger_x, \
                 MOD(MOD(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', `updated_at`), 2147483647) + 2147483647, 2147483647) AS dbtrigger_w"
            ),
            "{}",
            late.sql
        );
        assert!(
            late.sql.contains(
                "`updated_at` >= ? AND `updated_at` < ?) AS dbtrigger_keys0) AS dbtrigger_versions0 UNION ALL"
            ),
            "{}",
            late.sql
        );
        assert!(
            late.sql.contains("`updated_at` <= ? AND (`updated_at` < ? OR (`updated_at` = ? AND `id` <= ?))"),
            "{}",
            late.sql
        );
        assert_eq!(&late.slots[..3], &[LateSlot::Bound(0), LateSlot::End(0), LateSlot::Bound(1)]);
        source.engine = Engine::Sqlite;
        let sqlite = tally_sql(&source, &plan(), &[true], KeyHashKind::Integer);
        assert!(late.sql.contains("CAST(SUM(dbtrigger_u) AS SIGNED), CAST(SUM(dbtrigger_v) AS SIGNED), CAST(SUM((dbtrigger_v * dbtrigger_v % 2147483647)) AS SIGNED)"), "{}", late.sql);
        assert!(sqlite.sql.starts_with("SELECT 0, count(*), sum(dbtrigger_u), sum(dbtrigger_v), sum((dbtrigger_v * dbtrigger_v % 2147483647)), \
            sum(((dbtrigger_v * dbtrigger_v % 2147483647) * dbtrigger_v % 2147483647)), sum(((dbtrigger_v * dbtrigger_v % 2147483647) * (dbtrigger_v * dbtrigger_v % 2147483647) % 2147483647)) \
            FROM (SELECT (dbtrigger_x >> 31) AS dbtrigger_u, (dbtrigger_x & 2147483647) AS dbtrigger_v \
            FROM (SELECT dbtrigger_key_hash(\"updated_at\", \"id\") AS dbtrigger_x, 0 AS dbtrigger_w FROM"), "{}", sqlite.sql);
        assert!(
            sqlite.sql.ends_with(") AS dbtrigger_keys0 LIMIT -1 OFFSET 0) AS dbtrigger_versions0"),
            "{}",
            sqlite.sql
        );
    }

    #[test]
    fn a_bucket_is_reread_after_a_position_up_to_the_next_bucket_or_the_checkpoint() {
        let source = config(Engine::Postgres, Some(vec!["status"]), None);
        let late = bucket_sql(&source, &typed_plan(), false, true, None);
        assert_eq!(
            late.sql,
            "SELECT \"status\", \"updated_at\", \"tenant\", \"id\" FROM \"public\".\"orders\" WHERE \"updated_at\" >= $1::TIMESTAMPTZ AND \"updated_at\" < $2::TIMESTAMPTZ \
             AND (\"updated_at\", \"tenant\", \"id\") > ($3::TIMESTAMPTZ, $4::INT4, $5::INT8) ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT $6"
        );
        let mut mysql = config(Engine::MySql, None, None);
        mysql.pk = vec!["id".into()];
        let only = bucket_sql(&mysql, &plan(), true, false, Some(KeyHashKind::Integer));
        let w = "MOD(MOD(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', `updated_at`), 2147483647) + 2147483647, 2147483647)";
        let u = format!(
            "(((MOD(MOD(`id`, 2147483647) + 2147483647, 2147483647)) + ({w}) * 1103515245 % 2147483647) % 2147483647)"
        );
        assert!(only.sql.contains(&format!("{u} = ?")), "{}", only.sql);
        assert_eq!(
            only.slots,
            vec![
                LateSlot::Bound(0),
                LateSlot::Checkpoint(Slot::Cursor),
                LateSlot::Checkpoint(Slot::Cursor),
                LateSlot::Checkpoint(Slot::Cursor),
                LateSlot::Checkpoint(Slot::Key(0)),
                LateSlot::HashU,
                LateSlot::HashV,
                LateSlot::Limit
            ]
        );
    }

    #[test]
    fn a_recount_row_of_a_bucket_out_of_range_is_an_error_not_a_panic() {
        assert_eq!(
            tallies(2, &[[1, 3, 30, 300, 1, 2, 3]]).unwrap()[1],
            Tally { rows: 3, sum_u: 30, sum_v: 300, moments: Some([1, 2, 3]) }
        );
        assert!(tallies(2, &[[2, 1, 1, 1, 0, 0, 0]]).is_err());
        assert!(tallies(2, &[[-1, 1, 1, 1, 0, 0, 0]]).is_err());
    }
}
