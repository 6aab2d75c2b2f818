//! Per-key order with several batches in flight (issue 38): which of the events read so far may go
//! into the next batch, so that two events of one key never travel in batches in flight at the
//! same time and a key's events leave in the order the source gave them, while keys run in
//! parallel. The checkpoint is still the contiguous prefix of acknowledged events (seed 004).
//!
//! An event's [`Group`] names its keys as hashes of the bytes the source gave (no normalising: two
//! spellings of one value are two keys). A collision of two hashes only makes two keys wait for
//! each other. An event whose key cannot be told ([`Group::All`]: a truncate, a missing column)
//! waits for every batch in flight and holds back every event after it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};

/// The keys an event belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Group {
    /// Usually one key; an update that changed a row's key belongs to the old key and the new.
    Keys(Vec<u64>),
    /// Every key: the event is a barrier.
    All,
}

impl Group {
    /// The key made of `parts`, each hashed exactly as given (with its length, so that parts
    /// cannot run into each other).
    pub fn key_of(parts: &[&[u8]]) -> u64 {
        // Fixed keys: the same bytes give the same hash in every process.
        let mut hasher = std::hash::DefaultHasher::new();
        for part in parts {
            part.len().hash(&mut hasher);
            hasher.write(part);
        }
        hasher.finish()
    }

    pub fn one(parts: &[&[u8]]) -> Group {
        Group::Keys(vec![Group::key_of(parts)])
    }
}

/// An event's group: the source's own (`source`: the logical source's table and replica
/// identity), else the primary key as the event's `pk` JSON (`pk_json`); or, when `columns` are
/// named, their values' JSON exactly as the row holds them (a change stream's row: from `new`,
/// else `old`, with the table; a column `new` lacks, which the server did not send because the
/// change left it as it was, from `old`). A column the row lacks, or a row that is not a JSON
/// object, makes the event a barrier.
pub fn group_of(columns: Option<&[String]>, source: Option<&Group>, pk_json: &[u8], row_json: &[u8]) -> Group {
    use serde_json::value::RawValue;
    type Raw<'a> = std::collections::HashMap<&'a str, &'a RawValue>;
    let Some(columns) = columns else {
        return source.cloned().unwrap_or_else(|| Group::one(&[pk_json]));
    };
    let Ok(row) = serde_json::from_slice::<Raw<'_>>(row_json) else {
        return Group::All;
    };
    let key = |table: Option<&RawValue>, values: &Raw<'_>| -> Option<u64> {
        let mut parts: Vec<&[u8]> = Vec::with_capacity(columns.len() + 1);
        parts.extend(table.map(|table| table.get().as_bytes()));
        for column in columns {
            parts.push(values.get(column.as_str())?.get().as_bytes());
        }
        Some(Group::key_of(&parts))
    };
    if source.is_none() {
        return key(None, &row).map_or(Group::All, |key| Group::Keys(vec![key]));
    }
    // A change stream's row: `table`, `new`, `old`.
    let Some(&table) = row.get("table") else {
        return Group::All;
    };
    let image = |side: &str| {
        row.get(side)
            .filter(|value| value.get() != "null")
            .and_then(|value| serde_json::from_str::<Raw<'_>>(value.get()).ok())
    };
    let (values, old) = match (image("new"), image("old")) {
        (Some(mut new), Some(old)) => {
            for (column, value) in &old {
                new.entry(column).or_insert(value);
            }
            (new, Some(old))
        }
        (Some(values), None) | (None, Some(values)) => (values, None),
        (None, None) => return Group::All,
    };
    let Some(new_key) = key(Some(table), &values) else {
        return Group::All;
    };
    // An update that changed the named columns belongs to the old key and the new, as a change
    // of the primary key does.
    match old.and_then(|old| key(Some(table), &old)) {
        Some(old_key) if old_key != new_key => Group::Keys(vec![old_key, new_key]),
        _ => Group::Keys(vec![new_key]),
    }
}

