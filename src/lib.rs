//! dbtrigger: a database trigger for Azure Functions, as a custom handler.
//!
//! dbtrigger is not a native database trigger: it is a pseudo trigger built on Azure Functions
//! timers. Delivery is at least once, so handlers must be idempotent.
//!
//! # Layout
//!
//! | module       | what it holds                                                                 |
//! |--------------|-------------------------------------------------------------------------------|
//! | [`domain`]   | the pure core: state, cursor order, lease, ids, window, schedule. No I/O.      |
//! | [`config`]   | function.json + app settings, parsed once into a validated `PollerConfig`.     |
//! | [`store`]    | `StateStore` (ETag compare-and-swap): Azure Blob, file, memory; conformance.   |
//! | [`storage`]  | Azure Storage connections and the Shared Key signing policy.                   |
//! | [`source`]   | `Source`: the keyset query over sqlx (PostgreSQL, MySQL/MariaDB, SQLite).     |
//! | [`sink`]     | `Sink`: webhook, Storage queue, and a recording sink for tests.                |
//! | [`tick`]     | one tick: the orchestrator that carries out the domain's decisions.            |
//! | [`app`]      | every function of the app, opened once into pollers.                           |
//! | [`handler`]  | the custom-handler HTTP server the Functions host calls.                       |
//! | [`cli`]      | `serve`, `tick`, `dev`, `demo`.                                                |
//! | [`logging`]  | logs to stdout, as the Functions host expects.                                 |
//!
//! The invariant everything serves: the checkpoint moves only after the sink acknowledged every row
//! up to it, and only by a compare-and-swap that also proves the lease is still ours. So a row is
//! delivered at least once, and a stale instance can never move the checkpoint.

pub mod app;
pub mod cli;
pub mod config;
pub mod domain;
pub mod handler;
pub mod logging;
pub mod sink;
pub mod source;
pub mod storage;
pub mod store;
pub mod tick;
