//! The logical [`Source`]: peeks the slot through the SQL interface
//! (`pg_logical_slot_peek_binary_changes`, pgoutput version 1, the text form of values), reads
//! the result as a stream and hands its changes out in commit order as they come, and moves the
//! slot (`pg_replication_slot_advance`) only as far as the state document has committed.
//!
//! A peek runs in a task of its own on a connection of its own (kept from one peek to the next),
//! and sends each change through a bounded channel as its message arrives, in chunks (one
//! hand-off between the tasks for many changes; a chunk leaves as soon as the socket holds no
//! more): pgoutput's Begin carries the transaction's commit LSN,
//! so a change's position (commit LSN, ordinal) is known before its Commit, and a transaction of
//! any size goes through in bounded memory (the channel, a batch, the driver's buffer). While the
//! tick delivers, the task waits on the channel and the server on the socket. A peek starts
//! where the slot is: what the checkpoint already covers is counted by tag and skipped.

use crate::domain::keyed::Group;
use std::collections::VecDeque;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use futures::{FutureExt, TryStreamExt};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::{Connection, Row};
use tokio::sync::{Mutex, mpsc};

use super::changes::{Decoder, Step, event_row_of};
use super::progress::{Key, Mark, Progress, ReadToEnd, key_of, position};
use super::values::{lsn_text, parse_lsn};
use crate::config::redact::Redaction;
use crate::config::{Origin, SourceConfig, SourceTarget};
use crate::domain::Position;
use crate::domain::event::RowJson;
use crate::source::{FetchLimit, Fetched, Probe, Source, SourceError, SourceRow, classify, timed};

/// A tick's peek asks the server for this many batches' worth of rows past what was read before,
/// at least [`MIN_READ_AHEAD_ROWS`] and at most [`MAX_READ_AHEAD_ROWS`] (the server checks the
/// limit at a commit only: the transaction that crosses it comes whole, streamed). The server
/// decodes the whole window before the first row comes; a smaller window answers sooner.
const READ_AHEAD_BATCHES: usize = 256;
const MIN_READ_AHEAD_ROWS: usize = 1024;
const MAX_READ_AHEAD_ROWS: usize = 262_144;
/// Kept for the benches and docs: what a peek's channel holds at most, in changes.
pub const READ_AHEAD_BYTES: usize = 16 * 1024 * 1024;
/// The changes (and transaction ends) a peek's task sends ahead of the tick, at most, in chunks of
/// at most [`CHUNK_ITEMS`].
const CHANNEL_ITEMS: usize = 512;
const CHUNK_ITEMS: usize = 64;
/// The most a counting peek counts: the changes after a position, counted by tag (no decoding).
pub const COUNT_CAP: u64 = 100_000;

/// The rows of pgoutput a tick's peek reads ahead, for batches of `batch_rows` changes.
pub fn read_ahead_rows(batch_rows: usize) -> usize {
    batch_rows.saturating_mul(READ_AHEAD_BATCHES).clamp(MIN_READ_AHEAD_ROWS, MAX_READ_AHEAD_ROWS)
}

/// What a peek's task needs, shared with it.
struct Shared {
    pool: PgPool,
    /// A peek's own connection: no statement timeout (the tick's budget and the idle limit bound
    /// it), the text forms `values` reads.
    peek_options: PgConnectOptions,
    slot: String,
    publication: String,
    /// `none`: the peek asks pgoutput for the changes without a replication origin only.
    origin: Origin,
    redaction: Redaction,
    /// A peek's task gives up when the tick has not taken anything from it for this long.
    idle: Duration,
    /// The connection of the last peek read to its end, kept for the next one: a peek on it
    /// needs no new backend (a fork, an authentication, cold catalog caches), as a poller's pool
    /// keeps its connections. A peek given up or failed closes its connection instead.
    kept: std::sync::Mutex<Option<PgConnection>>,
}

pub struct LogicalSource {
    shared: Arc<Shared>,
    config: SourceConfig,
    reading: Mutex<Reading>,
    /// The checkpoint last committed, as told: a commit never waits for a read in progress (the
    /// tick commits on the task that reads), the read takes it in when it next holds `reading`.
    committed: std::sync::Mutex<Option<Option<Key>>>,
    /// This process holds the poller's lease (the tick says so, [`Source::fence`]): the slot moves
    /// only while it does.
    fenced: AtomicBool,
}

