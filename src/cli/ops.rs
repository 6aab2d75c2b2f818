//! Operator commands on a poller's state document: `inspect`, `reset`, `clone`, `fingerprint
//! accept`. Each write is planned by a pure transition (`domain::transitions`), shown before and
//! after, written only with confirmation (a terminal, or `--yes`), by a compare-and-swap on the
//! ETag it was read at (a tick that moved meanwhile makes it fail, not win), and it leaves an entry
//! in the document's history. A live lease held by a tick refuses the write unless `--force`.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::Value;

use super::operator::{Guard, find_poller, operator_name};
use crate::domain::StateDocument;
use crate::domain::cursor::{CursorJson, Position};
use crate::domain::transitions::{self, Operator, ResetTarget};
use crate::store::{StateKey, StateStore, StoreError, Versioned, WriteCondition};
use crate::tick::Poller;

pub async fn inspect(app_root: &Path, name: &str) -> anyhow::Result<ExitCode> {
    let poller = find_poller(app_root, name)?;
    match poller.store.read(&poller.key()).await? {
        Some(current) => println!("{}", serde_json::to_string_pretty(&current.document)?),
        None => bail!("poller {name} has no state document yet (no tick has delivered anything)"),
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints the document before and after a planned write.
fn show(before: Option<&StateDocument>, after: &StateDocument) -> anyhow::Result<()> {
    let before = match before {
        Some(document) => serde_json::to_string_pretty(document)?,
        None => "(none)".to_string(),
    };
    println!("before:\n{before}\nafter:\n{}", serde_json::to_string_pretty(after)?);
    Ok(())
}

/// Plans a change of `key`'s document as it was read (`current`), shows it, and writes it by CAS on
/// that version.
async fn apply(
    store: &dyn StateStore,
    key: &StateKey,
    current: Option<Versioned>,
    guard: &Guard,
    plan: impl FnOnce(&StateDocument) -> Result<StateDocument, transitions::Refusal>,
) -> anyhow::Result<ExitCode> {
    let Some(current) = current else {
        bail!("poller {} has no state document: nothing to change", key.poller);
    };
    let mut next = match plan(&current.document) {
        Ok(next) => next,
        Err(refusal @ transitions::Refusal::HeldElsewhere { .. }) => {
            bail!("refused: {refusal}; a tick is running. Wait for it, or pass --force (its next write then fails)")
        }
        Err(refusal) => bail!("refused: {refusal}"),
    };
    show(Some(&current.document), &next)?;
    if !guard.confirmed("write this document?")? {
        return Ok(ExitCode::SUCCESS);
    }
    next.write_id = Some(uuid::Uuid::new_v4().simple().to_string());
    match store.write(key, &next, WriteCondition::Matches(current.etag)).await {
        Ok(_) => {
            println!("written");
            Ok(ExitCode::SUCCESS)
        }
        Err(StoreError::Conflict { .. }) => {
            bail!(
                "the state document changed since it was read (a tick ran): nothing was written; run the command again"
            )
        }
        Err(error) => Err(error.into()),
    }
}

/// Where `reset` puts the checkpoint.
pub enum ResetTo {
    Beginning,
    /// After the source's last settled row.
    End,
    Cursor {
        value: String,
        pk: Vec<String>,
    },
    File(std::path::PathBuf),
}

pub async fn reset(app_root: &Path, name: &str, to: ResetTo, guard: Guard) -> anyhow::Result<ExitCode> {
    let poller = find_poller(app_root, name)?;
    let key = poller.key();
    let current = poller.store.read(&key).await?;
    let kind = current
        .as_ref()
        .and_then(|current| current.document.checkpoint.as_ref())
        .map(|checkpoint| checkpoint.cursor.kind.clone());
    let target = match to {
        ResetTo::Beginning => ResetTarget::Beginning,
        ResetTo::End => match crate::source::last_position(poller.source.as_ref()).await? {
            Some(last) => ResetTarget::After(last),
            None => {
                println!("the source has no settled row yet: the end is the beginning");
                ResetTarget::Beginning
            }
        },
        ResetTo::Cursor { value, pk } => {
            ResetTarget::After(position_from_arguments(&poller, kind.as_deref(), &value, &pk)?)
        }
        ResetTo::File(path) => ResetTarget::After(position_from_file(&poller, &path)?),
    };
    let who = operator_name();
    let operator = Operator { who: &who, force: guard.force, reason: guard.reason.as_deref() };
    let terms = poller.config.lease;
    apply(poller.store.as_ref(), &key, current, &guard, |document| {
        transitions::reset(document, &target, operator, chrono::Utc::now(), &terms)
    })
    .await
}

/// `--to-cursor VALUE --pk COL=VALUE…`: the value read with the checkpoint's kind (or, with no
/// checkpoint yet, an integer if it is one, else an RFC 3339 timestamp), every key column given.
fn position_from_arguments(
    poller: &Poller,
    kind: Option<&str>,
    value: &str,
    pk: &[String],
) -> anyhow::Result<Position> {
    let kind = match kind {
        Some(kind) => kind.to_string(),
        None if value.parse::<i64>().is_ok() => "integer".to_string(),
        None => "timestamp".to_string(),
    };
    let cursor_value = match kind.as_str() {
        "integer" => Value::from(value.parse::<i64>().with_context(|| format!("{value:?} is not an integer cursor"))?),
        _ => Value::from(value),
    };
    let mut tiebreaker = serde_json::Map::new();
    for column in &poller.config.source.pk {
        let given = pk.iter().find_map(|pair| pair.strip_prefix(&format!("{column}="))).with_context(|| {
            format!(
                "give --pk {column}=VALUE: the position needs every key column ({})",
                poller.config.source.pk.join(", ")
            )
        })?;
        let key_value = match given.parse::<i64>() {
            Ok(number) => Value::from(number),
            Err(_) => Value::from(given),
        };
        tiebreaker.insert(column.clone(), key_value);
    }
    for pair in pk {
        let column = pair.split('=').next().unwrap_or_default();
        if !poller.config.source.pk.iter().any(|key| key == column) {
            bail!(
                "--pk {pair}: {column:?} is not a key column of this poller ({})",
                poller.config.source.pk.join(", ")
            );
        }
    }
    let json = CursorJson { kind, value: cursor_value, source_text: None, tiebreaker };
    Position::try_from(&json).map_err(|reason| anyhow::anyhow!("not a position for this poller: {reason}"))
}

/// `--from-file F`: a checkpoint cursor (`{"kind", "value", "tiebreaker"}`), a checkpoint, or a
/// whole state document (as `inspect` prints it).
fn position_from_file(poller: &Poller, path: &Path) -> anyhow::Result<Position> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let value: Value = serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let cursor = value.pointer("/checkpoint/cursor").or_else(|| value.get("cursor")).unwrap_or(&value).clone();
    let json: CursorJson = serde_json::from_value(cursor).with_context(|| {
        format!("{}: no checkpoint cursor ({{\"kind\", \"value\", \"tiebreaker\"}}) in it", path.display())
    })?;
    let position =
        Position::try_from(&json).map_err(|reason| anyhow::anyhow!("{}: not a position: {reason}", path.display()))?;
    let columns: Vec<&String> = position.pk.iter().map(|(column, _)| column).collect();
    if columns != poller.config.source.pk.iter().collect::<Vec<_>>() {
        bail!(
            "{}: its key columns {columns:?} are not this poller's ({})",
            path.display(),
            poller.config.source.pk.join(", ")
        );
    }
    Ok(position)
}

pub async fn clone(
    app_root: &Path,
    name: &str,
    new_name: &str,
    from_beginning: bool,
    guard: Guard,
) -> anyhow::Result<ExitCode> {
    let poller = find_poller(app_root, name)?;
    if crate::config::validate_identifier(&new_name.replace('-', "_")).is_err() {
        bail!("{new_name:?} is not a valid poller name");
    }
    let Some(source) = poller.store.read(&poller.key()).await? else {
        bail!("poller {name} has no state document to clone");
    };
    let target = StateKey::new(&poller.config.app_name, new_name);
    if poller.store.read(&target).await?.is_some() {
        bail!("poller {new_name} already has a state document: refusing to overwrite it (reset it instead)");
    }
    let who = operator_name();
    let mut next = transitions::clone_to(
        &source.document,
        new_name,
        from_beginning,
        Operator { who: &who, force: false, reason: guard.reason.as_deref() },
        chrono::Utc::now(),
    );
    show(None, &next)?;
    if !guard.confirmed("write this document?")? {
        return Ok(ExitCode::SUCCESS);
    }
    next.write_id = Some(uuid::Uuid::new_v4().simple().to_string());
    match poller.store.write(&target, &next, WriteCondition::Absent).await {
        Ok(_) => {
            println!("written: give a function `\"name\": \"{new_name}\"` in its poller section to run it");
            Ok(ExitCode::SUCCESS)
        }
        Err(StoreError::AlreadyExists { .. }) => {
            bail!("poller {new_name} got a state document meanwhile: nothing was written")
        }
        Err(error) => Err(error.into()),
    }
}

pub async fn accept_fingerprint(app_root: &Path, name: &str, guard: Guard) -> anyhow::Result<ExitCode> {
    let poller = find_poller(app_root, name)?;
    let who = operator_name();
    let operator = Operator { who: &who, force: guard.force, reason: guard.reason.as_deref() };
    let fingerprint = poller.config.fingerprint.clone();
    let terms = poller.config.lease;
    let key = poller.key();
    let current = poller.store.read(&key).await?;
    apply(poller.store.as_ref(), &key, current, &guard, |document| {
        transitions::accept_fingerprint(document, &fingerprint, operator, chrono::Utc::now(), &terms)
    })
    .await
}
