//! Scaffolding the benches share: one poller `orders` in a temporary app root with file state, its
//! catch-up timed over real ticks, the medians of the rounds, and the CPU a run took. Each bench
//! uses some of it.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use async_trait::async_trait;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::sink::{Batch, Sink, SinkError};
use dbtrigger::tick::{Poller, StopReason, TickOutcome};
use serde_json::{Value, json};

/// A whole number from the environment, or `default` when it is not set (or not a number).
pub fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|value| value.parse().ok()).unwrap_or(default)
}

pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The configuration of a poller `orders` with this poller section, written to an app root in a
/// temporary directory: its `DB` setting is `database_url`, its `STATE` a file store beside it.
/// The directory goes with the returned guard.
pub fn orders_config(poller: Value, database_url: &str) -> (tempfile::TempDir, PollerConfig) {
    let directory = tempfile::tempdir().unwrap();
    let root = directory.path().join("app");
    std::fs::create_dir_all(root.join("orders")).unwrap();
    let function = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 * * * * *"}],
        "poller": poller
    });
    std::fs::write(root.join("orders/function.json"), function.to_string()).unwrap();
    let state = format!("file:{}", directory.path().join("state").display());
    let settings = Settings::from_pairs([("DB", database_url), ("STATE", state.as_str())]);
    let config = PollerConfig::load(&root, "orders", &settings, None).unwrap();
    (directory, config)
}

/// Ticks until the poller has caught up: the rows delivered, and the seconds it took.
pub async fn catch_up(poller: &Poller) -> (usize, f64) {
    let started = Instant::now();
    let mut total = 0;
    loop {
        match poller.tick().await.unwrap() {
            TickOutcome::Delivered { rows, stop: StopReason::CaughtUp, .. } => {
                total += rows;
                break;
            }
            TickOutcome::Delivered { rows, .. } => total += rows,
            other => panic!("{other:?}"),
        }
    }
    (total as usize, started.elapsed().as_secs_f64())
}

/// Acknowledges every batch and counts its events. The tests' recording sink copies each batch
/// it keeps, work no real sink does and a raw path does not do: it is not what is measured here.
#[derive(Default)]
pub struct Acknowledging {
    pub events: AtomicUsize,
}

#[async_trait]
impl Sink for Acknowledging {
    async fn deliver(&self, batch: &Batch, _deadline: tokio::time::Instant) -> Result<(), SinkError> {
        self.events.fetch_add(batch.events.len(), Ordering::Relaxed);
        Ok(())
    }

    fn describe(&self) -> String {
        "acknowledging".to_string()
    }
}

/// CPU time (user + system) of this process so far, in microseconds: the dbtrigger side's alone
/// (the databases, Azurite and the receivers the benches talk to are other processes).
pub fn cpu_micros() -> u64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let micros = |time: libc::timeval| time.tv_sec as u64 * 1_000_000 + time.tv_usec as u64;
    micros(usage.ru_utime) + micros(usage.ru_stime)
}