/// Where this process is in the slot.
struct Reading {
    progress: Progress,
    /// The peek being read, if one is open.
    stream: Option<Stream>,
    /// The last peek stopped at its row limit: more may follow.
    more: bool,
    /// How many times the usual window the next peek asks for (peeks that brought nothing new
    /// widen it).
    widen: usize,
}

impl Default for Reading {
    fn default() -> Self {
        Reading { progress: Progress::default(), stream: None, more: true, widen: 1 }
    }
}

/// What a peek's task sends.
enum Item {
    Row(Key, SourceRow),
    /// A transaction read to its Commit.
    Mark(Mark),
    /// The peek ended: whether it read to the flushed end, and how many changes after the
    /// position asked from it sent.
    End {
        reached_end: Option<ReadToEnd>,
        new: usize,
    },
}

/// A peek being read.
struct Stream {
    items: mpsc::Receiver<Result<Vec<Item>, SourceError>>,
    /// The rest of the chunk received last (first, a change that did not fit the last batch).
    pending: VecDeque<Item>,
    task: tokio::task::JoinHandle<()>,
    /// The peek's backend, once known: cancelled when the peek is given up before its end.
    backend: Arc<AtomicI32>,
    pool: PgPool,
    /// The last change handed out (the position the peek was asked from, before the first).
    at: Option<Key>,
}

impl Stream {
    /// The peek's next item, in order; `None` when its task ended without one.
    async fn next(&mut self) -> Option<Result<Item, SourceError>> {
        loop {
            if let Some(item) = self.pending.pop_front() {
                return Some(Ok(item));
            }
            match self.items.recv().await? {
                Ok(chunk) => self.pending.extend(chunk),
                Err(error) => return Some(Err(error)),
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.task.is_finished() {
            return;
        }
        self.task.abort();
        // The server may still be decoding (it notices a closed socket only when it writes):
        // cancel the statement, so that the slot is free for the next peek at once.
        let backend = self.backend.load(Ordering::Relaxed);
        if backend > 0
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let pool = self.pool.clone();
            runtime.spawn(async move {
                let _ = sqlx::query("SELECT pg_cancel_backend($1)").bind(backend).execute(&pool).await;
            });
        }
    }
}

/// What a peek's task sends the tick, a chunk at a time: one hand-off between the tasks (a
/// wake-up of the other) for up to [`CHUNK_ITEMS`] changes instead of one a change.
struct Outbox<'a> {
    items: &'a mpsc::Sender<Result<Vec<Item>, SourceError>>,
    /// Gives up when the tick has not taken a chunk for this long.
    idle: Duration,
    chunk: Vec<Item>,
}

impl Outbox<'_> {
    async fn push(&mut self, item: Item) -> Result<(), Stop> {
        self.chunk.push(item);
        if self.chunk.len() >= CHUNK_ITEMS {
            self.flush().await?;
        }
        Ok(())
    }

    /// Sends what the chunk holds, if anything.
    async fn flush(&mut self) -> Result<(), Stop> {
        if self.chunk.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.chunk, Vec::with_capacity(CHUNK_ITEMS));
        match tokio::time::timeout(self.idle, self.items.send(Ok(chunk))).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(Stop::GivenUp),
        }
    }
}

/// What a peek reads for: delivery or a count (`counting`: by tag, nothing decoded), and from the
/// slot (a tick's delivery) or from a temporary copy of it (`on_copy`: a look).
#[derive(Clone, Copy)]
struct Read {
    counting: bool,
    on_copy: bool,
}

/// Why a peek's task stopped before its end.
enum Stop {
    /// The tick gave it up (dropped it, or took nothing for the idle limit).
    GivenUp,
    Failed(SourceError),
}

impl From<SourceError> for Stop {
    fn from(error: SourceError) -> Self {
        Stop::Failed(error)
    }
}

impl Shared {
    fn query_error(&self, error: sqlx::Error) -> SourceError {
        let classified = classify(&self.redaction, error);
        match classified {
            SourceError::Query { location, reason } if reason.contains("is active for PID") => {
                SourceError::SlotInUse { location, slot: self.slot.clone(), reason }
            }
            SourceError::Query { location, reason } if reason.contains("does not exist") => SourceError::Query {
                location,
                reason: format!("{reason}: create the slot and the publication first (`dbtrigger sql` prints how)"),
            },
            other => other,
        }
    }

