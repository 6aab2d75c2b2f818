//! Timer schedules as function.json writes them, read the way the Functions host reads them
//! (azure-webjobs-sdk-extensions `Extensions/Timers/Scheduling/TimerSchedule.cs`, `Create`): first
//! as an NCRONTAB expression, six fields (`second minute hour day month day-of-week`, e.g.
//! `0 */5 * * * *`) or five (no seconds field, `HasSeconds` in `CronSchedule.cs`); else as a .NET
//! time span (`hh:mm[:ss]`, `d.hh:mm:ss`, or a whole number of days), every so long.
//!
//! Cron schedules are evaluated in the app's time zone ([`ScheduleZone`]: `WEBSITE_TIME_ZONE`),
//! as the host evaluates them in `TimeZoneInfo.Local`, with its daylight-saving rules
//! (`CronSchedule.cs`, `GetNextOccurrence`): a local time that does not exist (the hour skipped in
//! spring) fires when the clock has moved on past it; a local time that exists twice (the hour
//! repeated in autumn) fires once for a point-in-time schedule and twice for an interval schedule
//! (one whose second, minute or hour field holds `*`, `/` or `-`).
//!
//! Pure: `next_after` takes the instant to start from. No input panics: every date is computed
//! with checked arithmetic, and a schedule that never fires again answers `None`.

use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, Datelike, Duration, NaiveDate, NaiveDateTime, Timelike, Utc};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    text: String,
    kind: Kind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Cron(Cron),
    /// A .NET time span: every so long, from the previous run (`ConstantSchedule.cs`).
    Every(Duration),
}

/// Each field as a bit set of allowed values.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cron {
    seconds: u64,
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    /// Written with a seconds field (six fields).
    has_seconds: bool,
    /// The host's "interval" schedule (`CronSchedule.IsInterval`): one of the first three fields
    /// (two without seconds) holds `*`, `/` or `-`. It decides what a repeated local hour does.
    interval: bool,
    /// Every field after the seconds covers its whole range (the schedule runs every minute or
    /// more often).
    every_minute: bool,
}

impl fmt::Display for Schedule {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.text)
    }
}

const MONTHS: [&str; 12] = ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"];
const WEEKDAYS: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

/// One field as a bit set of allowed values (`low..=high` fits in 64 bits for every field).
fn field(text: &str, name: &str, low: u32, high: u32, names: &[&str], names_start: u32) -> Result<u64, String> {
    let value = |token: &str| -> Result<u32, String> {
        if let Some(position) = names.iter().position(|candidate| candidate.eq_ignore_ascii_case(token)) {
            return Ok(names_start + position as u32);
        }
        let number: u32 = token.parse().map_err(|_| format!("{name}: {token:?} is not a number"))?;
        if number < low || number > high {
            return Err(format!("{name}: {number} is outside {low}-{high}"));
        }
        Ok(number)
    };
    let mut bits = 0u64;
    for part in text.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((range, step)) => {
                let step: u32 = step.parse().map_err(|_| format!("{name}: step {step:?} is not a number"))?;
                if step == 0 {
                    return Err(format!("{name}: a step of 0"));
                }
                (range, step)
            }
            None => (part, 1),
        };
        let (start, end) = if range == "*" {
            (low, high)
        } else if let Some((start, end)) = range.split_once('-') {
            (value(start)?, value(end)?)
        } else {
            let single = value(range)?;
            (single, if part.contains('/') { high } else { single })
        };
        if start > end {
            return Err(format!("{name}: range {start}-{end} is backwards"));
        }
        let mut current = start;
        while current <= end {
            bits |= 1 << current;
            // A huge step ends the range rather than overflowing.
            match current.checked_add(step) {
                Some(next) => current = next,
                None => break,
            }
        }
    }
    Ok(bits)
}

/// All of `low..=high`.
fn full(low: u32, high: u32) -> u64 {
    let mut bits = 0u64;
    for value in low..=high {
        bits |= 1 << value;
    }
    bits
}

