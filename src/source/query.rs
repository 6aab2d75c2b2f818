//! The keyset query, built as text from validated identifiers. Pure, so every dialect's SQL is
//! unit-tested.
//!
//! PostgreSQL and SQLite get a row-value seek, `(c, pk1, pk2) > (?, ?, ?)`, which both turn into
//! one index range. MySQL/MariaDB get the expanded form `c >= ? AND (c > ? OR (c = ? AND pk > ?))`,
//! whose ranges their optimizer does seek on. Either way the cost of a batch does not grow with the
//! depth of the checkpoint.

use crate::config::source::SettleMode;
use crate::config::{Engine, SourceConfig, SourceTarget};

/// Quotes an identifier that config validation has already restricted to `[A-Za-z0-9_$]`.
pub fn quote_identifier(engine: Engine, identifier: &str) -> String {
    match engine {
        Engine::MySql => format!("`{identifier}`"),
        Engine::Sqlite | Engine::Postgres => format!("\"{identifier}\""),
    }
}

/// What a placeholder of the seek binds: the cursor, or the n-th key column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    Cursor,
    Key(usize),
}

/// What the cursor column holds, learnt from the database before the first seek.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CursorType {
    Integer,
    /// timestamp with time zone (PostgreSQL timestamptz, MySQL TIMESTAMP).
    Timestamp,
    /// timestamp without time zone (PostgreSQL timestamp, MySQL DATETIME).
    NaiveTimestamp,
    /// SQLite: the storage class decides per value (integers, or timestamps as text).
    Dynamic,
    /// PostgreSQL `xid8`: read below the commit horizon, `pg_snapshot_xmin(pg_current_snapshot())`.
    Xid,
}

/// What the pre-flight learnt, shaping the SQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeekPlan {
    pub cursor_type: CursorType,
    /// PostgreSQL: the type of the cursor and of each key column, to cast placeholders to (a text
    /// key bound to a uuid column needs it).
    pub placeholder_types: Option<Vec<String>>,
}

/// The SQL of one seek, and of the questions `status` and `reset --to-end` ask beside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeekQuery {
    /// After a checkpoint: binds `after_slots` then the limit.
    pub after: String,
    pub after_slots: Vec<Slot>,
    /// The first batch ever: binds the limit only.
    pub from_start: String,
    /// The rows after a checkpoint not yet delivered, settled or not (the seek without the settle
    /// predicate): binds like `after` / `from_start`.
    pub pending_after: String,
    pub pending_from_start: String,
    /// How many rows are pending, counted up to the bound limit (so it stays cheap on a deep
    /// backlog): binds like `after` / `from_start`.
    pub count_after: String,
    pub count_from_start: String,
    /// The source's last settled row, in the seek's order (for `reset --to-end`): binds the limit.
    pub last: String,
    /// What the pre-flight learnt, for the other questions built on demand (late arrivals).
    pub plan: SeekPlan,
    /// `settle: "auto"`: the deliver and last forms bind the bound (a cursor value the database
    /// computed just before, see [`super::horizon`]) right before their limit.
    pub bound: bool,
    /// What the cursor column holds, as the pre-flight learnt it.
    pub cursor_type: CursorType,
}

/// Which rows a read asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The next rows to deliver: settled rows after the checkpoint.
    Deliver,
    /// Rows after the checkpoint, settled or not (what is waiting).
    Pending,
    /// The last settled row of the source (the position is ignored).
    Last,
}

impl SeekQuery {
    /// The SQL of `probe`, after a position or from the start.
    pub fn sql(&self, probe: Probe, after: bool) -> &str {
        match (probe, after) {
            (Probe::Deliver, true) => &self.after,
            (Probe::Deliver, false) => &self.from_start,
            (Probe::Pending, true) => &self.pending_after,
            (Probe::Pending, false) => &self.pending_from_start,
            (Probe::Last, _) => &self.last,
        }
    }

    /// The SQL of the capped count, after a position or from the start.
    pub fn count_sql(&self, after: bool) -> &str {
        if after { &self.count_after } else { &self.count_from_start }
    }

    /// The cursor is an `xid8`: a checkpoint of another kind cannot be bound to it.
    pub fn is_xid(&self) -> bool {
        self.cursor_type == CursorType::Xid
    }

