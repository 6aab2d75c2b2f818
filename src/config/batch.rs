//! `poller.batch`, `poller.lease` and `poller.poison`: how much a tick does, and how it holds
//! the poller meanwhile.

use std::time::Duration;

use super::function_json::{RawBatch, RawLease, RawPoison};
use super::{ConfigError, Located, defaults, in_range, ranges};
use crate::domain::LeaseTerms;
pub use crate::domain::poison::PoisonMode;

#[derive(Debug, Clone)]
pub struct BatchConfig {
    pub size: usize,
    /// A batch ends early once its rows add up to this many bytes (as JSON), so that memory is
    /// bounded by bytes and not only by row count.
    pub max_bytes: usize,
    pub max_in_flight: usize,
    pub tick_budget: Duration,
    /// The checkpoint is written at most this often while a tick delivers (0: as soon as a batch
    /// is acknowledged and no other commit is being written).
    pub commit_interval: Duration,
    /// `batch.order`: per-key order whenever more than one batch is in flight (issue 38).
    pub order: Order,
}

/// What a receiver may count on when several batches are in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Order {
    /// `"key"` (the default): two events of one key are never in batches in flight at the same
    /// time, and a key's events leave in source order. The key is the primary key (a logical
    /// source: the table and its replica identity's columns), or the columns `batch.orderKey`
    /// names, their values as the source gave them.
    Key { columns: Option<Vec<String>> },
    /// `"none"`: batches go as soon as they are read and may arrive in any order.
    None,
}

#[derive(Debug, Clone, Copy)]
pub struct PoisonConfig {
    pub max_attempts: u32,
    pub mode: PoisonMode,
    /// The most rows quarantined in any hour; past it the poller holds (issue 45, finding 8).
    pub max_quarantined_per_hour: u32,
}

/// `poller.batch`, each number in its range; the budget must end well before host.json's
/// `functionTimeout`, or the host would kill a tick mid-batch.
pub(super) fn build_batch(
    raw: &RawBatch,
    function_timeout: Option<Duration>,
    at: &Located<'_>,
) -> Result<BatchConfig, ConfigError> {
    let size = in_range(at, "poller.batch.size", raw.size, defaults::BATCH_SIZE, ranges::BATCH_SIZE)?;
    let max_bytes =
        in_range(at, "poller.batch.maxBytes", raw.max_bytes, defaults::BATCH_MAX_BYTES, ranges::BATCH_MAX_BYTES)?;
    let max_in_flight =
        in_range(at, "poller.batch.maxInFlight", raw.max_in_flight, defaults::MAX_IN_FLIGHT, ranges::MAX_IN_FLIGHT)?;
    let tick_budget = Duration::from_secs(in_range(
        at,
        "poller.batch.tickBudgetSeconds",
        raw.tick_budget_seconds,
        defaults::TICK_BUDGET_SECONDS,
        ranges::TICK_BUDGET_SECONDS,
    )?);
    let commit_interval = Duration::from_millis(in_range(
        at,
        "poller.batch.commitIntervalMs",
        raw.commit_interval_ms,
        defaults::COMMIT_INTERVAL_MS,
        ranges::COMMIT_INTERVAL_MS,
    )?);
    if let Some(timeout) = function_timeout {
        let margin = Duration::from_secs(defaults::TIMEOUT_MARGIN_SECONDS);
        if tick_budget.saturating_add(margin) > timeout {
            return Err(at.error(
                "poller.batch.tickBudgetSeconds",
                format!(
                    "{} s leaves less than {} s before functionTimeout ({} s: host.json's, or the plan's default when host.json sets none): the host would kill the tick mid-batch",
                    tick_budget.as_secs(),
                    margin.as_secs(),
                    timeout.as_secs()
                ),
            ));
        }
    }
    let order = match raw.order.as_deref().unwrap_or(defaults::BATCH_ORDER) {
        "key" => Order::Key { columns: raw.order_key.clone() },
        "none" if raw.order_key.is_some() => {
            return Err(at.error(
                "poller.batch.orderKey",
                "names the key of per-key order, which batch.order \"none\" turns off: leave one of them out",
            ));
        }
        "none" => Order::None,
        other => {
            return Err(at.error(
                "poller.batch.order",
                format!("{other:?}: expected \"key\" (a key's events in source order, keys in parallel) or \"none\" (batches in any order)"),
            ));
        }
    };
    if let Some(columns) = &raw.order_key
        && columns.is_empty()
    {
        return Err(at.error("poller.batch.orderKey", "names no column: leave it out for the primary key"));
    }
    let batch = BatchConfig { size, max_bytes, max_in_flight, tick_budget, commit_interval, order };
    Ok(batch)
}