impl Schedule {
    pub fn parse(text: &str) -> Result<Schedule, String> {
        let trimmed = text.trim();
        let parts: Vec<&str> = trimmed.split_whitespace().collect();
        match parts.len() {
            5 | 6 => parse_cron(&parts).map(|cron| Schedule { text: trimmed.to_string(), kind: Kind::Cron(cron) }),
            1 => parse_time_span(trimmed).map(|every| Schedule { text: trimmed.to_string(), kind: Kind::Every(every) }),
            count => Err(format!(
                "{trimmed:?} has {count} fields: a schedule has six (second minute hour day month day-of-week, e.g. \"0 */5 * * * *\") or five (no seconds), or is a time span like \"00:05:00\""
            )),
        }
    }

    /// The host stores no schedule status for this schedule (its payload then has
    /// `ScheduleStatus: null`, as with `useMonitor: false`): it fires more often than once a
    /// minute (`TimerSchedule.cs`, `ShouldDisableScheduleMonitor`, and the time-span branch).
    pub fn monitor_off_by_frequency(&self) -> bool {
        match &self.kind {
            Kind::Every(every) => *every < Duration::minutes(1),
            Kind::Cron(cron) => cron.has_seconds && cron.every_minute && cron.seconds.count_ones() > 1,
        }
    }

    /// The first occurrence strictly after `after`, in UTC (within five years for a cron schedule).
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.next_after_in(after, &ScheduleZone::Utc)
    }

    /// The first occurrence strictly after `after`, the cron fields read as local times of `zone`.
    pub fn next_after_in(&self, after: DateTime<Utc>, zone: &ScheduleZone) -> Option<DateTime<Utc>> {
        match &self.kind {
            Kind::Every(every) => after.checked_add_signed(*every),
            Kind::Cron(cron) => match zone {
                ScheduleZone::Utc => cron.next_local(after.naive_utc()).map(|next| next.and_utc()),
                ScheduleZone::Named { .. } => next_in_zone(cron, after, zone),
            },
        }
    }
}

fn parse_cron(parts: &[&str]) -> Result<Cron, String> {
    // Five fields: no seconds field, the schedule fires at second 0 (`CronSchedule.HasSeconds`).
    let (seconds_text, rest) = if parts.len() == 6 { (parts[0], &parts[1..]) } else { ("0", parts) };
    let minutes = field(rest[0], "minute", 0, 59, &[], 0)?;
    let hours = field(rest[1], "hour", 0, 23, &[], 0)?;
    let days = field(rest[2], "day", 1, 31, &[], 0)?;
    let months = field(rest[3], "month", 1, 12, &MONTHS, 1)?;
    // NCRONTAB's day of week is 0-6, Sunday 0 (7 is refused by the host, so here too).
    let weekdays = field(rest[4], "day-of-week", 0, 6, &WEEKDAYS, 0)?;
    let seconds = field(seconds_text, "second", 0, 59, &[], 0)?;
    let checked_for_interval = if parts.len() == 6 { 3 } else { 2 };
    let interval = parts[..checked_for_interval].iter().any(|part| part.contains(['*', '/', '-']));
    let every_minute = minutes == full(0, 59)
        && hours == full(0, 23)
        && days == full(1, 31)
        && months == full(1, 12)
        && weekdays == full(0, 6);
    Ok(Cron { seconds, minutes, hours, days, months, weekdays, has_seconds: parts.len() == 6, interval, every_minute })
}

impl Cron {
    /// The first local time strictly after `after` that every field allows. NCRONTAB requires
    /// both the day of the month and the day of the week to match (unlike Vixie cron, which
    /// takes either when both are restricted).
    fn next_local(&self, after: NaiveDateTime) -> Option<NaiveDateTime> {
        let has = |bits: u64, value: u32| bits & (1 << value) != 0;
        let midnight = |date: NaiveDate| date.and_hms_opt(0, 0, 0);
        let mut at = after.with_nanosecond(0)?.checked_add_signed(Duration::seconds(1))?;
        let limit = after.checked_add_signed(Duration::days(5 * 366))?;
        while at <= limit {
            if !has(self.months, at.month()) {
                let (year, month) = if at.month() == 12 { (at.year() + 1, 1) } else { (at.year(), at.month() + 1) };
                at = midnight(NaiveDate::from_ymd_opt(year, month, 1)?)?;
                continue;
            }
            if !has(self.days, at.day()) || !has(self.weekdays, at.weekday().num_days_from_sunday()) {
                at = midnight(at.date().succ_opt()?)?;
                continue;
            }
            if !has(self.hours, at.hour()) {
                at = at.date().and_hms_opt(at.hour(), 0, 0)?.checked_add_signed(Duration::hours(1))?;
                continue;
            }
            if !has(self.minutes, at.minute()) {
                at = at.date().and_hms_opt(at.hour(), at.minute(), 0)?.checked_add_signed(Duration::minutes(1))?;
                continue;
            }
            if !has(self.seconds, at.second()) {
                at = at.checked_add_signed(Duration::seconds(1))?;
                continue;
            }
            return Some(at);
        }
        None
    }
}

