//! The scripted source: a table in memory with integer cursors and integer keys, read with the
//! semantics the SQL sources have (`Probe::Deliver` / `Pending` / `Last`, `count_after`,
//! `generation`), and a fault script consumed one entry per read.
//!
//! Every row carries its load (`gen`) in its columns, so that what a receiver acknowledged can be
//! told apart from a row of another load with the same key and cursor.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use dbtrigger::domain::event::Op;
use dbtrigger::domain::late::{BucketEnd, Tally, key_hash};
use dbtrigger::domain::{CursorValue, PkValue, Position};
use dbtrigger::source::{BucketCheck, BucketRange, FetchLimit, Fetched, Probe, Source, SourceError, SourceRow};
use serde_json::{Value, json};

use super::RowId;

/// What the next read does before (or instead of) answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFault {
    /// The query takes this long (the rows are those there when it ends).
    Delay { ms: u64 },
    /// The database answers an error.
    Error,
    /// The driver panics (a value nobody foresaw).
    Panic,
}

/// The table: one load (`generation`) of rows, key to cursor.
pub struct Table {
    pub generation: u64,
    pub rows: BTreeMap<i64, i64>,
    next_cursor: i64,
    next_key: i64,
}

impl Table {
    /// The current rows in the poller's order, (cursor, key).
    pub fn ordered(&self) -> Vec<RowId> {
        let mut rows: Vec<RowId> = self
            .rows
            .iter()
            .map(|(key, cursor)| RowId { generation: self.generation, key: *key, cursor: *cursor })
            .collect();
        rows.sort_by_key(|row| (row.cursor, row.key));
        rows
    }

    /// Rows strictly after `after` (cursor, key), in order.
    fn after(&self, after: Option<(i64, i64)>) -> Vec<RowId> {
        let mut rows = self.ordered();
        if let Some(after) = after {
            rows.retain(|row| (row.cursor, row.key) > after);
        }
        rows
    }

    /// Inserts `count` rows with increasing cursors; returns their keys.
    pub fn insert(&mut self, count: usize) -> Vec<i64> {
        let mut keys = Vec::new();
        for _ in 0..count {
            let key = self.next_key;
            self.next_key += 1;
            self.rows.insert(key, self.next_cursor);
            self.next_cursor += 1;
            keys.push(key);
        }
        keys
    }

    /// Moves the `nth` row (modulo the row count) to a new cursor, as an update bumping a version
    /// column does.
    pub fn update(&mut self, nth: usize) -> Option<i64> {
        let key = *self.rows.keys().nth(nth % self.rows.len().max(1))?;
        self.rows.insert(key, self.next_cursor);
        self.next_cursor += 1;
        Some(key)
    }

    /// A truncate and reload: a new generation, `count` fresh rows, keys and cursors from 1 again.
    pub fn reload(&mut self, count: usize) {
        self.generation += 1;
        self.rows.clear();
        self.next_cursor = 1;
        self.next_key = 1;
        self.insert(count);
    }
}

pub struct SourceShared {
    pub table: Mutex<Table>,
    pub faults: Mutex<VecDeque<ReadFault>>,
}

impl SourceShared {
    pub fn new() -> Arc<SourceShared> {
        let table = Table { generation: 1, rows: BTreeMap::new(), next_cursor: 1, next_key: 1 };
        Arc::new(SourceShared { table: Mutex::new(table), faults: Mutex::new(VecDeque::new()) })
    }
}

/// One view of the table: the ticks' (`faulty`: reads take the fault script) or the observer's
/// (`status`, the invariants), which never disturbs the script.
pub struct ScriptedSource {
    pub shared: Arc<SourceShared>,
    pub faulty: bool,
}

impl ScriptedSource {
    async fn fault(&self) -> Result<(), SourceError> {
        if !self.faulty {
            return Ok(());
        }
        let next = self.shared.faults.lock().unwrap().pop_front();
        match next {
            None => Ok(()),
            Some(ReadFault::Delay { ms }) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(())
            }
            Some(ReadFault::Error) => {
                Err(SourceError::Unreachable { location: "sim".to_string(), reason: "scripted read error".to_string() })
            }
            Some(ReadFault::Panic) => panic!("scripted panic in a source read"),
        }
    }
}

fn position(row: &RowId) -> Position {
    Position { cursor: CursorValue::Integer(row.cursor), pk: vec![("id".to_string(), PkValue::Integer(row.key))] }
}

/// (cursor, key) of a position this source made.
pub fn cursor_and_key(position: &Position) -> Option<(i64, i64)> {
    let CursorValue::Integer(cursor) = position.cursor else {
        return None;
    };
    match position.pk.first() {
        Some((_, PkValue::Integer(key))) => Some((cursor, *key)),
        _ => None,
    }
}

fn source_row(row: &RowId) -> SourceRow {
    let columns = json!({"id": row.key, "version": row.cursor, "gen": row.generation});
    SourceRow {
        position: position(row),
        row: dbtrigger::source::RowJson::from_map(columns.as_object().expect("an object")),
        op: Op::Upsert,
        group: None,
    }
}

