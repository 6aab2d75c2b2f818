//! The app: every function folder, each opened once into a [`Function`], and the one way in,
//! [`App::invoke`], that the handler, `dbtrigger tick`, `dev` and `demo` all go through.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use tracing::{error, info};

use crate::config::{AppConfig, ConfigError, FunctionConfig, PollerConfig, Settings, StatusConfig};
use crate::domain::health::PollerHealth;
use crate::protocol::InvocationRequest;
use crate::tick::{Clock, Poller, SystemClock, TickError, TickOutcome, TickReport};

/// One function of the app, as it was opened at start-up.
pub enum Function {
    Poller(Arc<Poller>),
    /// Answers HTTP requests with every poller's status.
    Status(StatusConfig),
    /// Checks every poller on a timer, reports the stalled ones, may kick them.
    Watchdog(Arc<crate::watchdog::Watchdog>),
    /// Its configuration (or a connection it names) is unusable: every invocation fails with this.
    Unusable(Unusable),
}

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
    },
    /// A watchdog ran: its report's lines (a summary, one per finding, notes, kicks).
    Watched {
        function: String,
        lines: Vec<String>,
        findings: usize,
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
                    outcome.to_string()
                )
            }
            Invocation::Failed { poller, error, report } => format!(
                "tick poller={poller} outcome=failed {} message={:?}",
                report_pairs(report),
                format!("tick failed: {error}")
            ),
            Invocation::Unusable { function, reason } => format!("{function}: {reason}"),
            Invocation::Unknown { function, known } => {
                format!("{function}: no such function in this app (functions: {})", known.join(", "))
            }
            Invocation::Answered { function, summary, .. } => format!("{function}: {summary}"),
            Invocation::Watched { lines, .. } => lines.join("\n"),
        }
    }

    pub fn succeeded(&self) -> bool {
        matches!(self, Invocation::Ticked { .. } | Invocation::Answered { .. } | Invocation::Watched { .. })
    }
}

/// A tick's costs as `key=value` pairs: duration, lag after it, blob requests, fencing token.
fn report_pairs(report: &TickReport) -> String {
    let lag = match report.lag_after {
        Some(lag) if lag.capped => format!("{}+", lag.rows),
        Some(lag) => lag.rows.to_string(),
        None => "unknown".to_string(),
    };
    let token = report.fencing_token.map(|token| token.to_string()).unwrap_or_else(|| "none".to_string());
    format!(
        "duration_ms={} lag_rows={lag} blob_reads={} blob_writes={} fencing_token={token}",
        report.duration_ms, report.blob_reads, report.blob_writes
    )
}

pub struct App {
    pub app_name: String,
    functions: BTreeMap<String, Function>,
    clock: Arc<dyn Clock>,
}

impl App {
    /// Loads and opens every function under `app_root`. Only an unreadable app root is an error.
    pub fn load(app_root: &Path, settings: &Settings) -> Result<App, ConfigError> {
        let config = AppConfig::load(app_root, settings)?;
        Ok(App::open(config, settings, Arc::new(SystemClock)))
    }

    /// Opens every function of `config`; `clock` is the one every tick decides time by.
    pub fn open(config: AppConfig, settings: &Settings, clock: Arc<dyn Clock>) -> App {
        let owner_id = owner_id(settings);
        let mut functions = BTreeMap::new();
        for (name, parsed) in config.functions {
            let function = match parsed.map_err(Unusable::Config) {
                Ok(FunctionConfig::Poller(poller_config)) => open_poller(*poller_config, clock.clone(), &owner_id),
                Ok(FunctionConfig::Status(status)) => Function::Status(status),
                Ok(FunctionConfig::Watchdog(config)) => {
                    let file = config.file.display().to_string();
                    match crate::watchdog::Watchdog::open(*config) {
                        Ok(watchdog) => Function::Watchdog(Arc::new(watchdog)),
                        Err(error) => Function::Unusable(Unusable::Open {
                            file,
                            section: "watchdog.state",
                            reason: error.to_string(),
                        }),
                    }
                }
                Err(unusable) => Function::Unusable(unusable),
            };
            match &function {
                Function::Poller(poller) => info!(
                    function = %name,
                    poller = %poller.config.poller_name,
                    source = %poller.source.describe(),
                    sink = %poller.sink.describe(),
                    state = %poller.store.describe(),
                    "poller ready"
                ),
                Function::Status(_) => info!(function = %name, "status function ready"),
                Function::Watchdog(_) => info!(function = %name, "watchdog ready"),
                Function::Unusable(reason) => error!(function = %name, "poller not usable: {reason}"),
            }
            functions.insert(name, function);
        }
        App { app_name: config.app_name, functions, clock }
    }

