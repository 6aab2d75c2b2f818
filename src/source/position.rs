//! Positions at the source's edge: binding a stored position to the seek (only when it fits the
//! configured key), and turning an operator's text (`reset --to-cursor VALUE --pk COL=VALUE`) into
//! a position as the source would have read it.
//!
//! Only the source knows what its cursor column holds (an integer, a timestamp with or without
//! time zone) and, for SQLite, the text layout its timestamps are stored in: a position built
//! without that knowledge is bound with the wrong type or compared as the wrong text, and rows are
//! skipped silently (issue 24, items 5 and 6). So the operator's text is read against a row the
//! source returns: its last settled row gives the cursor's kind, the SQLite layout and each key
//! column's kind. A value that cannot be read so is refused, never guessed.

use chrono::{DateTime, FixedOffset, NaiveDateTime, Timelike, Utc};
use sqlx::{Database, Encode, Type};

use super::query::Slot;
use super::sqlite_time::parse_sqlite_timestamp;
use super::{Source, SourceError, last_position};
use crate::config::SourceConfig;
use crate::domain::{CursorValue, PkValue, Position};

/// Refuses a position whose key columns are not the configured ones (after a change of `pk`).
pub(crate) fn check_key(config: &SourceConfig, position: &Position) -> Result<(), SourceError> {
    position.fits_key(&config.pk).map_err(SourceError::from)
}

/// Binds a position's values to the seek's placeholders, each as its native type. The position
/// must fit the key ([`check_key`]); a slot it has no value for is an error, never a panic.
pub(crate) fn bind_position<'q, DB>(
    mut query: sqlx::query::Query<'q, DB, <DB as Database>::Arguments>,
    slots: &[Slot],
    position: &Position,
) -> Result<sqlx::query::Query<'q, DB, <DB as Database>::Arguments>, SourceError>
where
    DB: Database,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    DateTime<Utc>: for<'t> Encode<'t, DB> + Type<DB>,
    NaiveDateTime: for<'t> Encode<'t, DB> + Type<DB>,
{
    for slot in slots {
        query = match slot {
            Slot::Cursor => bind_cursor(query, &position.cursor),
            Slot::Key(index) => match key_value(position, *index)? {
                PkValue::Integer(number) => query.bind(*number),
                PkValue::Text(text) => query.bind(text.clone()),
            },
        };
    }
    Ok(query)
}

/// Binds one cursor value as its native type (an xid as its decimal text, which the seek casts
/// to `xid8`).
pub(crate) fn bind_cursor<'q, DB>(
    query: sqlx::query::Query<'q, DB, <DB as Database>::Arguments>,
    cursor: &CursorValue,
) -> sqlx::query::Query<'q, DB, <DB as Database>::Arguments>
where
    DB: Database,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    DateTime<Utc>: for<'t> Encode<'t, DB> + Type<DB>,
    NaiveDateTime: for<'t> Encode<'t, DB> + Type<DB>,
{
    match cursor {
        CursorValue::Integer(number) => query.bind(*number),
        // SQLite: the exact stored text, so the seek agrees with its ORDER BY.
        CursorValue::Timestamp { source_text: Some(text), .. } => query.bind(text.clone()),
        CursorValue::Timestamp { at, source_text: None } => query.bind(*at),
        CursorValue::NaiveTimestamp(at) => query.bind(*at),
        CursorValue::Xid(xid) => query.bind(xid.to_string()),
    }
}

/// Refuses to bind a checkpoint of another kind than the column's when one side is an xid: its
/// text would be cast silently to the other type (`"740"` to an integer), or fail in the database.
pub(crate) fn check_xid_kind(xid_column: bool, position: &Position) -> Result<(), SourceError> {
    let xid_position = matches!(position.cursor, CursorValue::Xid(_));
    if xid_column == xid_position {
        return Ok(());
    }
    Err(SourceError::Position(format!(
        "the checkpoint holds a cursor of kind {}, the cursor column {}: the column's type changed; reset the poller (`dbtrigger reset`)",
        position.cursor.kind(),
        if xid_column { "is an xid8" } else { "is not an xid8" }
    )))
}

/// The value of the `index`-th key column of `position`.
pub(crate) fn key_value(position: &Position, index: usize) -> Result<&PkValue, SourceError> {
    match position.pk.get(index) {
        Some((_, value)) => Ok(value),
        None => Err(SourceError::Position(format!(
            "the position has {} key values, the seek binds key column {}",
            position.pk.len(),
            index + 1
        ))),
    }
}

