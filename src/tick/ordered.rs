//! The ordered window of a tick (issue 38): the events read, sent in batches that
//! [`KeyedWindow`] makes so that a key's events are never in two batches in flight and leave in
//! source order; the checkpoint moves over the contiguous prefix of acknowledged events.

use std::collections::{HashMap, VecDeque};

use crate::domain::Position;
use crate::domain::event::{Batch, Event};
use crate::domain::ids::batch_id;
use crate::domain::keyed::KeyedWindow;

use super::budget::Hold;
use super::reader::{BatchMaker, Prepared};

/// A batch of the ordered window in flight.
struct Info {
    batch_id: String,
    /// Its first and last events, and how many it holds.
    first: u64,
    last: u64,
    events: usize,
}

pub(super) struct Ordered {
    window: KeyedWindow<(Event, Position)>,
    /// What every batch of the tick shares (poller, token, generation, late), without events.
    head: Option<Batch>,
    /// The positions of the events from the prefix on (`positions[0]` is event `base`).
    positions: VecDeque<Position>,
    base: u64,
    /// The byte budget of each read, given back once the prefix passes its last event.
    holds: VecDeque<(u64, Hold)>,
    in_flight: HashMap<u64, Info>,
    /// The last event of each batch acknowledged and not yet under the checkpoint.
    landed: std::collections::BTreeMap<u64, usize>,
}

/// A run of events the prefix now covers.
pub(super) struct Covered {
    pub(super) batch_id: String,
    pub(super) first: Position,
    pub(super) last: Position,
    pub(super) positions: Vec<Position>,
    /// The batches whose every event the run brings under the checkpoint.
    pub(super) batches: usize,
}

impl Ordered {
    pub(super) fn new() -> Ordered {
        Ordered {
            window: KeyedWindow::new(),
            head: None,
            positions: VecDeque::new(),
            base: 0,
            holds: VecDeque::new(),
            in_flight: HashMap::new(),
            landed: std::collections::BTreeMap::new(),
        }
    }

    /// Takes a batch read: its events wait for their keys.
    pub(super) fn accept(&mut self, prepared: Prepared) {
        let Prepared { mut batch, positions, hold, groups } = prepared;
        let events = std::mem::take(&mut batch.events);
        if self.head.is_none() {
            self.head = Some(batch);
        }
        for ((event, position), group) in events.into_iter().zip(positions).zip(groups) {
            self.positions.push_back(position.clone());
            self.window.push(group, (event, position));
        }
        self.holds.push_back((self.window.pushed(), hold));
    }

    /// Events read and not sent.
    pub(super) fn waiting(&self) -> usize {
        self.window.waiting()
    }

    pub(super) fn idle(&self) -> bool {
        self.window.in_flight() == 0
    }

    pub(super) fn clear_waiting(&mut self) {
        self.window.clear_waiting();
    }

    /// The next batch that may go, with its number in the window.
    pub(super) fn next(&mut self, maker: &BatchMaker, rows: usize, bytes: usize) -> Option<(u64, Prepared)> {
        let head = self.head.as_ref()?;
        let taken = self.window.take(rows, bytes, |(event, _)| event.encoded_len())?;
        let first = taken.events.first().map(|(sequence, _)| *sequence).unwrap_or_default();
        let last = taken.events.last().map(|(sequence, _)| *sequence).unwrap_or_default();
        let (events, positions): (Vec<Event>, Vec<Position>) =
            taken.events.into_iter().map(|(_, (event, position))| (event, position)).unzip();
        let id = batch_id(
            &maker.poller,
            &maker.fingerprint,
            positions.first().expect("a batch is never empty"),
            positions.last().expect("a batch is never empty"),
            events.len(),
        );
        self.in_flight.insert(taken.batch, Info { batch_id: id.clone(), first, last, events: events.len() });
        let batch = Batch { batch_id: id, events, ..head.clone() };
        Some((taken.batch, Prepared { batch, positions, hold: Hold::default(), groups: Vec::new() }))
    }

    /// `batch` was acknowledged: the events the prefix now covers, if it moved.
    pub(super) fn acknowledge(&mut self, batch: u64) -> Option<Covered> {
        let info = self.in_flight.remove(&batch)?;
        *self.landed.entry(info.last).or_default() += 1;
        let moved = self.window.acknowledge(batch);
        if moved.is_empty() {
            return None;
        }
        let later = self.landed.split_off(&moved.end);
        let batches = std::mem::replace(&mut self.landed, later).into_values().sum();
        let positions: Vec<Position> = self.positions.drain(..(moved.end - moved.start) as usize).collect();
        self.base = moved.end;
        while self.holds.front().is_some_and(|(end, _)| *end <= moved.end) {
            self.holds.pop_front();
        }
        Some(Covered {
            batch_id: info.batch_id,
            first: positions.first().expect("the prefix moved").clone(),
            last: positions.last().expect("the prefix moved").clone(),
            positions,
            batches,
        })
    }

    /// `batch` failed: its keys are blocked for the rest of the tick. Returns its first event.
    pub(super) fn fail(&mut self, batch: u64) -> u64 {
        self.window.fail(batch);
        self.in_flight.get(&batch).map(|info| info.first).unwrap_or(u64::MAX)
    }

    /// Whether the failed `batch` sits at the checkpoint as a batch of today's window would: its
    /// events follow one another and every event before them is acknowledged.
    pub(super) fn at_the_checkpoint(&self, batch: u64) -> bool {
        self.in_flight
            .get(&batch)
            .is_some_and(|info| info.first == self.window.prefix() && info.last - info.first + 1 == info.events as u64)
    }

    pub(super) fn first_event(&self, batch: u64) -> u64 {
        self.in_flight.get(&batch).map(|info| info.first).unwrap_or(u64::MAX)
    }
}
