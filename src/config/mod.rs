//! Configuration: every `<app root>/<function>/function.json` with a `poller` section, plus app
//! settings, parsed once into a validated [`PollerConfig`]. A `PollerConfig` that exists is valid.
//!
//! Errors name the file, the field and the reason. One bad poller does not take the others down: the
//! app keeps a `Result` per function, and invocations of a bad one fail with its error.
//!
//! One file a section: [`function_json`] (the raw document, settings substitution, the timer),
//! [`source`] (a polling source) and [`logical`] (a logical one), which this module chooses between
//! by `source.kind`, both building from `source_types` (the validated source types) and
//! `source_url` (the database URL) below them; [`sink`], [`batch`] (batch, lease, poison), [`state`], [`connection`] (Azure Storage
//! connections), [`redact`] (credentials never shown, peer text escaped), [`tls`] (whether a
//! database connection verifies its server). Adapters read these plain, validated types;
//! config imports no adapter. [`fields`] says what each field is (type, default, range, meaning);
//! the JSON Schema of function.json ([`schema`]) and docs/configuration.md ([`reference`]) are
//! written from it, and `tests_schema.rs` holds it to the raw types and the loader.

pub mod batch;
pub mod binlog;
pub mod connection;
pub mod db_identity;
mod disabled;
pub mod fields;
mod function_json;
pub mod late;
pub mod logical;
pub mod plan;
pub mod redact;
pub mod reference;
pub mod schema;
pub mod sink;
pub mod source;
mod source_types;
mod source_url;
pub mod state;
pub mod status;
mod stream;
pub mod tls;
pub mod watchdog;

use std::collections::BTreeMap;
use std::fmt;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

pub use self::batch::{BatchConfig, Order, PoisonConfig};
pub use self::connection::{StorageConnection, StorageCredential};
pub use self::late::LateArrivalsConfig;
pub use self::redact::shown_endpoint;
pub use self::sink::{
    MessageEncoding, MessagePer, OutboundUrl, QueueConfig, SigningKey, SinkConfig, WebhookConfig, outbound_refusal,
};
pub use self::source::{
    BINLOG_CURSOR, Engine, GenerationConfig, LOGICAL_CURSOR, LOGICAL_KEY, OnGenerationChange, OpRule, Origin,
    OversizedRows, SourceConfig, SourceTarget, validate_identifier,
};
pub use self::source_types::DatabaseIdentity;
pub use self::state::{StateConfig, StateLocation};
pub use self::status::StatusConfig;
pub use self::watchdog::{AlertConfig, WatchdogConfig};
pub use crate::settings::{Secret, Settings};

use self::batch::{build_batch, build_lease, build_poison};
use self::function_json::{
    POLLER_SETTING_NAME_FIELDS, RawPoller, UsedSettings, check_setting_name_fields, substitute_settings, timer_schedule,
};
use self::sink::build_sink;
use self::source::{CursorKind, build_source};
use self::source_types::{Fingerprints, SourceKind};
use self::state::build_state;
use crate::domain::LeaseTerms;
use crate::domain::schedule::Schedule;

/// A configuration problem, located precisely.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {field}: {reason}", file.display())]
pub struct ConfigError {
    pub file: PathBuf,
    /// A JSON path inside the file, e.g. `poller.source.cursor`.
    pub field: String,
    pub reason: String,
}

/// Every function of an app, each with its configuration or the reason it has none.
#[derive(Debug)]
pub struct AppConfig {
    pub app_root: PathBuf,
    pub app_name: String,
    pub functions: BTreeMap<String, Result<FunctionConfig, ConfigError>>,
    /// The functions the host does not run (function name → why): `AzureWebJobs.<name>.Disabled`,
    /// host.json `functions`.
    pub disabled: BTreeMap<String, String>,
    /// How long the host lets an invocation run: host.json's `functionTimeout` or the plan's default.
    pub function_timeout: plan::FunctionTimeout,
}

