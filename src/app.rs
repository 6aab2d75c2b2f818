//! The app: every function folder, each opened once into a [`Function`], and the one way in,
//! [`App::invoke`], that the handler, `dbtrigger tick`, `dev` and `demo` all go through.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde_json::Value;
use tracing::{error, info, warn};

use crate::clock::{Clock, SystemClock};
use crate::config::plan::{FunctionTimeout, HostingPlan};
use crate::config::{AppConfig, ConfigError, FunctionConfig, PollerConfig, Settings, StatusConfig};
use crate::domain::health::PollerHealth;
use crate::domain::horizon::Audience;
use crate::domain::schedule::ScheduleZone;
use crate::protocol::InvocationRequest;
use crate::tick::{Poller, TickError, TickOutcome, TickReport};

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

pub struct App {
    pub app_name: String,
    functions: BTreeMap<String, Function>,
    clock: Arc<dyn Clock>,
    /// Functions the host does not run (function name → why).
    disabled: BTreeMap<String, String>,
    /// How long the host lets one invocation run (the watchdog kicks only within it).
    pub function_timeout: FunctionTimeout,
    /// The zone cron schedules are evaluated in (`WEBSITE_TIME_ZONE`).
    pub schedule_zone: ScheduleZone,
    /// Set when in-flight ticks must stop (a shutdown whose grace period is over).
    abandon: tokio::sync::watch::Sender<bool>,
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
        let schedule_zone = schedule_zone(settings);
        let mut functions = BTreeMap::new();
        // One pool per database target, shared by the app's pollers of it; one budget of bytes in
        // flight for them all.
        let pools = crate::source::pools::Pools::new();
        let budget = crate::tick::budget::BytesBudget::from_settings(settings).unwrap_or_else(|reason| {
            error!("{reason}: the default budget ({} bytes) applies", crate::tick::budget::DEFAULT_BYTES);
            crate::tick::budget::BytesBudget::new(crate::tick::budget::DEFAULT_BYTES)
        });
        for (name, parsed) in config.functions {
            let function = match parsed.map_err(Unusable::Config) {
                Ok(FunctionConfig::Poller(poller_config)) => {
                    open_poller(*poller_config, clock.clone(), &owner_id, &pools, &budget)
                }
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
            if let Some(reason) = config.disabled.get(&name) {
                info!(function = %name, "function disabled: {reason}");
            }
            functions.insert(name, function);
        }
        info!(
            function_timeout = %config.function_timeout.describe(),
            schedule_zone = schedule_zone.name(),
            "app opened"
        );
        App {
            app_name: config.app_name,
            functions,
            clock,
            disabled: config.disabled,
            function_timeout: config.function_timeout,
            schedule_zone,
            abandon: tokio::sync::watch::channel(false).0,
        }
    }

    /// Why the host does not run `function`, when it does not (function names without regard to case).
    pub fn disabled(&self, function: &str) -> Option<&str> {
        self.disabled.iter().find(|(name, _)| name.eq_ignore_ascii_case(function)).map(|(_, reason)| reason.as_str())
    }

