//! Opening the app: every function folder, once, into a [`Function`]; the process's owner id and
//! schedule zone.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use tracing::{error, info, warn};

use super::{App, Function, Unusable};
use crate::clock::{Clock, SystemClock};
use crate::config::plan::HostingPlan;
use crate::config::{AppConfig, ConfigError, FunctionConfig, PollerConfig, Settings};
use crate::domain::schedule::ScheduleZone;
use crate::tick::Poller;

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
