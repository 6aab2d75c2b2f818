//! `poller.source`: the database, the table or query, cursor and key, and the fingerprint of the
//! target the driver really reads (URL query parameters and driver defaults included).

use std::time::Duration;

use super::function_json::RawSource;
pub(super) use super::source_types::Fingerprints;
pub use super::source_types::{
    AUTO_SETTLE_SECONDS, BINLOG_CURSOR, CursorKind, Engine, GenerationConfig, LOGICAL_CURSOR, LOGICAL_KEY,
    OnGenerationChange, OpRule, Origin, OversizedRows, SettleMode, SourceConfig, SourceTarget, validate_identifier,
};
use super::{ConfigError, Located, defaults, in_range, ranges};
use crate::domain::ids::{FingerprintInput, source_fingerprint};
use crate::settings::{Secret, Settings};

/// `cursorKind`, `settle` and `settleSeconds` together: what each engine can honour.
fn build_cursor_rules(
    cursor_kind: Option<&str>,
    settle: Option<&str>,
    settle_seconds: Option<u64>,
    engine: Engine,
    at: &Located<'_>,
) -> Result<(Option<CursorKind>, SettleMode, u64), ConfigError> {
    let cursor_kind = match cursor_kind {
        None => None,
        Some("integer") => Some(CursorKind::Integer),
        Some("timestamp") => Some(CursorKind::Timestamp),
        Some("xid") => Some(CursorKind::Xid),
        Some(other) => {
            return Err(at.error(
                "poller.source.cursorKind",
                format!("{other:?}: expected \"integer\", \"timestamp\" or \"xid\" (leave it out to go by the column's type)"),
            ));
        }
    };
    let settle_mode = match settle {
        None => SettleMode::Fixed,
        Some("auto") => SettleMode::Auto,
        Some(other) => {
            return Err(at.error(
                "poller.source.settle",
                format!("{other:?}: expected \"auto\" (leave it out for settleSeconds alone)"),
            ));
        }
    };
    if cursor_kind == Some(CursorKind::Xid) {
        if engine != Engine::Postgres {
            return Err(at.error(
                "poller.source.cursorKind",
                format!(
                    "\"xid\" is a PostgreSQL cursor (an xid8 column stamped by the writing transaction); this source is {}",
                    engine.name()
                ),
            ));
        }
        if settle.is_some() {
            return Err(at.error(
                "poller.source.settle",
                "an xid cursor is read below the commit horizon, which is exact: leave `settle` out",
            ));
        }
        if settle_seconds.is_some() {
            return Err(at.error(
                "poller.source.settleSeconds",
                "an xid cursor is read below the commit horizon, which is exact: leave settleSeconds out",
            ));
        }
    }
    if settle_mode == SettleMode::Auto {
        if engine == Engine::Sqlite {
            return Err(at.error(
                "poller.source.settle",
                "\"auto\" needs the database's view of its open transactions, which SQLite does not give: leave `settle` out (settleSeconds applies)",
            ));
        }
        if cursor_kind == Some(CursorKind::Integer) {
            return Err(at.error(
                "poller.source.settle",
                "\"auto\" bounds a timestamp the database stamps; an integer cursor has none (on PostgreSQL, cursorKind \"xid\" is exact)",
            ));
        }
    }
    let default_seconds = match settle_mode {
        SettleMode::Fixed => defaults::SETTLE_SECONDS,
        SettleMode::Auto => AUTO_SETTLE_SECONDS,
    };
    let settle_seconds =
        in_range(at, "poller.source.settleSeconds", settle_seconds, default_seconds, ranges::SETTLE_SECONDS)?;
    if settle_mode == SettleMode::Auto && settle_seconds == 0 {
        return Err(at.error(
            "poller.source.settleSeconds",
            "with settle \"auto\" it is the margin for a transaction the database does not list yet: at least 1",
        ));
    }
    Ok((cursor_kind, settle_mode, settle_seconds))
}