    /// A temporary copy of the slot, at its position, made on `connection` (dropped with the
    /// session): a look reads it, never the slot itself, so it cannot meet a tick's read ("active
    /// for PID") nor hold the slot against one. Copying reads the slot's positions without taking
    /// it, and builds no snapshot. With no free slot on the server (`max_replication_slots`) the
    /// look reads the slot itself, as it did before copies.
    async fn copy_of_slot(&self, connection: &mut PgConnection, pid: i32) -> Result<String, SourceError> {
        let copy = format!("dbtrigger_look_{pid}");
        match sqlx::query("SELECT pg_copy_logical_replication_slot($1, $2, true)")
            .bind(&self.slot)
            .bind(&copy)
            .execute(&mut *connection)
            .await
        {
            Ok(_) => Ok(copy),
            // No free slot place (53400), or no copy function (42883: PostgreSQL 11).
            Err(sqlx::Error::Database(error)) if matches!(error.code().as_deref(), Some("53400" | "42883")) => {
                Ok(self.slot.clone())
            }
            Err(error) => Err(self.query_error(error)),
        }
    }

    fn malformed(&self, reason: String) -> SourceError {
        SourceError::Query {
            location: self.redaction.location.clone(),
            reason: format!("slot {:?}: {reason}", self.slot),
        }
    }

    /// One peek of at most `limit_rows` rows, from where the slot is: the changes after `after`
    /// are decoded and sent as they come (each transaction's end too), or only counted when
    /// `counting`.
    async fn peek(
        &self,
        after: Option<Key>,
        limit_rows: usize,
        read: Read,
        items: &mpsc::Sender<Result<Vec<Item>, SourceError>>,
        backend: &AtomicI32,
    ) -> Result<(), Stop> {
        let mut outbox = Outbox { items, idle: self.idle, chunk: Vec::with_capacity(CHUNK_ITEMS) };
        let result = self.read(after, limit_rows, read, &mut outbox, backend).await;
        if let Err(Stop::Failed(_)) = &result {
            // What was read before the failure goes first, as it came.
            outbox.flush().await?;
        }
        result
    }

