//! The instruments, and what they record: a tick's outcome and report (counters, histograms), and
//! the last status of every poller (gauges, read by the exporter at each interval from the very
//! [`PollerHealth`] values `status` shows).

use std::sync::{Arc, Mutex};

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter};

use super::names::{self, Metric, attribute};
use crate::config::PollerConfig;
use crate::config::{Engine, SourceTarget};
use crate::domain::health::PollerHealth;
use crate::domain::horizon::Horizon;
use crate::tick::{TickError, TickOutcome, TickReport};

/// A poller's attributes: which poller, function, app, source kind and engine.
pub fn poller_attributes(config: &PollerConfig) -> Vec<KeyValue> {
    let source_kind = match &config.source.target {
        SourceTarget::Table { .. } => "table",
        SourceTarget::Query(_) => "query",
        SourceTarget::Logical { .. } => "logical",
        SourceTarget::Binlog { .. } => "binlog",
    };
    let engine = match config.source.engine {
        Engine::Postgres => "postgresql",
        Engine::MySql => "mysql",
        Engine::Sqlite => "sqlite",
    };
    vec![
        KeyValue::new(attribute::POLLER, config.poller_name.clone()),
        KeyValue::new(attribute::FUNCTION, config.function_name.clone()),
        KeyValue::new(attribute::APP, config.app_name.clone()),
        KeyValue::new(attribute::SOURCE_KIND, source_kind),
        KeyValue::new(attribute::ENGINE, engine),
    ]
}

/// The numbers of one poller's status that become gauges, with its attributes.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    pub attributes: Vec<KeyValue>,
    pub health: PollerHealth,
}

/// The gauges' values: the last status sampled (shared with the exporter's callbacks).
pub type Snapshot = Arc<Mutex<Vec<Observed>>>;

/// The tick instruments.
pub struct Instruments {
    ticks: Counter<u64>,
    duration: Histogram<f64>,
    rows: Counter<u64>,
    batches: Counter<u64>,
    quarantined: Counter<u64>,
    late_arrivals: Counter<u64>,
    connection_wait: Histogram<f64>,
    budget_wait: Histogram<f64>,
    blob_reads: Counter<u64>,
    blob_writes: Counter<u64>,
}

/// Seconds, from a few milliseconds to a tick's longest budget.
const SECONDS_BOUNDARIES: [f64; 14] =
    [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];

fn counter(meter: &Meter, metric: Metric) -> Counter<u64> {
    meter.u64_counter(metric.name).with_unit(metric.unit).with_description(metric.description).build()
}

fn histogram(meter: &Meter, metric: Metric) -> Histogram<f64> {
    meter
        .f64_histogram(metric.name)
        .with_unit(metric.unit)
        .with_description(metric.description)
        .with_boundaries(SECONDS_BOUNDARIES.to_vec())
        .build()
}

/// A gauge read from the snapshot: `value` says what a status shows, `None` when it shows nothing.
fn gauge(
    meter: &Meter,
    metric: Metric,
    snapshot: &Snapshot,
    value: impl Fn(&PollerHealth) -> Option<(f64, Option<KeyValue>)> + Send + Sync + 'static,
) {
    let snapshot = snapshot.clone();
    let _ = meter
        .f64_observable_gauge(metric.name)
        .with_unit(metric.unit)
        .with_description(metric.description)
        .with_callback(move |observer| {
            let observed = snapshot.lock().unwrap_or_else(|poison| poison.into_inner());
            for poller in observed.iter() {
                if let Some((number, extra)) = value(&poller.health) {
                    match extra {
                        None => observer.observe(number, &poller.attributes),
                        Some(extra) => {
                            let mut attributes = poller.attributes.clone();
                            attributes.push(extra);
                            observer.observe(number, &attributes);
                        }
                    }
                }
            }
        })
        .build();
}

