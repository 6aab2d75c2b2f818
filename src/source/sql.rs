//! The body every sqlx engine's [`Source`](super::Source) shares: a question under the query
//! timeout, the [`sql_source!`] implementation of the trait, the settle and index warnings, the
//! generation query and the backlog's count.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};

use chrono::{DateTime, NaiveDateTime, Utc};
use serde_json::Value;
use sqlx::{Database, Encode, Type};

use super::kept::{Kept, Way};
use super::pools::{self, HeldConnection};
use super::position::bind_position;
use super::query::SeekQuery;
use super::{ColumnDecoder, Decoded, Fetched, SourceError, classify};
use crate::config::SourceConfig;
use crate::config::redact::Redaction;
use crate::domain::{CursorValue, Position};

/// Runs a source question under the source's query timeout, holding a permit of the target's cap
/// while it runs.
pub(crate) async fn timed<T, F>(
    gate: &pools::Gate,
    config: &SourceConfig,
    location: &str,
    work: F,
) -> Result<T, SourceError>
where
    F: Future<Output = Result<T, SourceError>>,
{
    let held = |permit| async move {
        let _permit = permit;
        work.await
    };
    timed_holding(gate, config, location, held).await
}

/// Runs the question `work` makes of the permit under the source's query timeout: a question that
/// takes its connection with the permit ([`pools::Permit::connect`]) keeps the permit with the
/// connection when it is cancelled.
pub(crate) async fn timed_holding<T, W, F>(
    gate: &pools::Gate,
    config: &SourceConfig,
    location: &str,
    work: W,
) -> Result<T, SourceError>
where
    W: FnOnce(pools::Permit) -> F,
    F: Future<Output = Result<T, SourceError>>,
{
    // A connection of the shared target first: waiting for one is not part of the query's time.
    let permit = gate.enter(location).await?;
    within_timeout(config, location, work(permit)).await
}

/// Runs `work` under the source's query timeout: dropped (and its query interrupted) when it
/// outlasts it.
async fn within_timeout<T, F>(config: &SourceConfig, location: &str, work: F) -> Result<T, SourceError>
where
    F: Future<Output = Result<T, SourceError>>,
{
    match tokio::time::timeout(config.query_timeout, work).await {
        Ok(result) => result,
        Err(_) => Err(SourceError::Timeout { location: location.to_string(), seconds: config.query_timeout.as_secs() }),
    }
}

/// A delivering read of an sqlx engine ([`guarded_fetch`]'s, with its connection kept between a
/// tick's reads: see [`super::kept`]): on the connection the previous read kept, which holds its
/// permit (so no wait for one), else on one taken with a permit; under the query timeout either
/// way. Once it answered, its connection is kept for the next read or given back.
pub(crate) async fn kept_fetch<DB, W, F>(
    gate: &pools::Gate,
    kept: &Kept<DB>,
    config: &SourceConfig,
    location: &str,
    settle_warned: &AtomicBool,
    fetch: W,
) -> Result<Fetched, SourceError>
where
    DB: Database,
    W: FnOnce(Way<DB>) -> F,
    F: Future<Output = Result<(Fetched, HeldConnection<DB>), SourceError>>,
{
    let answered = match kept.take() {
        Some(way) => within_timeout(config, location, fetch(way)).await,
        None => timed_holding(gate, config, location, |permit| fetch(Way::Take(permit))).await,
    };
    let (fetched, connection) = answered?;
    kept.after_read(connection, fetched.full, gate.free_permits());
    warn_if_settle_ignored(config, &fetched, settle_warned, location);
    Ok(fetched)
}

/// A question's fetch whose connection goes back to the pool once it answered.
pub(crate) async fn given_back<DB: Database>(
    fetch: impl Future<Output = Result<(Fetched, HeldConnection<DB>), SourceError>>,
) -> Result<Fetched, SourceError> {
    let (fetched, connection) = fetch.await?;
    connection.finish();
    Ok(fetched)
}