    /// Whether `probe`'s SQL binds the settle bound before its limit.
    pub fn binds_bound(&self, probe: Probe) -> bool {
        self.bound && probe != Probe::Pending
    }
}

/// What keeps the deliver (and last) forms from passing a row an open transaction may still join.
enum Guard {
    /// Nothing: an integer cursor, or no settle.
    Open,
    /// A predicate of its own, the same text in every form.
    Inline(String),
    /// `cursor < <placeholder>`: the bound `settle: "auto"` computed just before.
    Bound,
}

fn guard(config: &SourceConfig, cursor_type: CursorType, cursor: &str) -> Guard {
    if cursor_type == CursorType::Xid {
        // Every transaction below the snapshot's xmin has ended, and a transaction that has not
        // taken an id yet will take a larger one: no row below it can appear later. Evaluated
        // in the seek's own statement, so against the very snapshot the rows are read with.
        return Guard::Inline(format!("{cursor} < pg_snapshot_xmin(pg_current_snapshot())"));
    }
    if config.settle_mode == SettleMode::Auto && cursor_type != CursorType::Integer {
        return Guard::Bound;
    }
    match settle_predicate(config, cursor_type, cursor) {
        Some(predicate) => Guard::Inline(predicate),
        None => Guard::Open,
    }
}

/// The settle predicate: only rows older than the database's own `now - settle`.
fn settle_predicate(config: &SourceConfig, cursor_type: CursorType, cursor: &str) -> Option<String> {
    let seconds = config.settle.as_secs();
    if seconds == 0 {
        return None;
    }
    let zone = &config.cursor_time_zone;
    match (config.engine, cursor_type) {
        (_, CursorType::Integer | CursorType::Xid) => None,
        (Engine::Postgres, CursorType::Timestamp) => {
            Some(format!("{cursor} <= now() - make_interval(secs => {seconds})"))
        }
        (Engine::Postgres, _) => {
            Some(format!("{cursor} <= (now() AT TIME ZONE '{zone}') - make_interval(secs => {seconds})"))
        }
        (Engine::MySql, CursorType::Timestamp) => Some(format!("{cursor} <= NOW(6) - INTERVAL {seconds} SECOND")),
        (Engine::MySql, _) if zone == "UTC" => {
            Some(format!("{cursor} <= UTC_TIMESTAMP(6) - INTERVAL {seconds} SECOND"))
        }
        (Engine::MySql, _) => {
            Some(format!("{cursor} <= CONVERT_TZ(UTC_TIMESTAMP(6), '+00:00', '{zone}') - INTERVAL {seconds} SECOND"))
        }
        // SQLite stores timestamps as text: julianday() reads the layouts the source accepts as
        // cursors. A text it cannot read (NULL) is let through, so that the row reaches the
        // decoder and fails the tick naming it, instead of being held back silently forever.
        // Integer values are not timestamps and are not held back.
        (Engine::Sqlite, _) => Some(format!(
            "(typeof({cursor}) <> 'text' OR julianday({cursor}) IS NULL OR julianday({cursor}) <= julianday('now') - {seconds} / 86400.0)"
        )),
    }
}

/// Refuses a cursor column whose type the configuration cannot honour: not the declared
/// `cursorKind`, or not a timestamp under `settle: "auto"`. Said before the first seek, naming
/// the column and its type, never a guess.
pub(crate) fn check_cursor_rules(
    config: &SourceConfig,
    cursor_type: CursorType,
    type_name: &str,
) -> Result<(), super::SourceError> {
    use crate::config::source::{CursorKind, SettleMode};
    let column = &config.cursor;
    let fits = match config.cursor_kind {
        None => true,
        Some(CursorKind::Integer) => cursor_type == CursorType::Integer,
        Some(CursorKind::Timestamp) => matches!(cursor_type, CursorType::Timestamp | CursorType::NaiveTimestamp),
        Some(CursorKind::Xid) => cursor_type == CursorType::Xid,
    };
    if !fits {
        let kind = config.cursor_kind.map(CursorKind::name).unwrap_or_default();
        let hint = if config.cursor_kind == Some(CursorKind::Xid) {
            " (an xid8 column stamped by the writing transaction: `dbtrigger sql <poller>` prints its DDL)"
        } else {
            ""
        };
        return Err(super::SourceError::Position(format!(
            "cursorKind is \"{kind}\" but cursor column {column:?} has type {type_name}{hint}"
        )));
    }
    if config.settle_mode == SettleMode::Auto {
        match cursor_type {
            CursorType::Timestamp | CursorType::NaiveTimestamp => {}
            CursorType::Xid => {
                return Err(super::SourceError::Position(format!(
                    "cursor column {column:?} is an xid8, read below the commit horizon, which is exact: leave settle \"auto\" out"
                )));
            }
            CursorType::Integer | CursorType::Dynamic => {
                return Err(super::SourceError::Position(format!(
                    "settle \"auto\" bounds a timestamp the database stamps; cursor column {column:?} has type {type_name}"
                )));
            }
        }
    }
    Ok(())
}

