//! The metrics dbtrigger exports and the attributes they carry: one table, which the code
//! registers from, docs/observability.md lists, and the alert rules and workbook are checked
//! against (tests/it/telemetry.rs).

/// What kind of instrument a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Adds up over ticks (exported as a sum: cumulative over OTLP, per interval to Application
    /// Insights).
    Counter,
    /// One value per tick (a duration, a wait).
    Histogram,
    /// The last value `status` showed (sampled from the same status at each export interval).
    Gauge,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Histogram => "histogram",
            Kind::Gauge => "gauge",
        }
    }
}

/// Where a metric's value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum From {
    /// The tick's outcome and report (what its summary line says).
    Tick,
    /// The poller's status (`dbtrigger status --json`, the status function): the same struct.
    Status,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    /// UCUM, as the OpenTelemetry semantic conventions write units.
    pub unit: &'static str,
    pub from: From,
    pub description: &'static str,
}

const fn metric(name: &'static str, kind: Kind, unit: &'static str, from: From, description: &'static str) -> Metric {
    Metric { name, kind, unit, from, description }
}

pub const LAG_ROWS: Metric = metric(
    "dbtrigger.lag.rows",
    Kind::Gauge,
    "{row}",
    From::Status,
    "rows after the checkpoint, counted up to 1,000,000 (status: lag_rows)",
);
pub const LAG_SECONDS: Metric = metric(
    "dbtrigger.lag.seconds",
    Kind::Gauge,
    "s",
    From::Status,
    "age of the oldest pending row, timestamp cursors (status: oldest_pending_age_seconds)",
);
pub const HEALTHY: Metric =
    metric("dbtrigger.healthy", Kind::Gauge, "1", From::Status, "1 when status says healthy, else 0 (status: healthy)");
pub const ATTEMPTS: Metric = metric(
    "dbtrigger.attempts",
    Kind::Gauge,
    "{attempt}",
    From::Status,
    "failed ticks on the batch at the checkpoint (status: attempts)",
);
pub const QUARANTINED: Metric = metric(
    "dbtrigger.quarantined",
    Kind::Gauge,
    "{row}",
    From::Status,
    "rows isolated as poison so far (status: quarantined)",
);
pub const LATE_ARRIVALS_TOTAL: Metric = metric(
    "dbtrigger.late_arrivals.total",
    Kind::Gauge,
    "{row}",
    From::Status,
    "rows found committed behind the checkpoint and delivered late, in all (status: late_arrivals)",
);
pub const MAX_LATENESS: Metric = metric(
    "dbtrigger.late_arrivals.max_lateness",
    Kind::Gauge,
    "s",
    From::Status,
    "the most seconds a late row was found after its cursor time (status: max_lateness_seconds)",
);
pub const HORIZON_AGE: Metric = metric(
    "dbtrigger.horizon.age",
    Kind::Gauge,
    "s",
    From::Status,
    "how long the transaction holding pending rows back has been open, with dbtrigger.horizon.holder (status: horizon_holder)",
);
pub const SLOT_RETAINED: Metric = metric(
    "dbtrigger.slot.retained",
    Kind::Gauge,
    "By",
    From::Status,
    "WAL a logical source's replication slot keeps on the server (status: slot.retained_bytes)",
);
pub const TICKS: Metric =
    metric("dbtrigger.ticks", Kind::Counter, "{tick}", From::Tick, "ticks, by dbtrigger.tick.outcome");
pub const TICK_DURATION: Metric =
    metric("dbtrigger.tick.duration", Kind::Histogram, "s", From::Tick, "how long a tick took (summary: duration_ms)");
pub const ROWS_DELIVERED: Metric = metric(
    "dbtrigger.rows.delivered",
    Kind::Counter,
    "{row}",
    From::Tick,
    "rows delivered and committed (summary: rows)",
);
pub const BATCHES_DELIVERED: Metric = metric(
    "dbtrigger.batches.delivered",
    Kind::Counter,
    "{batch}",
    From::Tick,
    "batches delivered and committed (summary: batches)",
);
pub const ROWS_QUARANTINED: Metric = metric(
    "dbtrigger.rows.quarantined",
    Kind::Counter,
    "{row}",
    From::Tick,
    "rows quarantined by ticks (summary: quarantined)",
);
pub const LATE_ARRIVALS: Metric = metric(
    "dbtrigger.late_arrivals",
    Kind::Counter,
    "{row}",
    From::Tick,
    "late rows found and delivered by ticks (summary: late_arrivals)",
);
pub const CONNECTION_WAIT: Metric = metric(
    "db.client.connection.wait_time",
    Kind::Histogram,
    "s",
    From::Tick,
    "how long a tick waited for a database connection (semantic conventions; summary: connection_wait_ms)",
);
pub const BUDGET_WAIT: Metric = metric(
    "dbtrigger.budget.wait_time",
    Kind::Histogram,
    "s",
    From::Tick,
    "how long a tick waited for the app's budget of bytes in flight (summary: budget_wait_ms)",
);
pub const BLOB_READS: Metric = metric(
    "dbtrigger.blob.reads",
    Kind::Counter,
    "{request}",
    From::Tick,
    "state document reads (summary: blob_reads)",
);
pub const BLOB_WRITES: Metric = metric(
    "dbtrigger.blob.writes",
    Kind::Counter,
    "{request}",
    From::Tick,
    "state document writes (summary: blob_writes)",
);

