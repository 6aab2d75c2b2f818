//! Timer schedules as function.json writes them: a six-field NCRONTAB expression
//! (`second minute hour day month day-of-week`, e.g. `0 */5 * * * *`), or a time span
//! (`hh:mm:ss`, every so long). Pure: `next_after` takes the instant to start from. Used by
//! `dbtrigger dev`, which fires each function's schedule the way the Functions host would.

use std::fmt;

use chrono::{DateTime, Datelike, Duration, Timelike, Utc};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    text: String,
    kind: Kind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Cron {
        seconds: u64,
        minutes: u64,
        hours: u64,
        days: u64,
        months: u64,
        weekdays: u64,
        days_restricted: bool,
        weekdays_restricted: bool,
    },
    Every(Duration),
}

impl fmt::Display for Schedule {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.text)
    }
}

const MONTHS: [&str; 12] = ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"];
const WEEKDAYS: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

/// One field as a bit set of allowed values.
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
            current += step;
        }
    }
    Ok(bits)
}

impl Schedule {
    pub fn parse(text: &str) -> Result<Schedule, String> {
        let trimmed = text.trim();
        let parts: Vec<&str> = trimmed.split_whitespace().collect();
        if parts.len() == 1 && trimmed.contains(':') {
            return parse_time_span(trimmed)
                .map(|every| Schedule { text: trimmed.to_string(), kind: Kind::Every(every) });
        }
        if parts.len() != 6 {
            return Err(format!(
                "{trimmed:?} has {} fields: a schedule has six (second minute hour day month day-of-week), e.g. \"0 */5 * * * *\"",
                parts.len()
            ));
        }
        let mut weekdays = field(parts[5], "day-of-week", 0, 7, &WEEKDAYS, 0)?;
        if weekdays & (1 << 7) != 0 {
            weekdays |= 1; // 7 is Sunday too
        }
        Ok(Schedule {
            text: trimmed.to_string(),
            kind: Kind::Cron {
                seconds: field(parts[0], "second", 0, 59, &[], 0)?,
                minutes: field(parts[1], "minute", 0, 59, &[], 0)?,
                hours: field(parts[2], "hour", 0, 23, &[], 0)?,
                days: field(parts[3], "day", 1, 31, &[], 0)?,
                months: field(parts[4], "month", 1, 12, &MONTHS, 1)?,
                weekdays,
                days_restricted: parts[3] != "*",
                weekdays_restricted: parts[5] != "*",
            },
        })
    }

    /// The first occurrence strictly after `after` (UTC), within five years.
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let (seconds, minutes, hours, days, months, weekdays, days_restricted, weekdays_restricted) = match &self.kind {
            Kind::Every(every) => return Some(after + *every),
            Kind::Cron { seconds, minutes, hours, days, months, weekdays, days_restricted, weekdays_restricted } => {
                (seconds, minutes, hours, days, months, weekdays, days_restricted, weekdays_restricted)
            }
        };
        let has = |bits: &u64, value: u32| bits & (1 << value) != 0;
        let mut at = after.with_nanosecond(0)? + Duration::seconds(1);
        let limit = after + Duration::days(5 * 366);
        while at <= limit {
            if !has(months, at.month()) {
                let (year, month) = if at.month() == 12 { (at.year() + 1, 1) } else { (at.year(), at.month() + 1) };
                at =
                    at.with_day(1)?.with_hour(0)?.with_minute(0)?.with_second(0)?.with_month(month)?.with_year(year)?;
                continue;
            }
            let day_matches = has(days, at.day());
            let weekday_matches = has(weekdays, at.weekday().num_days_from_sunday());
            // Both restricted: either matches (as cron does); otherwise the restricted one decides.
            let day_ok = match (days_restricted, weekdays_restricted) {
                (true, true) => day_matches || weekday_matches,
                _ => day_matches && weekday_matches,
            };
            if !day_ok {
                at = (at + Duration::days(1)).with_hour(0)?.with_minute(0)?.with_second(0)?;
                continue;
            }
            if !has(hours, at.hour()) {
                at = (at + Duration::hours(1)).with_minute(0)?.with_second(0)?;
                continue;
            }
            if !has(minutes, at.minute()) {
                at = (at + Duration::minutes(1)).with_second(0)?;
                continue;
            }
            if !has(seconds, at.second()) {
                at += Duration::seconds(1);
                continue;
            }
            return Some(at);
        }
        None
    }
}

fn parse_time_span(text: &str) -> Result<Duration, String> {
    let parts: Vec<&str> = text.split(':').collect();
    let numbers: Vec<i64> = parts.iter().filter_map(|part| part.parse().ok()).collect();
    if parts.len() != 3 || numbers.len() != 3 {
        return Err(format!("{text:?} is neither a six-field schedule nor a time span like \"00:05:00\""));
    }
    let every = Duration::hours(numbers[0]) + Duration::minutes(numbers[1]) + Duration::seconds(numbers[2]);
    if every <= Duration::zero() {
        return Err(format!("{text:?}: the interval must be positive"));
    }
    Ok(every)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text).unwrap().with_timezone(&Utc)
    }

    fn next(schedule: &str, after: &str) -> String {
        Schedule::parse(schedule).unwrap().next_after(at(after)).unwrap().to_rfc3339()
    }

    #[test]
    fn common_schedules_fire_when_the_host_would() {
        assert_eq!(next("0 */5 * * * *", "2024-11-30T14:41:10Z"), "2024-11-30T14:45:00+00:00");
        assert_eq!(next("0 */5 * * * *", "2024-11-30T14:45:00Z"), "2024-11-30T14:50:00+00:00");
        assert_eq!(next("*/10 * * * * *", "2024-11-30T14:41:10.5Z"), "2024-11-30T14:41:20+00:00");
        assert_eq!(next("0 30 9 * * 1-5", "2024-11-30T14:41:10Z"), "2024-12-02T09:30:00+00:00");
        assert_eq!(next("0 0 0 1 JAN *", "2024-11-30T14:41:10Z"), "2025-01-01T00:00:00+00:00");
        assert_eq!(next("0 0 12 * * SUN", "2024-11-30T14:41:10Z"), "2024-12-01T12:00:00+00:00");
        assert_eq!(next("0 0 12 29 2 *", "2025-01-01T00:00:00Z"), "2028-02-29T12:00:00+00:00");
        assert_eq!(next("00:05:00", "2024-11-30T14:41:10Z"), "2024-11-30T14:46:10+00:00");
    }

    #[test]
    fn bad_schedules_say_why() {
        assert!(Schedule::parse("*/5 * * * *").unwrap_err().contains("six"));
        assert!(Schedule::parse("0 61 * * * *").unwrap_err().contains("minute"));
        assert!(Schedule::parse("0 */0 * * * *").unwrap_err().contains("step"));
        assert!(Schedule::parse("0 0 0 * FOO *").unwrap_err().contains("month"));
        assert!(Schedule::parse("00:00:00").is_err());
    }
}
