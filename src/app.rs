//! The app: every function folder, each opened once into a [`Poller`] (or kept as the reason it
//! could not be), shared by the handler, the CLI and `demo`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use tracing::{error, info};

use crate::config::{AppConfig, ConfigError, PollerConfig, Settings};
use crate::tick::{Clock, Poller, SystemClock};

pub struct App {
    pub app_name: String,
    pollers: BTreeMap<String, Result<Arc<Poller>, String>>,
}

/// Looking a function up.
pub enum Lookup<'a> {
    Ready(&'a Arc<Poller>),
    /// The function exists but its configuration (or a connection) is bad: every invocation fails
    /// with this message.
    Broken(&'a str),
    Unknown,
}

impl App {
    /// Loads and opens every poller under `app_root`. Only an unreadable app root is an error.
    pub fn load(app_root: &Path, settings: &Settings) -> Result<App, ConfigError> {
        let config = AppConfig::load(app_root, settings)?;
        Ok(App::open(config, settings, Arc::new(SystemClock)))
    }

    pub fn open(config: AppConfig, settings: &Settings, clock: Arc<dyn Clock>) -> App {
        let owner_id = owner_id(settings);
        let mut pollers = BTreeMap::new();
        for (name, parsed) in config.functions {
            let opened = match parsed {
                Ok(poller_config) => open_poller(poller_config, clock.clone(), &owner_id),
                Err(error) => Err(error.to_string()),
            };
            match &opened {
                Ok(poller) => info!(
                    function = %name,
                    poller = %poller.config.poller_name,
                    source = %poller.source.describe(),
                    sink = %poller.sink.describe(),
                    state = %poller.store.describe(),
                    "poller ready"
                ),
                Err(reason) => error!(function = %name, "poller not usable: {reason}"),
            }
            pollers.insert(name, opened);
        }
        App { app_name: config.app_name, pollers }
    }

    pub fn lookup(&self, name: &str) -> Lookup<'_> {
        let found = self.pollers.get(name).or_else(|| {
            self.pollers
                .iter()
                .find(|(function_name, _)| function_name.eq_ignore_ascii_case(name))
                .map(|(_, poller)| poller)
        });
        match found {
            Some(Ok(poller)) => Lookup::Ready(poller),
            Some(Err(reason)) => Lookup::Broken(reason),
            None => Lookup::Unknown,
        }
    }

    pub fn function_names(&self) -> Vec<String> {
        self.pollers.keys().cloned().collect()
    }
}

fn open_poller(config: PollerConfig, clock: Arc<dyn Clock>, owner_id: &str) -> Result<Arc<Poller>, String> {
    let file = config.file.display().to_string();
    let source = crate::source::open(&config.source).map_err(|error| format!("{file}: poller.source: {error}"))?;
    let sink = crate::sink::open(&config.sink).map_err(|error| format!("{file}: poller.sink: {error}"))?;
    let store = crate::store::open(&config.state).map_err(|error| format!("{file}: poller.state: {error}"))?;
    Ok(Arc::new(Poller::new(config, source, sink, store, clock, owner_id.to_string())))
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
