//! `status`: reads what the pure [`crate::domain::health`] decides from. For each poller: its
//! state document (one blob read), and from its source the rows after the checkpoint, counted up
//! to [`LAG_CAP`] so that the question stays cheap on a deep backlog, and the first of them. Used
//! by `dbtrigger status` and by the app's `status` HTTP function alike; [`page`] is the function's
//! page for a browser.

pub mod page;

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::domain::health::{self, Lag, Observed, PollerHealth};
use crate::domain::horizon::{Audience, HorizonHolder};
use crate::tick::Poller;

/// Lag is counted up to this many rows ("at least 1,000,000" beyond).
pub const LAG_CAP: u64 = 1_000_000;

/// How long the status function reuses what it read from a poller's source (the capped count,
/// the first pending row, the generation) while the checkpoint stays where it was.
pub const SOURCE_READS_REUSED_FOR: Duration = Duration::from_secs(5);

/// What a status reads from the source, beside the state document.
#[derive(Debug, Clone, PartialEq)]
pub struct FromSource {
    /// `None` when the checkpoint is unknown (the document could not be read).
    pub lag: Option<Result<Lag, String>>,
    pub generation: Result<Option<Value>, String>,
    /// While rows wait behind a commit horizon or a `settle: "auto"` bound: the oldest open
    /// transaction (the status function may show it up to [`SOURCE_READS_REUSED_FOR`] old).
    pub horizon_holder: Option<HorizonHolder>,
    /// A logical source's replication slot (`None`: not one, or it could not be read).
    pub slot: Option<crate::domain::slot::SlotView>,
}

/// The source reads of each poller, reused for a while: a capped count is up to a million rows
/// scanned, and whoever holds a function key may ask as often as they like. Each poller has one
/// slot, locked while its source is read, so that requests arriving together wait for one read
/// instead of each starting its own; a poller's ticks then never compete with more than one
/// status count at a time, and with at most one every [`SOURCE_READS_REUSED_FOR`].
pub struct SourceReadCache {
    reused_for: Duration,
    slots: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<Cached>>>>>,
}

struct Cached {
    /// The checkpoint the reads were made from: a commit since makes them stale at once.
    checkpoint: String,
    read_at: Instant,
    reads: FromSource,
}

impl SourceReadCache {
    pub fn new(reused_for: Duration) -> Self {
        SourceReadCache { reused_for, slots: Mutex::new(HashMap::new()) }
    }

    /// What `read` gives for `poller` at `checkpoint`, or what it gave less than `reused_for`
    /// before `now` at the same checkpoint.
    pub async fn get_or_read<F, Fut>(&self, poller: &str, checkpoint: &str, now: Instant, read: F) -> FromSource
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = FromSource>,
    {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|poison| poison.into_inner());
            slots.entry(poller.to_string()).or_default().clone()
        };
        let mut cached = slot.lock().await;
        if let Some(fresh) = cached.as_ref().filter(|cached| {
            cached.checkpoint == checkpoint && now.saturating_duration_since(cached.read_at) < self.reused_for
        }) {
            return fresh.reads.clone();
        }
        let reads = read().await;
        *cached = Some(Cached { checkpoint: checkpoint.to_string(), read_at: now, reads: reads.clone() });
        reads
    }
}

/// The cache of the app's status function: one per process (each poller is keyed by its app,
/// name and fingerprint, so two apps or a changed definition never share an entry).
static STATUS_FUNCTION_READS: LazyLock<SourceReadCache> =
    LazyLock::new(|| SourceReadCache::new(SOURCE_READS_REUSED_FOR));

/// The status of one poller at `now`, its source read afresh, as published (the watchdog: no
/// other session's query text, see [`Audience`]).
pub async fn of_poller(function: &str, poller: &Poller, now: DateTime<Utc>) -> PollerHealth {
    observe(function, poller, now, None, Audience::Published, Count::Always).await
}

/// The status of one poller at `now` for `audience`, its source reads reused for
/// [`SOURCE_READS_REUSED_FOR`] (the status function is reachable by anyone holding a function
/// key; `dbtrigger status` is an operator's).
pub async fn of_poller_cached(function: &str, poller: &Poller, now: DateTime<Utc>, audience: Audience) -> PollerHealth {
    observe(function, poller, now, Some(&STATUS_FUNCTION_READS), audience, Count::Always).await
}

