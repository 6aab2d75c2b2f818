//! What a source is, once validated: the engine, what it reads, the [`SourceConfig`] both kinds
//! of source build (polling, [`super::source`]; logical, [`super::logical`]), and the rules they
//! share.

use std::fmt;
use std::time::Duration;

use crate::settings::Secret;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
    MySql,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Sqlite => "sqlite",
            Engine::Postgres => "postgres",
            Engine::MySql => "mysql",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceTarget {
    Table {
        schema: Option<String>,
        name: String,
    },
    /// A SELECT, wrapped as a subquery.
    Query(String),
    /// PostgreSQL logical decoding (`source.kind: "logical"`): the changes of a publication, read
    /// from a replication slot. Its positions are (commit LSN, ordinal): never a seek.
    Logical {
        slot: String,
        publication: String,
        /// Which changes the slot is read for, by their replication origin.
        origin: Origin,
    },
    /// The MySQL/MariaDB binary log (`source.kind: "binlog"`, issue 39): the row changes of
    /// `tables` (`database.table`), read as a replica with `server_id`. Its positions are
    /// (binary log position, ordinal): never a seek.
    Binlog {
        tables: Vec<String>,
        server_id: u32,
    },
}

impl SourceTarget {
    /// A change stream (a logical slot, a binary log): read by one reader at a time, so that a
    /// read for a report (a count) would compete with the tick's.
    pub fn is_change_stream(&self) -> bool {
        matches!(self, SourceTarget::Logical { .. } | SourceTarget::Binlog { .. })
    }
}

/// Which changes a logical source reads, by their replication origin (`source.origin`: pgoutput's
/// `origin` option, PostgreSQL 16 and later). Not part of the fingerprint: it filters which
/// changes are sent, positions keep their meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Origin {
    /// Every change, whatever its origin (pgoutput's default; the option is not passed, so any
    /// server version reads it).
    #[default]
    Any,
    /// Only changes made without a replication origin (`'origin', 'none'`): a session that
    /// declared one (`pg_replication_origin_session_setup`) writes changes the poller never gets.
    None,
}

impl Origin {
    /// As `source.origin` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Origin::Any => "any",
            Origin::None => "none",
        }
    }
}

/// A logical source's cursor and key, as its positions name them.
pub const LOGICAL_CURSOR: &str = "commit_lsn";
pub const LOGICAL_KEY: &str = "ordinal";
/// A binary-log source's cursor (its key is [`LOGICAL_KEY`]).
pub const BINLOG_CURSOR: &str = "binlog_position";

#[derive(Debug, Clone)]
pub struct SourceConfig {
    /// The app setting that holds the URL.
    pub connection: String,
    pub engine: Engine,
    /// The database URL, resolved (a relative SQLite path is taken from the app root).
    pub url: Secret,
    pub target: SourceTarget,
    pub cursor: String,
    pub pk: Vec<String>,
    pub columns: Option<Vec<String>>,
    pub where_clause: Option<String>,
    /// Timestamp cursors only read rows older than the database's `now - settle`.
    pub settle: Duration,
    /// `source.settle`: whether the bound is that guess alone, or the database's oldest open
    /// transaction too (`"auto"`).
    pub settle_mode: SettleMode,
    /// `source.cursorKind`: what the cursor column must hold, when declared (`None`: whatever its
    /// type says, learnt before the first seek).
    pub cursor_kind: Option<CursorKind>,
    /// Whether `settleSeconds` was written in function.json (an integer cursor ignores it, and
    /// says so once when it was asked for).
    pub settle_configured: bool,
    /// Each fetch is cancelled after this long (and PostgreSQL's `statement_timeout` is set to
    /// it), so a slow query fails the tick instead of holding it.
    pub query_timeout: Duration,
    /// The zone naive timestamp cursors are written in (for `settle` only): `UTC` by default.
    pub cursor_time_zone: String,
    /// How a row says it was deleted (or which operation it records), if it can.
    pub ops: OpRule,
    /// The source's load generation, if the table is truncated and reloaded.
    pub generation: Option<GenerationConfig>,
    /// The database this source connects to, as a key: every source of the app with the same key
    /// shares one pool of connections (the effective target, the credentials and the connection
    /// parameters; never the URL's text, never a secret in clear).
    pub pool_key: String,
    /// The cap on connections to that database (`source.maxConnections`, else app setting
    /// `DBTRIGGER_MAX_CONNECTIONS_PER_DATABASE`, else 10); the smallest of its sources wins.
    pub max_connections: u32,
    /// `source.maxRowBytes`: the largest row (as JSON, with its event's overhead) a fetch keeps;
    /// a larger one stops the poller, named by its key (by default what the sink can carry).
    pub max_row_bytes: usize,
    /// `source.oversizedRows`: what a row over `max_row_bytes` does.
    pub oversized_rows: OversizedRows,
    /// `<connection>__credential = managedidentity`: the password is a Microsoft Entra token of
    /// the app's managed identity, asked for as connections open (`None`: the URL's password).
    pub identity: Option<DatabaseIdentity>,
}