/// What a function of the app is, by the section its function.json has.
#[derive(Debug, Clone)]
pub enum FunctionConfig {
    /// A `poller` section: a timer that delivers a table's changes.
    Poller(Box<PollerConfig>),
    /// A `status` section: an HTTP trigger that answers with every poller's status.
    Status(StatusConfig),
    /// A `watchdog` section: a timer that reports (and may kick) stalled pollers.
    Watchdog(Box<WatchdogConfig>),
}

impl FunctionConfig {
    /// Loads `<app_root>/<function_name>/function.json`, whichever kind it is.
    pub fn load(
        app_root: &Path,
        function_name: &str,
        settings: &Settings,
        function_timeout: Option<Duration>,
    ) -> Result<FunctionConfig, ConfigError> {
        let file = app_root.join(function_name).join("function.json");
        let at = Located { file: &file };
        let document = read_function_json(&at, function_name)?;
        if document.get("poller").is_none() {
            if document.get("status").is_some() {
                return status::build_status(&document, function_name, &at).map(FunctionConfig::Status);
            }
            if document.get("watchdog").is_some() {
                return watchdog::build_watchdog(&document, function_name, settings, app_root, &at)
                    .map(|config| FunctionConfig::Watchdog(Box::new(config)));
            }
        }
        PollerConfig::load(app_root, function_name, settings, function_timeout)
            .map(|config| FunctionConfig::Poller(Box::new(config)))
    }

    pub fn as_poller(&self) -> Option<&PollerConfig> {
        match self {
            FunctionConfig::Poller(config) => Some(config),
            FunctionConfig::Status(_) | FunctionConfig::Watchdog(_) => None,
        }
    }
}

/// A function's function.json as JSON, its folder name checked.
fn read_function_json(at: &Located<'_>, function_name: &str) -> Result<Value, ConfigError> {
    if !is_valid_function_name(function_name) {
        return Err(at.error(
            "(function name)",
            format!("{function_name:?} is not a valid function name: letters, digits, '_' and '-', starting with a letter, at most 128"),
        ));
    }
    let text = std::fs::read_to_string(at.file).map_err(|error| at.error("(file)", format!("cannot read: {error}")))?;
    serde_json::from_str(&text).map_err(|error| {
        at.error("(document)", format!("invalid JSON at line {} column {}: {error}", error.line(), error.column()))
    })
}

impl AppConfig {
    /// Reads every function folder under `app_root`. Fails only when the app root itself cannot be
    /// read; a bad function.json becomes that function's error.
    pub fn load(app_root: &Path, settings: &Settings) -> Result<AppConfig, ConfigError> {
        let entries = std::fs::read_dir(app_root).map_err(|error| ConfigError {
            file: app_root.to_path_buf(),
            field: "(app root)".to_string(),
            reason: format!("cannot read the app root directory: {error}"),
        })?;
        let timeout = plan::read_function_timeout(app_root, settings)?;
        let function_timeout = timeout.limit;
        let mut functions = BTreeMap::new();
        for entry in entries.flatten() {
            let folder = entry.path();
            let function_json = folder.join("function.json");
            if !folder.is_dir() || !function_json.is_file() {
                continue;
            }
            let Some(function_name) = folder.file_name().and_then(|name| name.to_str()).map(str::to_string) else {
                continue;
            };
            let parsed = FunctionConfig::load(app_root, &function_name, settings, function_timeout);
            functions.insert(function_name, parsed);
        }
        refuse_shared_poller_names(&mut functions);
        let names: Vec<String> = functions.keys().cloned().collect();
        let disabled = disabled::disabled_functions(app_root, settings, &names)?;
        Ok(AppConfig {
            app_root: app_root.to_path_buf(),
            app_name: settings.app_name(),
            functions,
            disabled,
            function_timeout: timeout,
        })
    }
}

