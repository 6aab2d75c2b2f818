//! A row put together from its decoded columns: what each column is to the poller (cursor, key,
//! the delete rule's column), its value as JSON, and the checks that name the column and the row.

use chrono::{DateTime, NaiveDateTime, Utc};
use serde_json::Value;

use super::SourceError;
use crate::config::{OpRule, OversizedRows, SourceConfig};
use crate::domain::event::{Op, RowJson, SourceRow};
use crate::domain::{CursorValue, PkValue, Position};

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

    fn write(&self, out: &mut impl std::io::Write) {
        match self {
            Json::Text(text) => serde_json::to_writer(out, text),
            Json::Value(value) => serde_json::to_writer(out, value),
        }
        .expect("writing to memory cannot fail")
    }

    /// The fewest bytes the value takes as JSON, known without writing it: a text's length and
    /// its quotes (escapes only add), else nothing.
    fn least_len(&self) -> usize {
        match self {
            Json::Text(text) => text.len() + 2,
            Json::Value(Value::String(text)) => text.len() + 2,
            Json::Value(_) => 0,
        }
    }

    /// The bytes the value takes as JSON, counted without keeping them.
    fn counted_len(&self) -> usize {
        let mut counter = ByteCounter(0);
        self.write(&mut counter);
        counter.0
    }

    fn to_value(&self) -> Value {
        match self {
            Json::Text(text) => Value::from(*text),
            Json::Value(value) => value.clone(),
        }
    }

    pub(super) fn into_value(self) -> Value {
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

/// The columns of a query's rows, learnt from its first row (every row of a result has the same):
/// what each one is to the poller, and its key as the row's JSON writes it.
pub(crate) struct Layout {
    pub(super) columns: Vec<LayoutColumn>,
}

pub(super) struct LayoutColumn {
    pub(super) name: String,
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
            if name == crate::domain::event::OVERSIZED_ROW_KEY {
                return Err(format!(
                    "the result has a column named {name:?}, the key dbtrigger keeps for a row too large to keep: rename it (AS)"
                ));
            }
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

/// Counts what is written to it, keeping nothing.
struct ByteCounter(usize);

impl std::io::Write for ByteCounter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0 += bytes.len();
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Puts a row together from its decoded columns, writing its JSON as they come: checks that the
/// cursor and every key are there and usable, with errors that name the column and the row.
///
/// A row larger than `source.maxRowBytes` is never kept: once its JSON would pass the bound, what
/// was written is dropped and the rest only counted (a text's length is known before it is
/// written, so an oversized text is never copied), and the row fails, named by its key, with its
/// size ([`SourceError::RowTooLarge`]).
pub(crate) struct RowBuilder<'a> {
    config: &'a SourceConfig,
    layout: &'a Layout,
    json: Vec<u8>,
    /// The row passed `source.maxRowBytes`: its JSON is no longer kept, only its size counted.
    oversized: Option<usize>,
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
        RowBuilder {
            config,
            layout,
            json,
            oversized: None,
            cursor: None,
            keys: vec![None; config.pk.len()],
            op: None,
            error: None,
        }
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
        self.write_value(&column.key, &decoded.json);
        if column.op {
            self.op = Some(op_of(&self.config.ops, Some(&decoded.json.into_value())));
        }
    }

    /// Appends `"name":value` to the row's JSON while it stays within `source.maxRowBytes`;
    /// past it, only counts it.
    fn write_value(&mut self, key: &[u8], json: &Json<'_>) {
        let bound = self.config.max_row_bytes.saturating_sub(ROW_OVERHEAD_BYTES);
        if let Some(counted) = self.oversized.as_mut() {
            *counted += key.len() + json.counted_len();
            return;
        }
        if self.json.len() + key.len() + json.least_len() > bound {
            self.oversized = Some(self.json.len() + key.len() + json.counted_len());
            self.json = Vec::new();
            return;
        }
        self.json.extend_from_slice(key);
        json.write(&mut self.json);
        if self.json.len() > bound {
            self.oversized = Some(self.json.len());
            self.json = Vec::new();
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
        let oversized = self.oversized.map(|counted| (counted + 2 + ROW_OVERHEAD_BYTES, self.config.max_row_bytes));
        if let Some((bytes, limit)) = oversized
            && self.config.oversized_rows == OversizedRows::Stop
        {
            let error = SourceError::RowTooLarge { bytes, limit };
            return Err(SourceError::InRow { row: self.describe_key(), error: Box::new(error) });
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
        let row = match oversized {
            // Kept aside as a reference: its key and cursor (the position) and its size only.
            Some((bytes, limit)) => RowJson::oversized_reference(bytes, limit),
            None => {
                self.json.push(b'}');
                RowJson::from_encoded(self.json)
            }
        };
        let size = row.len() + ROW_OVERHEAD_BYTES;
        Ok((SourceRow { position: Position { cursor, pk }, row, op, group: None }, size))
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
