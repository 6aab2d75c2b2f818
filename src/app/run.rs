//! One tick run by the app, stopped (and its lease given back) when the app abandons its ticks.

use super::{App, Invocation};
use crate::tick::Poller;

impl App {
    /// after this. For the end of a shutdown's grace period.
    pub fn abandon_ticks(&self) {
        self.abandon.send_replace(true);
    }

    /// One tick of `poller`, with its summary; stopped (and its lease given back) when the
    /// process abandons its ticks.
    pub(super) async fn tick(&self, poller: &Poller) -> Invocation {
        let poller_name = poller.config.poller_name.clone();
        let mut abandon = self.abandon.subscribe();
        if *abandon.borrow_and_update() {
            return Invocation::Abandoned { poller: poller_name, lease_released: false };
        }
        tokio::select! {
            ticked = poller.tick_reported() => {
                let (result, report) = ticked;
                crate::telemetry::record_tick(poller, result.as_ref(), &report);
                match result {
                    Ok(outcome) => Invocation::Ticked { poller: poller_name, outcome, report },
                    Err(error) => Invocation::Failed { poller: poller_name, error, report },
                }
            },
            () = abandoned(&mut abandon) => {
                // The tick's future is dropped here, at whatever await it was: nothing it
                // delivered after its last commit is committed, so nothing is lost.
                let lease_released = release_abandoned_lease(poller).await;
                Invocation::Abandoned { poller: poller_name, lease_released }
            }
        }
    }
}

/// Completes once the app abandons its ticks (never, if the app is dropped first).
async fn abandoned(abandon: &mut tokio::sync::watch::Receiver<bool>) {
    // The borrowed value is not held across an await: the handler's future must stay `Send`.
    if abandon.wait_for(|abandoned| *abandoned).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// After a tick was dropped: read its document again and give the lease back by compare-and-swap
/// if this process still holds it. `false` when it could not (the lease then expires by itself).
async fn release_abandoned_lease(poller: &Poller) -> bool {
    let key = poller.key();
    let Ok(Some(versioned)) = poller.store.read(&key).await else {
        return false;
    };
    let now = poller.clock.now();
    let Ok(released) = crate::domain::transitions::release(&versioned.document, &poller.owner_id, now) else {
        return false;
    };
    poller.store.write(&key, &released, crate::store::WriteCondition::Matches(versioned.etag)).await.is_ok()
}
