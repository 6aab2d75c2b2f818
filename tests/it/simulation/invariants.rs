//! What must hold after every step, after every tick, and once the world is quiet. Each check is
//! named; the name is what a failing run reports (and what the module documentation lists).
//!
//! A row is "accounted for" by a poller when the receiver acknowledged it for that poller (under
//! the load it belongs to, in the poller's epoch: under a fencing token at least the one its last
//! reset wrote, from a process that had not crashed), or it is in that poller's quarantine, or it
//! is excused: an operator purged it, or it was before the checkpoint a copy was cloned at (both
//! in the epoch since the last reset).
//!
//! What cannot be read is a violation, never skipped: a state document, a checkpoint or a
//! quarantine entry the observer cannot parse.

use std::cell::RefCell;
use std::collections::BTreeSet;

use dbtrigger::domain::StateDocument;
use dbtrigger::store::{StateStore, quarantine};
use dbtrigger::tick::{TickError, TickOutcome, TickReport};

use super::RowId;
use super::config::APP;
use super::sink::row_of;
use super::source::cursor_and_key;
use super::world::World;

/// Ticks in a row that fail without moving the checkpoint before a poller counts as stuck.
pub const STUCK_TICKS: u32 = 4;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub invariant: &'static str,
    pub detail: String,
}

impl Violation {
    pub fn new(invariant: &'static str, detail: String) -> Violation {
        Violation { invariant, detail }
    }
}