/// Zones are inlined into the settle predicate, so they are restricted to a safe alphabet; MySQL
/// only knows named zones when its time zone tables are loaded, so it gets offsets only.
fn validate_time_zone(engine: Engine, zone: &str) -> Result<(), String> {
    if zone == "UTC" {
        return Ok(());
    }
    // Compared byte by byte: a zone is any text, and a multi-byte character must not be sliced.
    let bytes = zone.as_bytes();
    let is_offset = bytes.len() == 6
        && matches!(bytes[0], b'+' | b'-')
        && bytes[1..3].iter().all(u8::is_ascii_digit)
        && bytes[3] == b':'
        && bytes[4..6].iter().all(u8::is_ascii_digit);
    match engine {
        Engine::Sqlite => Err("SQLite timestamps are read as UTC: only \"UTC\" is supported".to_string()),
        Engine::MySql if !is_offset => Err(format!("{zone:?}: MySQL takes \"UTC\" or an offset like \"+02:00\"")),
        Engine::MySql => Ok(()),
        Engine::Postgres => {
            let safe = !zone.is_empty()
                && zone.len() <= 64
                && zone.chars().all(|character| character.is_ascii_alphanumeric() || "_/+-:".contains(character));
            if safe {
                Ok(())
            } else {
                Err(format!("{zone:?} is not a time zone name like \"Europe/Paris\" or an offset like \"+02:00\""))
            }
        }
    }
}

/// A `where` or `query` fragment is inlined into the seek, inside parentheses: it must be one
/// expression that cannot close them (`tenant = 7) OR (1 = 1` would bypass the seek and redeliver
/// forever), end the statement, or comment out what follows (`;`, `--`, `/*`, MySQL's `#`).
/// Parentheses are counted outside quoted text; a quote must be closed, and a backslash inside
/// quoted text is refused because MySQL and the others disagree on what it escapes. A `$` outside
/// quoted text is refused: PostgreSQL reads `$$…$$` and `$tag$…$tag$` as quoted text, so a
/// parenthesis inside them would hide from the count here and still be read by nothing, while one
/// a `$$` seems to quote would close the seek's (and `$1` has nothing to bind).
fn validate_fragment(value: &str) -> Result<(), String> {
    if value.trim().is_empty() {
        return Err("is empty".to_string());
    }
    if value.contains(';') || value.contains("--") || value.contains("/*") || value.contains('#') {
        return Err("must be one SQL expression: ';', '--', '/*' and '#' are not allowed".to_string());
    }
    let mut depth: i64 = 0;
    let mut quote: Option<char> = None;
    for (offset, character) in value.char_indices() {
        match quote {
            Some(open) => {
                if character == '\\' {
                    return Err(format!(
                        "a backslash inside quoted text (at byte {offset}) is not allowed: write a quote twice to escape it"
                    ));
                }
                if character == open {
                    // A doubled quote is an escaped quote: the next character reopens the same quote.
                    quote = None;
                }
            }
            None => match character {
                '\'' | '"' | '`' => quote = Some(character),
                '$' => {
                    return Err(format!(
                        "a '$' outside quoted text (at byte {offset}) is not allowed: PostgreSQL reads $$…$$ and \
                         $tag$…$tag$ as quoted text; write text in single quotes"
                    ));
                }
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth < 0 {
                        return Err(format!(
                            "closes a parenthesis it did not open (at byte {offset}): the fragment must stay inside its own parentheses"
                        ));
                    }
                }
                _ => {}
            },
        }
    }
    if let Some(open) = quote {
        return Err(format!("has an unclosed {open} quote"));
    }
    if depth != 0 {
        return Err(format!("has {depth} unclosed parenthesis(es)"));
    }
    Ok(())
}

