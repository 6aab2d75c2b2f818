//! The scripted receiver: latency (more for a batch holding a slow row), an outage (503s),
//! timeouts, an endpoint refusing everything (401s: a rotated token, issue 36), a stretch of 422s
//! for every row (a bad deploy, issue 45 finding 8: the quarantine budget holds), per-row permanent
//! refusals (a 422 for any batch holding a poison row), 409s that are not about the row (a
//! receiver's own conflict: never a reason to quarantine), and fencing as the README asks of
//! receivers (a batch whose token is below the highest one seen is refused with a 409), or no
//! fencing at all (a receiver that ignores the token). It records what it acknowledged, with the
//! batch's fencing token; a request of a process that crashed (an isolation part runs detached
//! from its tick, src/tick/isolate.rs) gets no answer and counts for nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use dbtrigger::sink::{Batch, Sink, SinkError};
use serde_json::Value;
use tokio::time::Instant;

use super::RowId;

/// How long a request that times out hangs before the client gives up.
pub const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Default)]
pub struct SinkState {
    pub base_latency: Duration,
    /// Added to a batch that holds a slow row.
    pub slow_latency: Duration,
    pub outage_until: Option<Instant>,
    /// Until then every request is refused with 401, whatever it holds: the endpoint, not a row.
    pub unauthorized_until: Option<Instant>,
    /// Until then every row is refused with 422 (a receiver deployed with a bug, issue 45
    /// finding 8): a refusal about the rows, which the quarantine budget bounds.
    pub refuse_rows_until: Option<Instant>,
    /// The next this many requests time out.
    pub timeouts: u32,
    /// Rows (load, key) the receiver refuses for good, whatever their version.
    pub poison: BTreeSet<(u64, i64)>,
    pub slow: BTreeSet<(u64, i64)>,
    /// The highest fencing token seen, per poller.
    pub highest_token: BTreeMap<String, u64>,
    /// The receiver ignores fencing tokens (it never answers 409 for a stale one).
    pub unfenced: bool,
    /// The next this many requests are refused with a 409 about the receiver's own state.
    pub conflicts: u32,
    /// The next request panics in the receiver's client code: a scripted panic (`true`), or one
    /// nobody foresaw, which must fail the run although the product catches it.
    pub panic_next: Option<bool>,
    /// (poller, lease owner id) of processes that crashed: what their tasks still send counts for
    /// nothing.
    pub dead: BTreeSet<(String, String)>,
    /// Per poller, the fencing token its last reset wrote: an acknowledgement under an older
    /// token was of the epoch before it, and no longer accounts for a row.
    pub epoch_token: BTreeMap<String, u64>,
    /// (poller, row) -> the highest fencing token it was acknowledged under.
    pub acknowledged: BTreeMap<(String, RowId), u64>,
    pub requests: u64,
    pub acknowledged_batches: u64,
    /// (poller, load, key) -> the newest version (cursor) of the row acknowledged so far.
    pub newest_version: BTreeMap<(String, u64, i64), i64>,
    /// A version acknowledged for the first time after a newer version of its key (issue 38).
    pub out_of_order: Vec<String>,
}

pub struct ScriptedSink {
    pub state: Arc<Mutex<SinkState>>,
    /// The lease owner id of the process sending (`None`: the observer's, an operator's).
    pub owner: Option<String>,
}

impl SinkState {
    /// Whether the receiver acknowledged `row` for `poller` in the poller's current epoch.
    pub fn acknowledged_now(&self, poller: &str, row: &RowId) -> bool {
        let epoch = self.epoch_token.get(poller).copied().unwrap_or(0);
        self.acknowledged.get(&(poller.to_string(), *row)).is_some_and(|token| *token >= epoch)
    }
}

/// The row an event carries (its columns hold the load, the key and the cursor).
pub fn row_of(row: &serde_json::Map<String, Value>) -> Option<RowId> {
    Some(RowId {
        generation: row.get("gen")?.as_u64()?,
        key: row.get("id")?.as_i64()?,
        cursor: row.get("version")?.as_i64()?,
    })
}

