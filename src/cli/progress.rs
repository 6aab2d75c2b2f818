//! Progress of a long catch-up, for a person at a terminal: every two seconds, on stderr, the rows
//! committed so far, the rate, and the rows left (counted once at the start, up to a cap).

use std::future::Future;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tick::Poller;

const LEFT_CAP: u64 = 10_000_000;

/// Runs `work` (a tick of `poller`) and reports its progress while it runs.
pub async fn while_running<T>(poller: Arc<Poller>, work: impl Future<Output = T>) -> T {
    let started = Instant::now();
    let before = poller.committed_rows();
    let reporter = {
        let poller = poller.clone();
        tokio::spawn(async move {
            let position = match poller.store.read(&poller.key()).await {
                Ok(Some(versioned)) => versioned.document.position().ok().flatten(),
                _ => None,
            };
            let total = poller.source.count_after(position.as_ref(), LEFT_CAP).await.ok();
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                let done = poller.committed_rows() - before;
                let rate = done as f64 / started.elapsed().as_secs_f64().max(0.001);
                let left = match total {
                    Some(total) if total >= LEFT_CAP => format!("≥ {} left", total.saturating_sub(done)),
                    Some(total) => format!("{} left", total.saturating_sub(done)),
                    None => "left unknown".to_string(),
                };
                eprint!("\r{done} rows delivered, {rate:.0} rows/s, {left}   ");
                let _ = std::io::stderr().flush();
            }
        })
    };
    let result = work.await;
    reporter.abort();
    if started.elapsed() >= Duration::from_secs(2) {
        eprintln!();
    }
    result
}