/// A polling source's configuration and fingerprints, from its fields and its database URL
/// (`config/mod.rs` chose the kind).
pub(super) fn build_source(
    raw: RawSource,
    url: SourceUrl<'_>,
    settings: &Settings,
    at: &Located<'_>,
) -> Result<(SourceConfig, Fingerprints), ConfigError> {
    refuse_logical_fields(&raw, at)?;
    let (cursor, pk) = cursor_and_key(&raw, at)?;
    let target = polling_target(raw.table.clone(), raw.query.clone(), at)?;
    check_columns_and_filter(&raw, &cursor, &pk, at)?;
    let oversized_rows = oversized_rows(&raw, at)?;
    let ops = op_rule(&raw, &cursor, &pk, at)?;
    let generation = generation(&raw, at)?;
    let engine = url.identity.engine;
    let (cursor_kind, settle_mode, settle_seconds) =
        build_cursor_rules(raw.cursor_kind.as_deref(), raw.settle.as_deref(), raw.settle_seconds, engine, at)?;
    let query_timeout = super::query_timeout(&raw, at)?;
    let cursor_time_zone = raw.cursor_time_zone.clone().unwrap_or_else(|| defaults::CURSOR_TIME_ZONE.to_string());
    validate_time_zone(engine, &cursor_time_zone).map_err(|reason| at.error("poller.source.cursorTimeZone", reason))?;
    let effective = effective_of(&url.identity, &url.resolved, &raw.connection, at)?;
    let fingerprints = fingerprints(&raw, &url, &effective, &target, &cursor, &pk);
    let max_connections = max_connections(settings, raw.max_connections, at)?;
    let pool_key = pool_key(engine, &effective, &url.resolved);
    let source = SourceConfig {
        connection: raw.connection,
        engine,
        url: Secret::new(url.resolved),
        target,
        cursor,
        pk,
        columns: raw.columns,
        where_clause: raw.where_clause,
        settle: Duration::from_secs(settle_seconds),
        settle_mode,
        cursor_kind,
        settle_configured: raw.settle_seconds.is_some(),
        query_timeout,
        cursor_time_zone,
        ops,
        generation,
        pool_key,
        max_connections,
        // Set by the poller once its sink is known.
        max_row_bytes: super::limits::ROW_MAX_BYTES,
        oversized_rows,
        identity: None,
    };
    Ok((source, fingerprints))
}

/// `source.oversizedRows`: what a row over `source.maxRowBytes` does.
fn oversized_rows(raw: &RawSource, at: &Located<'_>) -> Result<OversizedRows, ConfigError> {
    match raw.oversized_rows.as_deref() {
        None | Some("stop") => Ok(OversizedRows::Stop),
        Some("quarantineReference") => Ok(OversizedRows::QuarantineReference),
        Some(other) => Err(
            at.error("poller.source.oversizedRows", format!("{other:?}: expected \"stop\" or \"quarantineReference\""))
        ),
    }
}

/// A logical source's fields are refused on a polling source, by name.
fn refuse_logical_fields(raw: &RawSource, at: &Located<'_>) -> Result<(), ConfigError> {
    if let Some(name) =
        [("slot", raw.slot.is_some()), ("publication", raw.publication.is_some()), ("origin", raw.origin.is_some())]
            .iter()
            .find_map(|(name, given)| given.then_some(*name))
    {
        return Err(at.error(&format!("poller.source.{name}"), "belongs to a logical source (kind \"logical\")"));
    }
    if let Some(name) = [("tables", raw.tables.is_some()), ("serverId", raw.server_id.is_some())]
        .iter()
        .find_map(|(name, given)| given.then_some(*name))
    {
        return Err(at.error(&format!("poller.source.{name}"), "belongs to a binary-log source (kind \"binlog\")"));
    }
    Ok(())
}

/// The cursor column and the key columns, both given (checked once the target is).
fn cursor_and_key(raw: &RawSource, at: &Located<'_>) -> Result<(String, Vec<String>), ConfigError> {
    let cursor = raw.cursor.clone().ok_or_else(|| {
        at.error("poller.source", "missing field `cursor`: a polling source reads rows after its cursor column")
    })?;
    let pk = raw.pk.clone().ok_or_else(|| {
        at.error("poller.source", "missing field `pk`: a polling source orders rows of one cursor value by their key")
    })?;
    Ok((cursor, pk))
}

