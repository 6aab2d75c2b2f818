//! The binary-log [`Source`]: a dump (`COM_BINLOG_DUMP`, non-blocking: it ends at the end of
//! what is written) from the checkpoint's transaction, read as a stream across the tick's
//! batches; what the checkpoint covers is counted and skipped. A poller with no checkpoint reads
//! from the current end, and the tick records where a read that found nothing ended
//! ([`Source::resting_position`]), so nothing committed after its first tick is skipped.

use std::collections::{HashMap, VecDeque};

use async_trait::async_trait;
use futures::StreamExt;
use mysql_async::{BinlogStream, Conn, Opts};
use serde_json::{Map, Value};
use tokio::sync::Mutex;

use super::events::{Change, Decoder, Step, TransactionFields, order_group};
use super::server;
use crate::config::redact::Redaction;
use crate::config::{SourceConfig, SourceTarget};
use crate::domain::binlog::{self, BinlogPos, FileNames, Reader};
use crate::domain::event::RowJson;
use crate::domain::keyed::Group;
use crate::domain::{CursorValue, PkValue, Position};
use crate::source::{FetchLimit, Fetched, Probe, Source, SourceError, SourceRow, timed};

/// A position: the transaction's start and the change's ordinal in it (0: before its first).
pub type Key = (BinlogPos, u32);

/// The most a count reads (status's lag).
pub const COUNT_CAP: u64 = 100_000;

pub fn position(key: Key) -> Position {
    Position {
        cursor: CursorValue::Integer(key.0.cursor()),
        pk: vec![(crate::config::LOGICAL_KEY.to_string(), PkValue::Integer(i64::from(key.1)))],
    }
}

pub fn key_of(position: &Position) -> Result<Key, String> {
    let foreign = || {
        format!(
            "the checkpoint ({}) is not a binary-log source's (position, ordinal): the poller's source changed kind; reset it",
            crate::domain::state::describe(position)
        )
    };
    let CursorValue::Integer(cursor) = position.cursor else { return Err(foreign()) };
    let pos = BinlogPos::of_cursor(cursor).ok_or_else(foreign)?;
    match position.pk.as_slice() {
        [(name, PkValue::Integer(ordinal))] if name == crate::config::LOGICAL_KEY => {
            Ok((pos, u32::try_from(*ordinal).map_err(|_| foreign())?))
        }
        _ => Err(foreign()),
    }
}

pub struct BinlogSource {
    config: SourceConfig,
    options: Opts,
    tables: Vec<String>,
    server_id: u32,
    redaction: Redaction,
    reading: Mutex<Reading>,
    /// The last checkpoint this source was asked from: `status` shows the retention behind it.
    known: std::sync::Mutex<Option<Key>>,
}

#[derive(Default)]
struct Reading {
    open: Option<Open>,
    /// A read from this position found nothing after it up to that end.
    rest: Option<(Option<Key>, BinlogPos)>,
    /// Each table's primary key as this tick's changes had it ([`order_group`]).
    keys: HashMap<String, Option<std::sync::Arc<[String]>>>,
}

/// A dump being read.
struct Open {
    stream: BinlogStream,
    decoder: Decoder,
    /// The last change handed out (the position asked from, before the first).
    at: Option<Key>,
    pending: VecDeque<(Key, SourceRow)>,
}

impl BinlogSource {
    pub fn open(config: &SourceConfig) -> Result<Self, SourceError> {
        let SourceTarget::Binlog { tables, server_id } = &config.target else {
            return Err(SourceError::Query { location: String::new(), reason: "not a binary-log source".into() });
        };
        let redaction = Redaction::of_url(config.url.expose());
        let options = server::options_of(config.url.expose()).map_err(|reason| SourceError::Unreachable {
            location: redaction.location.clone(),
            reason: redaction.scrub(&reason),
        })?;
        Ok(BinlogSource {
            config: config.clone(),
            options,
            tables: tables.clone(),
            server_id: *server_id,
            redaction,
            reading: Mutex::new(Reading::default()),
            known: std::sync::Mutex::new(None),
        })
    }

