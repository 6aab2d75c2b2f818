//! The logical [`Source`]: peeks the slot through the SQL interface
//! (`pg_logical_slot_peek_binary_changes`, pgoutput version 1, the text form of values), puts
//! whole transactions together, hands their changes out in commit order, and moves the slot
//! (`pg_replication_slot_advance`) only when the state document has committed what it passes.
//!
//! A peek always starts where the slot is; what the checkpoint (or the reads ahead of it) already
//! covers is counted and skipped, not decoded. One peek reads many batches ahead (bounded, see
//! [`READ_AHEAD_BATCHES`]); its messages wait in memory, undecoded, until handed out. The SQL
//! interface returns whole transactions: one larger than the batch is read whole.

use crate::domain::keyed::Group;
use std::str::FromStr;

use async_trait::async_trait;
use futures::TryStreamExt;
use serde_json::Value;
use sqlx::Row;
use sqlx::postgres::{PgConnectOptions, PgPool};
use tokio::sync::Mutex;

use super::changes::{Assembler, CommitFields, Transaction, Unread, event_row_of};
use super::progress::{Key, Mark, Progress, ReadToEnd, key_of, position};
use super::values::{lsn_text, parse_lsn};
use crate::config::redact::Redaction;
use crate::config::{SourceConfig, SourceTarget};
use crate::domain::Position;
use crate::domain::event::RowJson;
use crate::source::{FetchLimit, Fetched, Probe, Source, SourceError, SourceRow, classify, timed};

/// The rows one peek asks for at least (each change, Begin, Commit and Relation is a row).
const FIRST_PEEK_ROWS: usize = 256;
/// A tick's peek reads this many batches' worth of rows past what was read before, at least
/// [`MIN_READ_AHEAD_ROWS`] and at most [`MAX_READ_AHEAD_ROWS`], and keeps at most
/// [`READ_AHEAD_BYTES`] of their messages (or two batches' bytes, if more): whole transactions,
/// the last one read whole whatever its size. The messages wait in memory as pgoutput and are
/// decoded a transaction at a time as batches are handed out; the next peek is made once they are
/// all handed out. A peek starts where the slot is (it moves when the state document commits), so
/// a tick that needs several re-reads what the earlier ones returned (counted, not decoded): fewer,
/// larger peeks are what make a catch-up fast.
const READ_AHEAD_BATCHES: usize = 256;
const MIN_READ_AHEAD_ROWS: usize = 1024;
const MAX_READ_AHEAD_ROWS: usize = 262_144;
pub const READ_AHEAD_BYTES: usize = 16 * 1024 * 1024;

/// The rows of pgoutput a tick's peek reads ahead, for batches of `batch_rows` changes.
pub fn read_ahead_rows(batch_rows: usize) -> usize {
    batch_rows.saturating_mul(READ_AHEAD_BATCHES).clamp(MIN_READ_AHEAD_ROWS, MAX_READ_AHEAD_ROWS)
}

/// How much a peek keeps past the position it is asked from, at most: rows of pgoutput (of
/// the transactions that have changes kept) and bytes of their messages. The transaction that
/// crosses either is kept whole.
#[derive(Clone, Copy)]
struct Ahead {
    rows: usize,
    bytes: usize,
}

pub struct LogicalSource {
    pool: PgPool,
    config: SourceConfig,
    slot: String,
    publication: String,
    redaction: Redaction,
    reading: Mutex<Reading>,
}

/// Where this process is in the slot: the changes decoded and the messages peeked, waiting to be
/// handed out.
#[derive(Default)]
struct Reading {
    progress: Progress,
    unread: Unread,
}

/// What one peek returned, past `after`.
struct Peeked {
    /// The messages of the transactions with changes after the position asked from (and every
    /// Relation message), not decoded yet.
    unread: Unread,
    /// Changes after the position asked from.
    changes: usize,
    marks: Vec<Mark>,
    /// The peek stopped before its row limit: it read all the WAL flushed when it began.
    reached_end: Option<ReadToEnd>,
}