    /// Stops every tick in flight at its next await and gives back its lease; no tick starts
    /// after this. For the end of a shutdown's grace period.
    pub fn abandon_ticks(&self) {
        self.abandon.send_replace(true);
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

    /// Every poller of the app, by function name, disabled ones included.
    pub fn pollers(&self) -> impl Iterator<Item = (&String, &Arc<Poller>)> {
        self.functions.iter().filter_map(|(name, function)| match function {
            Function::Poller(poller) => Some((name, poller)),
            Function::Status(_) | Function::Watchdog(_) | Function::Unusable(_) => None,
        })
    }

    /// The pollers the host runs (not disabled).
    fn enabled_pollers(&self) -> Vec<(String, Arc<Poller>)> {
        self.pollers()
            .filter(|(name, _)| !self.disabled.contains_key(*name))
            .map(|(name, poller)| (name.clone(), poller.clone()))
            .collect()
    }

    /// Every timer the host would start: (function name, schedule, runOnStartup), for
    /// `dbtrigger dev` (a disabled function's timer never fires).
    pub fn timers(&self) -> Vec<(String, crate::domain::schedule::Schedule, bool)> {
        self.functions
            .iter()
            .filter(|(name, _)| !self.disabled.contains_key(*name))
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
    /// `audience` says what it may show of other sessions (an operator's `dbtrigger status`, or
    /// the status function).
    pub async fn status(&self, only: Option<&str>, audience: Audience) -> Option<Vec<PollerHealth>> {
        self.status_read(only, audience, false).await
    }

    /// Every poller's status for telemetry's gauges: as [`App::status`] (published), without
    /// counting a change stream's lag ([`crate::status::of_poller_sampled`]).
    pub async fn sampled_status(&self) -> Option<Vec<PollerHealth>> {
        self.status_read(None, Audience::Published, true).await
    }

    async fn status_read(&self, only: Option<&str>, audience: Audience, sampled: bool) -> Option<Vec<PollerHealth>> {
        let now = self.clock.now();
        let wanted = |name: &str, poller: Option<&Poller>| match only {
            None => true,
            Some(only) => {
                name.eq_ignore_ascii_case(only) || poller.is_some_and(|poller| poller.config.poller_name == only)
            }
        };
        let mut reports = Vec::new();
        let mut healths = Vec::new();
        for (name, function) in &self.functions {
            let poller = match function {
                Function::Poller(poller) => Some(poller.as_ref()),
                _ => None,
            };
            if !matches!(function, Function::Poller(_) | Function::Unusable(_)) || !wanted(name, poller) {
                continue;
            }
            // A disabled function is healthy whatever its state: nothing more is read.
            if let Some(reason) = self.disabled.get(name) {
                let poller_name = poller.map(|poller| poller.config.poller_name.as_str()).unwrap_or(name);
                healths.push(PollerHealth::disabled(name, poller_name, reason.clone()));
                continue;
            }
            match function {
                Function::Poller(poller) => reports.push(async move {
                    if sampled {
                        crate::status::of_poller_sampled(name, poller, now).await
                    } else {
                        crate::status::of_poller_cached(name, poller, now, audience).await
                    }
                }),
                Function::Unusable(reason) => healths.push(PollerHealth::unusable(name, reason.to_string())),
                _ => {}
            }
        }
        healths.extend(futures::future::join_all(reports).await);
        healths.sort_by(|left, right| left.function.cmp(&right.function));
        if only.is_some() && healths.is_empty() { None } else { Some(healths) }
    }

    /// The status page of `healths`, with what the app's watchdog remembers (its findings, the
    /// lag series), read from its memory document.
    async fn status_page(&self, healths: &[PollerHealth]) -> String {
        use crate::status::page::{WatchdogView, render};
        let now = self.clock.now();
        let watchdog = self.functions.iter().find_map(|(_, function)| match function {
            Function::Watchdog(watchdog) => Some(watchdog.clone()),
            _ => None,
        });
        let Some(watchdog) = watchdog else {
            return render(healths, WatchdogView::None, now);
        };
        match watchdog.memory().await {
            Ok(Some(memory)) => render(healths, WatchdogView::Remembered(&memory), now),
            Ok(None) => render(healths, WatchdogView::NotYet, now),
            Err(reason) => render(healths, WatchdogView::Unreadable(&reason), now),
        }
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
                let accept = request.http_header(&config.request_binding, "Accept").unwrap_or_default();
                let wants_page = match query.get("format").map(String::as_str) {
                    Some(format) => format.eq_ignore_ascii_case("html"),
                    None => accept.to_ascii_lowercase().contains("text/html"),
                };
                let response_binding = config.response_binding.clone();
                let function = function.to_string();
                match self.status(only, Audience::Published).await {
                    None => Invocation::Answered {
                        function,
                        response_binding,
                        status_code: 404,
                        body: serde_json::json!({"error": format!("no poller {:?} in this app", only.unwrap_or_default())}),
                        summary: format!("no poller {:?}", only.unwrap_or_default()),
                        page: None,
                    },
                    Some(healths) => {
                        let unhealthy = healths.iter().filter(|health| !health.healthy).count();
                        let page = match wants_page {
                            true => Some(self.status_page(&healths).await),
                            false => None,
                        };
                        Invocation::Answered {
                            function,
                            response_binding,
                            status_code: if unhealthy == 0 { 200 } else { 503 },
                            summary: format!("status of {} pollers, {unhealthy} unhealthy", healths.len()),
                            body: serde_json::to_value(&healths).unwrap_or(Value::Null),
                            page,
                        }
                    }
                }
            }
            Some(Function::Poller(poller)) => {
                // The host starts no timer for a disabled function; what reaches the handler is
                // a run through the admin API (the portal's Test/Run, with the master key), which
                // the host allows for a disabled function: it runs, and says so.
                if let Some(reason) = self.disabled(function) {
                    warn!(function = %function, "running a disabled function (a run through the admin API): {reason}");
                }
                self.tick(poller).await
            }
            Some(Function::Watchdog(watchdog)) => self.watch(function, watchdog).await,
        }
    }

