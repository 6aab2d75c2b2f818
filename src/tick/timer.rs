//! The loops' runtime timer, kept across their turns, and the sink's deadline in the runtime's
//! terms. `now` itself comes from the injected [`Clock`](crate::clock::Clock).

use std::pin::Pin;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::{Instant, Sleep};

/// A timer kept across the turns of a loop, instead of one registered and dropped on every turn:
/// set again only when its deadline moves by more than a millisecond.
pub(super) struct Timer {
    sleep: Pin<Box<Sleep>>,
}

impl Timer {
    pub(super) fn new() -> Timer {
        Timer { sleep: Box::pin(tokio::time::sleep(Duration::MAX)) }
    }

    /// Goes off `wait` from now (up to a millisecond early, if it was set that close; a wait
    /// beyond a day is a day: the loop turns well before that).
    pub(super) fn set(&mut self, wait: Duration) {
        let deadline = Instant::now() + wait.min(Duration::from_secs(86_400));
        let current = self.sleep.deadline();
        if deadline.max(current) - deadline.min(current) > Duration::from_millis(1) {
            self.sleep.as_mut().reset(deadline);
        }
    }

    /// Ends when the timer goes off (at once if it has, until it is set later again).
    pub(super) async fn wait(&mut self) {
        self.sleep.as_mut().await;
    }
}

/// The sink's deadline in its runtime's terms: the time left until `deadline` by `now`.
pub(super) fn runtime_deadline(deadline: DateTime<Utc>, now: DateTime<Utc>) -> Instant {
    Instant::now() + (deadline - now).to_std().unwrap_or(Duration::ZERO)
}
