//! What the two change-stream sources (`"logical"`, `"binlog"`) share in their configuration: the
//! polling fields they refuse by name, and the fixed parts of their [`SourceConfig`] (no settle,
//! no filters, one session of their own outside the shared pools, a change's ordinal as its key).

use std::time::Duration;

use super::function_json::RawSource;
use super::source_types::{Engine, OpRule, SettleMode, SourceConfig, SourceTarget};
use super::{ConfigError, Located, defaults};
use crate::settings::Secret;

/// The first field set that only a polling source reads (table, cursor, key, filters, settle,
/// pools, row limits), if any.
pub(super) fn polling_field(raw: &RawSource) -> Option<&'static str> {
    let polling_only = [
        ("table", raw.table.is_some()),
        ("query", raw.query.is_some()),
        ("cursor", raw.cursor.is_some()),
        ("pk", raw.pk.is_some()),
        ("columns", raw.columns.is_some()),
        ("where", raw.where_clause.is_some()),
        ("settleSeconds", raw.settle_seconds.is_some()),
        ("settle", raw.settle.is_some()),
        ("cursorKind", raw.cursor_kind.is_some()),
        ("cursorTimeZone", raw.cursor_time_zone.is_some()),
        ("softDelete", raw.soft_delete.is_some()),
        ("opColumn", raw.op_column.is_some()),
        ("generation", raw.generation.is_some()),
        // A change stream is read on one session of its own, outside the shared pools.
        ("maxConnections", raw.max_connections.is_some()),
        ("maxRowBytes", raw.max_row_bytes.is_some()),
        ("oversizedRows", raw.oversized_rows.is_some()),
    ];
    polling_only.iter().find_map(|(name, given)| given.then_some(*name))
}

/// What makes a change stream's [`SourceConfig`] besides its fixed parts.
pub(super) struct Stream {
    pub engine: Engine,
    pub url: String,
    pub target: SourceTarget,
    pub cursor: &'static str,
    pub pk: Vec<String>,
    pub pool_key: String,
}

/// A change stream's [`SourceConfig`]: `queryTimeoutSeconds` checked, the rest fixed.
pub(super) fn source_config(raw: RawSource, stream: Stream, at: &Located<'_>) -> Result<SourceConfig, ConfigError> {
    let query_timeout = super::query_timeout(&raw, at)?;
    Ok(SourceConfig {
        connection: raw.connection,
        engine: stream.engine,
        url: Secret::new(stream.url),
        target: stream.target,
        cursor: stream.cursor.to_string(),
        pk: stream.pk,
        columns: None,
        where_clause: None,
        settle: Duration::ZERO,
        settle_mode: SettleMode::Fixed,
        cursor_kind: None,
        settle_configured: false,
        query_timeout,
        cursor_time_zone: defaults::CURSOR_TIME_ZONE.to_string(),
        ops: OpRule::Upsert,
        generation: None,
        pool_key: stream.pool_key,
        max_connections: 1,
        max_row_bytes: super::limits::ROW_MAX_BYTES,
        oversized_rows: super::source_types::OversizedRows::Stop,
        identity: None,
    })
}
