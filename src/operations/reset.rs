//! `reset`: moves a poller's checkpoint where an operator says (the beginning, the source's end, a
//! cursor and key, or a checkpoint from a file), through a live lease only when forced. A poller
//! that has never ticked gets its first document this way (written only if there still is none).
//!
//! A logical poller's slot cannot go back: `--to-end` puts the checkpoint at the end of the
//! flushed WAL and moves the slot there, `--to-cursor`/`--from-file` take a position at or after
//! where the slot stands, and `--to-beginning` is refused. [`apply`] writes the document first
//! and moves the slot after: a crash between the two leaves a checkpoint that covers what the
//! operator asked to skip, which the next tick skips (and then moves the slot itself), so nothing
//! is lost that was not asked to be skipped, and nothing skipped is delivered. The other order
//! would move the slot for a write that might then fail its compare-and-swap.

use crate::config::SourceTarget;
use crate::domain::StateDocument;
use crate::domain::cursor::{CursorJson, Position};
use crate::domain::transitions::{self, Operator, ResetTarget};
use crate::store::WriteCondition;

use super::{Applied, OperationError, Parts, Plan};
use crate::source::logical::progress::{key_of, position as logical_position};
use crate::source::logical::values::{lsn_text, parse_lsn};

/// Where a reset puts the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum ResetTo {
    Beginning,
    /// After the source's last settled row (the beginning when it has none).
    End,
    /// After this cursor value and key, as an operator writes them: `keys` are (column, value)
    /// pairs, every key column once, in any order.
    Cursor {
        value: String,
        keys: Vec<(String, String)>,
    },
    /// After a checkpoint cursor as a state document holds it (`inspect`'s output).
    Checkpoint(CursorJson),
}

/// Reads the document and plans the reset (a new document when the poller has none yet).
pub async fn plan(parts: Parts<'_>, to: &ResetTo, operator: Operator<'_>) -> Result<Plan, OperationError> {
    let config = parts.config;
    let key = parts.key();
    let current = parts.store.read(&key).await?;
    let target = target(parts, to).await?;
    let (before, condition) = match current {
        Some(versioned) => (Some(versioned.document), WriteCondition::Matches(versioned.etag)),
        None => (None, WriteCondition::Absent),
    };
    let base = match &before {
        Some(document) => document.clone(),
        None => StateDocument::new(&config.poller_name, &config.fingerprint),
    };
    let after = transitions::reset(&base, &target, operator, parts.clock.now(), &config.lease)?;
    Ok(Plan { key, before, after, condition })
}

async fn target(parts: Parts<'_>, to: &ResetTo) -> Result<ResetTarget, OperationError> {
    let source_config = &parts.config.source;
    if matches!(source_config.target, SourceTarget::Logical { .. }) {
        return logical_target(parts, to).await;
    }
    if matches!(source_config.target, SourceTarget::Binlog { .. }) {
        return binlog_target(parts, to).await;
    }
    match to {
        ResetTo::Beginning => Ok(ResetTarget::Beginning),
        ResetTo::End => match crate::source::last_position(parts.source).await? {
            Some(last) => Ok(ResetTarget::After(last)),
            None => Ok(ResetTarget::Beginning),
        },
        ResetTo::Cursor { value, keys } => {
            let ordered = key_values(&source_config.pk, keys)?;
            let position =
                crate::source::position::operator_position(parts.source, source_config, value, &ordered).await?;
            Ok(ResetTarget::After(position))
        }
        ResetTo::Checkpoint(json) => {
            let position = Position::try_from(json)
                .map_err(|reason| OperationError::Invalid(format!("not a checkpoint position: {reason}")))?;
            if let Err(mismatch) = position.fits_key(&source_config.pk) {
                return Err(OperationError::Invalid(format!(
                    "the checkpoint's key columns ({}) are not this poller's ({})",
                    mismatch.stored.join(", "),
                    mismatch.configured.join(", ")
                )));
            }
            Ok(ResetTarget::After(position))
        }
    }
}

