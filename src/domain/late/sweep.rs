//! Which buckets a check recounts (docs/sources.md "Late arrivals", docs/late-arrivals.md).
//!
//! A recount reads every row of the buckets it covers, so that covering the whole window at every
//! check costs a fraction of a microsecond per row of the window (tens of milliseconds for 100,000
//! rows), many times an idle tick. A check therefore covers:
//!
//! - the **fresh** buckets, the newest [`FRESH_BUCKETS`] (each at most [`super::FRESH_BUCKET_ROWS`]
//!   rows): where a commit that was late by seconds lands. Every check covers them;
//! - a **slice** of the older buckets, taken in turn from the oldest: each check earns
//!   `old rows / sweepChecks` rows of credit, and recounts the next old bucket while the credit
//!   covers its rows. Over `sweepChecks` checks the credit earned is every old row: every old
//!   bucket is recounted at most `sweepChecks + 1` checks after the previous time (for a window
//!   that commits did not change meanwhile; a commit merges buckets or adds rows, and the turn
//!   goes on from the bucket that holds the cursor it had reached).
//!
//! The turn ([`Sweep`]) is the caller's to keep between checks (in memory, for the poller's
//! process: an idle tick writes nothing), and starts where `start` says (the caller spreads it, so
//! that a process restarted often does not always begin with the same buckets).

use std::cmp::Ordering;

use super::{FRESH_BUCKETS, Window};
use crate::domain::cursor::CursorValue;

/// Where the turn over the old buckets is, between checks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sweep {
    /// The first cursor of the next old bucket to recount; `None`: not begun.
    pub next: Option<CursorValue>,
    /// Rows earned and not spent yet.
    pub credit: u64,
}

/// What a check covers: bucket indices, ascending, and the turn after it (to keep only if the
/// recount succeeded).
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub indices: Vec<usize>,
    pub sweep: Sweep,
}

/// The buckets the next check of `window` recounts, the turn being `sweep`: the fresh ones and the
/// old ones the credit reaches. `start` (any number) picks the first old bucket of a turn not
/// begun.
pub fn select(window: &Window, sweep: &Sweep, sweep_checks: u32, start: u64) -> Selection {
    let count = window.buckets.len();
    let fresh = count.saturating_sub(FRESH_BUCKETS);
    let old_rows: u64 = window.buckets[..fresh].iter().map(|bucket| bucket.tally.rows.max(1)).sum();
    let mut indices = Vec::new();
    let mut next_sweep = Sweep::default();
    if fresh > 0 {
        let earned = old_rows.div_ceil(u64::from(sweep_checks.max(1)));
        let mut credit = (sweep.credit + earned).min(old_rows);
        let froms: Vec<Option<CursorValue>> =
            window.buckets[..fresh].iter().map(|bucket| bucket.from_cursor(&window.kind).ok()).collect();
        let mut at = match &sweep.next {
            None => (start % fresh as u64) as usize,
            // The bucket that holds the cursor the turn reached (buckets merged or dropped since).
            Some(next) => froms
                .iter()
                .rposition(|from| {
                    from.as_ref().and_then(|from| from.compare(next)).is_some_and(|order| order != Ordering::Greater)
                })
                .unwrap_or(0),
        };
        let mut taken = 0;
        while taken < fresh {
            let rows = window.buckets[at].tally.rows.max(1);
            if rows > credit {
                break;
            }
            credit -= rows;
            indices.push(at);
            taken += 1;
            at = (at + 1) % fresh;
        }
        next_sweep = Sweep { next: froms[at].clone(), credit };
    }
    indices.extend(fresh..count);
    indices.sort_unstable();
    indices.dedup();
    Selection { indices, sweep: next_sweep }
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};

    use super::super::{Bucket, Tally};
    use super::*;

    fn window(rows: &[u64]) -> Window {
        let mut from = 0;
        let buckets = rows
            .iter()
            .map(|rows| {
                let bucket = Bucket {
                    from: serde_json::json!(from),
                    from_text: None,
                    tally: Tally { rows: *rows, ..Tally::default() },
                    since: DateTime::<Utc>::UNIX_EPOCH,
                };
                from += *rows as i64;
                bucket
            })
            .collect();
        Window {
            kind: "integer".into(),
            identity: super::super::WINDOW_IDENTITY,
            checkpoint_batch: "b".into(),
            buckets,
        }
    }

    /// The fresh buckets at every check; every old bucket within `sweepChecks + 1` checks.
    #[test]
    fn fresh_buckets_every_check_and_every_old_one_within_the_bound() {
        for (rows, checks) in [
            (vec![6250; 16], 10u32),
            (vec![6250, 6250, 100, 3000, 6250, 6250, 6250, 64, 64, 64, 64], 7),
            (vec![1, 1, 1, 1, 1, 1], 1),
            (vec![5000, 10, 10, 10, 10, 10, 10, 10, 10, 64, 64, 64, 64], 100),
        ] {
            let window = window(&rows);
            let fresh = rows.len() - FRESH_BUCKETS;
            for start in [0u64, 3, 17] {
                let mut sweep = Sweep::default();
                let mut last_seen = vec![0usize; fresh];
                for check in 1..=(4 * checks as usize + 8) {
                    let selection = select(&window, &sweep, checks, start);
                    sweep = selection.sweep;
                    for index in fresh..rows.len() {
                        assert!(selection.indices.contains(&index), "fresh bucket {index} at check {check}");
                    }
                    for (index, seen) in last_seen.iter_mut().enumerate() {
                        if selection.indices.contains(&index) {
                            *seen = check;
                        }
                        assert!(
                            check - *seen <= checks as usize,
                            "{rows:?}, {checks} checks: bucket {index} last at check {seen}, now {check}"
                        );
                    }
                }
            }
        }
    }

    /// A check covers about `old rows / sweepChecks` old rows, not the whole window.
    #[test]
    fn a_check_recounts_a_slice_of_the_old_rows() {
        let rows = [vec![6250u64; 16], vec![64; 4]].concat();
        let window = window(&rows);
        let mut sweep = Sweep::default();
        let mut covered = Vec::new();
        for _ in 0..160 {
            let selection = select(&window, &sweep, 160, 0);
            sweep = selection.sweep;
            covered.push(selection.indices.iter().filter(|index| **index < 16).count());
        }
        // 100,000 old rows over 160 checks: one old bucket every 10 checks.
        assert_eq!(covered.iter().sum::<usize>(), 16);
        assert!(covered.iter().all(|count| *count <= 1), "{covered:?}");
    }

    /// After buckets merged, the turn goes on from the bucket that holds the cursor it reached.
    #[test]
    fn the_turn_survives_a_merge() {
        let before = window(&[10, 10, 10, 10, 1, 1, 1, 1]);
        let sweep = Sweep { next: Some(CursorValue::Integer(20)), credit: 0 };
        // Buckets from 10 and 20 merged into one from 10: the turn starts there.
        let after = window(&[10, 20, 10, 1, 1, 1, 1]);
        let selection = select(&after, &Sweep { credit: 100, ..sweep.clone() }, 1, 0);
        assert_eq!(selection.indices, vec![0, 1, 2, 3, 4, 5, 6]);
        let selection = select(&before, &Sweep { credit: 9, ..sweep }, 1_000, 0);
        assert_eq!(selection.indices, vec![2, 4, 5, 6, 7]);
    }
}
