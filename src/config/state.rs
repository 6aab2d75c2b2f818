//! `poller.state`: where the state document lives (Azure Blob Storage, or `file:<dir>`).

use std::path::{Path, PathBuf};

use super::connection::StorageConnection;
use super::function_json::RawState;
use super::{ConfigError, Located, defaults};
use crate::settings::Settings;

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

pub(super) fn build_state(
    raw: RawState,
    settings: &Settings,
    app_root: &Path,
    at: &Located<'_>,
    section: &str,
) -> Result<StateConfig, ConfigError> {
    let connection = raw.connection.unwrap_or_else(|| defaults::STATE_CONNECTION.to_string());
    let container = raw.container.unwrap_or_else(|| defaults::STATE_CONTAINER.to_string());
    if !is_valid_container_name(&container) {
        return Err(at.error(
            &format!("{section}.container"),
            format!("{container:?} is not a valid container name: 3-63 lowercase letters, digits and single '-'"),
        ));
    }
    let location = match settings.get(&connection) {
        Some(value) if value.starts_with("file:") => {
            let directory = value["file:".len()..].trim();
            if directory.is_empty() {
                return Err(at.error(
                    &format!("{section}.connection"),
                    format!("app setting {connection}: `file:` needs a directory"),
                ));
            }
            let path = PathBuf::from(directory);
            StateLocation::File(if path.is_absolute() { path } else { app_root.join(path) })
        }
        _ => {
            let connection_value = StorageConnection::from_settings(&connection, settings)
                .map_err(|reason| at.error(&format!("{section}.connection"), reason))?;
            StateLocation::AzureBlob(Box::new(connection_value))
        }
    };
    Ok(StateConfig { connection, container, location })
}

pub(super) fn is_valid_container_name(name: &str) -> bool {
    (3..=63).contains(&name.len())
        && name
            .chars()
            .all(|character| character.is_ascii_lowercase() || character.is_ascii_digit() || character == '-')
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--")
}
