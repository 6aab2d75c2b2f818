//! The batch window (seed 004): several batches in flight, acknowledged in any order; the
//! checkpoint advances only over the contiguous prefix of acknowledged batches, so a crash can
//! never skip a batch that was sent but not acknowledged.

use std::collections::BTreeMap;

/// Batches in flight, in the order they were opened.
#[derive(Debug)]
pub struct BatchWindow<T> {
    next_sequence: u64,
    /// Opened and not yet released, with whether each was acknowledged.
    pending: BTreeMap<u64, (T, bool)>,
}

impl<T> Default for BatchWindow<T> {
    fn default() -> Self {
        BatchWindow { next_sequence: 0, pending: BTreeMap::new() }
    }
}

impl<T> BatchWindow<T> {
    pub fn new() -> Self {
        BatchWindow::default()
    }

    /// Registers a batch about to be sent; returns its sequence number.
    pub fn open(&mut self, item: T) -> u64 {
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        self.pending.insert(sequence, (item, false));
        sequence
    }

    /// The sequence number the next batch opened gets.
    pub fn next_sequence(&self) -> u64 {
        self.next_sequence
    }

    /// Records an acknowledgement and returns, in order, the batches that may now be committed:
    /// the acknowledged ones with no unacknowledged batch before them.
    pub fn acknowledge(&mut self, sequence: u64) -> Vec<T> {
        if let Some(entry) = self.pending.get_mut(&sequence) {
            entry.1 = true;
        }
        let mut ready = Vec::new();
        while let Some(entry) = self.pending.first_entry() {
            if !entry.get().1 {
                break;
            }
            ready.push(entry.remove().0);
        }
        ready
    }

    /// Removes and returns the batch `sequence` if it is the oldest one still open: the batch the
    /// checkpoint stops before (every batch before it was released). `None` otherwise.
    pub fn take_first_open(&mut self, sequence: u64) -> Option<T> {
        let entry = self.pending.first_entry()?;
        if *entry.key() != sequence {
            return None;
        }
        Some(entry.remove().0)
    }

    /// Removes and returns, in order, the batches opened after `sequence`: after a batch failed,
    /// the ones after it are given up (the checkpoint cannot pass it this tick), while the ones
    /// before it are still waited for.
    pub fn close_after(&mut self, sequence: u64) -> Vec<T> {
        let later = self.pending.split_off(&(sequence.saturating_add(1)));
        later.into_values().map(|(item, _)| item).collect()
    }

    /// Batches opened and not yet released (acknowledged behind a gap, or unacknowledged).
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_early_ack_waits_for_the_batches_before_it() {
        let mut window = BatchWindow::new();
        let first = window.open("a");
        let second = window.open("b");
        let third = window.open("c");
        assert!(window.acknowledge(third).is_empty());
        assert!(window.acknowledge(second).is_empty());
        assert_eq!(window.acknowledge(first), vec!["a", "b", "c"]);
        assert!(window.is_empty());
    }

    /// Regression (issue 24, item 1): a batch failing behind one still in flight closes the
    /// window after itself only; the earlier one is still acknowledged and released, and then the
    /// failed one is the first open, at the checkpoint.
    #[test]
    fn a_failed_batch_closes_the_window_after_itself_only() {
        let mut window = BatchWindow::new();
        let slow = window.open("slow");
        let failed = window.open("refused");
        let after = window.open("after");
        assert!(window.acknowledge(after).is_empty());
        assert_eq!(window.close_after(failed), vec!["after"]);
        assert_eq!(window.take_first_open(failed), None, "the slow one is still before it");
        assert_eq!(window.acknowledge(slow), vec!["slow"]);
        assert_eq!(window.take_first_open(failed), Some("refused"));
        assert!(window.is_empty());
        assert!(window.close_after(u64::MAX).is_empty());
    }

    proptest! {
        /// Whatever the order of acknowledgements, batches are released exactly once each, in the
        /// order they were opened, and never before every earlier batch was acknowledged.
        #[test]
        fn release_is_in_order_and_never_past_a_gap(order in Just((0u64..12).collect::<Vec<_>>()).prop_shuffle()) {
            let mut window = BatchWindow::new();
            for item in 0..12u64 {
                window.open(item);
            }
            let mut acknowledged = std::collections::BTreeSet::new();
            let mut released = Vec::new();
            for sequence in order {
                acknowledged.insert(sequence);
                let ready = window.acknowledge(sequence);
                for item in &ready {
                    prop_assert!((0..*item).all(|earlier| acknowledged.contains(&earlier)), "{} released past a gap", item);
                }
                released.extend(ready);
            }
            prop_assert_eq!(released, (0..12).collect::<Vec<_>>());
        }
    }
}