/// Two functions with one `poller.name` would share one state document and one lease owner id
/// (one per process), so both would believe they hold the lease and deliver at once: every
/// function that shares its poller name with another becomes a configuration error naming them all.
fn refuse_shared_poller_names(functions: &mut BTreeMap<String, Result<FunctionConfig, ConfigError>>) {
    let mut by_poller: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (function_name, parsed) in functions.iter() {
        if let Ok(FunctionConfig::Poller(config)) = parsed {
            by_poller.entry(config.poller_name.clone()).or_default().push(function_name.clone());
        }
    }
    for (poller_name, sharing) in by_poller {
        if sharing.len() < 2 {
            continue;
        }
        for function_name in &sharing {
            let Some(Ok(FunctionConfig::Poller(config))) = functions.get(function_name) else {
                continue;
            };
            let error = ConfigError {
                file: config.file.clone(),
                field: "poller.name".to_string(),
                reason: format!(
                    "poller name {poller_name:?} is used by functions {}: each poller needs its own name (its own state document and lease)",
                    sharing.join(", ")
                ),
            };
            functions.insert(function_name.clone(), Err(error));
        }
    }
}

/// The longest `functionTimeout` taken as a bound (a year): beyond it a tick's budget is bounded by
/// its own setting anyway, and no arithmetic on it can overflow.
const LONGEST_FUNCTION_TIMEOUT_SECONDS: u64 = 366 * 86_400;

/// `[d.]hh:mm:ss[.fff]`, the .NET TimeSpan form host.json uses. Every part is checked and the sum
/// is bounded, so an absurd value is an error that says so, never an overflow (a panic in a debug
/// build, a silent wrap in a release one).
fn parse_timespan(text: &str) -> Result<Duration, String> {
    let not_a_span = || format!("{text:?} is not a time span like \"00:10:00\" or \"1.00:00:00\"");
    let (days, rest) = match text.split_once('.') {
        Some((days, rest)) if !days.contains(':') => (days.parse::<u64>().map_err(|_| not_a_span())?, rest),
        _ => (0, text),
    };
    let parts: Vec<&str> = rest.split(':').collect();
    if parts.len() != 3 {
        return Err(not_a_span());
    }
    let hours: u64 = parts[0].parse().map_err(|_| not_a_span())?;
    let minutes: u64 = parts[1].parse().map_err(|_| not_a_span())?;
    let seconds: f64 = parts[2].parse().map_err(|_| not_a_span())?;
    if minutes >= 60 || !(0.0..60.0).contains(&seconds) {
        return Err(not_a_span());
    }
    let whole = days
        .checked_mul(86_400)
        .and_then(|total| hours.checked_mul(3_600).and_then(|hours| total.checked_add(hours)))
        .and_then(|total| total.checked_add(minutes * 60))
        .filter(|total| *total < LONGEST_FUNCTION_TIMEOUT_SECONDS)
        .ok_or_else(|| format!("{text:?} is longer than a year: give a shorter time span, or \"-1\" for no timeout"))?;
    Ok(Duration::from_secs(whole) + Duration::from_secs_f64(seconds))
}

/// A validated poller.
#[derive(Debug, Clone)]
pub struct PollerConfig {
    /// The function's folder name: what the host posts to.
    pub function_name: String,
    /// The state document's name (`poller.name`, else the function name).
    pub poller_name: String,
    pub app_name: String,
    pub file: PathBuf,
    /// The timer's schedule (resolved and parsed), and whether the host runs it at start-up.
    pub schedule: Option<Schedule>,
    pub run_on_startup: bool,
    pub source: SourceConfig,
    pub batch: BatchConfig,
    pub sink: SinkConfig,
    pub lease: LeaseTerms,
    pub poison: PoisonConfig,
    pub state: StateConfig,
    /// `source.lateArrivals`: the late-arrival detector.
    pub late_arrivals: LateArrivalsConfig,
    /// `sha256:...` of the source definition, without the password: the effective target (host,
    /// port, database, user, options, as the driver resolves the URL) and the query's shape.
    pub fingerprint: String,
    /// The fingerprint earlier builds computed from the URL's surface, accepted (and replaced at the
    /// next write) when it identifies the same target: only when the URL has no query parameter
    /// that changes the target, so that an upgrade does not stop every poller.
    pub legacy_fingerprint: Option<String>,
}

