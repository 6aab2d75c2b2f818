//! `dbtrigger quarantine list | show | replay | purge`: the rows a poller isolated as poison,
//! against the app's real store. Writes (replay, purge) show what they will do, ask for
//! confirmation on a terminal (refuse without one unless `--yes`), delete each entry only by the
//! ETag it was read at, and leave a line in the poller's state document history.

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::operator::{Guard, find_poller, operator_name};
use crate::domain::transitions::{self, Operator};
use crate::domain::{Batch, Event};
use crate::store::quarantine::{self, QuarantineEntry};
use crate::store::{BlobStore, ETag, StateStore, StoreError, WriteCondition};
use crate::tick::Poller;

/// Which entries a write takes.
pub enum Selection {
    All,
    Ids(Vec<String>),
}

struct Target {
    poller: Arc<Poller>,
    blobs: Arc<dyn BlobStore>,
}

fn open(app_root: &Path, poller_name: &str) -> anyhow::Result<Target> {
    let poller = find_poller(app_root, poller_name)?;
    let blobs = poller.quarantine.clone().context("this poller keeps no quarantine")?;
    Ok(Target { poller, blobs })
}

async fn entries(target: &Target) -> anyhow::Result<Vec<(QuarantineEntry, ETag)>> {
    let config = &target.poller.config;
    Ok(quarantine::list(target.blobs.as_ref(), &config.app_name, &config.poller_name).await?)
}

fn summary(entry: &QuarantineEntry) -> Value {
    json!({
        "id": entry.id,
        "pk": entry.event.get("pk"),
        "cursor": entry.event.get("cursor"),
        "error": entry.error,
        "status": entry.status,
        "attempts": entry.attempts,
        "quarantined_at": entry.quarantined_at,
        "event": entry.event,
    })
}

