//! What can go wrong in a source, and what a driver's error means for the poller.

use crate::config::redact::Redaction;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error("cannot reach the database ({location}): {reason}")]
    Unreachable { location: String, reason: String },
    /// `<connection>__credential = managedidentity`, and the managed identity gave no token.
    #[error(
        "cannot log in to the database ({location}): no Microsoft Entra token from the managed identity (app setting {setting} = managedidentity): {reason}"
    )]
    NoToken { location: String, setting: String, reason: String },
    #[error("the query on {location} failed: {reason}")]
    Query { location: String, reason: String },
    #[error("column {column:?} has type {type_name}, which dbtrigger cannot turn into JSON")]
    UnsupportedType { column: String, type_name: String },
    #[error("cursor/key column problem: {0}")]
    Position(String),
    /// `settle: "auto"` cannot bound this server's rows (a hot standby, a replica, a Galera
    /// node): the poller stops rather than guess.
    #[error("{location}: {reason}")]
    SettleRefused { location: String, reason: String },
    #[error("the query on {location} took longer than {seconds} s (source.queryTimeoutSeconds) and was cancelled")]
    Timeout { location: String, seconds: u64 },
    /// A stored position that does not fit the configured key: never bound.
    #[error(transparent)]
    KeyMismatch(#[from] crate::domain::cursor::KeyMismatch),
    /// Every connection the app allows to this database stayed busy for the poller's tick budget.
    #[error(
        "every one of the {cap} connections this app allows to {location} stayed in use for {seconds} s (source.maxConnections, app setting DBTRIGGER_MAX_CONNECTIONS_PER_DATABASE)"
    )]
    Busy { location: String, cap: u32, seconds: u64 },
    /// A logical source's replication slot the server invalidated, or that is gone after it was
    /// used: the changes it no longer holds are a gap no tick can deliver.
    #[error(
        "replication slot {slot} on {location} is lost: {reason}. The changes it no longer holds are a gap: the poller stops here, \
         its checkpoint stays where it is, and nothing recreates the slot. Recover by hand (docs/logical-operations.md, \"A lost slot\"): \
         recreate the slot, `dbtrigger reset <poller> --to-end`, and load the gap again through a polling poller"
    )]
    SlotLost { location: String, slot: String, reason: String },
    /// A logical source's replication slot read by another session (a slot has one reader): the
    /// lease holder's tick, or another consumer.
    #[error(
        "the replication slot {slot:?} is in use by another process ({reason}): a slot has one reader; \
         stop the other consumer, or give this poller a slot of its own"
    )]
    SlotInUse { location: String, slot: String, reason: String },
    /// A binary-log source's checkpoint in a file the server no longer keeps (purged): the
    /// changes in between are a gap no tick can deliver.
    #[error(
        "binary log {file} on {location} is lost: {reason}. The changes it held are a gap: the poller stops here, \
         its checkpoint stays where it is. Recover by hand (docs/binlog.md, \"A purged binary log\"): \
         `dbtrigger reset <poller> --to-end`, and load the gap again through a polling poller"
    )]
    BinlogLost { location: String, file: String, reason: String },
    /// A row larger than `source.maxRowBytes` (by default what the sink can carry): never kept
    /// whole, never skipped; the poller stops at it.
    #[error(
        "the row is {bytes} bytes as an event, over the {limit} bytes source.maxRowBytes allows (by default what the \
         sink can carry): the poller stops here and skips nothing. Deliver fewer columns (source.columns), raise \
         source.maxRowBytes (and sink.maxBodyBytes), or change the row"
    )]
    RowTooLarge { bytes: usize, limit: usize },
    /// A row that cannot be delivered, named by its primary key.
    #[error("{error} (in the row with {row})")]
    InRow { row: String, error: Box<SourceError> },
}

/// Maps a driver error to what it means for the poller, scrubbed of the URL's secrets (a driver
/// may quote its configuration).
pub(crate) fn classify(redaction: &Redaction, error: sqlx::Error) -> SourceError {
    let location = redaction.location.clone();
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Configuration(_) => {
            SourceError::Unreachable { location, reason: redaction.scrub(&error.to_string()) }
        }
        sqlx::Error::Database(database_error) => {
            let message = redaction.scrub(database_error.message());
            let unreachable = message.contains("unable to open")
                || message.contains("password authentication failed")
                || message.contains("Access denied")
                || message.contains("does not exist") && message.contains("database");
            if unreachable {
                SourceError::Unreachable { location, reason: message }
            } else {
                SourceError::Query { location, reason: message }
            }
        }
        other => SourceError::Query { location, reason: redaction.scrub(&other.to_string()) },
    }
}