impl PollerConfig {
    /// Whether a state document written with `stored` belongs to this source definition.
    pub fn fingerprint_matches(&self, stored: &str) -> bool {
        stored == self.fingerprint || self.legacy_fingerprint.as_deref() == Some(stored)
    }
}

/// Defaults: safe and fast (design "Configuration").
pub mod defaults {
    pub const BATCH_SIZE: usize = 500;
    pub const MAX_BATCH_SIZE: usize = 10_000;
    /// A batch holds at most this many bytes of rows (as JSON), whatever its row count.
    pub const BATCH_MAX_BYTES: usize = 4 * 1024 * 1024;
    pub const QUERY_TIMEOUT_SECONDS: u64 = 60;
    /// Connections the app opens to one database at most, shared by its pollers.
    pub const MAX_CONNECTIONS_PER_DATABASE: u64 = 10;
    /// One batch at a time keeps deliveries in (cursor, pk) order across batches; more trades that
    /// order for throughput against slow receivers.
    pub const MAX_IN_FLIGHT: usize = 1;
    pub const TICK_BUDGET_SECONDS: u64 = 240;
    /// While a tick delivers, the checkpoint is written at most this often (and always when the
    /// tick ends): a catch-up costs a few writes a second, not one per batch, and what a crash
    /// sends again is at most this much of acknowledged deliveries.
    pub const COMMIT_INTERVAL_MS: u64 = 1000;
    pub const WEBHOOK_TIMEOUT_SECONDS: u64 = 30;
    pub const WEBHOOK_MAX_RETRIES: u32 = 3;
    /// Timestamp cursors hold back rows younger than this, so that a transaction that commits late
    /// with an older timestamp is still read (the classic keyset-polling loss).
    pub const SETTLE_SECONDS: u64 = 2;
    pub const WEBHOOK_MAX_BODY_BYTES: usize = 1024 * 1024;
    /// What one Azure Storage queue message may hold (64 KiB, as the service counts it).
    pub const QUEUE_MESSAGE_BYTES: usize = 64 * 1024;
    pub const LEASE_TTL_SECONDS: u64 = 60;
    pub const LEASE_HEARTBEAT_SECONDS: u64 = 15;
    pub const LEASE_CLOCK_SKEW_SECONDS: u64 = 5;
    pub const POISON_MAX_ATTEMPTS: u32 = 5;
    pub const POISON_MAX_QUARANTINED_PER_HOUR: u32 = 10;
    pub const STATE_CONNECTION: &str = "AzureWebJobsStorage";
    pub const STATE_CONTAINER: &str = "db-state";
    pub const POISON_MODE: &str = "quarantine";
    pub const BATCH_ORDER: &str = "key";
    pub const CURSOR_TIME_ZONE: &str = "UTC";
    pub const MESSAGE_ENCODING: &str = "base64";
    pub const MESSAGE_PER: &str = "row";
    pub const GENERATION_ON_CHANGE: &str = "stop";
    pub const STALLED_AFTER_INTERVALS: u32 = 3;
    pub const HORIZON_HELD_AFTER_SECONDS: u64 = 300;
    pub const SLOT_RETENTION_MEGABYTES: u64 = 1024;
    pub const ALERT_TIMEOUT_SECONDS: u64 = 10;
    /// A tick ends at least this long before host.json's functionTimeout.
    pub const TIMEOUT_MARGIN_SECONDS: u64 = 30;
}

pub(crate) struct Located<'a> {
    file: &'a Path,
}

impl Located<'_> {
    pub(crate) fn error(&self, field: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError { file: self.file.to_path_buf(), field: field.to_string(), reason: reason.into() }
    }
}

impl PollerConfig {
    /// Loads `<app_root>/<function_name>/function.json`.
    pub fn load(
        app_root: &Path,
        function_name: &str,
        settings: &Settings,
        function_timeout: Option<Duration>,
    ) -> Result<PollerConfig, ConfigError> {
        let file = app_root.join(function_name).join("function.json");
        let at = Located { file: &file };
        let document = read_function_json(&at, function_name)?;
        PollerConfig::from_document(&document, app_root, function_name, settings, function_timeout, &at)
    }