thread_local! {
    /// Panics of this thread's run that no script asked for (the runtime is current-thread: every
    /// task of a run panics on its thread), noted by the panic hook even where the product catches
    /// them (a read's panic becomes a source error, a delivery's a transient sink error).
    static UNSCRIPTED_PANICS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// The panic hook's note of a panic nobody scripted.
pub fn note_unscripted_panic(what: String) {
    UNSCRIPTED_PANICS.with(|panics| panics.borrow_mut().push(what));
}

/// Forgets the panics noted on this thread (a run starts).
pub fn forget_panics() {
    UNSCRIPTED_PANICS.with(|panics| panics.borrow_mut().clear());
}

fn unscripted_panic() -> Result<(), Violation> {
    match UNSCRIPTED_PANICS.with(|panics| panics.borrow().first().cloned()) {
        Some(what) => Err(Violation::new("nothing panics", format!("an unscripted panic (caught or not): {what}"))),
        None => Ok(()),
    }
}

fn unreadable(what: String) -> Violation {
    Violation::new("every stored document the poller wrote is readable", what)
}

async fn document(world: &World, index: usize) -> Result<Option<StateDocument>, Violation> {
    let key = world.pollers[index].observer.key();
    match world.clean_store().read(&key).await {
        Ok(found) => Ok(found.map(|versioned| versioned.document)),
        Err(error) => Err(unreadable(format!("the state document of {}: {error}", key.poller))),
    }
}

/// The checkpoint as (generation recorded, cursor, key), if it has one.
fn checkpoint(document: &StateDocument) -> Result<Option<(Option<u64>, i64, i64)>, Violation> {
    let position = match document.position() {
        Ok(Some(position)) => position,
        Ok(None) => return Ok(None),
        Err(error) => return Err(unreadable(format!("the checkpoint of {}: {error}", document.poller_name))),
    };
    let Some((cursor, key)) = cursor_and_key(&position) else {
        return Err(unreadable(format!(
            "the checkpoint of {} is no (cursor, key): {position:?}",
            document.poller_name
        )));
    };
    let generation = document.generation.as_ref().and_then(|record| record.value.as_u64());
    Ok(Some((generation, cursor, key)))
}

/// Rows of the current load the checkpoint of poller `index` is past (none when the checkpoint
/// belongs to another load: the next tick restarts, or cannot be read: the next check says so).
pub async fn covered_by_checkpoint(world: &World, index: usize) -> BTreeSet<RowId> {
    let found = document(world, index).await.ok().flatten();
    let Some((generation, cursor, key)) = found.as_ref().and_then(|document| checkpoint(document).ok().flatten())
    else {
        return BTreeSet::new();
    };
    let table = world.source.table.lock().unwrap();
    if generation.is_some_and(|generation| generation != table.generation) {
        return BTreeSet::new();
    }
    table.ordered().into_iter().filter(|row| (row.cursor, row.key) <= (cursor, key)).collect()
}

pub async fn fingerprint_matches(world: &World, index: usize) -> bool {
    let config = &world.pollers[index].config;
    let found = document(world, index).await.ok().flatten();
    found.is_none_or(|document| document.source_fingerprint == config.fingerprint)
}

/// Quarantined rows of poller `index`, with their entries' status and fencing token.
type Entry = (RowId, Option<u16>, u64, String);

async fn quarantined(world: &World, index: usize) -> Result<Vec<Entry>, Violation> {
    let name = &world.pollers[index].config.poller_name;
    let entries = quarantine::list(world.clean_store().as_ref(), APP, name)
        .await
        .map_err(|error| unreadable(format!("the quarantine of {name}: {error}")))?;
    let mut rows = Vec::new();
    for (entry, _) in entries {
        let Some(row) = entry.event.get("row").and_then(|row| row.as_object()).and_then(row_of) else {
            return Err(unreadable(format!("quarantine entry {} of {name} holds no row: {}", entry.id, entry.event)));
        };
        rows.push((row, entry.status, entry.fencing_token, entry.id));
    }
    Ok(rows)
}

fn accounted(world: &World, index: usize, in_quarantine: &BTreeSet<RowId>, row: &RowId) -> bool {
    let logical = &world.pollers[index];
    let acknowledged = world.sink.lock().unwrap().acknowledged_now(&logical.config.poller_name, row);
    acknowledged || in_quarantine.contains(row) || logical.excused.contains(row)
}

/// A key's versions are first delivered in source order (issue 38), whatever the window.
fn key_order(world: &World) -> Result<(), Violation> {
    match world.sink.lock().unwrap().out_of_order.first() {
        Some(what) => Err(Violation::new("a key's versions are first delivered in source order", what.clone())),
        None => Ok(()),
    }
}

/// After every step.
pub async fn check(world: &mut World) -> Result<(), Violation> {
    unscripted_panic()?;
    key_order(world)?;
    super::budget::quarantine_within_budget(world).await?;
    if let Some((invariant, what)) = world.store.stale_entries.lock().unwrap().first() {
        return Err(Violation::new(invariant, what.clone()));
    }
    let mut quarantined_rows = 0;
    for index in 0..world.pollers.len() {
        let name = world.pollers[index].config.poller_name.clone();
        let entries = quarantined(world, index).await?;
        quarantined_rows += entries.len();
        for (row, status, _, id) in &entries {
            if status.is_none() {
                return Err(Violation::new(
                    "only a refused row is quarantined",
                    format!("{name}: entry {id} (row {row:?}) was quarantined for a transient failure"),
                ));
            }
            // The receiver refuses a row itself only with 422: a 401 is the endpoint refusing
            // everything (issue 36), a 409 a stale fencing token; neither is the row's doing.
            if *status != Some(422) {
                return Err(Violation::new(
                    "a row is quarantined only for a refusal about the row",
                    format!("{name}: entry {id} (row {row:?}) was quarantined for HTTP {status:?}"),
                ));
            }
        }
        let in_quarantine: BTreeSet<RowId> = entries.iter().map(|(row, ..)| *row).collect();
        super::commits::judge(world, index).await;
        let Some(document) = document(world, index).await? else {
            continue;
        };
        // Rows written at once commit in order; a transaction's may commit behind what a poller
        // read ([`super::commits`]). The late-arrival detector, which recounts buckets of its
        // window behind the checkpoint at every tick, must never report more late rows than
        // committed behind (a reload, an update or a reset is not a late arrival).
        let behind = world.late.get(&name).cloned().unwrap_or_default();
        if let Some(late) = document.late.as_ref().filter(|late| late.found > behind.count) {
            return Err(Violation::new(
                "nothing is reported late that was not",
                format!(
                    "{name}: {} rows reported late (the most {:?} s late), {} committed behind what it read",
                    late.found, late.max_lateness_seconds, behind.count
                ),
            ));
        }
        let checkpoint = checkpoint(&document)?;
        if let Some((generation, cursor, key)) = checkpoint {
            let rows = world.source.table.lock().unwrap().ordered();
            let current = rows.first().map(|row| row.generation);
            if generation.is_none() || generation == current {
                // A version committed behind what the poller read may be passed undelivered: the
                // detector owes it (checked once the world is quiet).
                let passed = rows.iter().filter(|row| (row.cursor, row.key) <= (cursor, key));
                let mut passed = passed.filter(|row| !behind.behind.contains(row));
                if let Some(lost) = passed.find(|row| !accounted(world, index, &in_quarantine, row)) {
                    return Err(Violation::new(
                        "the checkpoint passes only delivered or quarantined rows",
                        format!("{name}: checkpoint ({cursor}, {key}) of load {generation:?} is past row {lost:?}"),
                    ));
                }
            }
        }
        let logical = &mut world.pollers[index];
        if let (Some(last), Some(now)) = (logical.last_checkpoint, checkpoint)
            && last.0 == now.0
            && (now.1, now.2) < (last.1, last.2)
        {
            return Err(Violation::new(
                "the checkpoint only moves forward",
                format!("{name}: from {last:?} back to {now:?} with no reset"),
            ));
        }
        logical.last_checkpoint = checkpoint;
    }
    world.quarantined = quarantined_rows;
    Ok(())
}

/// After each tick that ended (not crashed).
pub async fn after_tick(
    world: &mut World,
    index: usize,
    me: &str,
    result: &Result<TickOutcome, TickError>,
    report: &TickReport,
    overlapped: std::ops::Range<usize>,
) -> Result<(), Violation> {
    if let Err(TickError::Panicked { message }) = result
        && !message.contains("scripted panic")
    {
        return Err(Violation::new("nothing panics", format!("poller {index}, owner {me}: {message}")));
    }
    // Did someone else take the lease (another owner, a rival, an operator's reset) while the
    // tick ran, or did one of the writes fail?
    let (taken, faulted) = {
        let path = world.pollers[index].observer.key().blob_path();
        let log = world.store.log.lock().unwrap();
        let overlapping = &log[overlapped];
        let taken = overlapping.iter().filter(|written| written.path == path).any(|written| match &written.lease {
            Some((holder, token)) => Some(*token) != report.fencing_token || holder.as_deref().is_some_and(|h| h != me),
            None => true,
        });
        (taken, overlapping.iter().any(|written| written.faulted))
    };
    let lost = matches!(result, Ok(TickOutcome::LeaseLost { .. }) | Err(TickError::NoProgress { .. }));
    if lost && !taken && !faulted {
        return Err(Violation::new(
            "a tick loses its lease only to a takeover",
            format!(
                "poller {index}, owner {me} (token {:?}) lost its lease, yet nobody took it and no write failed: {result:?}",
                report.fencing_token
            ),
        ));
    }
    let marker = match document(world, index).await? {
        Some(document) => Some(format!("{:?} / {:?}", checkpoint(&document)?, document.generation.map(|g| g.value))),
        None => None,
    };
    let failing = match result {
        Ok(TickOutcome::Idle | TickOutcome::Delivered { .. }) => Some(false),
        Err(
            TickError::Delivery { .. }
            | TickError::SinkDown { .. }
            | TickError::NoProgress { .. }
            | TickError::FingerprintMismatch { .. }
            | TickError::Checkpoint(_)
            | TickError::PoisonStop { .. }
            | TickError::GenerationChanged { .. }
            | TickError::EndpointRefused { .. }
            | TickError::Document(_),
        ) => Some(true),
        // A scripted source or store failure, a lease held, a takeover, a reload: no verdict.
        _ => None,
    };
    // A tick overtaken by another writer could not record its failure: no verdict either.
    let failing = if taken { None } else { failing };
    let at = world.now();
    let logical = &mut world.pollers[index];
    match failing {
        Some(true) if logical.progress.as_ref() == marker.as_ref() => logical.failing_streak += 1,
        Some(true) => {
            logical.failing_streak = 1;
            logical.progress = marker;
        }
        Some(false) => {
            logical.failing_streak = 0;
            logical.progress = marker;
        }
        None => {}
    }
    // Judged as the failing tick ends, as the watchdog would judge it then.
    if failing == Some(true) && logical.failing_streak >= STUCK_TICKS {
        let name = &logical.config.poller_name;
        let health = dbtrigger::status::of_poller(name, &logical.observer, at).await;
        if health.healthy {
            return Err(Violation::new(
                "a stuck poller is reported unhealthy",
                format!(
                    "{name}: {} ticks in a row failed at checkpoint {:?}, the last with {result:?}; status says healthy (attempts {})",
                    logical.failing_streak,
                    logical.progress.as_deref().unwrap_or("none"),
                    health.attempts
                ),
            ));
        }
    }
    Ok(())
}

/// Once quiet and caught up: every row of the current load is accounted for by every poller.
pub async fn complete(world: &mut World) -> Result<(), Violation> {
    check(world).await?;
    let rows = world.source.table.lock().unwrap().ordered();
    for index in 0..world.pollers.len() {
        let in_quarantine: BTreeSet<RowId> =
            quarantined(world, index).await?.into_iter().map(|(row, ..)| row).collect();
        if let Some(lost) = rows.iter().find(|row| !accounted(world, index, &in_quarantine, row)) {
            return Err(Violation::new(
                "every row is delivered or quarantined",
                format!("{}: row {lost:?} was neither", world.pollers[index].config.poller_name),
            ));
        }
    }
    Ok(())
}

/// After each tick that ended (not crashed): it took no longer than its budget and the margin the
/// host's `functionTimeout` must leave beyond it (`TIMEOUT_MARGIN_SECONDS`, docs/hosting.md).
pub fn tick_took(world: &World, index: usize, me: &str, took: std::time::Duration) -> Result<(), Violation> {
    let bound = std::time::Duration::from_secs(world.variant.tick_budget_seconds + MARGIN_SECONDS);
    if took > bound {
        return Err(Violation::new(
            "a tick ends within its budget",
            format!(
                "poller {index}, owner {me}: the tick took {:.1} s, over its budget of {} s and the {MARGIN_SECONDS} s margin",
                took.as_secs_f64(),
                world.variant.tick_budget_seconds
            ),
        ));
    }
    Ok(())
}

/// What a tick may take beyond its budget (its last commit, the release): the margin the
/// configuration keeps before `functionTimeout`.
const MARGIN_SECONDS: u64 = 30;

/// The rows in the quarantine of poller `index` now (none readable: none).
pub async fn in_quarantine(world: &World, index: usize) -> BTreeSet<RowId> {
    quarantined(world, index)
        .await
        .map(|entries| entries.into_iter().map(|(row, ..)| row).collect())
        .unwrap_or_default()
}