    /// [`Shared::peek`]'s work: the rows read, decoded and put in `outbox`.
    async fn read(
        &self,
        after: Option<Key>,
        limit_rows: usize,
        read: Read,
        outbox: &mut Outbox<'_>,
        backend: &AtomicI32,
    ) -> Result<(), Stop> {
        let (mut connection, (pid, flushed, version)) = self.session().await?;
        backend.store(pid, Ordering::Relaxed);
        let flushed = parse_lsn(&flushed).ok_or_else(|| self.malformed(format!("a WAL position {flushed:?}")))?;
        if let Some(refusal) = origin_refusal(self.origin, version) {
            return Err(Stop::Failed(self.malformed(refusal)));
        }
        let slot = if read.on_copy { self.copy_of_slot(&mut connection, pid).await? } else { self.slot.clone() };
        let counting = read.counting;
        let limit_rows = limit_rows.min(i32::MAX as usize);
        let peek = match self.origin {
            Origin::Any => PEEK,
            Origin::None => PEEK_WITHOUT_ORIGIN,
        };
        let mut rows = sqlx::query(peek)
            .bind(&slot)
            .bind(lsn_text(flushed))
            .bind(limit_rows as i32)
            .bind(format!("\"{}\"", self.publication))
            .fetch(&mut connection);
        let mut decoder = if counting { Decoder::counting() } else { Decoder::after(after) };
        let mut fields = None;
        let (mut returned, mut rows_of_transaction, mut new, mut last) = (0usize, 0u32, 0usize, None);
        let mut capped = false;
        loop {
            // What the socket holds already is read on; when it holds nothing more, the changes
            // made so far go to the tick before waiting on the server.
            let next = match rows.try_next().now_or_never() {
                Some(next) => next,
                None => {
                    outbox.flush().await?;
                    rows.try_next().await
                }
            };
            let Some(row) = next.map_err(|error| self.query_error(error))? else {
                break;
            };
            returned += 1;
            rows_of_transaction += 1;
            let lsn: String = row.try_get(0).map_err(|error| self.query_error(error))?;
            let lsn = parse_lsn(&lsn).ok_or_else(|| self.malformed(format!("a WAL position {lsn:?}")))?;
            let data: &[u8] = row.try_get(1).map_err(|error| self.query_error(error))?;
            let step = decoder.push(lsn, data).map_err(|error| self.malformed(self.at_change(&decoder, error)))?;
            match step {
                Step::Nothing if data.first() == Some(&b'B') && !counting => fields = decoder.commit_fields(),
                Step::Nothing => {}
                Step::Changes(changes) => {
                    let (Some(fields), Some((commit_lsn, _))) = (fields.as_ref(), decoder.next_change()) else {
                        continue;
                    };
                    for change in changes {
                        let key = (commit_lsn, change.ordinal);
                        let op = change.op;
                        let group = order_group(&change);
                        let row = SourceRow {
                            position: position(key.0, key.1),
                            row: RowJson::from_map(&event_row_of(fields, change)),
                            op,
                            group: Some(group),
                        };
                        new += 1;
                        outbox.push(Item::Row(key, row)).await?;
                    }
                }
                Step::Committed { commit_lsn, end_lsn, changes, .. } => {
                    if counting {
                        new += new_changes(commit_lsn, changes, after);
                    }
                    if changes > 0 {
                        last = Some((commit_lsn, changes));
                    }
                    let rows = std::mem::take(&mut rows_of_transaction);
                    outbox.push(Item::Mark(Mark { commit_lsn, end_lsn, changes, rows })).await?;
                    if counting && new as u64 >= COUNT_CAP {
                        capped = true;
                        break;
                    }
                }
            }
        }
        // Read to its end (a count that stopped at its cap has rows left on the socket): the
        // connection is idle and kept for the next peek. Nothing to cancel from here on, so that
        // a stream dropped now (the tick took the end) cancels nothing on the kept backend.
        // A look's temporary copy of the slot is dropped first: it would hold WAL for as long as
        // the session lives (a connection whose copy cannot be dropped is closed, which drops it).
        drop(rows);
        backend.store(0, Ordering::Relaxed);
        let reusable = !capped
            && (slot == self.slot
                || sqlx::query("SELECT pg_drop_replication_slot($1)")
                    .bind(&slot)
                    .execute(&mut connection)
                    .await
                    .is_ok());
        if reusable {
            *self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(connection);
        } else {
            let _ = connection.close().await;
        }
        let reached_end = returned < limit_rows && !decoder.in_transaction();
        outbox.push(Item::End { reached_end: reached_end.then_some(ReadToEnd { flushed, last }), new }).await?;
        outbox.flush().await
    }

    /// A connection for a peek, with its backend's pid, the end of the flushed WAL and the
    /// server's version: the one kept from the last peek if it still answers, else a new one.
    async fn session(&self) -> Result<(PgConnection, (i32, String, i32)), SourceError> {
        let kept = self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some(mut connection) = kept {
            // A kept connection that no longer answers (the server restarted, a proxy's idle
            // limit) is replaced.
            if let Ok(answer) = ask(&mut connection).await {
                return Ok((connection, answer));
            }
        }
        let mut connection =
            PgConnection::connect_with(&self.peek_options).await.map_err(|error| self.query_error(error))?;
        let answer = ask(&mut connection).await.map_err(|error| self.query_error(error))?;
        Ok((connection, answer))
    }

    /// A decoding failure, named by the position of the change it stopped at, as `reset` takes it.
    fn at_change(&self, decoder: &Decoder, error: super::changes::AssembleError) -> String {
        match decoder.next_change() {
            Some((commit_lsn, ordinal)) => format!(
                "{error}, in the transaction committing at {} (the change after cursor {commit_lsn}, ordinal {}): \
                 to skip it, `dbtrigger reset <poller> --to-cursor {commit_lsn} --pk ordinal={ordinal}`",
                lsn_text(commit_lsn),
                ordinal.saturating_sub(1)
            ),
            None => error.to_string(),
        }
    }
}

/// A peek's backend's pid, the end of the flushed WAL, and the server's `server_version_num`.
async fn ask(connection: &mut PgConnection) -> Result<(i32, String, i32), sqlx::Error> {
    sqlx::query_as(
        "SELECT pg_backend_pid(), pg_current_wal_flush_lsn()::text, current_setting('server_version_num')::int",
    )
    .fetch_one(connection)
    .await
}

/// A peek: pgoutput version 1 (the text form of values) of the publication, from where the slot
/// is to the flushed end (`$2`), at most `$3` rows.
const PEEK: &str = "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes($1, $2::pg_lsn, $3, \
                    'proto_version', '1', 'publication_names', $4)";
