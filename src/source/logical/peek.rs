//! A peek of the slot, run in a task of its own: its connection (kept from one peek to the next,
//! or a temporary copy of the slot for a look), the query, and the changes sent to the tick in
//! chunks through a bounded channel ([`super::source`] hands them out).

use crate::domain::keyed::Group;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use futures::{FutureExt, TryStreamExt};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::{Connection, Row as _};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::changes::{Change, CommitFields, Decoder, Pending, Step, event_row_of};
use super::progress::{Key, Mark, ReadToEnd, position};
use super::values::{lsn_text, parse_lsn};
use crate::config::Origin;
use crate::config::redact::Redaction;
use crate::domain::event::RowJson;
use crate::source::{SourceError, SourceRow, classify};

/// The changes (and transaction ends) a peek's task sends ahead of the tick, at most, in chunks of
/// at most [`CHUNK_ITEMS`] changes or [`CHUNK_BYTES`] of pgoutput; the channel also holds at most
/// [`READ_AHEAD_BYTES`] of pgoutput. Room for a few chunks being decoded at once, and for the
/// peek to go on while the tick writes its lease.
pub(super) const CHANNEL_ITEMS: usize = 2048;
/// What a peek's channel holds at most, in bytes of pgoutput (its changes are decoded there).
pub const READ_AHEAD_BYTES: usize = 16 * 1024 * 1024;
pub(super) const CHUNK_ITEMS: usize = 128;
const CHUNK_BYTES: usize = READ_AHEAD_BYTES / 16;
/// The most a counting peek counts: the changes after a position, counted by tag (no decoding).
pub(super) const COUNT_CAP: u64 = 100_000;

/// What a peek's task needs, shared with it.
pub(super) struct Shared {
    pub(super) pool: PgPool,
    /// A peek's own connection: no statement timeout (the tick's budget and the idle limit bound
    /// it), the text forms `values` reads.
    pub(super) peek_options: PgConnectOptions,
    pub(super) slot: String,
    pub(super) publication: String,
    /// `none`: the peek asks pgoutput for the changes without a replication origin only.
    pub(super) origin: Origin,
    pub(super) redaction: Redaction,
    /// A peek's task gives up when the tick has not taken anything from it for this long.
    pub(super) idle: Duration,
    /// The connection of the last peek read to its end, kept for the next one: a peek on it
    /// needs no new backend (a fork, an authentication, cold catalog caches), as a poller's pool
    /// keeps its connections. A peek given up or failed closes its connection instead.
    pub(super) kept: std::sync::Mutex<Option<PgConnection>>,
    /// The Entra token connections log in with (`<connection>__credential = managedidentity`).
    pub(super) token: Option<crate::source::entra::DatabaseToken>,
    /// Which of the token's generations the pool's connect options carry (0: none yet).
    pub(super) applied: std::sync::atomic::AtomicU64,
}

/// What a peek's task sends.
pub(super) enum Item {
    Row(Key, Row),
    /// A transaction read to its Commit.
    Mark(Mark),
    /// The peek ended: whether it read to the flushed end, and how many changes after the
    /// position asked from it sent.
    End {
        reached_end: Option<ReadToEnd>,
        new: usize,
    },
}

/// What a peek's task sends: items, and the room their messages take in the channel (given back
/// when the tick has them).
pub(super) struct Chunk {
    items: Items,
    room: Option<OwnedSemaphorePermit>,
}

/// A chunk's items: ready, or being decoded by a task of their own (chunks are decoded in
/// parallel, on every core, and handed out in order), whose first change is at `Key`.
enum Items {
    Ready(Decoded),
    Decoding(Decoding, Key),
}

/// A chunk's decoding task, aborted when dropped: a chunk nobody will take (its stream dropped,
/// the peek's task aborted while it was sending it) is not decoded for nothing.
pub(super) struct Decoding(tokio::task::JoinHandle<Decoded>);