impl LogicalSource {
    pub fn open(config: &SourceConfig) -> Result<Self, SourceError> {
        let SourceTarget::Logical { slot, publication } = &config.target else {
            return Err(SourceError::Query { location: String::new(), reason: "not a logical source".into() });
        };
        let redaction = Redaction::of_url(config.url.expose());
        let options = PgConnectOptions::from_str(config.url.expose())
            .map_err(|error| SourceError::Unreachable {
                location: redaction.location.clone(),
                reason: redaction.scrub(&error.to_string()),
            })?
            .application_name("dbtrigger")
            // The text forms `values` reads.
            .options([
                ("statement_timeout", format!("{}ms", config.query_timeout.as_millis())),
                ("DateStyle", "ISO, MDY".to_string()),
                ("TimeZone", "UTC".to_string()),
                ("IntervalStyle", "postgres".to_string()),
                ("extra_float_digits", "3".to_string()),
                ("bytea_output", "hex".to_string()),
            ]);
        let pool = crate::source::pool_options().connect_lazy_with(options);
        Ok(LogicalSource {
            pool,
            config: config.clone(),
            slot: slot.clone(),
            publication: publication.clone(),
            redaction,
            reading: Mutex::new(Reading::default()),
        })
    }

    fn query_error(&self, error: sqlx::Error) -> SourceError {
        let classified = classify(&self.redaction, error);
        match classified {
            SourceError::Query { location, reason } if reason.contains("is active for PID") => SourceError::Query {
                location,
                reason: format!(
                    "the replication slot {:?} is in use by another process ({reason}): a slot has one reader; \
                     stop the other consumer, or give this poller a slot of its own",
                    self.slot
                ),
            },
            SourceError::Query { location, reason } if reason.contains("does not exist") => SourceError::Query {
                location,
                reason: format!("{reason}: create the slot and the publication first (`dbtrigger sql` prints how)"),
            },
            other => other,
        }
    }