    /// One watchdog run: judge the pollers the host runs, then kick, within the time the
    /// invocation has left, the ones a tick may fix.
    async fn watch(&self, function: &str, watchdog: &crate::watchdog::Watchdog) -> Invocation {
        let started = self.clock.now();
        let pollers = self.enabled_pollers();
        let mut unusable = Vec::new();
        let mut disabled = Vec::new();
        for (name, function) in &self.functions {
            match (self.disabled.contains_key(name), function) {
                (true, Function::Poller(poller)) => disabled.push(poller.config.poller_name.clone()),
                (true, _) => disabled.push(name.clone()),
                (false, Function::Unusable(reason)) => unusable.push((name.clone(), reason.to_string())),
                (false, _) => {}
            }
        }
        let report = watchdog.run(&pollers, &unusable, &disabled, started, &self.schedule_zone).await;
        let mut lines = report.lines();
        if watchdog.config.kick {
            // Regression (issue 24, item 12): kicks ran one after another with no overall
            // budget, so a few slow ones outlasted functionTimeout and the host restarted the
            // whole process, every tick in flight with it.
            let deadline = self.function_timeout.limit.and_then(|limit| {
                chrono::Duration::from_std(limit).ok().and_then(|limit| started.checked_add_signed(limit))
            });
            for name in &report.to_kick {
                let Some((_, poller)) = pollers.iter().find(|(candidate, _)| candidate == name) else {
                    continue;
                };
                let budget = poller.config.batch.tick_budget;
                match kick_fits(deadline, self.clock.now(), budget) {
                    Ok(()) => {
                        let kicked = match crate::telemetry::traced::child_context(&format!("kick {name}")) {
                            Some(context) => {
                                use opentelemetry::context::FutureExt as _;
                                let kicked = self.tick(poller).with_context(context.clone()).await;
                                crate::telemetry::traced::finish(context, kicked.succeeded(), &kicked.line());
                                kicked
                            }
                            None => self.tick(poller).await,
                        };
                        lines.push(format!("watchdog kicked {name}: {}", kicked.line()));
                    }
                    Err(left) => {
                        let reason = format!(
                            "a tick may take its budget ({} s) plus {} s, and {} s are left before {}: a later run kicks it",
                            budget.as_secs(),
                            KICK_MARGIN.as_secs(),
                            left.as_secs(),
                            self.function_timeout.describe()
                        );
                        let line = format!("watchdog kick skipped function={name} message={reason:?}");
                        warn!("{line}");
                        lines.push(line);
                    }
                }
            }
        }
        Invocation::Watched { function: function.to_string(), lines, findings: report.findings.len() }
    }

    /// One tick of `poller`, with its summary; stopped (and its lease given back) when the
    /// process abandons its ticks.
    async fn tick(&self, poller: &Poller) -> Invocation {
        let poller_name = poller.config.poller_name.clone();
        let mut abandon = self.abandon.subscribe();
        if *abandon.borrow_and_update() {
            return Invocation::Abandoned { poller: poller_name, lease_released: false };
        }
        tokio::select! {
            ticked = poller.tick_reported() => {
                let (result, report) = ticked;
                crate::telemetry::record_tick(poller, result.as_ref(), &report);
                match result {
                    Ok(outcome) => Invocation::Ticked { poller: poller_name, outcome, report },
                    Err(error) => Invocation::Failed { poller: poller_name, error, report },
                }
            },
            () = abandoned(&mut abandon) => {
                // The tick's future is dropped here, at whatever await it was: nothing it
                // delivered after its last commit is committed, so nothing is lost.
                let lease_released = release_abandoned_lease(poller).await;
                Invocation::Abandoned { poller: poller_name, lease_released }
            }
        }
    }
}

