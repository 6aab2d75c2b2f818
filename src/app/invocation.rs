//! What one invocation came to, and the one line that says so.

use serde_json::Value;

use crate::config::ConfigError;
use crate::tick::{TickError, TickOutcome, TickReport};

/// Why a function cannot run, located as precisely as it was found.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unusable {
    #[error(transparent)]
    Config(ConfigError),
    /// The configuration is valid but the source, sink or store could not be opened.
    #[error("{file}: {section}: {reason}")]
    Open { file: String, section: &'static str, reason: String },
}

/// What one invocation came to: the same for every caller, each rendering it its own way.
#[derive(Debug)]
pub enum Invocation {
    Ticked {
        poller: String,
        outcome: TickOutcome,
        report: TickReport,
    },
    Failed {
        poller: String,
        error: TickError,
        report: TickReport,
    },
    Unusable {
        function: String,
        reason: Unusable,
    },
    Unknown {
        function: String,
        known: Vec<String>,
    },
    /// A status function answered: `status_code` (200 when every poller is healthy, 503 when one
    /// is not, 404 for an unknown `?poller=`) and `body` go into the HTTP output binding.
    Answered {
        function: String,
        response_binding: String,
        status_code: u16,
        body: Value,
        summary: String,
        /// The page for a browser (`Accept: text/html` or `?format=html`), sent instead of `body`.
        page: Option<String>,
    },
    /// A watchdog ran: its report's lines (a summary, one per finding, notes, kicks).
    Watched {
        function: String,
        lines: Vec<String>,
        findings: usize,
    },
    /// The process is shutting down and its grace period is over: the tick was stopped at its
    /// next await (what it had delivered but not committed is sent again by the next tick), and
    /// its lease given back when that could be done (else it expires).
    Abandoned {
        poller: String,
        lease_released: bool,
    },
}

impl Invocation {
    /// The one line that says what happened, for logs, the host's `Logs` and the terminal. A
    /// tick's is its summary: `key=value` pairs (so that Application Insights queries can split
    /// them), then the same in words as `message`.
    pub fn line(&self) -> String {
        match self {
            Invocation::Ticked { poller, outcome, report } => {
                let (rows, batches, quarantined) = match outcome {
                    TickOutcome::Delivered { rows, batches, quarantined, .. } => (*rows, *batches, *quarantined),
                    TickOutcome::LeaseLost { rows, batches } => (*rows, *batches, 0),
                    _ => (0, 0, 0),
                };
                format!(
                    "tick poller={poller} outcome={} rows={rows} batches={batches} quarantined={quarantined} {} message={:?}",
                    outcome.kind(),
                    report_pairs(report),
                    format!("{outcome}{}", waited_words(report))
                )
            }
            Invocation::Failed { poller, error, report } => format!(
                "tick poller={poller} outcome=failed {} message={:?}",
                report_pairs(report),
                format!("tick failed: {error}{}", waited_words(report))
            ),
            Invocation::Unusable { function, reason } => format!("{function}: {reason}"),
            Invocation::Unknown { function, known } => {
                format!("{function}: no such function in this app (functions: {})", known.join(", "))
            }
            Invocation::Answered { function, summary, .. } => format!("{function}: {summary}"),
            Invocation::Watched { lines, .. } => lines.join("\n"),
            Invocation::Abandoned { poller, lease_released } => format!(
                "tick poller={poller} outcome=abandoned message={:?}",
                if *lease_released {
                    "the handler is shutting down: tick stopped, lease released; the next tick sends again what was not committed"
                } else {
                    "the handler is shutting down: tick stopped; its lease expires; the next tick sends again what was not committed"
                }
            ),
        }
    }

    pub fn succeeded(&self) -> bool {
        matches!(self, Invocation::Ticked { .. } | Invocation::Answered { .. } | Invocation::Watched { .. })
    }
}

/// What the summary's words add when the tick waited for a database connection.
fn waited_words(report: &TickReport) -> String {
    let mut words = String::new();
    if report.connection_wait_ms > 0 {
        words.push_str(&format!(
            " (waited {} ms for a database connection: the app's others to that database were in use)",
            report.connection_wait_ms
        ));
    }
    if report.budget_wait_ms > 0 {
        words.push_str(&format!(
            " (waited {} ms for the app's budget of bytes in flight, {})",
            report.budget_wait_ms,
            crate::tick::budget::SETTING
        ));
    }
    words
}

/// A tick's costs as `key=value` pairs: duration, lag after it, blob requests, fencing token, and
/// the late-arrival detector's check and findings.
fn report_pairs(report: &TickReport) -> String {
    let lag = match report.lag_after {
        Some(lag) if lag.capped => format!("{}+", lag.rows),
        Some(lag) => lag.rows.to_string(),
        None => "unknown".to_string(),
    };
    let token = report.fencing_token.map(|token| token.to_string()).unwrap_or_else(|| "none".to_string());
    let lateness = report.max_lateness_seconds.map(|seconds| seconds.to_string()).unwrap_or_else(|| "none".to_string());
    format!(
        "late_arrivals={} max_lateness_seconds={lateness} late_check={} duration_ms={} connection_wait_ms={} budget_wait_ms={} lag_rows={lag} blob_reads={} blob_writes={} fencing_token={token}",
        report.late_arrivals,
        report.late_check.as_str(),
        report.duration_ms,
        report.connection_wait_ms,
        report.budget_wait_ms,
        report.blob_reads,
        report.blob_writes
    )
}