/// A batch taken: its number and its events, in source order, each with its sequence number (its
/// place in the order events were pushed).
#[derive(Debug)]
pub struct Taken<T> {
    pub batch: u64,
    pub events: Vec<(u64, T)>,
}

#[derive(Debug)]
struct InFlight {
    events: Vec<u64>,
    keys: Vec<u64>,
    all: bool,
}

/// Events read and not sent, batches in flight, and the prefix of acknowledged events.
#[derive(Debug)]
pub struct KeyedWindow<T> {
    next_event: u64,
    next_batch: u64,
    /// Read and not sent, in source order.
    waiting: BTreeMap<u64, (Group, T)>,
    in_flight: BTreeMap<u64, InFlight>,
    /// Keys in flight, with how many batches carry them.
    busy: HashMap<u64, usize>,
    /// Batches in flight that carry a barrier.
    barriers_in_flight: usize,
    /// Keys of failed batches: none of their events is sent again in this window.
    blocked: HashSet<u64>,
    blocked_all: bool,
    /// Every event before this one is acknowledged.
    prefix: u64,
    /// Acknowledged events after the prefix.
    acknowledged: BTreeSet<u64>,
}

impl<T> Default for KeyedWindow<T> {
    fn default() -> Self {
        KeyedWindow {
            next_event: 0,
            next_batch: 0,
            waiting: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            busy: HashMap::new(),
            barriers_in_flight: 0,
            blocked: HashSet::new(),
            blocked_all: false,
            prefix: 0,
            acknowledged: BTreeSet::new(),
        }
    }
}

impl<T> KeyedWindow<T> {
    pub fn new() -> Self {
        KeyedWindow::default()
    }

    /// Adds the next event the source gave; returns its sequence number.
    pub fn push(&mut self, group: Group, item: T) -> u64 {
        let sequence = self.next_event;
        self.next_event += 1;
        self.waiting.insert(sequence, (group, item));
        sequence
    }

    /// The next batch: at most `max_events` events (and, past the first, at most `max_weight` by
    /// `weight`), taken in source order among those that may go now: an event goes when none of
    /// its keys is in flight in another batch, blocked, or held by an earlier event left waiting.
    /// `None` when no event may go.
    pub fn take(&mut self, max_events: usize, max_weight: usize, weight: impl Fn(&T) -> usize) -> Option<Taken<T>> {
        let mut chosen = Vec::new();
        let mut held: HashSet<u64> = HashSet::new();
        let mut held_all = self.blocked_all || self.barriers_in_flight > 0;
        let (mut events, mut total) = (0usize, 0usize);
        let mut batch_keys: Vec<u64> = Vec::new();
        let mut barrier = false;
        for (sequence, (group, item)) in &self.waiting {
            if held_all || events >= max_events.max(1) {
                break;
            }
            let free = match group {
                Group::All => held.is_empty() && self.in_flight.is_empty() && self.blocked.is_empty(),
                Group::Keys(keys) => keys
                    .iter()
                    .all(|key| !held.contains(key) && !self.blocked.contains(key) && !self.busy.contains_key(key)),
            };
            if !free {
                match group {
                    Group::All => held_all = true,
                    Group::Keys(keys) => held.extend(keys.iter().copied()),
                }
                continue;
            }
            let heavy = weight(item);
            if events > 0 && total.saturating_add(heavy) > max_weight {
                break;
            }
            events += 1;
            total = total.saturating_add(heavy);
            chosen.push(*sequence);
            match group {
                Group::All => barrier = true,
                Group::Keys(keys) => batch_keys.extend(keys.iter().copied()),
            }
        }
        if chosen.is_empty() {
            return None;
        }
        batch_keys.sort_unstable();
        batch_keys.dedup();
        for key in &batch_keys {
            *self.busy.entry(*key).or_default() += 1;
        }
        if barrier {
            self.barriers_in_flight += 1;
        }
        let batch = self.next_batch;
        self.next_batch += 1;
        let events = chosen
            .iter()
            .map(|sequence| (*sequence, self.waiting.remove(sequence).expect("chosen from waiting").1))
            .collect();
        self.in_flight.insert(batch, InFlight { events: chosen, keys: batch_keys, all: barrier });
        Some(Taken { batch, events })
    }

