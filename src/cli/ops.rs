//! Operator commands on a poller's state document: `inspect`, `reset`, `clone`, `fingerprint
//! accept`. The library plans each write ([`crate::operations`]); this module shows the document
//! before and after, asks (a terminal, or `--yes`), and has the plan applied by compare-and-swap
//! on the version it was read at (a tick that moved meanwhile makes it fail, not win).

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::Value;

use super::operator::{Guard, find_poller, operator_name};
use crate::domain::StateDocument;
use crate::domain::cursor::CursorJson;
use crate::operations::reset::ResetTo as Target;
use crate::operations::{self, Applied, Operator, Parts, Plan};
use crate::source::logical::values::lsn_text;
use crate::store::StateStore;

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

/// Shows `plan`, asks, and applies it; `written` is printed once it landed.
async fn confirm_and_apply(
    store: &dyn StateStore,
    plan: &Plan,
    guard: &Guard,
    written: &str,
) -> anyhow::Result<ExitCode> {
    show(plan.before.as_ref(), &plan.after)?;
    if !guard.confirmed("write this document?")? {
        return Ok(ExitCode::SUCCESS);
    }
    report(operations::apply(store, plan).await?, plan, written)
}

/// What became of an applied plan, in words.
fn report(applied: Applied, plan: &Plan, written: &str) -> anyhow::Result<ExitCode> {
    match applied {
        Applied::Written(_) => {
            println!("{written}");
            Ok(ExitCode::SUCCESS)
        }
        Applied::Changed => bail!(
            "the state document changed since it was read (a tick ran): nothing was written; run the command again"
        ),
        Applied::Appeared => bail!(
            "poller {} got a state document since it was read (a tick ran): nothing was written; run the command again",
            plan.key.poller
        ),
    }
}

/// Where `reset` puts the checkpoint, as given on the command line.
pub enum ResetTo {
    Beginning,
    /// After the source's last settled row.
    End,
    Cursor {
        value: String,
        /// `COL=VALUE` of each key column.
        pk: Vec<String>,
    },
    File(std::path::PathBuf),
}

pub async fn reset(app_root: &Path, name: &str, to: ResetTo, guard: Guard) -> anyhow::Result<ExitCode> {
    let poller = find_poller(app_root, name)?;
    let to_end = matches!(to, ResetTo::End);
    let target = match to {
        ResetTo::Beginning => Target::Beginning,
        ResetTo::End => Target::End,
        ResetTo::Cursor { value, pk } => Target::Cursor { value, keys: key_pairs(&pk)? },
        ResetTo::File(path) => Target::Checkpoint(checkpoint_from_file(&path)?),
    };
    let who = operator_name();
    let operator = Operator { who: &who, force: guard.force, reason: guard.reason.as_deref() };
    let plan = operations::reset::plan(Parts::of(&poller), &target, operator).await?;
    if to_end && plan.after.checkpoint.is_none() {
        println!("the source has no settled row yet: the end is the beginning");
    }
    let Some(skip) = operations::reset::slot_skip(Parts::of(&poller), &plan).await? else {
        return confirm_and_apply(poller.store.as_ref(), &plan, &guard, "written").await;
    };
    show(plan.before.as_ref(), &plan.after)?;
    println!("{}", slot_skip_text(&skip));
    if !guard.confirmed("write this document, then move the slot?")? {
        return Ok(ExitCode::SUCCESS);
    }
    let applied = operations::reset::apply(Parts::of(&poller), &plan).await?;
    report(applied, &plan, &format!("written; replication slot {} moved to {}", skip.slot, lsn_text(skip.to)))
}

/// What a reset of a logical poller skips, in words.
fn slot_skip_text(skip: &operations::reset::SlotSkip) -> String {
    let pending = match &skip.pending {
        Ok((count, true)) => format!("at least {count} changes wait after the current checkpoint"),
        Ok((count, false)) => format!("{count} changes wait after the current checkpoint"),
        Err(error) => format!("the changes waiting could not be counted now ({error})"),
    };
    let retained = skip.retained_bytes.map(|bytes| format!(", holding {bytes} bytes of WAL")).unwrap_or_default();
    format!(
        "replication slot {} is at {}{retained}; {pending}. Every change committed before {} is skipped for good; \
         changes committed after it are delivered. The document is written first, then the slot is moved to {}.",
        skip.slot,
        lsn_text(skip.from),
        lsn_text(skip.to),
        lsn_text(skip.to),
    )
}

/// `--pk COL=VALUE…` as (column, value) pairs.
fn key_pairs(pairs: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    let mut keys = Vec::with_capacity(pairs.len());
    for pair in pairs {
        let Some((column, value)) = pair.split_once('=') else {
            bail!("--pk {pair}: write it COL=VALUE");
        };
        keys.push((column.to_string(), value.to_string()));
    }
    Ok(keys)
}

/// `--from-file F`: a checkpoint cursor (`{"kind", "value", "tiebreaker"}`), a checkpoint, or a
/// whole state document (as `inspect` prints it).
fn checkpoint_from_file(path: &Path) -> anyhow::Result<CursorJson> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let value: Value = serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let cursor = value.pointer("/checkpoint/cursor").or_else(|| value.get("cursor")).unwrap_or(&value).clone();
    serde_json::from_value(cursor).with_context(|| {
        format!("{}: no checkpoint cursor ({{\"kind\", \"value\", \"tiebreaker\"}}) in it", path.display())
    })
}

pub async fn clone(
    app_root: &Path,
    name: &str,
    new_name: &str,
    from_beginning: bool,
    guard: Guard,
) -> anyhow::Result<ExitCode> {
    let poller = find_poller(app_root, name)?;
    let who = operator_name();
    let operator = Operator { who: &who, force: false, reason: guard.reason.as_deref() };
    let plan = operations::clone::plan(Parts::of(&poller), new_name, from_beginning, operator).await?;
    let written = format!("written: give a function `\"name\": \"{new_name}\"` in its poller section to run it");
    confirm_and_apply(poller.store.as_ref(), &plan, &guard, &written).await
}

pub async fn accept_fingerprint(app_root: &Path, name: &str, guard: Guard) -> anyhow::Result<ExitCode> {
    let poller = find_poller(app_root, name)?;
    let who = operator_name();
    let operator = Operator { who: &who, force: guard.force, reason: guard.reason.as_deref() };
    let plan = operations::fingerprint::plan_accept(Parts::of(&poller), operator).await?;
    confirm_and_apply(poller.store.as_ref(), &plan, &guard, "written").await
}