    /// Peeks from the slot's position, keeping the changes after `after`, up to `ahead` of them.
    /// The peek asks the server for `held` rows (what it returns again before `after`: counted,
    /// not decoded) plus `ahead.rows`, and reads further (four times the rows) while everything
    /// returned is already covered and more may follow.
    async fn peek(&self, after: Option<Key>, held: usize, ahead: Ahead) -> Result<Peeked, SourceError> {
        let mut limit = held.saturating_add(ahead.rows).max(FIRST_PEEK_ROWS);
        loop {
            let flushed: String = sqlx::query_scalar("SELECT pg_current_wal_flush_lsn()::text")
                .fetch_one(&self.pool)
                .await
                .map_err(|error| self.query_error(error))?;
            let flushed = parse_lsn(&flushed).ok_or_else(|| self.malformed(format!("a WAL position {flushed:?}")))?;
            let limit_rows = i32::try_from(limit).unwrap_or(i32::MAX);
            let mut stream = sqlx::query(
                "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes($1, $2::pg_lsn, $3, \
                 'proto_version', '1', 'publication_names', $4)",
            )
            .bind(&self.slot)
            .bind(lsn_text(flushed))
            .bind(limit_rows)
            .bind(format!("\"{}\"", self.publication))
            .fetch(&self.pool);
            // Every transaction is counted here, none decoded: what is kept is decoded as it is
            // handed out.
            let mut assembler = Assembler::skipping(u64::MAX);
            let mut peeked = Peeked { unread: Unread::default(), changes: 0, marks: Vec::new(), reached_end: None };
            let (mut returned, mut rows_of_transaction, mut kept_rows, mut kept_bytes) = (0usize, 0u32, 0usize, 0usize);
            let wanted = |commit_lsn: u64| after.is_none_or(|after| commit_lsn >= after.0);
            let mut stopped = false;
            let mut last = None;
            while let Some(row) = stream.try_next().await.map_err(|error| self.query_error(error))? {
                returned += 1;
                if stopped {
                    // Read to the end of the result (the server has made it already), not kept.
                    continue;
                }
                rows_of_transaction += 1;
                let lsn: String = row.try_get(0).map_err(|error| self.query_error(error))?;
                let lsn = parse_lsn(&lsn).ok_or_else(|| self.malformed(format!("a WAL position {lsn:?}")))?;
                let data: &[u8] = row.try_get(1).map_err(|error| self.query_error(error))?;
                let committed = assembler.push(lsn, data).map_err(|error| self.malformed(error.to_string()))?;
                // The relations serve the transactions after them, kept or not.
                let keep = match &committed {
                    Some(transaction) => wanted(transaction.commit_lsn),
                    None => data.first() == Some(&b'R') || assembler.open_commit_lsn().is_some_and(wanted),
                };
                if keep {
                    kept_bytes += data.len() + 32;
                    peeked.unread.push(lsn, data.to_vec());
                }
                let Some(transaction) = committed else {
                    continue;
                };
                let count = transaction.change_count();
                peeked.marks.push(Mark {
                    commit_lsn: transaction.commit_lsn,
                    end_lsn: transaction.end_lsn,
                    changes: count,
                    rows: std::mem::take(&mut rows_of_transaction),
                });
                if count > 0 {
                    last = Some((transaction.commit_lsn, count));
                }
                let new = new_changes(&transaction, after);
                if new > 0 {
                    peeked.changes += new;
                    kept_rows += peeked.marks.last().map_or(0, |mark| mark.rows as usize);
                }
                // Enough kept: the rest (whole transactions from here) is for the next peek.
                stopped = kept_rows >= ahead.rows || kept_bytes >= ahead.bytes;
            }
            let reached_end = !stopped && returned < limit;
            if reached_end && !assembler.in_transaction() {
                peeked.reached_end = Some(ReadToEnd { flushed, last });
            }
            if peeked.changes > 0 || reached_end || limit >= i32::MAX as usize {
                return Ok(peeked);
            }
            limit = limit.saturating_mul(4);
        }
    }

    fn malformed(&self, reason: String) -> SourceError {
        SourceError::Query {
            location: self.redaction.location.clone(),
            reason: format!("slot {:?}: {reason}", self.slot),
        }
    }

    /// Moves the slot as far as the committed checkpoint allows, if further than it is.
    async fn advance(&self, progress: &mut Progress) -> Result<(), SourceError> {
        let Some(target) = progress.advance_target() else {
            return Ok(());
        };
        // Never backwards: a slot already past the target (moved by an earlier process) stays.
        sqlx::query(
            "SELECT pg_replication_slot_advance(slot_name, $2::pg_lsn) FROM pg_replication_slots \
             WHERE slot_name = $1 AND confirmed_flush_lsn < $2::pg_lsn",
        )
        .bind(&self.slot)
        .bind(lsn_text(target))
        .fetch_all(&self.pool)
        .await
        .map_err(|error| self.query_error(error))?;
        progress.advanced(target);
        tracing::debug!(slot = %self.slot, to = %lsn_text(target), "replication slot advanced");
        Ok(())
    }

    fn after_key(&self, after: Option<&Position>) -> Result<Option<Key>, SourceError> {
        after.map(key_of).transpose().map_err(SourceError::Position)
    }

