//! From binary log events to changes: where each event is (the file a Rotate names, the offset
//! its header ends at), where each transaction starts (its GTID event, or its `BEGIN`), its row
//! events of the configured tables, one change per row numbered from 1 within the transaction,
//! and where it ends (an `XID`, a `COMMIT`, or the statement after a GTID with no `BEGIN`: DDL).
//! Table maps are the stream's own (read before each row event), so an `ALTER TABLE` is followed.
//! Each change names its table's primary key (from the table map, else `information_schema`) and
//! the columns its images lack (`binlog_row_image=MINIMAL` or `NOBLOB`); [`order_group`] makes its
//! key for per-key order. No I/O: events in, changes out.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use mysql_async::binlog::events::{Event, EventData, OptionalMetaExtractor, RowsEventData, TableMapEvent};
use serde_json::{Map, Value};

use super::values::{TableInfo, row_json};
use crate::domain::Op;
use crate::domain::binlog::{self, BinlogPos, FileNames, Gtid, GtidMark, GtidPos};
use crate::domain::binlog_query::{self, Query};
use crate::domain::keyed::Group;

/// MariaDB's GTID event (`GTID_EVENT`, 162): mysql_common does not know MariaDB's event types.
const MARIADB_GTID_EVENT: u8 = 162;
/// MariaDB's compressed query and rows events (165 to 171).
const MARIADB_COMPRESSED_EVENTS: std::ops::RangeInclusive<u8> = 165..=171;
/// MariaDB's GTID list (163) and binlog checkpoint (161) events, and the format description (15):
/// what a dump sends before the first transaction.
const MARIADB_GTID_LIST_EVENT: u8 = 163;
const MARIADB_BINLOG_CHECKPOINT_EVENT: u8 = 161;
const FORMAT_DESCRIPTION_EVENT: u8 = 15;
const ROTATE_EVENT: u8 = 4;
/// A MariaDB GTID's flag: the transaction is one statement, without `BEGIN`/`COMMIT`.
const MARIADB_FL_STANDALONE: u8 = 1;
/// An event the server made for the reader (a Rotate or a format description at the start of a
/// dump): it is not in the file, and its header's position means nothing.
const LOG_EVENT_ARTIFICIAL: u16 = 0x20;

/// One change of a transaction read.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub op: Op,
    /// `database.table`.
    pub table: String,
    pub new: Option<Map<String, Value>>,
    pub old: Option<Map<String, Value>>,
    /// Its transaction's start and its place in it, from 1.
    pub at: (BinlogPos, u32),
    /// The primary key's columns in the table's order (`None`: the table has none).
    pub key: Option<Arc<[String]>>,
    /// The table's columns `old` and `new` lack: the server did not log them
    /// (`binlog_row_image=MINIMAL` or `NOBLOB`). Empty under `FULL`, and for an absent image.
    pub not_logged_old: Vec<String>,
    pub not_logged_new: Vec<String>,
}

impl Change {
    /// Whether an image lacks columns the server did not log.
    pub fn partial(&self) -> bool {
        !self.not_logged_old.is_empty() || !self.not_logged_new.is_empty()
    }
}