    fn error(&self, error: mysql_async::Error) -> SourceError {
        server::error(&self.redaction, error)
    }

    fn query(&self, reason: String) -> SourceError {
        SourceError::Query { location: self.redaction.location.clone(), reason }
    }

    async fn connect(&self) -> Result<Conn, SourceError> {
        Conn::new(self.options.clone()).await.map_err(|error| self.error(error))
    }

    fn key(&self, after: Option<&Position>) -> Result<Option<Key>, SourceError> {
        let key = after.map(key_of).transpose().map_err(SourceError::Position)?;
        if key.is_some() {
            *self.known.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = key;
        }
        Ok(key)
    }

    /// Where the binary log ends, its naming, and the oldest file it keeps.
    async fn ends(&self, conn: &mut Conn) -> Result<(BinlogPos, FileNames, u32, Vec<(u32, u64)>), SourceError> {
        let (end, names) = server::end_position(conn).await.map_err(|error| self.error(error))?.map_err(|reason| {
            self.query(format!("{reason}: a binary-log source needs log_bin (`dbtrigger check` says what is missing)"))
        })?;
        let files = server::files(conn).await.map_err(|error| self.error(error))?;
        let sizes: Vec<(u32, u64)> =
            files.iter().filter_map(|(name, size)| Some((names.number(name)?, *size))).collect();
        // A file list that names none of the log's files (another base name) judges nothing
        // lost: the oldest kept is then taken to be the first file there can be.
        let oldest = sizes.first().map(|(number, _)| *number).unwrap_or(0);
        Ok((end, names, oldest, sizes))
    }

    /// A dump after `after` (from the end when `None`) for `reader`, with its replica id; a
    /// count's changes are counted, not decoded.
    async fn start(&self, after: Option<Key>, reader: Reader) -> Result<Open, SourceError> {
        let mut conn = self.connect().await?;
        let (end, names, oldest, _) = self.ends(&mut conn).await?;
        let from = after.map(|(pos, _)| pos).unwrap_or(end);
        if let Some(reason) = binlog::lost_reason(from, oldest, &names) {
            return Err(SourceError::BinlogLost {
                location: self.redaction.location.clone(),
                file: names.name(from.file),
                reason,
            });
        }
        let info = server::table_info(&mut conn, &self.tables).await.map_err(|error| self.error(error))?;
        // `status` reads beside a tick: a replica id of its own, or the server would drop the tick's.
        let server_id = binlog::reader_id(self.server_id, reader);
        let stream = server::dump(conn, server_id, &names, from).await.map_err(|error| self.error(error))?;
        let mut decoder = Decoder::new(&self.tables, info, after);
        decoder.counting(reader == Reader::Count);
        Ok(Open { stream, decoder, at: after, pending: VecDeque::new() })
    }

    /// The next change of the dump; `None` at the end of what is written. `keys`: each table's
    /// primary key as the changes before had it (for their order keys).
    async fn next(
        &self,
        open: &mut Open,
        keys: &mut HashMap<String, Option<std::sync::Arc<[String]>>>,
    ) -> Result<Option<(Key, SourceRow)>, SourceError> {
        loop {
            if let Some(change) = open.pending.pop_front() {
                return Ok(Some(change));
            }
            let Some(event) = open.stream.next().await else {
                return Ok(None);
            };
            let event = event.map_err(|error| self.error(error))?;
            let Open { stream, decoder, pending, .. } = open;
            let step = decoder
                .push(&event, |id| stream.get_tme(id))
                .map_err(|reason| self.query(format!("binary log at {}: {reason}", decoder.position().offset)))?;
            if let Step::Changes(changes) = step {
                let fields =
                    decoder.fields().cloned().ok_or_else(|| self.query("a change outside a transaction".into()))?;
                let head = fields_json(&fields);
                for change in changes {
                    let key = change.at;
                    let group = order_group(&change, keys);
                    pending.push_back((key, row_of(&head, change, group)));
                }
            }
        }
    }

