//! Integration tests, one binary (`cargo test --test it`). Real components only: SQLite files,
//! HTTP receivers on loopback, the real `dbtrigger` binary spoken to over the host's protocol.

mod azure;
mod budget;
mod chaos;
mod dev;
mod docs;
mod failing;
mod fleet;
mod generations;
mod harness;
mod horizon;
mod host;
mod host_rules;
mod late;
mod logical;
mod logical_ops;
mod matrix;
mod memory;
mod operations;
mod ops;
mod package;
mod poison;
mod quarantine;
mod queue;
mod scale_out;
mod schema;
mod security;
mod services;
mod simulation;
mod sources;
mod status;
mod store;
mod tick;
mod watchdog;
mod webhook;
mod wide_rows;
