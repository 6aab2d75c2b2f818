//! `dbtrigger quarantine list | show | replay | purge`: the rows a poller isolated as poison,
//! against the app's real store, through [`crate::operations::quarantine`]. Writes (replay,
//! purge) show what they will do and ask for confirmation on a terminal (refuse without one unless
//! `--yes`). An entry that cannot be read is named on stderr, the others go on, and the exit code
//! is then 1.

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::operator::{Guard, find_poller, operator_name};
use crate::operations::quarantine::{
    self as operations, Chosen, HistoryLine, Progress, QuarantineOutcome, QuarantineParts, Tally,
};
use crate::operations::{Operator, Parts};
use crate::store::BlobStore;
use crate::store::quarantine::{self, StoredEntry, UnreadableEntry};
use crate::tick::Poller;

pub use crate::operations::quarantine::Selection;

/// How often a replay on a terminal says how far it is.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

fn open(app_root: &Path, poller_name: &str) -> anyhow::Result<(Arc<Poller>, Arc<dyn BlobStore>)> {
    let poller = find_poller(app_root, poller_name)?;
    let blobs = poller.quarantine.clone().context("this poller keeps no quarantine")?;
    Ok((poller, blobs))
}

fn summary(stored: &StoredEntry) -> Value {
    let entry = &stored.entry;
    json!({
        "id": stored.name,
        "pk": entry.event.get("pk"),
        "cursor": entry.event.get("cursor"),
        "error": entry.error,
        "status": entry.status,
        "attempts": entry.attempts,
        "quarantined_at": entry.quarantined_at,
        "event": entry.event,
    })
}

fn report_unreadable(unreadable: &[UnreadableEntry]) {
    for entry in unreadable {
        eprintln!("quarantine entry {} cannot be read, left as it is: {}", entry.name, entry.reason);
    }
}

