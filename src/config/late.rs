//! `poller.source.lateArrivals`: the late-arrival detector (docs/sources.md, "Late arrivals"). On unless
//! `"enabled": false`.
//!
//! ```json
//! "lateArrivals": {"enabled": true, "windowSeconds": 900, "windowRows": 100000, "everyTicks": 1, "sweepChecks": 1000}
//! ```

use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, Located, in_range};
use crate::domain::late::WindowPolicy;

/// The detector's defaults: the last 15 minutes of cursor time and the last 100,000 rows behind
/// the checkpoint; a check at every tick, of the fresh buckets and a slice of the older ones, so
/// that the whole window is recounted in 1,000 checks (docs/late-arrivals.md: the cost).
pub mod defaults {
    pub const WINDOW_SECONDS: u64 = 900;
    pub const WINDOW_ROWS: u64 = 100_000;
    pub const EVERY_TICKS: u32 = 1;
    pub const SWEEP_CHECKS: u32 = 1000;
}

/// What the loader accepts (the field table in `fields.rs` reads these too).
pub mod ranges {
    use std::ops::RangeInclusive;

    use super::super::limits;

    pub const WINDOW_SECONDS: RangeInclusive<u64> = 1..=limits::SECONDS;
    pub const WINDOW_ROWS: RangeInclusive<u64> = 16..=10_000_000;
    pub const EVERY_TICKS: RangeInclusive<u32> = 1..=10_000;
    pub const SWEEP_CHECKS: RangeInclusive<u32> = 1..=100_000;
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawLateArrivals {
    enabled: Option<bool>,
    window_seconds: Option<u64>,
    window_rows: Option<u64>,
    every_ticks: Option<u32>,
    sweep_checks: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LateArrivalsConfig {
    pub enabled: bool,
    /// Cursor time behind the checkpoint the window covers (timestamp cursors).
    pub window: Duration,
    /// Rows behind the checkpoint the window covers (every cursor).
    pub window_rows: u64,
    /// The check runs at one tick in this many (of this process).
    pub every_ticks: u32,
    /// Each check recounts the fresh buckets and a slice of the older ones: every old bucket is
    /// recounted within this many checks ([`crate::domain::late::sweep`]).
    pub sweep_checks: u32,
}

impl Default for LateArrivalsConfig {
    fn default() -> Self {
        LateArrivalsConfig {
            enabled: true,
            window: Duration::from_secs(defaults::WINDOW_SECONDS),
            window_rows: defaults::WINDOW_ROWS,
            every_ticks: defaults::EVERY_TICKS,
            sweep_checks: defaults::SWEEP_CHECKS,
        }
    }
}

impl LateArrivalsConfig {
    pub fn policy(&self) -> WindowPolicy {
        WindowPolicy {
            span: chrono::Duration::from_std(self.window).unwrap_or(chrono::Duration::MAX),
            rows: self.window_rows,
        }
    }
}

/// Whether `lateArrivals` is given and says anything but `"enabled": false` (what a source that
/// cannot have late rows refuses).
pub(super) fn configured(raw: Option<&RawLateArrivals>) -> bool {
    raw.is_some_and(|raw| {
        raw.enabled != Some(false)
            || raw.window_seconds.is_some()
            || raw.window_rows.is_some()
            || raw.every_ticks.is_some()
            || raw.sweep_checks.is_some()
    })
}

/// Whether function.json turns the detector on in so many words (`"enabled": true`).
pub(super) fn asked_for(raw: Option<&RawLateArrivals>) -> bool {
    raw.and_then(|raw| raw.enabled).unwrap_or(false)
}

pub(super) fn build_late_arrivals(
    raw: Option<&RawLateArrivals>,
    at: &Located<'_>,
) -> Result<LateArrivalsConfig, ConfigError> {
    let empty = RawLateArrivals::default();
    let raw = raw.unwrap_or(&empty);
    let field = |name: &str| format!("poller.source.lateArrivals.{name}");
    let window_seconds =
        in_range(at, &field("windowSeconds"), raw.window_seconds, defaults::WINDOW_SECONDS, ranges::WINDOW_SECONDS)?;
    let window_rows = in_range(at, &field("windowRows"), raw.window_rows, defaults::WINDOW_ROWS, ranges::WINDOW_ROWS)?;
    let every_ticks = in_range(at, &field("everyTicks"), raw.every_ticks, defaults::EVERY_TICKS, ranges::EVERY_TICKS)?;
    let sweep_checks =
        in_range(at, &field("sweepChecks"), raw.sweep_checks, defaults::SWEEP_CHECKS, ranges::SWEEP_CHECKS)?;
    Ok(LateArrivalsConfig {
        enabled: raw.enabled.unwrap_or(true),
        window: Duration::from_secs(window_seconds),
        window_rows,
        every_ticks,
        sweep_checks,
    })
}
