//! MySQL and MariaDB through sqlx. The session runs in UTC (sqlx sets `time_zone='+00:00'`), so a
//! TIMESTAMP column reads as a point in time and a DATETIME as a naive timestamp, each bound back
//! as its own type.

use std::str::FromStr;
use std::sync::atomic::AtomicBool;

use base64::Engine as _;
use chrono::{DateTime, NaiveDate, NaiveDateTime, NaiveTime, Utc};
use serde_json::Value;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlRow, MySqlTypeInfo};
use sqlx::{Column, Executor, Row, SqlSafeStr, Statement, TypeInfo, ValueRef};
use tokio::sync::OnceCell;

use super::query::{CursorType, SeekPlan, SeekQuery, build_seek};
use super::{Decoded, SourceError, classify, warn_missing_index};
use crate::config::redact::Redaction;
use crate::config::{SourceConfig, SourceTarget};
use crate::domain::CursorValue;
use crate::domain::horizon::HorizonHolder;

pub struct MySqlSource {
    /// The connection options of the target; the pool itself is the target's, made at first use.
    options: MySqlConnectOptions,
    gate: super::pools::Gate,
    /// The connection a tick's delivering reads keep between them.
    kept: super::Kept<sqlx::MySql>,
    config: SourceConfig,
    redaction: Redaction,
    query: OnceCell<SeekQuery>,
    settle_warned: AtomicBool,
    /// `settle: "auto"` said once that this account cannot read INNODB_TRX.
    horizon_warned: AtomicBool,
    /// The size of the rows read last, to size the next LIMIT by (`batch.maxBytes`).
    row_sizes: super::RowSizes,
}

impl MySqlSource {
    pub(crate) fn open(config: &SourceConfig, gate: super::pools::Gate) -> Result<Self, SourceError> {
        let redaction = Redaction::of_url(config.url.expose());
        let options = MySqlConnectOptions::from_str(config.url.expose())
            .map_err(|error| SourceError::Unreachable {
                location: redaction.location.clone(),
                reason: redaction.scrub(&error.to_string()),
            })?
            .timezone(Some("+00:00".to_string()));
        Ok(MySqlSource {
            options,
            gate,
            kept: super::Kept::default(),
            config: config.clone(),
            redaction,
            query: OnceCell::new(),
            settle_warned: AtomicBool::new(false),
            horizon_warned: AtomicBool::new(false),
            row_sizes: super::RowSizes::default(),
        })
    }

    /// The target's pool, made by its first user. Every session is read-only: a poller only reads.
    fn pool(&self) -> &MySqlPool {
        let target = self.gate.target().expect("a MySQL source has a shared target");
        target.mysql.get_or_init(|| {
            target
                .pool_options()
                .after_connect(|connection: &mut sqlx::MySqlConnection, _| {
                    Box::pin(async move {
                        connection.execute("SET SESSION TRANSACTION READ ONLY").await?;
                        Ok(())
                    })
                })
                .connect_lazy_with(target.mysql_login(self.options.clone()))
        })
    }

    /// `settle: "auto"`'s bound, asked for before each read (see [`super::horizon`]).
    async fn settle_bound(&self) -> Result<CursorValue, SourceError> {
        let seek = self.seek().await?;
        super::horizon::mysql_bound(self.pool(), &self.config, seek.cursor_type, &self.redaction, &self.horizon_warned)
            .await
    }

    /// The oldest InnoDB transaction, which holds `settle: "auto"`'s bound.
    async fn holder(&self, seek: &SeekQuery) -> Result<Option<HorizonHolder>, SourceError> {
        if !seek.bound {
            return Ok(None);
        }
        super::horizon::mysql_holder(self.pool(), &self.redaction).await
    }

    async fn seek(&self) -> Result<&SeekQuery, SourceError> {
        self.query.get_or_try_init(|| self.preflight()).await
    }

    async fn preflight(&self) -> Result<SeekQuery, SourceError> {
        let probe = build_seek(&self.config, &SeekPlan { cursor_type: CursorType::Integer, placeholder_types: None });
        let statement = self
            .pool()
            .prepare(sqlx::AssertSqlSafe(probe.from_start).into_sql_str())
            .await
            .map_err(|error| classify(&self.redaction, error))?;
        let cursor_type_name = statement
            .columns()
            .iter()
            .find(|candidate| candidate.name() == self.config.cursor)
            .map(|found| type_name(found.type_info()).to_string())
            .ok_or_else(|| {
                SourceError::Position(format!(
                    "column {:?} is not in the result of the source query",
                    self.config.cursor
                ))
            })?;
        let cursor_type = match cursor_type_name.as_str() {
            "TIMESTAMP" => CursorType::Timestamp,
            "DATETIME" => CursorType::NaiveTimestamp,
            name if name.contains("INT") => CursorType::Integer,
            other => {
                return Err(SourceError::Position(format!(
                    "cursor column {:?} has type {other}: use an integer or a timestamp column",
                    self.config.cursor
                )));
            }
        };
        super::query::check_cursor_rules(&self.config, cursor_type, &cursor_type_name)?;
        if self.config.settle_mode == crate::config::source::SettleMode::Auto {
            super::horizon::mysql_check_server(self.pool(), &self.redaction).await?;
        }
        if let SourceTarget::Table { schema, name } = &self.config.target {
            let indexed: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.statistics \
                 WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ? AND seq_in_index = 1 AND column_name = ?",
            )
            .bind(schema.as_deref())
            .bind(name)
            .bind(&self.config.cursor)
            .fetch_one(self.pool())
            .await
            .map_err(|error| classify(&self.redaction, error))?;
            if indexed == 0 {
                warn_missing_index(&self.redaction.location, name, &self.config);
            }
        }
        Ok(build_seek(&self.config, &SeekPlan { cursor_type, placeholder_types: None }))
    }
}

