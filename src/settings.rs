//! App settings: environment variables in Azure and under `func start` (local.settings.json
//! `Values`). Passed around as a value, never read from the process environment deep inside the
//! code, so that tests and `demo` can provide their own.

use std::collections::BTreeMap;
use std::fmt;

#[derive(Clone, Default)]
pub struct Settings {
    values: BTreeMap<String, String>,
}

impl Settings {
    pub fn from_env() -> Self {
        Settings { values: std::env::vars().collect() }
    }

    pub fn from_pairs<I, K, V>(pairs: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        Settings { values: pairs.into_iter().map(|(key, value)| (key.into(), value.into())).collect() }
    }

    pub fn with(mut self, key: &str, value: &str) -> Self {
        self.values.insert(key.to_string(), value.to_string());
        self
    }

    /// A setting's value. Azure on Linux turns `:` into `__` in names; accept both.
    pub fn get(&self, name: &str) -> Option<&str> {
        if let Some(value) = self.values.get(name) {
            return Some(value.as_str());
        }
        if name.contains(':') {
            return self.values.get(&name.replace(':', "__")).map(String::as_str);
        }
        None
    }

    /// A setting's value, its name matched without regard to case (as .NET configuration keys are,
    /// which is how the host reads `AzureWebJobs.<function>.Disabled`).
    pub fn get_ignoring_case(&self, name: &str) -> Option<&str> {
        if let Some(value) = self.get(name) {
            return Some(value);
        }
        self.values.iter().find(|(key, _)| key.eq_ignore_ascii_case(name)).map(|(_, value)| value.as_str())
    }

    /// The app's name in state paths: `WEBSITE_SITE_NAME`, else `DBTRIGGER_APP_NAME`, else `local`.
    pub fn app_name(&self) -> String {
        self.get("WEBSITE_SITE_NAME")
            .or_else(|| self.get("DBTRIGGER_APP_NAME"))
            .filter(|name| !name.trim().is_empty())
            .unwrap_or("local")
            .to_string()
    }
}

/// Settings hold secrets: never print their values.
impl fmt::Debug for Settings {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.debug_struct("Settings").field("names", &self.values.keys().collect::<Vec<_>>()).finish()
    }
}

/// A value that must never reach a log, an error message or the state document.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("Secret(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_never_shows_values() {
        let settings = Settings::from_pairs([("DB", "postgres://u:hunter2@h/db")]);
        assert!(!format!("{settings:?}").contains("hunter2"));
        assert!(!format!("{:?}", Secret::new("hunter2")).contains("hunter2"));
    }

    #[test]
    fn app_name_falls_back_in_order() {
        assert_eq!(Settings::default().app_name(), "local");
        let settings = Settings::default().with("DBTRIGGER_APP_NAME", "mine");
        assert_eq!(settings.app_name(), "mine");
        assert_eq!(settings.with("WEBSITE_SITE_NAME", "site").app_name(), "site");
    }
}
