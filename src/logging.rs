//! Logs go to stdout (the Functions host logs stdout lines as Information and stderr as Error), one
//! line per event, without colour unless the stream is a terminal. Operator commands log to stderr
//! instead, so that what they print on stdout (JSON, tables) stays clean.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Where log lines go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogStream {
    Stdout,
    Stderr,
}

/// Installs the subscriber. `RUST_LOG` overrides `default_level`.
pub fn init(default_level: &str, stream: LogStream) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_target(false);
    let _ = match stream {
        LogStream::Stdout => builder.with_writer(std::io::stdout).with_ansi(std::io::stdout().is_terminal()).try_init(),
        LogStream::Stderr => builder.with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal()).try_init(),
    };
}