/// The [`Source`] of an engine: every engine's source has the same fields (`gate`, `kept`,
/// `config`, `redaction`, `settle_warned`, `row_sizes`), `pool()` and `seek()` methods (the SQL
/// learnt once) and a [`ColumnDecoder`] for its rows, so one body serves them all.
macro_rules! sql_source {
    ($source:ty) => {
        #[async_trait::async_trait]
        impl $crate::source::Source for $source {
            async fn read(
                &self,
                probe: $crate::source::Probe,
                after: Option<&$crate::domain::Position>,
                limit: $crate::source::FetchLimit,
            ) -> Result<$crate::source::Fetched, $crate::source::SourceError> {
                let fetch = |way| async move {
                    let seek = self.seek().await?;
                    // `settle: "auto"`: the bound is asked for before the rows, in its own
                    // statement, so that the rows' snapshot is taken after it (see `horizon`).
                    let bound = if seek.binds_bound(probe) { Some(self.settle_bound().await?) } else { None };
                    $crate::source::fetch_rows(
                        self.pool(),
                        &self.config,
                        seek,
                        probe,
                        after,
                        bound.as_ref(),
                        limit,
                        &self.redaction,
                        self,
                        &self.row_sizes,
                        way,
                    )
                    .await
                };
                let location = &self.redaction.location;
                match probe {
                    $crate::source::Probe::Deliver => {
                        $crate::source::kept_fetch(
                            &self.gate,
                            &self.kept,
                            &self.config,
                            location,
                            &self.settle_warned,
                            fetch,
                        )
                        .await
                    }
                    $crate::source::Probe::Pending | $crate::source::Probe::Last => {
                        let given_back = |permit| $crate::source::given_back(fetch($crate::source::Way::Take(permit)));
                        $crate::source::timed_holding(&self.gate, &self.config, location, given_back).await
                    }
                }
            }

            async fn tick_ended(&self) -> Result<(), $crate::source::SourceError> {
                self.kept.release();
                Ok(())
            }

            fn end_reads(&self) {
                self.kept.release();
            }

            async fn count_after(
                &self,
                after: Option<&$crate::domain::Position>,
                cap: u64,
            ) -> Result<u64, $crate::source::SourceError> {
                let count = |permit| async move {
                    let seek = self.seek().await?;
                    if let Some(position) = after {
                        $crate::source::position::check_key(&self.config, position)?;
                        $crate::source::position::check_xid_kind(seek.is_xid(), position)?;
                    }
                    $crate::source::count_rows(self.pool(), permit, seek, after, cap, &self.redaction).await
                };
                $crate::source::timed_holding(&self.gate, &self.config, &self.redaction.location, count).await
            }

            async fn generation(&self) -> Result<Option<serde_json::Value>, $crate::source::SourceError> {
                let Some(generation) = &self.config.generation else {
                    return Ok(None);
                };
                let value = $crate::source::fetch_scalar(self.pool(), &generation.query, &self.redaction, self);
                $crate::source::timed(&self.gate, &self.config, &self.redaction.location, value).await.map(Some)
            }

            async fn horizon_holder(
                &self,
            ) -> Result<Option<$crate::domain::horizon::HorizonHolder>, $crate::source::SourceError> {
                let holder = async {
                    let seek = self.seek().await?;
                    self.holder(seek).await
                };
                $crate::source::timed(&self.gate, &self.config, &self.redaction.location, holder).await
            }

            fn describe(&self) -> String {
                self.redaction.location.clone()
            }

            fn connection_wait(&self) -> std::time::Duration {
                self.gate.take_waited()
            }

            async fn tally_buckets(
                &self,
                check: &$crate::source::BucketCheck,
            ) -> Result<Option<Vec<$crate::domain::late::Tally>>, $crate::source::SourceError> {
                let work = async {
                    let seek = self.seek().await?;
                    $crate::source::late::tally_buckets(self.pool(), &self.config, &seek.plan, check, &self.redaction)
                        .await
                        .map(Some)
                };
                $crate::source::timed(&self.gate, &self.config, &self.redaction.location, work).await
            }

            async fn read_bucket(
                &self,
                range: &$crate::source::BucketRange,
                after: Option<&$crate::domain::Position>,
                limit: $crate::source::FetchLimit,
            ) -> Result<$crate::source::Fetched, $crate::source::SourceError> {
                let work = async {
                    let seek = self.seek().await?;
                    $crate::source::late::read_bucket(
                        self.pool(),
                        &self.config,
                        &seek.plan,
                        range,
                        after,
                        limit,
                        &self.redaction,
                        self,
                    )
                    .await
                };
                $crate::source::timed(&self.gate, &self.config, &self.redaction.location, work).await
            }
        }
    };
}
pub(crate) use sql_source;

/// Runs an engine's fetch under the source's query timeout (a query that does not answer in time
/// is cancelled: its future dropped, which closes the connection), and says once when
/// `settleSeconds` cannot apply to what it returned.
pub(crate) async fn guarded_fetch<W, F>(
    gate: &pools::Gate,
    config: &SourceConfig,
    location: &str,
    settle_warned: &AtomicBool,
    fetch: W,
) -> Result<Fetched, SourceError>
where
    W: FnOnce(pools::Permit) -> F,
    F: Future<Output = Result<Fetched, SourceError>>,
{
    let fetched = timed_holding(gate, config, location, fetch).await?;
    warn_if_settle_ignored(config, &fetched, settle_warned, location);
    Ok(fetched)
}

