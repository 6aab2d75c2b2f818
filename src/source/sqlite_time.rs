//! Cursor texts as SQLite stores timestamps: read by the SQLite source (its rows' cursors) and by
//! the operator's positions (a bound written in the stored layout), below both.

use chrono::{DateTime, NaiveDateTime, Utc};

/// A cursor text as a point in time, for exactly the layouts SQLite's `julianday()` also reads,
/// so that the settle predicate (which uses it) and the checkpoint agree on every row:
/// `YYYY-MM-DD`, a space or an upper-case `T`, `HH:MM`, optional `:SS` and `.fraction`, then
/// nothing (UTC), `Z`/`z`, or an offset `±HH:MM` of at most 14 hours. Anything else (`+0200`,
/// `+02`, a lower-case `t`, a date alone) is `None`: the row is reported, not skipped.
pub fn parse_sqlite_timestamp(text: &str) -> Option<DateTime<Utc>> {
    let bytes = text.as_bytes();
    let digits =
        |range: std::ops::Range<usize>| bytes.get(range).is_some_and(|part| part.iter().all(u8::is_ascii_digit));
    // YYYY-MM-DD?HH:MM
    let shape = digits(0..4)
        && bytes.get(4) == Some(&b'-')
        && digits(5..7)
        && bytes.get(7) == Some(&b'-')
        && digits(8..10)
        && matches!(bytes.get(10), Some(b' ' | b'T'))
        && digits(11..13)
        && bytes.get(13) == Some(&b':')
        && digits(14..16);
    if !shape {
        return None;
    }
    let mut end = 16;
    if bytes.get(end) == Some(&b':') {
        if !digits(end + 1..end + 3) {
            return None;
        }
        end += 3;
        if bytes.get(end) == Some(&b'.') {
            let fraction_digits = bytes[end + 1..].iter().take_while(|byte| byte.is_ascii_digit()).count();
            if fraction_digits == 0 {
                return None;
            }
            end += 1 + fraction_digits;
        }
    }
    let offset_seconds: i32 = match &bytes[end..] {
        [] | [b'Z'] | [b'z'] => 0,
        [sign @ (b'+' | b'-'), hours @ ..] if hours.len() == 5 && hours[2] == b':' => {
            if !digits(end + 1..end + 3) || !digits(end + 4..end + 6) {
                return None;
            }
            let hour = i32::from(hours[0] - b'0') * 10 + i32::from(hours[1] - b'0');
            let minute = i32::from(hours[3] - b'0') * 10 + i32::from(hours[4] - b'0');
            if hour > 14 || minute > 59 || (hour == 14 && minute > 0) {
                return None;
            }
            let seconds = hour * 3600 + minute * 60;
            if *sign == b'-' { -seconds } else { seconds }
        }
        _ => return None,
    };
    let local = &text[..end];
    // Seconds of 60 (a leap second to chrono) are not a time to SQLite.
    if end >= 19 && &text[17..19] >= "60" {
        return None;
    }
    let format = if end == 16 { "%Y-%m-%d %H:%M" } else { "%Y-%m-%d %H:%M:%S%.f" };
    let normalized = local.replacen('T', " ", 1);
    let naive = NaiveDateTime::parse_from_str(&normalized, format).ok()?;
    Some(naive.and_utc() - chrono::Duration::seconds(i64::from(offset_seconds)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_timestamp_layouts_parse_as_utc() {
        let expected = DateTime::parse_from_rfc3339("2024-03-01T10:20:30.5Z").unwrap().with_timezone(&Utc);
        for text in [
            "2024-03-01 10:20:30.5",
            "2024-03-01T10:20:30.5",
            "2024-03-01T10:20:30.500Z",
            "2024-03-01T10:20:30.500z",
            "2024-03-01 10:20:30.5+00:00",
            "2024-03-01T12:20:30.5+02:00",
            "2024-03-01T08:50:30.5-01:30",
        ] {
            assert_eq!(parse_sqlite_timestamp(text), Some(expected), "{text}");
        }
        assert_eq!(
            parse_sqlite_timestamp("2024-03-01 10:20"),
            Some(DateTime::parse_from_rfc3339("2024-03-01T10:20:00Z").unwrap().with_timezone(&Utc))
        );
        // Layouts julianday() cannot read are not timestamps here either.
        for text in [
            "yesterday",
            "2024-03-01T10:20:30+0200",
            "2024-03-01T10:20:30+02",
            "2024-03-01t10:20:30",
            "2024-03-01",
            "2024-03-01 10:20:60",
            "2024-03-01 10:20:30.",
            "2024-03-01 10:20:30+15:00",
            "2024-03-01 1:20:30",
        ] {
            assert_eq!(parse_sqlite_timestamp(text), None, "{text}");
        }
    }
}