/// [`PEEK`] of the changes made without a replication origin only (`source.origin: "none"`).
const PEEK_WITHOUT_ORIGIN: &str = "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes($1, $2::pg_lsn, \
                                   $3, 'proto_version', '1', 'publication_names', $4, 'origin', 'none')";

/// Why `origin` cannot be read from a server of `server_version_num` `version`, if it cannot:
/// pgoutput has its `origin` option from PostgreSQL 16 on (15 refuses it as unknown).
pub fn origin_refusal(origin: Origin, version: i32) -> Option<String> {
    if origin == Origin::Any || version >= 160_000 {
        return None;
    }
    Some(format!(
        "source.origin \"none\" needs PostgreSQL 16 or later (pgoutput's origin option), and this server is \
         PostgreSQL {} (server_version_num {version}): leave source.origin out (every change is read, whatever its \
         origin) or upgrade the server",
        version / 10_000
    ))
}

/// How many of a transaction's `changes` come after `after`.
fn new_changes(commit_lsn: u64, changes: u32, after: Option<Key>) -> usize {
    match after {
        Some((at, _)) if commit_lsn < at => 0,
        Some((at, ordinal)) if commit_lsn == at => changes.saturating_sub(ordinal) as usize,
        _ => changes as usize,
    }
}

impl LogicalSource {
    pub fn open(config: &SourceConfig) -> Result<Self, SourceError> {
        let SourceTarget::Logical { slot, publication, origin } = &config.target else {
            return Err(SourceError::Query { location: String::new(), reason: "not a logical source".into() });
        };
        let redaction = Redaction::of_url(config.url.expose());
        let options = PgConnectOptions::from_str(config.url.expose()).map_err(|error| SourceError::Unreachable {
            location: redaction.location.clone(),
            reason: redaction.scrub(&error.to_string()),
        })?;
        let text_forms = |timeout: String| {
            options.clone().application_name("dbtrigger").options([
                ("statement_timeout", timeout),
                // The text forms `values` reads.
                ("DateStyle", "ISO, MDY".to_string()),
                ("TimeZone", "UTC".to_string()),
                ("IntervalStyle", "postgres".to_string()),
                ("extra_float_digits", "3".to_string()),
                ("bytea_output", "hex".to_string()),
            ])
        };
        let pool = crate::source::pool_options()
            .connect_lazy_with(text_forms(format!("{}ms", config.query_timeout.as_millis())));
        let shared = Shared {
            pool,
            peek_options: text_forms("0".to_string()),
            slot: slot.clone(),
            publication: publication.clone(),
            origin: *origin,
            redaction,
            idle: config.query_timeout.max(Duration::from_secs(1)),
            kept: std::sync::Mutex::new(None),
        };
        Ok(LogicalSource {
            shared: Arc::new(shared),
            config: config.clone(),
            reading: Mutex::new(Reading::default()),
            committed: std::sync::Mutex::new(None),
            fenced: AtomicBool::new(false),
        })
    }

    fn query_error(&self, error: sqlx::Error) -> SourceError {
        self.shared.query_error(error)
    }

    /// Starts a peek after `after` of at most `limit_rows` rows.
    fn start(&self, after: Option<Key>, limit_rows: usize, read: Read) -> Stream {
        let (sender, items) = mpsc::channel(CHANNEL_ITEMS / CHUNK_ITEMS);
        let backend = Arc::new(AtomicI32::new(0));
        let (shared, task_backend) = (self.shared.clone(), backend.clone());
        let task = tokio::spawn(async move {
            if let Err(Stop::Failed(error)) = shared.peek(after, limit_rows, read, &sender, &task_backend).await {
                let _ = sender.send(Err(error)).await;
            }
        });
        Stream { items, pending: VecDeque::new(), task, backend, pool: self.shared.pool.clone(), at: after }
    }

    fn malformed(&self, reason: String) -> SourceError {
        self.shared.malformed(reason)
    }

    /// The checkpoint last told as committed, taken into `reading`.
    fn take_committed(&self, reading: &mut Reading) {
        let told = *self.committed.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(key) = told {
            reading.progress.committed(key);
        }
    }

