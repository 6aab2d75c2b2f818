//! Versions committed out of order (issue 35): what each poller may have passed unseen, and what
//! the late-arrival detector owes it.
//!
//! When a transaction commits, each of its versions is judged for each poller:
//!
//! - a delivering read of that poller went past it (same load): it may have been passed unseen,
//!   so it is **committed behind** the checkpoint. The checkpoint may pass it undelivered; it must
//!   still be delivered (late, by the detector) or quarantined before the run ends.
//! - once the checkpoint is past it (judged after the step in which it got there: a tick in
//!   flight may commit past it later), it is older than the first bucket of the poller's
//!   late-arrival window (or there is no window reaching the checkpoint): the detector cannot
//!   see it, by its documented bound. It is **beyond the window**, and excused.
//!
//! A row the poller had passed that left its range (an update moved it past the checkpoint, or
//! into another bucket) around a late commit excuses nothing: the recount's moments tell the
//! versions that left a bucket from one that came (issue 45, finding 9; docs/late-arrivals.md).
//!
//! Every version committed behind counts: the detector may never report more late rows than
//! that ("nothing is reported late that was not").

use std::collections::{BTreeMap, BTreeSet};

use dbtrigger::store::StateStore;

use super::RowId;
use super::world::World;

/// Idle ticks in a row that make a poller caught up once the world is quiet: one, and a whole
/// turn of the detector's sweep over the window's older buckets (`sweepChecks` 3 in
/// `config.rs`), so that a late row in an old bucket is found before the run is judged.
pub const IDLE_TICKS_TO_SWEEP: usize = 4;

/// What one poller may have passed unseen.
#[derive(Debug, Clone, Default)]
pub struct LateLedger {
    /// Versions committed behind what the poller read: excused from "the checkpoint passes only
    /// delivered rows", not from being delivered in the end.
    pub behind: BTreeSet<RowId>,
    /// Versions committed behind, in all (including the ones beyond the window): the most late
    /// rows the detector may report.
    pub count: u64,
    /// Of those, the versions beyond the window (excused).
    pub beyond: u64,
    /// Versions of `behind` whose place against the window was judged.
    pub judged: BTreeSet<RowId>,
}

/// Judges the versions a commit made visible, for every poller (see the module).
pub async fn committed(world: &mut World, versions: &[RowId]) {
    if versions.is_empty() {
        return;
    }
    for index in 0..world.pollers.len() {
        let name = world.pollers[index].config.poller_name.clone();
        let behind: Vec<RowId> = versions.iter().copied().filter(|row| world.source.read_past(&name, row)).collect();
        if behind.is_empty() {
            continue;
        }
        let ledger = world.late.entry(name.clone()).or_default();
        for row in &behind {
            ledger.count += 1;
            ledger.behind.insert(*row);
        }
        world.note_public(format!("{index}/committed behind what it read: {behind:?}"));
    }
}

/// After every step: the versions committed behind that the checkpoint now passes are judged
/// against the window it reaches (see the module).
pub async fn judge(world: &mut World, index: usize) {
    let name = world.pollers[index].config.poller_name.clone();
    let Some(ledger) = world.late.get(&name) else {
        return;
    };
    let waiting: Vec<RowId> = ledger.behind.difference(&ledger.judged).copied().collect();
    if waiting.is_empty() {
        return;
    }
    let sight = Sight::of(world, index).await;
    let passed: Vec<RowId> = waiting.into_iter().filter(|row| sight.passed(row)).collect();
    let beyond: Vec<RowId> = passed.iter().copied().filter(|row| sight.beyond(row)).collect();
    let ledger = world.late.get_mut(&name).expect("read above");
    ledger.judged.extend(passed.iter().copied());
    ledger.beyond += beyond.len() as u64;
    if !beyond.is_empty() {
        world.pollers[index].excused.extend(beyond.iter().copied());
        world.note_public(format!("{index}/late versions beyond the window (excused): {beyond:?}"));
    }
}

/// What poller `index`'s state document covers: its checkpoint (load, cursor, key) and the first
/// cursor of its late-arrival window, when the window reaches the checkpoint.
struct Sight {
    checkpoint: Option<(Option<u64>, i64, i64)>,
    window_from: Option<i64>,
}

impl Sight {
    async fn of(world: &World, index: usize) -> Sight {
        let key = world.pollers[index].observer.key();
        let document = match world.clean_store().read(&key).await {
            Ok(Some(versioned)) => versioned.document,
            _ => return Sight { checkpoint: None, window_from: None },
        };
        let position = document.position().ok().flatten();
        let generation = document.generation.as_ref().and_then(|record| record.value.as_u64());
        let checkpoint =
            position.as_ref().and_then(super::source::cursor_and_key).map(|(cursor, key)| (generation, cursor, key));
        let window_from = document.checkpoint.as_ref().and_then(|checkpoint| {
            let window = document.late.as_ref()?.window.as_ref()?;
            if window.checkpoint_batch != checkpoint.last_successful_batch_id {
                return None;
            }
            window.buckets.first()?.from.as_i64()
        });
        Sight { checkpoint, window_from }
    }

    /// The checkpoint (of `row`'s load) is at or past `row`.
    fn passed(&self, row: &RowId) -> bool {
        let Some((generation, cursor, key)) = self.checkpoint else {
            return false;
        };
        generation.is_none_or(|generation| generation == row.generation) && (row.cursor, row.key) <= (cursor, key)
    }

    /// The checkpoint is past `row` and no window reaching it covers `row`.
    fn beyond(&self, row: &RowId) -> bool {
        self.passed(row) && self.window_from.is_none_or(|from| row.cursor < from)
    }
}

/// A copy cloned from the poller inherits what the poller read and owes.
pub fn cloned(world: &mut World, from: &str, to: &str) {
    let ledger = world.late.get(from).cloned().unwrap_or_default();
    world.late.insert(to.to_string(), ledger);
    let read: BTreeMap<String, (u64, i64, i64)> = world.source.read_past.lock().unwrap().clone();
    if let Some(past) = read.get(from) {
        world.source.read_past.lock().unwrap().insert(to.to_string(), *past);
    }
}

/// `fingerprint accept` dropped poller `index`'s window (documented: a row committed late behind
/// the checkpoint before the next commit starts a new one is not found): the versions it still
/// owed are beyond the window now, excused.
pub fn window_dropped(world: &mut World, index: usize) {
    let name = world.pollers[index].config.poller_name.clone();
    let Some(ledger) = world.late.get_mut(&name) else {
        return;
    };
    let owed: Vec<RowId> = std::mem::take(&mut ledger.behind).into_iter().collect();
    ledger.beyond += owed.len() as u64;
    world.pollers[index].excused.extend(owed);
}
