//! dbtrigger: a database trigger for Azure Functions, as a custom handler.
//!
//! dbtrigger is not a native database trigger: it is a pseudo trigger built on Azure Functions
//! timers. Delivery is at least once, so handlers must be idempotent.
//!
//! # Layout
//!
//! | module       | what it holds                                                                 |
//! |--------------|-------------------------------------------------------------------------------|
//! | [`domain`]   | the pure core: state, cursor order, lease, events, ids, window, schedule.      |
//! | [`settings`] | app settings (environment, local.settings.json) and `%NAME%` values.           |
//! | [`clock`]    | `Clock`: where `now` comes from, for the tick and the operator commands alike. |
//! | [`config`]   | function.json, one file a section, parsed once into a validated `PollerConfig`.|
//! | [`store`]    | `BlobStore` (get/put/list/delete, ETag CAS): Azure Blob, file; state documents.|
//! | [`azure`]    | Azure Storage clients from a validated connection; Shared Key signing.         |
//! | [`source`]   | `Source`: keyset queries (sqlx, rusqlite), a PostgreSQL slot, a binary log     |
//! | [`sink`]     | `Sink`: webhook and Storage queue (a recording sink for tests).                |
//! | [`status`]   | what `status` reads of each poller (state, lag), for the CLI and the app; the page.|
//! | [`tick`]     | one tick: the orchestrator that carries out the domain's decisions.            |
//! | [`watchdog`] | the watchdog function's run: judge every poller, remember, report, alert.    |
//! | [`telemetry`]| metrics and a span per tick to Application Insights / OTLP, when set.        |
//! | [`operations`]| operator commands as library code: plan (pure), apply by CAS; quarantine.   |
//! | [`app`]      | every function of the app, and `App::invoke`, the one way to run one.          |
//! | [`protocol`] | what the Functions host posts: the invocation envelope, timer and HTTP data.   |
//! | [`handler`]  | the custom-handler HTTP server the Functions host calls.                       |
//! | [`cli`]      | `serve`, `tick`, `dev`, `demo`, `package`, `new`, `check`, `schema`, operators.|
//! | [`logging`]  | logs by severity: warnings and errors to stderr, the rest to stdout (the host).|
//!
//! Dependencies point one way: `domain`, `settings` and `clock` import nothing of the crate; `config`
//! imports them; the adapters (`store`, `azure`, `source`, `sink`) read config's plain types; `tick`
//! drives the adapters; `operations` drives them for an operator; `app`, `handler` and `cli` sit on
//! top. No two modules import each other.
//!
//! The invariant everything serves: the checkpoint moves only after the sink acknowledged every row
//! up to it, and only by a compare-and-swap that also proves the lease is still ours. So a row is
//! delivered at least once, and a stale instance can never move the checkpoint.

pub mod app;
pub mod azure;
pub mod cli;
pub mod clock;
pub mod config;
pub mod domain;
pub mod handler;
pub mod logging;
pub mod operations;
pub mod protocol;
pub mod settings;
pub mod sink;
pub mod source;
pub mod status;
pub mod store;
pub mod telemetry;
pub mod tick;
pub mod watchdog;