pub async fn list(app_root: &Path, poller: &str, as_json: bool) -> anyhow::Result<ExitCode> {
    let target = open(app_root, poller)?;
    let entries = entries(&target).await?;
    if as_json {
        let array: Vec<Value> = entries.iter().map(|(entry, _)| summary(entry)).collect();
        println!("{}", serde_json::to_string_pretty(&array)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:<36}  {:<20}  {:<26}  {:>6}  {:>8}  error", "id", "pk", "cursor", "status", "attempts");
    for (entry, _) in &entries {
        let pk = entry.event.get("pk").map(Value::to_string).unwrap_or_default();
        let cursor = entry.event.get("cursor").map(Value::to_string).unwrap_or_default();
        let status = entry.status.map(|status| status.to_string()).unwrap_or_else(|| "-".into());
        let error: String = entry.error.chars().take(80).collect();
        println!("{:<36}  {pk:<20}  {cursor:<26}  {status:>6}  {:>8}  {error}", entry.id, entry.attempts);
    }
    println!("{} quarantined rows", entries.len());
    Ok(ExitCode::SUCCESS)
}

pub async fn show(app_root: &Path, poller: &str, id: &str) -> anyhow::Result<ExitCode> {
    let target = open(app_root, poller)?;
    let entries = entries(&target).await?;
    let Some((entry, _)) = entries.iter().find(|(entry, _)| entry.id == id) else {
        bail!("no quarantine entry {id:?} for poller {poller}");
    };
    println!("{}", serde_json::to_string_pretty(entry)?);
    Ok(ExitCode::SUCCESS)
}

fn select(
    entries: Vec<(QuarantineEntry, ETag)>,
    selection: &Selection,
) -> anyhow::Result<Vec<(QuarantineEntry, ETag)>> {
    match selection {
        Selection::All => Ok(entries),
        Selection::Ids(ids) => {
            let mut chosen = Vec::new();
            for id in ids {
                let Some(found) = entries.iter().find(|(entry, _)| &entry.id == id) else {
                    bail!("no quarantine entry {id:?}: nothing was changed");
                };
                chosen.push(found.clone());
            }
            Ok(chosen)
        }
    }
}

/// Shows the plan and asks for confirmation; `false`: stop here (dry run, or declined).
fn confirm(verb: &str, chosen: &[(QuarantineEntry, ETag)], guard: &Guard) -> anyhow::Result<bool> {
    println!("{verb} {} quarantined rows:", chosen.len());
    for (entry, _) in chosen {
        let pk = entry.event.get("pk").map(Value::to_string).unwrap_or_default();
        println!("  {}  pk {pk}", entry.id);
    }
    guard.confirmed(&format!("{verb} these rows?"))
}

/// Appends `what` to the poller's state document history, by compare-and-swap (re-read on a
/// conflict: a tick may be writing at the same time).
async fn audit(target: &Target, what: String, guard: &Guard) -> anyhow::Result<()> {
    let store: &dyn StateStore = target.poller.store.as_ref();
    let key = target.poller.key();
    let who = operator_name();
    for _ in 0..10 {
        let Some(current) = store.read(&key).await? else {
            return Ok(());
        };
        let mut next = transitions::audit(
            &current.document,
            Operator { who: &who, force: false, reason: guard.reason.as_deref() },
            what.clone(),
            chrono::Utc::now(),
        );
        next.write_id = Some(uuid::Uuid::new_v4().simple().to_string());
        match store.write(&key, &next, WriteCondition::Matches(current.etag)).await {
            Ok(_) => return Ok(()),
            Err(StoreError::Conflict { .. }) => continue,
            Err(error) => return Err(error.into()),
        }
    }
    bail!("the state document kept changing; the history entry {what:?} was not written")
}

/// The entries `selection` names, once shown and confirmed; `None`: nothing to do (an empty
/// quarantine, a dry run, a declined question).
async fn chosen(
    app_root: &Path,
    poller: &str,
    selection: &Selection,
    guard: &Guard,
    verb: &str,
) -> anyhow::Result<Option<(Target, Vec<(QuarantineEntry, ETag)>)>> {
    let target = open(app_root, poller)?;
    let chosen = select(entries(&target).await?, selection)?;
    if chosen.is_empty() {
        println!("the quarantine is empty");
        return Ok(None);
    }
    if !confirm(verb, &chosen, guard)? {
        return Ok(None);
    }
    Ok(Some((target, chosen)))
}

pub async fn purge(app_root: &Path, poller: &str, selection: Selection, guard: Guard) -> anyhow::Result<ExitCode> {
    let Some((target, chosen)) = chosen(app_root, poller, &selection, &guard, "purge").await? else {
        return Ok(ExitCode::SUCCESS);
    };
    let config = &target.poller.config;
    let mut purged = Vec::new();
    for (entry, etag) in &chosen {
        let path = quarantine::path(&config.app_name, &config.poller_name, &entry.id);
        target.blobs.delete(&path, etag).await.with_context(|| format!("purging {}", entry.id))?;
        purged.push(entry.id.clone());
    }
    audit(&target, format!("purged {} quarantined rows: {}", purged.len(), purged.join(", ")), &guard).await?;
    println!("purged {} rows", purged.len());
    Ok(ExitCode::SUCCESS)
}

pub async fn replay(app_root: &Path, poller: &str, selection: Selection, guard: Guard) -> anyhow::Result<ExitCode> {
    let Some((target, chosen)) = chosen(app_root, poller, &selection, &guard, "replay").await? else {
        return Ok(ExitCode::SUCCESS);
    };
    let config = &target.poller.config;
    // The receiver fences on the token: the newest one issued, never an older one.
    let fencing_token = match target.poller.store.read(&target.poller.key()).await? {
        Some(current) => current.document.lease.map(|lease| lease.fencing_token).unwrap_or(0),
        None => 0,
    };
    let mut replayed = Vec::new();
    let mut failed = Vec::new();
    let on_terminal = std::io::stderr().is_terminal();
    let started = std::time::Instant::now();
    for (done, (entry, etag)) in chosen.iter().enumerate() {
        if on_terminal && done > 0 && done % 50 == 0 {
            let rate = done as f64 / started.elapsed().as_secs_f64().max(0.001);
            eprint!("\r{done} of {} replayed, {rate:.0} rows/s, {} left   ", chosen.len(), chosen.len() - done);
        }
        let event = Event::from_value(&entry.event)
            .map_err(|error| anyhow::anyhow!("{}: the stored event cannot be read: {error}", entry.id))?;
        let batch = Batch {
            poller: config.poller_name.clone(),
            batch_id: format!("replay-{}", entry.id),
            fencing_token: fencing_token.max(entry.fencing_token),
            generation: None,
            events: vec![event],
        };
        let deadline = tokio::time::Instant::now() + config.batch.tick_budget;
        match target.poller.sink.deliver(&batch, deadline).await {
            Ok(()) => {
                // Delivered: only now is the entry removed, and only as it was read.
                let path = quarantine::path(&config.app_name, &config.poller_name, &entry.id);
                target.blobs.delete(&path, etag).await.with_context(|| format!("removing {}", entry.id))?;
                replayed.push(entry.id.clone());
            }
            Err(error) => {
                eprintln!("{}: kept in the quarantine: {error}", entry.id);
                failed.push(entry.id.clone());
            }
        }
    }
    if on_terminal && chosen.len() > 50 {
        eprintln!();
    }
    if !replayed.is_empty() {
        audit(&target, format!("replayed {} quarantined rows: {}", replayed.len(), replayed.join(", ")), &guard)
            .await?;
    }
    println!("replayed {} rows, {} kept in the quarantine", replayed.len(), failed.len());
    Ok(if failed.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
