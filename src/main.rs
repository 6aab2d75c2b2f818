//! Thin: parse the command line, set up logging, dispatch.

use std::process::ExitCode;

use clap::FromArgMatches;
use dbtrigger::cli::Cli;

/// mimalloc rather than the C library's allocator: a batch's rows and events are allocated by the
/// task that reads them and freed by the one that delivers them, on another thread, and the C
/// library's allocator pays for that in locks (in the throughput bench dbtrigger's CPU per row at
/// batch 1,000 fell by a tenth to a sixth; docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    // The derived command line, with its commands grouped and an example under each (cli::help).
    let cli = Cli::from_arg_matches(&dbtrigger::cli::command().get_matches()).unwrap_or_else(|error| error.exit());
    // Operator commands and the demo: warnings and errors only unless -v (cli::Cli::log_level).
    dbtrigger::logging::init(cli.log_level(), cli.command.log_stream());
    match dbtrigger::cli::run(cli).await {
        Ok(code) => code,
        Err(error) => {
            // Fatal: stderr, which the host logs at Error (the exit code 1 makes it restart us).
            eprintln!("dbtrigger: {error:#}");
            ExitCode::FAILURE
        }
    }
}
