//! Where rows come from: a trait with one question, "the next rows after this position", and its
//! SQL implementations: PostgreSQL and MySQL/MariaDB over sqlx, SQLite over rusqlite. Dialect
//! differences live in [`query`] (the SQL) and in each engine's module (decoding values).
//!
//! Before its first seek a source runs a pre-flight, once: it prepares the query to learn the
//! cursor's type (which shapes the settle predicate and the placeholders' casts), and warns once
//! when no index starts with (cursor, pk...), since the seek's cost then grows with the table.
//!
//! | file          | holds                                                                       |
//! |---------------|-----------------------------------------------------------------------------|
//! | `mod.rs`      | [`Source`], what a fetch asks and returns, [`open`], [`backlog`]             |
//! | `error.rs`    | [`SourceError`], and what a driver's error means for the poller             |
//! | `sql.rs`      | the body every sqlx engine shares: timeouts, counts, the generation query   |
//! | `pool.rs`     | the base of every shared connection pool                                    |
//! | `pools.rs`    | the pools shared by the app's pollers of one database target, and their cap |
//! | `kept.rs`     | the connection a tick's delivering reads keep between them                  |
//! | `entra.rs`    | a password that is an Entra token of the managed identity, kept and renewed |
//! | `row.rs`      | a row put together from its decoded columns: layout, cursor, keys, op       |
//! | `fetch.rs`    | one fetch through sqlx, bounded by rows and by bytes                        |
//! | `query.rs`    | the SQL of the seek, per dialect                                            |
//! | `position.rs` | a position bound to the seek's placeholders; operator positions             |
//! | `horizon.rs`  | the commit horizon and `settle: "auto"`'s bound, and what holds them back   |
//! | `late.rs`     | the late-arrival recount: per-bucket tallies, a bucket re-read               |
//! | `ddl.rs`      | the DDL `dbtrigger sql` prints                                              |
//! | `logical/`    | the PostgreSQL logical-decoding source: pgoutput, the slot, its set-up      |
//! | `postgres.rs`, `mysql.rs`, `sqlite.rs` | each engine: its connection, pre-flight, decoding   |
//! | `sqlite_time.rs` | cursor texts as SQLite stores timestamps (its rows, operator positions)  |

pub mod binlog;
pub mod ddl;
pub mod entra;
mod error;
mod fetch;
pub mod horizon;
mod kept;
pub mod late;
pub mod logical;
pub mod mysql;
mod pool;
pub mod pools;
pub mod position;
pub mod postgres;
pub mod query;
mod row;
mod sql;
pub mod sqlite;
pub mod sqlite_time;

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;

use crate::config::{Engine, SourceConfig};
use crate::domain::late::Tally;
use crate::domain::{CursorValue, Position};
pub use error::SourceError;
pub(crate) use error::classify;
pub(crate) use fetch::{Collector, RowSizes, fetch_rows};
pub(crate) use kept::{Kept, Way};
pub use late::{BucketCheck, BucketRange};
pub(crate) use pool::pool_options;
pub use query::Probe;
pub(crate) use row::{ColumnDecoder, Decoded, Layout, RowBuilder};
pub(crate) use sql::{
    count_rows, fetch_scalar, generation_columns_error, generation_of, given_back, guarded_fetch, kept_fetch,
    sql_source, timed, timed_holding, warn_missing_index,
};

pub use crate::domain::event::{RowJson, SourceRow};

/// How much one fetch may return: a row count (the batch size) and a byte budget (the rows as
/// JSON), whichever is reached first. At least one row is returned whatever its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchLimit {
    pub rows: usize,
    pub bytes: usize,
}

/// How a stop on a purged binary log is recorded in the state document's `failure.slot_lost`
/// (the same stop-until-reset rule as a lost slot), before the file's name.
pub const BINLOG_LOST_PREFIX: &str = "binary log ";

/// Where a checkpoint is on the server read now, when a source read from a server's log (a
/// binary log) finds that the log under it changed ([`Source::rebase`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Rebase {
    /// The checkpoint as it now is (`None`: it stays as it is).
    pub checkpoint: Option<Position>,
    /// The server the checkpoint is read on from now on, recorded as the document's `generation`.
    pub server: Value,
    /// What happened, for the document's history and a warning (`None`: nothing an operator needs
    /// to see: the server recorded for the first time, a checkpoint completed).
    pub what: Option<String>,
}

/// Whether a stored position fits the source's key ([`Position::fits_key`]): a binary-log
/// source's position on MariaDB carries its GTIDs after the configured ordinal.
pub fn fits_source_key(config: &SourceConfig, position: &Position) -> Result<(), crate::domain::cursor::KeyMismatch> {
    if matches!(config.target, crate::config::SourceTarget::Binlog { .. }) && binlog::key_of(position).is_ok() {
        return Ok(());
    }
    position.fits_key(&config.pk)
}

