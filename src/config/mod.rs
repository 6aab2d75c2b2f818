//! Configuration: every `<app root>/<function>/function.json` with a `poller` section, plus app
//! settings, parsed once into a validated [`PollerConfig`]. A `PollerConfig` that exists is valid.
//!
//! Errors name the file, the field and the reason. One bad poller does not take the others down: the
//! app keeps a `Result` per function, and invocations of a bad one fail with its error.

pub mod redact;
mod settings;

use std::collections::BTreeMap;
use std::fmt;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

pub use settings::{Secret, Settings};

use crate::domain::LeaseTerms;
use crate::domain::ids::{FingerprintInput, source_fingerprint};
use crate::domain::schedule::Schedule;
use crate::sink::signing::SigningKey;
use crate::storage::StorageConnection;

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
    pub functions: BTreeMap<String, Result<PollerConfig, ConfigError>>,
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
        let function_timeout = read_function_timeout(app_root)?;
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
            let parsed = PollerConfig::load(app_root, &function_name, settings, function_timeout);
            functions.insert(function_name, parsed);
        }
        refuse_shared_poller_names(&mut functions);
        Ok(AppConfig { app_root: app_root.to_path_buf(), app_name: settings.app_name(), functions })
    }
}

/// Two functions with one `poller.name` would share one state document and one lease owner id
/// (one per process), so both would believe they hold the lease and deliver at once: every
/// function that shares its poller name with another becomes a configuration error naming them all.
fn refuse_shared_poller_names(functions: &mut BTreeMap<String, Result<PollerConfig, ConfigError>>) {
    let mut by_poller: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (function_name, parsed) in functions.iter() {
        if let Ok(config) = parsed {
            by_poller.entry(config.poller_name.clone()).or_default().push(function_name.clone());
        }
    }
    for (poller_name, sharing) in by_poller {
        if sharing.len() < 2 {
            continue;
        }
        for function_name in &sharing {
            let Some(Ok(config)) = functions.get(function_name) else {
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

/// host.json `functionTimeout`, when given: each tick must end well before it.
fn read_function_timeout(app_root: &Path) -> Result<Option<Duration>, ConfigError> {
    let path = app_root.join("host.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let error = |reason: String| ConfigError { file: path.clone(), field: "functionTimeout".to_string(), reason };
    let value: Value = serde_json::from_str(&text).map_err(|parse_error| ConfigError {
        file: path.clone(),
        field: "(document)".to_string(),
        reason: format!("invalid JSON: {parse_error}"),
    })?;
    let Some(timeout) = value.get("functionTimeout") else {
        return Ok(None);
    };
    let text = timeout.as_str().ok_or_else(|| error("expected a string like \"00:10:00\"".to_string()))?;
    if text == "-1" {
        return Ok(None);
    }
    parse_timespan(text).map(Some).ok_or_else(|| error(format!("{text:?} is not a time span like \"00:10:00\"")))
}

/// `[d.]hh:mm:ss[.fff]`, the .NET TimeSpan form host.json uses.
fn parse_timespan(text: &str) -> Option<Duration> {
    let (days, rest) = match text.split_once('.') {
        Some((days, rest)) if !days.contains(':') => (days.parse::<u64>().ok()?, rest),
        _ => (0, text),
    };
    let parts: Vec<&str> = rest.split(':').collect();
    if parts.len() != 3 {
        return None;
    }
    let hours: u64 = parts[0].parse().ok()?;
    let minutes: u64 = parts[1].parse().ok()?;
    let seconds: f64 = parts[2].parse().ok()?;
    if minutes >= 60 || !(0.0..60.0).contains(&seconds) {
        return None;
    }
    let whole = days * 86_400 + hours * 3_600 + minutes * 60;
    Some(Duration::from_secs(whole) + Duration::from_secs_f64(seconds))
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
    MySql,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Sqlite => "sqlite",
            Engine::Postgres => "postgres",
            Engine::MySql => "mysql",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceTarget {
    Table {
        schema: Option<String>,
        name: String,
    },
    /// A SELECT, wrapped as a subquery.
    Query(String),
}

#[derive(Debug, Clone)]
pub struct SourceConfig {
    /// The app setting that holds the URL.
    pub connection: String,
    pub engine: Engine,
    /// The database URL, resolved (a relative SQLite path is taken from the app root).
    pub url: Secret,
    pub target: SourceTarget,
    pub cursor: String,
    pub pk: Vec<String>,
    pub columns: Option<Vec<String>>,
    pub where_clause: Option<String>,
    /// Timestamp cursors only read rows older than the database's `now - settle`.
    pub settle: Duration,
    /// Whether `settleSeconds` was written in function.json (an integer cursor ignores it, and
    /// says so once when it was asked for).
    pub settle_configured: bool,
    /// Each fetch is cancelled after this long (and PostgreSQL's `statement_timeout` is set to
    /// it), so a slow query fails the tick instead of holding it.
    pub query_timeout: Duration,
    /// The zone naive timestamp cursors are written in (for `settle` only): `UTC` by default.
    pub cursor_time_zone: String,
}

#[derive(Debug, Clone, Copy)]
pub struct BatchConfig {
    pub size: usize,
    /// A batch ends early once its rows add up to this many bytes (as JSON), so that memory is
    /// bounded by bytes and not only by row count.
    pub max_bytes: usize,
    pub max_in_flight: usize,
    pub tick_budget: Duration,
}

#[derive(Debug, Clone)]
pub enum SinkConfig {
    Webhook(WebhookConfig),
    Queue(QueueConfig),
}

/// An Azure Storage queue sink.
#[derive(Debug, Clone)]
pub struct QueueConfig {
    pub connection: Box<StorageConnection>,
    pub queue_name: String,
    pub encoding: MessageEncoding,
    pub per: MessagePer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageEncoding {
    /// What a Functions queue trigger expects.
    Base64,
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessagePer {
    Row,
    Batch,
}

#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub url: url::Url,
    /// The signing key, when `secret` names a setting (Standard Webhooks signatures).
    pub signing_key: Option<SigningKey>,
    pub timeout: Duration,
    pub max_retries: u32,
    /// A batch whose JSON body would exceed this is split into several requests.
    pub max_body_bytes: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct PoisonConfig {
    pub max_attempts: u32,
}

#[derive(Debug, Clone)]
pub struct StateConfig {
    /// The app setting that names the store.
    pub connection: String,
    pub container: String,
    pub location: StateLocation,
}

#[derive(Debug, Clone)]
pub enum StateLocation {
    /// `file:<dir>`: documents at `<dir>/state/{app}/{poller}.json`.
    File(PathBuf),
    /// Azure Blob Storage: a connection string or an identity-based connection.
    AzureBlob(Box<StorageConnection>),
}

// ---------------------------------------------------------------------------------------------
// Raw, as written in function.json. Unknown fields are refused: a typo must not silently mean
// "use the default".

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPoller {
    name: Option<String>,
    source: RawSource,
    #[serde(default)]
    batch: RawBatch,
    sink: RawSink,
    #[serde(default)]
    lease: RawLease,
    #[serde(default)]
    poison: RawPoison,
    #[serde(default)]
    state: RawState,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawSource {
    connection: String,
    table: Option<String>,
    query: Option<String>,
    cursor: String,
    pk: Vec<String>,
    columns: Option<Vec<String>>,
    #[serde(rename = "where")]
    where_clause: Option<String>,
    settle_seconds: Option<u64>,
    cursor_time_zone: Option<String>,
    query_timeout_seconds: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawBatch {
    size: Option<usize>,
    max_bytes: Option<usize>,
    max_in_flight: Option<usize>,
    tick_budget_seconds: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawSink {
    #[serde(rename = "type")]
    kind: String,
    url: Option<String>,
    secret: Option<String>,
    timeout_seconds: Option<u64>,
    max_retries: Option<u32>,
    max_body_bytes: Option<usize>,
    connection: Option<String>,
    queue_name: Option<String>,
    message_encoding: Option<String>,
    message_per: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawLease {
    ttl_seconds: Option<u64>,
    heartbeat_seconds: Option<u64>,
    clock_skew_seconds: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawPoison {
    max_attempts: Option<u32>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawState {
    connection: Option<String>,
    container: Option<String>,
}

/// Defaults: safe and fast (design "Configuration").
pub mod defaults {
    pub const BATCH_SIZE: usize = 500;
    pub const MAX_BATCH_SIZE: usize = 10_000;
    /// A batch holds at most this many bytes of rows (as JSON), whatever its row count.
    pub const BATCH_MAX_BYTES: usize = 4 * 1024 * 1024;
    pub const QUERY_TIMEOUT_SECONDS: u64 = 60;
    /// One batch at a time keeps deliveries in (cursor, pk) order across batches; more trades that
    /// order for throughput against slow receivers.
    pub const MAX_IN_FLIGHT: usize = 1;
    pub const TICK_BUDGET_SECONDS: u64 = 240;
    pub const WEBHOOK_TIMEOUT_SECONDS: u64 = 30;
    pub const WEBHOOK_MAX_RETRIES: u32 = 3;
    /// Timestamp cursors hold back rows younger than this, so that a transaction that commits late
    /// with an older timestamp is still read (the classic keyset-polling loss).
    pub const SETTLE_SECONDS: u64 = 2;
    pub const WEBHOOK_MAX_BODY_BYTES: usize = 1024 * 1024;
    pub const LEASE_TTL_SECONDS: u64 = 60;
    pub const LEASE_HEARTBEAT_SECONDS: u64 = 15;
    pub const LEASE_CLOCK_SKEW_SECONDS: u64 = 5;
    pub const POISON_MAX_ATTEMPTS: u32 = 5;
    pub const STATE_CONNECTION: &str = "AzureWebJobsStorage";
    pub const STATE_CONTAINER: &str = "db-state";
    /// A tick ends at least this long before host.json's functionTimeout.
    pub const TIMEOUT_MARGIN_SECONDS: u64 = 30;
}

struct Located<'a> {
    file: &'a Path,
}

impl Located<'_> {
    fn error(&self, field: &str, reason: impl Into<String>) -> ConfigError {
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
        if !is_valid_function_name(function_name) {
            return Err(at.error(
                "(function name)",
                format!("{function_name:?} is not a valid function name: letters, digits, '_' and '-', starting with a letter, at most 128"),
            ));
        }
        let text =
            std::fs::read_to_string(&file).map_err(|error| at.error("(file)", format!("cannot read: {error}")))?;
        let document: Value = serde_json::from_str(&text).map_err(|error| {
            at.error("(document)", format!("invalid JSON at line {} column {}: {error}", error.line(), error.column()))
        })?;
        let (schedule, run_on_startup) = timer_schedule(&document, &at, settings)?;
        let Some(poller) = document.get("poller") else {
            return Err(
                at.error("poller", "missing: this function has no `poller` section, so dbtrigger cannot run it")
            );
        };
        let mut poller = poller.clone();
        substitute_settings(&mut poller, "poller", settings, &at)?;
        let raw: RawPoller = serde_path_to_error::deserialize(&poller).map_err(|error| {
            let path = error.path().to_string();
            let field = if path == "." { "poller".to_string() } else { format!("poller.{path}") };
            at.error(&field, error.into_inner().to_string())
        })?;
        let mut config = build(raw, function_name, schedule, settings, app_root, function_timeout, &at)?;
        config.run_on_startup = run_on_startup;
        Ok(config)
    }
}

fn is_valid_function_name(name: &str) -> bool {
    let mut characters = name.chars();
    let Some(first) = characters.next() else {
        return false;
    };
    first.is_ascii_alphabetic()
        && name.len() <= 128
        && characters.all(|character| character.is_ascii_alphanumeric() || character == '_' || character == '-')
        && !name.eq_ignore_ascii_case("host")
}

fn timer_schedule(
    document: &Value,
    at: &Located<'_>,
    settings: &Settings,
) -> Result<(Option<Schedule>, bool), ConfigError> {
    let Some(bindings) = document.get("bindings") else {
        return Err(at.error("bindings", "missing: a poller needs a timerTrigger binding"));
    };
    let Some(bindings) = bindings.as_array() else {
        return Err(at.error("bindings", "expected an array"));
    };
    for (index, binding) in bindings.iter().enumerate() {
        if binding.get("type").and_then(Value::as_str) != Some("timerTrigger") {
            continue;
        }
        if binding.get("functionName").is_some() {
            return Err(at.error(
                &format!("bindings[{index}].functionName"),
                "must not be set: the Functions host adds its own and fails on a duplicate",
            ));
        }
        let field = format!("bindings[{index}].schedule");
        let mut schedule = binding.get("schedule").cloned().unwrap_or(Value::Null);
        substitute_settings(&mut schedule, &field, settings, at)?;
        let schedule = match schedule.as_str() {
            Some(text) => Some(Schedule::parse(text).map_err(|reason| at.error(&field, reason))?),
            None => None,
        };
        let run_on_startup = binding.get("runOnStartup").and_then(Value::as_bool).unwrap_or(false);
        return Ok((schedule, run_on_startup));
    }
    Err(at.error("bindings", "no timerTrigger binding: a poller runs on a timer"))
}

/// Replaces every `%NAME%` in string values by app setting NAME (the Functions convention).
fn substitute_settings(
    value: &mut Value,
    path: &str,
    settings: &Settings,
    at: &Located<'_>,
) -> Result<(), ConfigError> {
    match value {
        Value::String(text) => {
            if text.contains('%') {
                *text = substitute_in_text(text, settings).map_err(|reason| at.error(path, reason))?;
            }
            Ok(())
        }
        Value::Array(items) => {
            for (index, item) in items.iter_mut().enumerate() {
                substitute_settings(item, &format!("{path}[{index}]"), settings, at)?;
            }
            Ok(())
        }
        Value::Object(map) => {
            for (key, item) in map.iter_mut() {
                substitute_settings(item, &format!("{path}.{key}"), settings, at)?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

fn substitute_in_text(text: &str, settings: &Settings) -> Result<String, String> {
    let mut output = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find('%') {
        output.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        let Some(end) = after.find('%') else {
            return Err(format!("unmatched '%' in {text:?}"));
        };
        let name = &after[..end];
        if name.is_empty() {
            output.push('%');
        } else {
            let value =
                settings.get(name).ok_or_else(|| format!("app setting {name} (referenced as %{name}%) is not set"))?;
            output.push_str(value);
        }
        rest = &after[end + 1..];
    }
    output.push_str(rest);
    Ok(output)
}

/// Identifiers are a strict subset of what every engine accepts unquoted, then quoted anyway:
/// a quote, a semicolon or a comment sequence can never reach the SQL.
pub fn validate_identifier(value: &str) -> Result<(), String> {
    let mut characters = value.chars();
    let valid_first = characters.next().is_some_and(|character| character.is_ascii_alphabetic() || character == '_');
    let valid_rest =
        characters.all(|character| character.is_ascii_alphanumeric() || character == '_' || character == '$');
    if valid_first && valid_rest && value.len() <= 63 {
        Ok(())
    } else {
        Err(format!(
            "{value:?} is not a valid identifier: use letters, digits, '_' and '$', starting with a letter or '_', at most 63 characters"
        ))
    }
}

/// Zones are inlined into the settle predicate, so they are restricted to a safe alphabet; MySQL
/// only knows named zones when its time zone tables are loaded, so it gets offsets only.
fn validate_time_zone(engine: Engine, zone: &str) -> Result<(), String> {
    if zone == "UTC" {
        return Ok(());
    }
    let is_offset = zone.len() == 6
        && (zone.starts_with('+') || zone.starts_with('-'))
        && zone[1..3].chars().all(|character| character.is_ascii_digit())
        && &zone[3..4] == ":"
        && zone[4..6].chars().all(|character| character.is_ascii_digit());
    match engine {
        Engine::Sqlite => Err("SQLite timestamps are read as UTC: only \"UTC\" is supported".to_string()),
        Engine::MySql if !is_offset => Err(format!("{zone:?}: MySQL takes \"UTC\" or an offset like \"+02:00\"")),
        Engine::MySql => Ok(()),
        Engine::Postgres => {
            let safe = !zone.is_empty()
                && zone.len() <= 64
                && zone.chars().all(|character| character.is_ascii_alphanumeric() || "_/+-:".contains(character));
            if safe {
                Ok(())
            } else {
                Err(format!("{zone:?} is not a time zone name like \"Europe/Paris\" or an offset like \"+02:00\""))
            }
        }
    }
}

/// A `where` or `query` fragment is inlined into the seek, inside parentheses: it must be one
/// expression that cannot close them (`tenant = 7) OR (1 = 1` would bypass the seek and redeliver
/// forever), end the statement, or comment out what follows (`;`, `--`, `/*`, MySQL's `#`).
/// Parentheses are counted outside quoted text; a quote must be closed, and a backslash inside
/// quoted text is refused because MySQL and the others disagree on what it escapes.
fn validate_fragment(value: &str) -> Result<(), String> {
    if value.trim().is_empty() {
        return Err("is empty".to_string());
    }
    if value.contains(';') || value.contains("--") || value.contains("/*") || value.contains('#') {
        return Err("must be one SQL expression: ';', '--', '/*' and '#' are not allowed".to_string());
    }
    let mut depth: i64 = 0;
    let mut quote: Option<char> = None;
    for (offset, character) in value.char_indices() {
        match quote {
            Some(open) => {
                if character == '\\' {
                    return Err(format!(
                        "a backslash inside quoted text (at byte {offset}) is not allowed: write a quote twice to escape it"
                    ));
                }
                if character == open {
                    // A doubled quote is an escaped quote: the next character reopens the same quote.
                    quote = None;
                }
            }
            None => match character {
                '\'' | '"' | '`' => quote = Some(character),
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth < 0 {
                        return Err(format!(
                            "closes a parenthesis it did not open (at byte {offset}): the fragment must stay inside its own parentheses"
                        ));
                    }
                }
                _ => {}
            },
        }
    }
    if let Some(open) = quote {
        return Err(format!("has an unclosed {open} quote"));
    }
    if depth != 0 {
        return Err(format!("has {depth} unclosed parenthesis(es)"));
    }
    Ok(())
}

/// Upper bounds that keep every number of function.json far from any overflow in the time and
/// size arithmetic that follows (one absurd function.json must not panic the process).
pub mod limits {
    /// Every duration given in seconds: a day.
    pub const SECONDS: u64 = 86_400;
    pub const BATCH_MAX_BYTES: usize = 1024 * 1024 * 1024;
    pub const WEBHOOK_MAX_BODY_BYTES: usize = 256 * 1024 * 1024;
}

/// A number from function.json (or its default), refused with the field and the range when it
/// falls outside `range`.
fn in_range<T>(
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
    let app_name = settings.app_name();
    if !app_name.chars().all(|character| character.is_ascii_alphanumeric() || matches!(character, '-' | '_' | '.'))
        || app_name.starts_with('.')
    {
        return Err(at.error("(app name)", format!("app name {app_name:?} (WEBSITE_SITE_NAME / DBTRIGGER_APP_NAME) may hold only letters, digits, '-', '_' and '.'")));
    }

    let (source, fingerprints) = build_source(raw.source, settings, app_root, at)?;

    let size = in_range(at, "poller.batch.size", raw.batch.size, defaults::BATCH_SIZE, 1..=defaults::MAX_BATCH_SIZE)?;
    let max_bytes = in_range(
        at,
        "poller.batch.maxBytes",
        raw.batch.max_bytes,
        defaults::BATCH_MAX_BYTES,
        1024..=limits::BATCH_MAX_BYTES,
    )?;
    let max_in_flight =
        in_range(at, "poller.batch.maxInFlight", raw.batch.max_in_flight, defaults::MAX_IN_FLIGHT, 1..=64)?;
    let tick_budget = Duration::from_secs(in_range(
        at,
        "poller.batch.tickBudgetSeconds",
        raw.batch.tick_budget_seconds,
        defaults::TICK_BUDGET_SECONDS,
        1..=limits::SECONDS,
    )?);
    if let Some(timeout) = function_timeout {
        let margin = Duration::from_secs(defaults::TIMEOUT_MARGIN_SECONDS);
        if tick_budget.saturating_add(margin) > timeout {
            return Err(at.error(
                "poller.batch.tickBudgetSeconds",
                format!(
                    "{} s leaves less than {} s before host.json functionTimeout ({} s): the host would kill the tick mid-batch",
                    tick_budget.as_secs(),
                    margin.as_secs(),
                    timeout.as_secs()
                ),
            ));
        }
    }
    let batch = BatchConfig { size, max_bytes, max_in_flight, tick_budget };

    let sink = build_sink(raw.sink, settings, at)?;

    let ttl = in_range(
        at,
        "poller.lease.ttlSeconds",
        raw.lease.ttl_seconds,
        defaults::LEASE_TTL_SECONDS,
        3..=limits::SECONDS,
    )?;
    let heartbeat = in_range(
        at,
        "poller.lease.heartbeatSeconds",
        raw.lease.heartbeat_seconds,
        defaults::LEASE_HEARTBEAT_SECONDS,
        1..=limits::SECONDS,
    )?;
    let skew = in_range(
        at,
        "poller.lease.clockSkewSeconds",
        raw.lease.clock_skew_seconds,
        defaults::LEASE_CLOCK_SKEW_SECONDS,
        0..=limits::SECONDS,
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

    let max_attempts =
        in_range(at, "poller.poison.maxAttempts", raw.poison.max_attempts, defaults::POISON_MAX_ATTEMPTS, 1..=1000)?;

    let state = build_state(raw.state, settings, app_root, at)?;

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
        poison: PoisonConfig { max_attempts },
        state,
        fingerprint: fingerprints.current,
        legacy_fingerprint: fingerprints.legacy,
    })
}

/// The parts of a database URL that identify it (no password).
struct UrlIdentity {
    engine: Engine,
    host: String,
    port: Option<u16>,
    database: String,
    user: String,
}

fn parse_source_url(url: &str, app_root: &Path) -> Result<(UrlIdentity, String), String> {
    let scheme = url.split(':').next().unwrap_or_default().to_ascii_lowercase();
    match scheme.as_str() {
        "sqlite" => {
            let rest = url["sqlite:".len()..].trim_start_matches("//");
            let (path, query) = match rest.split_once('?') {
                Some((path, query)) => (path, Some(query)),
                None => (rest, None),
            };
            if path.is_empty() {
                return Err("a sqlite URL needs a file path: sqlite://path/to/file.db".to_string());
            }
            let resolved_path = if path == ":memory:" || Path::new(path).is_absolute() {
                path.to_string()
            } else {
                app_root.join(path).to_string_lossy().into_owned()
            };
            let resolved = match query {
                Some(query) => format!("sqlite://{resolved_path}?{query}"),
                None => format!("sqlite://{resolved_path}"),
            };
            let identity = UrlIdentity {
                engine: Engine::Sqlite,
                host: String::new(),
                port: None,
                database: path.to_string(),
                user: String::new(),
            };
            Ok((identity, resolved))
        }
        "postgres" | "postgresql" | "mysql" | "mariadb" => {
            let parsed = url::Url::parse(url).map_err(|error| format!("not a valid URL: {error}"))?;
            let engine = if scheme.starts_with("postgres") { Engine::Postgres } else { Engine::MySql };
            let identity = UrlIdentity {
                engine,
                host: parsed.host_str().unwrap_or_default().to_string(),
                port: parsed.port(),
                database: parsed.path().trim_start_matches('/').to_string(),
                user: parsed.username().to_string(),
            };
            let resolved = match engine {
                Engine::Postgres => without_unsupported_postgres_parameters(parsed),
                _ if scheme == "mariadb" => url.replacen("mariadb", "mysql", 1),
                _ => url.to_string(),
            };
            Ok((identity, resolved))
        }
        _ => Err(format!("unsupported database URL scheme {scheme:?}: expected postgres://, mysql:// or sqlite://")),
    }
}

/// The query parameters PostgreSQL's driver understands. It logs any other one *with its value*
/// ("ignoring unrecognized connect parameter"), which would print an `sslpassword` or a misspelt
/// `pasword` in clear: those are removed here, and named (never their value) in a warning.
const POSTGRES_PARAMETERS: [&str; 18] = [
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

fn without_unsupported_postgres_parameters(mut parsed: url::Url) -> String {
    if parsed.query().is_none() {
        return parsed.to_string();
    }
    let mut kept = Vec::new();
    for (name, value) in parsed.query_pairs() {
        if POSTGRES_PARAMETERS.contains(&name.as_ref()) {
            kept.push((name.into_owned(), value.into_owned()));
        } else {
            tracing::warn!(parameter = %name, "ignoring a database URL parameter the PostgreSQL driver does not support");
        }
    }
    if kept.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(kept);
    }
    parsed.to_string()
}

fn build_source(
    raw: RawSource,
    settings: &Settings,
    app_root: &Path,
    at: &Located<'_>,
) -> Result<(SourceConfig, Fingerprints), ConfigError> {
    let url_value = settings.get(&raw.connection).ok_or_else(|| {
        at.error(
            "poller.source.connection",
            format!("app setting {} is not set (it must hold the database URL)", raw.connection),
        )
    })?;
    // The reason never quotes the URL: it may hold a password.
    let (identity, resolved_url) = parse_source_url(url_value, app_root)
        .map_err(|reason| at.error("poller.source.connection", format!("app setting {}: {reason}", raw.connection)))?;

    let target = match (raw.table, raw.query) {
        (Some(_), Some(_)) => {
            return Err(at.error("poller.source", "give either `table` or `query`, not both"));
        }
        (None, None) => return Err(at.error("poller.source", "give `table` (or `query`)")),
        (Some(table), None) => {
            let parts: Vec<&str> = table.split('.').collect();
            if parts.len() > 2 {
                return Err(
                    at.error("poller.source.table", format!("{table:?} has more than two parts: use schema.table"))
                );
            }
            for part in &parts {
                validate_identifier(part).map_err(|reason| at.error("poller.source.table", reason))?;
            }
            match parts.as_slice() {
                [name] => SourceTarget::Table { schema: None, name: name.to_string() },
                [schema, name] => SourceTarget::Table { schema: Some(schema.to_string()), name: name.to_string() },
                _ => unreachable!("checked above"),
            }
        }
        (None, Some(query)) => {
            let trimmed = query.trim().trim_end_matches(';').trim().to_string();
            validate_fragment(&trimmed).map_err(|reason| at.error("poller.source.query", reason))?;
            let lowered = trimmed.to_ascii_lowercase();
            if !(lowered.starts_with("select") || lowered.starts_with("with")) {
                return Err(at.error("poller.source.query", "must be a SELECT (or WITH ... SELECT) statement"));
            }
            SourceTarget::Query(trimmed)
        }
    };
    validate_identifier(&raw.cursor).map_err(|reason| at.error("poller.source.cursor", reason))?;
    if raw.pk.is_empty() {
        return Err(
            at.error("poller.source.pk", "give at least one primary key column: the tiebreaker between equal cursors")
        );
    }
    for (index, column) in raw.pk.iter().enumerate() {
        validate_identifier(column).map_err(|reason| at.error(&format!("poller.source.pk[{index}]"), reason))?;
        if raw.pk[..index].contains(column) {
            return Err(at.error(&format!("poller.source.pk[{index}]"), format!("{column:?} is listed twice")));
        }
    }
    if raw.pk.contains(&raw.cursor) {
        return Err(at.error("poller.source.pk", "the cursor column cannot also be a primary key column"));
    }
    if let Some(columns) = &raw.columns {
        if columns.is_empty() {
            return Err(at.error("poller.source.columns", "is empty: leave it out to select every column"));
        }
        for (index, column) in columns.iter().enumerate() {
            validate_identifier(column)
                .map_err(|reason| at.error(&format!("poller.source.columns[{index}]"), reason))?;
        }
    }
    if let Some(where_clause) = &raw.where_clause {
        validate_fragment(where_clause).map_err(|reason| at.error("poller.source.where", reason))?;
    }
    let settle_seconds =
        in_range(at, "poller.source.settleSeconds", raw.settle_seconds, defaults::SETTLE_SECONDS, 0..=limits::SECONDS)?;
    let query_timeout_seconds = in_range(
        at,
        "poller.source.queryTimeoutSeconds",
        raw.query_timeout_seconds,
        defaults::QUERY_TIMEOUT_SECONDS,
        1..=limits::SECONDS,
    )?;
    let cursor_time_zone = raw.cursor_time_zone.clone().unwrap_or_else(|| "UTC".to_string());
    validate_time_zone(identity.engine, &cursor_time_zone)
        .map_err(|reason| at.error("poller.source.cursorTimeZone", reason))?;
    let target_text = match &target {
        SourceTarget::Table { schema: Some(schema), name } => format!("table:{schema}.{name}"),
        SourceTarget::Table { schema: None, name } => format!("table:{name}"),
        SourceTarget::Query(query) => format!("query:{query}"),
    };
    let effective = effective_target(&identity, &resolved_url)
        .map_err(|reason| at.error("poller.source.connection", format!("app setting {}: {reason}", raw.connection)))?;
    let fingerprint = source_fingerprint(&FingerprintInput {
        engine: identity.engine.name(),
        host: &effective.host,
        port: effective.port,
        database: &effective.database,
        user: &effective.user,
        socket: effective.socket.as_deref(),
        options: effective.options.as_deref(),
        target: target_text.clone(),
        cursor: &raw.cursor,
        pk: &raw.pk,
        columns: raw.columns.as_deref(),
        where_clause: raw.where_clause.as_deref(),
    });
    let legacy_fingerprint = if url_changes_target_in_query(url_value) {
        None
    } else {
        Some(source_fingerprint(&FingerprintInput {
            engine: identity.engine.name(),
            host: &identity.host,
            port: identity.port,
            database: &identity.database,
            user: &identity.user,
            socket: None,
            options: None,
            target: target_text,
            cursor: &raw.cursor,
            pk: &raw.pk,
            columns: raw.columns.as_deref(),
            where_clause: raw.where_clause.as_deref(),
        }))
        .filter(|legacy| *legacy != fingerprint)
    };
    let source = SourceConfig {
        connection: raw.connection,
        engine: identity.engine,
        url: Secret::new(resolved_url),
        target,
        cursor: raw.cursor,
        pk: raw.pk,
        columns: raw.columns,
        where_clause: raw.where_clause,
        settle: Duration::from_secs(settle_seconds),
        settle_configured: raw.settle_seconds.is_some(),
        query_timeout: Duration::from_secs(query_timeout_seconds),
        cursor_time_zone,
    };
    Ok((source, Fingerprints { current: fingerprint, legacy: legacy_fingerprint }))
}

struct Fingerprints {
    current: String,
    legacy: Option<String>,
}

/// The database a URL really points at, as the driver resolves it: query parameters
/// (`?host=`, `?port=`, `?dbname=`, `?user=`, `?options=`) and the driver's defaults included.
struct EffectiveTarget {
    host: String,
    port: Option<u16>,
    socket: Option<String>,
    database: String,
    user: String,
    options: Option<String>,
}

fn effective_target(identity: &UrlIdentity, resolved_url: &str) -> Result<EffectiveTarget, String> {
    let redaction = redact::Redaction::of_url(resolved_url);
    let invalid = |error: sqlx::Error| format!("not a valid database URL: {}", redaction.scrub(&error.to_string()));
    match identity.engine {
        Engine::Sqlite => Ok(EffectiveTarget {
            host: identity.host.clone(),
            port: identity.port,
            socket: None,
            database: identity.database.clone(),
            user: identity.user.clone(),
            options: None,
        }),
        Engine::Postgres => {
            let options = sqlx::postgres::PgConnectOptions::from_str(resolved_url).map_err(invalid)?;
            let user = options.get_username().to_string();
            Ok(EffectiveTarget {
                host: options.get_host().to_string(),
                port: Some(options.get_port()),
                socket: options.get_socket().map(|path| path.display().to_string()),
                // PostgreSQL's default database is the user's name.
                database: options.get_database().map(str::to_string).unwrap_or_else(|| user.clone()),
                user,
                options: options.get_options().map(str::to_string),
            })
        }
        Engine::MySql => {
            let options = sqlx::mysql::MySqlConnectOptions::from_str(resolved_url).map_err(invalid)?;
            Ok(EffectiveTarget {
                host: options.get_host().to_string(),
                port: Some(options.get_port()),
                socket: options.get_socket().map(|path| path.display().to_string()),
                database: options.get_database().unwrap_or_default().to_string(),
                user: options.get_username().to_string(),
                options: None,
            })
        }
    }
}

/// Whether the URL's query names a different target than its surface (host, port, database,
/// user, options, socket): then the surface-only fingerprint of earlier builds cannot be trusted.
fn url_changes_target_in_query(url: &str) -> bool {
    const TARGET_PARAMETERS: [&str; 8] = ["host", "hostaddr", "port", "dbname", "user", "options", "socket", "service"];
    let Some((_, query)) = url.split_once('?') else {
        return false;
    };
    query.split('&').any(|pair| {
        let name = pair.split('=').next().unwrap_or_default().to_ascii_lowercase();
        TARGET_PARAMETERS.contains(&name.as_str())
    })
}

fn build_sink(raw: RawSink, settings: &Settings, at: &Located<'_>) -> Result<SinkConfig, ConfigError> {
    let queue_fields = [
        ("connection", raw.connection.is_some()),
        ("queueName", raw.queue_name.is_some()),
        ("messageEncoding", raw.message_encoding.is_some()),
        ("messagePer", raw.message_per.is_some()),
    ];
    let webhook_fields = [
        ("url", raw.url.is_some()),
        ("secret", raw.secret.is_some()),
        ("timeoutSeconds", raw.timeout_seconds.is_some()),
        ("maxRetries", raw.max_retries.is_some()),
        ("maxBodyBytes", raw.max_body_bytes.is_some()),
    ];
    let foreign = match raw.kind.as_str() {
        "webhook" => queue_fields.iter().find(|(_, present)| *present),
        "queue" => webhook_fields.iter().find(|(_, present)| *present),
        _ => None,
    };
    if let Some((field, _)) = foreign {
        return Err(at.error(&format!("poller.sink.{field}"), format!("does not apply to a {} sink", raw.kind)));
    }
    match raw.kind.as_str() {
        "queue" => {
            let connection_name = raw.connection.unwrap_or_else(|| defaults::STATE_CONNECTION.to_string());
            let connection = StorageConnection::from_settings(&connection_name, settings)
                .map_err(|reason| at.error("poller.sink.connection", reason))?;
            let queue_name = raw
                .queue_name
                .ok_or_else(|| at.error("poller.sink.queueName", "missing: a queue sink needs a queueName"))?;
            if !is_valid_container_name(&queue_name) {
                return Err(at.error(
                    "poller.sink.queueName",
                    format!("{queue_name:?} is not a valid queue name: 3-63 lowercase letters, digits and single '-'"),
                ));
            }
            let encoding = match raw.message_encoding.as_deref().unwrap_or("base64") {
                "base64" => MessageEncoding::Base64,
                "none" => MessageEncoding::None,
                other => {
                    return Err(at.error(
                        "poller.sink.messageEncoding",
                        format!("{other:?}: expected \"base64\" (what a queue trigger expects) or \"none\""),
                    ));
                }
            };
            let per = match raw.message_per.as_deref().unwrap_or("row") {
                "row" => MessagePer::Row,
                "batch" => MessagePer::Batch,
                other => {
                    return Err(at.error("poller.sink.messagePer", format!("{other:?}: expected \"row\" or \"batch\"")));
                }
            };
            Ok(SinkConfig::Queue(QueueConfig { connection: Box::new(connection), queue_name, encoding, per }))
        }
        "webhook" => {
            let url_text = raw.url.ok_or_else(|| at.error("poller.sink.url", "missing: a webhook sink needs a url"))?;
            let url = url::Url::parse(&url_text)
                .map_err(|error| at.error("poller.sink.url", format!("not a valid URL: {error}")))?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(at.error("poller.sink.url", format!("scheme {:?} is not http or https", url.scheme())));
            }
            let secret = match raw.secret {
                None => None,
                Some(name) => {
                    let value = settings.get(&name).ok_or_else(|| {
                        at.error(
                            "poller.sink.secret",
                            format!("app setting {name} is not set (it must hold the signing secret)"),
                        )
                    })?;
                    if value.is_empty() {
                        return Err(at.error("poller.sink.secret", format!("app setting {name} is empty")));
                    }
                    let key = SigningKey::from_secret(value)
                        .map_err(|reason| at.error("poller.sink.secret", format!("app setting {name}: {reason}")))?;
                    Some(key)
                }
            };
            let timeout = Duration::from_secs(in_range(
                at,
                "poller.sink.timeoutSeconds",
                raw.timeout_seconds,
                defaults::WEBHOOK_TIMEOUT_SECONDS,
                1..=limits::SECONDS,
            )?);
            let max_retries =
                in_range(at, "poller.sink.maxRetries", raw.max_retries, defaults::WEBHOOK_MAX_RETRIES, 0..=20)?;
            let max_body_bytes = in_range(
                at,
                "poller.sink.maxBodyBytes",
                raw.max_body_bytes,
                defaults::WEBHOOK_MAX_BODY_BYTES,
                1024..=limits::WEBHOOK_MAX_BODY_BYTES,
            )?;
            Ok(SinkConfig::Webhook(WebhookConfig { url, signing_key: secret, timeout, max_retries, max_body_bytes }))
        }
        other => {
            Err(at.error("poller.sink.type", format!("unknown sink type {other:?}: expected \"webhook\" or \"queue\"")))
        }
    }
}

fn build_state(
    raw: RawState,
    settings: &Settings,
    app_root: &Path,
    at: &Located<'_>,
) -> Result<StateConfig, ConfigError> {
    let connection = raw.connection.unwrap_or_else(|| defaults::STATE_CONNECTION.to_string());
    let container = raw.container.unwrap_or_else(|| defaults::STATE_CONTAINER.to_string());
    if !is_valid_container_name(&container) {
        return Err(at.error(
            "poller.state.container",
            format!("{container:?} is not a valid container name: 3-63 lowercase letters, digits and single '-'"),
        ));
    }
    let location = match settings.get(&connection) {
        Some(value) if value.starts_with("file:") => {
            let directory = value["file:".len()..].trim();
            if directory.is_empty() {
                return Err(
                    at.error("poller.state.connection", format!("app setting {connection}: `file:` needs a directory"))
                );
            }
            let path = PathBuf::from(directory);
            StateLocation::File(if path.is_absolute() { path } else { app_root.join(path) })
        }
        _ => {
            let connection_value = StorageConnection::from_settings(&connection, settings)
                .map_err(|reason| at.error("poller.state.connection", reason))?;
            StateLocation::AzureBlob(Box::new(connection_value))
        }
    };
    Ok(StateConfig { connection, container, location })
}

fn is_valid_container_name(name: &str) -> bool {
    (3..=63).contains(&name.len())
        && name
            .chars()
            .all(|character| character.is_ascii_lowercase() || character.is_ascii_digit() || character == '-')
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--")
}

impl fmt::Display for SourceTarget {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceTarget::Table { schema: Some(schema), name } => write!(formatter, "{schema}.{name}"),
            SourceTarget::Table { schema: None, name } => formatter.write_str(name),
            SourceTarget::Query(_) => formatter.write_str("(query)"),
        }
    }
}

#[cfg(test)]
mod tests;