/// A change's keys for per-key order (`batch.order: "key"` without `orderKey`): its table with its
/// primary key's values, the old key's and the new one's when an update changed it; the table alone
/// when it has no primary key; every key (a barrier, [`Group::All`]) when an image lacks a key
/// column it needs, or when the table's primary key is not the one `seen` has for it from the
/// changes before (an `ALTER TABLE` between them: the changes keyed the old way finish first).
/// `seen` keeps each table's key for the tick.
pub fn order_group(change: &Change, seen: &mut HashMap<String, Option<Arc<[String]>>>) -> Group {
    if change.op == Op::Truncate {
        return Group::All;
    }
    match seen.get(&change.table) {
        Some(before) if *before == change.key => {}
        before => {
            let changed = before.is_some();
            seen.insert(change.table.clone(), change.key.clone());
            if changed {
                return Group::All;
            }
        }
    }
    let Some(columns) = &change.key else {
        return Group::one(&[change.table.as_bytes()]);
    };
    let key_of = |image: &Map<String, Value>, fill: Option<&Map<String, Value>>| -> Option<Vec<u8>> {
        let values: Option<Vec<(&str, &Value)>> = columns
            .iter()
            .map(|column| {
                let value = image.get(column).or_else(|| fill.and_then(|fill| fill.get(column)))?;
                Some((column.as_str(), value))
            })
            .collect();
        Some(serde_json::to_vec(&values?).expect("JSON values serialize"))
    };
    let keys = match (change.op, &change.old, &change.new) {
        (Op::Insert, _, Some(new)) => vec![key_of(new, None)],
        (Op::Delete, Some(old), _) => vec![key_of(old, None)],
        // A key column the after image lacks was not changed: it is the before image's.
        (Op::Update, Some(old), Some(new)) => vec![key_of(old, None), key_of(new, Some(old))],
        _ => vec![None],
    };
    let mut distinct: Vec<u64> = Vec::with_capacity(2);
    for key in keys {
        let Some(key) = key else { return Group::All };
        let hash = Group::key_of(&[change.table.as_bytes(), &key]);
        if !distinct.contains(&hash) {
            distinct.push(hash);
        }
    }
    Group::Keys(distinct)
}

/// A table map's column names (empty when the server does not log them) and primary key (in the
/// table's order): the map's own when `binlog_row_metadata=FULL` logs it, else the columns
/// `information_schema` marks when the read started.
fn table_columns(table_map: &TableMapEvent<'_>, info: Option<&TableInfo>) -> (Vec<String>, Option<Arc<[String]>>) {
    let Ok(extractor) = OptionalMetaExtractor::new(table_map.iter_optional_meta()) else {
        return (Vec::new(), None);
    };
    let names: Vec<String> =
        extractor.iter_column_name().map_while(Result::ok).map(|name| name.name().into_owned()).collect();
    let mut indexes: Vec<usize> = extractor
        .iter_primary_key()
        .map_while(Result::ok)
        .filter_map(|index| usize::try_from(index).ok())
        .filter(|index| *index < names.len())
        .collect();
    indexes.sort_unstable();
    indexes.dedup();
    let key: Vec<String> = if indexes.is_empty() {
        names
            .iter()
            .filter(|name| info.and_then(|info| info.get(name.as_str())).is_some_and(|info| info.key))
            .cloned()
            .collect()
    } else {
        indexes.iter().map(|index| names[*index].clone()).collect()
    };
    (names, Some(key).filter(|key| !key.is_empty()).map(Arc::from))
}

/// The names of `columns` an image lacks (none for an absent image, or when names are unknown).
fn not_logged(columns: &[String], image: Option<&Map<String, Value>>) -> Vec<String> {
    let Some(image) = image else { return Vec::new() };
    columns.iter().filter(|column| !image.contains_key(column.as_str())).cloned().collect()
}

/// What the open transaction carries, for every change's event.
#[derive(Debug, Clone, PartialEq)]
pub struct TransactionFields {
    pub start: BinlogPos,
    /// MariaDB `domain-server-sequence`, MySQL `uuid:n`; `None` without GTIDs.
    pub gtid: Option<String>,
    /// Seconds since the epoch, as the transaction's first event records it.
    pub time: u32,
    pub file: String,
    /// MariaDB: the transaction's GTID, and the GTID position before it (tracked from the
    /// checkpoint's, [`Decoder::track_gtids`]); `None` otherwise.
    pub mariadb: Option<(Gtid, GtidPos)>,
}