/// A key's versions are first delivered in source order: a version acknowledged for the first
/// time must be newer than every version of its key acknowledged before it. (`stale`: a batch
/// under a superseded token that a receiver without fencing took: the order is not the poller's
/// to keep then.)
fn record_first_delivery(state: &mut SinkState, poller: &str, row: &RowId, stale: bool) {
    if state.acknowledged.contains_key(&(poller.to_string(), *row)) || stale {
        return;
    }
    let newest = state.newest_version.entry((poller.to_string(), row.generation, row.key)).or_insert(row.cursor);
    if *newest > row.cursor {
        let newest = *newest;
        state.out_of_order.push(format!(
            "{poller}: key {} of load {} version {} first delivered after version {newest}",
            row.key, row.generation, row.cursor
        ));
    }
    let newest = state.newest_version.get_mut(&(poller.to_string(), row.generation, row.key)).expect("just set");
    *newest = (*newest).max(row.cursor);
}

enum Planned {
    Answer(Duration),
    Timeout,
}

#[async_trait]
impl Sink for ScriptedSink {
    async fn deliver(&self, batch: &Batch, deadline: Instant) -> Result<(), SinkError> {
        let rows: Vec<RowId> = batch.events.iter().filter_map(|event| row_of(&event.row())).collect();
        // Taken, and the lock let go, before panicking: a poisoned lock would end the run.
        let panic_now = self.state.lock().unwrap().panic_next.take();
        match panic_now {
            Some(true) => panic!("scripted panic in the receiver's client"),
            Some(false) => panic!("an unforeseen panic in the receiver's client"),
            None => {}
        }
        let planned = {
            let mut state = self.state.lock().unwrap();
            state.requests += 1;
            if state.timeouts > 0 {
                state.timeouts -= 1;
                Planned::Timeout
            } else {
                let slow = rows.iter().any(|row| state.slow.contains(&(row.generation, row.key)));
                Planned::Answer(state.base_latency + if slow { state.slow_latency } else { Duration::ZERO })
            }
        };
        let wait = match planned {
            Planned::Answer(latency) => latency,
            Planned::Timeout => TIMEOUT,
        };
        let transient =
            |reason: &str| SinkError::Transient { batch_id: batch.batch_id.clone(), reason: reason.to_string() };
        if Instant::now() + wait > deadline {
            // The client never waits past the tick's deadline.
            tokio::time::sleep_until(deadline).await;
            return Err(transient("timed out at the tick's deadline"));
        }
        tokio::time::sleep(wait).await;
        let mut state = self.state.lock().unwrap();
        if self.owner.as_ref().is_some_and(|owner| state.dead.contains(&(batch.poller.clone(), owner.clone()))) {
            // The process that sent it is gone: the connection dropped with it, unanswered.
            return Err(transient("the sending process crashed"));
        }
        if let Planned::Timeout = planned {
            return Err(transient("timed out"));
        }
        if state.outage_until.is_some_and(|until| Instant::now() < until) {
            return Err(transient("HTTP 503: down for maintenance"));
        }
        let rejected =
            |status: u16, body: String| SinkError::Rejected { batch_id: batch.batch_id.clone(), status, body };
        if state.unauthorized_until.is_some_and(|until| Instant::now() < until) {
            return Err(rejected(401, "invalid or expired token".to_string()));
        }
        if state.refuse_rows_until.is_some_and(|until| Instant::now() < until) {
            return Err(rejected(422, "every row is refused (a bad deploy)".to_string()));
        }
        if let Some(bad) = rows.iter().find(|row| state.poison.contains(&(row.generation, row.key))) {
            return Err(rejected(422, format!("row {} of load {} is refused", bad.key, bad.generation)));
        }
        if state.conflicts > 0 {
            state.conflicts -= 1;
            return Err(rejected(409, "conflict: another request holds this resource".to_string()));
        }
        let highest = state.highest_token.get(&batch.poller).copied().unwrap_or(0);
        let stale = batch.fencing_token < highest;
        if stale && !state.unfenced {
            return Err(rejected(409, format!("stale fencing token {} (seen {highest})", batch.fencing_token)));
        }
        state.highest_token.insert(batch.poller.clone(), highest.max(batch.fencing_token));
        state.acknowledged_batches += 1;
        for row in rows {
            // A receiver drops the rows of a superseded load (the batch says which load it read).
            if batch.generation.as_ref().is_some_and(|generation| generation.as_u64() != Some(row.generation)) {
                continue;
            }
            record_first_delivery(&mut state, &batch.poller, &row, stale);
            let token = state.acknowledged.entry((batch.poller.clone(), row)).or_insert(0);
            *token = (*token).max(batch.fencing_token);
        }
        Ok(())
    }

    fn describe(&self) -> String {
        "sim receiver".to_string()
    }
}