    /// Moves the slot as far as the committed checkpoint allows, if further than it is. Only
    /// while this process holds the lease (a move by a process that lost it, or before it took
    /// it, could pass what an operator's reset has just asked to deliver again, and meets the
    /// holder's peek on the slot); never while a peek of this process is open (the slot has one
    /// user at a time): the next peek, or the end of the tick, moves it.
    async fn advance(&self, reading: &mut Reading) -> Result<(), SourceError> {
        self.take_committed(reading);
        if reading.stream.is_some() || !self.fenced.load(Ordering::SeqCst) {
            return Ok(());
        }
        let Some(target) = reading.progress.advance_target() else {
            return Ok(());
        };
        // Never backwards: a slot already past the target (moved by an earlier process) stays.
        super::operate::advance_to(&self.shared.pool, &self.shared.slot, target)
            .await
            .map_err(|error| self.query_error(error))?;
        reading.progress.advanced(target);
        tracing::debug!(slot = %self.shared.slot, to = %lsn_text(target), "replication slot advanced");
        Ok(())
    }

    fn after_key(&self, after: Option<&Position>) -> Result<Option<Key>, SourceError> {
        after.map(key_of).transpose().map_err(SourceError::Position)
    }

    async fn deliver(&self, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let after = self.after_key(after)?;
        let mut guard = self.reading.lock().await;
        let reading = &mut *guard;
        if reading.stream.as_ref().is_some_and(|stream| stream.at != after) {
            // Asked from elsewhere (a failed tick starting again from its checkpoint): read again.
            reading.stream = None;
        }
        let mut rows = Vec::new();
        let mut bytes = 0usize;
        loop {
            if reading.stream.is_none() {
                if let Err(error) = self.advance(reading).await {
                    return Err(self.lost_or(error, after.is_some()).await);
                }
                let window = read_ahead_rows(limit.rows).saturating_mul(reading.widen);
                let limit_rows = reading.progress.rows_through(after).saturating_add(window);
                tracing::debug!(slot = %self.shared.slot, ?after, limit_rows, "peek started");
                reading.stream = Some(self.start(after, limit_rows, Read { counting: false, on_copy: false }));
            }
            let stream = reading.stream.as_mut().expect("a peek is open");
            let item = match stream.next().await {
                Some(item) => item,
                None => Err(self.malformed("the peek's task ended before its end".into())),
            };
            match item {
                Ok(Item::Row(key, row)) => {
                    let size = row.row.len() + 128;
                    if !rows.is_empty() && bytes + size > limit.bytes {
                        stream.pending.push_front(Item::Row(key, row));
                        break;
                    }
                    bytes += size;
                    stream.at = Some(key);
                    reading.progress.handed(key);
                    rows.push(row);
                    if rows.len() >= limit.rows.max(1) {
                        break;
                    }
                }
                Ok(Item::Mark(mark)) => reading.progress.read(mark),
                Ok(Item::End { reached_end, new }) => {
                    tracing::debug!(slot = %self.shared.slot, ?reached_end, new, rows = rows.len(), "peek ended");
                    reading.stream = None;
                    reading.more = reached_end.is_none();
                    reading.progress.reached_end(reached_end);
                    // A peek that brought nothing new (all it returned was covered) asks for
                    // more the next time; one that did, for the usual window.
                    reading.widen = if new > 0 { 1 } else { reading.widen.saturating_mul(4).min(1 << 16) };
                    // Never 0 rows while more waits: peek again (the tick's read budget bounds it).
                    if !reading.more || !rows.is_empty() {
                        break;
                    }
                }
                Err(error) => {
                    reading.stream = None;
                    reading.more = true;
                    return Err(self.lost_or(error, after.is_some()).await);
                }
            }
        }
        let full = reading.stream.is_some() || reading.more;
        Ok(Fetched { rows, full })
    }

    /// `error`, or the slot's loss when that is why a read or an advance failed (`used`: the
    /// poller has a checkpoint, so a slot that does not exist was dropped after use).
    async fn lost_or(&self, error: SourceError, used: bool) -> SourceError {
        if !matches!(error, SourceError::Query { .. }) {
            return error;
        }
        match super::operate::slot_row(&self.shared.pool, &self.shared.slot).await {
            Ok(row) => match super::operate::lost_reason(row.as_ref(), used) {
                Some(reason) => SourceError::SlotLost {
                    location: self.shared.redaction.location.clone(),
                    slot: self.shared.slot.clone(),
                    reason,
                },
                None => error,
            },
            Err(_) => error,
        }
    }