impl Drop for Decoding {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A chunk decoded: its items up to the first change that could not be, and why it could not.
pub(super) struct Decoded {
    items: Vec<Item>,
    failed: Option<String>,
}

/// An item of the chunk being filled: a row change is decoded when its chunk is sent.
enum Unsent {
    Item(Item),
    Change(Key, Arc<CommitFields>, Pending),
}

impl Unsent {
    /// The item; a change that cannot be decoded is why, naming its position as `reset` takes it.
    fn into_item(self) -> Result<Item, String> {
        match self {
            Unsent::Item(item) => Ok(item),
            Unsent::Change(key, fields, pending) => match pending.decode() {
                Ok(change) => Ok(Item::Row(key, Row::of(&fields, change))),
                Err(error) => Err(at_position(error, key)),
            },
        }
    }
}

/// Decodes a chunk's changes, in order, up to the first that cannot be.
fn decode(chunk: Vec<Unsent>) -> Decoded {
    let mut items = Vec::with_capacity(chunk.len());
    for unsent in chunk {
        match unsent.into_item() {
            Ok(item) => items.push(item),
            Err(failed) => return Decoded { items, failed: Some(failed) },
        }
    }
    Decoded { items, failed: None }
}

/// `error`, met decoding the change at `(commit LSN, ordinal)`: where, and how to skip it.
fn at_position(error: super::changes::AssembleError, (commit_lsn, ordinal): Key) -> String {
    format!(
        "{error}, in the transaction committing at {} (the change after cursor {commit_lsn}, ordinal {}): \
         to skip it, `dbtrigger reset <poller> --to-cursor {commit_lsn} --pk ordinal={ordinal}`",
        lsn_text(commit_lsn),
        ordinal.saturating_sub(1)
    )
}

/// A change decoded: its event row and its keys for the ordered window. Its position is made
/// from its key where it is handed out ([`Row::at`]), by the tick that frees it.
pub(super) struct Row {
    pub(super) row: RowJson,
    op: crate::domain::Op,
    group: Group,
}

impl Row {
    fn of(fields: &CommitFields, change: Change) -> Row {
        let (op, group) = (change.op, order_group(&change));
        Row { row: RowJson::from_map(&event_row_of(fields, change)), op, group }
    }

    /// The row handed out, at its position (commit LSN, ordinal).
    pub(super) fn at(self, (commit_lsn, ordinal): Key) -> SourceRow {
        SourceRow { position: position(commit_lsn, ordinal), row: self.row, op: self.op, group: Some(self.group) }
    }
}

/// A peek being read.
pub(super) struct Stream {
    pub(super) items: mpsc::Receiver<Result<Chunk, SourceError>>,
    /// The rest of the chunk received last (first, a change that did not fit the last batch).
    pub(super) pending: VecDeque<Item>,
    pub(super) task: tokio::task::JoinHandle<()>,
    /// The peek's backend, once known: cancelled when the peek is given up before its end.
    pub(super) backend: Arc<AtomicI32>,
    pub(super) pool: PgPool,
    /// The last change handed out (the position the peek was asked from, before the first).
    pub(super) at: Option<Key>,
    /// The source and the slot, as its errors name them.
    pub(super) location: String,
    pub(super) slot: String,
    /// The chunk being decoded, kept here while the tick waits for it: a read dropped during that
    /// wait loses nothing (the next read waits for the same chunk).
    pub(super) decoding: Option<(Decoding, Key, Option<OwnedSemaphorePermit>)>,
    /// Why a change after `pending` could not be decoded: every next item, once `pending` is taken.
    pub(super) failed: Option<String>,
}

impl Stream {
    /// The peek's next item, in order; `None` when its task ended without one. Cancel-safe: a
    /// chunk taken from the channel is kept in the stream until its items are.
    pub(super) async fn next(&mut self) -> Option<Result<Item, SourceError>> {
        loop {
            if let Some(item) = self.pending.pop_front() {
                return Some(Ok(item));
            }
            if let Some(reason) = &self.failed {
                let reason = format!("slot {:?}: {reason}", self.slot);
                return Some(Err(SourceError::Query { location: self.location.clone(), reason }));
            }
            if let Some((task, first, _)) = self.decoding.as_mut() {
                let decoded = (&mut task.0).await.unwrap_or_else(|error| Decoded {
                    items: Vec::new(),
                    failed: Some(format!(
                        "decoding the chunk from the change after cursor {}, ordinal {} failed: {error}",
                        first.0,
                        first.1.saturating_sub(1)
                    )),
                });
                // The items are in `pending` before the room is given back.
                self.take(decoded);
                self.decoding = None;
                continue;
            }
            match self.items.recv().await? {
                Ok(Chunk { items: Items::Ready(decoded), .. }) => self.take(decoded),
                Ok(Chunk { items: Items::Decoding(task, first), room }) => self.decoding = Some((task, first, room)),
                Err(error) => return Some(Err(error)),
            }
        }
    }

