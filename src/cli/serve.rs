//! `dbtrigger serve` until a signal, and the exit that follows it.
//!
//! What the host does with the worker's exit (azure-functions-host
//! `Workers/ProcessManagement/WorkerProcess.cs` `OnProcessExited`, and
//! `Workers/Http/HttpFunctionInvocationDispatcher.cs`):
//! - exit code 0: nothing. The worker is gone and every later invocation fails until the host
//!   itself restarts;
//! - exit code 200 (`WorkerConstants.IntentionalRestartExitCode`): the host starts the worker again,
//!   and does not count it as an error;
//! - any other code: the host starts the worker again and counts an error; the third error within
//!   30 minutes of the one before (`WorkerRestartErrorIntervalThresholdInMinutes`) stops the host.
//!
//! While the host itself shuts down (scale-in, a restart, Ctrl-C on `func start`) it ignores the
//! exit, and it ends the worker with a kill, not a signal (`WorkerProcess.Dispose`). So a SIGTERM or
//! SIGINT the handler sees comes from elsewhere (the container's stop, an operator's `kill`, a
//! terminal): under a host (`FUNCTIONS_CUSTOMHANDLER_WORKER_ID` is set) the handler then exits
//! 200, so that a host still running restarts it without counting an error; run by hand it exits
//! as shells expect of a signalled process, 128 + the signal's number (130, 143).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::app::App;

/// The host restarts a worker that exits with this code, and counts no error.
pub const INTENTIONAL_RESTART_EXIT_CODE: u8 = 200;

/// How long the leases of abandoned ticks may take to be given back before the process exits
/// anyway (they then expire).
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// The signal that stopped the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    Interrupt,
    Terminate,
}

impl Stop {
    fn name(self) -> &'static str {
        match self {
            Stop::Interrupt => "SIGINT",
            Stop::Terminate => "SIGTERM",
        }
    }

    /// The exit code after this signal (see the module's documentation).
    pub fn exit_code(self, under_host: bool) -> u8 {
        match (under_host, self) {
            (true, _) => INTENTIONAL_RESTART_EXIT_CODE,
            (false, Stop::Interrupt) => 130,
            (false, Stop::Terminate) => 143,
        }
    }
}

/// Waits for SIGINT (Ctrl-C) or SIGTERM.
pub async fn stop_signal() -> Stop {
    #[cfg(unix)]
    {
        let mut terminate = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return Stop::Interrupt;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => Stop::Interrupt,
            _ = terminate.recv() => Stop::Terminate,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        Stop::Interrupt
    }
}

/// Serves until a signal; then takes no new invocation, lets ticks in flight finish for `grace`,
/// stops the ones still running (each gives its lease back), and exits with the signal's code.
pub async fn run(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    grace: Duration,
    under_host: bool,
) -> anyhow::Result<ExitCode> {
    let (stopped_sender, stopped) = tokio::sync::watch::channel(None::<Stop>);
    tokio::spawn(async move {
        let stop = stop_signal().await;
        stopped_sender.send_replace(Some(stop));
    });
    let mut graceful = stopped.clone();
    let server = crate::handler::serve(listener, app.clone(), async move {
        let _ = graceful.wait_for(Option::is_some).await;
    });
    let mut server = std::pin::pin!(server);
    let mut waiting = stopped.clone();
    let stop = tokio::select! {
        served = &mut server => {
            // The server ended without a signal: only an error ends it.
            served?;
            return Ok(ExitCode::FAILURE);
        }
        stop = wait_for_stop(&mut waiting) => stop,
    };
    let code = stop.exit_code(under_host);
    info!(
        signal = stop.name(),
        exit_code = code,
        "stopping: no new invocations; ticks in flight have {} s to finish",
        grace.as_secs()
    );
    if tokio::time::timeout(grace, &mut server).await.is_err() {
        warn!("grace period over: stopping the ticks still in flight and giving their leases back");
        app.abandon_ticks();
        if tokio::time::timeout(RELEASE_WAIT, &mut server).await.is_err() {
            warn!("exiting with requests still open: the leases of their ticks expire by themselves");
        }
    }
    info!(exit_code = code, "handler stopped");
    Ok(ExitCode::from(code))
}

async fn wait_for_stop(stopped: &mut tokio::sync::watch::Receiver<Option<Stop>>) -> Stop {
    match stopped.wait_for(Option::is_some).await {
        Ok(stop) => (*stop).unwrap_or(Stop::Terminate),
        Err(_) => Stop::Terminate,
    }
}
