//! From binary log events to changes: where each event is (the file a Rotate names, the offset
//! its header ends at), where each transaction starts (its GTID event, or its `BEGIN`), its row
//! events of the configured tables, one change per row numbered from 1 within the transaction,
//! and where it ends (an `XID`, a `COMMIT`, or the statement after a GTID with no `BEGIN`: DDL).
//! Table maps are the stream's own (read before each row event), so an `ALTER TABLE` is followed.
//! No I/O: events in, changes out.

use std::collections::{HashMap, HashSet};

use mysql_async::binlog::events::{Event, EventData, RowsEventData, TableMapEvent};
use serde_json::{Map, Value};

use super::values::{TableInfo, row_json};
use crate::domain::Op;
use crate::domain::binlog::{self, BinlogPos, FileNames, Gtid, GtidMark, GtidPos};

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
            EventData::QueryEvent(query) => {
                let text = query.query();
                let statement = text.trim();
                if statement.eq_ignore_ascii_case("BEGIN") {
                    match self.open.as_mut() {
                        Some(open) => open.begun = true,
                        None => {
                            self.begin(start, None, header.timestamp(), false);
                            if let Some(open) = self.open.as_mut() {
                                open.begun = true;
                            }
                        }
                    }
                    return Ok(Step::Nothing);
                }
                let ends = statement.eq_ignore_ascii_case("COMMIT")
                    || statement.eq_ignore_ascii_case("ROLLBACK")
                    || self.open.as_ref().is_some_and(|open| !open.begun || open.standalone);
                Ok(if ends { self.end() } else { Step::Nothing })
            }
            EventData::XidEvent(_) => Ok(self.end()),
            EventData::RowsEvent(rows) => self.rows(&rows, tme),
            _ => Ok(Step::Nothing),
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
        let mut changes = Vec::new();
        for row in rows.rows(table_map) {
            let (before, after) = row.map_err(|error| format!("a row of {table} that does not parse: {error}"))?;
            open.changes += 1;
            let at = (open.fields.start, open.changes);
            if self.after.is_some_and(|after| at <= after) {
                continue;
            }
            if self.count_only {
                changes.push(Change { op, table: table.clone(), new: None, old: None, at });
                continue;
            }
            let old = before.as_ref().map(|row| row_json(row, info)).transpose()?;
            let new = after.as_ref().map(|row| row_json(row, info)).transpose()?;
            changes.push(Change { op, table: table.clone(), new, old, at });
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