    fn take(&mut self, Decoded { items, failed }: Decoded) {
        self.pending.extend(items);
        self.failed = self.failed.take().or(failed);
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
    items: &'a mpsc::Sender<Result<Chunk, SourceError>>,
    /// The channel's room, in bytes of pgoutput ([`READ_AHEAD_BYTES`] in all).
    room: Arc<Semaphore>,
    /// Gives up when the tick has not taken a chunk for this long.
    idle: Duration,
    chunk: Vec<Unsent>,
    /// The bytes of pgoutput the chunk's changes came in.
    bytes: usize,
}

impl Outbox<'_> {
    async fn push(&mut self, item: Item) -> Result<(), Stop> {
        self.add(Unsent::Item(item), 0).await
    }

    /// Adds a change that came in `bytes` of pgoutput.
    async fn add(&mut self, unsent: Unsent, bytes: usize) -> Result<(), Stop> {
        self.chunk.push(unsent);
        self.bytes += bytes;
        if self.chunk.len() >= CHUNK_ITEMS || self.bytes >= CHUNK_BYTES {
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
        let bytes = std::mem::take(&mut self.bytes).min(READ_AHEAD_BYTES) as u32;
        let sent = tokio::time::timeout(self.idle, async {
            // Room first: the chunk is decoded (and its rows grow) only once the channel has it.
            let room = match bytes {
                0 => None,
                bytes => Some(self.room.clone().acquire_many_owned(bytes).await.map_err(|_| Stop::GivenUp)?),
            };
            let first = chunk.iter().find_map(|unsent| match unsent {
                Unsent::Change(key, ..) => Some(*key),
                Unsent::Item(_) => None,
            });
            let items = match first {
                Some(first) => Items::Decoding(Decoding(tokio::spawn(async move { decode(chunk) })), first),
                None => Items::Ready(decode(chunk)),
            };
            self.items.send(Ok(Chunk { items, room })).await.map_err(|_| Stop::GivenUp)
        })
        .await;
        match sent {
            Ok(Ok(())) => Ok(()),
            _ => Err(Stop::GivenUp),
        }
    }
}

/// What a peek reads for: delivery or a count (`counting`: by tag, nothing decoded), and from the
/// slot (a tick's delivery) or from a temporary copy of it (`on_copy`: a look).
#[derive(Clone, Copy)]
pub(super) struct Read {
    pub(super) counting: bool,
    pub(super) on_copy: bool,
}

/// Why a peek's task stopped before its end.
pub(super) enum Stop {
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
    pub(super) fn query_error(&self, error: sqlx::Error) -> SourceError {
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
    pub(super) async fn copy_of_slot(&self, connection: &mut PgConnection, pid: i32) -> Result<String, SourceError> {
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

    pub(super) fn malformed(&self, reason: String) -> SourceError {
        SourceError::Query {
            location: self.redaction.location.clone(),
            reason: format!("slot {:?}: {reason}", self.slot),
        }
    }

    /// One peek of at most `limit_rows` rows, from where the slot is: the changes after `after`
    /// are decoded and sent as they come (each transaction's end too), or only counted when
    /// `counting`.
    pub(super) async fn peek(
        &self,
        after: Option<Key>,
        limit_rows: usize,
        read: Read,
        items: &mpsc::Sender<Result<Chunk, SourceError>>,
        backend: &AtomicI32,
    ) -> Result<(), Stop> {
        let room = Arc::new(Semaphore::new(READ_AHEAD_BYTES));
        let mut outbox = Outbox { items, room, idle: self.idle, chunk: Vec::with_capacity(CHUNK_ITEMS), bytes: 0 };
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
        let mut decoder = if counting { Decoder::counting() } else { Decoder::after(after).deferring() };
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
                Step::Nothing if data.first() == Some(&b'B') && !counting => {
                    fields = decoder.commit_fields().map(Arc::new)
                }
                Step::Nothing => {}
                Step::Changes(changes) => {
                    let (Some(fields), Some((commit_lsn, _))) = (fields.as_ref(), decoder.next_change()) else {
                        return Err(Stop::Failed(self.malformed("a change before its transaction's Begin".into())));
                    };
                    for change in changes {
                        let key = (commit_lsn, change.ordinal);
                        new += 1;
                        outbox.push(Item::Row(key, Row::of(fields, change))).await?;
                    }
                }
                Step::Pending(pending) => {
                    let (Some(fields), Some((commit_lsn, _))) = (fields.as_ref(), decoder.next_change()) else {
                        return Err(Stop::Failed(self.malformed("a change before its transaction's Begin".into())));
                    };
                    new += 1;
                    let unsent = Unsent::Change((commit_lsn, pending.ordinal()), fields.clone(), pending);
                    outbox.add(unsent, data.len()).await?;
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

    /// Before a question or a peek's connection: the token renewed when due, and given to the
    /// pool for the connections it opens from now on (`None`: the URL's password).
    pub(super) async fn login(&self) -> Result<Option<crate::settings::Secret>, SourceError> {
        use std::sync::atomic::Ordering;
        let Some(token) = &self.token else {
            return Ok(None);
        };
        let password = token.password(std::time::SystemTime::now(), &self.redaction.location).await?;
        if self.applied.load(Ordering::SeqCst) != password.generation {
            let options = self.pool.connect_options().as_ref().clone();
            self.pool.set_connect_options(options.password(password.token.expose()));
            self.applied.store(password.generation, Ordering::SeqCst);
        }
        Ok(Some(password.token))
    }

    /// A connection for a peek, with its backend's pid, the end of the flushed WAL and the
    /// server's version: the one kept from the last peek if it still answers, else a new one.
    pub(super) async fn session(&self) -> Result<(PgConnection, (i32, String, i32)), SourceError> {
        let kept = self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some(mut connection) = kept {
            // A kept connection that no longer answers (the server restarted, a proxy's idle
            // limit) is replaced.
            if let Ok(answer) = ask(&mut connection).await {
                return Ok((connection, answer));
            }
        }
        let options = match self.login().await? {
            Some(token) => self.peek_options.clone().password(token.expose()),
            None => self.peek_options.clone(),
        };
        let mut connection = PgConnection::connect_with(&options).await.map_err(|error| self.query_error(error))?;
        let answer = ask(&mut connection).await.map_err(|error| self.query_error(error))?;
        Ok((connection, answer))
    }

    /// A decoding failure, named by the position of the change it stopped at, as `reset` takes it.
    pub(super) fn at_change(&self, decoder: &Decoder, error: super::changes::AssembleError) -> String {
        match decoder.next_change() {
            Some(key) => at_position(error, key),
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
pub(super) fn new_changes(commit_lsn: u64, changes: u32, after: Option<Key>) -> usize {
    match after {
        Some((at, _)) if commit_lsn < at => 0,
        Some((at, ordinal)) if commit_lsn == at => changes.saturating_sub(ordinal) as usize,
        _ => changes as usize,
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

#[cfg(test)]
mod tests {
    use super::super::pgoutput::tests::{begin, insert, relation};
    use super::*;

    /// A chunk is decoded in order up to its first change that cannot be; that change's error
    /// names it as `reset` takes it (its commit LSN as the cursor, the ordinal before it), so that
    /// an operator can skip it.
    #[test]
    fn a_chunk_is_decoded_up_to_the_change_that_cannot_be_which_is_named_for_reset() {
        let mut decoder = Decoder::after(None).deferring();
        decoder.push(1, &begin(100, 0, 7)).unwrap();
        decoder.push(2, &relation()).unwrap();
        let fields = Arc::new(decoder.commit_fields().unwrap());
        let mut chunk = Vec::new();
        for values in [&[Some(Some("1")), Some(None), Some(None)][..], &[Some(Some("2"))][..]] {
            let Step::Pending(pending) = decoder.push(3, &insert(values)).unwrap() else { panic!("deferred") };
            chunk.push(Unsent::Change((100, pending.ordinal()), fields.clone(), pending));
        }
        chunk.push(Unsent::Item(Item::End { reached_end: None, new: 2 }));
        let Decoded { items, failed } = decode(chunk);
        assert_eq!(items.len(), 1);
        assert!(matches!(&items[0], Item::Row((100, 1), _)));
        let failed = failed.expect("the second change has one value for three columns");
        assert!(failed.contains("a row of 1 values for public.orders, which has 3 columns"), "{failed}");
        assert!(
            failed.ends_with(
                "in the transaction committing at 0/64 (the change after cursor 100, ordinal 1): to skip it, \
                 `dbtrigger reset <poller> --to-cursor 100 --pk ordinal=2`"
            ),
            "{failed}"
        );
    }

    /// Regression (review, 2026-11-27): a read dropped while it waited for a chunk's decoding (a
    /// tick whose future was dropped) lost that chunk, and a later read of the same stream went
    /// on after it, past a gap. The chunk now stays in the stream until its items are taken.
    #[tokio::test]
    async fn a_read_dropped_while_a_chunk_is_decoded_loses_nothing() {
        let (sender, items) = mpsc::channel(4);
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let decoding = tokio::spawn(async move {
            let _ = released.await;
            Decoded { items: vec![Item::End { reached_end: None, new: 7 }], failed: None }
        });
        sender.send(Ok(Chunk { items: Items::Decoding(Decoding(decoding), (100, 1)), room: None })).await.unwrap();
        drop(sender);
        let mut stream = Stream {
            items,
            pending: VecDeque::new(),
            task: tokio::spawn(async {}),
            backend: Arc::new(AtomicI32::new(0)),
            pool: sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://u@127.0.0.1:9/none").unwrap(),
            at: None,
            location: "test".into(),
            slot: "s".into(),
            decoding: None,
            failed: None,
        };
        // The read takes the chunk from the channel and waits for its decoding: dropped there.
        assert!(stream.next().now_or_never().is_none());
        release.send(()).unwrap();
        match stream.next().await {
            Some(Ok(Item::End { new: 7, .. })) => {}
            _ => panic!("the chunk taken by the dropped read was lost"),
        }
    }

    /// The channel holds at most READ_AHEAD_BYTES of pgoutput: a chunk whose messages do not fit
    /// the room left waits until the tick takes an earlier one, however few changes the channel
    /// holds (rows of several MiB each).
    #[tokio::test]
    async fn a_chunk_waits_for_room_in_the_channels_bytes() {
        let mut decoder = Decoder::after(None).deferring();
        decoder.push(1, &begin(100, 0, 7)).unwrap();
        decoder.push(2, &relation()).unwrap();
        let fields = Arc::new(decoder.commit_fields().unwrap());
        let (sender, mut items) = mpsc::channel(CHANNEL_ITEMS / CHUNK_ITEMS);
        let room = Arc::new(Semaphore::new(READ_AHEAD_BYTES));
        let mut outbox =
            Outbox { items: &sender, room: room.clone(), idle: Duration::from_secs(60), chunk: Vec::new(), bytes: 0 };
        let mut change = || {
            let Step::Pending(pending) = decoder.push(3, &insert(&[Some(Some("1")), Some(None), Some(None)])).unwrap()
            else {
                panic!("deferred")
            };
            Unsent::Change((100, pending.ordinal()), fields.clone(), pending)
        };
        // A chunk leaves at 1 MiB: each of these changes is a chunk of its own.
        let ten_mib = 10 * 1024 * 1024;
        assert!(outbox.add(change(), ten_mib).await.is_ok(), "the first chunk fits");
        assert_eq!(room.available_permits(), READ_AHEAD_BYTES - ten_mib);
        let second = outbox.add(change(), ten_mib);
        tokio::pin!(second);
        assert!(futures::poll!(&mut second).is_pending(), "a second 10 MiB does not fit 16 MiB: it waits");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(futures::poll!(&mut second).is_pending(), "it still waits");
        // The tick takes the first chunk: its room comes back, and the second one goes.
        drop(items.recv().await.unwrap().unwrap());
        assert!(second.await.is_ok(), "room for the second now");
        assert_eq!(room.available_permits(), READ_AHEAD_BYTES - ten_mib);
    }
}
