//! The raw shape of function.json: what a user writes, deserialized as is (unknown fields
//! refused), with `%NAME%` app settings substituted and the timer binding read. Validation into
//! the typed configuration happens in the section modules.

use serde::Deserialize;
use serde_json::Value;

use super::{ConfigError, Located};
use crate::domain::schedule::Schedule;
use crate::settings::Settings;

// ---------------------------------------------------------------------------------------------
// Raw, as written in function.json. Unknown fields are refused: a typo must not silently mean
// "use the default".

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPoller {
    pub(super) name: Option<String>,
    pub(super) source: RawSource,
    #[serde(default)]
    pub(super) batch: RawBatch,
    pub(super) sink: RawSink,
    #[serde(default)]
    pub(super) lease: RawLease,
    #[serde(default)]
    pub(super) poison: RawPoison,
    #[serde(default)]
    pub(super) state: RawState,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawSource {
    /// `"polling"` (the default) or `"logical"` (PostgreSQL logical decoding).
    pub(super) kind: Option<String>,
    pub(super) connection: String,
    pub(super) table: Option<String>,
    pub(super) query: Option<String>,
    pub(super) cursor: Option<String>,
    pub(super) pk: Option<Vec<String>>,
    /// A logical source's replication slot and publication.
    pub(super) slot: Option<String>,
    pub(super) publication: Option<String>,
    /// A logical source's `"any"` (the default) or `"none"`: which changes it reads by their
    /// replication origin.
    pub(super) origin: Option<String>,
    /// A binary-log source's tables (`database.table`) and the server id it registers with.
    pub(super) tables: Option<Vec<String>>,
    pub(super) server_id: Option<u64>,
    pub(super) columns: Option<Vec<String>>,
    #[serde(rename = "where")]
    pub(super) where_clause: Option<String>,
    pub(super) settle_seconds: Option<u64>,
    /// `"auto"`: bound the cursor by the database's oldest open transaction.
    pub(super) settle: Option<String>,
    /// `"integer"`, `"timestamp"` or `"xid"`: what the cursor column must hold.
    pub(super) cursor_kind: Option<String>,
    pub(super) cursor_time_zone: Option<String>,
    pub(super) query_timeout_seconds: Option<u64>,
    /// The cap on connections to this source's database, for every poller of the app reading it.
    pub(super) max_connections: Option<u64>,
    pub(super) soft_delete: Option<String>,
    pub(super) op_column: Option<String>,
    pub(super) generation: Option<RawGeneration>,
    pub(super) late_arrivals: Option<super::late::RawLateArrivals>,
    /// The largest row (as JSON) the poller keeps: by default what the sink can carry.
    pub(super) max_row_bytes: Option<usize>,
    /// `"stop"` or `"quarantineReference"`: what a row over the bound does.
    pub(super) oversized_rows: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawGeneration {
    pub(super) query: String,
    pub(super) on_change: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawBatch {
    pub(super) size: Option<usize>,
    pub(super) max_bytes: Option<usize>,
    pub(super) max_in_flight: Option<usize>,
    pub(super) tick_budget_seconds: Option<u64>,
    pub(super) commit_interval_ms: Option<u64>,
    pub(super) order: Option<String>,
    pub(super) order_key: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawSink {
    #[serde(rename = "type")]
    pub(super) kind: String,
    pub(super) url: Option<String>,
    pub(super) secret: Option<String>,
    pub(super) timeout_seconds: Option<u64>,
    pub(super) max_retries: Option<u32>,
    pub(super) max_body_bytes: Option<usize>,
    pub(super) allow_link_local: Option<bool>,
    pub(super) connection: Option<String>,
    pub(super) queue_name: Option<String>,
    pub(super) message_encoding: Option<String>,
    pub(super) message_per: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawLease {
    pub(super) ttl_seconds: Option<u64>,
    pub(super) heartbeat_seconds: Option<u64>,
    pub(super) clock_skew_seconds: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawPoison {
    pub(super) max_attempts: Option<u32>,
    pub(super) mode: Option<String>,
    pub(super) max_quarantined_per_hour: Option<u32>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct RawState {
    pub(super) connection: Option<String>,
    pub(super) container: Option<String>,
}

pub(crate) fn timer_schedule(
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
        if !binding_is(binding, "timerTrigger", "in") {
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
        let mut used = UsedSettings::default();
        substitute_settings(&mut schedule, &field, settings, &mut used, at)?;
        let schedule = match schedule.as_str() {
            Some(text) => Some(Schedule::parse(text).map_err(|reason| used.scrub(at.error(&field, reason)))?),
            None => None,
        };
        let run_on_startup = binding.get("runOnStartup").and_then(Value::as_bool).unwrap_or(false);
        return Ok((schedule, run_on_startup));
    }
    Err(at.error("bindings", "no timerTrigger binding: a poller runs on a timer"))
}

/// Whether `binding` is of type `kind` in direction `direction`, matched without regard to case as
/// the host matches them (azure-functions-host `Binding/CoreExtensionsScriptBindingProvider.cs` and
/// `Binding/WebJobsCoreScriptBindingProvider.cs` compare the type `OrdinalIgnoreCase`;
/// `BindingMetadata.Direction` is an enum read case-insensitively). A trigger with no direction
/// is taken as `in`, the only direction a trigger has.
pub(crate) fn binding_is(binding: &Value, kind: &str, direction: &str) -> bool {
    let type_matches = binding.get("type").and_then(Value::as_str).is_some_and(|text| text.eq_ignore_ascii_case(kind));
    let direction_matches = match binding.get("direction").and_then(Value::as_str) {
        Some(text) => text.eq_ignore_ascii_case(direction),
        None => kind.to_ascii_lowercase().ends_with("trigger") && direction == "in",
    };
    type_matches && direction_matches
}

/// The fields of a `poller` section that name an app setting: never substituted (a `%NAME%` there
/// would put the setting's value, a password or a key, where a name is expected, and every error
/// about the field would then quote it).
pub(crate) const POLLER_SETTING_NAME_FIELDS: [&str; 4] =
    ["source.connection", "sink.secret", "sink.connection", "state.connection"];

/// The fields of a `watchdog` section that name an app setting.
pub(crate) const WATCHDOG_SETTING_NAME_FIELDS: [&str; 2] = ["alert.secret", "state.connection"];

/// Whether `name` can be an app setting's name: letters, digits and `_ . : -` (Azure's names,
/// with `:` for nested names). A URL, a connection string or a key is not one.
fn looks_like_a_setting_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name.chars().all(|character| character.is_ascii_alphanumeric() || matches!(character, '_' | '.' | ':' | '-'))
}

/// Checks the fields of `section` (at `section_path`) that name an app setting, before any
/// substitution: a field written `%NAME%` is refused with the fix (write `NAME`), and a field that
/// does not look like a name is refused without being quoted (it may be a value pasted in). The
/// values of the settings they name are remembered in `used`, so that no error can quote them.
pub(crate) fn check_setting_name_fields(
    section: &Value,
    section_path: &str,
    fields: &[&str],
    settings: &Settings,
    used: &mut UsedSettings,
    at: &Located<'_>,
) -> Result<(), ConfigError> {
    for field in fields {
        let pointer = format!("/{}", field.replace('.', "/"));
        let Some(name) = section.pointer(&pointer).and_then(Value::as_str) else {
            // Missing, or not text: the section's own parsing says what is wrong.
            continue;
        };
        let field_path = format!("{section_path}.{field}");
        let inner = name.strip_prefix('%').and_then(|rest| rest.strip_suffix('%'));
        if let Some(inner) = inner.filter(|inner| looks_like_a_setting_name(inner)) {
            return Err(at.error(
                &field_path,
                format!(
                    "names an app setting: write {inner:?}, not \"%{inner}%\" (a %NAME% would put the setting's \
                     value, a password or a key, where its name belongs)"
                ),
            ));
        }
        if !looks_like_a_setting_name(name) {
            return Err(at.error(
                &field_path,
                "must be the name of an app setting (letters, digits, '_', '.', ':', '-'), not a value: put the \
                 value in an app setting and write that setting's name here (the text written is not shown: it may \
                 be a secret)",
            ));
        }
        used.named(name, settings);
    }
    Ok(())
}

/// The values of the app settings a section used (substituted, or named by a connection or
/// secret field). An error about the section is scrubbed of every one of them before it leaves
/// the loader: whichever message a mistake leads to, it never quotes a setting's value.
#[derive(Default)]
pub(crate) struct UsedSettings {
    /// (what replaces it, the text), longest text first once scrubbing.
    values: Vec<(String, String)>,
}

/// Values shorter than this are not scrubbed: they cannot be a credential, and replacing them
/// would garble the numbers and words of the message itself.
const SHORTEST_SCRUBBED_VALUE: usize = 4;

impl UsedSettings {
    /// A setting a field names.
    pub(crate) fn named(&mut self, name: &str, settings: &Settings) {
        if let Some(value) = settings.get(name) {
            self.remember(name, value);
        }
    }

    /// A setting's value: whole, and its secret parts on their own (a URL's password and
    /// credential parameters, a connection string's key, a `whsec_` key's base64), since an error
    /// may quote a piece of a value (one dotted part of a table name, say).
    fn remember(&mut self, name: &str, value: &str) {
        self.values.push((format!("<value of {name}>"), value.to_string()));
        for part in super::redact::url_secrets(value) {
            self.values.push((super::redact::MASK.to_string(), part));
        }
        for pair in value.split(';') {
            if let Some((key, secret)) = pair.split_once('=') {
                let key = key.trim().to_ascii_lowercase();
                if matches!(key.as_str(), "accountkey" | "sharedaccesssignature" | "password" | "pwd") {
                    self.values.push((super::redact::MASK.to_string(), secret.trim().to_string()));
                }
            }
        }
        if let Some(encoded) = value.strip_prefix("whsec_") {
            self.values.push((super::redact::MASK.to_string(), encoded.to_string()));
        }
    }

    /// `error` with every remembered value replaced.
    pub(crate) fn scrub(&self, mut error: ConfigError) -> ConfigError {
        let mut values: Vec<&(String, String)> =
            self.values.iter().filter(|(_, text)| text.len() >= SHORTEST_SCRUBBED_VALUE).collect();
        values.sort_by_key(|(_, text)| std::cmp::Reverse(text.len()));
        for (replacement, text) in values {
            if error.reason.contains(text.as_str()) {
                error.reason = error.reason.replace(text.as_str(), replacement);
            }
        }
        error
    }
}

/// Replaces every `%NAME%` in string values by app setting NAME (the Functions convention),
/// remembering each value in `used`.
pub(crate) fn substitute_settings(
    value: &mut Value,
    path: &str,
    settings: &Settings,
    used: &mut UsedSettings,
    at: &Located<'_>,
) -> Result<(), ConfigError> {
    match value {
        Value::String(text) => {
            if text.contains('%') {
                *text = substitute_in_text(text, settings, used).map_err(|reason| at.error(path, reason))?;
            }
            Ok(())
        }
        Value::Array(items) => {
            for (index, item) in items.iter_mut().enumerate() {
                substitute_settings(item, &format!("{path}[{index}]"), settings, used, at)?;
            }
            Ok(())
        }
        Value::Object(map) => {
            for (key, item) in map.iter_mut() {
                substitute_settings(item, &format!("{path}.{key}"), settings, used, at)?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

fn substitute_in_text(text: &str, settings: &Settings, used: &mut UsedSettings) -> Result<String, String> {
    let mut output = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find('%') {
        output.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        let Some(end) = after.find('%') else {
            return Err(unmatched_percent(text, text.len() - rest.len() + start));
        };
        let name = &after[..end];
        if name.is_empty() {
            output.push('%');
        } else {
            let value =
                settings.get(name).ok_or_else(|| format!("app setting {name} (referenced as %{name}%) is not set"))?;
            used.remember(name, value);
            output.push_str(value);
        }
        rest = &after[end + 1..];
    }
    output.push_str(rest);
    Ok(output)
}

/// The error of a value with a '%' that opens no `%NAME%`: where the '%' is (its character
/// position), and of the value only what a URL shows safely (scheme, host and port), never the
/// value whole: a literal URL with `%3D` in its key would print the key.
fn unmatched_percent(text: &str, byte_position: usize) -> String {
    let position = text.get(..byte_position).map(|before| before.chars().count() + 1).unwrap_or(0);
    let shown = match url::Url::parse(text) {
        Ok(url) if url.host_str().is_some() => {
            format!(" of the URL {}/… (the rest not shown: it may hold a key)", super::redact::shown_endpoint(&url))
        }
        _ => " of the value (not shown: it may hold a secret)".to_string(),
    };
    format!(
        "unmatched '%' at character {position}{shown}: write %% for a literal '%', %NAME% for an app setting, \
         or put the whole value in an app setting"
    )
}

#[cfg(test)]
mod unmatched_percent_tests {
    use super::substitute_in_text;
    use crate::settings::Settings;

    /// Regression (issue 36, section 3): a literal value with an unmatched '%' is not quoted
    /// whole: a URL shows its scheme, host and port only, anything else nothing.
    #[test]
    fn an_unmatched_percent_quotes_nothing_secret() {
        let settings = Settings::from_pairs(Vec::<(String, String)>::new());
        let mut used = super::UsedSettings::default();
        let error =
            substitute_in_text("https://fn.example/api/hook/T0KEN?code=K3y%3D", &settings, &mut used).unwrap_err();
        assert!(!error.contains("T0KEN") && !error.contains("K3y") && !error.contains("/api"), "{error}");
        assert!(error.contains("https://fn.example") && error.contains("character 43"), "{error}");
        let error = substitute_in_text("pass%word", &settings, &mut used).unwrap_err();
        assert!(!error.contains("pass") && !error.contains("word") && error.contains("character 5"), "{error}");
    }
}