/// `table` (`name` or `schema.name`) or `query` (one SELECT), exactly one of them.
fn polling_target(table: Option<String>, query: Option<String>, at: &Located<'_>) -> Result<SourceTarget, ConfigError> {
    match (table, query) {
        (Some(_), Some(_)) => Err(at.error("poller.source", "give either `table` or `query`, not both")),
        (None, None) => Err(at.error("poller.source", "give `table` (or `query`)")),
        (Some(table), None) => {
            let parts: Vec<&str> = table.split('.').collect();
            if parts.len() > 2 {
                return Err(
                    at.error("poller.source.table", format!("{table:?} has more than two parts: use schema.table"))
                );
            }
            for part in &parts {
                validate_identifier(part).map_err(|reason| at.error("poller.source.table", reason))?;
            }
            match parts.as_slice() {
                [name] => Ok(SourceTarget::Table { schema: None, name: name.to_string() }),
                [schema, name] => Ok(SourceTarget::Table { schema: Some(schema.to_string()), name: name.to_string() }),
                _ => unreachable!("checked above"),
            }
        }
        (None, Some(query)) => {
            let trimmed = query.trim().trim_end_matches(';').trim().to_string();
            validate_fragment(&trimmed).map_err(|reason| at.error("poller.source.query", reason))?;
            let lowered = trimmed.to_ascii_lowercase();
            if !(lowered.starts_with("select") || lowered.starts_with("with")) {
                return Err(at.error("poller.source.query", "must be a SELECT (or WITH ... SELECT) statement"));
            }
            Ok(SourceTarget::Query(trimmed))
        }
    }
}

/// The cursor, key and selected columns are identifiers, the key not empty, no column twice;
/// `where` is one fragment.
fn check_columns_and_filter(raw: &RawSource, cursor: &str, pk: &[String], at: &Located<'_>) -> Result<(), ConfigError> {
    validate_identifier(cursor).map_err(|reason| at.error("poller.source.cursor", reason))?;
    if pk.is_empty() {
        return Err(
            at.error("poller.source.pk", "give at least one primary key column: the tiebreaker between equal cursors")
        );
    }
    for (index, column) in pk.iter().enumerate() {
        validate_identifier(column).map_err(|reason| at.error(&format!("poller.source.pk[{index}]"), reason))?;
        if pk[..index].contains(column) {
            return Err(at.error(&format!("poller.source.pk[{index}]"), format!("{column:?} is listed twice")));
        }
    }
    if pk.iter().any(|key| key == cursor) {
        return Err(at.error("poller.source.pk", "the cursor column cannot also be a primary key column"));
    }
    if let Some(columns) = &raw.columns {
        if columns.is_empty() {
            return Err(at.error("poller.source.columns", "is empty: leave it out to select every column"));
        }
        for (index, column) in columns.iter().enumerate() {
            validate_identifier(column)
                .map_err(|reason| at.error(&format!("poller.source.columns[{index}]"), reason))?;
        }
    }
    if let Some(where_clause) = &raw.where_clause {
        validate_fragment(where_clause).map_err(|reason| at.error("poller.source.where", reason))?;
    }
    Ok(())
}

/// Which `op` the events get: `softDelete` or `opColumn` (not both, neither the cursor nor a key).
fn op_rule(raw: &RawSource, cursor: &str, pk: &[String], at: &Located<'_>) -> Result<OpRule, ConfigError> {
    let ops = match (raw.soft_delete.clone(), raw.op_column.clone()) {
        (Some(_), Some(_)) => {
            return Err(at.error("poller.source", "give `softDelete` or `opColumn`, not both"));
        }
        (Some(column), None) => {
            validate_identifier(&column).map_err(|reason| at.error("poller.source.softDelete", reason))?;
            OpRule::SoftDelete(column)
        }
        (None, Some(column)) => {
            validate_identifier(&column).map_err(|reason| at.error("poller.source.opColumn", reason))?;
            OpRule::OpColumn(column)
        }
        (None, None) => OpRule::Upsert,
    };
    if let Some(column) = ops.column()
        && (column == cursor || pk.iter().any(|key| key == column))
    {
        return Err(at.error(
            if matches!(ops, OpRule::SoftDelete(_)) { "poller.source.softDelete" } else { "poller.source.opColumn" },
            format!("{column:?} is the cursor or a key column"),
        ));
    }
    Ok(ops)
}

