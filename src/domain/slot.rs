//! A logical source's replication slot as `status` shows it, and where it stands for an
//! operator's `reset`. Pure data; what the watchdog concludes of it is
//! [`super::watchdog::judge_slot`].

use serde::Serialize;

/// The slot, as `pg_replication_slots` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlotView {
    pub slot: String,
    /// `pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)`: the WAL the server keeps for it
    /// (`None` when it has no restart position: invalidated).
    pub retained_bytes: Option<i64>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// The process reading it now, if any.
    pub active_pid: Option<i32>,
}

impl SlotView {
    pub fn lost(&self) -> bool {
        self.wal_status.as_deref() == Some("lost")
    }
}

/// Where a logical source's slot stands and where the WAL ends, for an operator's `reset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotEnds {
    pub slot: String,
    /// `confirmed_flush_lsn`: the slot no longer holds a transaction that committed before it.
    pub confirmed: u64,
    /// `pg_current_wal_flush_lsn()`: every transaction committed before it is in the WAL.
    pub end: u64,
    /// The WAL the slot holds (`None` when it has no restart position).
    pub retained_bytes: Option<i64>,
}