    /// The function the host names (function names are case-insensitive, as in Azure Functions).
    pub fn function(&self, name: &str) -> Option<&Function> {
        self.functions.get(name).or_else(|| {
            self.functions
                .iter()
                .find(|(function_name, _)| function_name.eq_ignore_ascii_case(name))
                .map(|(_, function)| function)
        })
    }

    pub fn function_names(&self) -> Vec<String> {
        self.functions.keys().cloned().collect()
    }

    /// Every poller of the app, by function name.
    pub fn pollers(&self) -> impl Iterator<Item = (&String, &Arc<Poller>)> {
        self.functions.iter().filter_map(|(name, function)| match function {
            Function::Poller(poller) => Some((name, poller)),
            Function::Status(_) | Function::Watchdog(_) | Function::Unusable(_) => None,
        })
    }

    /// Every timer of the app: (function name, schedule, runOnStartup), for `dbtrigger dev`.
    pub fn timers(&self) -> Vec<(String, crate::domain::schedule::Schedule, bool)> {
        self.functions
            .iter()
            .filter_map(|(name, function)| match function {
                Function::Poller(poller) => poller
                    .config
                    .schedule
                    .clone()
                    .map(|schedule| (name.clone(), schedule, poller.config.run_on_startup)),
                Function::Watchdog(watchdog) => watchdog
                    .config
                    .schedule
                    .clone()
                    .map(|schedule| (name.clone(), schedule, watchdog.config.run_on_startup)),
                Function::Status(_) | Function::Unusable(_) => None,
            })
            .collect()
    }

    /// The status of every poller of the app (and of every function that cannot run), or of the
    /// one named by its poller or function name; `None` when there is no such poller.
    pub async fn status(&self, only: Option<&str>) -> Option<Vec<PollerHealth>> {
        let now = self.clock.now();
        let wanted = |name: &str, poller: Option<&Poller>| match only {
            None => true,
            Some(only) => {
                name.eq_ignore_ascii_case(only) || poller.is_some_and(|poller| poller.config.poller_name == only)
            }
        };
        let mut reports = Vec::new();
        for (name, function) in &self.functions {
            match function {
                Function::Poller(poller) if wanted(name, Some(poller)) => {
                    reports.push(crate::status::of_poller_cached(name, poller, now));
                }
                _ => {}
            }
        }
        let mut healths = futures::future::join_all(reports).await;
        for (name, function) in &self.functions {
            if let Function::Unusable(reason) = function
                && wanted(name, None)
            {
                healths.push(PollerHealth::unusable(name, reason.to_string()));
            }
        }
        healths.sort_by(|left, right| left.function.cmp(&right.function));
        if only.is_some() && healths.is_empty() { None } else { Some(healths) }
    }

    /// Runs `function` once, as a manual run (no request data): the CLI's `tick`.
    pub async fn invoke(&self, function: &str) -> Invocation {
        self.invoke_with(function, &InvocationRequest::default()).await
    }

