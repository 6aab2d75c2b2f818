//! The command line: `serve` (what host.json starts), `tick` (one tick from the shell, same code
//! path) and `demo` (the quickstart). Thin: parse, call the library, print.

mod demo;
mod dev;
mod help;
mod operator;
mod ops;
mod package;
mod progress;
mod quarantine;
mod scaffold;
mod serve;
mod sql;
mod status;

use std::io::IsTerminal;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

use crate::app::{App, Invocation};
use crate::config::Settings;

pub use self::help::command;

/// The sentence every user must read before relying on dbtrigger (design "disclosure").
pub const DISCLOSURE: &str = "dbtrigger is not a native database trigger: it is a pseudo trigger built on Azure Functions timers. \
Delivery is at least once, so handlers must be idempotent (de-duplicate on event_id, or upsert).";

#[derive(Debug, Parser)]
#[command(name = "dbtrigger", version, about = "A database trigger for Azure Functions: PostgreSQL, MySQL/MariaDB and SQLite tables as a change feed.", long_about = None, after_help = DISCLOSURE)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// More log lines on stderr: -v for what the app does (INFO), -vv for debugging. Operator
    /// commands show only warnings and errors by default; `RUST_LOG` overrides both.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
}

impl Cli {
    /// The log level when `RUST_LOG` is not set: the handler's commands (`serve`, `dev`, `tick`)
    /// log what they do (INFO), since the host and the person running them read it; an operator
    /// command answers on stdout and says only what went wrong on stderr (warnings and errors),
    /// as kubectl and cargo do, unless asked for more with `-v`; the demo tells its own story.
    pub fn log_level(&self) -> &'static str {
        let quiet = matches!(self.command, Command::Demo { .. }) || self.command.is_operator();
        match (quiet, self.verbose) {
            (_, 2..) => "debug",
            (true, 0) => "warn",
            _ => "info",
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the custom handler, as host.json starts it
    ///
    /// Listens on $FUNCTIONS_CUSTOMHANDLER_PORT for the Functions host's invocations. Settings come
    /// from the environment only, as the host passes them (local.settings.json is `func start`'s).
    Serve {
        #[command(flatten)]
        app_root: AppRoot,
        /// Port to listen on [default: $FUNCTIONS_CUSTOMHANDLER_PORT].
        #[arg(long, env = "FUNCTIONS_CUSTOMHANDLER_PORT")]
        port: u16,
        /// Address to bind; the host dials 127.0.0.1.
        #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
        bind: IpAddr,
        /// After SIGTERM or SIGINT: how long ticks in flight may go on before they are stopped and
        /// their leases given back.
        #[arg(long, default_value_t = 8)]
        grace_seconds: u64,
    },
    /// Run one tick of a poller (or one run of a watchdog) from the shell
    ///
    /// The same code as the handler runs; prints one line, exits 1 when the tick failed. Settings
    /// come from the environment, then the app root's local.settings.json.
    Tick {
        /// The function (folder) name of the poller.
        poller: String,
        /// Tick it even though it is disabled (`AzureWebJobs.<function>.Disabled`, host.json
        /// `functions`).
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        app_root: AppRoot,
    },
    /// Run the app locally without Core Tools: the handler plus the timers
    ///
    /// A timer fires each function's schedule at the handler through the host's HTTP path.
    /// Settings come from the environment, then the app root's local.settings.json.
    Dev {
        #[command(flatten)]
        app_root: AppRoot,
        /// Port for the handler [default: any free port].
        #[arg(long)]
        port: Option<u16>,
    },
    /// Build the zip for zip deploy
    ///
    /// Validates every function (settings from the environment, then local.settings.json), then
    /// packs host.json, each function.json and this binary (executable), and says what it left out.
    Package {
        #[command(flatten)]
        app_root: AppRoot,
        /// The zip to write.
        #[arg(long, default_value = "app.zip")]
        out: PathBuf,
        /// The Linux binary to pack [default: this program].
        #[arg(long)]
        binary: Option<PathBuf>,
    },
    /// Show every poller's checkpoint, lag, lease and health; exit 1 when one is unhealthy
    ///
    /// Checkpoint, lag, lease, last success, attempts, quarantine, fingerprint, and every function
    /// that cannot run.
    Status {
        /// One JSON array on stdout (logs go to stderr).
        #[arg(long)]
        json: bool,
        /// Only this poller (its poller or function name).
        #[arg(long)]
        poller: Option<String>,
        #[command(flatten)]
        app_root: AppRoot,
    },
    /// Write a new function from a template, and print the app settings it needs
    ///
    /// Writes `<app root>/<function>/function.json` (host.json too when the app root has none), and
    /// `<app root>/function.schema.json`, the JSON Schema its `$schema` refers to for editors.
    New {
        function: String,
        /// webhook, queue, status or watchdog.
        #[arg(long)]
        template: String,
        /// KEY=VALUE inside the poller section (dotted: source.table=public.orders; `schedule` is
        /// the timer's). VALUE is JSON when it parses as JSON, else text.
        #[arg(long = "set")]
        sets: Vec<String>,
        #[command(flatten)]
        app_root: AppRoot,
    },
    /// Validate every function.json against the app settings, without a database or a store
    ///
    /// Settings from the environment, then local.settings.json: one line per problem, exit 1.
    Check {
        #[command(flatten)]
        app_root: AppRoot,
    },
    /// Print the DDL a poller's cursor needs, for a person to review and run
    ///
    /// On its engine: an xid column and its trigger, the stamp and privilege of `settle: "auto"`,
    /// the index. dbtrigger never runs it.
    Sql {
        poller: String,
        #[command(flatten)]
        app_root: AppRoot,
    },
    /// Print a poller's whole state document, as pretty JSON
    Inspect {
        poller: String,
        #[command(flatten)]
        app_root: AppRoot,
    },
    /// Move a poller's checkpoint: to the beginning, the end, a cursor, or a saved checkpoint
    ///
    /// After a cursor and key, or to a checkpoint from a file (as `inspect` prints it). Audited;
    /// refused while a tick holds the lease.
    Reset {
        poller: String,
        #[arg(long, group = "target")]
        to_beginning: bool,
        /// Skip everything the source holds now: after its last settled row (rows younger than
        /// settleSeconds are still delivered, since late commits may join them).
        #[arg(long, group = "target")]
        to_end: bool,
        /// A cursor value, read with the checkpoint's kind; give every key column with --pk.
        #[arg(long, group = "target")]
        to_cursor: Option<String>,
        /// COL=VALUE of a key column, with --to-cursor.
        #[arg(long, requires = "to_cursor")]
        pk: Vec<String>,
        #[arg(long, group = "target")]
        from_file: Option<PathBuf>,
        #[command(flatten)]
        guard: OpsGuardArgs,
        #[command(flatten)]
        app_root: AppRoot,
    },
    /// Start a new poller name at this poller's checkpoint (or at the beginning)
    ///
    /// A backfill or a migration on a separate name, while the original goes on.
    Clone {
        poller: String,
        new_poller: String,
        #[arg(long)]
        from_beginning: bool,
        #[command(flatten)]
        guard: GuardArgs,
        #[command(flatten)]
        app_root: AppRoot,
    },
    /// Accept an intended change of the source definition, keeping the checkpoint
    ///
    /// Records the new fingerprint in the state document. Audited.
    Fingerprint {
        #[command(subcommand)]
        action: FingerprintAction,
    },
    /// List, show, replay or purge the rows a poller isolated as poison
    Quarantine {
        #[command(subcommand)]
        action: QuarantineAction,
    },
    /// Print the JSON Schema of function.json, for editors to validate and complete with
    ///
    /// `new` writes it as `<app root>/function.schema.json`; `--markdown` prints the configuration
    /// reference (docs/configuration.md) instead.
    Schema {
        /// Print the configuration reference (docs/configuration.md) instead, as Markdown.
        #[arg(long)]
        markdown: bool,
    },
    /// Run the quickstart: a SQLite table, a file state store and a built-in receiver, no setup
    Demo {
        /// Rows in the sample table.
        #[arg(long, default_value_t = 5000)]
        rows: u32,
        /// Keep the demo's directory instead of deleting it at the end.
        #[arg(long)]
        keep: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum QuarantineAction {
    /// List every quarantined row: id, pk, cursor, status, attempts, error (the event with --json)
    List {
        poller: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        app_root: AppRoot,
    },
    /// Print one entry, whole
    Show {
        poller: String,
        id: String,
        #[command(flatten)]
        app_root: AppRoot,
    },
    /// Deliver entries through the poller's sink (same event ids), removing each once delivered
    Replay(ChosenEntries),
    /// Remove entries without delivering them
    Purge(ChosenEntries),
}

/// The quarantine entries a replay or a purge acts on, and its guardrails.
#[derive(Debug, clap::Args)]
pub struct ChosenEntries {
    poller: String,
    /// Entry ids (or --all).
    ids: Vec<String>,
    #[arg(long, conflicts_with = "ids")]
    all: bool,
    #[command(flatten)]
    guard: GuardArgs,
    #[command(flatten)]
    app_root: AppRoot,
}

#[derive(Debug, Subcommand)]
pub enum FingerprintAction {
    /// Record the source's current fingerprint, keeping the checkpoint
    Accept {
        poller: String,
        #[command(flatten)]
        guard: OpsGuardArgs,
        #[command(flatten)]
        app_root: AppRoot,
    },
}

/// The guardrails of a write to a state document.
#[derive(Debug, clap::Args)]
pub struct OpsGuardArgs {
    /// Show the document before and after, write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Go ahead without asking (required when not on a terminal).
    #[arg(long)]
    yes: bool,
    /// Write even while a tick holds the lease (its next write then fails).
    #[arg(long)]
    force: bool,
    /// Why, for the audit entry in the document's history.
    #[arg(long)]
    reason: Option<String>,
}

impl OpsGuardArgs {
    fn guard(&self) -> operator::Guard {
        operator::Guard { dry_run: self.dry_run, yes: self.yes, force: self.force, reason: self.reason.clone() }
    }
}

impl GuardArgs {
    fn guard(&self) -> operator::Guard {
        operator::Guard { dry_run: self.dry_run, yes: self.yes, force: false, reason: self.reason.clone() }
    }
}

/// The guardrails of a write.
#[derive(Debug, clap::Args)]
pub struct GuardArgs {
    /// Show what would be done, change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Go ahead without asking (required when not on a terminal).
    #[arg(long)]
    yes: bool,
    /// Why, for the audit entry in the document's history.
    #[arg(long)]
    reason: Option<String>,
}

impl Command {
    /// Operator commands log to stderr, so that what they print stays clean; the rest by
    /// severity (warnings and errors to stderr), as the Functions host expects (see `logging`).
    pub fn log_stream(&self) -> crate::logging::LogStream {
        if self.is_operator() { crate::logging::LogStream::Stderr } else { crate::logging::LogStream::BySeverity }
    }

    /// The operator commands: they answer on stdout, log on stderr, and only warnings and errors
    /// unless asked for more (one list for both decisions).
    fn is_operator(&self) -> bool {
        matches!(
            self,
            Command::Quarantine { .. }
                | Command::Package { .. }
                | Command::Inspect { .. }
                | Command::Sql { .. }
                | Command::Status { .. }
                | Command::New { .. }
                | Command::Check { .. }
                | Command::Schema { .. }
                | Command::Reset { .. }
                | Command::Clone { .. }
                | Command::Fingerprint { .. }
        )
    }
}

fn selection(ids: Vec<String>, all: bool) -> anyhow::Result<quarantine::Selection> {
    match (all, ids.is_empty()) {
        (true, _) => Ok(quarantine::Selection::All),
        (false, false) => Ok(quarantine::Selection::Names(ids)),
        (false, true) => bail!("name the entries to act on, or pass --all"),
    }
}

#[derive(Debug, clap::Args)]
pub struct AppRoot {
    /// The function app's root (host.json and one folder per function)
    /// [default: $FUNCTIONS_APP_ROOT_PATH, else the current directory].
    #[arg(long = "app-root", env = "FUNCTIONS_APP_ROOT_PATH")]
    pub path: Option<PathBuf>,
}

impl AppRoot {
    fn resolve(&self) -> anyhow::Result<PathBuf> {
        match &self.path {
            Some(path) => Ok(path.clone()),
            None => std::env::current_dir().context("cannot read the current directory"),
        }
    }
}

/// A warning at start-up for every poller whose database connection does not verify its server
/// (the same that `check` prints).
fn warn_unverified_connections(app: &App) {
    for (function, poller) in app.pollers() {
        if let Some(warning) = crate::config::tls::tls_warning(&poller.config.source) {
            tracing::warn!(function = %function, "{warning}");
        }
    }
}

pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve { app_root, port, bind, grace_seconds } => {
            let root = app_root.resolve()?;
            let settings = Settings::from_env();
            // Before the app opens its pollers: their sinks trace deliveries when it is on.
            crate::telemetry::install(|name| settings.get(name).map(str::to_string));
            let app = Arc::new(App::load(&root, &settings)?);
            warn_unverified_connections(&app);
            let address = SocketAddr::new(bind, port);
            let listener =
                tokio::net::TcpListener::bind(address).await.with_context(|| format!("cannot listen on {address}"))?;
            tracing::info!(%address, app_root = %root.display(), functions = ?app.function_names(), "dbtrigger handler listening");
            let under_host = settings.get("FUNCTIONS_CUSTOMHANDLER_WORKER_ID").is_some();
            serve::run(listener, app, std::time::Duration::from_secs(grace_seconds), under_host).await
        }
        Command::Tick { poller, force, app_root } => {
            let root = app_root.resolve()?;
            // From a shell, as `func start` and `dev` would: the environment, completed by the
            // app root's local.settings.json `Values`. `serve` reads its environment only (the
            // host passes the settings; in Azure there is no such file).
            let app = App::load(&root, &Settings::for_app_root(&root)?)?;
            if let Some(reason) = app.disabled(&poller)
                && !force
            {
                bail!("{poller} is disabled ({reason}); pass --force to tick it anyway");
            }
            if let Some(crate::app::Function::Status(_)) = app.function(&poller) {
                bail!("{poller} is a status function, not a poller: run `dbtrigger status`");
            }
            let invocation = match app.pollers().find(|(name, _)| name.eq_ignore_ascii_case(&poller)) {
                Some((_, found)) if std::io::stderr().is_terminal() => {
                    progress::while_running(found.clone(), app.invoke(&poller)).await
                }
                _ => app.invoke(&poller).await,
            };
            match invocation {
                Invocation::Unknown { .. } | Invocation::Unusable { .. } | Invocation::Answered { .. } => {
                    bail!("{} (app root {})", invocation.line(), root.display())
                }
                Invocation::Ticked { .. } | Invocation::Failed { .. } | Invocation::Abandoned { .. } => {
                    println!("{}", invocation.line());
                    Ok(if invocation.succeeded() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
                }
                // A watchdog run from the shell: its report, exit 1 when it found something.
                Invocation::Watched { findings, .. } => {
                    println!("{}", invocation.line());
                    Ok(if findings == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
                }
            }
        }
        Command::Dev { app_root, port } => dev::run(&app_root.resolve()?, port).await,
        Command::Package { app_root, out, binary } => package::run(&app_root.resolve()?, &out, binary.as_deref()),
        Command::Demo { rows, keep } => demo::run(rows, keep).await,
        Command::New { function, template, sets, app_root } => {
            scaffold::new(&app_root.resolve()?, &function, &template, &sets)
        }
        Command::Check { app_root } => {
            let app_root = app_root.resolve()?;
            let offline = scaffold::check(&app_root)?;
            // A change-stream source's server is asked what it still lacks (set-up is printed,
            // not run); the verdict comes after, one per poller.
            let missing = sql::check_live(&app_root).await?;
            Ok(offline.verdict(&missing))
        }
        Command::Schema { markdown } => {
            if markdown {
                print!("{}", crate::config::reference::configuration_markdown());
            } else {
                println!("{}", serde_json::to_string_pretty(&crate::config::schema::function_json_schema())?);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { json, poller, app_root } => status::run(&app_root.resolve()?, json, poller.as_deref()).await,
        Command::Inspect { poller, app_root } => ops::inspect(&app_root.resolve()?, &poller).await,
        Command::Sql { poller, app_root } => sql::run(&app_root.resolve()?, &poller),
        Command::Reset { poller, to_beginning, to_end, to_cursor, pk, from_file, guard, app_root } => {
            let to = match (to_beginning, to_end, to_cursor, from_file) {
                (true, false, None, None) => ops::ResetTo::Beginning,
                (false, true, None, None) => ops::ResetTo::End,
                (false, false, Some(value), None) => ops::ResetTo::Cursor { value, pk },
                (false, false, None, Some(path)) => ops::ResetTo::File(path),
                _ => {
                    bail!("say where to: --to-beginning, --to-end, --to-cursor VALUE --pk COL=VALUE, or --from-file F")
                }
            };
            ops::reset(&app_root.resolve()?, &poller, to, guard.guard()).await
        }
        Command::Clone { poller, new_poller, from_beginning, guard, app_root } => {
            ops::clone(&app_root.resolve()?, &poller, &new_poller, from_beginning, guard.guard()).await
        }
        Command::Fingerprint { action: FingerprintAction::Accept { poller, guard, app_root } } => {
            ops::accept_fingerprint(&app_root.resolve()?, &poller, guard.guard()).await
        }
        Command::Quarantine { action } => match action {
            QuarantineAction::List { poller, json, app_root } => {
                quarantine::list(&app_root.resolve()?, &poller, json).await
            }
            QuarantineAction::Show { poller, id, app_root } => {
                quarantine::show(&app_root.resolve()?, &poller, &id).await
            }
            QuarantineAction::Replay(chosen) => {
                let ChosenEntries { poller, ids, all, guard, app_root } = chosen;
                quarantine::replay(&app_root.resolve()?, &poller, selection(ids, all)?, guard.guard()).await
            }
            QuarantineAction::Purge(chosen) => {
                let ChosenEntries { poller, ids, all, guard, app_root } = chosen;
                quarantine::purge(&app_root.resolve()?, &poller, selection(ids, all)?, guard.guard()).await
            }
        },
    }
}

/// Completes at SIGINT or SIGTERM (the handlers are installed at once, see `serve::stop_signal`).
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    let stop = serve::stop_signal();
    async move {
        stop.await;
    }
}
