//! Integration tests, one binary (`cargo test --test it`). Real components only: SQLite files,
//! HTTP receivers on loopback, the real `dbtrigger` binary spoken to over the host's protocol.

mod azure;
mod chaos;
mod dev;
mod generations;
mod harness;
mod host;
mod matrix;
mod memory;
mod ops;
mod package;
mod poison;
mod queue;
mod services;
mod simulation;
mod sources;
mod status;
mod store;
mod tick;
mod watchdog;
mod webhook;
