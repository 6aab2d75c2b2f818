//! `poller.source`: the database, the table or query, cursor and key, and the fingerprint of the
//! target the driver really reads (URL query parameters and driver defaults included).

use std::fmt;
use std::path::Path;
use std::time::Duration;

use super::function_json::RawSource;
use super::{ConfigError, Located, defaults, in_range, ranges};
use crate::domain::ids::{FingerprintInput, source_fingerprint};
use crate::settings::{Secret, Settings};

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
    },
}

/// A logical source's cursor and key, as its positions name them.
pub const LOGICAL_CURSOR: &str = "commit_lsn";
pub const LOGICAL_KEY: &str = "ordinal";

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

/// What a row over `source.maxRowBytes` does (`source.oversizedRows`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OversizedRows {
    /// The poller stops at it, named by its key, until the row or the configuration changes.
    #[default]
    Stop,
    /// It is kept as a reference (its key, cursor and size, not its payload) and quarantined.
    QuarantineReference,
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

pub(super) fn build_source(
    raw: RawSource,
    settings: &Settings,
    app_root: &Path,
    at: &Located<'_>,
) -> Result<(SourceConfig, Fingerprints), ConfigError> {
    let url_value = settings.get(&raw.connection).ok_or_else(|| {
        at.error(
            "poller.source.connection",
            format!("app setting {} is not set (it must hold the database URL)", raw.connection),
        )
    })?;
    // The reason never quotes the URL: it may hold a password.
    let (identity, resolved_url) = parse_source_url(url_value, app_root)
        .map_err(|reason| at.error("poller.source.connection", format!("app setting {}: {reason}", raw.connection)))?;

    let logical = match raw.kind.as_deref() {
        None | Some("polling") => false,
        Some("logical") => true,
        Some(other) => {
            return Err(at.error("poller.source.kind", format!("{other:?}: expected \"polling\" or \"logical\"")));
        }
    };
    if logical {
        return super::logical::build(raw, identity, resolved_url, at);
    }
    if let Some(name) = [("slot", raw.slot.is_some()), ("publication", raw.publication.is_some())]
        .iter()
        .find_map(|(name, given)| given.then_some(*name))
    {
        return Err(at.error(&format!("poller.source.{name}"), "belongs to a logical source (kind \"logical\")"));
    }
    let cursor = raw.cursor.clone().ok_or_else(|| {
        at.error("poller.source", "missing field `cursor`: a polling source reads rows after its cursor column")
    })?;
    let pk = raw.pk.clone().ok_or_else(|| {
        at.error("poller.source", "missing field `pk`: a polling source orders rows of one cursor value by their key")
    })?;
    let target = match (raw.table, raw.query) {
        (Some(_), Some(_)) => {
            return Err(at.error("poller.source", "give either `table` or `query`, not both"));
        }
        (None, None) => return Err(at.error("poller.source", "give `table` (or `query`)")),
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
                [name] => SourceTarget::Table { schema: None, name: name.to_string() },
                [schema, name] => SourceTarget::Table { schema: Some(schema.to_string()), name: name.to_string() },
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
            SourceTarget::Query(trimmed)
        }
    };
    validate_identifier(&cursor).map_err(|reason| at.error("poller.source.cursor", reason))?;
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
    if pk.contains(&cursor) {
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
    let oversized_rows = match raw.oversized_rows.as_deref() {
        None | Some("stop") => OversizedRows::Stop,
        Some("quarantineReference") => OversizedRows::QuarantineReference,
        Some(other) => {
            return Err(at.error(
                "poller.source.oversizedRows",
                format!("{other:?}: expected \"stop\" or \"quarantineReference\""),
            ));
        }
    };
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
    let generation = match &raw.generation {
        None => None,
        Some(generation) => {
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
                    return Err(at.error(
                        "poller.source.generation.onChange",
                        format!("{other:?}: expected \"stop\" or \"restart\""),
                    ));
                }
            };
            Some(GenerationConfig { query, on_change })
        }
    };
    let (cursor_kind, settle_mode, settle_seconds) =
        build_cursor_rules(raw.cursor_kind.as_deref(), raw.settle.as_deref(), raw.settle_seconds, identity.engine, at)?;
    let query_timeout_seconds = in_range(
        at,
        "poller.source.queryTimeoutSeconds",
        raw.query_timeout_seconds,
        defaults::QUERY_TIMEOUT_SECONDS,
        ranges::QUERY_TIMEOUT_SECONDS,
    )?;
    let cursor_time_zone = raw.cursor_time_zone.clone().unwrap_or_else(|| defaults::CURSOR_TIME_ZONE.to_string());
    validate_time_zone(identity.engine, &cursor_time_zone)
        .map_err(|reason| at.error("poller.source.cursorTimeZone", reason))?;
    let target_text = match &target {
        SourceTarget::Table { schema: Some(schema), name } => format!("table:{schema}.{name}"),
        SourceTarget::Table { schema: None, name } => format!("table:{name}"),
        SourceTarget::Query(query) => format!("query:{query}"),
        SourceTarget::Logical { slot, publication } => format!("logical:{slot}:{publication}"),
    };
    let effective = effective_of(&identity, &resolved_url, &raw.connection, at)?;
    let fingerprint = source_fingerprint(&FingerprintInput {
        columns: raw.columns.as_deref(),
        where_clause: raw.where_clause.as_deref(),
        ..effective.fingerprint_input(identity.engine, target_text.clone(), &cursor, &pk)
    });
    let legacy_fingerprint = if url_changes_target_in_query(url_value) {
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
            cursor: &cursor,
            pk: &pk,
            columns: raw.columns.as_deref(),
            where_clause: raw.where_clause.as_deref(),
        }))
        .filter(|legacy| *legacy != fingerprint)
    };
    let max_connections = max_connections(settings, raw.max_connections, at)?;
    let pool_key = pool_key(identity.engine, &effective, &resolved_url);
    let source = SourceConfig {
        connection: raw.connection,
        engine: identity.engine,
        url: Secret::new(resolved_url),
        target,
        cursor,
        pk,
        columns: raw.columns,
        where_clause: raw.where_clause,
        settle: Duration::from_secs(settle_seconds),
        settle_mode,
        cursor_kind,
        settle_configured: raw.settle_seconds.is_some(),
        query_timeout: Duration::from_secs(query_timeout_seconds),
        cursor_time_zone,
        ops,
        generation,
        pool_key,
        max_connections,
        // Set by the poller once its sink is known.
        max_row_bytes: super::limits::ROW_MAX_BYTES,
        oversized_rows,
    };
    Ok((source, Fingerprints { current: fingerprint, legacy: legacy_fingerprint }))
}

pub(super) struct Fingerprints {
    pub(super) current: String,
    pub(super) legacy: Option<String>,
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

impl fmt::Display for SourceTarget {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceTarget::Table { schema: Some(schema), name } => write!(formatter, "{schema}.{name}"),
            SourceTarget::Table { schema: None, name } => formatter.write_str(name),
            SourceTarget::Query(_) => formatter.write_str("(query)"),
            SourceTarget::Logical { slot, publication } => {
                write!(formatter, "(publication {publication}, slot {slot})")
            }
        }
    }
}

mod url;

pub(super) use url::{UrlIdentity, effective_of, pool_key};
use url::{parse_source_url, url_changes_target_in_query};

#[cfg(test)]
mod tests;