    async fn deliver(&self, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let after = self.after_key(after)?;
        let mut reading = self.reading.lock().await;
        let Reading { progress, unread } = &mut *reading;
        if progress.skip_to(after) {
            // Asked from further back: what was peeked after it is read again.
            *unread = Unread::default();
        }
        if progress.buffer.is_empty() && unread.is_empty() {
            let ahead =
                Ahead { rows: read_ahead_rows(limit.rows), bytes: READ_AHEAD_BYTES.max(limit.bytes.saturating_mul(2)) };
            let peeked = match self.peek(after, progress.rows_through(after), ahead).await {
                Ok(peeked) => peeked,
                Err(error) => return Err(self.lost_or(error, after.is_some()).await),
            };
            for mark in peeked.marks {
                progress.read(mark);
            }
            progress.more = peeked.reached_end.is_none();
            progress.reached_end(peeked.reached_end);
            *unread = peeked.unread;
            self.advance(progress).await?;
        }
        let mut rows = Vec::new();
        let mut bytes = 0usize;
        while rows.len() < limit.rows.max(1) {
            let Some((_, row)) = progress.buffer.front() else {
                match unread.next_transaction() {
                    Ok(Some(transaction)) => {
                        let handed_out = progress.handed_out();
                        progress.buffer.extend(rows_of(transaction, handed_out));
                        continue;
                    }
                    Ok(None) => break,
                    Err(error) => {
                        // Nothing half-read stays: the next read peeks again from what was handed out.
                        *unread = Unread::default();
                        progress.buffer.clear();
                        progress.more = true;
                        return Err(self.malformed(error.to_string()));
                    }
                }
            };
            let size = row.row.len() + 128;
            if !rows.is_empty() && bytes + size > limit.bytes {
                break;
            }
            bytes += size;
            rows.extend(progress.hand_out());
        }
        let full = progress.more || !progress.buffer.is_empty() || !unread.is_empty();
        Ok(Fetched { rows, full })
    }

    /// `error`, or the slot's loss when that is why a read or an advance failed (`used`: the
    /// poller has a checkpoint, so a slot that does not exist was dropped after use).
    async fn lost_or(&self, error: SourceError, used: bool) -> SourceError {
        if !matches!(error, SourceError::Query { .. }) {
            return error;
        }
        match super::operate::slot_row(&self.pool, &self.slot).await {
            Ok(row) => match super::operate::lost_reason(row.as_ref(), used) {
                Some(reason) => {
                    SourceError::SlotLost { location: self.redaction.location.clone(), slot: self.slot.clone(), reason }
                }
                None => error,
            },
            Err(_) => error,
        }
    }

    /// A read that changes nothing: the first change after `after` (Pending), for `status`. It
    /// waits for this process's own reads (the slot has one reader at a time).
    async fn look(&self, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let after = self.after_key(after)?;
        let reading = self.reading.lock().await;
        let held = reading.progress.rows_through(after);
        // A change is a row at least, and a transaction two more: what `limit` asks for is kept.
        let ahead = Ahead { rows: limit.rows.saturating_mul(3), bytes: usize::MAX };
        let mut peeked = self.peek(after, held, ahead).await?;
        let mut rows = Vec::new();
        while rows.len() <= limit.rows {
            match peeked.unread.next_transaction() {
                Ok(Some(transaction)) => rows.extend(rows_of(transaction, after)),
                Ok(None) => break,
                Err(error) => return Err(self.malformed(error.to_string())),
            }
        }
        let full = rows.len() > limit.rows || peeked.reached_end.is_none();
        Ok(Fetched { rows: rows.into_iter().take(limit.rows).map(|(_, row)| row).collect(), full })
    }
}