    /// A read that changes nothing: the first changes after `after` (Pending), for `status`, or
    /// (`counting`) how many follow it, counted by tag, up to [`COUNT_CAP`]. It reads a temporary
    /// copy of the slot, leaving the slot and any tick's peek on it alone (a tick's count under
    /// its lease, `status` from anywhere).
    async fn look(
        &self,
        after: Option<Key>,
        limit: FetchLimit,
        counting: bool,
    ) -> Result<(Vec<SourceRow>, bool, usize), SourceError> {
        let mut reading = self.reading.lock().await;
        let held = reading.progress.rows_through(after);
        // A change is a row at least, and a transaction two more.
        let wanted = if counting { COUNT_CAP as usize } else { limit.rows.saturating_add(1) };
        let mut stream =
            self.start(after, held.saturating_add(wanted.saturating_mul(3)), Read { counting, on_copy: true });
        let mut rows = Vec::new();
        loop {
            match stream.next().await {
                Some(Ok(Item::Row(_, row))) => {
                    rows.push(row);
                    if rows.len() > limit.rows {
                        return Ok((rows, true, 0));
                    }
                }
                Some(Ok(Item::Mark(mark))) => reading.progress.read(mark),
                Some(Ok(Item::End { reached_end, new })) => return Ok((rows, reached_end.is_none(), new)),
                Some(Err(error)) => return Err(error),
                None => return Err(self.malformed("the peek's task ended before its end".into())),
            }
        }
    }

    /// The end of a tick: the open peek is given up (the slot is free for whoever reads next),
    /// and the slot moves as far as the checkpoint allows.
    async fn finish(&self) -> Result<(), SourceError> {
        let mut reading = self.reading.lock().await;
        reading.stream = None;
        self.advance(&mut reading).await
    }
}

/// A change's keys for per-key order: the table with each of its keys; the table alone when it
/// has no narrower key; every key for a truncate (it waits for all before it).
fn order_group(change: &crate::source::logical::changes::Change) -> Group {
    if change.op == crate::domain::Op::Truncate {
        return Group::All;
    }
    if change.order_keys.is_empty() {
        return Group::one(&[change.table.as_bytes()]);
    }
    Group::Keys(change.order_keys.iter().map(|key| Group::key_of(&[change.table.as_bytes(), key])).collect())
}

