//! PostgreSQL through sqlx. Values are decoded by their column type; timestamps keep their kind
//! (timestamptz, or timestamp without time zone) and are bound back as that type.

use std::str::FromStr;
use std::sync::atomic::AtomicBool;

use base64::Engine as _;
use chrono::{DateTime, NaiveDate, NaiveDateTime, NaiveTime, Utc};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPool, PgRow};
use sqlx::{Column, Executor, Row, SqlSafeStr, Statement, TypeInfo, ValueRef};
use tokio::sync::OnceCell;

use super::query::{CursorType, SeekPlan, SeekQuery, build_seek};
use super::{Decoded, SourceError, classify, warn_missing_index};
use crate::config::redact::Redaction;
use crate::config::{SourceConfig, SourceTarget};
use crate::domain::CursorValue;
use crate::domain::horizon::{Horizon, HorizonHolder, PreparedHold};

pub struct PostgresSource {
    /// The connection options of the target; the pool itself is the target's, made at first use.
    options: PgConnectOptions,
    gate: super::pools::Gate,
    /// The connection a tick's delivering reads keep between them.
    kept: super::Kept<sqlx::Postgres>,
    config: SourceConfig,
    redaction: Redaction,
    query: OnceCell<SeekQuery>,
    settle_warned: AtomicBool,
    /// `settle: "auto"` said once that this role cannot see other roles' sessions.
    horizon_warned: AtomicBool,
    /// `settle: "auto"`: the bound each prepared transaction keeps while it stays prepared.
    prepared_hold: std::sync::Mutex<PreparedHold>,
    /// The size of the rows read last, to size the next LIMIT by (`batch.maxBytes`).
    row_sizes: super::RowSizes,
}

impl PostgresSource {
    pub(crate) fn open(config: &SourceConfig, gate: super::pools::Gate) -> Result<Self, SourceError> {
        let redaction = Redaction::of_url(config.url.expose());
        let options = PgConnectOptions::from_str(config.url.expose())
            .map_err(|error| SourceError::Unreachable {
                location: redaction.location.clone(),
                reason: redaction.scrub(&error.to_string()),
            })?
            .application_name("dbtrigger");
        Ok(PostgresSource {
            options,
            gate,
            kept: super::Kept::default(),
            config: config.clone(),
            redaction,
            query: OnceCell::new(),
            settle_warned: AtomicBool::new(false),
            horizon_warned: AtomicBool::new(false),
            prepared_hold: std::sync::Mutex::new(PreparedHold::default()),
            row_sizes: super::RowSizes::default(),
        })
    }

    /// The target's pool, made by its first user. The server gives up on a seek that outlasts the
    /// query timeout too (the longest of the target's sources), not only the client; and the
    /// session is read-only: a poller only reads.
    fn pool(&self) -> &PgPool {
        let target = self.gate.target().expect("a PostgreSQL source has a shared target");
        target.postgres.get_or_init(|| {
            let options = self.options.clone().options([
                ("statement_timeout", format!("{}ms", target.statement_timeout().as_millis())),
                ("default_transaction_read_only", "on".to_string()),
            ]);
            target.pool_options().connect_lazy_with(target.postgres_login(options))
        })
    }

    /// `settle: "auto"`'s bound, asked for before each read (see [`super::horizon`]).
    async fn settle_bound(&self) -> Result<CursorValue, SourceError> {
        let seek = self.seek().await?;
        super::horizon::postgres_bound(
            self.pool(),
            &self.config,
            seek.cursor_type,
            &self.redaction,
            &self.horizon_warned,
            &self.prepared_hold,
        )
        .await
    }

    /// The oldest transaction holding this source's horizon: the commit horizon of an xid
    /// cursor, or the bound of `settle: "auto"`.
    async fn holder(&self, seek: &SeekQuery) -> Result<Option<HorizonHolder>, SourceError> {
        let holds = if seek.is_xid() {
            Horizon::CommitHorizon
        } else if seek.bound {
            Horizon::SettleBound
        } else {
            return Ok(None);
        };
        super::horizon::postgres_holder(self.pool(), holds, &self.redaction).await
    }

    async fn seek(&self) -> Result<&SeekQuery, SourceError> {
        self.query.get_or_try_init(|| self.preflight()).await
    }

