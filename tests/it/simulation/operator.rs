//! The operator commands, as the command line runs them today (src/cli/ops.rs and
//! src/cli/quarantine.rs, which are not library code), rebuilt here from the public library
//! pieces they use: the domain transitions, the state store, the `quarantine` helpers and the
//! sink. Same reads, same plans, same compare-and-swap writes, same history entries, with `--yes`
//! and without `--force`. Two differences, both for determinism: `now` is the simulation's clock
//! (the CLI reads the system clock), and write ids come from the same uuid generator as the
//! tick's. Once the operator commands are library code, each function here becomes one call.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use dbtrigger::config::PollerConfig;
use dbtrigger::domain::transitions::{self, Operator, Refusal, ResetTarget};
use dbtrigger::domain::{Batch, Event, StateDocument};
use dbtrigger::sink::Sink;
use dbtrigger::store::quarantine;
use dbtrigger::store::{BlobStore, StateKey, StateStore, StoreError, WriteCondition};

use super::RowId;
use super::sink::row_of;

const WHO: &str = "operator@sim";

/// What a command needs: the poller's configuration and the app's store, sink and clock.
pub struct Target<'a> {
    pub config: &'a PollerConfig,
    pub store: Arc<dyn StateStore>,
    pub blobs: Arc<dyn BlobStore>,
    pub sink: Arc<dyn Sink>,
    pub now: DateTime<Utc>,
}

/// How a command ended: what it did, or why it refused (an error exit of the CLI).
pub type Done = Result<String, String>;

fn operator() -> Operator<'static> {
    Operator { who: WHO, force: false, reason: Some("simulation") }
}

fn key(config: &PollerConfig) -> StateKey {
    StateKey::new(&config.app_name, &config.poller_name)
}

fn fresh_write_id(document: &mut StateDocument) {
    document.write_id = Some(uuid::Uuid::new_v4().simple().to_string());
}

/// `apply` of cli/ops.rs: plan on the document as read, write by CAS on that version.
async fn apply(target: &Target<'_>, plan: impl FnOnce(&StateDocument) -> Result<StateDocument, Refusal>) -> Done {
    let key = key(target.config);
    let Some(current) = target.store.read(&key).await.map_err(|error| error.to_string())? else {
        return Err(format!("poller {} has no state document: nothing to change", key.poller));
    };
    let mut next = plan(&current.document).map_err(|refusal| format!("refused: {refusal}"))?;
    fresh_write_id(&mut next);
    match target.store.write(&key, &next, WriteCondition::Matches(current.etag)).await {
        Ok(_) => Ok("written".to_string()),
        Err(StoreError::Conflict { .. }) => Err("the state document changed since it was read".to_string()),
        Err(error) => Err(error.to_string()),
    }
}

/// `dbtrigger reset <poller> --to-beginning --yes`.
pub async fn reset_to_beginning(target: &Target<'_>) -> Done {
    let (now, terms) = (target.now, target.config.lease);
    apply(target, |document| transitions::reset(document, &ResetTarget::Beginning, operator(), now, &terms)).await
}

/// `dbtrigger fingerprint accept <poller> --yes`.
pub async fn accept_fingerprint(target: &Target<'_>) -> Done {
    let (now, terms) = (target.now, target.config.lease);
    let fingerprint = target.config.fingerprint.clone();
    apply(target, |document| transitions::accept_fingerprint(document, &fingerprint, operator(), now, &terms)).await
}

/// `dbtrigger clone <poller> <new_name> --yes` (at its checkpoint).
pub async fn clone(target: &Target<'_>, new_name: &str) -> Done {
    let key = key(target.config);
    let Some(source) = target.store.read(&key).await.map_err(|error| error.to_string())? else {
        return Err(format!("poller {} has no state document to clone", key.poller));
    };
    let copy = StateKey::new(&target.config.app_name, new_name);
    if target.store.read(&copy).await.map_err(|error| error.to_string())?.is_some() {
        return Err(format!("poller {new_name} already has a state document"));
    }
    let mut next = transitions::clone_to(&source.document, new_name, false, operator(), target.now);
    fresh_write_id(&mut next);
    match target.store.write(&copy, &next, WriteCondition::Absent).await {
        Ok(_) => Ok("written".to_string()),
        Err(error) => Err(error.to_string()),
    }
}

