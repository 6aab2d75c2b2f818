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

/// Waits for SIGINT (Ctrl-C) or SIGTERM. The handlers are installed when this is called, not
/// when the future is first polled: a signal that comes between the two must not kill the process.
pub fn stop_signal() -> impl std::future::Future<Output = Stop> + Send {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let terminate = signal(SignalKind::terminate()).ok();
        let interrupt = signal(SignalKind::interrupt()).ok();
        async move {
            let (mut terminate, mut interrupt) = (terminate, interrupt);
            tokio::select! {
                () = received(terminate.as_mut()) => Stop::Terminate,
                () = received(interrupt.as_mut()) => Stop::Interrupt,
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
            Stop::Interrupt
        }
    }
}

/// Completes when `signal` arrives; never, when its handler could not be installed.
#[cfg(unix)]
async fn received(signal: Option<&mut tokio::signal::unix::Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending::<()>().await,
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
    if let Some(telemetry) = crate::telemetry::installed() {
        tokio::spawn(sample_status(app.clone(), telemetry.interval));
    }
    let (stopped_sender, stopped) = tokio::sync::watch::channel(None::<Stop>);
    let signalled = stop_signal();
    tokio::spawn(async move {
        let stop = signalled.await;
        stopped_sender.send_replace(Some(stop));
    });
    let mut graceful = stopped.clone();
    let server = crate::handler::serve(listener, app.clone(), async move {
        let _ = graceful.wait_for(Option::is_some).await;
    });
    let mut server = std::pin::pin!(server);
    let mut waiting = stopped.clone();
    // The signal first: once it came the server may end too, and the exit code is the signal's.
    let stop = tokio::select! {
        biased;
        stop = wait_for_stop(&mut waiting) => stop,
        served = &mut server => {
            served?;
            let stop = *stopped.borrow();
            return Ok(match stop {
                Some(stop) => ExitCode::from(stop.exit_code(under_host)),
                // Only an error ends the server without a signal.
                None => ExitCode::FAILURE,
            });
        }
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
    crate::telemetry::shutdown().await;
    info!(exit_code = code, "handler stopped");
    Ok(ExitCode::from(code))
}

async fn wait_for_stop(stopped: &mut tokio::sync::watch::Receiver<Option<Stop>>) -> Stop {
    match stopped.wait_for(Option::is_some).await {
        Ok(stop) => (*stop).unwrap_or(Stop::Terminate),
        Err(_) => Stop::Terminate,
    }
}

/// Telemetry's gauges: every `interval`, the status of every poller, read as `dbtrigger status`
/// and the status function read it (`App::status`, its source reads shared with the status
/// function's), handed to the exporter. One status read per interval, never during a tick's
/// critical path (it is a task of its own).
async fn sample_status(app: Arc<App>, interval: Duration) {
    let mut every = tokio::time::interval(interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(healths) = app.sampled_status().await else {
            continue;
        };
        let pollers: Vec<_> = healths
            .into_iter()
            .map(|health| {
                let poller =
                    app.pollers().find(|(name, _)| **name == health.function).map(|(_, poller)| poller.clone());
                (health, poller)
            })
            .collect();
        let borrowed: Vec<_> = pollers.iter().map(|(health, poller)| (health.clone(), poller.as_deref())).collect();
        crate::telemetry::observe_status(&borrowed);
    }
}