/// Every entry, page by page as the store lists them: a table, or one JSON array.
pub async fn list(app_root: &Path, poller_name: &str, as_json: bool) -> anyhow::Result<ExitCode> {
    let (poller, blobs) = open(app_root, poller_name)?;
    let config = &poller.config;
    let mut count = 0usize;
    let mut unreadable = 0usize;
    let mut continuation = None;
    if as_json {
        print!("[");
    } else {
        println!("{:<36}  {:<20}  {:<26}  {:>6}  {:>8}  error", "id", "pk", "cursor", "status", "attempts");
    }
    loop {
        let (listed, next) =
            quarantine::listed_page(blobs.as_ref(), &config.app_name, &config.poller_name, continuation).await?;
        // One entry read at a time, printed, and let go: an entry holds a whole row.
        for listed in &listed {
            let stored = match quarantine::read_listed(blobs.as_ref(), listed).await? {
                None => continue,
                Some(Ok(stored)) => stored,
                Some(Err(entry)) => {
                    report_unreadable(std::slice::from_ref(&entry));
                    unreadable += 1;
                    continue;
                }
            };
            if as_json {
                let separator = if count == 0 { "\n" } else { ",\n" };
                print!("{separator}{}", indent(&serde_json::to_string_pretty(&summary(&stored))?));
            } else {
                print_row(&stored);
            }
            count += 1;
        }
        match next {
            Some(next) => continuation = Some(next),
            None => break,
        }
    }
    if as_json {
        println!("{}]", if count == 0 { "" } else { "\n" });
    } else {
        println!("{count} quarantined rows");
    }
    Ok(if unreadable == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// A pretty JSON object as an element of a pretty array.
fn indent(object: &str) -> String {
    object.lines().map(|line| format!("  {line}")).collect::<Vec<_>>().join("\n")
}

fn print_row(stored: &StoredEntry) {
    let entry = &stored.entry;
    let pk = entry.event.get("pk").map(Value::to_string).unwrap_or_default();
    let cursor = entry.event.get("cursor").map(Value::to_string).unwrap_or_default();
    let status = entry.status.map(|status| status.to_string()).unwrap_or_else(|| "-".into());
    let error: String = entry.error.chars().take(80).collect();
    println!("{:<36}  {pk:<20}  {cursor:<26}  {status:>6}  {:>8}  {error}", stored.name, entry.attempts);
}

/// One entry, read alone by its name.
pub async fn show(app_root: &Path, poller_name: &str, name: &str) -> anyhow::Result<ExitCode> {
    let (poller, blobs) = open(app_root, poller_name)?;
    let config = &poller.config;
    match quarantine::read_entry(blobs.as_ref(), &config.app_name, &config.poller_name, name).await? {
        Some(Ok(stored)) => {
            println!("{}", serde_json::to_string_pretty(&stored.entry)?);
            Ok(ExitCode::SUCCESS)
        }
        Some(Err(unreadable)) => bail!("quarantine entry {} cannot be read: {}", unreadable.name, unreadable.reason),
        None => bail!("no quarantine entry {name:?} for poller {poller_name}"),
    }
}

/// The chosen entries, once shown and confirmed; `None`: nothing to do (an empty quarantine, a
/// dry run, a declined question).
async fn chosen(
    app_root: &Path,
    poller_name: &str,
    selection: &Selection,
    guard: &Guard,
    verb: &str,
) -> anyhow::Result<Option<(Arc<Poller>, Arc<dyn BlobStore>, Chosen)>> {
    let (poller, blobs) = open(app_root, poller_name)?;
    let config = &poller.config;
    let chosen = operations::choose(blobs.as_ref(), &config.app_name, &config.poller_name, selection).await?;
    report_unreadable(&chosen.unreadable);
    if chosen.entries.is_empty() {
        println!("the quarantine has no readable entry to {verb}");
        return Ok(None);
    }
    println!("{verb} {} quarantined rows:", chosen.entries.len());
    for stored in &chosen.entries {
        let pk = stored.entry.event.get("pk").map(Value::to_string).unwrap_or_default();
        println!("  {}  pk {pk}", stored.name);
    }
    if !guard.confirmed(&format!("{verb} these rows?"))? {
        return Ok(None);
    }
    Ok(Some((poller, blobs, chosen)))
}

pub async fn purge(app_root: &Path, poller_name: &str, selection: Selection, guard: Guard) -> anyhow::Result<ExitCode> {
    let Some((poller, blobs, chosen)) = chosen(app_root, poller_name, &selection, &guard, "purge").await? else {
        return Ok(ExitCode::SUCCESS);
    };
    let who = operator_name();
    let operator = Operator { who: &who, force: false, reason: guard.reason.as_deref() };
    let parts = QuarantineParts { poller: Parts::of(&poller), blobs: blobs.as_ref(), sink: poller.sink.as_ref() };
    let outcome = operations::purge(parts, &chosen.entries, operator).await;
    conclude("purged", outcome, chosen.unreadable.len())
}

pub async fn replay(
    app_root: &Path,
    poller_name: &str,
    selection: Selection,
    guard: Guard,
) -> anyhow::Result<ExitCode> {
    let Some((poller, blobs, chosen)) = chosen(app_root, poller_name, &selection, &guard, "replay").await? else {
        return Ok(ExitCode::SUCCESS);
    };
    let who = operator_name();
    let operator = Operator { who: &who, force: false, reason: guard.reason.as_deref() };
    let parts = QuarantineParts { poller: Parts::of(&poller), blobs: blobs.as_ref(), sink: poller.sink.as_ref() };
    let on_terminal = std::io::stderr().is_terminal();
    let started = Instant::now();
    let mut last_said = started;
    let mut said_anything = false;
    let mut progress = |progress: Progress| {
        if !on_terminal || last_said.elapsed() < PROGRESS_EVERY || progress.done == progress.total {
            return;
        }
        last_said = Instant::now();
        said_anything = true;
        let rate = progress.done as f64 / started.elapsed().as_secs_f64().max(0.001);
        eprint!(
            "\r{} of {} replayed, {rate:.0} rows/s, {} left   ",
            progress.done,
            progress.total,
            progress.total - progress.done
        );
    };
    let outcome = operations::replay(parts, &chosen.entries, operator, &mut progress).await;
    if said_anything {
        eprintln!();
    }
    conclude("replayed", outcome, chosen.unreadable.len())
}

/// Prints what a replay or a purge did; exit 1 when anything was kept, unreadable or interrupted.
fn conclude(verb: &str, outcome: QuarantineOutcome, unreadable: usize) -> anyhow::Result<ExitCode> {
    let (tally, interrupted): (Tally, Option<String>) = match outcome {
        QuarantineOutcome::Finished(tally) => (tally, None),
        QuarantineOutcome::Interrupted { tally, error } => (tally, Some(error)),
    };
    for (name, why) in &tally.kept {
        eprintln!("{name}: kept in the quarantine: {why}");
    }
    match &tally.history {
        HistoryLine::Written | HistoryLine::NothingToRecord => {}
        HistoryLine::NoDocument => eprintln!("the poller has no state document: no history line was written"),
        HistoryLine::Failed(error) => eprintln!("the history line was not written: {error}"),
    }
    println!("{verb} {} rows, {} kept in the quarantine", tally.removed.len(), tally.kept.len());
    if let Some(error) = interrupted {
        bail!("stopped part way: {error}");
    }
    let clean = tally.kept.is_empty() && unreadable == 0 && !matches!(tally.history, HistoryLine::Failed(_));
    Ok(if clean { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