fn bad_position(after: &Position) -> SourceError {
    SourceError::Position(format!("not a position of the simulated table: {after:?}"))
}

#[async_trait]
impl Source for ScriptedSource {
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        if probe == Probe::Deliver {
            self.fault().await?;
        }
        let table = self.shared.table.lock().unwrap();
        let rows = match probe {
            // Every integer cursor is settled: Deliver and Pending see the same rows.
            Probe::Deliver | Probe::Pending => {
                let after = match after {
                    Some(after) => Some(cursor_and_key(after).ok_or_else(|| bad_position(after))?),
                    None => None,
                };
                table.after(after)
            }
            Probe::Last => table.ordered().into_iter().rev().collect(),
        };
        let full = rows.len() >= limit.rows;
        let rows: Vec<SourceRow> = rows.iter().take(limit.rows).map(source_row).collect();
        Ok(Fetched { rows, full })
    }

    async fn count_after(&self, after: Option<&Position>, cap: u64) -> Result<u64, SourceError> {
        let after = match after {
            Some(after) => Some(cursor_and_key(after).ok_or_else(|| bad_position(after))?),
            None => None,
        };
        let count = self.shared.table.lock().unwrap().after(after).len() as u64;
        Ok(count.min(cap))
    }

    async fn generation(&self) -> Result<Option<Value>, SourceError> {
        self.fault().await?;
        Ok(Some(Value::from(self.shared.table.lock().unwrap().generation)))
    }

    fn describe(&self) -> String {
        "sim:orders".to_string()
    }

    /// The late-arrival recount, as the SQL sources compute it: per bucket asked for (from its
    /// first cursor to the next bucket's, or to the checkpoint), the rows at or before the
    /// checkpoint, with the sums of their key hashes. It takes the fault script like a delivering
    /// read: a recount can fail or be slow.
    async fn tally_buckets(&self, check: &BucketCheck) -> Result<Option<Vec<Tally>>, SourceError> {
        self.fault().await?;
        let checkpoint = cursor_and_key(&check.checkpoint).ok_or_else(|| bad_position(&check.checkpoint))?;
        let integer = |cursor: &CursorValue| match cursor {
            CursorValue::Integer(cursor) => Ok(*cursor),
            other => Err(SourceError::Position(format!("not a cursor of the simulated table: {other:?}"))),
        };
        let mut ranges = Vec::with_capacity(check.ranges.len());
        for (from, until) in &check.ranges {
            let until = match until {
                BucketEnd::Before(cursor) => Some(integer(cursor)?),
                BucketEnd::Checkpoint => None,
            };
            ranges.push((integer(from)?, until));
        }
        let mut tallies = vec![Tally::default(); ranges.len()];
        for row in self.shared.table.lock().unwrap().ordered() {
            if (row.cursor, row.key) > checkpoint {
                continue;
            }
            let bucket = ranges
                .iter()
                .position(|(from, until)| row.cursor >= *from && until.is_none_or(|until| row.cursor < until));
            if let Some(bucket) = bucket {
                tallies[bucket].add(key_hash(&[&PkValue::Integer(row.key)]));
            }
        }
        Ok(Some(tallies))
    }

    /// The re-read of one bucket (or of one key hash in it), after `after`, in order.
    async fn read_bucket(
        &self,
        range: &BucketRange,
        after: Option<&Position>,
        limit: FetchLimit,
    ) -> Result<Fetched, SourceError> {
        self.fault().await?;
        let integer = |cursor: &CursorValue| match cursor {
            CursorValue::Integer(cursor) => Ok(*cursor),
            other => Err(SourceError::Position(format!("not a cursor of the simulated table: {other:?}"))),
        };
        let from = integer(&range.from)?;
        let until = match &range.until {
            BucketEnd::Before(cursor) => Some(integer(cursor)?),
            BucketEnd::Checkpoint => None,
        };
        let checkpoint = cursor_and_key(&range.checkpoint).ok_or_else(|| bad_position(&range.checkpoint))?;
        let after = match after {
            Some(after) => Some(cursor_and_key(after).ok_or_else(|| bad_position(after))?),
            None => None,
        };
        let rows: Vec<RowId> = self
            .shared
            .table
            .lock()
            .unwrap()
            .ordered()
            .into_iter()
            .filter(|row| row.cursor >= from && (row.cursor, row.key) <= checkpoint)
            .filter(|row| until.is_none_or(|until| row.cursor < until))
            .filter(|row| after.is_none_or(|after| (row.cursor, row.key) > after))
            .filter(|row| range.only.is_none_or(|only| key_hash(&[&PkValue::Integer(row.key)]) == only))
            .collect();
        let full = rows.len() >= limit.rows;
        let rows: Vec<SourceRow> = rows.iter().take(limit.rows).map(source_row).collect();
        Ok(Fetched { rows, full })
    }
}