/// A .NET time span as `TimeSpan.TryParse` reads it: `[-]d`, or `[-][d.]hh:mm[:ss[.fffffff]]`
/// with hours 0-23, minutes and seconds 0-59 (the host refuses `24:00:00`, and so a schedule such as
/// `9999999999:00:00`), days at most 10,675,199 (`TimeSpan.MaxValue`).
fn parse_time_span(text: &str) -> Result<Duration, String> {
    let neither = || {
        format!(
            "{text:?} is neither a cron schedule (six fields, or five) nor a time span like \"00:05:00\" (hh:mm:ss, hours 0-23; d.hh:mm:ss for days)"
        )
    };
    let number = |digits: &str| -> Option<i64> {
        if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok()
    };
    if text.starts_with('-') {
        return Err(format!("{text:?}: the interval must be positive"));
    }
    let (days, clock) = match text.split_once(':') {
        None => (number(text).ok_or_else(neither)?, None),
        Some(_) => match text.split_once('.') {
            Some((days, clock)) if !days.contains(':') => (number(days).ok_or_else(neither)?, Some(clock)),
            _ => (0, Some(text)),
        },
    };
    if days > 10_675_199 {
        return Err(format!("{text:?}: more days than a time span holds (10675199)"));
    }
    let mut every = Duration::try_days(days).ok_or_else(neither)?;
    if let Some(clock) = clock {
        let parts: Vec<&str> = clock.split(':').collect();
        if parts.len() != 2 && parts.len() != 3 {
            return Err(neither());
        }
        let hours = number(parts[0]).filter(|hours| *hours < 24).ok_or_else(neither)?;
        let minutes = number(parts[1]).filter(|minutes| *minutes < 60).ok_or_else(neither)?;
        let (seconds, fraction) = match parts.get(2) {
            Some(seconds) => match seconds.split_once('.') {
                Some((whole, fraction)) => (whole, Some(fraction)),
                None => (*seconds, None),
            },
            None => ("0", None),
        };
        let seconds = number(seconds).filter(|seconds| *seconds < 60).ok_or_else(neither)?;
        let mut nanoseconds = 0i64;
        if let Some(fraction) = fraction {
            if fraction.is_empty() || fraction.len() > 7 || !fraction.bytes().all(|byte| byte.is_ascii_digit()) {
                return Err(neither());
            }
            nanoseconds = format!("{fraction:0<9}").parse().map_err(|_| neither())?;
        }
        every = every
            .checked_add(&Duration::hours(hours))
            .and_then(|every| every.checked_add(&Duration::minutes(minutes)))
            .and_then(|every| every.checked_add(&Duration::seconds(seconds)))
            .and_then(|every| every.checked_add(&Duration::nanoseconds(nanoseconds)))
            .ok_or_else(neither)?;
    }
    if every <= Duration::zero() {
        return Err(format!("{text:?}: the interval must be positive"));
    }
    Ok(every)
}

/// The time zone the app's cron schedules are evaluated in: UTC, or a zone of the IANA database
/// (`WEBSITE_TIME_ZONE` on Linux plans that support it). Loading a zone by name reads the
/// system's zone files, which is I/O: the app does it once, at start-up, and hands the zone in.
#[derive(Clone, Default)]
pub enum ScheduleZone {
    #[default]
    Utc,
    Named {
        name: String,
        zone: Arc<tz::TimeZone>,
    },
}

impl fmt::Debug for ScheduleZone {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

impl ScheduleZone {
    /// A zone from the contents of its zone file (TZif, as under /usr/share/zoneinfo).
    pub fn from_zone_file(name: &str, bytes: &[u8]) -> Result<ScheduleZone, String> {
        let zone = tz::TimeZone::from_tz_data(bytes).map_err(|error| format!("time zone {name:?}: {error}"))?;
        Ok(ScheduleZone::Named { name: name.to_string(), zone: Arc::new(zone) })
    }