/// Warns once per source when `settleSeconds` was set but the cursor turned out to be an integer:
/// settle holds back young timestamps only. What protects an integer cursor from late commits is
/// that its values are handed out in commit order (a sequence read after commit, or a version
/// bumped inside the writing transaction); an identity or auto-increment column alone is not.
fn warn_if_settle_ignored(config: &SourceConfig, fetched: &Fetched, warned: &AtomicBool, location: &str) {
    if !config.settle_configured || config.settle.is_zero() {
        return;
    }
    let Some(first) = fetched.rows.first() else {
        return;
    };
    let kind = &first.position.cursor;
    if matches!(kind, CursorValue::Integer(_) | CursorValue::Xid(_)) && !warned.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            source = %location,
            cursor = %config.cursor,
            settle_seconds = config.settle.as_secs(),
            "settleSeconds applies to timestamp cursors only: this {} cursor is read without it (see docs/sources.md, \"Integer cursors\")",
            kind.kind()
        );
    }
}

/// The pre-flight's warning when no index starts with the cursor column.
pub(crate) fn warn_missing_index(location: &str, table: &str, config: &SourceConfig) {
    tracing::warn!(
        source = %location,
        table = %table,
        "no index starts with the cursor column {:?}: each batch scans the table; create one on ({}, {})",
        config.cursor,
        config.cursor,
        config.pk.join(", ")
    );
}

/// Runs `sql` and returns its one value: the first column of the first row (`null` without a
/// row), which must be text, an integer or null.
pub(crate) async fn fetch_scalar<DB, D>(
    pool: &sqlx::Pool<DB>,
    sql: &str,
    redaction: &Redaction,
    decoder: &D,
) -> Result<Value, SourceError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    D: ColumnDecoder<DB::Row> + Sync,
{
    let row =
        sqlx::query(sqlx::AssertSqlSafe(sql)).fetch_optional(pool).await.map_err(|error| classify(redaction, error))?;
    let Some(row) = row else {
        return Ok(Value::Null);
    };
    let columns = sqlx::Row::columns(&row);
    if columns.len() != 1 {
        return Err(generation_columns_error(columns.len(), redaction));
    }
    let name = sqlx::Column::name(&columns[0]).to_string();
    let decoded = decoder.decode_column(&row, 0, &name)?;
    generation_of(decoded, || decoder.column_type(&row, 0), redaction)
}

/// A generation query must return one column.
pub(crate) fn generation_columns_error(columns: usize, redaction: &Redaction) -> SourceError {
    SourceError::Query {
        location: redaction.location.clone(),
        reason: format!("source.generation.query returned {columns} columns: it must return one value"),
    }
}

/// The generation a generation query's value names: text, an integer or null (`type_name` names
/// the value's type for the error).
pub(crate) fn generation_of(
    decoded: Decoded<'_>,
    type_name: impl FnOnce() -> String,
    redaction: &Redaction,
) -> Result<Value, SourceError> {
    match decoded.json.into_value() {
        value @ (Value::Null | Value::String(_)) => Ok(value),
        Value::Number(number) if number.is_i64() || number.is_u64() => Ok(Value::Number(number)),
        other => Err(SourceError::Query {
            location: redaction.location.clone(),
            reason: format!(
                "source.generation.query returned {other} ({}): it must return text or an integer",
                type_name()
            ),
        }),
    }
}

/// Counts the rows after `after` (settled or not), up to `cap`.
pub(crate) async fn count_rows<DB>(
    pool: &sqlx::Pool<DB>,
    permit: pools::Permit,
    seek: &SeekQuery,
    after: Option<&Position>,
    cap: u64,
    redaction: &Redaction,
) -> Result<u64, SourceError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    i64: for<'t> Encode<'t, DB> + Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    DateTime<Utc>: for<'t> Encode<'t, DB> + Type<DB>,
    NaiveDateTime: for<'t> Encode<'t, DB> + Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let query = match after {
        None => sqlx::query(sqlx::AssertSqlSafe(seek.count_sql(false))),
        Some(position) => {
            bind_position(sqlx::query(sqlx::AssertSqlSafe(seek.count_sql(true))), &seek.after_slots, position)?
        }
    };
    let cap = i64::try_from(cap).unwrap_or(i64::MAX);
    let mut connection = permit.connect(pool).await.map_err(|error| classify(redaction, error))?;
    let row =
        query.bind(cap).fetch_one(&mut **connection.pooled()).await.map_err(|error| classify(redaction, error))?;
    connection.finish();
    let count: i64 = sqlx::Row::try_get_unchecked(&row, 0usize).map_err(|error| classify(redaction, error))?;
    Ok(count.max(0) as u64)
}