/// Completes once the app abandons its ticks (never, if the app is dropped first).
async fn abandoned(abandon: &mut tokio::sync::watch::Receiver<bool>) {
    // The borrowed value is not held across an await: the handler's future must stay `Send`.
    if abandon.wait_for(|abandoned| *abandoned).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Time a kicked tick may need beyond its budget (its last commit, the release): the margin a
/// tick budget must leave before functionTimeout.
const KICK_MARGIN: std::time::Duration =
    std::time::Duration::from_secs(crate::config::defaults::TIMEOUT_MARGIN_SECONDS);

/// Whether a tick with `budget` fits before `deadline` (the invocation's functionTimeout) with
/// the margin; `Err` says how long is left.
fn kick_fits(
    deadline: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    budget: std::time::Duration,
) -> Result<(), std::time::Duration> {
    let Some(deadline) = deadline else {
        return Ok(());
    };
    let left = (deadline - now).to_std().unwrap_or_default();
    if budget.saturating_add(KICK_MARGIN) <= left { Ok(()) } else { Err(left) }
}

/// After a tick was dropped: read its document again and give the lease back by compare-and-swap
/// if this process still holds it. `false` when it could not (the lease then expires by itself).
async fn release_abandoned_lease(poller: &Poller) -> bool {
    let key = poller.key();
    let Ok(Some(versioned)) = poller.store.read(&key).await else {
        return false;
    };
    let now = poller.clock.now();
    let Ok(released) = crate::domain::transitions::release(&versioned.document, &poller.owner_id, now) else {
        return false;
    };
    poller.store.write(&key, &released, crate::store::WriteCondition::Matches(versioned.etag)).await.is_ok()
}

/// The zone the host evaluates cron schedules in: `WEBSITE_TIME_ZONE`, else `TZ` (what .NET's
/// `TimeZoneInfo.Local` follows on Linux), else UTC. Linux Consumption and Flex Consumption
/// ignore both (azure-functions-host `WebJobsScriptHostService.cs` `ValidateLinuxSKUConfiguration`
/// warns that they are not supported there). A zone that cannot be read is UTC, with an error.
fn schedule_zone(settings: &Settings) -> ScheduleZone {
    let mut chosen = None;
    for setting in ["WEBSITE_TIME_ZONE", "TZ"] {
        if let Some(name) = settings.get(setting).map(str::trim).filter(|name| !name.is_empty()) {
            chosen = Some((setting, name));
            break;
        }
    }
    let Some((setting, name)) = chosen else {
        return ScheduleZone::Utc;
    };
    let plan = HostingPlan::detect(settings);
    let linux_container = settings.get("CONTAINER_NAME").is_some() || settings.get("LEGION_SERVICE_HOST").is_some();
    if linux_container && matches!(plan, HostingPlan::Consumption | HostingPlan::FlexConsumption) {
        warn!("{setting}={name} is ignored: {} does not support it, schedules run in UTC", plan.describe());
        return ScheduleZone::Utc;
    }
    match tz::TimeZone::from_posix_tz(name) {
        Ok(zone) => ScheduleZone::named(name, zone),
        Err(reason) => {
            error!("{setting}={name} is not a time zone this machine knows ({reason}): schedules are read in UTC");
            ScheduleZone::Utc
        }
    }
}

fn open_poller(
    config: PollerConfig,
    clock: Arc<dyn Clock>,
    owner_id: &str,
    pools: &crate::source::pools::Pools,
    budget: &Arc<crate::tick::budget::BytesBudget>,
) -> Function {
    let file = config.file.display().to_string();
    let unusable = |section: &'static str, reason: String| {
        Function::Unusable(Unusable::Open { file: file.clone(), section, reason })
    };
    let source = match crate::source::open_shared(&config.source, pools, config.batch.tick_budget) {
        Ok(source) => source,
        Err(error) => return unusable("poller.source", error.to_string()),
    };
    let sink = match crate::sink::open(&config.sink) {
        // A span per delivery when telemetry is on; the sink itself otherwise.
        Ok(sink) => crate::telemetry::traced::sink(sink),
        Err(error) => return unusable("poller.sink", error.to_string()),
    };
    let (store, blobs) = match crate::store::open(&config.state) {
        Ok(opened) => opened,
        Err(error) => return unusable("poller.state", error.to_string()),
    };
    let poller = Poller::new(config, source, sink, store, clock, owner_id.to_string())
        .with_quarantine(blobs)
        .with_budget(budget.clone());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text).unwrap().with_timezone(&Utc)
    }

    /// Regression (issue 24, item 12): a kick starts only when its tick's budget and the margin
    /// fit before functionTimeout; unbounded, every kick fits.
    #[test]
    fn a_kick_starts_only_within_the_time_the_invocation_has_left() {
        let deadline = Some(at("2024-01-01T00:10:00Z"));
        let budget = std::time::Duration::from_secs(240);
        assert_eq!(kick_fits(deadline, at("2024-01-01T00:05:30Z"), budget), Ok(()));
        assert_eq!(kick_fits(deadline, at("2024-01-01T00:05:31Z"), budget), Err(std::time::Duration::from_secs(269)));
        assert_eq!(kick_fits(deadline, at("2024-01-01T00:11:00Z"), budget), Err(std::time::Duration::ZERO));
        assert_eq!(kick_fits(None, at("2024-01-01T00:11:00Z"), budget), Ok(()));
    }
}
