//! The app: every function folder, each opened once into a [`Function`], and the one way in,
//! [`App::invoke`], that the handler, `dbtrigger tick`, `dev` and `demo` all go through.

//!
//! | room           | what it holds                                                            |
//! |----------------|--------------------------------------------------------------------------|
//! | `mod.rs`       | [`Function`], [`App`], finding a function, and [`App::invoke_with`].      |
//! | `open`         | opening the app: every function once, the owner id, the schedule zone.  |
//! | `invocation`   | [`Invocation`], what one invocation came to, and its one line; [`Unusable`].|
//! | `status`       | the status read of the pollers, and the status function's answer.      |
//! | `watch`        | the watchdog function's run and its kicks within functionTimeout.       |
//! | `run`          | one tick, stopped (its lease given back) when the app abandons its ticks.|

mod invocation;
mod open;
mod run;
mod status;
mod watch;

pub use invocation::{Invocation, Unusable};

use std::collections::BTreeMap;
use std::sync::Arc;

use tracing::warn;

use crate::clock::Clock;
use crate::config::StatusConfig;
use crate::config::plan::FunctionTimeout;
use crate::domain::schedule::ScheduleZone;
use crate::protocol::InvocationRequest;
use crate::tick::Poller;

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
    /// Why the host does not run `function`, when it does not (function names without regard to case).
    pub fn disabled(&self, function: &str) -> Option<&str> {
        self.disabled.iter().find(|(name, _)| name.eq_ignore_ascii_case(function)).map(|(_, reason)| reason.as_str())
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
            Some(Function::Status(config)) => self.answer_status(function, config, request).await,
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
}
