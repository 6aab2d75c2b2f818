//! Logs go to stdout (the Functions host logs stdout lines as Information and stderr as Error), one
//! line per event, without colour unless stdout is a terminal.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the subscriber. `RUST_LOG` overrides `default_level`.
pub fn init(default_level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stdout)
        .with_ansi(std::io::stdout().is_terminal())
        .with_target(false)
        .try_init();
}