    fn land(&mut self, batch: u64) -> Option<InFlight> {
        let landed = self.in_flight.remove(&batch)?;
        for key in &landed.keys {
            if let Some(count) = self.busy.get_mut(key) {
                *count -= 1;
                if *count == 0 {
                    self.busy.remove(key);
                }
            }
        }
        if landed.all {
            self.barriers_in_flight -= 1;
        }
        Some(landed)
    }

    /// Records that `batch` was acknowledged; returns the events the acknowledged prefix now
    /// covers (`start..end`, empty when it did not move).
    pub fn acknowledge(&mut self, batch: u64) -> std::ops::Range<u64> {
        let start = self.prefix;
        if let Some(landed) = self.land(batch) {
            self.acknowledged.extend(landed.events);
        }
        while self.acknowledged.remove(&self.prefix) {
            self.prefix += 1;
        }
        start..self.prefix
    }

    /// Records that `batch` failed: its keys are blocked (none of their events is sent again by
    /// this window) and its events stay unacknowledged, so the prefix never passes them. Returns
    /// its events' sequence numbers.
    pub fn fail(&mut self, batch: u64) -> Vec<u64> {
        let Some(landed) = self.land(batch) else {
            return Vec::new();
        };
        self.blocked.extend(landed.keys.iter().copied());
        self.blocked_all |= landed.all;
        landed.events
    }

    /// Drops the events not sent (the tick stops reading and sending).
    pub fn clear_waiting(&mut self) {
        self.waiting.clear();
    }

    /// Every event before this one is acknowledged.
    pub fn prefix(&self) -> u64 {
        self.prefix
    }