/// A database login by the app's managed identity (app settings `<connection>__credential` =
/// `managedidentity` and, for a user-assigned identity, `<connection>__clientId`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseIdentity {
    /// The app setting named `<connection>__credential`, as errors name it.
    pub setting: String,
    /// A user-assigned identity's client id (`None`: the system-assigned identity).
    pub client_id: Option<String>,
}

/// What a row over `source.maxRowBytes` does (`source.oversizedRows`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OversizedRows {
    /// The poller stops at it, named by its key, until the row or the configuration changes.
    #[default]
    Stop,
    /// It is kept as a reference (its key, cursor and size, not its payload) and quarantined.
    QuarantineReference,
}

/// What a cursor column holds, as `source.cursorKind` declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CursorKind {
    Integer,
    /// A timestamp, with or without time zone.
    Timestamp,
    /// PostgreSQL `xid8`, stamped by the writing transaction and read below the commit horizon.
    Xid,
}

impl CursorKind {
    pub fn name(self) -> &'static str {
        match self {
            CursorKind::Integer => "integer",
            CursorKind::Timestamp => "timestamp",
            CursorKind::Xid => "xid",
        }
    }
}

/// How far a timestamp cursor reads (`source.settle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SettleMode {
    /// Rows older than the database's `now - settleSeconds`: a guess at the longest transaction.
    #[default]
    Fixed,
    /// Rows older than the start of the oldest transaction the database reports open, and never
    /// younger than `now - settleSeconds` (the margin for what that report cannot show yet).
    Auto,
}

/// Under `settle: "auto"` `settleSeconds` is only a margin (the moment a transaction starts
/// before the database lists it, InnoDB's 0.1 s cache of INNODB_TRX), so it defaults lower.
pub const AUTO_SETTLE_SECONDS: u64 = 1;

/// Which `op` an event gets.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum OpRule {
    /// Keyset polling sees each row's latest state: every event is an `upsert`.
    #[default]
    Upsert,
    /// `softDelete`: a row whose column is not NULL (and not false or 0) is a `delete`.
    SoftDelete(String),
    /// `opColumn`: the row says its operation (`insert`, `update`, `upsert`, `delete`).
    OpColumn(String),
}

impl OpRule {
    /// The column the rule reads, if any.
    pub fn column(&self) -> Option<&str> {
        match self {
            OpRule::Upsert => None,
            OpRule::SoftDelete(column) | OpRule::OpColumn(column) => Some(column),
        }
    }
}

/// `source.generation` (seed 003): a query whose one scalar names the load the rows belong to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerationConfig {
    pub query: String,
    pub on_change: OnGenerationChange,
}

/// What a tick does when the generation moved since the checkpoint was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnGenerationChange {
    /// Fail every tick, naming both, until an operator resets the poller.
    Stop,
    /// Start again from the beginning of the new load, recorded in the history.
    Restart,
}

/// Identifiers are a strict subset of what every engine accepts unquoted, then quoted anyway:
/// a quote, a semicolon or a comment sequence can never reach the SQL.
pub fn validate_identifier(value: &str) -> Result<(), String> {
    let mut characters = value.chars();
    let valid_first = characters.next().is_some_and(|character| character.is_ascii_alphabetic() || character == '_');
    let valid_rest =
        characters.all(|character| character.is_ascii_alphanumeric() || character == '_' || character == '$');
    if valid_first && valid_rest && value.len() <= 63 {
        Ok(())
    } else {
        Err(format!(
            "{value:?} is not a valid identifier: use letters, digits, '_' and '$', starting with a letter or '_', at most 63 characters"
        ))
    }
}

/// `source.kind`: what reads the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::config) enum SourceKind {
    /// Keyset polling of a table or query (the default).
    Polling,
    /// PostgreSQL logical decoding through a slot.
    Logical,
    /// The MySQL/MariaDB binary log, read as a replica.
    Binlog,
}

impl SourceKind {
    pub(in crate::config) fn parse(kind: Option<&str>) -> Result<SourceKind, String> {
        match kind {
            None | Some("polling") => Ok(SourceKind::Polling),
            Some("logical") => Ok(SourceKind::Logical),
            Some("binlog") => Ok(SourceKind::Binlog),
            Some(other) => Err(format!("{other:?}: expected \"polling\", \"logical\" or \"binlog\"")),
        }
    }
}

/// A source's fingerprint, and (when it differs) the one computed from the URL's parts alone.
pub(in crate::config) struct Fingerprints {
    pub(in crate::config) current: String,
    pub(in crate::config) legacy: Option<String>,
}

impl fmt::Display for SourceTarget {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceTarget::Table { schema: Some(schema), name } => write!(formatter, "{schema}.{name}"),
            SourceTarget::Table { schema: None, name } => formatter.write_str(name),
            SourceTarget::Query(_) => formatter.write_str("(query)"),
            SourceTarget::Logical { slot, publication, .. } => {
                write!(formatter, "(publication {publication}, slot {slot})")
            }
            SourceTarget::Binlog { tables, .. } => write!(formatter, "(binary log of {})", tables.join(", ")),
        }
    }
}
