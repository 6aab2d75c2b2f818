//! A `watchdog` function: a timer whose invocation checks every poller of the app and reports the
//! stalled ones (seed 003: "the watchdog is what makes recovery real"). Its function.json has a
//! timerTrigger binding and a top-level `watchdog` section.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::function_json::{
    RawState, UsedSettings, WATCHDOG_SETTING_NAME_FIELDS, check_setting_name_fields, substitute_settings,
    timer_schedule,
};
use super::sink::{OutboundUrl, SigningKey, outbound_url, signing_key};
use super::state::{StateConfig, build_state};
use super::{ConfigError, Located, defaults, in_range, ranges};
use crate::domain::schedule::Schedule;
use crate::settings::Settings;

/// A validated watchdog.
#[derive(Debug, Clone)]
pub struct WatchdogConfig {
    pub function_name: String,
    pub app_name: String,
    pub file: std::path::PathBuf,
    pub schedule: Option<Schedule>,
    pub run_on_startup: bool,
    /// A poller with rows waiting and no commit for this many of its schedule's intervals is stalled.
    pub stalled_after_intervals: u32,
    /// Run a tick of a stalled poller (or one whose lease was abandoned) right away, in this process.
    pub kick: bool,
    /// Rows waiting behind a transaction open this long are reported (`horizon_held`).
    pub horizon_held_after: chrono::Duration,
    /// A logical source's slot holding more WAL than this is reported (`slot_retention`).
    pub slot_retention_bytes: u64,
    pub alert: Option<AlertConfig>,
    /// Where it lists the app's state documents and keeps what it saw last time.
    pub state: StateConfig,
}

/// An optional webhook the findings are posted to, signed like the sink.
#[derive(Debug, Clone)]
pub struct AlertConfig {
    pub url: OutboundUrl,
    pub signing_key: Option<SigningKey>,
    pub timeout: Duration,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawWatchdog {
    stalled_after_intervals: Option<u32>,
    horizon_held_after_seconds: Option<u64>,
    slot_retention_megabytes: Option<u64>,
    kick: Option<bool>,
    alert: Option<RawAlert>,
    #[serde(default)]
    state: RawState,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawAlert {
    url: String,
    secret: Option<String>,
    timeout_seconds: Option<u64>,
    allow_link_local: Option<bool>,
}

pub const DEFAULT_STALLED_AFTER_INTERVALS: u32 = super::defaults::STALLED_AFTER_INTERVALS;

/// Five minutes: longer than a healthy batch job's transaction, short enough that a session
/// forgotten `idle in transaction` is found the same hour.
pub const DEFAULT_HORIZON_HELD_AFTER_SECONDS: u64 = super::defaults::HORIZON_HELD_AFTER_SECONDS;

pub(super) fn build_watchdog(
    document: &Value,
    function_name: &str,
    settings: &Settings,
    app_root: &std::path::Path,
    at: &Located<'_>,
) -> Result<WatchdogConfig, ConfigError> {
    let (schedule, run_on_startup) = timer_schedule(document, at, settings)?;
    let mut section = document.get("watchdog").cloned().unwrap_or(Value::Null);
    if !section.is_object() {
        return Err(at.error("watchdog", "expected an object"));
    }
    let mut used = UsedSettings::default();
    check_setting_name_fields(&section, "watchdog", &WATCHDOG_SETTING_NAME_FIELDS, settings, &mut used, at)?;
    used.named(super::defaults::STATE_CONNECTION, settings);
    substitute_settings(&mut section, "watchdog", settings, &mut used, at).map_err(|error| used.scrub(error))?;
    let raw: RawWatchdog = serde_path_to_error::deserialize(&section).map_err(|error| {
        let path = error.path().to_string();
        let field = if path == "." { "watchdog".to_string() } else { format!("watchdog.{path}") };
        used.scrub(at.error(&field, error.into_inner().to_string()))
    })?;
    build_checked(raw, function_name, settings, app_root, at, schedule, run_on_startup)
        .map_err(|error| used.scrub(error))
}

/// The rest of [`build_watchdog`], once the section is parsed: every error it returns is
/// scrubbed by the caller.
#[allow(clippy::too_many_arguments)]
fn build_checked(
    raw: RawWatchdog,
    function_name: &str,
    settings: &Settings,
    app_root: &std::path::Path,
    at: &Located<'_>,
    schedule: Option<Schedule>,
    run_on_startup: bool,
) -> Result<WatchdogConfig, ConfigError> {
    let stalled_after_intervals = in_range(
        at,
        "watchdog.stalledAfterIntervals",
        raw.stalled_after_intervals,
        DEFAULT_STALLED_AFTER_INTERVALS,
        ranges::STALLED_AFTER_INTERVALS,
    )?;
    let horizon_held_after_seconds = in_range(
        at,
        "watchdog.horizonHeldAfterSeconds",
        raw.horizon_held_after_seconds,
        DEFAULT_HORIZON_HELD_AFTER_SECONDS,
        ranges::HORIZON_HELD_AFTER_SECONDS,
    )?;
    let slot_retention_megabytes = in_range(
        at,
        "watchdog.slotRetentionMegabytes",
        raw.slot_retention_megabytes,
        super::defaults::SLOT_RETENTION_MEGABYTES,
        ranges::SLOT_RETENTION_MEGABYTES,
    )?;
    let alert = match raw.alert {
        None => None,
        Some(alert) => {
            let allow_link_local = alert.allow_link_local.unwrap_or(false);
            let url = outbound_url(at, "watchdog.alert.url", &alert.url, allow_link_local, settings)?;
            let signing_key = match alert.secret {
                None => None,
                Some(name) => Some(signing_key(at, "watchdog.alert.secret", &name, settings)?),
            };
            let timeout = in_range(
                at,
                "watchdog.alert.timeoutSeconds",
                alert.timeout_seconds,
                defaults::ALERT_TIMEOUT_SECONDS,
                ranges::ALERT_TIMEOUT_SECONDS,
            )?;
            Some(AlertConfig { url, signing_key, timeout: Duration::from_secs(timeout) })
        }
    };
    let state = build_state(raw.state, settings, app_root, at, "watchdog.state")?;
    Ok(WatchdogConfig {
        function_name: function_name.to_string(),
        app_name: super::checked_app_name(settings, at)?,
        file: at.file.to_path_buf(),
        schedule,
        run_on_startup,
        stalled_after_intervals,
        horizon_held_after: chrono::Duration::seconds(horizon_held_after_seconds as i64),
        slot_retention_bytes: slot_retention_megabytes * 1024 * 1024,
        kick: raw.kick.unwrap_or(false),
        alert,
        state,
    })
}
