use proptest::prelude::*;

use super::*;

fn at(text: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(text).unwrap().with_timezone(&Utc)
}

fn next(schedule: &str, after: &str) -> String {
    Schedule::parse(schedule).unwrap().next_after(at(after)).unwrap().to_rfc3339()
}

/// New York's rule as a POSIX TZ string: no zone file needed, the same transitions.
fn new_york() -> ScheduleZone {
    ScheduleZone::named("America/New_York", tz::TimeZone::from_posix_tz("EST5EDT,M3.2.0,M11.1.0").unwrap())
}

fn next_in(schedule: &str, after: &str, zone: &ScheduleZone) -> String {
    Schedule::parse(schedule).unwrap().next_after_in(at(after), zone).unwrap().to_rfc3339()
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

/// Regression (issue 25, item 4): the host accepts five-field cron (no seconds field), so a
/// poller written that way must not be refused while the host keeps firing it.
#[test]
fn five_field_schedules_fire_at_second_zero() {
    assert_eq!(next("*/5 * * * *", "2024-11-30T14:41:10Z"), "2024-11-30T14:45:00+00:00");
    assert_eq!(next("30 9 * * 1-5", "2024-11-30T14:41:10Z"), "2024-12-02T09:30:00+00:00");
    assert_eq!(next("* * * * *", "2024-11-30T14:41:10Z"), "2024-11-30T14:42:00+00:00");
    assert!(!Schedule::parse("* * * * *").unwrap().monitor_off_by_frequency());
}

/// NCRONTAB takes a day only when both the day of the month and the day of the week allow it.
#[test]
fn day_of_month_and_day_of_week_must_both_match() {
    // Friday the 13th, not the first Friday (6 December) nor the 13th of a month before.
    assert_eq!(next("0 0 0 13 * FRI", "2024-11-30T00:00:00Z"), "2024-12-13T00:00:00+00:00");
    assert_eq!(next("0 0 0 13 * FRI", "2024-12-13T00:00:00Z"), "2025-06-13T00:00:00+00:00");
}

#[test]
fn time_spans_are_read_as_the_host_reads_them() {
    let every =
        |text: &str| Schedule::parse(text).unwrap().next_after(at("2024-01-01T00:00:00Z")).unwrap().to_rfc3339();
    assert_eq!(every("00:05"), "2024-01-01T00:05:00+00:00");
    assert_eq!(every("1.02:00:00"), "2024-01-02T02:00:00+00:00");
    assert_eq!(every("2"), "2024-01-03T00:00:00+00:00");
    assert_eq!(every("00:00:01.5"), "2024-01-01T00:00:01.500+00:00");
    assert!(Schedule::parse("00:00:30").unwrap().monitor_off_by_frequency());
    assert!(!Schedule::parse("00:01:00").unwrap().monitor_off_by_frequency());
}

/// Regression (issue 24, item 13): a time span with an absurd number of hours overflowed the
/// schedule arithmetic (a panic in every watchdog run and in `dev`). The host refuses it
/// (`TimeSpan.TryParse` takes hours 0-23), and so does dbtrigger, with a reason.
#[test]
fn absurd_time_spans_are_refused_not_a_panic() {
    for text in ["9999999999:00:00", "24:00:00", "00:60:00", "10675200.00:00:00", "99999999999999999999"] {
        let error = Schedule::parse(text).unwrap_err();
        assert!(error.contains(text), "{text}: {error}");
    }
    let largest = Schedule::parse("10675199.23:59:59").unwrap();
    assert_eq!(largest.next_after(DateTime::<Utc>::MAX_UTC), None, "past the end of time: never again");
}

#[test]
fn bad_schedules_say_why() {
    assert!(Schedule::parse("* * * *").unwrap_err().contains("six"));
    assert!(Schedule::parse("0 61 * * * *").unwrap_err().contains("minute"));
    assert!(Schedule::parse("0 */0 * * * *").unwrap_err().contains("step"));
    assert!(Schedule::parse("0 0 0 * FOO *").unwrap_err().contains("month"));
    assert!(Schedule::parse("0 0 0 * * 7").unwrap_err().contains("day-of-week"));
    assert!(Schedule::parse("00:00:00").is_err());
    assert!(Schedule::parse("-00:05:00").unwrap_err().contains("positive"));
}

#[test]
fn sub_minute_cron_schedules_run_without_a_schedule_status() {
    assert!(Schedule::parse("*/10 * * * * *").unwrap().monitor_off_by_frequency());
    assert!(!Schedule::parse("0 * * * * *").unwrap().monitor_off_by_frequency());
    assert!(!Schedule::parse("*/10 0 * * * *").unwrap().monitor_off_by_frequency());
}

/// Regression (issue 25, item 4): schedules follow `WEBSITE_TIME_ZONE`, as the host's do.
#[test]
fn cron_fields_are_local_times_of_the_zone() {
    let zone = new_york();
    // 09:30 in New York is 14:30 UTC in winter, 13:30 UTC in summer.
    assert_eq!(next_in("0 30 9 * * *", "2024-12-02T00:00:00Z", &zone), "2024-12-02T14:30:00+00:00");
    assert_eq!(next_in("0 30 9 * * *", "2024-07-01T00:00:00Z", &zone), "2024-07-01T13:30:00+00:00");
    // Weekdays are New York's: Friday 23:00 there is Saturday 04:00 UTC.
    assert_eq!(next_in("0 0 23 * * FRI", "2024-11-29T12:00:00Z", &zone), "2024-11-30T04:00:00+00:00");
    // Time spans know no zone.
    assert_eq!(next_in("00:05:00", "2024-12-02T00:00:00Z", &zone), "2024-12-02T00:05:00+00:00");
}

#[test]
fn a_skipped_local_time_fires_once_the_clock_has_moved_past_it() {
    // 2024-03-10: New York skips 02:00-03:00. 02:30 fires at 03:30 EDT (07:30 UTC).
    let zone = new_york();
    assert_eq!(next_in("0 30 2 * * *", "2024-03-10T05:00:00Z", &zone), "2024-03-10T07:30:00+00:00");
    assert_eq!(next_in("0 30 2 * * *", "2024-03-10T07:30:00Z", &zone), "2024-03-11T06:30:00+00:00");
}

#[test]
fn a_repeated_local_time_fires_once_for_a_point_in_time_and_twice_for_an_interval() {
    // 2024-11-03: New York repeats 01:00-02:00 (05:00-06:00 UTC in EDT, 06:00-07:00 UTC in EST).
    let zone = new_york();
    assert_eq!(next_in("0 30 1 * * *", "2024-11-03T04:00:00Z", &zone), "2024-11-03T05:30:00+00:00");
    assert_eq!(next_in("0 30 1 * * *", "2024-11-03T05:30:00Z", &zone), "2024-11-04T06:30:00+00:00");
    assert_eq!(next_in("0 */30 * * * *", "2024-11-03T05:30:00Z", &zone), "2024-11-03T06:00:00+00:00");
    assert_eq!(next_in("0 */30 * * * *", "2024-11-03T06:00:00Z", &zone), "2024-11-03T06:30:00+00:00");
    assert_eq!(next_in("0 */30 * * * *", "2024-11-03T06:30:00Z", &zone), "2024-11-03T07:00:00+00:00");
}

#[test]
fn a_zone_file_from_the_system_reads_like_its_rule() {
    // The same zone as the TZif file the host's .NET reads on Linux (tzdata is installed here
    // as in the Functions images).
    let bytes = std::fs::read("/usr/share/zoneinfo/America/New_York").expect("tzdata is installed");
    let zone = ScheduleZone::from_zone_file("America/New_York", &bytes).unwrap();
    assert_eq!(next_in("0 30 9 * * *", "2024-07-01T00:00:00Z", &zone), "2024-07-01T13:30:00+00:00");
    assert!(ScheduleZone::from_zone_file("Nowhere", b"not a zone file").is_err());
}

/// Any text: a schedule or an error. Any instant and zone: an occurrence after it, or none.
fn schedule_text() -> impl Strategy<Value = String> {
    let token = prop_oneof![
        Just("*".to_string()),
        Just("*/".to_string()),
        Just("-".to_string()),
        Just(",".to_string()),
        Just(":".to_string()),
        Just(".".to_string()),
        Just(" ".to_string()),
        Just("MON".to_string()),
        Just("jan".to_string()),
        any::<u64>().prop_map(|number| number.to_string()),
        (0u32..70).prop_map(|number| number.to_string()),
        "\\PC{0,3}",
    ];
    prop::collection::vec(token, 0..16).prop_map(|tokens| tokens.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Regression (issue 24, item 13): no schedule text and no instant panics.
    #[test]
    fn any_text_gives_a_schedule_or_an_error_and_never_panics(
        text in schedule_text(),
        seconds in any::<i64>(),
        in_new_york in any::<bool>(),
    ) {
        let Ok(schedule) = Schedule::parse(&text) else {
            return Ok(());
        };
        let after = DateTime::<Utc>::from_timestamp(seconds % 300_000_000_000, 0).unwrap_or(DateTime::<Utc>::MAX_UTC);
        let zone = if in_new_york { new_york() } else { ScheduleZone::Utc };
        if let Some(next) = schedule.next_after_in(after, &zone) {
            prop_assert!(next > after, "{text:?}: {next} is not after {after}");
        }
    }

    #[test]
    fn cron_fields_in_any_order_parse_or_say_why(
        fields in prop::collection::vec("[0-9*/,A-Za-z-]{1,6}", 5..=6),
        seconds in 0i64..4_102_444_800,
    ) {
        let text = fields.join(" ");
        if let Ok(schedule) = Schedule::parse(&text) {
            let after = DateTime::<Utc>::from_timestamp(seconds, 0).unwrap();
            if let Some(next) = schedule.next_after_in(after, &new_york()) {
                prop_assert!(next > after);
            }
        }
    }
}