/// The position an operator names: `cursor` and `keys` (one text per configured key column, in
/// the configured order) read the way `source` reads its rows. The source's last settled row says
/// what each column holds; without one nothing can be known, and the position is refused.
pub async fn operator_position(
    source: &dyn Source,
    config: &SourceConfig,
    cursor: &str,
    keys: &[String],
) -> Result<Position, SourceError> {
    if keys.len() != config.pk.len() {
        return Err(SourceError::Position(format!(
            "a position needs a value for every key column ({}), {} given",
            config.pk.join(", "),
            keys.len()
        )));
    }
    let Some(sample) = last_position(source).await? else {
        return Err(SourceError::Position(format!(
            "{} has no settled row yet, so what its cursor column {:?} holds cannot be known: \
             nothing to skip (`reset --to-beginning` is the same place)",
            source.describe(),
            config.cursor
        )));
    };
    check_key(config, &sample)?;
    let cursor_value = cursor_like(&sample.cursor, &config.cursor, cursor)?;
    let mut pk = Vec::with_capacity(keys.len());
    for ((column, sample_value), text) in sample.pk.iter().zip(keys) {
        let value = match sample_value {
            PkValue::Integer(_) => PkValue::Integer(text.parse::<i64>().map_err(|_| {
                SourceError::Position(format!("key column {column:?} holds integers: {text:?} is not one"))
            })?),
            PkValue::Text(_) => PkValue::Text(text.clone()),
        };
        pk.push((column.clone(), value));
    }
    Ok(Position { cursor: cursor_value, pk })
}

/// `text` as a cursor value of the kind `sample` is (a value the source read).
fn cursor_like(sample: &CursorValue, column: &str, text: &str) -> Result<CursorValue, SourceError> {
    let refuse = |what: &str| SourceError::Position(format!("cursor column {column:?} {what}: {text:?} is not one"));
    match sample {
        CursorValue::Integer(_) => text.parse::<i64>().map(CursorValue::Integer).map_err(|_| refuse("holds integers")),
        CursorValue::Timestamp { source_text: None, .. } => DateTime::parse_from_rfc3339(text)
            .map(|at| CursorValue::Timestamp { at: at.with_timezone(&Utc), source_text: None })
            .map_err(|_| {
                refuse("holds timestamps with a time zone: give RFC 3339 with its offset (2026-01-01T10:00:00Z)")
            }),
        CursorValue::Timestamp { source_text: Some(stored), .. } => {
            let at = DateTime::parse_from_rfc3339(text)
                .map(|at| at.with_timezone(&Utc))
                .ok()
                .or_else(|| parse_sqlite_timestamp(text))
                .ok_or_else(|| refuse("holds timestamps as text: give RFC 3339 (2026-01-01T10:00:00Z)"))?;
            let layout = TextLayout::of(stored).ok_or_else(|| {
                SourceError::Position(format!(
                    "cursor column {column:?}: the stored text {stored:?} has no known layout"
                ))
            })?;
            let formatted = layout.format(at);
            // The instant of the text that is bound (truncated to the layout: an earlier bound,
            // so a row is delivered again rather than skipped).
            let bound_at = parse_sqlite_timestamp(&formatted).ok_or_else(|| {
                SourceError::Position(format!("cursor column {column:?}: {formatted:?} cannot be read back"))
            })?;
            Ok(CursorValue::Timestamp { at: bound_at, source_text: Some(formatted) })
        }
        CursorValue::Xid(_) => crate::domain::cursor::parse_xid(text)
            .map(CursorValue::Xid)
            .ok_or_else(|| refuse("holds transaction ids (xid8): give its decimal digits")),
        CursorValue::NaiveTimestamp(_) => {
            if DateTime::parse_from_rfc3339(text).is_ok() {
                return Err(refuse(
                    "holds timestamps without time zone: give the value as the database holds it, without an offset",
                ));
            }
            parse_naive(text).map(CursorValue::NaiveTimestamp).ok_or_else(|| {
                refuse("holds timestamps without time zone (2026-01-01T10:00:00 or 2026-01-01 10:00:00)")
            })
        }
    }
}

fn parse_naive(text: &str) -> Option<NaiveDateTime> {
    for format in ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%d %H:%M:%S%.f", "%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M"] {
        if let Ok(at) = NaiveDateTime::parse_from_str(text, format) {
            return Some(at);
        }
    }
    None
}

/// The text layout of a SQLite timestamp (one the source accepts, see
/// [`parse_sqlite_timestamp`]): what separates date and time, whether seconds and how many
/// fraction digits follow, and the zone suffix. SQLite compares cursor texts byte by byte, so a
/// bound must be written in the layout of the stored values to compare as the instant it means.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TextLayout {
    separator: char,
    seconds: bool,
    fraction_digits: usize,
    /// `""`, `"Z"`, `"z"`, or an offset such as `"+02:00"`.
    suffix: String,
    offset_seconds: i32,
}