    /// Learns the types of the cursor and key columns (to shape the SQL) and warns once when no
    /// index starts with the cursor.
    async fn preflight(&self) -> Result<SeekQuery, SourceError> {
        let probe = build_seek(&self.config, &SeekPlan { cursor_type: CursorType::Integer, placeholder_types: None });
        let statement = self
            .pool()
            .prepare(sqlx::AssertSqlSafe(probe.from_start).into_sql_str())
            .await
            .map_err(|error| classify(&self.redaction, error))?;
        let type_of = |column: &str| -> Result<String, SourceError> {
            statement
                .columns()
                .iter()
                .find(|candidate| candidate.name() == column)
                .map(|found| found.type_info().name().to_string())
                .ok_or_else(|| {
                    SourceError::Position(format!("column {column:?} is not in the result of the source query"))
                })
        };
        let mut cursor_type_name = type_of(&self.config.cursor)?;
        let cursor_type = match cursor_type_name.as_str() {
            "INT2" | "INT4" | "INT8" => CursorType::Integer,
            "TIMESTAMPTZ" => CursorType::Timestamp,
            "TIMESTAMP" => CursorType::NaiveTimestamp,
            name if name.eq_ignore_ascii_case("xid8") => {
                cursor_type_name = "XID8".to_string();
                CursorType::Xid
            }
            other => {
                return Err(SourceError::Position(format!(
                    "cursor column {:?} has type {other}: use an integer, a timestamp or (cursorKind \"xid\") an xid8 column",
                    self.config.cursor
                )));
            }
        };
        super::query::check_cursor_rules(&self.config, cursor_type, &cursor_type_name)?;
        if self.config.settle_mode == crate::config::source::SettleMode::Auto {
            super::horizon::postgres_check_server(self.pool(), &self.redaction).await?;
        }
        let mut placeholder_types = vec![cursor_type_name];
        for key in &self.config.pk {
            placeholder_types.push(type_of(key)?);
        }
        if let SourceTarget::Table { schema, name } = &self.config.target {
            let qualified = match schema {
                Some(schema) => format!("\"{schema}\".\"{name}\""),
                None => format!("\"{name}\""),
            };
            let indexed: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
                 WHERE i.indrelid = to_regclass($1) AND a.attname = $2",
            )
            .bind(&qualified)
            .bind(&self.config.cursor)
            .fetch_one(self.pool())
            .await
            .map_err(|error| classify(&self.redaction, error))?;
            if indexed == 0 {
                warn_missing_index(&self.redaction.location, &qualified, &self.config);
            }
        }
        Ok(build_seek(&self.config, &SeekPlan { cursor_type, placeholder_types: Some(placeholder_types) }))
    }
}

