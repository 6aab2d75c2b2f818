//! What the watchdog concludes of a logical source's replication slot: the WAL a slot holds grows
//! while nobody moves it, and a slot the server invalidated (`max_slot_wal_keep_size`) is a gap in
//! the changes. Pure.

use crate::domain::finding::{Finding, FindingKind};
use crate::domain::health::PollerHealth;
use crate::domain::slot::SlotView;

/// `slot_lost` when the server invalidated the slot; `slot_retention` when it holds more than
/// `threshold_bytes` of WAL.
pub fn judge_slot(health: &PollerHealth, threshold_bytes: u64) -> Option<Finding> {
    let finding =
        |kind, message| Finding { kind, function: health.function.clone(), poller: health.poller.clone(), message };
    if let Some(found) = judge_binlog(health, threshold_bytes) {
        return Some(finding(found.0, found.1));
    }
    if let Some(slot) = &health.slot_lost
        && !health.slot.as_ref().is_some_and(SlotView::lost)
    {
        return Some(finding(
            FindingKind::SlotLost,
            format!(
                "the poller stopped on replication slot {slot}, found lost (gone after use, or invalidated): the changes it no \
                 longer held are a gap; recreate the slot, reset the poller and load the gap again (docs/logical-operations.md, \"A lost slot\")"
            ),
        ));
    }
    let slot = health.slot.as_ref()?;
    if slot.slot.starts_with(BINLOG) {
        return None;
    }
    if slot.lost() {
        return Some(finding(
            FindingKind::SlotLost,
            format!(
                "the server invalidated replication slot {} (max_slot_wal_keep_size): the changes it dropped are gone; \
                 recreate the slot, reset the poller and load the gap again (docs/logical-operations.md, \"A lost slot\")",
                slot.slot
            ),
        ));
    }
    let retained = slot.retained_bytes?;
    if retained > 0 && retained as u64 > threshold_bytes {
        return Some(finding(
            FindingKind::SlotRetention,
            format!(
                "replication slot {} holds {} MiB of WAL (threshold {} MiB): the poller is not moving it (stopped, failing, or one long transaction)",
                slot.slot,
                retained / (1024 * 1024),
                threshold_bytes / (1024 * 1024)
            ),
        ));
    }
    None
}

/// How a binary-log source's position shows as a slot (`status`, the state document's stop).
const BINLOG: &str = "binary log ";

/// A binary-log source (issue 39): `binlog_lost` when the poller stopped on a purged file or its
/// checkpoint's file is gone; `binlog_retention` when the checkpoint is more than `threshold_bytes`
/// behind the end of the log (the server purges by age: a poller that far behind is at risk).
fn judge_binlog(health: &PollerHealth, threshold_bytes: u64) -> Option<(FindingKind, String)> {
    if let Some(file) = health.slot_lost.as_deref().and_then(|lost| lost.strip_prefix(BINLOG)) {
        return Some((
            FindingKind::BinlogLost,
            format!(
                "the poller stopped on binary log {file}, purged before it was read: the changes it held are a gap; \
                 reset the poller and load the gap again (docs/binlog.md, \"A purged binary log\")"
            ),
        ));
    }
    let slot = health.slot.as_ref().filter(|slot| slot.slot.starts_with(BINLOG))?;
    if slot.lost() {
        return Some((
            FindingKind::BinlogLost,
            format!("the checkpoint's {} is purged: the changes it held are a gap (docs/binlog.md)", slot.slot),
        ));
    }
    let behind = slot.retained_bytes.filter(|bytes| *bytes > 0 && *bytes as u64 > threshold_bytes)?;
    Some((
        FindingKind::BinlogRetention,
        format!(
            "the checkpoint is {} MiB behind the end of the binary log (in {}; threshold {} MiB): the server purges \
             its files by age (binlog_expire_logs_seconds), and a file purged before it is read is a gap",
            behind / (1024 * 1024),
            slot.slot,
            threshold_bytes / (1024 * 1024)
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(retained: Option<i64>, wal_status: &str) -> PollerHealth {
        let mut health = PollerHealth::empty("feed", "feed");
        health.slot = Some(SlotView {
            slot: "s".into(),
            retained_bytes: retained,
            wal_status: Some(wal_status.into()),
            active_pid: None,
        });
        health
    }

    #[test]
    fn retention_past_the_threshold_and_a_lost_slot_are_reported() {
        assert_eq!(judge_slot(&health(Some(10), "reserved"), 100), None);
        let grown = judge_slot(&health(Some(200 << 20), "extended"), 100 << 20).expect("past the threshold");
        assert_eq!(grown.kind, FindingKind::SlotRetention);
        assert!(grown.message.contains("200 MiB"), "{}", grown.message);
        assert_eq!(judge_slot(&health(None, "lost"), 100).unwrap().kind, FindingKind::SlotLost);
        assert_eq!(judge_slot(&PollerHealth::empty("f", "f"), 0), None, "no slot, nothing to say");
        // A slot gone after use: the stop recorded in the document says so, with no slot to read.
        let mut stopped = PollerHealth::empty("feed", "feed");
        stopped.slot_lost = Some("s".into());
        let finding = judge_slot(&stopped, 100).expect("a stop on a lost slot");
        assert_eq!(finding.kind, FindingKind::SlotLost);
        assert!(
            finding.message.contains("replication slot s") && finding.message.contains("gap"),
            "{}",
            finding.message
        );
    }
}

#[cfg(test)]
mod binlog_tests {
    use super::*;

    fn binlog_health(behind: i64, status: &str) -> PollerHealth {
        let mut health = PollerHealth::empty("feed", "feed");
        health.slot = Some(SlotView {
            slot: "binary log binlog.000003".into(),
            retained_bytes: Some(behind),
            wal_status: Some(status.into()),
            active_pid: None,
        });
        health
    }

    #[test]
    fn a_binary_log_far_behind_or_purged_is_reported_as_binlog() {
        assert_eq!(judge_slot(&binlog_health(10, "0 files after it"), 100), None);
        assert_eq!(
            judge_slot(&binlog_health(1000, "2 files after it"), 100).unwrap().kind,
            FindingKind::BinlogRetention
        );
        assert_eq!(judge_slot(&binlog_health(0, "lost"), 100).unwrap().kind, FindingKind::BinlogLost);
        let mut stopped = binlog_health(0, "0 files after it");
        stopped.slot_lost = Some("binary log binlog.000001".into());
        let finding = judge_slot(&stopped, 100).unwrap();
        assert_eq!(finding.kind, FindingKind::BinlogLost);
        assert!(finding.message.contains("binlog.000001"));
    }
}