/// Where a reset puts a logical poller's checkpoint: never before where its slot stands.
async fn logical_target(parts: Parts<'_>, to: &ResetTo) -> Result<ResetTarget, OperationError> {
    let Some(ends) = parts.source.slot_ends().await? else {
        return Err(OperationError::Invalid("this source reports no replication slot".into()));
    };
    let slot = &ends.slot;
    let at = lsn_text(ends.confirmed);
    let key = match to {
        ResetTo::Beginning => {
            return Err(OperationError::Invalid(format!(
                "a logical poller cannot go back to the beginning: its replication slot {slot} is at {at} and no longer \
                 holds the changes committed before it (a slot cannot go back). To deliver the tables' rows again, run a \
                 first load through a polling poller (docs/logical.md, \"The first load\"); to skip what waits, \
                 `reset --to-end`"
            )));
        }
        // Ordinal 0 comes before every change of a transaction committing at the end itself: the
        // checkpoint covers exactly the transactions the slot skips once moved there.
        ResetTo::End => (ends.end.max(ends.confirmed), 0),
        ResetTo::Cursor { value, keys } => {
            let ordinal = key_values(&parts.config.source.pk, keys)?.remove(0);
            let lsn = value.parse::<u64>().ok().or_else(|| parse_lsn(value)).ok_or_else(|| {
                OperationError::Invalid(format!(
                    "{value:?} is not a commit LSN: give it as a number (an event's `cursor`) or as PostgreSQL writes it (16/B374D848)"
                ))
            })?;
            let ordinal = ordinal.parse::<u32>().map_err(|_| {
                OperationError::Invalid(format!(
                    "--pk ordinal={ordinal}: the ordinal is a change's number in its transaction"
                ))
            })?;
            (lsn, ordinal)
        }
        ResetTo::Checkpoint(json) => {
            let position = Position::try_from(json)
                .map_err(|reason| OperationError::Invalid(format!("not a checkpoint position: {reason}")))?;
            key_of(&position).map_err(OperationError::Invalid)?
        }
    };
    // A position past the end of the WAL would move the slot to the end (the server clamps) and
    // skip, silently, every change committed before the checkpoint's: refused, as a cursor
    // above the largest integer a checkpoint holds.
    if key.0 > i64::MAX as u64 {
        return Err(OperationError::Invalid(format!(
            "commit LSN {} is above the largest a checkpoint holds ({}): give a position at or before the end of the WAL ({})",
            key.0,
            i64::MAX,
            lsn_text(ends.end.max(ends.confirmed))
        )));
    }
    if key.0 > ends.end.max(ends.confirmed) {
        return Err(OperationError::Invalid(format!(
            "commit LSN {} ({}) is past the end of the WAL ({}, commit LSN {}): no change commits there yet, and the \
             slot cannot move past the end. Give a position at or before it, or --to-end",
            key.0,
            lsn_text(key.0),
            lsn_text(ends.end.max(ends.confirmed)),
            ends.end.max(ends.confirmed)
        )));
    }
    if key.0 < ends.confirmed {
        return Err(OperationError::Invalid(format!(
            "replication slot {slot} is at {at}: it no longer holds the changes committed before it, and a slot cannot go \
             back. Give a position at or after {at} (commit LSN {}), or --to-end",
            ends.confirmed
        )));
    }
    Ok(ResetTarget::After(logical_position(key.0, key.1)))
}