/// Every metric, in the order of the documentation's table.
pub const METRICS: &[Metric] = &[
    LAG_ROWS,
    LAG_SECONDS,
    HEALTHY,
    ATTEMPTS,
    QUARANTINED,
    LATE_ARRIVALS_TOTAL,
    MAX_LATENESS,
    HORIZON_AGE,
    SLOT_RETAINED,
    TICKS,
    TICK_DURATION,
    ROWS_DELIVERED,
    BATCHES_DELIVERED,
    ROWS_QUARANTINED,
    LATE_ARRIVALS,
    CONNECTION_WAIT,
    BUDGET_WAIT,
    BLOB_READS,
    BLOB_WRITES,
];

/// The attributes of every metric: which poller it is about.
pub mod attribute {
    /// The poller's name (its state document's).
    pub const POLLER: &str = "dbtrigger.poller";
    /// The function's folder name (semantic conventions: FaaS).
    pub const FUNCTION: &str = "faas.name";
    /// The app (`DBTRIGGER_APP_NAME`, else the site's name).
    pub const APP: &str = "dbtrigger.app";
    /// `table`, `query` or `logical`.
    pub const SOURCE_KIND: &str = "dbtrigger.source.kind";
    /// `postgresql`, `mysql` or `sqlite` (semantic conventions: database).
    pub const ENGINE: &str = "db.system.name";
    /// `dbtrigger.ticks` only: the tick's outcome (`caught-up`, `idle`, `failed`, …).
    pub const OUTCOME: &str = "dbtrigger.tick.outcome";
    /// `dbtrigger.horizon.age` only: `commit-horizon` or `settle-bound`.
    pub const HORIZON_HOLDER: &str = "dbtrigger.horizon.holder";
    /// The tick span's: the invocation id the Functions host sent (semantic conventions: FaaS).
    pub const INVOCATION_ID: &str = "faas.invocation_id";
    /// The tick span's counts (its summary line's).
    pub const ROWS: &str = "dbtrigger.rows";
    pub const BATCHES: &str = "dbtrigger.batches";
    pub const QUARANTINED: &str = "dbtrigger.quarantined";
    pub const LATE_ARRIVALS: &str = "dbtrigger.late_arrivals";
    pub const BLOB_READS: &str = "dbtrigger.blob.reads";
    pub const BLOB_WRITES: &str = "dbtrigger.blob.writes";
    /// Rows still after the checkpoint when the tick ended (up to 100,000).
    pub const LAG_ROWS_AFTER: &str = "dbtrigger.lag.rows_after";
    /// A delivery span's: its batch, its size, where it went (no secret), and how it ended
    /// (`acknowledged`, `rejected`, `transient`), with the receiver's HTTP status when it refused.
    pub const BATCH_ID: &str = "dbtrigger.batch.id";
    pub const BATCH_ROWS: &str = "dbtrigger.batch.rows";
    pub const SINK: &str = "dbtrigger.sink";
    pub const DELIVERY_OUTCOME: &str = "dbtrigger.delivery.outcome";
    pub const HTTP_STATUS: &str = "http.response.status_code";

    /// Every attribute above, for the documentation's checks.
    pub const ALL: &[&str] = &[
        POLLER,
        FUNCTION,
        APP,
        SOURCE_KIND,
        ENGINE,
        OUTCOME,
        HORIZON_HOLDER,
        INVOCATION_ID,
        ROWS,
        BATCHES,
        QUARANTINED,
        LATE_ARRIVALS,
        BLOB_READS,
        BLOB_WRITES,
        LAG_ROWS_AFTER,
        BATCH_ID,
        BATCH_ROWS,
        SINK,
        DELIVERY_OUTCOME,
        HTTP_STATUS,
    ];
}