fn decode_value<'r>(row: &'r PgRow, index: usize, name: &str, type_name: &str) -> Result<Decoded<'r>, SourceError> {
    let raw = row.try_get_raw(index).map_err(|error| SourceError::Position(format!("column {name:?}: {error}")))?;
    if raw.is_null() {
        return Ok(Decoded::plain(Value::Null));
    }
    let failed = |error: sqlx::Error| SourceError::UnsupportedType {
        column: name.to_string(),
        type_name: format!("{type_name} ({error})"),
    };
    // An extension's type is named as the catalog spells it (`citext`).
    let type_name = if type_name.eq_ignore_ascii_case("citext") { "CITEXT" } else { type_name };
    // Each arm decodes the Rust type of its PostgreSQL type: the driver's check of that pairing,
    // per value, would only repeat this match.
    let decoded = match type_name {
        "BOOL" => Decoded::plain(Value::from(row.try_get_unchecked::<bool, _>(index).map_err(failed)?)),
        "INT2" => Decoded::integer(i64::from(row.try_get_unchecked::<i16, _>(index).map_err(failed)?)),
        "INT4" => Decoded::integer(i64::from(row.try_get_unchecked::<i32, _>(index).map_err(failed)?)),
        "INT8" => Decoded::integer(row.try_get_unchecked::<i64, _>(index).map_err(failed)?),
        "FLOAT4" => Decoded::float(f64::from(row.try_get_unchecked::<f32, _>(index).map_err(failed)?)),
        "FLOAT8" => Decoded::float(row.try_get_unchecked::<f64, _>(index).map_err(failed)?),
        // As a string, exactly as PostgreSQL prints it (same digits, same scale).
        "NUMERIC" => {
            let bytes = row.try_get_unchecked::<&[u8], _>(index).map_err(failed)?;
            let text = numeric_text(bytes).ok_or_else(|| SourceError::UnsupportedType {
                column: name.to_string(),
                type_name: "NUMERIC (malformed value)".to_string(),
            })?;
            Decoded::plain(Value::from(text))
        }
        "TEXT" | "VARCHAR" | "BPCHAR" | "NAME" | "CHAR" | "CITEXT" => {
            Decoded::borrowed_text(row.try_get_unchecked::<&str, _>(index).map_err(failed)?)
        }
        "UUID" => Decoded::text(row.try_get_unchecked::<sqlx::types::Uuid, _>(index).map_err(failed)?.to_string()),
        "JSON" | "JSONB" => Decoded::plain(row.try_get_unchecked::<Value, _>(index).map_err(failed)?),
        "BYTEA" => Decoded::plain(Value::from(
            base64::engine::general_purpose::STANDARD
                .encode(row.try_get_unchecked::<Vec<u8>, _>(index).map_err(failed)?),
        )),
        "DATE" | "TIMESTAMP" | "TIMESTAMPTZ" => match decode_moment(&raw, type_name) {
            Moment::Infinite(text) => Decoded::not_a_position(
                Value::from(text),
                format!("holds {text}, which is not a position a checkpoint can hold"),
            ),
            Moment::OutOfRange => {
                return Err(SourceError::UnsupportedType {
                    column: name.to_string(),
                    type_name: format!("{type_name} (a value beyond the years dbtrigger can represent)"),
                });
            }
            Moment::Date(date) => Decoded::plain(Value::from(date.to_string())),
            Moment::Naive(at) if type_name == "TIMESTAMP" => Decoded::naive_timestamp(at),
            Moment::Naive(at) => Decoded::timestamp(at.and_utc()),
            Moment::Text => match type_name {
                "DATE" => Decoded::plain(Value::from(
                    row.try_get_unchecked::<NaiveDate, _>(index).map_err(failed)?.to_string(),
                )),
                "TIMESTAMP" => {
                    Decoded::naive_timestamp(row.try_get_unchecked::<NaiveDateTime, _>(index).map_err(failed)?)
                }
                _ => Decoded::timestamp(row.try_get_unchecked::<DateTime<Utc>, _>(index).map_err(failed)?),
            },
        },
        "TIME" => {
            Decoded::plain(Value::from(row.try_get_unchecked::<NaiveTime, _>(index).map_err(failed)?.to_string()))
        }
        xid8 if xid8.eq_ignore_ascii_case("xid8") => Decoded::xid(decode_xid8(&raw).ok_or_else(|| {
            SourceError::UnsupportedType { column: name.to_string(), type_name: "xid8 (malformed value)".to_string() }
        })?),
        other => {
            return Err(SourceError::UnsupportedType { column: name.to_string(), type_name: other.to_string() });
        }
    };
    Ok(decoded)
}

/// An `xid8`: eight bytes, big-endian, in the binary form; its decimal digits in the text form.
fn decode_xid8(raw: &sqlx::postgres::PgValueRef<'_>) -> Option<u64> {
    let bytes = raw.as_bytes().ok()?;
    match raw.format() {
        sqlx::postgres::PgValueFormat::Binary => <[u8; 8]>::try_from(bytes).ok().map(u64::from_be_bytes),
        sqlx::postgres::PgValueFormat::Text => crate::domain::cursor::parse_xid(std::str::from_utf8(bytes).ok()?),
    }
}

