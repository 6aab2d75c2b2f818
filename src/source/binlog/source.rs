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
use crate::domain::binlog::{self, BinlogPos, FileNames, Gtid, GtidMark, GtidPos, Reader, Resume};
use crate::domain::event::RowJson;
use crate::domain::keyed::Group;
use crate::domain::{CursorValue, PkValue, Position};
use crate::source::{FetchLimit, Fetched, Probe, Rebase, Source, SourceError, SourceRow, timed};

/// A position: the transaction's start and the change's ordinal in it (0: before its first).
pub type Key = (BinlogPos, u32);

/// A checkpoint's place: its key and, on MariaDB, its GTIDs.
#[derive(Debug, Clone, PartialEq)]
pub struct At {
    pub key: Key,
    pub mark: Option<GtidMark>,
}

/// The key columns a MariaDB position adds after the ordinal: its transaction's GTID (empty when
/// none names the position yet) and the GTID position before that transaction.
pub const GTID_KEY: &str = "gtid";
pub const GTID_POS_KEY: &str = "gtid_pos";

/// The most a count reads (status's lag).
pub const COUNT_CAP: u64 = 100_000;

pub fn position(key: Key) -> Position {
    Position {
        cursor: CursorValue::Integer(key.0.cursor()),
        pk: vec![(crate::config::LOGICAL_KEY.to_string(), PkValue::Integer(i64::from(key.1)))],
    }
}

/// A position with its GTIDs (MariaDB), as a checkpoint and an event's `pk` carry them.
pub fn position_marked(key: Key, mark: Option<&GtidMark>) -> Position {
    position_texts(key, mark.map(mark_texts).as_ref())
}

/// A mark's key columns as a position carries them: its transaction's GTID (empty when none) and
/// the GTID position before it.
fn mark_texts(mark: &GtidMark) -> (String, String) {
    (mark.tx.map(|tx| tx.to_string()).unwrap_or_default(), mark.before.to_string())
}

/// [`position_marked`] with the mark's texts made once (every change of a transaction has them).
fn position_texts(key: Key, mark: Option<&(String, String)>) -> Position {
    let mut position = position(key);
    if let Some((tx, before)) = mark {
        position.pk.push((GTID_KEY.to_string(), PkValue::Text(tx.clone())));
        position.pk.push((GTID_POS_KEY.to_string(), PkValue::Text(before.clone())));
    }
    position
}

pub fn key_of(position: &Position) -> Result<Key, String> {
    at_of(position).map(|at| at.key)
}

/// A checkpoint's key and GTIDs.
pub fn at_of(position: &Position) -> Result<At, String> {
    let foreign = || {
        format!(
            "the checkpoint ({}) is not a binary-log source's (position, ordinal): the poller's source changed kind; reset it",
            crate::domain::state::describe(position)
        )
    };
    let CursorValue::Integer(cursor) = position.cursor else { return Err(foreign()) };
    let pos = BinlogPos::of_cursor(cursor).ok_or_else(foreign)?;
    let ordinal = |name: &String, ordinal: &i64| {
        (name == crate::config::LOGICAL_KEY).then(|| u32::try_from(*ordinal).ok()).flatten().ok_or_else(foreign)
    };
    match position.pk.as_slice() {
        [(name, PkValue::Integer(number))] => Ok(At { key: (pos, ordinal(name, number)?), mark: None }),
        [(name, PkValue::Integer(number)), (gtid, PkValue::Text(tx)), (gtid_pos, PkValue::Text(before))]
            if gtid == GTID_KEY && gtid_pos == GTID_POS_KEY =>
        {
            let tx = if tx.is_empty() { None } else { Some(Gtid::parse(tx).ok_or_else(foreign)?) };
            let before = GtidPos::parse(before).ok_or_else(foreign)?;
            Ok(At { key: (pos, ordinal(name, number)?), mark: Some(GtidMark { tx, before }) })
        }
        _ => Err(foreign()),
    }
}

pub struct BinlogSource {
    config: SourceConfig,
    options: Opts,
    /// The Entra token each connection logs in with (`<connection>__credential = managedidentity`).
    token: Option<crate::source::entra::DatabaseToken>,
    tables: Vec<String>,
    server_id: u32,
    redaction: Redaction,
    reading: Mutex<Reading>,
    /// The last checkpoint this source was asked from: `status` shows the retention behind it.
    known: std::sync::Mutex<Option<Key>>,
    /// The server this tick's re-base judged the checkpoint on ([`Source::rebase`]).
    judged_on: std::sync::Mutex<Option<String>>,
}