    async fn deliver(&self, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let after = self.key(after)?;
        let mut reading = self.reading.lock().await;
        if reading.open.as_ref().is_some_and(|open| open.at != after) {
            reading.open = None;
        }
        if after.is_none() {
            // No checkpoint: this tick only fixes where the poller starts (the end of the log,
            // recorded by the idle tick's write, `resting_position`). Delivering from an end
            // not yet recorded would, if the tick failed before its first commit, let the next
            // tick start at a later end and skip what this one read.
            reading.open = None;
            let mut conn = self.connect().await?;
            let (end, ..) = self.ends(&mut conn).await?;
            let _ = conn.disconnect().await;
            reading.rest = Some((None, end));
            return Ok(Fetched { rows: Vec::new(), full: false });
        }
        if reading.open.is_none() {
            reading.open = Some(self.start(after, Reader::Tick).await?);
        }
        let mut rows = Vec::new();
        let mut bytes = 0usize;
        loop {
            let Reading { open, keys, .. } = &mut *reading;
            let open = open.as_mut().expect("a dump is open");
            let Some((key, row)) = self.next(open, keys).await? else {
                let end = open.decoder.position();
                let in_transaction = open.decoder.in_transaction();
                reading.open = None;
                if rows.is_empty() && !in_transaction {
                    reading.rest = Some((after, end));
                }
                return Ok(Fetched { rows, full: in_transaction });
            };
            let size = row.row.len() + 128;
            if !rows.is_empty() && bytes + size > limit.bytes {
                open.pending.push_front((key, row));
                break;
            }
            bytes += size;
            open.at = Some(key);
            rows.push(row);
            if rows.len() >= limit.rows.max(1) {
                break;
            }
        }
        Ok(Fetched { rows, full: true })
    }

    /// Up to `limit` changes after `after` (counted only when `counting`), and whether more follow.
    async fn look(
        &self,
        after: Option<Key>,
        limit: u64,
        counting: bool,
    ) -> Result<(Vec<SourceRow>, u64, bool), SourceError> {
        let reader = if counting { Reader::Count } else { Reader::Look };
        let mut open = self.start(after, reader).await?;
        let mut rows = Vec::new();
        let mut count = 0u64;
        let mut keys = HashMap::new();
        while let Some((_, row)) = self.next(&mut open, &mut keys).await? {
            count += 1;
            if count > limit {
                return Ok((rows, limit, true));
            }
            if !counting {
                rows.push(row);
            }
        }
        Ok((rows, count, false))
    }
}

/// What every change of a transaction carries.
fn fields_json(fields: &TransactionFields) -> Map<String, Value> {
    let mut head = Map::new();
    head.insert("gtid".into(), fields.gtid.clone().map(Value::from).unwrap_or(Value::Null));
    head.insert("binlog_file".into(), Value::from(fields.file.clone()));
    head.insert("binlog_position".into(), Value::from(fields.start.offset));
    let time = chrono::DateTime::from_timestamp(i64::from(fields.time), 0)
        .map(|at| Value::from(at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)))
        .unwrap_or(Value::Null);
    head.insert("commit_time".into(), time);
    head
}

fn row_of(head: &Map<String, Value>, change: Change, group: Group) -> SourceRow {
    let mut row = Map::new();
    row.insert("table".into(), Value::from(change.table.clone()));
    if change.partial() {
        // What the server did not log is named, never sent as null (`binlog_row_image=MINIMAL`).
        let mut not_logged = Map::new();
        not_logged.insert("old".into(), Value::from(change.not_logged_old));
        not_logged.insert("new".into(), Value::from(change.not_logged_new));
        row.insert("not_logged".into(), Value::Object(not_logged));
    }
    row.insert("new".into(), change.new.map(Value::Object).unwrap_or(Value::Null));
    row.insert("old".into(), change.old.map(Value::Object).unwrap_or(Value::Null));
    for (name, value) in head {
        row.insert(name.clone(), value.clone());
    }
    SourceRow { position: position(change.at), row: RowJson::from_map(&row), op: change.op, group: Some(group) }
}