/// What one fetch returned.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Fetched {
    pub rows: Vec<SourceRow>,
    /// The fetch stopped at a limit, so more rows may follow; `false` means the source had no more
    /// rows when it was read (no need to ask again this tick).
    pub full: bool,
}

#[async_trait]
pub trait Source: Send + Sync {
    /// The rows `probe` asks for, strictly after `after` (from the start when `None`), in
    /// (cursor, pk...) order (the last row first for [`Probe::Last`]), up to `limit`.
    async fn read(&self, probe: Probe, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError>;

    /// How many rows come after `after`, settled or not, counted up to `cap`.
    async fn count_after(&self, after: Option<&Position>, cap: u64) -> Result<u64, SourceError>;

    /// The most [`Source::count_after`] counts whatever the cap asked (a count there is "at
    /// least").
    fn count_limit(&self) -> u64 {
        u64::MAX
    }

    /// The tick is over (its last commit made): a source that holds something on the server
    /// between reads (a logical source's open peek) lets it go, and moves its own position as far
    /// as the commits allow (under the lease only: see [`Source::fence`]).
    async fn tick_ended(&self) -> Result<(), SourceError> {
        Ok(())
    }

    /// The tick's delivering reads are over: a source that kept a connection between them (see
    /// `kept.rs`) gives it back. Called when a tick ends however it ends (its result, a panic, its
    /// future dropped), so it does not wait.
    fn end_reads(&self) {}

    /// The source's load generation (`source.generation`'s one value: text, an integer or null),
    /// or `None` when it has none configured.
    async fn generation(&self) -> Result<Option<Value>, SourceError>;

    /// What holds the source's commit horizon (or its `settle: "auto"` bound) back: the oldest
    /// transaction the database reports open, when the cursor is read below one; `None` otherwise.
    async fn horizon_holder(&self) -> Result<Option<crate::domain::horizon::HorizonHolder>, SourceError> {
        Ok(None)
    }

    /// Where the source is, for messages; never includes a password.
    fn describe(&self) -> String;

    /// How long this source waited for a connection (all of its target's were in use) since the
    /// last call: a tick reads it at its end, for its summary line.
    fn connection_wait(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }

    /// At the start of a tick, before any read: a source read from a server's log (a binary log)
    /// looks at the server read now against `server`, the one the checkpoint was read on (the
    /// document's `generation`), and says where the checkpoint is on it ([`Rebase`]), or fails
    /// when it cannot tell (a lost log stops the poller). `None`: nothing to record.
    async fn rebase(
        &self,
        checkpoint: Option<&Position>,
        server: Option<&Value>,
    ) -> Result<Option<Rebase>, SourceError> {
        let _ = (checkpoint, server);
        Ok(None)
    }

    /// A logical source's replication slot, as the server reports it; `None` for the others.
    async fn slot(&self) -> Result<Option<crate::domain::slot::SlotView>, SourceError> {
        Ok(None)
    }

    /// Where the checkpoint may rest when nothing after `checkpoint` waits: a source that reads a
    /// log from its current end (a binary-log source with no checkpoint) says where the read that
    /// found nothing ended, and the tick records it, so that a poller's first tick fixes where it
    /// starts and a quiet poller's checkpoint follows the log. `None` for the others.
    async fn resting_position(&self, checkpoint: Option<&Position>) -> Result<Option<Position>, SourceError> {
        let _ = checkpoint;
        Ok(None)
    }

    /// A source with a position of its own on the server (a logical source's slot): where that
    /// position stands and where the source ends, for an operator's `reset`; `None` for the others.
    async fn slot_ends(&self) -> Result<Option<crate::domain::slot::SlotEnds>, SourceError> {
        Ok(None)
    }

    /// Why the source cannot read after `to`, an operator's reset target it does not check by
    /// [`Source::slot_ends`] (a binary-log source's GTID position: the server must hold it);
    /// `None` when it can, and for the sources with no such target.
    async fn refuses_reset_to(&self, to: &Position) -> Result<Option<String>, SourceError> {
        let _ = to;
        Ok(None)
    }

    /// After an operator's reset wrote a checkpoint at `to`: a source with a position of its own on
    /// the server moves it forward to there (never back); the others have nothing to do.
    async fn reset_moved(&self, to: &Position) -> Result<(), SourceError> {
        let _ = to;
        Ok(())
    }

    /// The state document's checkpoint as committed: at the start of a tick (as read) and after
    /// each commit. A source that keeps a position of its own on the server (a logical source's
    /// replication slot) moves it here, never past what is committed; the others have nothing to
    /// do.
    async fn committed(&self, checkpoint: Option<&Position>) -> Result<(), SourceError> {
        let _ = checkpoint;
        Ok(())
    }

    /// Whether this process holds the poller's lease: the tick says so once a write took it, and
    /// again before a write gives it back, or when a write finds it lost. A source with a position
    /// of its own on the server (a logical source's slot) moves it only while it does, so that two
    /// processes never move it at once nor one that no longer holds the lease; the others ignore it.
    fn fence(&self, held: bool) {
        let _ = held;
    }

    /// Whether the tick keeps the lease to its end (its last commit does not give it back; the
    /// write after [`Source::tick_ended`] does): a source that moves a position of its own there.
    fn moves_under_lease(&self) -> bool {
        false
    }

    /// Called after [`Source::committed`] at the start of a tick: whether the source's own position
    /// on the server is owed a move (a logical slot behind the committed checkpoint), so that the
    /// tick takes the lease before it reads, even with nothing to deliver.
    async fn move_owed(&self) -> Result<bool, SourceError> {
        Ok(false)
    }

    /// The late-arrival recount ([`late`]): one tally per bucket of `check`, over the rows at or
    /// before its checkpoint. `None`: this source cannot recount (a test double), and the detector
    /// stays off for it.
    async fn tally_buckets(&self, check: &BucketCheck) -> Result<Option<Vec<Tally>>, SourceError> {
        let _ = check;
        Ok(None)
    }

    /// Up to `limit` rows of one bucket of the late-arrival window, after `after`, in order.
    async fn read_bucket(
        &self,
        range: &BucketRange,
        after: Option<&Position>,
        limit: FetchLimit,
    ) -> Result<Fetched, SourceError> {
        let _ = (range, after, limit);
        Err(SourceError::Query { location: self.describe(), reason: "this source cannot re-read a bucket".into() })
    }

    /// The next rows to deliver: settled rows strictly after `after`, up to `limit`.
    async fn fetch_after(&self, after: Option<&Position>, limit: FetchLimit) -> Result<Fetched, SourceError> {
        self.read(Probe::Deliver, after, limit).await
    }
}

/// What waits after a checkpoint: `status`'s lag.
#[derive(Debug, Clone, PartialEq)]
pub struct Backlog {
    /// Rows after the checkpoint, settled or not, counted up to the cap.
    pub rows: u64,
    /// The count stopped at the cap: there are at least `rows`.
    pub capped: bool,
    /// The cursor of the first row not yet delivered.
    pub oldest: Option<CursorValue>,
}

/// Counts what waits after `after` (up to `cap` rows) and finds the first of it.
pub async fn backlog(source: &dyn Source, after: Option<&Position>, cap: u64) -> Result<Backlog, SourceError> {
    let rows = source.count_after(after, cap).await?;
    let oldest = if rows == 0 {
        None
    } else {
        let first = source.read(Probe::Pending, after, FetchLimit { rows: 1, bytes: usize::MAX }).await?;
        first.rows.into_iter().next().map(|row| row.position.cursor)
    };
    Ok(Backlog { rows, capped: rows >= cap.min(source.count_limit()), oldest })
}

/// The position of the source's last settled row (`None`: the source is empty), for
/// `reset --to-end`.
pub async fn last_position(source: &dyn Source) -> Result<Option<Position>, SourceError> {
    let last = source.read(Probe::Last, None, FetchLimit { rows: 1, bytes: usize::MAX }).await?;
    Ok(last.rows.into_iter().next().map(|row| row.position))
}

/// Opens a source on pools of its own (a tool, a test): [`open_shared`] with a fresh
/// [`pools::Pools`] and the default tick budget as its wait for a connection.
pub fn open(config: &SourceConfig) -> Result<Arc<dyn Source>, SourceError> {
    let budget = std::time::Duration::from_secs(crate::config::defaults::TICK_BUDGET_SECONDS);
    open_shared(config, &pools::Pools::new(), budget)
}

/// Opens a source for a poller. Connections are made lazily, on first use, from the pool of its
/// database target in `pools`, shared with the app's other pollers of that target; a question
/// that finds them all in use waits up to `wait_limit` (the poller's tick budget). The source
/// lives as long as the poller, across ticks.
pub fn open_shared(
    config: &SourceConfig,
    pools: &pools::Pools,
    wait_limit: std::time::Duration,
) -> Result<Arc<dyn Source>, SourceError> {
    match config.engine {
        Engine::Sqlite => Ok(Arc::new(sqlite::SqliteSource::open(config)?)),
        Engine::Postgres if matches!(config.target, crate::config::SourceTarget::Logical { .. }) => {
            Ok(Arc::new(logical::LogicalSource::open(config)?))
        }
        Engine::Postgres => {
            Ok(Arc::new(postgres::PostgresSource::open(config, pools::Gate::new(pools.target(config), wait_limit))?))
        }
        Engine::MySql if matches!(config.target, crate::config::SourceTarget::Binlog { .. }) => {
            Ok(Arc::new(binlog::BinlogSource::open(config)?))
        }
        Engine::MySql => {
            Ok(Arc::new(mysql::MySqlSource::open(config, pools::Gate::new(pools.target(config), wait_limit))?))
        }
    }
}

/// A database URL with every credential masked (user-info password and credential query
/// parameters), for messages.
pub fn redacted_location(url: &str) -> String {
    crate::config::redact::redacted_url(url)
}