/// A date or timestamp read from PostgreSQL's binary form without the driver's arithmetic, which
/// overflows (and panics) on `infinity`, `-infinity` and years past chrono's range.
enum Moment {
    /// `"infinity"` or `"-infinity"`: delivered as that string.
    Infinite(&'static str),
    /// A finite value chrono cannot hold.
    OutOfRange,
    Date(NaiveDate),
    /// A timestamp (a timestamptz is this in UTC).
    Naive(NaiveDateTime),
    /// Not the binary form: left to the driver's text decoding.
    Text,
}

fn decode_moment(raw: &sqlx::postgres::PgValueRef<'_>, type_name: &str) -> Moment {
    if !matches!(raw.format(), sqlx::postgres::PgValueFormat::Binary) {
        return Moment::Text;
    }
    let Ok(bytes) = raw.as_bytes() else {
        return Moment::OutOfRange;
    };
    let epoch = NaiveDate::from_ymd_opt(2000, 1, 1).expect("a valid date");
    if type_name == "DATE" {
        let Ok(days) = <[u8; 4]>::try_from(bytes).map(i32::from_be_bytes) else {
            return Moment::OutOfRange;
        };
        return match days {
            i32::MAX => Moment::Infinite("infinity"),
            i32::MIN => Moment::Infinite("-infinity"),
            _ => epoch
                .checked_add_signed(chrono::Duration::days(i64::from(days)))
                .map(Moment::Date)
                .unwrap_or(Moment::OutOfRange),
        };
    }
    let Ok(micros) = <[u8; 8]>::try_from(bytes).map(i64::from_be_bytes) else {
        return Moment::OutOfRange;
    };
    match micros {
        i64::MAX => Moment::Infinite("infinity"),
        i64::MIN => Moment::Infinite("-infinity"),
        _ => epoch
            .and_hms_opt(0, 0, 0)
            .expect("midnight")
            .checked_add_signed(chrono::Duration::microseconds(micros))
            .map(Moment::Naive)
            .unwrap_or(Moment::OutOfRange),
    }
}

/// Formats PostgreSQL's binary NUMERIC (base-10000 digit groups, a weight, a sign and a display
/// scale) as its text form.
pub fn numeric_text(bytes: &[u8]) -> Option<String> {
    let word =
        |offset: usize| -> Option<u16> { Some(u16::from_be_bytes([*bytes.get(offset)?, *bytes.get(offset + 1)?])) };
    let digit_count = usize::from(word(0)?);
    let weight = i64::from(word(2)? as i16);
    let sign = word(4)?;
    let scale = usize::from(word(6)?);
    match sign {
        0xC000 => return Some("NaN".to_string()),
        0xD000 => return Some("Infinity".to_string()),
        0xF000 => return Some("-Infinity".to_string()),
        0x0000 | 0x4000 => {}
        _ => return None,
    }
    let mut digits = Vec::with_capacity(digit_count);
    for index in 0..digit_count {
        digits.push(word(8 + 2 * index)?);
    }
    let group = |index: i64| -> u16 { if index < 0 { 0 } else { digits.get(index as usize).copied().unwrap_or(0) } };
    let mut text = String::new();
    if sign == 0x4000 {
        text.push('-');
    }
    if weight < 0 {
        text.push('0');
    } else {
        for index in 0..=weight {
            if index == 0 {
                text.push_str(&group(index).to_string());
            } else {
                text.push_str(&format!("{:04}", group(index)));
            }
        }
    }
    if scale > 0 {
        let mut fraction = String::new();
        for position in 1..=scale.div_ceil(4) as i64 {
            fraction.push_str(&format!("{:04}", group(weight + position)));
        }
        fraction.truncate(scale);
        text.push('.');
        text.push_str(&fraction);
    }
    Some(text)
}

impl super::ColumnDecoder<PgRow> for PostgresSource {
    fn decode_column<'r>(&self, row: &'r PgRow, index: usize, name: &str) -> Result<Decoded<'r>, SourceError> {
        decode_value(row, index, name, row.columns()[index].type_info().name())
    }

    fn column_type(&self, row: &PgRow, index: usize) -> String {
        row.columns()[index].type_info().name().to_string()
    }
}

super::sql_source!(PostgresSource);

#[cfg(test)]
mod tests {
    use super::numeric_text;

    fn encode(weight: i16, sign: u16, scale: u16, digits: &[u16]) -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend((digits.len() as u16).to_be_bytes());
        bytes.extend(weight.to_be_bytes());
        bytes.extend(sign.to_be_bytes());
        bytes.extend(scale.to_be_bytes());
        for digit in digits {
            bytes.extend(digit.to_be_bytes());
        }
        bytes
    }

    #[test]
    fn numerics_print_like_postgres() {
        // 12345678901234567890.0123456789 with scale 10
        assert_eq!(
            numeric_text(&encode(4, 0, 10, &[1234, 5678, 9012, 3456, 7890, 123, 4567, 8900])).unwrap(),
            "12345678901234567890.0123456789"
        );
        assert_eq!(numeric_text(&encode(-1, 0x4000, 3, &[50])).unwrap(), "-0.005");
        assert_eq!(numeric_text(&encode(0, 0, 2, &[7])).unwrap(), "7.00");
        assert_eq!(numeric_text(&encode(1, 0, 0, &[1])).unwrap(), "10000");
        assert_eq!(numeric_text(&encode(0, 0, 0, &[])).unwrap(), "0");
        assert_eq!(numeric_text(&encode(0, 0xC000, 0, &[])).unwrap(), "NaN");
        assert_eq!(numeric_text(&[0, 1]), None);
    }
}