/// Where a reset puts a binary-log poller's checkpoint: between the start of the oldest file the
/// server keeps (`--to-beginning`) and the end of the log (`--to-end`); a cursor as an event
/// carries it (a number) or as `file:offset` (`binlog.000042:1234`), with its ordinal, or a GTID
/// position (MariaDB: `0-1-1234`).
async fn binlog_target(parts: Parts<'_>, to: &ResetTo) -> Result<ResetTarget, OperationError> {
    use crate::domain::binlog::{BinlogPos, FileNames};
    let Some(ends) = parts.source.slot_ends().await? else {
        return Err(OperationError::Invalid("this source reports no binary log".into()));
    };
    let key = match to {
        ResetTo::Beginning => (ends.confirmed, 0),
        ResetTo::End => (ends.end, 0),
        // A GTID position (MariaDB's `0-1-1234`, several domains separated by commas): the
        // checkpoint covers every transaction up to it, and the next tick finds where that is in
        // the server's log by GTID (a dump from it), on any server of the same history.
        ResetTo::Cursor { value, keys } if value.contains('-') && !value.contains(':') => {
            use crate::domain::binlog::{BY_GTID_ONLY, GtidMark, GtidPos};
            if !keys.is_empty() {
                return Err(OperationError::Invalid(format!(
                    "--pk with a GTID position ({value}): a GTID position covers whole transactions, it takes no \
                     ordinal; give a file:offset with --pk ordinal=N to stop inside a transaction"
                )));
            }
            let before = GtidPos::parse(value).filter(|pos| !pos.is_empty()).ok_or_else(|| {
                OperationError::Invalid(format!(
                    "{value:?} is not a GTID position: give it as MariaDB writes one (0-1-1234, or 0-1-1234,1-2-56 for \
                     several domains)"
                ))
            })?;
            let mark = GtidMark { tx: None, before };
            let position = crate::source::binlog::position_marked((BY_GTID_ONLY, 0), Some(&mark));
            if let Some(reason) = parts.source.refuses_reset_to(&position).await? {
                return Err(OperationError::Invalid(format!(
                    "GTID position {value}: {reason}; give one this server holds, --to-beginning or --to-end"
                )));
            }
            return Ok(ResetTarget::After(position));
        }
        ResetTo::Cursor { value, keys } => {
            let ordinal = key_values(&parts.config.source.pk, keys)?.remove(0);
            let ordinal = ordinal.parse::<u32>().map_err(|_| {
                OperationError::Invalid(format!(
                    "--pk ordinal={ordinal}: the ordinal is a change's number in its transaction"
                ))
            })?;
            let by_name = value.rsplit_once(':').and_then(|(file, offset)| {
                let (_, number) = FileNames::parse(file)?;
                Some(BinlogPos { file: number, offset: offset.parse().ok()? }.cursor() as u64)
            });
            let cursor = value.parse::<u64>().ok().or(by_name).ok_or_else(|| {
                OperationError::Invalid(format!(
                    "{value:?} is not a binary log position: give an event's `cursor` (a number) or file:offset \
                     (binlog.000042:1234)"
                ))
            })?;
            (cursor, ordinal)
        }
        ResetTo::Checkpoint(json) => {
            let position = Position::try_from(json)
                .map_err(|reason| OperationError::Invalid(format!("not a checkpoint position: {reason}")))?;
            let at = crate::source::binlog::at_of(&position).map_err(OperationError::Invalid)?;
            if at.mark.is_some() {
                // With its GTIDs: the next tick finds it on the server read then, or stops.
                return Ok(ResetTarget::After(position));
            }
            let (pos, ordinal) = at.key;
            (pos.cursor() as u64, ordinal)
        }
    };
    if key.0 < ends.confirmed || key.0 > ends.end {
        return Err(OperationError::Invalid(format!(
            "position {} is outside the binary log the server keeps ({}..={}, {}): give one within it, \
             --to-beginning or --to-end",
            key.0, ends.confirmed, ends.end, ends.slot
        )));
    }
    Ok(ResetTarget::After(logical_position(key.0, key.1)))
}