impl TextLayout {
    fn of(text: &str) -> Option<TextLayout> {
        parse_sqlite_timestamp(text)?;
        let bytes = text.as_bytes();
        let separator = char::from(*bytes.get(10)?);
        let mut end = 16;
        let seconds = bytes.get(16) == Some(&b':');
        let mut fraction_digits = 0;
        if seconds {
            end = 19;
            if bytes.get(19) == Some(&b'.') {
                fraction_digits = bytes[20..].iter().take_while(|byte| byte.is_ascii_digit()).count();
                end = 20 + fraction_digits;
            }
        }
        let suffix = text.get(end..)?.to_string();
        let offset_seconds = match suffix.as_bytes() {
            [sign @ (b'+' | b'-'), ..] => {
                let hours: i32 = suffix.get(1..3)?.parse().ok()?;
                let minutes: i32 = suffix.get(4..6)?.parse().ok()?;
                let seconds = hours * 3600 + minutes * 60;
                if *sign == b'-' { -seconds } else { seconds }
            }
            _ => 0,
        };
        Some(TextLayout { separator, seconds, fraction_digits, suffix, offset_seconds })
    }

    /// `at` in this layout, truncated to its precision.
    fn format(&self, at: DateTime<Utc>) -> String {
        let offset =
            FixedOffset::east_opt(self.offset_seconds).unwrap_or_else(|| FixedOffset::east_opt(0).expect("UTC"));
        let local = at.with_timezone(&offset);
        let mut text = local.format(&format!("%Y-%m-%d{}%H:%M", self.separator)).to_string();
        if self.seconds {
            text.push_str(&local.format(":%S").to_string());
            if self.fraction_digits > 0 {
                let nanos = format!("{:09}", local.nanosecond() % 1_000_000_000);
                let mut fraction: String = nanos.chars().take(self.fraction_digits).collect();
                while fraction.len() < self.fraction_digits {
                    fraction.push('0');
                }
                text.push('.');
                text.push_str(&fraction);
            }
        }
        text.push_str(&self.suffix);
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text).unwrap().with_timezone(&Utc)
    }

    /// Regression (issue 24, item 5): a bound is written in the stored values' layout, so that
    /// SQLite's text comparison means the instant the operator gave.
    #[test]
    fn a_sqlite_bound_takes_the_stored_layout() {
        let cases = [
            ("2026-01-01 12:00:00.000", "2026-01-01 10:00:00.000"),
            ("2026-01-01T12:00:00Z", "2026-01-01T10:00:00Z"),
            ("2026-01-01 12:00", "2026-01-01 10:00"),
            ("2026-01-01T14:00:00.5+02:00", "2026-01-01T12:00:00.0+02:00"),
            ("2026-01-01 12:00:00.123456", "2026-01-01 10:00:00.000000"),
        ];
        for (stored, expected) in cases {
            let layout = TextLayout::of(stored).unwrap();
            assert_eq!(layout.format(utc("2026-01-01T10:00:00Z")), expected, "{stored}");
        }
        let millis = TextLayout::of("2026-01-01 12:00:00.000").unwrap();
        assert_eq!(millis.format(utc("2026-01-01T10:00:00.98765Z")), "2026-01-01 10:00:00.987", "truncated: earlier");
    }

    #[test]
    fn operator_text_is_read_as_the_sample_is() {
        let integer = CursorValue::Integer(5);
        assert_eq!(cursor_like(&integer, "v", "42").unwrap(), CursorValue::Integer(42));
        assert!(cursor_like(&integer, "v", "2026-01-01T00:00:00Z").is_err());
        let naive = CursorValue::NaiveTimestamp(parse_naive("2026-01-01 00:00:00").unwrap());
        assert_eq!(cursor_like(&naive, "c", "2026-01-01T10:00:00").unwrap().kind(), "timestamp_naive");
        let offset = cursor_like(&naive, "c", "2026-01-01T10:00:00Z").unwrap_err();
        assert!(offset.to_string().contains("without time zone"), "{offset}");
        let zoned = CursorValue::Timestamp { at: utc("2026-01-01T00:00:00Z"), source_text: None };
        assert!(cursor_like(&zoned, "c", "2026-01-01 10:00:00").is_err(), "no offset: refused, not guessed");
        let stored = CursorValue::Timestamp {
            at: utc("2026-01-01T12:00:00Z"),
            source_text: Some("2026-01-01 12:00:00.000".into()),
        };
        let CursorValue::Timestamp { at, source_text } =
            cursor_like(&stored, "c", "2026-01-01T11:00:00+01:00").unwrap()
        else {
            panic!("a timestamp");
        };
        assert_eq!((at, source_text.as_deref()), (utc("2026-01-01T10:00:00Z"), Some("2026-01-01 10:00:00.000")));
    }
}