    /// A poller from its function.json, already read: no I/O.
    pub(crate) fn from_document(
        document: &Value,
        app_root: &Path,
        function_name: &str,
        settings: &Settings,
        function_timeout: Option<Duration>,
        at: &Located<'_>,
    ) -> Result<PollerConfig, ConfigError> {
        let (schedule, run_on_startup) = timer_schedule(document, at, settings)?;
        let Some(poller) = document.get("poller") else {
            return Err(at.error(
                "poller",
                "missing: this function has no `poller` section (nor a `status` one), so dbtrigger cannot run it",
            ));
        };
        let mut poller = poller.clone();
        let mut used = UsedSettings::default();
        check_setting_name_fields(&poller, "poller", &POLLER_SETTING_NAME_FIELDS, settings, &mut used, at)?;
        // The connections a section may leave out default to this setting.
        used.named(defaults::STATE_CONNECTION, settings);
        // Whatever goes wrong from here, the error is scrubbed of every setting value used.
        substitute_settings(&mut poller, "poller", settings, &mut used, at).map_err(|error| used.scrub(error))?;
        let raw: RawPoller = serde_path_to_error::deserialize(&poller).map_err(|error| {
            let path = error.path().to_string();
            let field = if path == "." { "poller".to_string() } else { format!("poller.{path}") };
            used.scrub(at.error(&field, error.into_inner().to_string()))
        })?;
        let mut config = build(raw, function_name, schedule, settings, app_root, function_timeout, at)
            .map_err(|error| used.scrub(error))?;
        config.run_on_startup = run_on_startup;
        Ok(config)
    }
}

/// The app's name from the settings, checked by the rule every name in a store path follows (it is
/// a folder of every state document, quarantine entry and watchdog memory).
pub(crate) fn checked_app_name(settings: &Settings, at: &Located<'_>) -> Result<String, ConfigError> {
    let app_name = settings.app_name();
    crate::domain::ids::check_path_name(&app_name)
        .map_err(|reason| at.error("(app name)", format!("WEBSITE_SITE_NAME / DBTRIGGER_APP_NAME: {reason}")))?;
    Ok(app_name)
}

pub(crate) fn is_valid_function_name(name: &str) -> bool {
    let mut characters = name.chars();
    let Some(first) = characters.next() else {
        return false;
    };
    first.is_ascii_alphabetic()
        && name.len() <= 128
        && characters.all(|character| character.is_ascii_alphanumeric() || character == '_' || character == '-')
        && !name.eq_ignore_ascii_case("host")
}

/// Upper bounds that keep every number of function.json far from any overflow in the time and
/// size arithmetic that follows (one absurd function.json must not panic the process).
pub mod limits {
    /// Every duration given in seconds: a day.
    pub const SECONDS: u64 = 86_400;
    pub const BATCH_MAX_BYTES: usize = 1024 * 1024 * 1024;
    pub const WEBHOOK_MAX_BODY_BYTES: usize = 256 * 1024 * 1024;
    /// The largest row a poller may be told to keep (`source.maxRowBytes`): the largest body a
    /// webhook may be allowed. A quarantine entry holds one row, so this also bounds what the
    /// operator's quarantine commands read ([`crate::store::quarantine::MAX_ENTRY_BYTES`]).
    pub const ROW_MAX_BYTES: usize = WEBHOOK_MAX_BODY_BYTES;
}

/// The range of every number of function.json: what the loader refuses outside of, and what the
/// JSON Schema (`schema`) and docs/configuration.md say, from these same constants.
pub mod ranges {
    use std::ops::RangeInclusive;

    use super::{defaults, limits};

    /// A binary-log source's `serverId`: a replica's id, 32 bits; at least 4, so that `status`'s
    /// readers (the id with its lowest bit, or the next one, flipped) are never 0.
    pub const SERVER_ID: RangeInclusive<u64> = 4..=4_294_967_295;

