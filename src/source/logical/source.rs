//! The logical [`Source`]: peeks the slot through the SQL interface
//! (`pg_logical_slot_peek_binary_changes`, pgoutput version 1, the text form of values), puts
//! whole transactions together, hands their changes out in commit order, and moves the slot
//! (`pg_replication_slot_advance`) only when the state document has committed what it passes.
//!
//! A peek always starts where the slot is; what the checkpoint (or the reads ahead of it) already
//! covers is skipped. Changes read ahead of what is asked are kept in memory until handed out. The
//! SQL interface returns whole transactions: one larger than the batch is read whole.

use std::str::FromStr;

use async_trait::async_trait;
use serde_json::Value;
use sqlx::Row;
use sqlx::postgres::{PgConnectOptions, PgPool};
use tokio::sync::Mutex;

use super::changes::{Assembler, event_row};
use super::progress::{Key, Mark, Progress, ReadToEnd, key_of, position};
use super::values::{lsn_text, parse_lsn};
use crate::config::redact::Redaction;
use crate::config::{SourceConfig, SourceTarget};
use crate::domain::Position;
use crate::domain::event::RowJson;
use crate::source::{FetchLimit, Fetched, Probe, Source, SourceError, SourceRow, classify, timed};

/// The rows one peek asks for at first (each change, Begin, Commit and Relation is a row).
const FIRST_PEEK_ROWS: usize = 256;

pub struct LogicalSource {
    pool: PgPool,
    config: SourceConfig,
    slot: String,
    publication: String,
    redaction: Redaction,
    progress: Mutex<Progress>,
}

/// What one peek returned, past `after`.
struct Peeked {
    rows: Vec<(Key, SourceRow)>,
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
            progress: Mutex::new(Progress::default()),
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

    /// Peeks from the slot's position, keeping the changes after `after`: reads further (more
    /// rows per peek) while everything read is already covered and more may follow.
    async fn peek(&self, after: Option<Key>, wanted: usize) -> Result<Peeked, SourceError> {
        let mut limit = wanted.saturating_mul(2).max(FIRST_PEEK_ROWS);
        loop {
            let flushed: String = sqlx::query_scalar("SELECT pg_current_wal_flush_lsn()::text")
                .fetch_one(&self.pool)
                .await
                .map_err(|error| self.query_error(error))?;
            let flushed = parse_lsn(&flushed).ok_or_else(|| self.malformed(format!("a WAL position {flushed:?}")))?;
            let rows = sqlx::query(
                "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes($1, $2::pg_lsn, $3, \
                 'proto_version', '1', 'publication_names', $4)",
            )
            .bind(&self.slot)
            .bind(lsn_text(flushed))
            .bind(i32::try_from(limit).unwrap_or(i32::MAX))
            .bind(format!("\"{}\"", self.publication))
            .fetch_all(&self.pool)
            .await
            .map_err(|error| self.query_error(error))?;
            let reached_end = rows.len() < limit;
            let mut assembler = Assembler::default();
            let mut peeked = Peeked { rows: Vec::new(), marks: Vec::new(), reached_end: None };
            let mut last = None;
            for row in &rows {
                let lsn: String = row.try_get(0).map_err(|error| self.query_error(error))?;
                let lsn = parse_lsn(&lsn).ok_or_else(|| self.malformed(format!("a WAL position {lsn:?}")))?;
                let data: &[u8] = row.try_get(1).map_err(|error| self.query_error(error))?;
                let Some(transaction) = assembler.push(lsn, data).map_err(|error| self.malformed(error.to_string()))?
                else {
                    continue;
                };
                peeked.marks.push(Mark {
                    commit_lsn: transaction.commit_lsn,
                    end_lsn: transaction.end_lsn,
                    changes: transaction.changes.len() as u32,
                });
                for change in &transaction.changes {
                    let key = (transaction.commit_lsn, change.ordinal);
                    last = Some(key);
                    if after.is_some_and(|after| key <= after) {
                        continue;
                    }
                    let row = SourceRow {
                        position: position(key.0, key.1),
                        row: RowJson::from_map(&event_row(&transaction, change)),
                        op: change.op,
                    };
                    peeked.rows.push((key, row));
                }
            }
            if reached_end && !assembler.in_transaction() {
                peeked.reached_end = Some(ReadToEnd { flushed, last });
            }
            if !peeked.rows.is_empty() || reached_end || limit >= i32::MAX as usize {
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
        let mut progress = self.progress.lock().await;
        progress.skip_to(after);
        if progress.buffer.is_empty() {
            let peeked = match self.peek(after, limit.rows).await {
                Ok(peeked) => peeked,
                Err(error) => return Err(self.lost_or(error, after.is_some()).await),
            };
            for mark in peeked.marks {
                progress.read(mark);
            }
            progress.more = peeked.reached_end.is_none();
            progress.reached_end(peeked.reached_end);
            progress.buffer.extend(peeked.rows);
            self.advance(&mut progress).await?;
        }
        let mut rows = Vec::new();
        let mut bytes = 0usize;
        while rows.len() < limit.rows.max(1) {
            let Some((_, row)) = progress.buffer.front() else { break };
            let size = row.row.len() + 128;
            if !rows.is_empty() && bytes + size > limit.bytes {
                break;
            }
            bytes += size;
            rows.extend(progress.hand_out());
        }
        let full = progress.more || !progress.buffer.is_empty();
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
        let _reading = self.progress.lock().await;
        let peeked = self.peek(after, limit.rows).await?;
        let full = peeked.rows.len() > limit.rows || peeked.reached_end.is_none();
        Ok(Fetched { rows: peeked.rows.into_iter().take(limit.rows).map(|(_, row)| row).collect(), full })
    }
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
            let mut progress = self.progress.lock().await;
            progress.committed(key);
            match self.advance(&mut progress).await {
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
        let _reading = self.progress.lock().await;
        super::operate::advance_to(&self.pool, &self.slot, lsn).await.map_err(|error| self.query_error(error))?;
        tracing::info!(slot = %self.slot, to = %lsn_text(lsn), "replication slot moved to where a reset put the checkpoint");
        Ok(())
    }
}