/// `audit` of cli/quarantine.rs: a history line, by CAS, re-read on a conflict (10 tries).
async fn audit(target: &Target<'_>, what: String) -> Done {
    let key = key(target.config);
    for _ in 0..10 {
        let Some(current) = target.store.read(&key).await.map_err(|error| error.to_string())? else {
            return Ok(what);
        };
        let mut next = transitions::audit(&current.document, operator(), what.clone(), target.now);
        fresh_write_id(&mut next);
        match target.store.write(&key, &next, WriteCondition::Matches(current.etag)).await {
            Ok(_) => return Ok(what),
            Err(StoreError::Conflict { .. }) => continue,
            Err(error) => return Err(error.to_string()),
        }
    }
    Err(format!("the state document kept changing; the history entry {what:?} was not written"))
}

/// `dbtrigger quarantine purge <poller> --all --yes`. Returns the rows purged (excused from the
/// "never lost" promise: an operator dropped them on purpose) beside how it ended.
pub async fn purge_all(target: &Target<'_>) -> (Vec<RowId>, Done) {
    let config = target.config;
    let entries = match quarantine::list(target.blobs.as_ref(), &config.app_name, &config.poller_name).await {
        Ok(entries) => entries,
        Err(error) => return (Vec::new(), Err(error.to_string())),
    };
    if entries.is_empty() {
        return (Vec::new(), Ok("the quarantine is empty".to_string()));
    }
    let (mut purged, mut rows) = (Vec::new(), Vec::new());
    for (entry, etag) in &entries {
        let path = quarantine::path(&config.app_name, &config.poller_name, &entry.id);
        if let Err(error) = target.blobs.delete(&path, etag).await {
            return (rows, Err(format!("purging {}: {error}", entry.id)));
        }
        purged.push(entry.id.clone());
        if let Some(row) = entry.event.get("row").and_then(|row| row.as_object()).and_then(row_of) {
            rows.push(row);
        }
    }
    let done = audit(target, format!("purged {} quarantined rows: {}", purged.len(), purged.join(", "))).await;
    (rows, done)
}

/// `dbtrigger quarantine replay <poller> --all --yes`: each entry sent alone under the newest
/// fencing token, removed (by the ETag it was read at) only once acknowledged.
pub async fn replay_all(target: &Target<'_>) -> Done {
    let config = target.config;
    let entries = quarantine::list(target.blobs.as_ref(), &config.app_name, &config.poller_name)
        .await
        .map_err(|error| error.to_string())?;
    if entries.is_empty() {
        return Ok("the quarantine is empty".to_string());
    }
    let fencing_token = match target.store.read(&key(config)).await.map_err(|error| error.to_string())? {
        Some(current) => current.document.lease.map(|lease| lease.fencing_token).unwrap_or(0),
        None => 0,
    };
    let (mut replayed, mut kept) = (Vec::new(), 0);
    for (entry, etag) in &entries {
        let event = Event::from_value(&entry.event).map_err(|error| format!("{}: {error}", entry.id))?;
        let batch = Batch {
            poller: config.poller_name.clone(),
            batch_id: format!("replay-{}", entry.id),
            fencing_token: fencing_token.max(entry.fencing_token),
            generation: None,
            events: vec![event],
        };
        let deadline = tokio::time::Instant::now() + config.batch.tick_budget;
        match target.sink.deliver(&batch, deadline).await {
            Ok(()) => {
                let path = quarantine::path(&config.app_name, &config.poller_name, &entry.id);
                target.blobs.delete(&path, etag).await.map_err(|error| format!("removing {}: {error}", entry.id))?;
                replayed.push(entry.id.clone());
            }
            Err(_) => kept += 1,
        }
    }
    if !replayed.is_empty() {
        audit(target, format!("replayed {} quarantined rows: {}", replayed.len(), replayed.join(", "))).await?;
    }
    Ok(format!("replayed {} rows, {kept} kept in the quarantine", replayed.len()))
}
