//! `status`: reads what the pure [`crate::domain::health`] decides from. For each poller: its
//! state document (one blob read), and from its source the rows after the checkpoint, counted up
//! to [`LAG_CAP`] so that the question stays cheap on a deep backlog, and the first of them. Used
//! by `dbtrigger status` and by the app's `status` HTTP function alike.

use chrono::{DateTime, Utc};

use crate::domain::health::{self, Lag, Observed, PollerHealth};
use crate::tick::Poller;

/// Lag is counted up to this many rows ("at least 1,000,000" beyond).
pub const LAG_CAP: u64 = 1_000_000;

/// The status of one poller at `now`.
pub async fn of_poller(function: &str, poller: &Poller, now: DateTime<Utc>) -> PollerHealth {
    let config = &poller.config;
    let read = poller.store.read(&poller.key()).await;
    let document = match &read {
        Ok(found) => Ok(found.as_ref().map(|versioned| &versioned.document)),
        Err(error) => Err(error.to_string()),
    };
    let lag = match &document {
        Ok(document) => {
            let position = match document.map(|document| document.position()) {
                Some(Ok(position)) => Ok(position),
                Some(Err(error)) => Err(error.to_string()),
                None => Ok(None),
            };
            // A checkpoint of another key (the key changed) cannot be counted from: say so.
            let position = match position {
                Ok(Some(position)) => match position.fits_key(&config.source.pk) {
                    Ok(()) => Ok(Some(position)),
                    Err(mismatch) => Err(mismatch.to_string()),
                },
                other => other,
            };
            match position {
                Ok(position) => Some(
                    crate::source::backlog(poller.source.as_ref(), position.as_ref(), LAG_CAP)
                        .await
                        .map(|backlog| Lag { rows: backlog.rows, capped: backlog.capped, oldest: backlog.oldest })
                        .map_err(|error| error.to_string()),
                ),
                Err(reason) => Some(Err(reason)),
            }
        }
        // The checkpoint is unknown: nothing to count from.
        Err(_) => None,
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
            lag,
            fingerprint: &config.fingerprint,
            earlier_fingerprint: config.legacy_fingerprint.as_deref(),
            terms: &config.lease,
            naive_cursors_are_utc: zone_is_utc(&config.source.cursor_time_zone),
            generation,
            generation_stops,
            horizon_holder,
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