    /// A zone already read (see `tz::TimeZone::from_posix_tz`).
    pub fn named(name: &str, zone: tz::TimeZone) -> ScheduleZone {
        ScheduleZone::Named { name: name.to_string(), zone: Arc::new(zone) }
    }

    pub fn name(&self) -> &str {
        match self {
            ScheduleZone::Utc => "UTC",
            ScheduleZone::Named { name, .. } => name,
        }
    }

    /// The zone's offset from UTC at `instant`, in seconds (0 when the zone cannot say).
    fn offset_at(&self, instant: DateTime<Utc>) -> i64 {
        match self {
            ScheduleZone::Utc => 0,
            ScheduleZone::Named { zone, .. } => {
                zone.find_local_time_type(instant.timestamp()).map(|local| i64::from(local.ut_offset())).unwrap_or(0)
            }
        }
    }

    fn local(&self, instant: DateTime<Utc>) -> Option<NaiveDateTime> {
        instant.naive_utc().checked_add_signed(Duration::seconds(self.offset_at(instant)))
    }

    /// The instants at which the local time `local` occurs, earliest first: one; two when the
    /// clock repeats it (autumn); none when the clock skips it (spring), and then the instant the
    /// host fires at instead: `local` read with the offset in force before the jump, which is as
    /// far past the jump as `local` was past its start.
    fn instants(&self, local: NaiveDateTime) -> Vec<DateTime<Utc>> {
        let as_utc = local.and_utc();
        let offset_before = as_utc.checked_sub_signed(Duration::days(1)).map(|probe| self.offset_at(probe));
        let offset_after = as_utc.checked_add_signed(Duration::days(1)).map(|probe| self.offset_at(probe));
        let mut found = Vec::new();
        for offset in [offset_before, offset_after].into_iter().flatten() {
            let Some(instant) = as_utc.checked_sub_signed(Duration::seconds(offset)) else {
                continue;
            };
            if self.offset_at(instant) == offset && !found.contains(&instant) {
                found.push(instant);
            }
        }
        found.sort();
        if found.is_empty()
            && let Some(instant) = as_utc.checked_sub_signed(Duration::seconds(offset_before.unwrap_or(0)))
        {
            found.push(instant);
        }
        found
    }

    /// How far the offset moves within a day either side of `instant`, in seconds.
    fn offset_swing(&self, instant: DateTime<Utc>) -> i64 {
        let now = self.offset_at(instant);
        let mut swing = 0;
        for hours in [-26, -13, 13, 26] {
            if let Some(probe) = instant.checked_add_signed(Duration::hours(hours)) {
                swing = swing.max((self.offset_at(probe) - now).abs());
            }
        }
        swing
    }
}

/// The next occurrence after `after` of a cron schedule read in `zone`. Local times map to
/// instants nearly in order: they can be out of order only by the offset's swing around a
/// daylight-saving change. So the search starts that far before `after`'s local time and stops
/// that far past the best instant found.
fn next_in_zone(cron: &Cron, after: DateTime<Utc>, zone: &ScheduleZone) -> Option<DateTime<Utc>> {
    let swing = Duration::seconds(zone.offset_swing(after));
    let mut from = zone.local(after)?.checked_sub_signed(swing)?;
    let mut best: Option<(DateTime<Utc>, NaiveDateTime)> = None;
    loop {
        let local = cron.next_local(from)?;
        if let Some((_, best_local)) = best
            && local > best_local.checked_add_signed(swing)?
        {
            break;
        }
        let instants = zone.instants(local);
        // A point-in-time schedule runs once in a repeated hour: at its first occurrence.
        let count = if cron.interval { instants.len() } else { instants.len().min(1) };
        for instant in instants.into_iter().take(count) {
            if instant > after && best.is_none_or(|(best_instant, _)| instant < best_instant) {
                best = Some((instant, local));
            }
        }
        if swing.is_zero() && best.is_some() {
            break;
        }
        from = local;
    }
    best.map(|(instant, _)| instant)
}

#[cfg(test)]
mod tests;