/// What a reset of a logical poller skips, for the plan shown before it is applied.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotSkip {
    pub slot: String,
    /// Where the slot stands now.
    pub from: u64,
    /// Where the reset moves it: the new checkpoint's commit LSN.
    pub to: u64,
    /// The WAL the slot holds now.
    pub retained_bytes: Option<i64>,
    /// The changes after the current checkpoint, counted up to [`SKIP_COUNT_CAP`] (the count
    /// stopped there: `true`), or why they could not be counted.
    pub pending: Result<(u64, bool), String>,
}

/// The most changes a plan counts (each is read from the slot to be counted).
pub const SKIP_COUNT_CAP: u64 = 10_000;

/// What `plan` skips on a logical poller (`None` for the other sources, or when the reset moves
/// nothing forward). Reads the slot; writes nothing.
pub async fn slot_skip(parts: Parts<'_>, plan: &Plan) -> Result<Option<SlotSkip>, OperationError> {
    let Some(ends) = parts.source.slot_ends().await? else {
        return Ok(None);
    };
    let Ok(Some(after)) = plan.after.position() else {
        return Ok(None);
    };
    let Ok((to, _)) = key_of(&after) else {
        return Ok(None);
    };
    let before = plan.before.as_ref().and_then(|document| document.position().ok().flatten());
    let pending = match parts.source.count_after(before.as_ref(), SKIP_COUNT_CAP).await {
        Ok(count) => Ok((count, count >= SKIP_COUNT_CAP)),
        Err(error) => Err(error.to_string()),
    };
    Ok(Some(SlotSkip { slot: ends.slot, from: ends.confirmed, to, retained_bytes: ends.retained_bytes, pending }))
}

/// Writes `plan` by compare-and-swap on the version it was read at and then, once written, has
/// the source move its own position on the server (a logical source's slot) to the new
/// checkpoint. The document first: see the module's comment.
pub async fn apply(parts: Parts<'_>, plan: &Plan) -> Result<Applied, OperationError> {
    let applied = super::apply(parts.store, plan).await?;
    if let Applied::Written(_) = &applied
        && let Ok(Some(position)) = plan.after.position()
    {
        parts.source.reset_moved(&position).await.map_err(|error| OperationError::NotMoved { error })?;
    }
    Ok(applied)
}

/// The operator's key values in the configured key order: every key column exactly once.
fn key_values(columns: &[String], given: &[(String, String)]) -> Result<Vec<String>, OperationError> {
    let mut ordered = Vec::with_capacity(columns.len());
    for column in columns {
        let mut values = given.iter().filter(|(name, _)| name == column);
        let Some((_, value)) = values.next() else {
            return Err(OperationError::Invalid(format!(
                "give --pk {column}=VALUE: the position needs every key column ({})",
                columns.join(", ")
            )));
        };
        if values.next().is_some() {
            return Err(OperationError::Invalid(format!("--pk {column}=… is given twice")));
        }
        ordered.push(value.clone());
    }
    for (column, _) in given {
        if !columns.contains(column) {
            return Err(OperationError::Invalid(format!(
                "--pk {column}=…: {column:?} is not a key column of this poller ({})",
                columns.join(", ")
            )));
        }
    }
    Ok(ordered)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_values_come_in_the_configured_order_each_once() {
        let columns = vec!["tenant".to_string(), "id".to_string()];
        let pair = |column: &str, value: &str| (column.to_string(), value.to_string());
        assert_eq!(key_values(&columns, &[pair("id", "5"), pair("tenant", "1")]).unwrap(), vec!["1", "5"]);
        assert!(key_values(&columns, &[pair("id", "5")]).unwrap_err().to_string().contains("tenant=VALUE"));
        assert!(key_values(&columns, &[pair("id", "5"), pair("tenant", "1"), pair("id", "6")]).is_err());
        assert!(
            key_values(&columns, &[pair("tenant", "1"), pair("id", "5"), pair("code", "5")])
                .unwrap_err()
                .to_string()
                .contains("not a key column")
        );
    }
}