/// What one event gives.
#[derive(Debug)]
pub enum Step {
    Nothing,
    /// Changes of the open transaction, decoded (those at or before the reader's position are
    /// counted and left out).
    Changes(Vec<Change>),
    /// The last changes of the transaction that just ended ([`Decoder::last_committed`]): a
    /// `TRUNCATE`, a transaction of one statement.
    Ended(Vec<Change>),
    /// The open transaction ended: where the next one starts, and how many changes it had.
    Committed {
        start: BinlogPos,
        end: BinlogPos,
        changes: u32,
    },
    /// The first transaction read is not the one the reader expected there
    /// ([`Decoder::track_gtids`]): the log at that position is not the one the checkpoint was read
    /// from. `None`: the first event there does not start a transaction.
    Foreign(Option<Gtid>),
}

struct Open {
    fields: TransactionFields,
    begun: bool,
    standalone: bool,
    changes: u32,
    /// The checkpoint's GTID position holds this transaction: none of its changes is given.
    covered: bool,
}

/// What the reader tracks of MariaDB's GTIDs: the position before the next transaction, the
/// checkpoint's mark (what it covers), and the GTID the first transaction must have.
struct Tracking {
    pos: GtidPos,
    mark: Option<GtidMark>,
    expect: Option<Gtid>,
}

/// Reads a dump's events in order.
pub struct Decoder {
    tables: HashSet<String>,
    info: HashMap<String, TableInfo>,
    names: Option<FileNames>,
    file: u32,
    file_name: String,
    /// Where the next event starts.
    next: u32,
    open: Option<Open>,
    /// Changes at or before this are counted, not decoded.
    after: Option<(BinlogPos, u32)>,
    /// Every change is counted and given without its rows.
    count_only: bool,
    gtids: Option<Tracking>,
    /// The last transaction that ended.
    last: Option<TransactionFields>,
}

impl Decoder {
    pub fn new(tables: &[String], info: HashMap<String, TableInfo>, after: Option<(BinlogPos, u32)>) -> Decoder {
        Decoder {
            tables: tables.iter().cloned().collect(),
            info,
            names: None,
            file: 0,
            file_name: String::new(),
            next: 0,
            open: None,
            after,
            count_only: false,
            gtids: None,
            last: None,
        }
    }

    /// MariaDB: tracks GTIDs from `pos` (the GTID position where the read starts), leaves out the
    /// transactions `mark` covers, and, when `expect` is set, checks that the first event read is
    /// that transaction's GTID.
    pub fn track_gtids(&mut self, pos: GtidPos, mark: Option<GtidMark>, expect: Option<Gtid>) {
        self.gtids = Some(Tracking { pos, mark, expect });
    }

    /// Whether the first transaction the read expects has not been read yet.
    pub fn expecting(&self) -> bool {
        self.gtids.as_ref().is_some_and(|tracking| tracking.expect.is_some())
    }

    /// The last transaction that ended in this read.
    pub fn last_committed(&self) -> Option<&TransactionFields> {
        self.last.as_ref()
    }

    /// The GTID position after the last transaction read (MariaDB).
    pub fn gtid_pos(&self) -> Option<&GtidPos> {
        self.gtids.as_ref().map(|tracking| &tracking.pos)
    }

    /// Changes are given without their rows (decoded only as far as counting them takes).
    pub fn counting(&mut self, count_only: bool) {
        self.count_only = count_only;
    }

    /// Where the event read next starts (the end of the last one read).
    pub fn position(&self) -> BinlogPos {
        BinlogPos { file: self.file, offset: self.next }
    }

    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    pub fn fields(&self) -> Option<&TransactionFields> {
        self.open.as_ref().map(|open| &open.fields)
    }