    pub const BATCH_SIZE: RangeInclusive<usize> = 1..=defaults::MAX_BATCH_SIZE;
    pub const BATCH_MAX_BYTES: RangeInclusive<usize> = 1024..=limits::BATCH_MAX_BYTES;
    pub const MAX_IN_FLIGHT: RangeInclusive<usize> = 1..=64;
    pub const TICK_BUDGET_SECONDS: RangeInclusive<u64> = 1..=limits::SECONDS;
    pub const COMMIT_INTERVAL_MS: RangeInclusive<u64> = 0..=60_000;
    pub const SETTLE_SECONDS: RangeInclusive<u64> = 0..=limits::SECONDS;
    pub const QUERY_TIMEOUT_SECONDS: RangeInclusive<u64> = 1..=limits::SECONDS;
    pub const MAX_CONNECTIONS: RangeInclusive<u64> = 1..=1000;
    pub const WEBHOOK_TIMEOUT_SECONDS: RangeInclusive<u64> = 1..=limits::SECONDS;
    pub const WEBHOOK_MAX_RETRIES: RangeInclusive<u32> = 0..=20;
    pub const WEBHOOK_MAX_BODY_BYTES: RangeInclusive<usize> = 1024..=limits::WEBHOOK_MAX_BODY_BYTES;
    pub const ROW_MAX_BYTES: RangeInclusive<usize> = 1024..=limits::ROW_MAX_BYTES;
    pub const LEASE_TTL_SECONDS: RangeInclusive<u64> = 3..=limits::SECONDS;
    pub const LEASE_HEARTBEAT_SECONDS: RangeInclusive<u64> = 1..=limits::SECONDS;
    pub const LEASE_CLOCK_SKEW_SECONDS: RangeInclusive<u64> = 0..=limits::SECONDS;
    pub const POISON_MAX_ATTEMPTS: RangeInclusive<u32> = 1..=1000;
    /// The quarantine budget's times are kept in the state document: at most this many.
    pub const POISON_MAX_QUARANTINED_PER_HOUR: RangeInclusive<u32> = 1..=10_000;
    pub const STALLED_AFTER_INTERVALS: RangeInclusive<u32> = 1..=1000;
    pub const HORIZON_HELD_AFTER_SECONDS: RangeInclusive<u64> = 1..=limits::SECONDS;
    pub const SLOT_RETENTION_MEGABYTES: RangeInclusive<u64> = 1..=1_048_576;
    pub const ALERT_TIMEOUT_SECONDS: RangeInclusive<u64> = 1..=limits::SECONDS;
}

/// A number from function.json (or its default), refused with the field and the range when it
/// falls outside `range`.
/// A source's `queryTimeoutSeconds`, its default and range applied (every kind of source).
fn query_timeout(raw: &function_json::RawSource, at: &Located<'_>) -> Result<Duration, ConfigError> {
    let seconds = in_range(
        at,
        "poller.source.queryTimeoutSeconds",
        raw.query_timeout_seconds,
        defaults::QUERY_TIMEOUT_SECONDS,
        ranges::QUERY_TIMEOUT_SECONDS,
    )?;
    Ok(Duration::from_secs(seconds))
}

pub(crate) fn in_range<T>(
    at: &Located<'_>,
    field: &str,
    value: Option<T>,
    default: T,
    range: RangeInclusive<T>,
) -> Result<T, ConfigError>
where
    T: PartialOrd + Copy + fmt::Display,
{
    let value = value.unwrap_or(default);
    if range.contains(&value) {
        Ok(value)
    } else {
        Err(at.error(field, format!("{value} is out of range {}..={}", range.start(), range.end())))
    }
}