/// The types PostgreSQL's driver names in upper case, written unquoted; anything else came from
/// the catalog (a domain, an enum, an extension's type) and is quoted as an identifier, so a type
/// name can never inject SQL.
const POSTGRES_BUILTIN_TYPES: [&str; 13] = [
    "XID8",
    "INT2",
    "INT4",
    "INT8",
    "TIMESTAMPTZ",
    "TIMESTAMP",
    "TEXT",
    "VARCHAR",
    "BPCHAR",
    "NAME",
    "UUID",
    "NUMERIC",
    "DATE",
];

pub(super) fn postgres_type_name(name: &str) -> String {
    match name {
        // sqlx names `character(n)` (bpchar) "CHAR", but `::CHAR` in SQL is `character(1)`: a
        // bound cast so keeps one letter, and the seek compares against the wrong key (issue 35,
        // finding 5). `::BPCHAR` keeps the whole value and compares as the column does (trailing
        // spaces insignificant).
        "CHAR" => "BPCHAR".to_string(),
        // sqlx's name of the one-byte internal type `"char"`.
        "\"CHAR\"" => "\"char\"".to_string(),
        builtin if POSTGRES_BUILTIN_TYPES.contains(&builtin) => builtin.to_string(),
        other => format!("\"{}\"", other.replace('"', "\"\"")),
    }
}