    /// The event read; `tme` finds a table map the stream read before it.
    pub fn push<'t>(
        &mut self,
        event: &Event,
        tme: impl Fn(u64) -> Option<&'t TableMapEvent<'static>>,
    ) -> Result<Step, String> {
        let header = event.header();
        let artificial = header.flags_raw() & LOG_EVENT_ARTIFICIAL != 0 || header.log_pos() == 0;
        // An event in the file ends at its header's position: it starts its size before (a dump
        // by GTID leaves out the events before the first transaction it sends).
        let start = if artificial {
            BinlogPos { file: self.file, offset: self.next }
        } else {
            BinlogPos { file: self.file, offset: header.log_pos().saturating_sub(header.event_size()) }
        };
        if !artificial {
            self.next = header.log_pos();
        }
        let raw_type = header.event_type_raw();
        if !artificial
            && let Some(tracking) = self.gtids.as_mut()
            && let Some(expected) = tracking.expect
            && !matches!(
                raw_type,
                ROTATE_EVENT | FORMAT_DESCRIPTION_EVENT | MARIADB_GTID_LIST_EVENT | MARIADB_BINLOG_CHECKPOINT_EVENT
            )
        {
            // The first event of the read: it must be the checkpoint's transaction's GTID.
            tracking.expect = None;
            let found =
                (raw_type == MARIADB_GTID_EVENT).then(|| mariadb_gtid(event)).transpose()?.map(|(gtid, _)| gtid);
            if found != Some(expected) {
                return Ok(Step::Foreign(found));
            }
        }
        if raw_type == MARIADB_GTID_EVENT {
            let (gtid, flags) = mariadb_gtid(event)?;
            let standalone = flags & MARIADB_FL_STANDALONE != 0;
            let tracked = self.gtids.as_mut().map(|tracking| {
                let before = tracking.pos.clone();
                let covered = binlog::covered_by(tracking.mark.as_ref(), Some(gtid));
                if !covered {
                    tracking.pos.advance(gtid);
                }
                (before, covered)
            });
            self.begin(start, Some(gtid.to_string()), header.timestamp(), standalone);
            if let Some(open) = self.open.as_mut() {
                open.covered = tracked.as_ref().is_some_and(|(_, covered)| *covered);
                open.fields.mariadb = tracked.map(|(before, _)| (gtid, before));
            }
            // MariaDB's GTID takes the place of `BEGIN`: a transaction's statements follow it.
            if let Some(open) = self.open.as_mut() {
                open.begun = !standalone;
            }
            return Ok(Step::Nothing);
        }
        // MariaDB's compressed events (`log_bin_compress=ON`): the driver does not know them, and
        // skipping one would lose its rows while the transaction's commit moves the checkpoint on.
        if MARIADB_COMPRESSED_EVENTS.contains(&raw_type) {
            return Err(format!(
                "a MariaDB compressed event (type {raw_type}, log_bin_compress=ON), which this source cannot read: \
                 set log_bin_compress=OFF, then `dbtrigger reset` past this transaction if it must be skipped"
            ));
        }
        let data = match event.read_data() {
            Ok(Some(data)) => data,
            Ok(None) => return Ok(Step::Nothing),
            Err(error) => return Err(format!("an event of type {raw_type} that does not parse: {error}")),
        };
        match data {
            EventData::RotateEvent(rotate) => {
                // The dump's first Rotate comes before the format description: the reader does
                // not know yet that events end with a 4-byte checksum, and leaves it in the name.
                let raw = rotate.name_raw();
                let parsed = [raw, raw.get(..raw.len().saturating_sub(4)).unwrap_or_default()]
                    .into_iter()
                    .filter_map(|bytes| std::str::from_utf8(bytes).ok())
                    .find_map(|name| FileNames::parse(name).map(|(names, number)| (names, number, name.to_string())));
                let Some((names, number, name)) = parsed else {
                    return Err(format!("a binary log file name {:?} without a number", String::from_utf8_lossy(raw)));
                };
                self.names.get_or_insert(names);
                self.file = number;
                self.file_name = name;
                self.next = u32::try_from(rotate.position()).unwrap_or(u32::MAX);
                Ok(Step::Nothing)
            }
            EventData::GtidEvent(gtid) => {
                let sid = gtid.sid();
                let uuid = uuid::Uuid::from_bytes(sid);
                let text = format!("{uuid}:{}", gtid.gno());
                self.begin(start, Some(text), header.timestamp(), false);
                Ok(Step::Nothing)
            }
            EventData::QueryEvent(query) => self.query(&query.query(), &query.schema(), start, header.timestamp()),
            // `LOAD DATA` logged as a statement (its file sent before it).
            EventData::ExecuteLoadQueryEvent(load) => {
                self.query(&load.query(), &load.schema(), start, header.timestamp())
            }
            EventData::XidEvent(_) => Ok(self.end()),
            EventData::RowsEvent(rows) => self.rows(&rows, tme),
            _ => Ok(Step::Nothing),
        }
    }

    /// A statement: a transaction's bounds, a `TRUNCATE` of a watched table (a change, ending its
    /// transaction of one statement), a change logged as a statement naming a watched table (an
    /// error: it cannot be turned into rows, and passing it would lose it), or passed
    /// ([`binlog_query::classify`]).
    fn query(&mut self, text: &str, schema: &str, start: BinlogPos, time: u32) -> Result<Step, String> {
        // After a GTID with no `BEGIN` (DDL, or a statement alone), the statement is the transaction.
        let ends_alone = |open: &Option<Open>| open.as_ref().is_some_and(|open| !open.begun || open.standalone);
        match binlog_query::classify(text, schema, &self.tables) {
            Query::Begin => {
                match self.open.as_mut() {
                    Some(open) => open.begun = true,
                    None => {
                        self.begin(start, None, time, false);
                        if let Some(open) = self.open.as_mut() {
                            open.begun = true;
                        }
                    }
                }
                Ok(Step::Nothing)
            }
            Query::End => Ok(self.end()),
            Query::Statement { table } => {
                if self.open.as_ref().is_some_and(|open| open.covered) {
                    return Ok(if ends_alone(&self.open) { self.end() } else { Step::Nothing });
                }
                let verb = text.split_whitespace().next().unwrap_or("").to_ascii_uppercase();
                Err(format!(
                    "a change to {table} logged as a statement ({verb} at {}:{}, binlog_format STATEMENT or MIXED in \
                     the writer's session), which cannot be turned into rows: the poller stops before it. Have every \
                     session write in ROW format, apply what the statement did to the receiver by hand, then \
                     `dbtrigger reset <poller>` past its transaction (--to-cursor the next transaction's place, or \
                     --to-end)",
                    self.file_name, start.offset
                ))
            }
            Query::Truncate { table } => {
                if self.open.is_none() {
                    self.begin(start, None, time, true);
                }
                let open = self.open.as_mut().expect("a transaction is open");
                let mut changes = Vec::new();
                if !open.covered {
                    open.changes += 1;
                    let at = (open.fields.start, open.changes);
                    if self.after.is_none_or(|after| at > after) {
                        changes.push(Change {
                            op: Op::Truncate,
                            table,
                            new: None,
                            old: None,
                            at,
                            key: None,
                            not_logged_old: Vec::new(),
                            not_logged_new: Vec::new(),
                        });
                    }
                }
                if ends_alone(&self.open) {
                    let _ = self.end();
                    return Ok(if changes.is_empty() { Step::Nothing } else { Step::Ended(changes) });
                }
                Ok(if changes.is_empty() { Step::Nothing } else { Step::Changes(changes) })
            }
            Query::Xa { .. } | Query::Other => Ok(if ends_alone(&self.open) { self.end() } else { Step::Nothing }),
        }
    }

    fn begin(&mut self, start: BinlogPos, gtid: Option<String>, time: u32, standalone: bool) {
        let fields = TransactionFields { start, gtid, time, file: self.file_name.clone(), mariadb: None };
        self.open = Some(Open { fields, begun: false, standalone, changes: 0, covered: false });
    }

    fn end(&mut self) -> Step {
        match self.open.take() {
            Some(open) => {
                let step = Step::Committed { start: open.fields.start, end: self.position(), changes: open.changes };
                self.last = Some(open.fields);
                step
            }
            None => Step::Nothing,
        }
    }

    fn rows<'t>(
        &mut self,
        rows: &RowsEventData<'_>,
        tme: impl Fn(u64) -> Option<&'t TableMapEvent<'static>>,
    ) -> Result<Step, String> {
        let table_map = tme(rows.table_id())
            .ok_or_else(|| format!("a row event of table id {} with no table map before it", rows.table_id()))?;
        let table = format!("{}.{}", table_map.database_name(), table_map.table_name());
        if !self.tables.contains(&table) {
            return Ok(Step::Nothing);
        }
        let Some(open) = self.open.as_mut() else {
            return Err(format!("a row event of {table} outside a transaction"));
        };
        if open.covered {
            return Ok(Step::Nothing);
        }
        let op = match rows {
            RowsEventData::WriteRowsEvent(_) | RowsEventData::WriteRowsEventV1(_) => Op::Insert,
            RowsEventData::DeleteRowsEvent(_) | RowsEventData::DeleteRowsEventV1(_) => Op::Delete,
            _ => Op::Update,
        };
        let info = self.info.get(&table);
        let (columns, key) = if self.count_only { (Vec::new(), None) } else { table_columns(table_map, info) };
        let mut changes = Vec::new();
        for row in rows.rows(table_map) {
            let (before, after) = row.map_err(|error| format!("a row of {table} that does not parse: {error}"))?;
            open.changes += 1;
            let at = (open.fields.start, open.changes);
            if self.after.is_some_and(|after| at <= after) {
                continue;
            }
            let mut change = Change {
                op,
                table: table.clone(),
                new: None,
                old: None,
                at,
                key: key.clone(),
                not_logged_old: Vec::new(),
                not_logged_new: Vec::new(),
            };
            if !self.count_only {
                change.old = before.as_ref().map(|row| row_json(row, info)).transpose()?;
                change.new = after.as_ref().map(|row| row_json(row, info)).transpose()?;
                change.not_logged_old = not_logged(&columns, change.old.as_ref());
                change.not_logged_new = not_logged(&columns, change.new.as_ref());
            }
            changes.push(change);
        }
        Ok(if changes.is_empty() { Step::Nothing } else { Step::Changes(changes) })
    }
}

