//! A logical source's slot as an operator and a failed read see it: where it stands and where the
//! WAL ends (for `reset`), moving it forward to where a reset put the checkpoint, and telling a
//! lost slot (invalidated by the server, or gone after it was used) from any other failure.

use sqlx::postgres::PgPool;

use super::values::{lsn_text, parse_lsn};

/// The slot's row in `pg_replication_slots`, with the end of the flushed WAL.
pub(super) struct SlotRow {
    /// `None` when the slot has no confirmed position (invalidated, or never used).
    pub confirmed: Option<u64>,
    pub end: u64,
    pub retained_bytes: Option<i64>,
    pub wal_status: Option<String>,
}

/// `confirmed_flush_lsn`, the flushed end, the WAL retained and `wal_status`, as the server gives them.
type RawSlotRow = (Option<String>, String, Option<i64>, Option<String>);

/// The slot's row, `None` when there is no such slot.
pub(super) async fn slot_row(pool: &PgPool, slot: &str) -> Result<Option<SlotRow>, sqlx::Error> {
    let row: Option<RawSlotRow> = sqlx::query_as(
        "SELECT confirmed_flush_lsn::text, pg_current_wal_flush_lsn()::text, \
         pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, wal_status \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|(confirmed, end, retained_bytes, wal_status)| SlotRow {
        confirmed: confirmed.as_deref().and_then(parse_lsn),
        end: parse_lsn(&end).unwrap_or(0),
        retained_bytes,
        wal_status,
    }))
}

/// Moves the slot forward to `lsn`; a slot already there or past it stays where it is.
pub(super) async fn advance_to(pool: &PgPool, slot: &str, lsn: u64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "SELECT pg_replication_slot_advance(slot_name, $2::pg_lsn) FROM pg_replication_slots \
         WHERE slot_name = $1 AND confirmed_flush_lsn < $2::pg_lsn",
    )
    .bind(slot)
    .bind(lsn_text(lsn))
    .fetch_all(pool)
    .await?;
    Ok(())
}

/// Why the slot is lost, if it is: the server invalidated it (`wal_status` `lost`), or it does not
/// exist although the poller has a checkpoint (`used`: it read from it before). A slot that does not
/// exist for a poller that never delivered anything is a set-up not done yet, not a gap.
pub(super) fn lost_reason(row: Option<&SlotRow>, used: bool) -> Option<String> {
    match row {
        None if used => Some(
            "it does not exist, and the poller has a checkpoint: the slot was dropped after the poller read from it"
                .to_string(),
        ),
        None => None,
        Some(row) if row.wal_status.as_deref() == Some("lost") => Some(
            "the server invalidated it (wal_status lost: it held more WAL than max_slot_wal_keep_size allows), \
             and removed WAL it had not decoded yet"
                .to_string(),
        ),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(wal_status: &str) -> SlotRow {
        SlotRow { confirmed: None, end: 0, retained_bytes: None, wal_status: Some(wal_status.into()) }
    }

    #[test]
    fn a_slot_is_lost_when_invalidated_or_gone_after_use() {
        assert!(lost_reason(Some(&row("lost")), false).unwrap().contains("invalidated"));
        assert!(lost_reason(Some(&row("lost")), true).is_some());
        assert!(lost_reason(None, true).unwrap().contains("does not exist"));
        assert_eq!(lost_reason(None, false), None, "never used: the set-up is not done yet");
        assert_eq!(lost_reason(Some(&row("reserved")), true), None);
        assert_eq!(lost_reason(Some(&row("unreserved")), true), None, "at risk, not lost yet");
    }
}