#[async_trait]
impl Source for LogicalSource {
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let location = self.shared.redaction.location.clone();
        match probe {
            Probe::Deliver => {
                timed(&crate::source::pools::Gate::open(), &self.config, &location, self.deliver(after, limit)).await
            }
            Probe::Pending => {
                let after = self.after_key(after)?;
                let look = async {
                    let (mut rows, full, _) = self.look(after, limit, false).await?;
                    let full = full || rows.len() > limit.rows;
                    rows.truncate(limit.rows);
                    Ok(Fetched { rows, full })
                };
                timed(&crate::source::pools::Gate::open(), &self.config, &location, look).await
            }
            Probe::Last => Err(SourceError::Query {
                location,
                reason:
                    "a logical source has no last row: `reset --to-end` moves its slot to the end of the WAL instead"
                        .into(),
            }),
        }
    }

    /// Counted by tag, nothing decoded (memory does not grow with the count), up to
    /// [`COUNT_CAP`]: a count that stopped there, or at the peek's window, is that cap (at least).
    async fn count_after(&self, after: Option<&Position>, cap: u64) -> Result<u64, SourceError> {
        let after = self.after_key(after)?;
        let cap = cap.min(COUNT_CAP);
        let count = async {
            let (_, more, new) = self.look(after, FetchLimit { rows: usize::MAX - 1, bytes: usize::MAX }, true).await?;
            Ok(if more { cap.max(new as u64).min(cap) } else { (new as u64).min(cap) })
        };
        timed(&crate::source::pools::Gate::open(), &self.config, &self.shared.redaction.location, count).await
    }

    fn count_limit(&self) -> u64 {
        COUNT_CAP
    }

    fn fence(&self, held: bool) {
        self.fenced.store(held, Ordering::SeqCst);
    }

    fn moves_under_lease(&self) -> bool {
        true
    }

    /// Owed when the committed checkpoint covers WAL the slot has not passed, or a read reached an
    /// end of WAL a segment past it; where the slot stands is read once per process.
    async fn move_owed(&self) -> Result<bool, SourceError> {
        let work = async {
            let mut reading = self.reading.lock().await;
            self.take_committed(&mut reading);
            if !reading.progress.slot_known() {
                let row = super::operate::slot_row(&self.shared.pool, &self.shared.slot)
                    .await
                    .map_err(|error| self.query_error(error))?;
                // No slot, or one with no position: the read says why.
                if let Some(confirmed) = row.and_then(|row| row.confirmed) {
                    reading.progress.advanced(confirmed);
                }
            }
            Ok(reading.progress.owed())
        };
        timed(&crate::source::pools::Gate::open(), &self.config, &self.shared.redaction.location, work).await
    }

    async fn tick_ended(&self) -> Result<(), SourceError> {
        timed(&crate::source::pools::Gate::open(), &self.config, &self.shared.redaction.location, self.finish()).await
    }

    async fn generation(&self) -> Result<Option<Value>, SourceError> {
        Ok(None)
    }

    fn describe(&self) -> String {
        format!("{} (slot {})", self.shared.redaction.location, self.shared.slot)
    }

    async fn slot(&self) -> Result<Option<crate::domain::slot::SlotView>, SourceError> {
        let row: Option<(Option<i64>, Option<String>, Option<i32>)> = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, wal_status, active_pid \
             FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&self.shared.slot)
        .fetch_optional(&self.shared.pool)
        .await
        .map_err(|error| self.query_error(error))?;
        let (retained_bytes, wal_status, active_pid) = row.ok_or_else(|| SourceError::Query {
            location: self.shared.redaction.location.clone(),
            reason: format!(
                "replication slot {:?} does not exist (`dbtrigger sql` prints how to create it)",
                self.shared.slot
            ),
        })?;
        Ok(Some(crate::domain::slot::SlotView {
            slot: self.shared.slot.clone(),
            retained_bytes,
            wal_status,
            active_pid,
        }))
    }

    async fn committed(&self, checkpoint: Option<&Position>) -> Result<(), SourceError> {
        let key = self.after_key(checkpoint)?;
        let work = async {
            {
                let mut told = self.committed.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                if told.is_none_or(|known| known < key) {
                    *told = Some(key);
                }
            }
            // A read in progress holds the slot and `reading`: it moves the slot when it next can.
            let Ok(mut reading) = self.reading.try_lock() else {
                return Ok(());
            };
            match self.advance(&mut reading).await {
                Ok(()) => Ok(()),
                Err(error) => Err(self.lost_or(error, key.is_some()).await),
            }
        };
        timed(&crate::source::pools::Gate::open(), &self.config, &self.shared.redaction.location, work).await
    }

    async fn slot_ends(&self) -> Result<Option<crate::domain::slot::SlotEnds>, SourceError> {
        let row = super::operate::slot_row(&self.shared.pool, &self.shared.slot)
            .await
            .map_err(|error| self.query_error(error))?;
        let Some(row) = row else {
            return Err(self.malformed("it does not exist: create it first (`dbtrigger sql` prints how)".into()));
        };
        if let Some(reason) = super::operate::lost_reason(Some(&row), true) {
            return Err(SourceError::SlotLost {
                location: self.shared.redaction.location.clone(),
                slot: self.shared.slot.clone(),
                reason,
            });
        }
        let confirmed = row.confirmed.ok_or_else(|| self.malformed("it has no confirmed position".into()))?;
        Ok(Some(crate::domain::slot::SlotEnds {
            slot: self.shared.slot.clone(),
            confirmed,
            end: row.end,
            retained_bytes: row.retained_bytes,
        }))
    }

    async fn reset_moved(&self, to: &Position) -> Result<(), SourceError> {
        let Some((lsn, _)) = self.after_key(Some(to))? else { return Ok(()) };
        // The slot's own mutex: a tick of this process reading it waits, and its next read starts
        // from where the slot now is.
        let mut reading = self.reading.lock().await;
        // What this process peeked before the move is read again from the slot.
        reading.stream = None;
        reading.more = true;
        super::operate::advance_to(&self.shared.pool, &self.shared.slot, lsn)
            .await
            .map_err(|error| self.query_error(error))?;
        tracing::info!(slot = %self.shared.slot, to = %lsn_text(lsn), "replication slot moved to where a reset put the checkpoint");
        Ok(())
    }
}
