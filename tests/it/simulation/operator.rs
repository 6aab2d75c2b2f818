//! The operator commands, through the library the command line uses (`dbtrigger::operations`):
//! the same plans, compare-and-swap writes, history entries and quarantine runs, with `--yes` and
//! without `--force`. The parts are a fault-free poller's (the world's observer: the memory store,
//! the scripted source and receiver, and the simulation's clock), so `now` is the simulation's
//! and a command fails only when the product refuses or loses a race with a tick.

use dbtrigger::operations::quarantine::{self, QuarantineOutcome, QuarantineParts, Selection, Tally};
use dbtrigger::operations::reset::ResetTo;
use dbtrigger::operations::{self, Applied, Operator, Parts, Plan};
use dbtrigger::tick::Poller;

use super::RowId;
use super::sink::row_of;

/// How a command ended: what it did, or why it refused (an error exit of the CLI).
pub type Done = Result<String, String>;

fn operator() -> Operator<'static> {
    Operator { who: "operator@sim", force: false, reason: Some("simulation") }
}

/// What `confirm_and_apply` of cli/ops.rs does once confirmed: the plan written by CAS on the
/// version it was read at.
async fn apply(poller: &Poller, planned: Result<Plan, operations::OperationError>) -> Done {
    let plan = planned.map_err(|error| error.to_string())?;
    match operations::apply(poller.store.as_ref(), &plan).await {
        Ok(Applied::Written(_)) => Ok("written".to_string()),
        Ok(Applied::Changed) => Err("the state document changed since it was read".to_string()),
        Ok(Applied::Appeared) => Err("a state document appeared since it was read".to_string()),
        Err(error) => Err(error.to_string()),
    }
}

/// `dbtrigger reset <poller> --to-beginning --yes`.
pub async fn reset_to_beginning(poller: &Poller) -> Done {
    apply(poller, operations::reset::plan(Parts::of(poller), &ResetTo::Beginning, operator()).await).await
}

/// `dbtrigger fingerprint accept <poller> --yes`.
pub async fn accept_fingerprint(poller: &Poller) -> Done {
    apply(poller, operations::fingerprint::plan_accept(Parts::of(poller), operator()).await).await
}

/// `dbtrigger clone <poller> <new_name> --yes` (at its checkpoint).
pub async fn clone(poller: &Poller, new_name: &str) -> Done {
    apply(poller, operations::clone::plan(Parts::of(poller), new_name, false, operator()).await).await
}

fn quarantine_parts(poller: &Poller) -> QuarantineParts<'_> {
    let blobs = poller.quarantine.as_deref().expect("the simulation's pollers keep a quarantine");
    QuarantineParts { poller: Parts::of(poller), blobs, sink: poller.sink.as_ref() }
}

/// A run's tally as the command line would end: an error exit when it stopped part way or could
/// not write its history line.
fn ended(outcome: &QuarantineOutcome) -> (&Tally, Done) {
    match outcome {
        QuarantineOutcome::Finished(tally) => match &tally.history {
            quarantine::HistoryLine::Failed(error) => (tally, Err(format!("history not written: {error}"))),
            _ => (tally, Ok(format!("removed {}, kept {}", tally.removed.len(), tally.kept.len()))),
        },
        QuarantineOutcome::Interrupted { tally, error } => (tally, Err(error.clone())),
    }
}

/// `dbtrigger quarantine purge <poller> --all --yes`. Returns the rows it chose to purge (those
/// gone from the quarantine afterwards are excused from the "never lost" promise: an operator
/// dropped them on purpose, also when a delete landed but answered an error) beside how it ended.
pub async fn purge_all(poller: &Poller) -> (Vec<RowId>, Done) {
    let parts = quarantine_parts(poller);
    let config = &poller.config;
    let chosen = match quarantine::choose(parts.blobs, &config.app_name, &config.poller_name, &Selection::All).await {
        Ok(chosen) => chosen,
        Err(error) => return (Vec::new(), Err(error.to_string())),
    };
    if chosen.entries.is_empty() {
        return (Vec::new(), Ok("the quarantine is empty".to_string()));
    }
    let outcome = quarantine::purge(parts, &chosen.entries, operator()).await;
    let (_, done) = ended(&outcome);
    let rows = chosen
        .entries
        .iter()
        .filter_map(|stored| stored.entry.event.get("row").and_then(|row| row.as_object()).and_then(row_of))
        .collect();
    (rows, done)
}

/// `dbtrigger quarantine replay <poller> --all --yes`: each entry sent alone under the newest
/// fencing token, removed (by the ETag it was read at) only once acknowledged.
pub async fn replay_all(poller: &Poller) -> Done {
    let parts = quarantine_parts(poller);
    let config = &poller.config;
    let chosen = quarantine::choose(parts.blobs, &config.app_name, &config.poller_name, &Selection::All)
        .await
        .map_err(|error| error.to_string())?;
    if chosen.entries.is_empty() {
        return Ok("the quarantine is empty".to_string());
    }
    let outcome = quarantine::replay(parts, &chosen.entries, operator(), &mut |_| {}).await;
    ended(&outcome).1
}