/// What telemetry's sampler reads at every export interval: as [`of_poller_cached`], but a
/// change stream's lag is not counted (a count makes the server decode a copy of the slot from
/// its restart position, or reads the binary log: too heavy for every interval). Its retention (the
/// slot's bytes, the binary log behind) is read as always.
pub async fn of_poller_sampled(function: &str, poller: &Poller, now: DateTime<Utc>) -> PollerHealth {
    observe(function, poller, now, Some(&STATUS_FUNCTION_READS), Audience::Published, Count::NotChangeStreams).await
}

/// Whether a status read counts the rows waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Count {
    Always,
    NotChangeStreams,
}

async fn observe(
    function: &str,
    poller: &Poller,
    now: DateTime<Utc>,
    cache: Option<&SourceReadCache>,
    audience: Audience,
    count: Count,
) -> PollerHealth {
    let counted = count == Count::Always || !poller.config.source.target.is_change_stream();
    let config = &poller.config;
    let read = poller.store.read(&poller.key()).await;
    let document = match &read {
        Ok(found) => Ok(found.as_ref().map(|versioned| &versioned.document)),
        Err(error) => Err(error.to_string()),
    };
    // The checkpoint the count starts from (`Err`: the document cannot say; `None` inside: none
    // is known, the whole source waits).
    let position = match &document {
        Ok(document) => match document.map(|document| document.position()) {
            // A checkpoint of another key (the key changed) cannot be counted from: say so.
            Some(Ok(Some(position))) => match crate::source::fits_source_key(&config.source, &position) {
                Ok(()) => Some(Ok(Some(position))),
                Err(mismatch) => Some(Err(mismatch.to_string())),
            },
            Some(Ok(None)) => Some(Ok(None)),
            Some(Err(error)) => Some(Err(error.to_string())),
            None => Some(Ok(None)),
        },
        // The checkpoint is unknown: nothing to count from.
        Err(_) => None,
    };
    let read_source = || async {
        let lag = match &position {
            Some(Ok(_)) if !counted => None,
            Some(Ok(position)) => Some(
                crate::source::backlog(poller.source.as_ref(), position.as_ref(), LAG_CAP)
                    .await
                    .map(|backlog| Lag { rows: backlog.rows, capped: backlog.capped, oldest: backlog.oldest })
                    .map_err(|error| error.to_string()),
            ),
            Some(Err(reason)) => Some(Err(reason.clone())),
            None => None,
        };
        let generation = poller.source.generation().await.map_err(|error| error.to_string());
        // Only while rows wait: what holds them back (the question reads the server's sessions).
        let rows_wait = matches!(&lag, Some(Ok(lag)) if lag.rows > 0);
        let horizon_holder = if rows_wait {
            match poller.source.horizon_holder().await {
                Ok(holder) => holder,
                Err(error) => {
                    tracing::warn!(poller = %config.poller_name, %error, "what holds the horizon back could not be read");
                    None
                }
            }
        } else {
            None
        };
        let slot = match poller.source.slot().await {
            Ok(slot) => slot,
            Err(error) => {
                tracing::warn!(poller = %config.poller_name, %error, "the replication slot could not be read");
                None
            }
        };
        FromSource { lag, generation, horizon_holder, slot }
    };
    let from_source = match cache {
        None => read_source().await,
        Some(cache) => {
            let uncounted = if counted { "" } else { "/uncounted" };
            let key = format!("{}/{}/{}{uncounted}", config.app_name, config.poller_name, config.fingerprint);
            let checkpoint = match &position {
                Some(Ok(Some(position))) => format!("{position:?}"),
                Some(Ok(None)) => "start".to_string(),
                Some(Err(reason)) => format!("unreadable: {reason}"),
                None => "unknown".to_string(),
            };
            cache.get_or_read(&key, &checkpoint, Instant::now(), read_source).await
        }
    };
    let generation_stops = config
        .source
        .generation
        .as_ref()
        .is_some_and(|generation| generation.on_change == crate::config::OnGenerationChange::Stop);
    health::assess(
        Observed {
            function,
            poller: &config.poller_name,
            document,
            lag: from_source.lag,
            fingerprint: &config.fingerprint,
            earlier_fingerprint: config.legacy_fingerprint.as_deref(),
            terms: &config.lease,
            naive_cursors_are_utc: zone_is_utc(&config.source.cursor_time_zone),
            generation: from_source.generation,
            generation_stops,
            horizon_holder: from_source.horizon_holder,
            audience,
            slot: from_source.slot,
        },
        now,
    )
}