    /// Events pushed so far.
    pub fn pushed(&self) -> u64 {
        self.next_event
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(k: u8) -> Group {
        Group::one(&[&[k]])
    }

    #[test]
    fn keys_run_in_parallel_and_a_key_waits_for_itself() {
        let mut window = KeyedWindow::new();
        for k in [1u8, 2, 1, 3, 2] {
            window.push(key(k), k);
        }
        let first = window.take(2, usize::MAX, |_| 1).unwrap();
        assert_eq!(first.events.iter().map(|(_, k)| *k).collect::<Vec<_>>(), vec![1, 2]);
        // Keys 1 and 2 are in flight: only key 3 may go.
        let second = window.take(10, usize::MAX, |_| 1).unwrap();
        assert_eq!(second.events.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![3]);
        assert!(window.take(10, usize::MAX, |_| 1).is_none());
        assert_eq!(window.acknowledge(second.batch), 0..0, "the prefix waits for the first batch");
        assert_eq!(window.acknowledge(first.batch), 0..2);
        let third = window.take(10, usize::MAX, |_| 1).unwrap();
        assert_eq!(third.events.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![2, 4]);
        assert_eq!(window.acknowledge(third.batch), 2..5);
    }

    #[test]
    fn a_barrier_waits_for_everything_and_holds_everything_back() {
        let mut window = KeyedWindow::new();
        window.push(key(1), 0);
        window.push(Group::All, 1);
        window.push(key(2), 2);
        let first = window.take(1, usize::MAX, |_| 1).unwrap();
        assert!(window.take(10, usize::MAX, |_| 1).is_none(), "the barrier waits; key 2 is after it");
        window.acknowledge(first.batch);
        let second = window.take(10, usize::MAX, |_| 1).unwrap();
        assert_eq!(second.events.len(), 2, "barrier then key 2, in order, in one batch");
        assert_eq!(window.acknowledge(second.batch), 1..3);
    }

    #[test]
    fn a_failed_batch_blocks_its_keys_only() {
        let mut window = KeyedWindow::new();
        for k in [1u8, 2, 1, 2] {
            window.push(key(k), k);
        }
        let first = window.take(1, usize::MAX, |_| 1).unwrap();
        let second = window.take(1, usize::MAX, |_| 1).unwrap();
        assert_eq!(window.fail(first.batch), vec![0]);
        assert_eq!(window.acknowledge(second.batch), 0..0);
        let third = window.take(10, usize::MAX, |_| 1).unwrap();
        assert_eq!(third.events.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![3], "key 1 stays blocked");
        assert_eq!(window.acknowledge(third.batch), 0..0, "never past the failed event");
        assert!(window.take(10, usize::MAX, |_| 1).is_none());
    }

    #[test]
    fn a_group_is_the_bytes_the_source_gave() {
        let pk = br#"{"id":7}"#;
        assert_eq!(group_of(None, None, pk, b"{}"), Group::one(&[pk]));
        let columns = vec!["account".to_string()];
        let a = group_of(Some(&columns), None, pk, br#"{"id":7,"account":1}"#);
        assert_eq!(a, group_of(Some(&columns), None, br#"{"id":8}"#, br#"{"account":1,"id":8}"#));
        assert_ne!(a, group_of(Some(&columns), None, pk, br#"{"id":7,"account":1.0}"#), "no normalising");
        assert_eq!(group_of(Some(&columns), None, pk, br#"{"id":7}"#), Group::All);
        let logical = Group::one(&[b"t"]);
        let insert =
            group_of(Some(&columns), Some(&logical), pk, br#"{"table":"s.t","new":{"account":"x"},"old":null}"#);
        let delete =
            group_of(Some(&columns), Some(&logical), pk, br#"{"table":"s.t","new":null,"old":{"account":"x"}}"#);
        assert_eq!(insert, delete);
        // An update whose new row lacks the column (unchanged, not sent): the old row's value.
        let update = group_of(
            Some(&columns),
            Some(&logical),
            pk,
            br#"{"table":"s.t","new":{"note":"y"},"old":{"id":7,"account":"x"}}"#,
        );
        assert_eq!(update, insert);
        let moved = group_of(
            Some(&columns),
            Some(&logical),
            pk,
            br#"{"table":"s.t","new":{"account":"z"},"old":{"account":"x"}}"#,
        );
        let (old_key, new_key) = (Group::key_of(&[br#""s.t""#, br#""x""#]), Group::key_of(&[br#""s.t""#, br#""z""#]));
        assert_eq!(insert, Group::Keys(vec![old_key]));
        assert_eq!(moved, Group::Keys(vec![old_key, new_key]), "a changed value: the old key and the new");
        assert_eq!(group_of(None, Some(&logical), pk, b"{}"), logical);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Take(usize),
        Ack(usize),
        Fail(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => (1usize..6).prop_map(Step::Take),
            3 => any::<usize>().prop_map(Step::Ack),
            1 => any::<usize>().prop_map(Step::Fail),
        ]
    }

    proptest! {
        /// For any keys (barriers among them) and any order of acknowledgements and failures:
        /// no key is in two batches in flight; each key's events are sent in source order, none
        /// after a failed batch of that key; the prefix never passes an unacknowledged event; and
        /// with no failure, every event is sent and the prefix reaches the end.
        #[test]
        fn per_key_order_and_a_prefix_of_acknowledged_events(
            keys in proptest::collection::vec(proptest::option::weighted(0.95, 0u8..6), 0..40),
            steps in proptest::collection::vec(step(), 0..120),
        ) {
            let mut window = KeyedWindow::new();
            let groups: Vec<Group> = keys.iter().map(|k| k.map(key).unwrap_or(Group::All)).collect();
            for (index, group) in groups.iter().enumerate() {
                window.push(group.clone(), index);
            }
            let mut in_flight: Vec<(u64, Vec<usize>)> = Vec::new();
            let mut sent: Vec<bool> = vec![false; groups.len()];
            let mut acknowledged: Vec<bool> = vec![false; groups.len()];
            let mut failed_keys: HashSet<u64> = HashSet::new();
            let mut failed_all = false;
            let mut failures = 0;
            let check_take = |taken: &Taken<usize>, in_flight: &[(u64, Vec<usize>)], sent: &[bool], failed_keys: &HashSet<u64>, failed_all: bool| -> Result<(), TestCaseError> {
                let ours: Vec<usize> = taken.events.iter().map(|(_, index)| *index).collect();
                prop_assert!(ours.windows(2).all(|pair| pair[0] < pair[1]), "a batch keeps source order");
                for &index in &ours {
                    prop_assert_eq!(taken.events.iter().find(|(_, i)| *i == index).unwrap().0, index as u64);
                    let overlaps = |other: usize| match (&groups[index], &groups[other]) {
                        (Group::Keys(a), Group::Keys(b)) => a.iter().any(|k| b.contains(k)),
                        _ => true,
                    };
                    // Every earlier event of its key was sent before it, or is in this batch.
                    for (earlier, was_sent) in sent.iter().enumerate().take(index) {
                        if overlaps(earlier) {
                            prop_assert!(*was_sent || ours.contains(&earlier), "event {} left before {}", index, earlier);
                        }
                    }
                    for (_, other) in in_flight {
                        for &other in other {
                            prop_assert!(!overlaps(other), "events {} and {} share a key in flight", index, other);
                        }
                    }
                    if let Group::Keys(keys) = &groups[index] {
                        prop_assert!(!failed_all && keys.iter().all(|k| !failed_keys.contains(k)), "event {} sent after its key failed", index);
                    } else {
                        prop_assert!(!failed_all && failed_keys.is_empty(), "a barrier sent after a failure");
                    }
                }
                Ok(())
            };
            let extra = (0..400).map(|i| if i % 2 == 0 { Step::Take(5) } else { Step::Ack(0) });
            let steps: Vec<Step> = steps.into_iter().chain(extra).collect();
            for step in steps {
                match step {
                    Step::Take(max) => {
                        if let Some(taken) = window.take(max, usize::MAX, |_| 1) {
                            prop_assert!(taken.events.len() <= max);
                            check_take(&taken, &in_flight, &sent, &failed_keys, failed_all)?;
                            for (_, index) in &taken.events {
                                sent[*index] = true;
                            }
                            in_flight.push((taken.batch, taken.events.iter().map(|(_, i)| *i).collect()));
                        }
                    }
                    Step::Ack(pick) | Step::Fail(pick) if in_flight.is_empty() => { let _ = pick; }
                    Step::Ack(pick) => {
                        let (batch, events) = in_flight.remove(pick % in_flight.len());
                        for index in events {
                            acknowledged[index] = true;
                        }
                        let moved = window.acknowledge(batch);
                        prop_assert!(moved.end == window.prefix());
                        prop_assert!((0..window.prefix() as usize).all(|index| acknowledged[index]), "the prefix passed an unacknowledged event");
                        let next = window.prefix() as usize;
                        prop_assert!(next == groups.len() || !acknowledged[next], "the prefix stops short");
                    }
                    Step::Fail(pick) => {
                        let (batch, events) = in_flight.remove(pick % in_flight.len());
                        failures += 1;
                        prop_assert_eq!(window.fail(batch).iter().map(|s| *s as usize).collect::<Vec<_>>(), events.clone());
                        for index in events {
                            match &groups[index] {
                                Group::Keys(keys) => failed_keys.extend(keys.iter().copied()),
                                Group::All => failed_all = true,
                            }
                        }
                    }
                }
            }
            if failures == 0 {
                prop_assert!(sent.iter().all(|s| *s), "every event was sent");
                prop_assert_eq!(window.prefix() as usize, groups.len());
            }
        }
    }
}
