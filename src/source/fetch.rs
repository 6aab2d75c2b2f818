//! One fetch of rows through sqlx (PostgreSQL, MySQL/MariaDB), bounded by rows and by bytes.
//!
//! A byte budget that only stops the reading bounds memory, not what the database sends: sqlx
//! reads (and drops) the rest of a result before the connection's next use, so a `LIMIT
//! batch.size` over megabyte rows moved the whole LIMIT to deliver a few rows (issue 24, item 14:
//! 56 MB from PostgreSQL and 77 MB from MariaDB for two fetches of four 1 MiB rows). So the LIMIT
//! asked for is derived from the size of the rows the source read last: about what fills the byte
//! budget, never more than `batch.size`, and one row for a source's first query, to learn it. A
//! fetch asks again (after its last row) while the budget is not filled and the database had as
//! many rows as asked. Should rows grow between two queries, so that reading stops with much of
//! a result unread, the connection is closed instead of drained.

use std::sync::atomic::{AtomicUsize, Ordering};

use chrono::{DateTime, NaiveDateTime, Utc};
use futures::TryStreamExt;
use sqlx::{Database, Encode, Type};

use super::kept::Way;
use super::pools::HeldConnection;
use super::position::{self, bind_position};
use super::query::{Probe, SeekQuery};
use super::{ColumnDecoder, Decoded, FetchLimit, Fetched, Layout, RowBuilder, SourceError, classify};
use crate::config::SourceConfig;
use crate::config::redact::Redaction;
use crate::domain::{CursorValue, Position};

/// Rows a stopped read may leave unread, in bytes, and still keep its connection idle for the
/// tick's next read: what the socket's buffers take, so that the server's query has ended. More,
/// and the server may still be sending, its query open (its snapshot, its locks) until drained.
const KEEP_UNREAD_AT_MOST_BYTES: usize = 64 * 1024;

/// Rows a stopped read may leave unread, in bytes, before closing the connection is cheaper
/// than draining them (a new connection costs a handshake; a megabyte on loopback is ~1 ms).
const DRAIN_AT_MOST_BYTES: usize = 1 << 20;

/// The size of the largest row of a source's last query (as JSON, with its event's overhead):
/// what the next LIMIT is derived from. Zero before the first.
#[derive(Debug, Default)]
pub(crate) struct RowSizes {
    largest: AtomicUsize,
}

impl RowSizes {
    /// How many rows to ask for, to fill `rows_left` rows or `bytes_left` bytes: enough rows of
    /// the last size seen to reach the byte budget (the row that reaches it is kept), at least
    /// one, at most `rows_left`. One while no size is known.
    fn rows_to_ask(&self, rows_left: usize, bytes_left: usize) -> usize {
        let largest = self.largest.load(Ordering::Relaxed);
        if largest == 0 {
            return 1;
        }
        (bytes_left / largest).saturating_add(1).clamp(1, rows_left.max(1))
    }

    fn observe(&self, largest: usize) {
        if largest > 0 {
            self.largest.store(largest, Ordering::Relaxed);
        }
    }
}

/// Runs `probe`'s query, from the start or after `after`, and decodes rows with `decoder` as they
/// stream in, writing each row's JSON as its values come, stopping at `limit.rows` rows or once
/// they add up to `limit.bytes`; each query's LIMIT sized by `sizes`. One body for every engine.
/// `bound` is what `settle: "auto"` computed before this fetch (every query of it binds the same).
/// The connection comes `way`: taken with the question's permit (which goes with it), or kept by
/// the tick's previous read. A fetch that answered returns its connection, idle, for the caller to
/// give back or keep; one that failed lets it go (its permit waits for it to be idle or closed).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn fetch_rows<DB, D>(
    pool: &sqlx::Pool<DB>,
    config: &SourceConfig,
    seek: &SeekQuery,
    probe: Probe,
    after: Option<&Position>,
    bound: Option<&CursorValue>,
    limit: FetchLimit,
    redaction: &Redaction,
    decoder: &D,
    sizes: &RowSizes,
    way: Way<DB>,
) -> Result<(Fetched, HeldConnection<DB>), SourceError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    DateTime<Utc>: for<'t> Encode<'t, DB> + Type<DB>,
    NaiveDateTime: for<'t> Encode<'t, DB> + Type<DB>,
    D: ColumnDecoder<DB::Row> + Sync,
{
    let after = if probe == Probe::Last { None } else { after };
    if let Some(position) = after {
        position::check_key(config, position)?;
        position::check_xid_kind(seek.is_xid(), position)?;
    }
    let bound = match (seek.binds_bound(probe), bound) {
        (false, _) => None,
        (true, Some(bound)) => Some(bound),
        (true, None) => {
            return Err(SourceError::Query {
                location: redaction.location.clone(),
                reason: "settle \"auto\": no bound was computed for this read".into(),
            });
        }
    };
    let mut connection = way.connect(pool).await.map_err(|error| classify(redaction, error))?;
    // A failed read may have left rows unread, and a dropped one a query running: the connection
    // is dropped unfinished, and its permit waits for it.
    let fetched =
        read_rows(&mut connection, config, seek, probe, after, bound, limit, redaction, decoder, sizes).await?;
    Ok((fetched, connection))
}