/// How many of a transaction's changes come after `after`.
fn new_changes(transaction: &Transaction, after: Option<Key>) -> usize {
    match after {
        Some((commit_lsn, _)) if transaction.commit_lsn < commit_lsn => 0,
        Some((commit_lsn, ordinal)) if transaction.commit_lsn == commit_lsn => {
            transaction.change_count().saturating_sub(ordinal) as usize
        }
        _ => transaction.change_count() as usize,
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

/// The rows of a transaction's changes after `after`, in order: the changes move into them.
fn rows_of(mut transaction: Transaction, after: Option<Key>) -> Vec<(Key, SourceRow)> {
    let commit = CommitFields::of(&transaction);
    let commit_lsn = transaction.commit_lsn;
    std::mem::take(&mut transaction.changes)
        .into_iter()
        .filter(|change| after.is_none_or(|after| (commit_lsn, change.ordinal) > after))
        .map(|change| {
            let key = (commit_lsn, change.ordinal);
            let op = change.op;
            let group = order_group(&change);
            let row = SourceRow {
                position: position(key.0, key.1),
                row: RowJson::from_map(&event_row_of(&commit, change)),
                op,
                group: Some(group),
            };
            (key, row)
        })
        .collect()
}

#[async_trait]
impl Source for LogicalSource {
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        let location = self.redaction.location.clone();
        match probe {
            Probe::Deliver => {
                timed(&crate::source::pools::Gate::open(), &self.config, &location, self.deliver(after, limit)).await
            }
            Probe::Pending => {
                timed(&crate::source::pools::Gate::open(), &self.config, &location, self.look(after, limit)).await
            }
            Probe::Last => Err(SourceError::Query {
                location,
                reason:
                    "a logical source has no last row: `reset --to-end` moves its slot to the end of the WAL instead"
                        .into(),
            }),
        }
    }

    async fn count_after(&self, after: Option<&Position>, cap: u64) -> Result<u64, SourceError> {
        let rows = usize::try_from(cap).unwrap_or(usize::MAX).min(100_000);
        let fetched = self.read(Probe::Pending, after, FetchLimit { rows, bytes: usize::MAX }).await?;
        Ok(fetched.rows.len() as u64)
    }

    async fn generation(&self) -> Result<Option<Value>, SourceError> {
        Ok(None)
    }

    fn describe(&self) -> String {
        format!("{} (slot {})", self.redaction.location, self.slot)
    }

    async fn slot(&self) -> Result<Option<crate::domain::slot::SlotView>, SourceError> {
        let row: Option<(Option<i64>, Option<String>, Option<i32>)> = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, wal_status, active_pid \
             FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&self.slot)
        .fetch_optional(&self.pool)
        .await
        .map_err(|error| self.query_error(error))?;
        let (retained_bytes, wal_status, active_pid) = row.ok_or_else(|| SourceError::Query {
            location: self.redaction.location.clone(),
            reason: format!(
                "replication slot {:?} does not exist (`dbtrigger sql` prints how to create it)",
                self.slot
            ),
        })?;
        Ok(Some(crate::domain::slot::SlotView { slot: self.slot.clone(), retained_bytes, wal_status, active_pid }))
    }

    async fn committed(&self, checkpoint: Option<&Position>) -> Result<(), SourceError> {
        let key = self.after_key(checkpoint)?;
        let work = async {
            let mut reading = self.reading.lock().await;
            reading.progress.committed(key);
            match self.advance(&mut reading.progress).await {
                Ok(()) => Ok(()),
                Err(error) => Err(self.lost_or(error, key.is_some()).await),
            }
        };
        timed(&crate::source::pools::Gate::open(), &self.config, &self.redaction.location, work).await
    }

    async fn slot_ends(&self) -> Result<Option<crate::domain::slot::SlotEnds>, SourceError> {
        let row = super::operate::slot_row(&self.pool, &self.slot).await.map_err(|error| self.query_error(error))?;
        let Some(row) = row else {
            return Err(self.malformed("it does not exist: create it first (`dbtrigger sql` prints how)".into()));
        };
        if let Some(reason) = super::operate::lost_reason(Some(&row), true) {
            return Err(SourceError::SlotLost {
                location: self.redaction.location.clone(),
                slot: self.slot.clone(),
                reason,
            });
        }
        let confirmed = row.confirmed.ok_or_else(|| self.malformed("it has no confirmed position".into()))?;
        Ok(Some(crate::domain::slot::SlotEnds {
            slot: self.slot.clone(),
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
        reading.unread = Unread::default();
        reading.progress.buffer.clear();
        reading.progress.more = true;
        super::operate::advance_to(&self.pool, &self.slot, lsn).await.map_err(|error| self.query_error(error))?;
        tracing::info!(slot = %self.slot, to = %lsn_text(lsn), "replication slot moved to where a reset put the checkpoint");
        Ok(())
    }
}