/// A MariaDB GTID event's GTID (sequence, domain, and the header's server id) and flags.
fn mariadb_gtid(event: &Event) -> Result<(Gtid, u8), String> {
    let data = event.data();
    let (Some(seq), Some(domain), Some(flags)) = (
        data.get(0..8).map(|bytes| u64::from_le_bytes(bytes.try_into().unwrap_or_default())),
        data.get(8..12).map(|bytes| u32::from_le_bytes(bytes.try_into().unwrap_or_default())),
        data.get(12),
    ) else {
        return Err("a MariaDB GTID event shorter than 13 bytes".into());
    };
    Ok((Gtid { domain, server: event.header().server_id(), seq }, *flags))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn change(op: Op, key: Option<&[&str]>, old: Value, new: Value) -> Change {
        let image = |value: Value| value.as_object().cloned();
        Change {
            op,
            table: "shop.items".into(),
            new: image(new),
            old: image(old),
            at: (BinlogPos { file: 1, offset: 4 }, 1),
            key: key.map(|columns| columns.iter().map(|column| column.to_string()).collect::<Vec<_>>().into()),
            not_logged_old: Vec::new(),
            not_logged_new: Vec::new(),
        }
    }

    fn row_key(id: i64) -> u64 {
        Group::key_of(&[b"shop.items", format!(r#"[["id",{id}]]"#).as_bytes()])
    }

    #[test]
    fn a_change_is_keyed_by_its_rows_primary_key() {
        let mut seen = HashMap::new();
        let key = Some(&["id"][..]);
        let insert = change(Op::Insert, key, Value::Null, json!({"id": 1, "note": "a"}));
        assert_eq!(order_group(&insert, &mut seen), Group::Keys(vec![row_key(1)]));
        // Another row: another key; an update keeping its key: the one key.
        let update = change(Op::Update, key, json!({"id": 2, "note": "a"}), json!({"id": 2, "note": "b"}));
        assert_eq!(order_group(&update, &mut seen), Group::Keys(vec![row_key(2)]));
        // A key change waits for both keys, the old first.
        let moved = change(Op::Update, key, json!({"id": 2}), json!({"id": 3}));
        assert_eq!(order_group(&moved, &mut seen), Group::Keys(vec![row_key(2), row_key(3)]));
        let delete = change(Op::Delete, key, json!({"id": 3, "note": "b"}), Value::Null);
        assert_eq!(order_group(&delete, &mut seen), Group::Keys(vec![row_key(3)]));
    }

    #[test]
    fn a_minimal_image_takes_the_unchanged_key_from_the_before_image() {
        let mut seen = HashMap::new();
        let key = Some(&["id"][..]);
        // MINIMAL: the before image holds the key, the after image the columns set.
        let update = change(Op::Update, key, json!({"id": 4}), json!({"note": "b"}));
        assert_eq!(order_group(&update, &mut seen), Group::Keys(vec![row_key(4)]));
        // A key column no image holds: the key cannot be told, the change waits for all.
        let unknown = change(Op::Delete, key, json!({"note": "b"}), Value::Null);
        assert_eq!(order_group(&unknown, &mut seen), Group::All);
        let insert = change(Op::Insert, key, Value::Null, json!({"note": "b"}));
        assert_eq!(order_group(&insert, &mut seen), Group::All);
        // A composite key with one column changed: the other is the before image's.
        let composite = Some(&["a", "b"][..]);
        let mut seen = HashMap::new();
        let update = change(Op::Update, composite, json!({"a": 1, "b": 2}), json!({"b": 3}));
        let keys = |pairs: &[(i64, i64)]| {
            Group::Keys(
                pairs
                    .iter()
                    .map(|(a, b)| Group::key_of(&[b"shop.items", format!(r#"[["a",{a}],["b",{b}]]"#).as_bytes()]))
                    .collect(),
            )
        };
        assert_eq!(order_group(&update, &mut seen), keys(&[(1, 2), (1, 3)]));
    }

    #[test]
    fn a_table_without_a_primary_key_is_one_key_and_a_new_key_is_a_barrier() {
        let mut seen = HashMap::new();
        let table = Group::one(&[b"shop.items"]);
        let first = change(Op::Insert, None, Value::Null, json!({"id": 1}));
        let second = change(Op::Update, None, json!({"id": 1}), json!({"id": 2}));
        assert_eq!(order_group(&first, &mut seen), table);
        assert_eq!(order_group(&second, &mut seen), table);
        // `ALTER TABLE … ADD PRIMARY KEY` between two changes: the first keyed the new way waits
        // for every change before it; the next ones have their rows' keys.
        let keyed = change(Op::Update, Some(&["id"]), json!({"id": 2}), json!({"id": 2, "note": "x"}));
        assert_eq!(order_group(&keyed, &mut seen), Group::All);
        assert_eq!(order_group(&keyed, &mut seen), Group::Keys(vec![row_key(2)]));
    }

    #[test]
    fn a_truncate_waits_for_every_change_before_it() {
        let mut seen = HashMap::new();
        let truncate = change(Op::Truncate, Some(&["id"]), Value::Null, Value::Null);
        assert_eq!(order_group(&truncate, &mut seen), Group::All);
    }

    #[test]
    fn missing_columns_are_named_in_the_tables_order() {
        let columns: Vec<String> = ["id", "note", "body"].iter().map(|name| name.to_string()).collect();
        let image = json!({"note": "x"}).as_object().cloned().unwrap();
        assert_eq!(not_logged(&columns, Some(&image)), ["id", "body"]);
        assert!(not_logged(&columns, None).is_empty());
    }
}