/// Whether a `cursorTimeZone` names UTC, however it is spelled (`UTC`, `Etc/UTC`, `+00:00`, …):
/// the age of the oldest pending naive timestamp is then known.
pub fn zone_is_utc(zone: &str) -> bool {
    let zone = zone.trim();
    const NAMES: [&str; 10] =
        ["UTC", "Etc/UTC", "Z", "Zulu", "Etc/Zulu", "UCT", "Etc/UCT", "Universal", "Etc/Universal", "GMT"];
    if NAMES.iter().any(|name| name.eq_ignore_ascii_case(zone)) || zone.eq_ignore_ascii_case("Etc/GMT") {
        return true;
    }
    // An offset of zero: +00:00, -00:00, +0000, +00.
    let digits = match zone.strip_prefix('+').or_else(|| zone.strip_prefix('-')) {
        Some(rest) => rest.replace(':', ""),
        None => return false,
    };
    !digits.is_empty() && digits.len() <= 4 && digits.chars().all(|digit| digit == '0')
}

/// A lag for people: `1,234` or `≥ 1,000,000`, `?` when unknown.
pub fn lag_text(health: &PollerHealth) -> String {
    match health.lag_rows {
        None => "?".to_string(),
        Some(rows) if health.lag_capped => format!("≥ {}", thousands(rows)),
        Some(rows) => thousands(rows),
    }
}

fn thousands(number: u64) -> String {
    let digits = number.to_string();
    let mut out = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reads(rows: u64) -> FromSource {
        FromSource {
            lag: Some(Ok(Lag { rows, capped: false, oldest: None })),
            generation: Ok(None),
            horizon_holder: None,
            slot: None,
        }
    }

    /// Regression (issue 30, item 9): the status function's source reads (a capped count of up to
    /// a million rows) are made once per poller for a few seconds, however many requests arrive,
    /// together or one after another; a new checkpoint or the end of the window reads again.
    #[tokio::test]
    async fn status_requests_share_one_source_read_per_poller_for_a_few_seconds() {
        let cache = SourceReadCache::new(Duration::from_secs(5));
        let counts = std::sync::atomic::AtomicU64::new(0);
        let start = Instant::now();
        let read = || async {
            let count = counts.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            tokio::task::yield_now().await;
            reads(count)
        };
        let together: Vec<FromSource> =
            futures::future::join_all((0..10).map(|_| cache.get_or_read("app/orders/f", "c1", start, read))).await;
        assert!(together.iter().all(|answer| *answer == reads(1)), "ten requests at once, one read: {together:?}");
        let later = cache.get_or_read("app/orders/f", "c1", start + Duration::from_secs(4), read).await;
        assert_eq!(later, reads(1), "within the window: reused");
        assert_eq!(counts.load(std::sync::atomic::Ordering::SeqCst), 1);

        let other_poller = cache.get_or_read("app/shipments/f", "c1", start, read).await;
        assert_eq!(other_poller, reads(2), "each poller has its own");
        let moved = cache.get_or_read("app/orders/f", "c2", start + Duration::from_secs(4), read).await;
        assert_eq!(moved, reads(3), "a new checkpoint reads again");
        let expired = cache.get_or_read("app/orders/f", "c2", start + Duration::from_secs(9), read).await;
        assert_eq!(expired, reads(4), "after the window: read again");
    }

    #[test]
    fn big_numbers_get_thousands_separators() {
        assert_eq!(super::thousands(0), "0");
        assert_eq!(super::thousands(999), "999");
        assert_eq!(super::thousands(1_000_000), "1,000,000");
        assert_eq!(super::thousands(12_345), "12,345");
    }

    /// Regression (issue 24, item 15): the age of the oldest pending naive timestamp is known for
    /// every spelling of UTC, not only `UTC`.
    #[test]
    fn every_spelling_of_utc_is_utc() {
        for zone in ["UTC", "utc", "Etc/UTC", "+00:00", "-00:00", "+0000", "+00", "Z", "Etc/GMT", "GMT"] {
            assert!(super::zone_is_utc(zone), "{zone}");
        }
        for zone in ["Europe/Paris", "+01:00", "-05:00", "+00:30", "", "+", "Etc/GMT+1"] {
            assert!(!super::zone_is_utc(zone), "{zone}");
        }
    }
}