#[async_trait]
impl Source for BinlogSource {
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let location = self.redaction.location.clone();
        let gate = crate::source::pools::Gate::open();
        match probe {
            Probe::Deliver => timed(&gate, &self.config, &location, self.deliver(after, limit)).await,
            Probe::Pending => {
                let after = self.key(after)?;
                let look = async {
                    let (rows, _, full) = self.look(after, limit.rows as u64, false).await?;
                    Ok(Fetched { rows, full })
                };
                timed(&gate, &self.config, &location, look).await
            }
            Probe::Last => Err(SourceError::Query {
                location,
                reason: "a binary-log source has no last row: `reset --to-end` puts its checkpoint at the end of the \
                         binary log instead"
                    .into(),
            }),
        }
    }

    async fn count_after(&self, after: Option<&Position>, cap: u64) -> Result<u64, SourceError> {
        let after = self.key(after)?;
        let cap = cap.min(COUNT_CAP);
        let count = async { Ok(self.look(after, cap, true).await?.1) };
        timed(&crate::source::pools::Gate::open(), &self.config, &self.redaction.location, count).await
    }

    fn count_limit(&self) -> u64 {
        COUNT_CAP
    }

    async fn tick_ended(&self) -> Result<(), SourceError> {
        let mut reading = self.reading.lock().await;
        reading.open = None;
        reading.keys.clear();
        Ok(())
    }

    async fn generation(&self) -> Result<Option<Value>, SourceError> {
        Ok(None)
    }

    fn describe(&self) -> String {
        format!("{} (binary log, server id {})", self.redaction.location, self.server_id)
    }

    async fn resting_position(&self, checkpoint: Option<&Position>) -> Result<Option<Position>, SourceError> {
        let key = self.key(checkpoint)?;
        let reading = self.reading.lock().await;
        Ok(match reading.rest {
            Some((asked, end)) if asked == key && key.is_none_or(|(start, _)| end > start) => Some(position((end, 0))),
            _ => None,
        })
    }

    /// The retention behind the checkpoint last asked from: bytes and files to the end, as a
    /// slot's view (`lost` when its file was purged).
    async fn slot(&self) -> Result<Option<crate::domain::slot::SlotView>, SourceError> {
        let known = *self.known.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some((at, _)) = known else { return Ok(None) };
        let mut conn = self.connect().await?;
        let (_, names, oldest, sizes) = self.ends(&mut conn).await?;
        let _ = conn.disconnect().await;
        let (bytes, files) = binlog::behind(at, &sizes);
        let lost = binlog::lost_reason(at, oldest, &names).is_some();
        Ok(Some(crate::domain::slot::SlotView {
            slot: format!("binary log {}", names.name(at.file)),
            retained_bytes: Some(i64::try_from(bytes).unwrap_or(i64::MAX)),
            wal_status: Some(if lost {
                "lost".to_string()
            } else {
                format!("{files} files after it, the oldest kept {}", names.name(oldest))
            }),
            active_pid: None,
        }))
    }

    async fn slot_ends(&self) -> Result<Option<crate::domain::slot::SlotEnds>, SourceError> {
        let mut conn = self.connect().await?;
        let (end, names, oldest, sizes) = self.ends(&mut conn).await?;
        let _ = conn.disconnect().await;
        let oldest = if sizes.is_empty() { end.file } else { oldest };
        let first = BinlogPos { file: oldest, offset: binlog::FIRST_OFFSET };
        Ok(Some(crate::domain::slot::SlotEnds {
            slot: format!("binary log (oldest kept {})", names.name(oldest)),
            confirmed: first.cursor() as u64,
            end: end.cursor() as u64,
            retained_bytes: Some(i64::try_from(binlog::behind(first, &sizes).0).unwrap_or(i64::MAX)),
        }))
    }
}
