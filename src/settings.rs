//! App settings: environment variables in Azure and under `func start` (local.settings.json
//! `Values`). Passed around as a value, never read from the process environment deep inside the
//! code, so that tests and `demo` can provide their own.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

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

    /// The settings of the app at `app_root` as the Functions tools see them locally: the
    /// environment, completed by the app root's local.settings.json `Values` (the environment
    /// wins). No local.settings.json is no error: in Azure there is none.
    pub fn for_app_root(app_root: &Path) -> Result<Settings, SettingsError> {
        let mut settings = Settings::from_env();
        let path = app_root.join("local.settings.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Ok(settings);
        };
        let document: serde_json::Value = serde_json::from_str(&text).map_err(|error| {
            SettingsError::InvalidLocalSettings { path: path.display().to_string(), reason: error.to_string() }
        })?;
        if let Some(values) = document.get("Values").and_then(serde_json::Value::as_object) {
            for (name, value) in values {
                if settings.get(name).is_none()
                    && let Some(text) = value.as_str()
                {
                    settings = settings.with(name, text);
                }
            }
        }
        Ok(settings)
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

/// Why the settings of an app root cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    /// The reason is serde's (a line and a column), which never quotes the file's values.
    #[error("{path}: invalid JSON: {reason}")]
    InvalidLocalSettings { path: String, reason: String },
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
    fn local_settings_complete_the_environment_and_a_broken_file_is_named() {
        let directory = tempfile::tempdir().unwrap();
        assert!(Settings::for_app_root(directory.path()).is_ok(), "no local.settings.json is no error");
        std::fs::write(
            directory.path().join("local.settings.json"),
            r#"{"Values": {"DBTRIGGER_TEST_ONLY_LOCAL": "from-file", "PATH": "not-the-path"}}"#,
        )
        .unwrap();
        let settings = Settings::for_app_root(directory.path()).unwrap();
        assert_eq!(settings.get("DBTRIGGER_TEST_ONLY_LOCAL"), Some("from-file"));
        assert_ne!(settings.get("PATH"), Some("not-the-path"), "the environment wins");
        std::fs::write(directory.path().join("local.settings.json"), "{ not json").unwrap();
        let error = Settings::for_app_root(directory.path()).unwrap_err();
        assert!(error.to_string().contains("local.settings.json: invalid JSON"), "{error}");
    }

    #[test]
    fn app_name_falls_back_in_order() {
        assert_eq!(Settings::default().app_name(), "local");
        let settings = Settings::default().with("DBTRIGGER_APP_NAME", "mine");
        assert_eq!(settings.app_name(), "mine");
        assert_eq!(settings.with("WEBSITE_SITE_NAME", "site").app_name(), "site");
    }
}