/// The column's type as the decoder names it. The driver calls a string column binary when the wire
/// sets its BINARY flag, which the server also sets for text in a binary *collation* (`utf8mb4_bin`,
/// MariaDB's `JSON`): such a column is text unless its character set is `binary` (63), the only one
/// whose bytes are not text. The driver keeps the character set private; its `Debug` form shows it
/// (`sources::mariadb_text_with_a_binary_collation_stays_text` holds this reading).
fn type_name(info: &MySqlTypeInfo) -> &str {
    let name = info.name();
    let text = match name {
        "BINARY" => "CHAR",
        "VARBINARY" => "VARCHAR",
        "TINYBLOB" => "TINYTEXT",
        "BLOB" => "TEXT",
        "MEDIUMBLOB" => "MEDIUMTEXT",
        "LONGBLOB" => "LONGTEXT",
        _ => return name,
    };
    if character_set(info).is_some_and(|set| set != BINARY_CHARACTER_SET) { text } else { name }
}

/// The `binary` character set's number on the wire.
const BINARY_CHARACTER_SET: u16 = 63;

/// The character set number the driver read for the column, from its `Debug` form
/// (`collation: Collation(46)`); `None` if that form changes, and the driver's own name stands.
fn character_set(info: &MySqlTypeInfo) -> Option<u16> {
    let shown = format!("{info:?}");
    let (_, after) = shown.split_once("collation: Collation(")?;
    after.split_once(')')?.0.parse().ok()
}

fn decode_value<'r>(row: &'r MySqlRow, index: usize, name: &str, type_name: &str) -> Result<Decoded<'r>, SourceError> {
    let raw = row.try_get_raw(index).map_err(|error| SourceError::Position(format!("column {name:?}: {error}")))?;
    if raw.is_null() {
        return Ok(Decoded::plain(Value::Null));
    }
    let failed = |error: sqlx::Error| SourceError::UnsupportedType {
        column: name.to_string(),
        type_name: format!("{type_name} ({error})"),
    };
    let decoded = match type_name {
        "BOOLEAN" => Decoded::plain(Value::from(row.try_get_unchecked::<i8, _>(index).map_err(failed)? != 0)),
        "TINYINT" | "SMALLINT" | "INT" | "MEDIUMINT" | "BIGINT" => {
            Decoded::integer(row.try_get_unchecked::<i64, _>(index).map_err(failed)?)
        }
        "TINYINT UNSIGNED" | "SMALLINT UNSIGNED" | "INT UNSIGNED" | "MEDIUMINT UNSIGNED" | "BIGINT UNSIGNED"
        | "YEAR" => {
            let number = row.try_get_unchecked::<u64, _>(index).map_err(failed)?;
            match i64::try_from(number) {
                Ok(signed) => Decoded::integer(signed),
                Err(_) => Decoded::plain(Value::from(number)),
            }
        }
        "FLOAT" => Decoded::float(f64::from(row.try_get_unchecked::<f32, _>(index).map_err(failed)?)),
        "DOUBLE" => Decoded::float(row.try_get_unchecked::<f64, _>(index).map_err(failed)?),
        // As a string: no precision is lost.
        "DECIMAL" => Decoded::plain(Value::from(
            row.try_get_unchecked::<sqlx::types::BigDecimal, _>(index).map_err(failed)?.to_string(),
        )),
        "CHAR" | "VARCHAR" | "TEXT" | "TINYTEXT" | "MEDIUMTEXT" | "LONGTEXT" | "ENUM" | "SET" => {
            Decoded::borrowed_text(row.try_get_unchecked::<&str, _>(index).map_err(failed)?)
        }
        "JSON" => Decoded::plain(row.try_get_unchecked::<Value, _>(index).map_err(failed)?),
        "BINARY" | "VARBINARY" | "TINYBLOB" | "BLOB" | "MEDIUMBLOB" | "LONGBLOB" | "BIT" => {
            Decoded::plain(Value::from(
                base64::engine::general_purpose::STANDARD
                    .encode(row.try_get_unchecked::<Vec<u8>, _>(index).map_err(failed)?),
            ))
        }
        "DATE" => {
            Decoded::plain(Value::from(row.try_get_unchecked::<NaiveDate, _>(index).map_err(failed)?.to_string()))
        }
        "TIME" => {
            Decoded::plain(Value::from(row.try_get_unchecked::<NaiveTime, _>(index).map_err(failed)?.to_string()))
        }
        "DATETIME" => Decoded::naive_timestamp(row.try_get_unchecked::<NaiveDateTime, _>(index).map_err(failed)?),
        "TIMESTAMP" => Decoded::timestamp(row.try_get_unchecked::<DateTime<Utc>, _>(index).map_err(failed)?),
        other => {
            return Err(SourceError::UnsupportedType { column: name.to_string(), type_name: other.to_string() });
        }
    };
    Ok(decoded)
}

impl super::ColumnDecoder<MySqlRow> for MySqlSource {
    fn decode_column<'r>(&self, row: &'r MySqlRow, index: usize, name: &str) -> Result<Decoded<'r>, SourceError> {
        decode_value(row, index, name, type_name(row.columns()[index].type_info()))
    }

    fn column_type(&self, row: &MySqlRow, index: usize) -> String {
        type_name(row.columns()[index].type_info()).to_string()
    }
}

super::sql_source!(MySqlSource);
