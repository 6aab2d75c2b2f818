//! What the status page draws beside each poller: its lag over the last hours, and the watchdog's
//! findings at its last run. Both are kept in the watchdog's memory document (never a store of
//! their own), bounded: a point at most every [`SAMPLE_EVERY`], none older than [`KEPT_FOR`], at
//! most [`MAX_POINTS`]. A quiet poller adds no point while its lag stays what it was (for up to
//! [`REPEAT_AFTER`]), so that a quiet app's watchdog still writes its memory rarely.

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};

/// The span of time a series covers.
pub const KEPT_FOR: Duration = Duration::hours(6);
/// The least time between two points.
pub const SAMPLE_EVERY: Duration = Duration::minutes(5);
/// An unchanged lag is recorded again after this long (the chart's line then stays level).
pub const REPEAT_AFTER: Duration = Duration::minutes(30);
/// The most points a series holds (6 hours at one every 5 minutes).
pub const MAX_POINTS: usize = 72;

/// One sample of a poller's lag, as the watchdog's status read it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LagPoint {
    pub at: DateTime<Utc>,
    /// Rows after the checkpoint (counted up to the status cap); `None` when they could not be.
    pub rows: Option<u64>,
    /// The oldest pending row's age, for timestamp cursors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_seconds: Option<f64>,
}

/// A poller's lag over the last [`KEPT_FOR`], oldest first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LagSeries {
    #[serde(default)]
    pub points: Vec<LagPoint>,
}

impl LagSeries {
    /// Adds `point` (taken at `point.at`, the watchdog's now) when the rules above allow, and drops
    /// what has grown too old or too many. Points are kept in time order: one older than the
    /// newest kept is ignored (a clock that went back).
    pub fn record(&mut self, point: LagPoint) {
        let now = point.at;
        let keep = match self.points.last() {
            None => true,
            Some(last) if point.at <= last.at => false,
            Some(last) => {
                let since = point.at - last.at;
                since >= SAMPLE_EVERY && (last.rows != point.rows || since >= REPEAT_AFTER)
            }
        };
        if keep {
            self.points.push(point);
        }
        self.points.retain(|kept| now - kept.at <= KEPT_FOR);
        if self.points.len() > MAX_POINTS {
            let excess = self.points.len() - MAX_POINTS;
            self.points.drain(..excess);
        }
    }
}

/// A watchdog finding as the status page shows it (what the watchdog logged at error level).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FindingNote {
    pub kind: String,
    pub function: String,
    pub poller: String,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(minutes: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap() + Duration::minutes(minutes)
    }

    fn point(minutes: i64, rows: u64) -> LagPoint {
        LagPoint { at: at(minutes), rows: Some(rows), age_seconds: None }
    }

    #[test]
    fn a_series_stays_bounded_in_time_and_count_however_long_it_runs() {
        let mut series = LagSeries::default();
        // A watchdog every minute for two days, the lag changing every time.
        for minute in 0..(48 * 60) {
            series.record(point(minute, minute as u64));
            assert!(series.points.len() <= MAX_POINTS);
            let newest = series.points.last().unwrap().at;
            assert!(series.points.iter().all(|kept| newest - kept.at <= KEPT_FOR));
            assert!(series.points.windows(2).all(|pair| pair[1].at - pair[0].at >= SAMPLE_EVERY));
        }
        assert_eq!(series.points.len(), MAX_POINTS);
    }

    #[test]
    fn an_unchanged_lag_is_recorded_again_only_after_a_while() {
        let mut series = LagSeries::default();
        series.record(point(0, 0));
        for minute in 1..30 {
            series.record(point(minute, 0));
        }
        assert_eq!(series.points.len(), 1, "a quiet poller adds no point (its memory is not rewritten)");
        series.record(point(30, 0));
        assert_eq!(series.points.len(), 2);
        series.record(point(35, 7));
        assert_eq!(series.points.len(), 3, "a change after five minutes is a point");
        series.record(point(34, 9));
        assert_eq!(series.points.len(), 3, "a clock that went back adds nothing");
    }
}