impl Instruments {
    /// Registers every instrument of [`names::METRICS`] on `meter`; the gauges read `snapshot`.
    pub fn register(meter: &Meter, snapshot: &Snapshot) -> Instruments {
        gauge(meter, names::LAG_ROWS, snapshot, |health| health.lag_rows.map(|rows| (rows as f64, None)));
        gauge(meter, names::LAG_SECONDS, snapshot, |health| health.oldest_pending_age_seconds.map(|age| (age, None)));
        gauge(meter, names::HEALTHY, snapshot, |health| Some((if health.healthy { 1.0 } else { 0.0 }, None)));
        gauge(meter, names::ATTEMPTS, snapshot, |health| Some((f64::from(health.attempts), None)));
        gauge(meter, names::QUARANTINED, snapshot, |health| Some((health.quarantined as f64, None)));
        gauge(meter, names::LATE_ARRIVALS_TOTAL, snapshot, |health| Some((health.late_arrivals as f64, None)));
        gauge(meter, names::MAX_LATENESS, snapshot, |health| {
            health.max_lateness_seconds.map(|seconds| (seconds as f64, None))
        });
        gauge(meter, names::HORIZON_AGE, snapshot, |health| {
            let holder = health.horizon_holder.as_ref()?;
            let kind = match holder.holds {
                Horizon::CommitHorizon => "commit-horizon",
                Horizon::SettleBound => "settle-bound",
            };
            // An age the server hides (PostgreSQL without pg_read_all_stats) is not a young one:
            // nothing is observed.
            holder.age_seconds.map(|age| (age, Some(KeyValue::new(attribute::HORIZON_HOLDER, kind))))
        });
        gauge(meter, names::SLOT_RETAINED, snapshot, |health| {
            health.slot.as_ref().and_then(|slot| slot.retained_bytes).map(|bytes| (bytes as f64, None))
        });
        Instruments {
            ticks: counter(meter, names::TICKS),
            duration: histogram(meter, names::TICK_DURATION),
            rows: counter(meter, names::ROWS_DELIVERED),
            batches: counter(meter, names::BATCHES_DELIVERED),
            quarantined: counter(meter, names::ROWS_QUARANTINED),
            late_arrivals: counter(meter, names::LATE_ARRIVALS),
            connection_wait: histogram(meter, names::CONNECTION_WAIT),
            budget_wait: histogram(meter, names::BUDGET_WAIT),
            blob_reads: counter(meter, names::BLOB_READS),
            blob_writes: counter(meter, names::BLOB_WRITES),
        }
    }

    /// Records one tick (its summary line's numbers).
    pub fn tick(&self, attributes: &[KeyValue], facts: &TickFacts) {
        let mut with_outcome = attributes.to_vec();
        with_outcome.push(KeyValue::new(attribute::OUTCOME, facts.outcome));
        self.ticks.add(1, &with_outcome);
        let report = &facts.report;
        self.duration.record(report.duration_ms.max(0) as f64 / 1000.0, attributes);
        self.rows.add(facts.rows, attributes);
        self.batches.add(facts.batches, attributes);
        self.quarantined.add(facts.quarantined, attributes);
        self.late_arrivals.add(report.late_arrivals, attributes);
        self.connection_wait.record(report.connection_wait_ms as f64 / 1000.0, attributes);
        self.budget_wait.record(report.budget_wait_ms as f64 / 1000.0, attributes);
        self.blob_reads.add(report.blob_reads, attributes);
        self.blob_writes.add(report.blob_writes, attributes);
    }
}

/// One tick's facts, as its summary line gives them.
#[derive(Debug, Clone, PartialEq)]
pub struct TickFacts {
    /// [`TickOutcome::kind`], or `failed`.
    pub outcome: &'static str,
    pub rows: u64,
    pub batches: u64,
    pub quarantined: u64,
    pub report: TickReport,
    /// The error's message, for a failed tick.
    pub error: Option<String>,
}

impl TickFacts {
    pub fn of(result: Result<&TickOutcome, &TickError>, report: &TickReport) -> TickFacts {
        let (outcome, rows, batches, quarantined, error) = match result {
            Ok(outcome @ TickOutcome::Delivered { rows, batches, quarantined, .. }) => {
                (outcome.kind(), *rows, *batches, *quarantined, None)
            }
            Ok(outcome @ TickOutcome::LeaseLost { rows, batches }) => (outcome.kind(), *rows, *batches, 0, None),
            Ok(outcome) => (outcome.kind(), 0, 0, 0, None),
            Err(error) => ("failed", 0, 0, 0, Some(error.to_string())),
        };
        TickFacts { outcome, rows, batches, quarantined, report: *report, error }
    }
}