/// `source.generation`: one SELECT, and what a tick does when its value moves.
fn generation(raw: &RawSource, at: &Located<'_>) -> Result<Option<GenerationConfig>, ConfigError> {
    let Some(generation) = &raw.generation else {
        return Ok(None);
    };
    let query = generation.query.trim().trim_end_matches(';').trim().to_string();
    validate_fragment(&query).map_err(|reason| at.error("poller.source.generation.query", reason))?;
    let lowered = query.to_ascii_lowercase();
    if !(lowered.starts_with("select") || lowered.starts_with("with")) {
        return Err(at.error(
            "poller.source.generation.query",
            "must be a SELECT returning one value (e.g. SELECT max(load_id) FROM load_log)",
        ));
    }
    let on_change = match generation.on_change.as_deref().unwrap_or(defaults::GENERATION_ON_CHANGE) {
        "stop" => OnGenerationChange::Stop,
        "restart" => OnGenerationChange::Restart,
        other => {
            return Err(
                at.error("poller.source.generation.onChange", format!("{other:?}: expected \"stop\" or \"restart\""))
            );
        }
    };
    Ok(Some(GenerationConfig { query, on_change }))
}

/// The source's fingerprint over the target the driver really reads, and the one computed from
/// the URL's parts alone when that differs (a URL whose query parameters cannot move the target).
fn fingerprints(
    raw: &RawSource,
    url: &SourceUrl<'_>,
    effective: &EffectiveTarget,
    target: &SourceTarget,
    cursor: &str,
    pk: &[String],
) -> Fingerprints {
    let identity = &url.identity;
    let target_text = match target {
        SourceTarget::Table { schema: Some(schema), name } => format!("table:{schema}.{name}"),
        SourceTarget::Table { schema: None, name } => format!("table:{name}"),
        SourceTarget::Query(query) => format!("query:{query}"),
        SourceTarget::Logical { slot, publication, .. } => format!("logical:{slot}:{publication}"),
        SourceTarget::Binlog { tables, .. } => format!("binlog:{}", tables.join(",")),
    };
    let current = source_fingerprint(&FingerprintInput {
        columns: raw.columns.as_deref(),
        where_clause: raw.where_clause.as_deref(),
        ..effective.fingerprint_input(identity.engine, target_text.clone(), cursor, pk)
    });
    let legacy = if url_changes_target_in_query(url.setting) {
        None
    } else {
        Some(source_fingerprint(&FingerprintInput {
            engine: identity.engine.name(),
            host: &identity.host,
            port: identity.port,
            database: &identity.database,
            user: &identity.user,
            socket: None,
            options: None,
            target: target_text,
            cursor,
            pk,
            columns: raw.columns.as_deref(),
            where_clause: raw.where_clause.as_deref(),
        }))
        .filter(|legacy| *legacy != current)
    };
    Fingerprints { current, legacy }
}

/// The app setting that caps the connections to each database (`source.maxConnections`
/// overrides it).
pub const MAX_CONNECTIONS_SETTING: &str = "DBTRIGGER_MAX_CONNECTIONS_PER_DATABASE";

/// `source.maxConnections`, else the app setting, else the default; each in range.
fn max_connections(settings: &Settings, configured: Option<u64>, at: &Located<'_>) -> Result<u32, ConfigError> {
    let range = super::ranges::MAX_CONNECTIONS;
    let from_setting = match settings.get(MAX_CONNECTIONS_SETTING).map(str::trim).filter(|text| !text.is_empty()) {
        None => super::defaults::MAX_CONNECTIONS_PER_DATABASE,
        Some(text) => match text.parse::<u64>() {
            Ok(value) if range.contains(&value) => value,
            _ => {
                return Err(at.error(
                    "poller.source",
                    format!(
                        "app setting {MAX_CONNECTIONS_SETTING} is {text:?}: expected a whole number in {}..={}",
                        range.start(),
                        range.end()
                    ),
                ));
            }
        },
    };
    let value = super::in_range(at, "poller.source.maxConnections", configured, from_setting, range)?;
    Ok(u32::try_from(value).unwrap_or(u32::MAX))
}

use super::source_url::{EffectiveTarget, SourceUrl, effective_of, pool_key, url_changes_target_in_query};

#[cfg(test)]
mod tests;
