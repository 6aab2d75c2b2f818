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

use std::collections::VecDeque;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use sqlx::postgres::PgConnectOptions;
use tokio::sync::{Mutex, mpsc};

use super::peek::{CHANNEL_ITEMS, CHUNK_ITEMS, COUNT_CAP, Item, Read, Shared, Stop, Stream};
use super::progress::{Key, Mark, Progress, key_of};
use super::values::lsn_text;
use crate::config::redact::Redaction;
use crate::config::{SourceConfig, SourceTarget};
use crate::domain::Position;
use crate::source::{FetchLimit, Fetched, Probe, Source, SourceError, SourceRow, timed};

/// A tick's peek asks the server for this many batches' worth of rows past what was read before,
/// at least [`MIN_READ_AHEAD_ROWS`] and at most [`MAX_READ_AHEAD_ROWS`] (the server checks the
/// limit at a commit only: the transaction that crosses it comes whole, streamed). The server
/// decodes the whole window before the first row comes; a smaller window answers sooner.
const READ_AHEAD_BATCHES: usize = 256;
const MIN_READ_AHEAD_ROWS: usize = 1024;
const MAX_READ_AHEAD_ROWS: usize = 262_144;

/// The transactions a look keeps before it hands them to `reading`.
const LOOK_MARKS_KEPT: usize = 1024;

/// The most rows a read reserves room for before it has them.
const MAX_BATCH_ROWS_RESERVED: usize = 10_000;

/// The rows of pgoutput a tick's peek reads ahead, for batches of `batch_rows` changes.
pub fn read_ahead_rows(batch_rows: usize) -> usize {
    batch_rows.saturating_mul(READ_AHEAD_BATCHES).clamp(MIN_READ_AHEAD_ROWS, MAX_READ_AHEAD_ROWS)
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
            token: config.identity.clone().map(crate::source::entra::DatabaseToken::new),
            applied: std::sync::atomic::AtomicU64::new(0),
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
        Stream {
            items,
            pending: VecDeque::new(),
            task,
            backend,
            pool: self.shared.pool.clone(),
            at: after,
            location: self.shared.redaction.location.clone(),
            slot: self.shared.slot.clone(),
            decoding: None,
            failed: None,
        }
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
        // Room for the batch at once: grown a row at a time, its copies cost more than its rows.
        let mut rows = Vec::with_capacity(limit.rows.clamp(1, MAX_BATCH_ROWS_RESERVED));
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
                    rows.push(row.at(key));
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
        // `reading` is held only to read what it knows and to add what the look learnt, never
        // across the copy's peek (issue 45, finding 6): a tick of this process reads on while
        // `status` counts (logical_look::a_status_count_never_holds_up_the_ticks_read).
        let held = self.reading.lock().await.progress.rows_through(after);
        // A change is a row at least, and a transaction two more.
        let wanted = if counting { COUNT_CAP as usize } else { limit.rows.saturating_add(1) };
        let mut stream =
            self.start(after, held.saturating_add(wanted.saturating_mul(3)), Read { counting, on_copy: true });
        let mut rows = Vec::new();
        let mut marks = Vec::new();
        let looked = loop {
            match stream.next().await {
                Some(Ok(Item::Row(key, row))) => {
                    rows.push(row.at(key));
                    if rows.len() > limit.rows {
                        break Ok((rows, true, 0));
                    }
                }
                Some(Ok(Item::Mark(mark))) => {
                    marks.push(mark);
                    if marks.len() >= LOOK_MARKS_KEPT {
                        self.learn(&mut marks).await;
                    }
                }
                Some(Ok(Item::End { reached_end, new })) => break Ok((rows, reached_end.is_none(), new)),
                Some(Err(error)) => break Err(error),
                None => break Err(self.malformed("the peek's task ended before its end".into())),
            }
        };
        self.learn(&mut marks).await;
        looked
    }

    /// Adds the transactions a look read to what `reading` knows (a look's memory stays bounded:
    /// it hands them over every [`LOOK_MARKS_KEPT`]). A tick holds `reading` for one read at a
    /// time, so this waits for a batch at most.
    async fn learn(&self, marks: &mut Vec<Mark>) {
        if marks.is_empty() {
            return;
        }
        let mut reading = self.reading.lock().await;
        for mark in marks.drain(..) {
            reading.progress.read(mark);
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

#[async_trait]
impl Source for LogicalSource {
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        self.shared.login().await?;
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
        self.shared.login().await?;
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

    /// A peek a tick left open without ending cleanly (its future dropped, a panic) is given up:
    /// the next tick peeks again from its checkpoint.
    fn end_reads(&self) {
        if let Ok(mut reading) = self.reading.try_lock() {
            reading.stream = None;
        }
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
        self.shared.login().await?;
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
        self.shared.login().await?;
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
        self.shared.login().await?;
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
        self.shared.login().await?;
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
        self.shared.login().await?;
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