#[derive(Default)]
struct Reading {
    open: Option<Open>,
    /// A read from this position found nothing after it: where the checkpoint may rest.
    rest: Option<(Option<Key>, Key, Position)>,
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
    /// Where the dump started and the transaction it expects there (MariaDB), for a message.
    from: (String, BinlogPos, Option<Gtid>),
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
            token: config.identity.clone().map(crate::source::entra::DatabaseToken::new),
            tables: tables.clone(),
            server_id: *server_id,
            redaction,
            reading: Mutex::new(Reading::default()),
            known: std::sync::Mutex::new(None),
            judged_on: std::sync::Mutex::new(None),
        })
    }

    fn error(&self, error: mysql_async::Error) -> SourceError {
        server::error(&self.redaction, error)
    }

    fn query(&self, reason: String) -> SourceError {
        SourceError::Query { location: self.redaction.location.clone(), reason }
    }

    async fn connect(&self) -> Result<Conn, SourceError> {
        let options = match &self.token {
            None => self.options.clone(),
            Some(token) => {
                let password = token.password(std::time::SystemTime::now(), &self.redaction.location).await?;
                // Azure Database for MySQL takes the token by the cleartext plugin (over the TLS
                // the configuration requires).
                mysql_async::OptsBuilder::from_opts(self.options.clone())
                    .pass(Some(password.token.expose().to_string()))
                    .enable_cleartext_plugin(true)
                    .into()
            }
        };
        Conn::new(options).await.map_err(|error| self.error(error))
    }

    fn key(&self, after: Option<&Position>) -> Result<Option<At>, SourceError> {
        let at = after.map(at_of).transpose().map_err(SourceError::Position)?;
        if let Some(at) = &at {
            *self.known.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(at.key);
        }
        Ok(at)
    }

    fn lost(&self, file: String, reason: String) -> SourceError {
        SourceError::BinlogLost { location: self.redaction.location.clone(), file, reason }
    }

    /// Refuses a server whose global `binlog_format` is not ROW: its sessions log changes as
    /// statements by default, which a read cannot turn into rows (one that meets such a change
    /// to a watched table stops; this says why before any is written).
    async fn row_format(&self, conn: &mut Conn) -> Result<(), SourceError> {
        let format = server::binlog_format(conn).await.map_err(|error| self.error(error))?;
        if format.eq_ignore_ascii_case("ROW") {
            return Ok(());
        }
        Err(self.query(format!(
            "the server's binlog_format is {format}: a binary-log source needs ROW (`SET GLOBAL binlog_format = 'ROW'` \
             and in the server's configuration; `dbtrigger check` says what else is missing)"
        )))
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
    /// count's changes are counted, not decoded. On MariaDB, a checkpoint's GTIDs are checked
    /// against the log there: its transaction must be the first read, or (no transaction names it)
    /// `BINLOG_GTID_POS` there must be its GTID position; otherwise the log was reset or replaced
    /// under it, and the read stops as lost.
    async fn start(&self, after: Option<&At>, reader: Reader) -> Result<Open, SourceError> {
        let mut conn = self.connect().await?;
        // A failover since the tick's re-base (an address that moved): the checkpoint was judged
        // on another server, and a read by its file position here would look like a reset log.
        // The tick fails; the next one re-bases it.
        let judged_on = self.judged_on.lock().map(|judged| judged.clone()).unwrap_or_default();
        if let (Some(judged_on), Reader::Tick) = (judged_on, reader) {
            let (now, _) = server::identity(&mut conn).await.map_err(|error| self.error(error))?;
            if now != judged_on {
                return Err(self.query(format!(
                    "the server changed during the tick ({judged_on} when the tick began, {now} now): the next tick \
                     finds the checkpoint on it"
                )));
            }
        }
        self.row_format(&mut conn).await?;
        let (end, names, oldest, _) = self.ends(&mut conn).await?;
        let from = after.map(|at| at.key.0).unwrap_or(end);
        if from == binlog::BY_GTID_ONLY && after.is_some_and(|at| at.mark.is_some()) {
            return Err(self.query(
                "the checkpoint was placed by GTID and has no file position yet: the next tick finds it".into(),
            ));
        }
        if let Some(reason) = binlog::lost_reason(from, oldest, &names) {
            return Err(self.lost(names.name(from.file), reason));
        }
        let mark = after.and_then(|at| at.mark.clone());
        if let Some(mark) = &mark
            && mark.tx.is_none()
        {
            let there = server::gtid_pos_at(&mut conn, &names, from).await.map_err(|error| self.error(error))?;
            if there.as_ref() != Some(&mark.before) {
                return Err(self.lost(
                    names.name(from.file),
                    format!(
                        "the GTID position at {}:{} is {}, not the checkpoint's ({}): the binary log was reset or replaced \
                         under the checkpoint, and its GTIDs may name other transactions now. If the server's GTID state was \
                         carried over, `dbtrigger reset <poller> --to-cursor {}`",
                        names.name(from.file),
                        from.offset,
                        there.map(|pos| pos.to_string()).unwrap_or_else(|| "not known (not the start of an event)".into()),
                        mark.before,
                        mark.before
                    ),
                ));
            }
        }
        let strict = match &mark {
            Some(_) => server::gtid_strict_mode(&mut conn).await.map_err(|error| self.error(error))?,
            None => false,
        };
        let info = server::table_info(&mut conn, &self.tables).await.map_err(|error| self.error(error))?;
        // `status` reads beside a tick: a replica id of its own, or the server would drop the tick's.
        let server_id = binlog::reader_id(self.server_id, reader);
        let stream = server::dump(conn, server_id, &names, from).await.map_err(|error| self.error(error))?;
        let key = after.map(|at| at.key);
        let mut decoder = Decoder::new(&self.tables, info, key);
        decoder.counting(reader == Reader::Count);
        let expect = mark.as_ref().and_then(|mark| mark.tx);
        if let Some(mark) = mark {
            // Transactions the checkpoint's GTID position holds are left out only where the server
            // guarantees sequence numbers grow in a domain; elsewhere such a transaction might be
            // a new one numbered lower, and is delivered (at least once, never skipped). With one
            // domain none is ever left out: a read by position after the checkpoint meets none
            // delivered, and strict mode as set now says nothing of how the log was written.
            let covers = if strict && mark.before.domains() > 1 { Some(mark.clone()) } else { None };
            decoder.track_gtids(mark.before.clone(), covers, expect);
        }
        Ok(Open { stream, decoder, at: key, pending: VecDeque::new(), from: (names.name(from.file), from, expect) })
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
            let event = match event {
                Ok(event) => event,
                // The server refuses to read from the checkpoint's place before its transaction
                // (ER_MASTER_FATAL_ERROR_READING_BINLOG: not the start of an event, in a log reset
                // or replaced under it): the same stop as a transaction found there that is not it.
                Err(mysql_async::Error::Server(error)) if error.code == 1236 && open.decoder.expecting() => {
                    let (file, from, _) = &open.from;
                    return Err(self.lost(
                        file.clone(),
                        format!(
                            "the server cannot read its binary log from the checkpoint's place ({file}:{}): {}; the log \
                             was reset or replaced under the checkpoint. If the server's GTID state was carried over, \
                             `dbtrigger reset <poller> --to-cursor` the checkpoint's GTID position (its `gtid_pos`)",
                            from.offset,
                            self.redaction.scrub(&error.message)
                        ),
                    ));
                }
                Err(error) => return Err(self.error(error)),
            };
            let Open { stream, decoder, pending, .. } = open;
            let step = decoder
                .push(&event, |id| stream.get_tme(id))
                .map_err(|reason| self.query(format!("binary log at {}: {reason}", decoder.position().offset)))?;
            if let Step::Foreign(found) = step {
                let (file, from, expected) = &open.from;
                return Err(self.lost(
                    file.clone(),
                    format!(
                        "the transaction at {file}:{} is {}, not the checkpoint's {}: the binary log was reset or replaced \
                         under the checkpoint. If the server's GTID state was carried over, `dbtrigger reset <poller> \
                         --to-cursor` the checkpoint's GTID position (its `gtid_pos`)",
                        from.offset,
                        found.map(|gtid| gtid.to_string()).unwrap_or_else(|| "not a transaction's start".into()),
                        expected.map(|gtid| gtid.to_string()).unwrap_or_default(),
                    ),
                ));
            }
            match step {
                Step::Changes(changes) => {
                    let fields = decoder.fields().ok_or_else(|| self.query("a change outside a transaction".into()))?;
                    pending.extend(rows_of(fields, changes, keys));
                }
                Step::Ended(changes) => {
                    let fields =
                        decoder.last_committed().ok_or_else(|| self.query("a change outside a transaction".into()))?;
                    pending.extend(rows_of(fields, changes, keys));
                }
                _ => {}
            }
        }
    }

    async fn deliver(&self, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let at = self.key(after)?;
        let after = at.as_ref().map(|at| at.key);
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
            self.row_format(&mut conn).await?;
            let (end, names, ..) = self.ends(&mut conn).await?;
            let (_, mariadb) = server::identity(&mut conn).await.map_err(|error| self.error(error))?;
            // MariaDB: the GTID position there, which the next reads check and a failover resumes from.
            let mark = if mariadb {
                let before = server::gtid_pos_at(&mut conn, &names, end).await.map_err(|error| self.error(error))?;
                let before = before.ok_or_else(|| {
                    self.query(format!(
                        "BINLOG_GTID_POS({}, {}) is not known: the log moved, try again",
                        names.name(end.file),
                        end.offset
                    ))
                })?;
                Some(GtidMark { tx: None, before })
            } else {
                None
            };
            let _ = conn.disconnect().await;
            reading.rest = Some((None, (end, 0), position_marked((end, 0), mark.as_ref())));
            return Ok(Fetched { rows: Vec::new(), full: false });
        }
        if reading.open.is_none() {
            reading.open = Some(self.start(at.as_ref(), Reader::Tick).await?);
        }
        let mut rows = Vec::new();
        let mut bytes = 0usize;
        loop {
            let Reading { open, keys, .. } = &mut *reading;
            let open = open.as_mut().expect("a dump is open");
            let next = match self.next(open, keys).await {
                Ok(next) => next,
                // What was read before the error (a change logged as a statement, say) is
                // delivered first; the next call reads from after it, and meets the error again.
                Err(_) if !rows.is_empty() => {
                    reading.open = None;
                    return Ok(Fetched { rows, full: true });
                }
                Err(error) => return Err(error),
            };
            let Some((key, row)) = next else {
                let end = open.decoder.position();
                let in_transaction = open.decoder.in_transaction();
                // MariaDB: rest at the start of the last transaction read (none of it is this
                // poller's), which names the place by its GTID; elsewhere at the end of the read.
                let rest = match (open.decoder.gtid_pos(), open.decoder.last_committed()) {
                    (None, _) => Some(((end, 0), position((end, 0)))),
                    (Some(_), Some(TransactionFields { start, mariadb: Some((tx, before)), .. })) => {
                        let mark = GtidMark { tx: Some(*tx), before: before.clone() };
                        Some(((*start, 0), position_marked((*start, 0), Some(&mark))))
                    }
                    (Some(_), _) => None,
                };
                reading.open = None;
                if rows.is_empty()
                    && !in_transaction
                    && let Some((key, rest)) = rest
                {
                    reading.rest = Some((after, key, rest));
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
        after: Option<&At>,
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

impl BinlogSource {
    /// [`Source::rebase`]: the server read now, against the one recorded and the checkpoint
    /// ([`binlog::judge`]).
    async fn rebased(
        &self,
        conn: &mut Conn,
        at: Option<At>,
        recorded: Option<&str>,
    ) -> Result<Option<Rebase>, SourceError> {
        let (identity, mariadb) = server::identity(conn).await.map_err(|error| self.error(error))?;
        if let Ok(mut judged_on) = self.judged_on.lock() {
            *judged_on = Some(identity.clone());
        }
        let server = Value::from(identity.clone());
        let record = (recorded != Some(identity.as_str())).then(|| Rebase {
            checkpoint: None,
            server: server.clone(),
            what: None,
        });
        let Some(at) = at else { return Ok(record) };
        let (end, names, oldest, _) = self.ends(conn).await?;
        if mariadb
            && at.mark.is_none()
            && recorded.is_none_or(|recorded| recorded == identity)
            && at.key.0.file >= oldest
        {
            // A checkpoint by file position only (an earlier build's, or `reset` to a position):
            // the GTID position there completes it.
            let before = server::gtid_pos_at(conn, &names, at.key.0).await.map_err(|error| self.error(error))?;
            let before = before.ok_or_else(|| {
                self.query(format!(
                    "{}:{} is not the start of an event in the binary log: reset the poller to a transaction's start",
                    names.name(at.key.0.file),
                    at.key.0.offset
                ))
            })?;
            let mark = GtidMark { tx: None, before };
            return Ok(Some(Rebase { checkpoint: Some(position_marked(at.key, Some(&mark))), server, what: None }));
        }
        let server_pos = if mariadb {
            server::gtid_binlog_pos(conn)
                .await
                .map_err(|error| self.error(error))?
                .map_err(|reason| self.query(reason))?
        } else {
            GtidPos::default()
        };
        let sight = binlog::Sight {
            recorded,
            current: &identity,
            at: at.key.0,
            ordinal: at.key.1,
            mark: at.mark.as_ref(),
            server_pos: &server_pos,
            oldest_kept: oldest,
            end,
        };
        let mark = match binlog::judge(&sight, &names) {
            Resume::ByPosition => return Ok(record),
            Resume::Lost { reason } => return Err(self.lost(names.name(at.key.0.file), reason)),
            Resume::ByGtid => at.mark.clone().unwrap_or_default(),
        };
        // Another server, or a checkpoint placed by GTID: a dump by GTID from the checkpoint's
        // GTID position, to its first transaction.
        let other = self.connect().await?;
        // The server's refusal to send from there (ER_MASTER_FATAL_ERROR_READING_BINLOG: purged, or
        // a GTID it never logged) is a loss; anything else (the network) fails the tick only.
        let refused = |error: mysql_async::Error| match error {
            mysql_async::Error::Server(server) if server.code == 1236 => self.lost(
                format!("at GTID position {}", mark.before),
                format!(
                    "this server cannot send its binary log from the checkpoint's GTID position: {}",
                    self.redaction.scrub(&server.message)
                ),
            ),
            other => self.error(other),
        };
        let mut stream = server::dump_by_gtid(other, self.server_id, &mark.before).await.map_err(refused)?;
        let mut decoder = Decoder::new(&self.tables, Default::default(), None);
        decoder.track_gtids(mark.before.clone(), Some(mark.clone()), None);
        let mut first = None;
        while let Some(event) = stream.next().await {
            let event = event.map_err(refused)?;
            let _ = decoder.push(&event, |id| stream.get_tme(id)).map_err(|reason| self.query(reason))?;
            if let Some(fields) = decoder.fields()
                && let Some((tx, before)) = &fields.mariadb
            {
                first = Some((fields.start, *tx, before.clone()));
                break;
            }
        }
        drop(stream);
        if let Some(through) = binlog::probe_through(&mark, at.key.1, first.as_ref().map(|(_, tx, _)| *tx)) {
            // Some of the checkpoint's transaction was delivered, and it was not sent first: does
            // this server hold it at all? A dump from the position through it is refused if not.
            let diverged = |error: mysql_async::Error| {
                match error {
                mysql_async::Error::Server(server) if server.code == 1236 => self.lost(
                    format!("at GTID position {}", mark.before),
                    format!(
                        "this server's binary log does not hold {}, which the poller delivered (all or part of it) from \
                         the server the checkpoint was read on: the two histories diverged ({}). Decide what to do with \
                         it, then `dbtrigger reset <poller> --to-cursor <GTID position>` or `--to-end`",
                        mark.tx.map(|tx| tx.to_string()).unwrap_or_default(),
                        self.redaction.scrub(&server.message)
                    ),
                ),
                other => self.error(other),
            }
            };
            let conn = self.connect().await?;
            let mut probe = server::dump_by_gtid(conn, self.server_id, &through).await.map_err(diverged)?;
            if let Some(event) = probe.next().await {
                event.map_err(diverged)?;
            }
        }
        let old = format!("{}:{}", names.name(at.key.0.file), at.key.0.offset);
        let (key, next) = match first {
            Some((start, tx, before)) => {
                let ordinal = binlog::rebased_ordinal(&mark, at.key.1, Some(tx));
                ((start, ordinal), GtidMark { tx: Some(tx), before })
            }
            None => ((end, 0), GtidMark { tx: None, before: mark.before.clone() }),
        };
        let what = format!(
            "re-based by GTID: the checkpoint (GTID position {}, {}, ordinal {}) read on {} is {}:{} (ordinal {}) on {}",
            mark.before,
            mark.tx.map(|tx| format!("transaction {tx}")).unwrap_or_else(|| "no transaction".into()),
            at.key.1,
            recorded
                .map(|recorded| format!("{recorded} at {old}"))
                .unwrap_or_else(|| format!("an unknown server at {old}")),
            names.name(key.0.file),
            key.0.offset,
            key.1,
            identity
        );
        Ok(Some(Rebase { checkpoint: Some(position_marked(key, Some(&next))), server, what: Some(what) }))
    }
}

/// The rows a read hands out for changes of the open transaction (`fields`), with their order
/// groups (`keys`: the tables' primary keys seen so far). The bench's raw path shares it.
pub fn rows_of(
    fields: &TransactionFields,
    changes: Vec<Change>,
    keys: &mut HashMap<String, Option<std::sync::Arc<[String]>>>,
) -> impl Iterator<Item = (Key, SourceRow)> {
    let head = fields_json(fields);
    // The transaction's GTID texts are formatted once, not once per change.
    let mark =
        fields.mariadb.as_ref().map(|(tx, before)| mark_texts(&GtidMark { tx: Some(*tx), before: before.clone() }));
    changes.into_iter().map(move |change| {
        let key = change.at;
        let group = order_group(&change, keys);
        (key, row_of(&head, change, mark.as_ref(), group))
    })
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

fn row_of(head: &Map<String, Value>, change: Change, mark: Option<&(String, String)>, group: Group) -> SourceRow {
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
    SourceRow {
        position: position_texts(change.at, mark),
        row: RowJson::from_map(&row),
        op: change.op,
        group: Some(group),
    }
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
                    let (rows, _, full) = self.look(after.as_ref(), limit.rows as u64, false).await?;
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
        let count = async { Ok(self.look(after.as_ref(), cap, true).await?.1) };
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
        let key = self.key(checkpoint)?.map(|at| at.key);
        let reading = self.reading.lock().await;
        Ok(match &reading.rest {
            Some((asked, rest, position)) if *asked == key && key.is_none_or(|key| *rest > key) => {
                Some(position.clone())
            }
            _ => None,
        })
    }

    async fn rebase(
        &self,
        checkpoint: Option<&Position>,
        server: Option<&Value>,
    ) -> Result<Option<Rebase>, SourceError> {
        let at = self.key(checkpoint)?;
        let recorded = server.and_then(Value::as_str);
        let timed_rebase = async {
            let mut conn = self.connect().await?;
            let result = self.rebased(&mut conn, at, recorded).await;
            let _ = conn.disconnect().await;
            result
        };
        timed(&crate::source::pools::Gate::open(), &self.config, &self.redaction.location, timed_rebase).await
    }

    /// The retention behind the checkpoint last asked from: bytes and files to the end, as a
    /// slot's view (`lost` when its file was purged).
    async fn slot(&self) -> Result<Option<crate::domain::slot::SlotView>, SourceError> {
        let known = *self.known.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // A checkpoint placed by GTID has no file yet (the next tick finds it): nothing to judge.
        let Some((at, _)) = known.filter(|(at, _)| *at != binlog::BY_GTID_ONLY) else { return Ok(None) };
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

    /// A GTID position (`reset --to-cursor 0-1-1234`): within what the server has logged, and a
    /// dump from it not refused (the server no longer keeps, or never had, what follows it).
    async fn refuses_reset_to(&self, to: &Position) -> Result<Option<String>, SourceError> {
        let Ok(at) = at_of(to) else { return Ok(None) };
        let Some(mark) = at.mark.filter(|mark| at.key.0 == binlog::BY_GTID_ONLY && mark.tx.is_none()) else {
            return Ok(None);
        };
        let mut conn = self.connect().await?;
        let (_, mariadb) = server::identity(&mut conn).await.map_err(|error| self.error(error))?;
        if !mariadb {
            let _ = conn.disconnect().await;
            return Ok(Some(
                "this server is MySQL, whose GTIDs a checkpoint does not record: give a file position \
                 (binlog.000042:1234) with --pk ordinal=N"
                    .into(),
            ));
        }
        let logged = server::gtid_binlog_pos(&mut conn)
            .await
            .map_err(|error| self.error(error))?
            .map_err(|reason| self.query(reason))?;
        if let Some(reason) = mark.before.beyond(&logged) {
            let _ = conn.disconnect().await;
            return Ok(Some(reason));
        }
        let server_id = binlog::reader_id(self.server_id, Reader::Look);
        let mut stream =
            server::dump_by_gtid(conn, server_id, &mark.before).await.map_err(|error| self.error(error))?;
        match stream.next().await {
            Some(Err(mysql_async::Error::Server(error))) if error.code == 1236 => Ok(Some(format!(
                "the server cannot read its binary log from there: {}",
                self.redaction.scrub(&error.message)
            ))),
            Some(Err(error)) => Err(self.error(error)),
            _ => Ok(None),
        }
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
