//! What the watchdog reports: one finding per thing a person should look at. Pure data, below
//! every judgement that makes one ([`super::watchdog`]).
//!
//! | finding              | when                                                                   |
//! |----------------------|------------------------------------------------------------------------|
//! | `config_error`       | the function cannot run                                                |
//! | `unreadable`         | its state document or its source cannot be read                       |
//! | `stalled`            | rows wait and the checkpoint has not moved for `stalledAfterIntervals` of its schedule |
//! | `lease_abandoned`    | a lease expired (past the skew margin) without being released: a tick died mid-work and nobody resumed |
//! | `failing`            | ticks fail at the checkpoint (`attempts` above zero: the batch there, or the source, the store…), growing or not |
//! | `endpoint_refused`   | the receiver refuses every row alike (a 401, a gateway's 404, a redirect, a queue's 403): the poller holds, nothing is quarantined (in place of `failing`) |
//! | `quarantine_grew`    | more rows quarantined than at the previous run                        |
//! | `quarantine_budget_spent` | a row refused alone found `poison.maxQuarantinedPerHour` spent: the poller holds, nothing more is quarantined (in place of `failing`) |
//! | `fingerprint_changed`| the source definition changed: the poller stops until reset or accepted |
//! | `generation_changed` | the source generation moved and the poller stops (`onChange: stop`)     |
//! | `late_arrivals`      | the late-arrival detector found (and delivered) more rows than at the previous run |
//! | `horizon_held`       | rows wait behind a transaction open (or seen holding) longer than `horizonHeldAfterSeconds` |
//! | `slot_retention`     | a logical source's slot holds more WAL than `slotRetentionBytes`      |
//! | `slot_lost`          | the server invalidated a logical source's slot: a gap                  |
//! | `binlog_retention`   | a binary-log source's checkpoint is more than `slotRetentionBytes` behind the log's end |
//! | `binlog_lost`        | a binary-log source's checkpoint is in a purged file: a gap            |
//!
//! `stalled` and `lease_abandoned` are what a tick can fix, so `kick` runs one for them.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    ConfigError,
    Unreadable,
    Stalled,
    LeaseAbandoned,
    Failing,
    EndpointRefused,
    QuarantineGrew,
    QuarantineBudgetSpent,
    FingerprintChanged,
    GenerationChanged,
    LateArrivals,
    HorizonHeld,
    SlotRetention,
    SlotLost,
    BinlogRetention,
    BinlogLost,
}

impl FindingKind {
    pub fn name(self) -> &'static str {
        match self {
            FindingKind::ConfigError => "config_error",
            FindingKind::Unreadable => "unreadable",
            FindingKind::Stalled => "stalled",
            FindingKind::LeaseAbandoned => "lease_abandoned",
            FindingKind::Failing => "failing",
            FindingKind::EndpointRefused => "endpoint_refused",
            FindingKind::QuarantineGrew => "quarantine_grew",
            FindingKind::QuarantineBudgetSpent => "quarantine_budget_spent",
            FindingKind::FingerprintChanged => "fingerprint_changed",
            FindingKind::GenerationChanged => "generation_changed",
            FindingKind::LateArrivals => "late_arrivals",
            FindingKind::HorizonHeld => "horizon_held",
            FindingKind::SlotRetention => "slot_retention",
            FindingKind::SlotLost => "slot_lost",
            FindingKind::BinlogRetention => "binlog_retention",
            FindingKind::BinlogLost => "binlog_lost",
        }
    }

    /// A tick can fix it.
    pub fn kickable(self) -> bool {
        matches!(self, FindingKind::Stalled | FindingKind::LeaseAbandoned)
    }
}

/// One thing a person should look at.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub kind: FindingKind,
    pub function: String,
    pub poller: String,
    pub message: String,
}
