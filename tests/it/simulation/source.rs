//! The scripted source: a table in memory with integer cursors and integer keys, read with the
//! semantics the SQL sources have (`Probe::Deliver` / `Pending` / `Last`, `count_after`,
//! `generation`), and a fault script consumed one entry per read.
//!
//! Every row carries its load (`gen`) in its columns, so that what a receiver acknowledged can be
//! told apart from a row of another load with the same key and cursor.
//!
//! Commit order (issue 35): besides rows written at once, a transaction can be opened
//! ([`Table::begin`]): it reserves its cursor values there (the next integers, as a sequence or a
//! `BEFORE` trigger stamping the row would), for new rows and for updates of committed rows (a new
//! cursor value, the key locked until it ends), and makes them visible only when it commits
//! ([`Table::commit`]), in any order. An open transaction the horizon sees (`seen`: a local
//! session `settle: "auto"` reads) bounds what a delivering read returns below its first reserved
//! cursor; one it cannot see (a replica's, a prepared one) does not, so its rows may commit behind
//! the checkpoint: late. The source notes, per poller, how far its delivering reads went
//! ([`SourceShared::read_past`]): a version committed behind that point may be late; any other
//! version the checkpoint passes undelivered is lost.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use dbtrigger::domain::event::Op;
use dbtrigger::domain::late::{BucketEnd, KeyHash, Tally, key_hash, version_hash};
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

/// At most this many transactions are open at once (a `Begin` beyond it opens nothing).
pub const MAX_OPEN: usize = 4;

/// An open transaction: the versions it writes, (key, reserved cursor), visible at its commit.
#[derive(Debug, Clone)]
pub struct Open {
    /// The horizon sees it: delivering reads stop below its first reserved cursor.
    pub seen: bool,
    pub writes: Vec<(i64, i64)>,
}

/// The table: one load (`generation`) of rows, key to cursor.
pub struct Table {
    pub generation: u64,
    pub rows: BTreeMap<i64, i64>,
    /// Open transactions, oldest first.
    pub open: Vec<Open>,
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

    /// The first cursor an open transaction the horizon sees has reserved: delivering reads stop
    /// below it.
    pub fn horizon(&self) -> Option<i64> {
        self.open.iter().filter(|open| open.seen).flat_map(|open| open.writes.iter().map(|(_, cursor)| *cursor)).min()
    }

    fn locked(&self, key: i64) -> bool {
        self.open.iter().any(|open| open.writes.iter().any(|(written, _)| *written == key))
    }

    /// Opens a transaction that inserts `inserts` rows and updates the `update`-th committed row
    /// not locked by another (modulo their count), reserving their cursors now. `false`: nothing
    /// opened ([`MAX_OPEN`] are open, or it would write nothing).
    pub fn begin(&mut self, inserts: usize, update: Option<usize>, seen: bool) -> bool {
        if self.open.len() >= MAX_OPEN {
            return false;
        }
        let mut writes = Vec::new();
        if let Some(nth) = update {
            let free: Vec<i64> = self.rows.keys().copied().filter(|key| !self.locked(*key)).collect();
            if !free.is_empty() {
                writes.push((free[nth % free.len()], self.next_cursor));
                self.next_cursor += 1;
            }
        }
        for _ in 0..inserts {
            writes.push((self.next_key, self.next_cursor));
            self.next_key += 1;
            self.next_cursor += 1;
        }
        if writes.is_empty() {
            return false;
        }
        self.open.push(Open { seen, writes });
        true
    }

    /// Commits the `nth` open transaction (modulo their count): its versions become visible.
    /// Returns them (none when nothing is open), each with the version it replaced, if any.
    pub fn commit(&mut self, nth: usize) -> Vec<(RowId, Option<RowId>)> {
        if self.open.is_empty() {
            return Vec::new();
        }
        let open = self.open.remove(nth % self.open.len());
        let generation = self.generation;
        open.writes
            .into_iter()
            .map(|(key, cursor)| {
                let before = self.rows.insert(key, cursor).map(|cursor| RowId { generation, key, cursor });
                (RowId { generation, key, cursor }, before)
            })
            .collect()
    }

