//! The quarantine's operator side: choosing entries, replaying them through the poller's sink and
//! purging them. Every entry is read, delivered and deleted by its own name (the blob's, never the
//! `id` written inside it), deleted only by the ETag it was read at, and an entry that cannot be
//! read is reported by name while the others go on. Whatever was removed, even by a run that
//! stopped part way, is recorded in the poller's history.
//!
//! The history line is written by compare-and-swap like any operator write, while a tick may hold
//! the lease: it changes nothing but `history`, and a tick that finds only that changed under it
//! adopts it and carries on ([`crate::store::StateWriter`]).

use serde_json::Value;

use crate::domain::transitions::{self, HistoryAction, Operator};
use crate::domain::{Batch, Event};
use crate::sink::Sink;
use crate::store::quarantine::{self, StoredEntry, UnreadableEntry};
use crate::store::{BlobStore, StoreError, WriteCondition};

use super::{OperationError, Parts};

/// What a replay or a purge works on: the poller's parts, its quarantine and its sink.
#[derive(Clone, Copy)]
pub struct QuarantineParts<'a> {
    pub poller: Parts<'a>,
    pub blobs: &'a dyn BlobStore,
    pub sink: &'a dyn Sink,
}

/// Which entries a replay or a purge takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    All,
    /// By name, as `list` shows them; a name given twice is taken once.
    Names(Vec<String>),
}

/// The entries a selection names, as read (a large one without its row:
/// [`StoredEntry::for_selection`]; a replay reads each again, whole, when it delivers it), and
/// those that are there but cannot be read.
#[derive(Debug, Clone, Default)]
pub struct Chosen {
    pub entries: Vec<StoredEntry>,
    pub unreadable: Vec<UnreadableEntry>,
}

/// Reads the entries `selection` names: each named one alone, or every one page by page. A name
/// with no entry refuses the whole selection (nothing is changed); an unreadable entry is set
/// aside in [`Chosen::unreadable`].
pub async fn choose(
    blobs: &dyn BlobStore,
    app: &str,
    poller: &str,
    selection: &Selection,
) -> Result<Chosen, OperationError> {
    let mut chosen = Chosen::default();
    match selection {
        Selection::All => {
            let mut continuation = None;
            loop {
                let (listed, next) = quarantine::listed_page(blobs, app, poller, continuation).await?;
                for listed in &listed {
                    match quarantine::read_listed(blobs, listed).await? {
                        None => {}
                        Some(Ok(entry)) => chosen.entries.push(entry.for_selection()),
                        Some(Err(unreadable)) => chosen.unreadable.push(unreadable),
                    }
                }
                match next {
                    Some(next) => continuation = Some(next),
                    None => return Ok(chosen),
                }
            }
        }
        Selection::Names(names) => {
            let mut seen: Vec<&str> = Vec::new();
            for name in names {
                if seen.contains(&name.as_str()) {
                    continue;
                }
                seen.push(name);
                match quarantine::read_entry(blobs, app, poller, name).await? {
                    Some(Ok(entry)) => chosen.entries.push(entry.for_selection()),
                    Some(Err(unreadable)) => chosen.unreadable.push(unreadable),
                    None => {
                        return Err(OperationError::Invalid(format!(
                            "no quarantine entry {name:?}: nothing was changed"
                        )));
                    }
                }
            }
            Ok(chosen)
        }
    }
}

/// How far a replay is, after each entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub done: usize,
    pub total: usize,
}

/// What a replay or a purge did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    /// Entries delivered (replay) or purged and then removed from the quarantine, by name.
    pub removed: Vec<String>,
    /// Entries left in the quarantine, by name, and why.
    pub kept: Vec<(String, String)>,
    pub history: HistoryLine,
}

/// Whether the run left its line in the poller's history.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum HistoryLine {
    /// Nothing was removed: nothing to record.
    #[default]
    NothingToRecord,
    Written,
    /// The poller has no state document to write it in.
    NoDocument,
    /// It could not be written (the store failed, or the document kept changing).
    Failed(String),
}

/// How a replay or a purge ended.
#[derive(Debug, Clone, PartialEq)]
pub enum QuarantineOutcome {
    /// Every chosen entry was handled (removed, or kept with its reason).
    Finished(Tally),
    /// The run stopped at an error of the store: what it removed before is in the tally (and in
    /// the history).
    Interrupted { tally: Tally, error: String },
}