#[allow(clippy::too_many_arguments)]
fn build(
    raw: RawPoller,
    function_name: &str,
    schedule: Option<Schedule>,
    settings: &Settings,
    app_root: &Path,
    function_timeout: Option<Duration>,
    at: &Located<'_>,
) -> Result<PollerConfig, ConfigError> {
    let poller_name = raw.name.clone().unwrap_or_else(|| function_name.to_string());
    if !is_valid_function_name(&poller_name) {
        return Err(at.error(
            "poller.name",
            format!("{poller_name:?} is not a valid poller name: letters, digits, '_' and '-', starting with a letter"),
        ));
    }
    let app_name = checked_app_name(settings, at)?;

    let mut late_arrivals = late::build_late_arrivals(raw.source.late_arrivals.as_ref(), at)?;
    let late_arrivals_asked = late::asked_for(raw.source.late_arrivals.as_ref());
    let late_arrivals_configured = late::configured(raw.source.late_arrivals.as_ref());
    let raw_max_row_bytes = raw.source.max_row_bytes;
    let (source, fingerprints) = build_any_source(raw.source, settings, app_root, (&app_name, &poller_name), at)?;
    if source.target.is_change_stream() {
        // A change stream hands out changes in commit order, each once: none can commit behind
        // the checkpoint, and there is no cursor to bucket by.
        if late_arrivals_configured {
            return Err(at.error(
                "poller.source.lateArrivals",
                "a change stream is read in commit order, where no change can arrive late: leave lateArrivals out",
            ));
        }
        late_arrivals.enabled = false;
    }
    if source.cursor_kind == Some(CursorKind::Xid) {
        // Below the commit horizon no row can commit behind the checkpoint: there is nothing to
        // detect, and the recount's buckets are not defined on xid8.
        if late_arrivals_asked {
            return Err(at.error(
                "poller.source.lateArrivals",
                "an xid cursor is read below the commit horizon, where no row can arrive late: leave lateArrivals out",
            ));
        }
        late_arrivals.enabled = false;
    }

    let batch = build_batch(&raw.batch, function_timeout, at)?;
    let sink = build_sink(raw.sink, settings, at)?;
    let mut source = source;
    source.max_row_bytes = in_range(
        at,
        "poller.source.maxRowBytes",
        raw_max_row_bytes,
        sink::default_max_row_bytes(&sink),
        ranges::ROW_MAX_BYTES,
    )?;
    let lease = build_lease(&raw.lease, at)?;
    let poison = build_poison(&raw.poison, at)?;

    let state = build_state(raw.state, settings, app_root, at, "poller.state")?;

    Ok(PollerConfig {
        function_name: function_name.to_string(),
        poller_name,
        app_name,
        file: at.file.to_path_buf(),
        schedule,
        run_on_startup: false,
        source,
        batch,
        sink,
        lease,
        poison,
        state,
        late_arrivals,
        fingerprint: fingerprints.current,
        legacy_fingerprint: fingerprints.legacy,
    })
}

/// `poller.source` of either kind: its database URL first (the same for both), then the kind
/// chooses which builds the rest.
fn build_any_source(
    raw: function_json::RawSource,
    settings: &Settings,
    app_root: &Path,
    (app_name, poller_name): (&str, &str),
    at: &Located<'_>,
) -> Result<(SourceConfig, Fingerprints), ConfigError> {
    let url = source_url::resolve(&raw.connection, settings, app_root, at)?;
    let identity = db_identity::database_identity(&raw.connection, settings, url.identity.engine, &url.resolved)
        .map_err(|reason| at.error("poller.source.connection", reason))?;
    let (mut source, fingerprints) =
        match SourceKind::parse(raw.kind.as_deref()).map_err(|reason| at.error("poller.source.kind", reason))? {
            SourceKind::Polling => build_source(raw, url, settings, at)?,
            SourceKind::Logical => logical::build(raw, url.identity, url.resolved, at)?,
            SourceKind::Binlog => {
                let server_id = crate::domain::binlog::derived_server_id(app_name, poller_name);
                binlog::build(raw, url.identity, url.resolved, server_id, at)?
            }
        };
    if let Some(identity) = &identity {
        // A login by token and one by the URL's (empty) password must not share a pool.
        source.pool_key = format!("{}+identity:{}", source.pool_key, identity.client_id.as_deref().unwrap_or("system"));
    }
    source.identity = identity;
    db_identity::require_tls(&source).map_err(|reason| at.error("poller.source.connection", reason))?;
    Ok((source, fingerprints))
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_proptest;
#[cfg(test)]
mod tests_schema;
#[cfg(test)]
mod tests_security;
