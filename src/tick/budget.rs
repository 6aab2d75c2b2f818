//! The app-wide budget of bytes in flight: what the batches of every poller of the app hold
//! together, read and not yet delivered (app setting `DBTRIGGER_MAX_BYTES_IN_FLIGHT`, default
//! [`DEFAULT_BYTES`]). The host may invoke a hundred pollers at once; each read first reserves
//! its batch's byte limit (`batch.maxBytes`, or the whole budget if that is less), keeps what its
//! rows turned out to weigh once read, and gives that back when the batch is delivered (or given
//! up). A read that finds the budget spent waits: that is not a failure, and the tick's summary
//! line says how long it waited.
//!
//! Counted in KiB, so that one reservation of up to 4 TiB fits the semaphore's `u32`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::Settings;

/// The app setting that sets the budget, in bytes.
pub const SETTING: &str = "DBTRIGGER_MAX_BYTES_IN_FLIGHT";
/// 256 MiB: a sixth of the smallest Consumption instance's 1.5 GB.
pub const DEFAULT_BYTES: u64 = 256 * 1024 * 1024;
/// The least budget accepted: one KiB-sized batch.
const MIN_BYTES: u64 = 64 * 1024;
const KIB: u64 = 1024;

/// The budget of one app, shared by its pollers.
pub struct BytesBudget {
    permits: Arc<Semaphore>,
    total_kib: u64,
    /// How long reads waited for it, in all, since the start (for measurements).
    waited_micros: AtomicU64,
}

/// Bytes reserved for one batch: given back when dropped.
#[derive(Debug, Default)]
pub struct Hold(Option<OwnedSemaphorePermit>);

impl BytesBudget {
    pub fn new(bytes: u64) -> Arc<BytesBudget> {
        let total_kib = bytes.max(MIN_BYTES) / KIB;
        Arc::new(BytesBudget {
            permits: Arc::new(Semaphore::new(total_kib as usize)),
            total_kib,
            waited_micros: AtomicU64::new(0),
        })
    }

    /// The budget the app settings ask for, or why the setting cannot be read.
    pub fn from_settings(settings: &Settings) -> Result<Arc<BytesBudget>, String> {
        let Some(text) = settings.get(SETTING).map(str::trim).filter(|text| !text.is_empty()) else {
            return Ok(BytesBudget::new(DEFAULT_BYTES));
        };
        match text.parse::<u64>() {
            Ok(bytes) if (MIN_BYTES..=KIB * u64::from(u32::MAX)).contains(&bytes) => Ok(BytesBudget::new(bytes)),
            _ => Err(format!(
                "app setting {SETTING} is {text:?}: expected a number of bytes from {MIN_BYTES} to {}",
                KIB * u64::from(u32::MAX)
            )),
        }
    }

    pub fn total_bytes(&self) -> u64 {
        self.total_kib * KIB
    }

    /// Bytes not reserved right now.
    pub fn available_bytes(&self) -> u64 {
        self.permits.available_permits() as u64 * KIB
    }

    /// Reserves `bytes` (at most the whole budget), waiting while the budget is spent; returns
    /// the hold and how long it waited.
    pub async fn reserve(&self, bytes: usize) -> (Hold, Duration) {
        let kib = kib_of(bytes).clamp(1, self.total_kib);
        if let Ok(permit) = self.permits.clone().try_acquire_many_owned(kib as u32) {
            return (Hold(Some(permit)), Duration::ZERO);
        }
        let started = Instant::now();
        let permit = self.permits.clone().acquire_many_owned(kib as u32).await.ok();
        let waited = started.elapsed();
        self.waited_micros.fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
        (Hold(permit), waited)
    }

    /// How long reads waited for the budget, in all.
    pub fn waited(&self) -> Duration {
        Duration::from_micros(self.waited_micros.load(Ordering::Relaxed))
    }
}

/// A poller's way to the budget: reserves (when the app has one) and adds up the waits.
#[derive(Clone)]
pub(crate) struct Reservations {
    pub(crate) budget: Option<Arc<BytesBudget>>,
    /// Microseconds waited by the running tick's reads.
    pub(crate) waited: Arc<AtomicU64>,
}

impl Reservations {
    pub(crate) async fn reserve(&self, bytes: usize) -> Hold {
        let Some(budget) = &self.budget else {
            return Hold::default();
        };
        let (hold, waited) = budget.reserve(bytes).await;
        self.waited.fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
        hold
    }
}

/// What rows weigh as JSON (their events weigh a little more: the head of each).
pub(crate) fn rows_bytes(rows: &[crate::source::SourceRow]) -> usize {
    rows.iter().map(|row| row.row.len() + 128).sum()
}

impl Hold {
    /// Keeps `bytes` of the reservation (at least 1 KiB), giving the rest back.
    pub fn keep(&mut self, bytes: usize) {
        let Some(permit) = self.0.as_mut() else {
            return;
        };
        let keep = kib_of(bytes).max(1) as usize;
        if permit.num_permits() > keep {
            drop(permit.split(permit.num_permits() - keep));
        }
    }

    /// Bytes held (in whole KiB).
    pub fn bytes(&self) -> u64 {
        self.0.as_ref().map(|permit| permit.num_permits() as u64 * KIB).unwrap_or(0)
    }
}

fn kib_of(bytes: usize) -> u64 {
    (bytes as u64).div_ceil(KIB)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reservation waits while the budget is spent, and goes on once a hold is given back; a
    /// hold keeps what its batch weighs and gives back the rest at once.
    #[tokio::test]
    async fn reads_wait_for_the_budget_and_holds_give_back_what_they_do_not_use() {
        let budget = BytesBudget::new(1024 * 1024);
        let (mut first, waited) = budget.reserve(800 * 1024).await;
        assert_eq!(waited, Duration::ZERO);
        assert_eq!(budget.available_bytes(), 224 * 1024);
        first.keep(100 * 1024 + 1);
        assert_eq!(first.bytes(), 101 * 1024);
        assert_eq!(budget.available_bytes(), 923 * 1024);
        // More than the whole budget is the whole budget: it waits for `first`.
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(10 * 1024 * 1024).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished());
        drop(first);
        let (whole, waited) = waiting.await.unwrap();
        assert_eq!(whole.bytes(), 1024 * 1024);
        assert!(waited >= Duration::from_millis(40), "{waited:?}");
        assert_eq!(budget.available_bytes(), 0);
        drop(whole);
        assert_eq!(budget.available_bytes(), 1024 * 1024);
    }

    #[test]
    fn the_setting_is_read_or_refused_with_its_name() {
        let settings = Settings::from_pairs([(SETTING, "1048576")]);
        assert_eq!(BytesBudget::from_settings(&settings).unwrap().total_bytes(), 1024 * 1024);
        assert_eq!(BytesBudget::from_settings(&Settings::default()).unwrap().total_bytes(), DEFAULT_BYTES);
        for bad in ["lots", "12", "-5"] {
            let error = BytesBudget::from_settings(&Settings::from_pairs([(SETTING, bad)])).err().unwrap();
            assert!(error.contains(SETTING) && error.contains(bad), "{error}");
        }
    }
}