/// Delivers each chosen entry's event through the sink (its event id unchanged, the newest
/// fencing token, the generation when one is configured), one batch per entry, and removes the
/// entry once delivered. `progress` is called after each entry.
pub async fn replay(
    parts: QuarantineParts<'_>,
    chosen: &[StoredEntry],
    operator: Operator<'_>,
    progress: &mut dyn FnMut(Progress),
) -> QuarantineOutcome {
    let config = parts.poller.config;
    let (fencing_token, generation) = match delivery_terms(parts).await {
        Ok(terms) => terms,
        Err(error) => return QuarantineOutcome::Interrupted { tally: Tally::default(), error: error.to_string() },
    };
    let mut tally = Tally::default();
    let mut interrupted = None;
    for (done, chosen_entry) in chosen.iter().enumerate() {
        // Read again, whole, one entry at a time: delivered only as it was chosen.
        let stored = match quarantine::read_again(parts.blobs, chosen_entry).await {
            Ok(Some(Ok(stored))) if stored.etag == chosen_entry.etag => stored,
            Ok(Some(Ok(_))) | Ok(None) => {
                tally.kept.push((chosen_entry.name.clone(), "changed since it was read: not replayed".into()));
                progress(Progress { done: done + 1, total: chosen.len() });
                continue;
            }
            Ok(Some(Err(unreadable))) => {
                tally.kept.push((chosen_entry.name.clone(), unreadable.reason));
                progress(Progress { done: done + 1, total: chosen.len() });
                continue;
            }
            Err(error) => {
                interrupted = Some(format!("{}: cannot read it again: {error}", chosen_entry.name));
                break;
            }
        };
        let stored = &stored;
        let event = match Event::from_value(&stored.entry.event) {
            Ok(event) => event,
            Err(error) => {
                tally.kept.push((stored.name.clone(), format!("the stored event cannot be read: {error}")));
                progress(Progress { done: done + 1, total: chosen.len() });
                continue;
            }
        };
        let batch = Batch {
            poller: config.poller_name.clone(),
            batch_id: format!("replay-{}", stored.name),
            // The receiver fences on the token: the newest one issued, never an older one.
            fencing_token: fencing_token.max(stored.entry.fencing_token),
            generation: generation.clone(),
            late: false,
            events: vec![event],
        };
        let deadline = tokio::time::Instant::now() + config.batch.tick_budget;
        match parts.sink.deliver(&batch, deadline).await {
            Ok(()) => {
                // Delivered: only now is the entry removed, and only as it was read.
                match parts.blobs.delete(&stored.path, &stored.etag).await {
                    Ok(()) => tally.removed.push(stored.name.clone()),
                    Err(StoreError::Conflict { .. }) => {
                        // Written again since it was read (a tick quarantined the row anew): kept,
                        // since what is there now was not what was delivered.
                        tally.kept.push((stored.name.clone(), "delivered, but changed since it was read: kept".into()));
                    }
                    Err(error) => {
                        interrupted = Some(format!("{}: delivered, but not removed: {error}", stored.name));
                        break;
                    }
                }
            }
            Err(error) => tally.kept.push((stored.name.clone(), error.to_string())),
        }
        progress(Progress { done: done + 1, total: chosen.len() });
    }
    tally.history =
        record(parts.poller, HistoryAction::QuarantineReplay, "replayed", &tally, &interrupted, operator).await;
    match interrupted {
        Some(error) => QuarantineOutcome::Interrupted { tally, error },
        None => QuarantineOutcome::Finished(tally),
    }
}

/// Removes each chosen entry without delivering it.
pub async fn purge(parts: QuarantineParts<'_>, chosen: &[StoredEntry], operator: Operator<'_>) -> QuarantineOutcome {
    let mut tally = Tally::default();
    let mut interrupted = None;
    for stored in chosen {
        match parts.blobs.delete(&stored.path, &stored.etag).await {
            Ok(()) => tally.removed.push(stored.name.clone()),
            Err(StoreError::Conflict { .. }) => {
                // Changed or gone since it was read (a tick wrote it again, another purge):
                // never removed unseen.
                tally.kept.push((stored.name.clone(), "changed since it was read: not purged".to_string()));
            }
            Err(error) => {
                interrupted = Some(format!("{}: {error}", stored.name));
                break;
            }
        }
    }
    tally.history =
        record(parts.poller, HistoryAction::QuarantinePurge, "purged", &tally, &interrupted, operator).await;
    match interrupted {
        Some(error) => QuarantineOutcome::Interrupted { tally, error },
        None => QuarantineOutcome::Finished(tally),
    }
}

/// The fencing token and the generation a replay's batches carry: the newest token the document
/// records, and the generation its checkpoint belongs to (else the source's current one) when
/// the source has one configured.
async fn delivery_terms(parts: QuarantineParts<'_>) -> Result<(u64, Option<Value>), OperationError> {
    let poller = parts.poller;
    let document = poller.store.read(&poller.key()).await?.map(|versioned| versioned.document);
    let fencing_token =
        document.as_ref().and_then(|document| document.lease.as_ref()).map(|lease| lease.fencing_token).unwrap_or(0);
    if poller.config.source.generation.is_none() {
        return Ok((fencing_token, None));
    }
    let recorded = document.and_then(|document| document.generation).map(|record| record.value);
    let generation = match recorded {
        Some(value) => Some(value),
        None => poller.source.generation().await?,
    };
    Ok((fencing_token, generation))
}

/// Appends what was removed to the poller's history, by compare-and-swap, re-reading on a
/// conflict (a tick may be writing at the same time).
async fn record(
    poller: Parts<'_>,
    action: HistoryAction,
    verb: &str,
    tally: &Tally,
    interrupted: &Option<String>,
    operator: Operator<'_>,
) -> HistoryLine {
    if tally.removed.is_empty() {
        return HistoryLine::NothingToRecord;
    }
    let stopped = match interrupted {
        Some(error) => format!(" (stopped part way: {error})"),
        None => String::new(),
    };
    let what = format!("{verb} {} quarantined rows{stopped}: {}", tally.removed.len(), tally.removed.join(", "));
    let key = poller.key();
    for _ in 0..10 {
        let current = match poller.store.read(&key).await {
            Ok(Some(current)) => current,
            Ok(None) => return HistoryLine::NoDocument,
            Err(error) => return HistoryLine::Failed(error.to_string()),
        };
        let mut next =
            transitions::audit(&current.document, operator, action.clone(), what.clone(), poller.clock.now());
        next.write_id = Some(uuid::Uuid::new_v4().simple().to_string());
        match poller.store.write(&key, &next, WriteCondition::Matches(current.etag)).await {
            Ok(_) => return HistoryLine::Written,
            Err(StoreError::Conflict { .. }) => continue,
            Err(error) => return HistoryLine::Failed(error.to_string()),
        }
    }
    HistoryLine::Failed(format!("the state document kept changing; the history entry {what:?} was not written"))
}