/// `poller.lease`: a ttl of at least three heartbeats (a missed heartbeat must not lose the lease)
/// and a skew margin under half the ttl.
pub(super) fn build_lease(raw: &RawLease, at: &Located<'_>) -> Result<LeaseTerms, ConfigError> {
    let ttl = in_range(
        at,
        "poller.lease.ttlSeconds",
        raw.ttl_seconds,
        defaults::LEASE_TTL_SECONDS,
        ranges::LEASE_TTL_SECONDS,
    )?;
    let heartbeat = in_range(
        at,
        "poller.lease.heartbeatSeconds",
        raw.heartbeat_seconds,
        defaults::LEASE_HEARTBEAT_SECONDS,
        ranges::LEASE_HEARTBEAT_SECONDS,
    )?;
    let skew = in_range(
        at,
        "poller.lease.clockSkewSeconds",
        raw.clock_skew_seconds,
        defaults::LEASE_CLOCK_SKEW_SECONDS,
        ranges::LEASE_CLOCK_SKEW_SECONDS,
    )?;
    // Every value is at most a day here, so the products below cannot overflow.
    if ttl < 3 * heartbeat {
        return Err(at.error(
            "poller.lease.ttlSeconds",
            format!("{ttl} s must be at least 3 x heartbeatSeconds ({heartbeat} s), so that a missed heartbeat does not lose the lease"),
        ));
    }
    if skew * 2 >= ttl {
        return Err(at.error(
            "poller.lease.clockSkewSeconds",
            format!("{skew} s must be less than half of ttlSeconds ({ttl} s)"),
        ));
    }
    let lease = LeaseTerms {
        ttl: chrono::Duration::seconds(ttl as i64),
        heartbeat: chrono::Duration::seconds(heartbeat as i64),
        clock_skew: chrono::Duration::seconds(skew as i64),
    };
    Ok(lease)
}

/// `poller.poison`.
pub(super) fn build_poison(raw: &RawPoison, at: &Located<'_>) -> Result<PoisonConfig, ConfigError> {
    let max_attempts = in_range(
        at,
        "poller.poison.maxAttempts",
        raw.max_attempts,
        defaults::POISON_MAX_ATTEMPTS,
        ranges::POISON_MAX_ATTEMPTS,
    )?;
    let mode = match raw.mode.as_deref().unwrap_or(defaults::POISON_MODE) {
        "quarantine" => PoisonMode::Quarantine,
        "stop" => PoisonMode::Stop,
        other => {
            return Err(at.error(
                "poller.poison.mode",
                format!("{other:?}: expected \"quarantine\" (keep the rows that fail alone, deliver the rest) or \"stop\" (never skip a row)"),
            ));
        }
    };
    let max_quarantined_per_hour = in_range(
        at,
        "poller.poison.maxQuarantinedPerHour",
        raw.max_quarantined_per_hour,
        defaults::POISON_MAX_QUARANTINED_PER_HOUR,
        ranges::POISON_MAX_QUARANTINED_PER_HOUR,
    )?;
    Ok(PoisonConfig { max_attempts, mode, max_quarantined_per_hour })
}