    /// Runs `function` once for `request`: the one way in for the handler, the CLI, `dev` and `demo`.
    pub async fn invoke_with(&self, function: &str, request: &InvocationRequest) -> Invocation {
        match self.function(function) {
            None => Invocation::Unknown { function: function.to_string(), known: self.function_names() },
            Some(Function::Unusable(reason)) => {
                Invocation::Unusable { function: function.to_string(), reason: reason.clone() }
            }
            Some(Function::Status(config)) => {
                let query = request.http_query(&config.request_binding);
                let only = query.get("poller").map(String::as_str);
                let response_binding = config.response_binding.clone();
                let function = function.to_string();
                match self.status(only).await {
                    None => Invocation::Answered {
                        function,
                        response_binding,
                        status_code: 404,
                        body: serde_json::json!({"error": format!("no poller {:?} in this app", only.unwrap_or_default())}),
                        summary: format!("no poller {:?}", only.unwrap_or_default()),
                    },
                    Some(healths) => {
                        let unhealthy = healths.iter().filter(|health| !health.healthy).count();
                        Invocation::Answered {
                            function,
                            response_binding,
                            status_code: if unhealthy == 0 { 200 } else { 503 },
                            summary: format!("status of {} pollers, {unhealthy} unhealthy", healths.len()),
                            body: serde_json::to_value(&healths).unwrap_or(Value::Null),
                        }
                    }
                }
            }
            Some(Function::Poller(poller)) => tick(poller).await,
            Some(Function::Watchdog(watchdog)) => {
                let pollers: Vec<(String, Arc<Poller>)> =
                    self.pollers().map(|(name, poller)| (name.clone(), poller.clone())).collect();
                let unusable: Vec<(String, String)> = self
                    .functions
                    .iter()
                    .filter_map(|(name, function)| match function {
                        Function::Unusable(reason) => Some((name.clone(), reason.to_string())),
                        _ => None,
                    })
                    .collect();
                let report = watchdog.run(&pollers, &unusable, self.clock.now()).await;
                let mut lines = report.lines();
                if watchdog.config.kick {
                    for name in &report.to_kick {
                        if let Some((_, poller)) = pollers.iter().find(|(function, _)| function == name) {
                            let kicked = tick(poller).await;
                            lines.push(format!("watchdog kicked {name}: {}", kicked.line()));
                        }
                    }
                }
                Invocation::Watched { function: function.to_string(), lines, findings: report.findings.len() }
            }
        }
    }
}

/// One tick of `poller`, with its summary.
async fn tick(poller: &Poller) -> Invocation {
    let poller_name = poller.config.poller_name.clone();
    match poller.tick_reported().await {
        (Ok(outcome), report) => Invocation::Ticked { poller: poller_name, outcome, report },
        (Err(error), report) => Invocation::Failed { poller: poller_name, error, report },
    }
}

fn open_poller(config: PollerConfig, clock: Arc<dyn Clock>, owner_id: &str) -> Function {
    let file = config.file.display().to_string();
    let unusable = |section: &'static str, reason: String| {
        Function::Unusable(Unusable::Open { file: file.clone(), section, reason })
    };
    let source = match crate::source::open(&config.source) {
        Ok(source) => source,
        Err(error) => return unusable("poller.source", error.to_string()),
    };
    let sink = match crate::sink::open(&config.sink) {
        Ok(sink) => sink,
        Err(error) => return unusable("poller.sink", error.to_string()),
    };
    let (store, blobs) = match crate::store::open(&config.state) {
        Ok(opened) => opened,
        Err(error) => return unusable("poller.state", error.to_string()),
    };
    let poller = Poller::new(config, source, sink, store, clock, owner_id.to_string()).with_quarantine(blobs);
    Function::Poller(Arc::new(poller))
}

/// `{instance}/{pid}-{random}`: unique per process, readable in the state document.
fn owner_id(settings: &Settings) -> String {
    let instance = settings
        .get("WEBSITE_INSTANCE_ID")
        .map(|id| id.chars().take(16).collect::<String>())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|name| name.trim().to_string()))
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "local".to_string());
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("{instance}/{}-{}", std::process::id(), &random[..8])
}
