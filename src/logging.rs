//! Log lines, one per event, without colour unless the stream is a terminal, where the Functions
//! host gives each its severity (azure-functions-host `Workers/ProcessManagement/WorkerProcess.cs`,
//! `ParseErrorMessageAndLog`, with `UseStdErrorStreamForErrorsOnly`, which `HttpWorkerDescription`
//! turns on for custom handlers): every stdout line is logged at Information, every stderr line at
//! Error, except a stderr line containing "warn" (any case), which is logged at Warning. So:
//! - the handler (`serve`, `dev`, `tick`) writes warnings and errors to stderr, the rest to stdout;
//!   a warning's line carries its level, `WARN`, which is what makes the host log it at
//!   Warning; an error's line says `ERROR` (and is logged at Warning if its text says "warn");
//! - operator commands write every log line to stderr, so that what they print on stdout (JSON,
//!   tables) stays clean.

use std::io::IsTerminal;

use tracing::Level;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::writer::MakeWriterExt;

/// Where log lines go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogStream {
    /// Warnings and errors to stderr, the rest to stdout: what the host expects of a handler.
    BySeverity,
    /// Everything to stderr.
    Stderr,
}

/// Targets never logged: the OpenTelemetry SDK and exporters' own lines.
const QUIET_TARGETS: [&str; 5] = [
    "opentelemetry",
    "opentelemetry_sdk",
    "opentelemetry_otlp",
    "opentelemetry_http",
    "opentelemetry_application_insights",
];

/// Installs the subscriber. `RUST_LOG` overrides `default_level`.
pub fn init(default_level: &str, stream: LogStream) {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // The OpenTelemetry crates log each failed export (and, at debug, a response body that may
    // echo a token): telemetry's own watch says it once instead (src/telemetry/watched.rs).
    for quiet in QUIET_TARGETS {
        if let Ok(directive) = format!("{quiet}=off").parse() {
            filter = filter.add_directive(directive);
        }
    }
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_target(false);
    let _ = match stream {
        LogStream::BySeverity => {
            let terminal = std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
            let writer = std::io::stderr.with_max_level(Level::WARN).or_else(std::io::stdout);
            builder.with_writer(writer).with_ansi(terminal).try_init()
        }
        LogStream::Stderr => builder.with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal()).try_init(),
    };
}