/// [`fetch_rows`]'s reading, on its connection.
#[allow(clippy::too_many_arguments)]
async fn read_rows<DB, D>(
    connection: &mut HeldConnection<DB>,
    config: &SourceConfig,
    seek: &SeekQuery,
    probe: Probe,
    after: Option<&Position>,
    bound: Option<&CursorValue>,
    limit: FetchLimit,
    redaction: &Redaction,
    decoder: &D,
    sizes: &RowSizes,
) -> Result<Fetched, SourceError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    DateTime<Utc>: for<'t> Encode<'t, DB> + Type<DB>,
    NaiveDateTime: for<'t> Encode<'t, DB> + Type<DB>,
    D: ColumnDecoder<DB::Row> + Sync,
{
    let mut collected: Option<Collector<'_>> = None;
    let mut from: Option<Position> = after.cloned();
    loop {
        let (rows_so_far, bytes_so_far) = match &collected {
            Some(collector) => (collector.rows(), collector.bytes()),
            None => (0, 0),
        };
        let asked = sizes.rows_to_ask(limit.rows - rows_so_far, limit.bytes.saturating_sub(bytes_so_far));
        let mut query = match &from {
            None => sqlx::query(sqlx::AssertSqlSafe(seek.sql(probe, false))),
            Some(position) => {
                bind_position(sqlx::query(sqlx::AssertSqlSafe(seek.sql(probe, true))), &seek.after_slots, position)?
            }
        };
        if let Some(bound) = bound {
            query = position::bind_cursor(query, bound);
        }
        let mut stream = sqlx::Executor::fetch(&mut **connection.pooled(), query.bind(asked as i64));
        let mut returned = 0usize;
        let mut largest = 0usize;
        while let Some(row) = stream.try_next().await.map_err(|error| classify(redaction, error))? {
            if collected.is_none() {
                let names = sqlx::Row::columns(&row).iter().map(sqlx::Column::name);
                let layout = Layout::new(config, names)
                    .map_err(|reason| SourceError::Query { location: redaction.location.clone(), reason })?;
                collected = Some(Collector::new(config, layout, limit));
            }
            let collector = collected.as_mut().expect("made at the first row");
            let bytes_before = collector.bytes();
            let at_limit = collector.add(
                |index, name| decoder.decode_column(&row, index, name),
                |index| decoder.column_type(&row, index),
            )?;
            largest = largest.max(collector.bytes() - bytes_before);
            returned += 1;
            if at_limit {
                drop(stream);
                sizes.observe(largest);
                // The rest of this LIMIT is left to the next fetch; much of it unread is not
                // drained through the connection but dropped with it.
                if (asked - returned).saturating_mul(largest) > DRAIN_AT_MOST_BYTES {
                    connection.close_on_drop();
                } else if (asked - returned).saturating_mul(largest) > KEEP_UNREAD_AT_MOST_BYTES {
                    connection.left_unread();
                }
                let collector = collected.take().expect("made at the first row");
                return Ok(collector.finish(true));
            }
        }
        drop(stream);
        sizes.observe(largest);
        let Some(collector) = collected.as_ref() else {
            return Ok(Fetched::default());
        };
        // Fewer rows than asked: the source had no more. The last row is asked for alone.
        if returned < asked || probe == Probe::Last || collector.rows() >= limit.rows {
            return Ok(collected.take().expect("checked above").finish(false));
        }
        from = collector.last_position();
    }
}

/// The rows of one fetch as they are decoded, up to the fetch's limits: one body for every engine.
pub(crate) struct Collector<'a> {
    config: &'a SourceConfig,
    layout: Layout,
    limit: FetchLimit,
    fetched: Fetched,
    bytes: usize,
    /// Rows of one result are alike: each row's buffer starts as large as the last row needed.
    row_capacity: usize,
}

impl<'a> Collector<'a> {
    pub fn new(config: &'a SourceConfig, layout: Layout, limit: FetchLimit) -> Self {
        Collector {
            config,
            layout,
            limit,
            fetched: Fetched { rows: Vec::with_capacity(limit.rows.min(1024)), full: false },
            bytes: 0,
            row_capacity: 64,
        }
    }

    /// Adds the row whose columns `decode` reads (by index and name; `type_name` names a
    /// column's type, for messages). `true` when the rows now add up to the byte limit: the
    /// caller stops reading.
    pub fn add<'r>(
        &mut self,
        mut decode: impl FnMut(usize, &str) -> Result<Decoded<'r>, SourceError>,
        type_name: impl Fn(usize) -> String,
    ) -> Result<bool, SourceError> {
        let mut builder = RowBuilder::new(self.config, &self.layout, self.row_capacity);
        for (index, column) in self.layout.columns.iter().enumerate() {
            match decode(index, &column.name) {
                Ok(value) => builder.push(index, value, || type_name(index)),
                Err(error) => builder.fail(error),
            }
        }
        let (row, size) = builder.finish()?;
        self.row_capacity = row.row.len() + 16;
        self.fetched.rows.push(row);
        self.bytes += size;
        Ok(self.bytes >= self.limit.bytes)
    }

    /// The position of the last row collected.
    fn last_position(&self) -> Option<Position> {
        self.fetched.rows.last().map(|row| row.position.clone())
    }

    /// Rows collected so far.
    pub fn rows(&self) -> usize {
        self.fetched.rows.len()
    }

    /// Their bytes as JSON, with each event's overhead.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// What was read; `stopped` when reading stopped at the byte limit (more rows may follow).
    pub fn finish(mut self, stopped: bool) -> Fetched {
        self.fetched.full = stopped || self.fetched.rows.len() >= self.limit.rows;
        self.fetched
    }
}