    /// Rows strictly after `after` (cursor, key) and below the horizon, in order: what a
    /// delivering read sees.
    fn settled_after(&self, after: Option<(i64, i64)>) -> Vec<RowId> {
        let horizon = self.horizon();
        let mut rows = self.after(after);
        rows.retain(|row| horizon.is_none_or(|horizon| row.cursor < horizon));
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
    /// column does (none when that row is locked by an open transaction).
    /// Returns the version before and after.
    pub fn update(&mut self, nth: usize) -> Option<(RowId, RowId)> {
        let key = *self.rows.keys().nth(nth % self.rows.len().max(1))?;
        if self.locked(key) {
            return None;
        }
        let generation = self.generation;
        let before = self.rows.insert(key, self.next_cursor)?;
        let after = RowId { generation, key, cursor: self.next_cursor };
        self.next_cursor += 1;
        Some((RowId { generation, key, cursor: before }, after))
    }

    /// A truncate and reload: a new generation, `count` fresh rows, keys and cursors from 1 again.
    pub fn reload(&mut self, count: usize) {
        self.generation += 1;
        self.rows.clear();
        // The reload's truncate waits for nobody: the open transactions are rolled back.
        self.open.clear();
        self.next_cursor = 1;
        self.next_key = 1;
        self.insert(count);
    }
}

/// A row version's hash, as the SQL sources compute it (the key's, mixed with the cursor).
fn version(row: &RowId) -> KeyHash {
    version_hash(key_hash(&[&PkValue::Integer(row.key)]), &CursorValue::Integer(row.cursor))
}

pub struct SourceShared {
    pub table: Mutex<Table>,
    pub faults: Mutex<VecDeque<ReadFault>>,
    /// Per poller: the furthest row (load, cursor, key) one of its delivering reads returned. A
    /// version committed at or before it may have been passed unseen: it may arrive late.
    pub read_past: Mutex<BTreeMap<String, (u64, i64, i64)>>,
}

impl SourceShared {
    pub fn new() -> Arc<SourceShared> {
        let table = Table { generation: 1, rows: BTreeMap::new(), open: Vec::new(), next_cursor: 1, next_key: 1 };
        Arc::new(SourceShared {
            table: Mutex::new(table),
            faults: Mutex::new(VecDeque::new()),
            read_past: Mutex::new(BTreeMap::new()),
        })
    }

    /// Whether a delivering read of `poller` went past `row` (same load).
    pub fn read_past(&self, poller: &str, row: &RowId) -> bool {
        self.read_past.lock().unwrap().get(poller).is_some_and(|(generation, cursor, key)| {
            *generation == row.generation && (row.cursor, row.key) <= (*cursor, *key)
        })
    }
}

/// One view of the table: the ticks' (`faulty`: reads take the fault script) or the observer's
/// (`status`, the invariants), which never disturbs the script.
pub struct ScriptedSource {
    pub shared: Arc<SourceShared>,
    pub faulty: bool,
    /// The poller reading (its delivering reads are noted in [`SourceShared::read_past`]).
    pub reader: String,
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
        let after = match after {
            Some(after) => Some(cursor_and_key(after).ok_or_else(|| bad_position(after))?),
            None => None,
        };
        let rows = match probe {
            // Delivering reads stop below the horizon (an open transaction it sees); Pending sees
            // every committed row.
            Probe::Deliver => table.settled_after(after),
            Probe::Pending => table.after(after),
            Probe::Last => table.settled_after(None).into_iter().rev().collect(),
        };
        let full = rows.len() >= limit.rows;
        let rows: Vec<RowId> = rows.into_iter().take(limit.rows).collect();
        if probe == Probe::Deliver
            && self.faulty
            && let Some(last) = rows.last()
        {
            let mut read_past = self.shared.read_past.lock().unwrap();
            let furthest = read_past.entry(self.reader.clone()).or_insert((last.generation, last.cursor, last.key));
            if furthest.0 != last.generation || (furthest.1, furthest.2) < (last.cursor, last.key) {
                *furthest = (last.generation, last.cursor, last.key);
            }
        }
        let rows: Vec<SourceRow> = rows.iter().map(source_row).collect();
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
                tallies[bucket].add(version(&row));
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
            .filter(|row| range.only.is_none_or(|only| version(row) == only))
            .collect();
        let full = rows.len() >= limit.rows;
        let rows: Vec<SourceRow> = rows.iter().take(limit.rows).map(source_row).collect();
        Ok(Fetched { rows, full })
    }
}