/// Builds both forms of the seek for a source.
pub fn build_seek(config: &SourceConfig, plan: &SeekPlan) -> SeekQuery {
    let engine = config.engine;
    let quote = |identifier: &str| quote_identifier(engine, identifier);
    let projection = match &config.columns {
        None => "*".to_string(),
        Some(columns) => {
            let mut selected: Vec<&String> = Vec::new();
            let op_column = config.ops.column().map(str::to_string);
            for column in
                columns.iter().chain(std::iter::once(&config.cursor)).chain(config.pk.iter()).chain(op_column.iter())
            {
                if !selected.contains(&column) {
                    selected.push(column);
                }
            }
            selected.iter().map(|column| quote(column)).collect::<Vec<_>>().join(", ")
        }
    };
    let from = match &config.target {
        SourceTarget::Table { schema: Some(schema), name } => format!("{}.{}", quote(schema), quote(name)),
        SourceTarget::Table { schema: None, name } => quote(name),
        SourceTarget::Query(query) => format!("({query}) AS dbtrigger_source"),
        // Never read by a seek (see `source::logical`): a name that cannot be a table's.
        SourceTarget::Logical { slot, .. } => quote(&format!("logical slot {slot}")),
        SourceTarget::Binlog { .. } => quote("binary log"),
    };
    let cursor = quote(&config.cursor);
    let keys: Vec<String> = config.pk.iter().map(|column| quote(column)).collect();
    let mut key_columns = vec![cursor.clone()];
    key_columns.extend(keys.iter().cloned());
    let order_by = key_columns.join(", ");

    let guard = guard(config, plan.cursor_type, &cursor);
    let cursor_cast = match &plan.placeholder_types {
        Some(types) => types.first().map(|name| format!("::{}", postgres_type_name(name))).unwrap_or_default(),
        None => String::new(),
    };
    let placeholder = |number: usize| match engine {
        Engine::Postgres => format!("${number}"),
        Engine::Sqlite | Engine::MySql => "?".to_string(),
    };
    // The filters of the deliver and last forms, whose bound (if any) is placeholder `number`.
    let filters = |number: usize| {
        let mut filters = Vec::new();
        if let Some(clause) = &config.where_clause {
            filters.push(format!("({clause})"));
        }
        match &guard {
            Guard::Open => {}
            Guard::Inline(predicate) => filters.push(predicate.clone()),
            Guard::Bound => filters.push(format!("{cursor} < {}{cursor_cast}", placeholder(number))),
        }
        filters
    };
    let bound = matches!(guard, Guard::Bound);

    let mut placeholder_count = 0usize;
    let mut slots = Vec::new();
    let mut next_placeholder = |slot: Slot, slots: &mut Vec<Slot>| {
        placeholder_count += 1;
        slots.push(slot);
        let cast = match (&plan.placeholder_types, slot) {
            (Some(types), Slot::Cursor) => types.first().map(|name| format!("::{}", postgres_type_name(name))),
            (Some(types), Slot::Key(index)) => {
                types.get(index + 1).map(|name| format!("::{}", postgres_type_name(name)))
            }
            (None, _) => None,
        }
        .unwrap_or_default();
        match engine {
            Engine::Postgres => format!("${placeholder_count}{cast}"),
            Engine::Sqlite | Engine::MySql => "?".to_string(),
        }
    };

    let seek = match engine {
        Engine::Postgres | Engine::Sqlite => {
            let mut values = vec![next_placeholder(Slot::Cursor, &mut slots)];
            for index in 0..keys.len() {
                values.push(next_placeholder(Slot::Key(index), &mut slots));
            }
            format!("({}) > ({})", key_columns.join(", "), values.join(", "))
        }
        Engine::MySql => {
            // c >= ? AND (c > ? OR (c = ? AND k1 > ?) OR (c = ? AND k1 = ? AND k2 > ?) ...)
            let lower_bound = format!("{cursor} >= {}", next_placeholder(Slot::Cursor, &mut slots));
            let mut alternatives = vec![format!("{cursor} > {}", next_placeholder(Slot::Cursor, &mut slots))];
            for depth in 0..keys.len() {
                let mut terms = vec![format!("{cursor} = {}", next_placeholder(Slot::Cursor, &mut slots))];
                for (index, key) in keys.iter().enumerate().take(depth) {
                    terms.push(format!("{key} = {}", next_placeholder(Slot::Key(index), &mut slots)));
                }
                terms.push(format!("{} > {}", keys[depth], next_placeholder(Slot::Key(depth), &mut slots)));
                alternatives.push(format!("({})", terms.join(" AND ")));
            }
            format!("{lower_bound} AND ({})", alternatives.join(" OR "))
        }
    };
    // The bound, when there is one, comes right before the limit.
    let bounded = usize::from(bound);
    let limit_after = placeholder(placeholder_count + 1);
    let limit_start = placeholder(1);
    let deliver_limit_after = placeholder(placeholder_count + 1 + bounded);
    let deliver_limit_start = placeholder(1 + bounded);
    let filters_after = filters(placeholder_count + 1);
    let filters_start = filters(1);

    let where_part = |predicates: &[String]| {
        if predicates.is_empty() { String::new() } else { format!(" WHERE {}", predicates.join(" AND ")) }
    };
    let compose = |predicates: &[String], limit: &str| {
        format!("SELECT {projection} FROM {from}{} ORDER BY {order_by} LIMIT {limit}", where_part(predicates))
    };
    let count = |predicates: &[String], limit: &str| {
        format!("SELECT count(*) FROM (SELECT 1 FROM {from}{} LIMIT {limit}) AS dbtrigger_lag", where_part(predicates))
    };
    let unsettled: Vec<String> = config.where_clause.iter().map(|clause| format!("({clause})")).collect();
    let mut after_predicates = vec![seek.clone()];
    after_predicates.extend(filters_after);
    let mut pending_predicates = vec![seek];
    pending_predicates.extend(unsettled.iter().cloned());
    let descending: Vec<String> = key_columns.iter().map(|column| format!("{column} DESC")).collect();
    SeekQuery {
        after: compose(&after_predicates, &deliver_limit_after),
        after_slots: slots,
        from_start: compose(&filters_start, &deliver_limit_start),
        pending_after: compose(&pending_predicates, &limit_after),
        pending_from_start: compose(&unsettled, &limit_start),
        count_after: count(&pending_predicates, &limit_after),
        count_from_start: count(&unsettled, &limit_start),
        last: format!(
            "SELECT {projection} FROM {from}{} ORDER BY {} LIMIT {deliver_limit_start}",
            where_part(&filters_start),
            descending.join(", ")
        ),
        plan: plan.clone(),
        bound,
        cursor_type: plan.cursor_type,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::config::Secret;
    use std::time::Duration;

    /// A source on `public.orders` (cursor `updated_at`, key `tenant, id`), for tests.
    pub(in crate::source) fn config(
        engine: Engine,
        columns: Option<Vec<&str>>,
        where_clause: Option<&str>,
    ) -> SourceConfig {
        SourceConfig {
            connection: "DB".into(),
            engine,
            url: Secret::new("x"),
            target: SourceTarget::Table { schema: Some("public".into()), name: "orders".into() },
            cursor: "updated_at".into(),
            pk: vec!["tenant".into(), "id".into()],
            columns: columns.map(|list| list.into_iter().map(str::to_string).collect()),
            where_clause: where_clause.map(str::to_string),
            settle: Duration::ZERO,
            settle_mode: SettleMode::Fixed,
            cursor_kind: None,
            settle_configured: false,
            query_timeout: Duration::from_secs(60),
            cursor_time_zone: "UTC".into(),
            ops: crate::config::source::OpRule::Upsert,
            generation: None,
            pool_key: String::new(),
            max_connections: 10,
            max_row_bytes: crate::config::limits::ROW_MAX_BYTES,
            oversized_rows: crate::config::OversizedRows::Stop,
            identity: None,
        }
    }

    fn plan(cursor_type: CursorType) -> SeekPlan {
        SeekPlan { cursor_type, placeholder_types: None }
    }

    #[test]
    fn sqlite_seek_is_a_row_value_comparison() {
        let query = build_seek(&config(Engine::Sqlite, None, None), &plan(CursorType::Dynamic));
        assert_eq!(
            query.after,
            "SELECT * FROM \"public\".\"orders\" WHERE (\"updated_at\", \"tenant\", \"id\") > (?, ?, ?) ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT ?"
        );
        assert_eq!(query.after_slots, vec![Slot::Cursor, Slot::Key(0), Slot::Key(1)]);
        assert_eq!(
            query.from_start,
            "SELECT * FROM \"public\".\"orders\" ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT ?"
        );
    }

    #[test]
    fn postgres_numbers_and_casts_its_placeholders_and_keeps_the_filter() {
        let plan = SeekPlan {
            cursor_type: CursorType::Timestamp,
            placeholder_types: Some(vec!["TIMESTAMPTZ".into(), "INT4".into(), "UUID".into()]),
        };
        let query = build_seek(&config(Engine::Postgres, Some(vec!["status"]), Some("tenant = 7")), &plan);
        assert_eq!(
            query.after,
            "SELECT \"status\", \"updated_at\", \"tenant\", \"id\" FROM \"public\".\"orders\" WHERE (\"updated_at\", \"tenant\", \"id\") > ($1::TIMESTAMPTZ, $2::INT4, $3::UUID) AND (tenant = 7) ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT $4"
        );
        assert!(query.from_start.ends_with("WHERE (tenant = 7) ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT $1"));
    }

    #[test]
    fn mysql_expands_the_seek_into_index_ranges() {
        let query = build_seek(&config(Engine::MySql, None, None), &plan(CursorType::Timestamp));
        assert_eq!(
            query.after,
            "SELECT * FROM `public`.`orders` WHERE `updated_at` >= ? AND (`updated_at` > ? OR (`updated_at` = ? AND `tenant` > ?) OR (`updated_at` = ? AND `tenant` = ? AND `id` > ?)) ORDER BY `updated_at`, `tenant`, `id` LIMIT ?"
        );
        assert_eq!(
            query.after_slots,
            vec![Slot::Cursor, Slot::Cursor, Slot::Cursor, Slot::Key(0), Slot::Cursor, Slot::Key(0), Slot::Key(1)]
        );
    }

    #[test]
    fn settle_uses_the_database_clock_for_timestamps_only() {
        let mut source = config(Engine::Postgres, None, None);
        source.settle = Duration::from_secs(5);
        let query = build_seek(&source, &plan(CursorType::Timestamp));
        assert!(
            query.from_start.contains("WHERE \"updated_at\" <= now() - make_interval(secs => 5) ORDER BY"),
            "{}",
            query.from_start
        );
        let naive = build_seek(&source, &plan(CursorType::NaiveTimestamp));
        assert!(naive.after.contains("(now() AT TIME ZONE 'UTC') - make_interval(secs => 5)"));
        assert!(!build_seek(&source, &plan(CursorType::Integer)).after.contains("now()"));
        source.engine = Engine::MySql;
        assert!(
            build_seek(&source, &plan(CursorType::NaiveTimestamp))
                .after
                .contains("<= UTC_TIMESTAMP(6) - INTERVAL 5 SECOND")
        );
        source.engine = Engine::Sqlite;
        let sqlite = build_seek(&source, &plan(CursorType::Dynamic)).after;
        assert!(sqlite.contains("julianday('now') - 5 / 86400.0"), "{sqlite}");
        assert!(
            sqlite.contains("julianday(\"updated_at\") IS NULL OR"),
            "unreadable text reaches the decoder: {sqlite}"
        );
    }

    #[test]
    fn status_probes_leave_settle_out_and_count_up_to_a_cap() {
        let mut source = config(Engine::Postgres, None, Some("tenant = 7"));
        source.settle = Duration::from_secs(5);
        let query = build_seek(&source, &plan(CursorType::Timestamp));
        assert_eq!(
            query.count_after,
            "SELECT count(*) FROM (SELECT 1 FROM \"public\".\"orders\" WHERE (\"updated_at\", \"tenant\", \"id\") > ($1, $2, $3) AND (tenant = 7) LIMIT $4) AS dbtrigger_lag"
        );
        assert_eq!(
            query.count_from_start,
            "SELECT count(*) FROM (SELECT 1 FROM \"public\".\"orders\" WHERE (tenant = 7) LIMIT $1) AS dbtrigger_lag"
        );
        assert!(!query.pending_after.contains("now()"), "{}", query.pending_after);
        assert!(query.pending_after.ends_with("ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT $4"));
        // The last row is the last settled one: younger rows may still be joined by late commits.
        assert_eq!(
            query.last,
            "SELECT * FROM \"public\".\"orders\" WHERE (tenant = 7) AND \"updated_at\" <= now() - make_interval(secs => 5) ORDER BY \"updated_at\" DESC, \"tenant\" DESC, \"id\" DESC LIMIT $1"
        );
        let mysql = build_seek(&config(Engine::MySql, None, None), &plan(CursorType::Integer));
        assert!(mysql.count_after.ends_with("LIMIT ?) AS dbtrigger_lag"), "{}", mysql.count_after);
    }

    /// Issue 26, item 1: an xid cursor is read below the snapshot's xmin, in the seek's own
    /// statement, with no settle; the status probes still see every row after the checkpoint.
    #[test]
    fn an_xid_cursor_reads_below_the_commit_horizon_in_the_same_statement() {
        let mut source = config(Engine::Postgres, None, None);
        source.settle = Duration::from_secs(5);
        let plan = SeekPlan {
            cursor_type: CursorType::Xid,
            placeholder_types: Some(vec!["XID8".into(), "INT4".into(), "INT8".into()]),
        };
        let query = build_seek(&source, &plan);
        assert_eq!(
            query.after,
            "SELECT * FROM \"public\".\"orders\" WHERE (\"updated_at\", \"tenant\", \"id\") > ($1::XID8, $2::INT4, $3::INT8) AND \"updated_at\" < pg_snapshot_xmin(pg_current_snapshot()) ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT $4"
        );
        assert!(query.from_start.contains("WHERE \"updated_at\" < pg_snapshot_xmin(pg_current_snapshot()) ORDER BY"));
        assert!(query.last.contains("pg_snapshot_xmin"), "{}", query.last);
        assert!(!query.after.contains("now()"), "no settle on an xid cursor: {}", query.after);
        assert!(!query.pending_after.contains("pg_snapshot_xmin") && !query.count_after.contains("pg_snapshot_xmin"));
        assert!(query.is_xid() && !query.bound);
    }

    /// Issue 26, item 4: `settle: "auto"` binds the bound the database computed just before,
    /// right before the limit, in the deliver and last forms only.
    #[test]
    fn settle_auto_binds_its_bound_before_the_limit() {
        let mut source = config(Engine::Postgres, None, Some("tenant = 7"));
        source.settle = Duration::from_secs(1);
        source.settle_mode = SettleMode::Auto;
        let plan = SeekPlan {
            cursor_type: CursorType::Timestamp,
            placeholder_types: Some(vec!["TIMESTAMPTZ".into(), "INT4".into(), "INT8".into()]),
        };
        let query = build_seek(&source, &plan);
        assert_eq!(
            query.after,
            "SELECT * FROM \"public\".\"orders\" WHERE (\"updated_at\", \"tenant\", \"id\") > ($1::TIMESTAMPTZ, $2::INT4, $3::INT8) AND (tenant = 7) AND \"updated_at\" < $4::TIMESTAMPTZ ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT $5"
        );
        assert_eq!(
            query.from_start,
            "SELECT * FROM \"public\".\"orders\" WHERE (tenant = 7) AND \"updated_at\" < $1::TIMESTAMPTZ ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT $2"
        );
        assert!(query.last.ends_with(
            "\"updated_at\" < $1::TIMESTAMPTZ ORDER BY \"updated_at\" DESC, \"tenant\" DESC, \"id\" DESC LIMIT $2"
        ));
        assert!(query.pending_after.ends_with("LIMIT $4") && !query.pending_after.contains("< $4"));
        assert!(query.count_from_start.ends_with("LIMIT $1) AS dbtrigger_lag"));
        assert!(
            query.binds_bound(Probe::Deliver) && query.binds_bound(Probe::Last) && !query.binds_bound(Probe::Pending)
        );
        source.engine = Engine::MySql;
        let mysql = build_seek(&source, &SeekPlan { cursor_type: CursorType::Timestamp, placeholder_types: None });
        assert!(
            mysql
                .after
                .ends_with("AND (tenant = 7) AND `updated_at` < ? ORDER BY `updated_at`, `tenant`, `id` LIMIT ?"),
            "{}",
            mysql.after
        );
        // An integer cursor has no time to bound: nothing is bound (the source refuses it anyway).
        assert!(!build_seek(&source, &SeekPlan { cursor_type: CursorType::Integer, placeholder_types: None }).bound);
    }

    /// Regression (issue 9, item 13): a type name read from the catalog is quoted in the casts.
    #[test]
    fn catalog_type_names_are_quoted_in_postgres_casts() {
        let plan = SeekPlan {
            cursor_type: CursorType::Integer,
            placeholder_types: Some(vec!["INT8".into(), "int4); DROP TABLE x; --\"".into(), "UUID".into()]),
        };
        let query = build_seek(&config(Engine::Postgres, None, None), &plan);
        assert!(query.after.contains("($1::INT8, $2::\"int4); DROP TABLE x; --\"\"\", $3::UUID)"), "{}", query.after);
    }

    /// Regression (issue 35, finding 5): sqlx's "CHAR" is bpchar, cast as such (`::CHAR` would
    /// be `character(1)` and cut the bound to its first letter).
    #[test]
    fn a_char_key_is_cast_to_bpchar_not_to_one_character() {
        let plan = SeekPlan {
            cursor_type: CursorType::Integer,
            placeholder_types: Some(vec!["INT8".into(), "CHAR".into(), "citext".into()]),
        };
        let query = build_seek(&config(Engine::Postgres, None, None), &plan);
        assert!(query.after.contains("($1::INT8, $2::BPCHAR, $3::\"citext\")"), "{}", query.after);
        assert_eq!(postgres_type_name("\"CHAR\""), "\"char\"");
    }

    #[test]
    fn a_query_source_is_wrapped_as_a_subquery() {
        let mut source = config(Engine::Sqlite, None, None);
        source.target = SourceTarget::Query("SELECT * FROM orders WHERE total > 0".into());
        let query = build_seek(&source, &plan(CursorType::Dynamic));
        assert!(
            query
                .from_start
                .starts_with("SELECT * FROM (SELECT * FROM orders WHERE total > 0) AS dbtrigger_source ORDER BY")
        );
    }
}
