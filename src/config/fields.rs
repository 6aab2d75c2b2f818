//! What every field of function.json's `poller`, `watchdog` and `status` sections is: its type,
//! default, range, rule and meaning, in one table. The JSON Schema ([`super::schema`]) and
//! docs/configuration.md ([`super::reference`]) are both written from it, and its numbers are the
//! loader's own constants ([`super::defaults`], [`super::ranges`]). The tests in
//! `tests_schema.rs` hold it to the loader: the same field names as the raw types at every level,
//! the same ranges, defaults and setting-name fields, so that a field added to the loader and not
//! here (or the reverse) fails with what to add.

use std::ops::RangeInclusive;

use serde_json::{Value, json};

use super::{defaults, ranges};

/// A section of function.json that dbtrigger reads (`poller`, `watchdog`, `status`).
pub struct Section {
    pub name: &'static str,
    pub description: &'static str,
    pub fields: Vec<Field>,
    pub rules: Vec<Rule>,
}

/// One field, as function.json spells it.
pub struct Field {
    pub name: &'static str,
    pub required: bool,
    /// Whether `null` is taken as "left out" (the raw type's `Option`): every optional field but
    /// the sections' objects that default as a whole (`batch`, `lease`, `poison`, `state`).
    pub nullable: bool,
    pub kind: Kind,
    pub description: &'static str,
    /// What leaving the field out means, when that is not a value (`the function's folder name`).
    pub when_absent: Option<&'static str>,
    /// A value as a user would write it, for the docs and the schema's `examples`.
    pub example: Value,
}

pub enum Kind {
    /// A whole number, never `%NAME%` (settings are text: the loader would refuse the text).
    Integer {
        range: RangeInclusive<u64>,
        /// `None`: no constant (what a left-out field means is the field's `when_absent`).
        default: Option<u64>,
    },
    Boolean {
        default: bool,
    },
    /// Text in which `%NAME%` is replaced by app setting NAME, then checked against `rule`.
    Text {
        rule: TextRule,
        default: Option<&'static str>,
    },
    /// One of `values` (or `%NAME%` of a setting holding one).
    Choice {
        values: &'static [&'static str],
        default: Option<&'static str>,
    },
    /// The name of an app setting: never `%NAME%`, never substituted (the loader refuses it).
    SettingName {
        default: Option<&'static str>,
    },
    /// A list of text, each item as [`Kind::Text`].
    List {
        rule: TextRule,
        unique: bool,
    },
    Object {
        fields: Vec<Field>,
        rules: Vec<Rule>,
    },
}

/// A rule between fields of one object that a single field's type cannot say.
pub struct Rule {
    /// The rule in words, for the docs.
    pub says: &'static str,
    /// The rule as a JSON Schema (an entry of the object's `allOf`).
    pub schema: Value,
}

/// What text must be once its `%NAME%` references are replaced.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum TextRule {
    Any,
    /// A plain SQL name: `validate_identifier`.
    Identifier,
    /// `table` or `schema.table`, each a plain SQL name.
    TableName,
    /// A replication slot's name: lower-case letters, digits and `_`, at most 63.
    SlotName,
    /// A function or poller name: `is_valid_function_name`.
    PollerName,
    /// An Azure Storage container or queue name: `is_valid_container_name`.
    StorageName,
    /// `UTC`, an offset or a zone name: the union of what the engines take (`validate_time_zone`).
    TimeZone,
    /// An http or https URL.
    Url,
}

impl Kind {
    fn integer<T: Into<u64> + Copy>(range: RangeInclusive<T>, default: T) -> Kind {
        Kind::Integer { range: (*range.start()).into()..=(*range.end()).into(), default: Some(default.into()) }
    }

    fn size(range: RangeInclusive<usize>, default: usize) -> Kind {
        Kind::Integer { range: *range.start() as u64..=*range.end() as u64, default: Some(default as u64) }
    }

    fn text(rule: TextRule) -> Kind {
        Kind::Text { rule, default: None }
    }
}

fn field(name: &'static str, kind: Kind, description: &'static str, example: Value) -> Field {
    let nullable = !matches!(kind, Kind::Object { .. });
    Field { name, required: false, nullable, kind, description, when_absent: None, example }
}

impl Field {
    fn required(mut self) -> Field {
        self.required = true;
        self.nullable = false;
        self
    }

    /// An optional object that `null` leaves out too.
    fn nullable(mut self) -> Field {
        self.nullable = true;
        self
    }

    fn when_absent(mut self, meaning: &'static str) -> Field {
        self.when_absent = Some(meaning);
        self
    }
}

/// Every section, in the order the docs show them.
pub fn sections() -> Vec<Section> {
    vec![poller(), watchdog(), status()]
}

fn poller() -> Section {
    Section {
        name: "poller",
        description: "A timer function that delivers a table's new and changed rows to a webhook or a Storage queue.",
        fields: vec![
            field(
                "name",
                Kind::text(TextRule::PollerName),
                "The poller's name: its state document and lease. Two functions must not share one.",
                json!("orders"),
            )
            .when_absent("the function's folder name"),
            field(
                "source",
                Kind::Object { fields: source(), rules: source_rules() },
                "The database and the rows to read.",
                json!({"connection": "ORDERS_DB", "table": "public.orders", "cursor": "updated_at", "pk": ["id"]}),
            )
            .required(),
            field(
                "batch",
                Kind::Object { fields: batch(), rules: vec![] },
                "How much one tick reads and sends.",
                json!({"size": 500}),
            )
            .when_absent("every default"),
            field(
                "sink",
                Kind::Object { fields: sink(), rules: sink_rules() },
                "Where the rows go: a webhook or an Azure Storage queue.",
                json!({"type": "webhook", "url": "%ORDERS_WEBHOOK_URL%", "secret": "ORDERS_WEBHOOK_SECRET"}),
            )
            .required(),
            field(
                "lease",
                Kind::Object { fields: lease(), rules: vec![] },
                "How a tick holds the poller against other instances.",
                json!({"ttlSeconds": 60}),
            )
            .when_absent("every default"),
            field(
                "poison",
                Kind::Object { fields: poison(), rules: vec![] },
                "What happens to a batch that keeps failing.",
                json!({"maxAttempts": 5}),
            )
            .when_absent("every default"),
            field(
                "state",
                state(),
                "Where the state document lives.",
                json!({"connection": "AzureWebJobsStorage", "container": "db-state"}),
            )
            .when_absent("every default"),
        ],
        rules: vec![],
    }
}

fn source() -> Vec<Field> {
    vec![
        field("kind", Kind::Choice { values: &["polling", "logical", "binlog"], default: Some("polling") }, "\"polling\" reads rows after a cursor column; \"logical\" (PostgreSQL, wal_level=logical) reads every insert, update, delete and truncate of a publication's tables from a replication slot, in commit order (docs/logical.md). A logical source takes `connection`, `slot`, `publication`, `origin` and `queryTimeoutSeconds` only. \"binlog\" (MySQL, MariaDB: log_bin, binlog_format=ROW) reads every insert, update and delete of `tables` from the binary log as a replica, in commit order (docs/binlog.md); it takes `connection`, `tables`, `serverId` and `queryTimeoutSeconds` only.", json!("logical")),
        field(
            "connection",
            Kind::SettingName { default: None },
            "The app setting holding the database URL: postgres://user:password@host/db?sslmode=verify-full, mysql://…?ssl-mode=VERIFY_IDENTITY (MariaDB too), or sqlite://path.db (relative to the app root, opened read-only).",
            json!("ORDERS_DB"),
        )
        .required(),
        field("table", Kind::text(TextRule::TableName), "The table to read (schema.table allowed). Give `table` or `query`.", json!("public.orders")),
        field("query", Kind::text(TextRule::Any), "A SELECT (or WITH … SELECT), read as a subquery, instead of `table`.", json!("SELECT o.id, o.updated_at, c.email FROM orders o JOIN customers c ON c.id = o.customer_id")),
        field("cursor", Kind::text(TextRule::Identifier), "A non-decreasing column: an integer, a version column, or a timestamp (with or without time zone). Required by a polling source.", json!("updated_at")),
        field("pk", Kind::List { rule: TextRule::Identifier, unique: true }, "One or more stable key columns: the tiebreaker between rows of one cursor value. Not the cursor. Required by a polling source.", json!(["id"])),
        field("slot", Kind::text(TextRule::SlotName), "A logical source's replication slot (pgoutput), created beforehand (`dbtrigger sql` prints how): lower-case letters, digits and '_'.", json!("dbtrigger_orders")),
        field("publication", Kind::text(TextRule::Identifier), "A logical source's publication: the tables whose changes it delivers.", json!("dbtrigger_orders")),
        field("origin", Kind::Choice { values: &["any", "none"], default: None }, "A logical source's changes by their replication origin (pgoutput's origin option): \"any\" delivers every change; \"none\" only the changes made without a replication origin, so that a function whose session declares one (pg_replication_origin_session_setup) does not receive its own writes back (docs/logical.md, \"A function that writes to the tables it reads\"). \"none\" needs PostgreSQL 16 or later: on an older server every read fails naming it, and `dbtrigger check` says so.", json!("none"))
            .when_absent("\"any\" for a logical source (every change)"),
        field("tables", Kind::List { rule: TextRule::TableName, unique: true }, "A binary-log source's tables, each `database.table`: the changes it delivers.", json!(["shop.orders", "shop.order_lines"])),
        field("serverId", Kind::Integer { range: ranges::SERVER_ID, default: None }, "The server id a binary-log source registers with as a replica: unique among the server's replicas (the server drops the older of two with one id), and so are the id with its lowest bit flipped and the id with its next bit flipped, which `status` registers with beside a tick (4242: 4243 and 4240).", json!(4242))
            .when_absent("derived from the app and poller names, in 2147483648..=4294967295"),
        field("columns", Kind::List { rule: TextRule::Identifier, unique: false }, "The columns to deliver (the cursor and the key are always read).", json!(["id", "status", "total", "updated_at"]))
            .when_absent("every column"),
        field("where", Kind::text(TextRule::Any), "A fixed SQL filter, part of the source's fingerprint: one expression that stays inside its own parentheses (no `;`, `--`, `/*`, `#`, no `$` outside quotes, no backslash inside them). Write `%%` for a literal `%`.", json!("tenant_id = 7"))
            .when_absent("no filter"),
        field("cursorKind", Kind::Choice { values: &["integer", "timestamp", "xid"], default: None }, "What the cursor holds, when its column's type does not say: \"xid\" is a PostgreSQL xid8 column stamped by the writing transaction, read below the commit horizon (exact: no settle; see `dbtrigger sql`).", json!("xid"))
            .when_absent("the column's type decides"),
        field("settle", Kind::Choice { values: &["auto"], default: None }, "\"auto\" (PostgreSQL, MySQL/MariaDB, timestamp cursors stamped by the database): read only below the start of the oldest open transaction, minus settleSeconds as a margin (default 1); without the privilege to see other sessions it falls back to settleSeconds with a warning. Not with an xid cursor.", json!("auto"))
            .when_absent("settleSeconds alone"),
        field("settleSeconds", Kind::integer(ranges::SETTLE_SECONDS, defaults::SETTLE_SECONDS), "Timestamp cursors read only rows with cursor <= the database's now - settle, so that a transaction committing late with an older timestamp is not skipped.", json!(2)),
        field("cursorTimeZone", Kind::Text { rule: TextRule::TimeZone, default: Some(defaults::CURSOR_TIME_ZONE) }, "The zone of a timestamp-without-time-zone cursor, for settle only. PostgreSQL: a zone name or an offset; MySQL: an offset like +02:00; SQLite: UTC only.", json!("Europe/Paris")),
        field("queryTimeoutSeconds", Kind::integer(ranges::QUERY_TIMEOUT_SECONDS, defaults::QUERY_TIMEOUT_SECONDS), "A fetch is cancelled after this long (PostgreSQL also gets it as statement_timeout) and the tick fails with that reason.", json!(60)),
        field("maxConnections", Kind::integer(ranges::MAX_CONNECTIONS, defaults::MAX_CONNECTIONS_PER_DATABASE), "The most connections the app opens to this source's database, shared by every poller of the app that reads it (the same host, port, database, user and options); when its pollers disagree, the smallest wins. Defaults to app setting DBTRIGGER_MAX_CONNECTIONS_PER_DATABASE, else 10. A tick that finds them all busy waits (its summary line says how long), within its tick budget.", json!(10)),
        field("maxRowBytes", Kind::size(ranges::ROW_MAX_BYTES, defaults::WEBHOOK_MAX_BODY_BYTES), "The largest row a polling source keeps, as an event (its JSON and about 128 bytes around it). A larger row is never kept as JSON past this bound (the database driver still hands over its raw value whole) and never skipped: the poller stops at it, naming its key (big_rows::a_row_over_the_bound_stops_the_poller_naming_its_key), and status shows it unhealthy until the row shrinks, source.columns leaves its large columns out, or this (and sink.maxBodyBytes) is raised. A row within it that the receiver refuses is quarantined whole.", json!(16777216))
            .when_absent("what the sink can carry: sink.maxBodyBytes for a webhook; 49152 for a queue (base64), 65536 with messageEncoding none"),
        field("oversizedRows", Kind::Choice { values: &["stop", "quarantineReference"], default: Some("stop") }, "What a row over maxRowBytes does: stop holds the poller at it, named by its key; quarantineReference keeps it aside as a reference (its key, cursor and size as an event whose row is {\"$dbtrigger_oversized\": {\"bytes\": N, \"limit\": M}}, never its payload), quarantined as refused (413), and the poller goes on. A replay of a reference is refused again: fix the row, then purge the entry.", json!("quarantineReference")),
        field("softDelete", Kind::text(TextRule::Identifier), "A column marking deleted rows: a row whose value is not NULL (nor false or 0) is delivered with op \"delete\". Not with `opColumn`.", json!("deleted_at")),
        field("opColumn", Kind::text(TextRule::Identifier), "A column saying each row's operation (insert, update, upsert, delete): an outbox or tombstone table. Not with `softDelete`.", json!("op")),
        field("lateArrivals", Kind::Object { fields: late_arrivals(), rules: vec![] }, "The late-arrival detector: a count and key hash per cursor bucket behind the checkpoint, recounted by the source; a bucket that grew is delivered again with `late: true` (docs/late-arrivals.md: how it checks, how soon, what it costs). A polling source's: a change stream (`kind` \"logical\" or \"binlog\") is read in commit order and refuses it (all but `{\"enabled\": false}`).", json!({"enabled": true, "windowSeconds": 900, "windowRows": 100000, "everyTicks": 1, "sweepChecks": 1000}))
            .when_absent("on, with the defaults below")
            .nullable(),
        field("generation", Kind::Object { fields: generation(), rules: vec![] }, "The load the table holds, for a table that is truncated and reloaded.", json!({"query": "SELECT max(load_id) FROM load_log", "onChange": "stop"}))
            .when_absent("no generation")
            .nullable(),
    ]
}

fn source_rules() -> Vec<Rule> {
    vec![
        Rule {
            says: "a logical source (kind \"logical\") gives `slot` and `publication`; a binary-log source (kind \"binlog\") gives `tables`; a polling source gives `table` or `query` (not both), `cursor` and `pk`",
            // `null` is "left out" to the loader: a field counts only when it holds text.
            schema: json!({
                "if": {"required": ["kind"], "properties": {"kind": {"const": "logical"}}},
                "then": {
                    "required": ["slot", "publication"],
                    "properties": {"slot": {"type": "string"}, "publication": {"type": "string"}}
                },
                "else": {
                    "if": {"required": ["kind"], "properties": {"kind": {"const": "binlog"}}},
                    "then": {"required": ["tables"], "properties": {"tables": {"type": "array"}}},
                    "else": {
                        "required": ["cursor", "pk"],
                        "properties": {"cursor": {"type": "string"}, "pk": {"type": "array"}},
                        "oneOf": [
                            {"required": ["table"], "properties": {"table": {"type": "string"}}},
                            {"required": ["query"], "properties": {"query": {"type": "string"}}}
                        ]
                    }
                }
            }),
        },
        Rule {
            says: "not both `softDelete` and `opColumn`",
            schema: json!({"not": {
                "required": ["softDelete", "opColumn"],
                "properties": {"softDelete": {"type": "string"}, "opColumn": {"type": "string"}}
            }}),
        },
    ]
}

fn late_arrivals() -> Vec<Field> {
    use super::late::{defaults as late_defaults, ranges as late_ranges};
    vec![
        field("enabled", Kind::Boolean { default: true }, "Whether the detector runs.", json!(false)),
        field(
            "windowSeconds",
            Kind::integer(late_ranges::WINDOW_SECONDS, late_defaults::WINDOW_SECONDS),
            "Cursor time behind the checkpoint the window covers (timestamp cursors).",
            json!(900),
        ),
        field(
            "windowRows",
            Kind::integer(late_ranges::WINDOW_ROWS, late_defaults::WINDOW_ROWS),
            "Rows behind the checkpoint the window covers (every cursor); the smaller of the two bounds wins.",
            json!(100000),
        ),
        field(
            "everyTicks",
            Kind::integer(late_ranges::EVERY_TICKS, late_defaults::EVERY_TICKS),
            "The check runs at one tick in this many. Each check recounts the newest buckets (the last few hundred rows delivered, where a row committed seconds late lands) and a slice of the older ones.",
            json!(10),
        ),
        field(
            "sweepChecks",
            Kind::integer(late_ranges::SWEEP_CHECKS, late_defaults::SWEEP_CHECKS),
            "The whole window is recounted over this many checks: a late row older than the newest buckets is found within sweepChecks x everyTicks ticks (docs/late-arrivals.md). Fewer is sooner, at a cost per check of about the window's rows divided by it.",
            json!(200),
        ),
    ]
}

fn generation() -> Vec<Field> {
    vec![
        field(
            "query",
            Kind::text(TextRule::Any),
            "A SELECT returning one value (text, an integer, or null) naming the load the table holds.",
            json!("SELECT max(load_id) FROM load_log"),
        )
        .required(),
        field(
            "onChange",
            Kind::Choice { values: &["stop", "restart"], default: Some(defaults::GENERATION_ON_CHANGE) },
            "When the value moves: stop fails every tick, naming both, until an operator resets the poller; restart starts again from the beginning of the new load.",
            json!("restart"),
        ),
    ]
}

fn batch() -> Vec<Field> {
    vec![
        field("size", Kind::size(ranges::BATCH_SIZE, defaults::BATCH_SIZE), "Rows per batch.", json!(500)),
        field(
            "maxBytes",
            Kind::size(ranges::BATCH_MAX_BYTES, defaults::BATCH_MAX_BYTES),
            "A batch also ends once its rows add up to this many bytes as JSON (at least one row a batch).",
            json!(1048576),
        ),
        field(
            "maxInFlight",
            Kind::size(ranges::MAX_IN_FLIGHT, defaults::MAX_IN_FLIGHT),
            "Batches sent at once. Above 1, a key's events still arrive in source order (batch.order).",
            json!(4),
        ),
        field(
            "order",
            Kind::Choice { values: &["key", "none"], default: Some(defaults::BATCH_ORDER) },
            "With maxInFlight above 1: key never puts two events of one key in batches in flight at the same time, so each key's events arrive in source order while keys run in parallel; none sends batches as they are read, in any order.",
            json!("key"),
        ),
        field(
            "orderKey",
            Kind::List { rule: TextRule::Identifier, unique: true },
            "The columns whose values make the key of batch.order (their values as the source gives them; a logical or binlog source reads them from new, else old, and an update that changed them belongs to the old values' key and the new; a polling source sees only the row as it is now). Left out: the primary key (a logical source: each table's replica identity; a binlog source: each table's primary key).",
            json!(["account_id"]),
        ),
        field(
            "tickBudgetSeconds",
            Kind::integer(ranges::TICK_BUDGET_SECONDS, defaults::TICK_BUDGET_SECONDS),
            "A tick starts no batch after this and no delivery outlasts it. Must end 30 s before functionTimeout (host.json's, else the plan's default).",
            json!(240),
        ),
        field(
            "commitIntervalMs",
            Kind::integer(ranges::COMMIT_INTERVAL_MS, defaults::COMMIT_INTERVAL_MS),
            "While a tick delivers, its checkpoint is written about this often (tick::a_slow_catch_up_commits_about_once_per_interval), sooner when a heartbeat is due, and when it ends; 0 writes as soon as a batch is acknowledged. A commit waits for a fetch still running and cannot cover batches acknowledged behind one still in flight, so after a crash about this long of acknowledged deliveries comes again, plus what was in flight.",
            json!(1000),
        ),
    ]
}

fn sink() -> Vec<Field> {
    vec![
        field(
            "type",
            Kind::Choice { values: &["webhook", "queue"], default: None },
            "webhook: each batch is one signed POST; queue: messages in an Azure Storage queue.",
            json!("webhook"),
        )
        .required(),
        field(
            "url",
            Kind::text(TextRule::Url),
            "webhook: the receiver's URL (usually %NAME% of a setting).",
            json!("%ORDERS_WEBHOOK_URL%"),
        ),
        field(
            "secret",
            Kind::SettingName { default: None },
            "webhook: the app setting holding the signing secret (whsec_<base64>, or any text of at least 24 bytes).",
            json!("ORDERS_WEBHOOK_SECRET"),
        )
        .when_absent("requests are not signed"),
        field(
            "timeoutSeconds",
            Kind::integer(ranges::WEBHOOK_TIMEOUT_SECONDS, defaults::WEBHOOK_TIMEOUT_SECONDS),
            "webhook: per request, and never past the tick budget.",
            json!(30),
        ),
        field(
            "maxRetries",
            Kind::integer(ranges::WEBHOOK_MAX_RETRIES, defaults::WEBHOOK_MAX_RETRIES),
            "webhook: retries of a transient failure within a tick.",
            json!(3),
        ),
        field(
            "maxBodyBytes",
            Kind::size(ranges::WEBHOOK_MAX_BODY_BYTES, defaults::WEBHOOK_MAX_BODY_BYTES),
            "webhook: a larger batch is split into several requests.",
            json!(1048576),
        ),
        field(
            "allowLinkLocal",
            Kind::Boolean { default: false },
            "webhook: allow a url at a link-local or cloud metadata address (169.254.0.0/16, fd00:ec2::254, fe80::/10) or at the handler's own port on the loopback, which are refused otherwise (docs/security.md).",
            json!(true),
        ),
        field(
            "connection",
            Kind::SettingName { default: Some(defaults::STATE_CONNECTION) },
            "queue: the app setting naming the Storage account (a connection string, or NAME__queueServiceUri / NAME__accountName for an identity).",
            json!("AzureWebJobsStorage"),
        ),
        field("queueName", Kind::text(TextRule::StorageName), "queue: the queue's name.", json!("orders-changes")),
        field(
            "messageEncoding",
            Kind::Choice { values: &["base64", "none"], default: Some(defaults::MESSAGE_ENCODING) },
            "queue: base64 is what a Functions queue trigger expects.",
            json!("base64"),
        ),
        field(
            "messagePer",
            Kind::Choice { values: &["row", "batch"], default: Some(defaults::MESSAGE_PER) },
            "queue: one message per row, or one per batch.",
            json!("row"),
        ),
    ]
}

pub(crate) const WEBHOOK_ONLY: [&str; 6] =
    ["url", "secret", "timeoutSeconds", "maxRetries", "maxBodyBytes", "allowLinkLocal"];
/// The source fields only a binary-log source takes (`kind: "binlog"`).
#[cfg(test)]
pub(crate) const BINLOG_ONLY: [&str; 2] = ["tables", "serverId"];

pub(crate) const QUEUE_ONLY: [&str; 4] = ["connection", "queueName", "messageEncoding", "messagePer"];

/// A sink of one type: its needed field holds text, and the other type's fields are left out
/// (`null` is "left out" to the loader).
fn sink_of(needed: &str, foreign: &[&str]) -> Value {
    let mut properties: serde_json::Map<String, Value> =
        foreign.iter().map(|name| (name.to_string(), json!({"type": "null"}))).collect();
    properties.insert(needed.to_string(), json!({"type": "string"}));
    json!({"required": [needed], "properties": properties})
}

fn sink_rules() -> Vec<Rule> {
    vec![
        Rule {
            says: "a webhook sink needs `url` and takes none of the queue's fields",
            schema: json!({
                "if": {"properties": {"type": {"const": "webhook"}}, "required": ["type"]},
                "then": sink_of("url", &QUEUE_ONLY)
            }),
        },
        Rule {
            says: "a queue sink needs `queueName` and takes none of the webhook's fields",
            schema: json!({
                "if": {"properties": {"type": {"const": "queue"}}, "required": ["type"]},
                "then": sink_of("queueName", &WEBHOOK_ONLY)
            }),
        },
    ]
}

fn lease() -> Vec<Field> {
    vec![
        field(
            "ttlSeconds",
            Kind::integer(ranges::LEASE_TTL_SECONDS, defaults::LEASE_TTL_SECONDS),
            "How long a lease lasts unless renewed; at least 3 x heartbeatSeconds.",
            json!(60),
        ),
        field(
            "heartbeatSeconds",
            Kind::integer(ranges::LEASE_HEARTBEAT_SECONDS, defaults::LEASE_HEARTBEAT_SECONDS),
            "A delivery or a fetch that outlasts this renews the lease while it runs.",
            json!(15),
        ),
        field(
            "clockSkewSeconds",
            Kind::integer(ranges::LEASE_CLOCK_SKEW_SECONDS, defaults::LEASE_CLOCK_SKEW_SECONDS),
            "Margin against clocks that disagree; less than half of ttlSeconds.",
            json!(5),
        ),
    ]
}

fn poison() -> Vec<Field> {
    vec![
        field(
            "maxAttempts",
            Kind::integer(ranges::POISON_MAX_ATTEMPTS, defaults::POISON_MAX_ATTEMPTS),
            "Failed ticks on the batch at the checkpoint before it is isolated as poison (a permanent refusal isolates at once).",
            json!(5),
        ),
        field(
            "mode",
            Kind::Choice { values: &["quarantine", "stop"], default: Some(defaults::POISON_MODE) },
            "quarantine: rows that fail alone are kept aside and the rest delivered; stop: never skip a row, hold at the first row that fails alone.",
            json!("stop"),
        ),
        field(
            "maxQuarantinedPerHour",
            Kind::integer(ranges::POISON_MAX_QUARANTINED_PER_HOUR, defaults::POISON_MAX_QUARANTINED_PER_HOUR),
            "The most rows quarantined in any hour (a rolling hour, kept in the state document). Past it nothing more is quarantined: the poller holds at its checkpoint as for an endpoint refusal, and status and the watchdog say quarantine_budget_spent, until the budget is raised, the quarantine replayed, the hour has passed, or the receiver accepts the row again (endpoint::a_receiver_answering_422_to_every_row_quarantines_no_more_than_the_budget).",
            json!(10),
        ),
    ]
}

/// `state` of a poller or a watchdog.
fn state() -> Kind {
    Kind::Object {
        fields: vec![
            field(
                "connection",
                Kind::SettingName { default: Some(defaults::STATE_CONNECTION) },
                "The app setting naming the state store: a Storage connection string, `file:<dir>` for local work, or NAME__blobServiceUri / NAME__accountName (and NAME__clientId) for an identity.",
                json!("AzureWebJobsStorage"),
            ),
            field(
                "container",
                Kind::Text { rule: TextRule::StorageName, default: Some(defaults::STATE_CONTAINER) },
                "The blob container; documents at state/{app}/{poller}.json.",
                json!("db-state"),
            ),
        ],
        rules: vec![],
    }
}

fn watchdog() -> Section {
    Section {
        name: "watchdog",
        description: "A timer function that checks every poller of the app and reports the stalled and failing ones.",
        fields: vec![
            field(
                "stalledAfterIntervals",
                Kind::integer(ranges::STALLED_AFTER_INTERVALS, defaults::STALLED_AFTER_INTERVALS),
                "A poller with rows waiting and no commit for this many of its schedule's intervals is stalled.",
                json!(3),
            ),
            field(
                "horizonHeldAfterSeconds",
                Kind::integer(ranges::HORIZON_HELD_AFTER_SECONDS, defaults::HORIZON_HELD_AFTER_SECONDS),
                "A poller whose rows wait behind a transaction open this long (the commit horizon of an xid cursor, the bound of settle \"auto\") is reported as horizon_held; a tick cannot fix it, so it is never kicked.",
                json!(300),
            ),
            field(
                "slotRetentionMegabytes",
                Kind::integer(ranges::SLOT_RETENTION_MEGABYTES, defaults::SLOT_RETENTION_MEGABYTES),
                "A logical source's replication slot holding more WAL than this is reported as slot_retention (a slot the server invalidated, as slot_lost). Keep it well below max_slot_wal_keep_size.",
                json!(1024),
            ),
            field(
                "kick",
                Kind::Boolean { default: false },
                "Also run a tick of a stalled poller (or one whose lease was abandoned) right away, in this process.",
                json!(true),
            ),
            field(
                "alert",
                Kind::Object { fields: alert(), rules: vec![] },
                "A webhook the findings are posted to, signed like the sink.",
                json!({"url": "%ALERT_URL%", "secret": "ALERT_SECRET"}),
            )
            .when_absent("findings go to the logs only")
            .nullable(),
            field(
                "state",
                state(),
                "Where the app's state documents are (and the watchdog's memory).",
                json!({"connection": "AzureWebJobsStorage"}),
            )
            .when_absent("every default"),
        ],
        rules: vec![],
    }
}

fn alert() -> Vec<Field> {
    vec![
        field("url", Kind::text(TextRule::Url), "The alert webhook's URL.", json!("%ALERT_URL%")).required(),
        field(
            "secret",
            Kind::SettingName { default: None },
            "The app setting holding its signing secret.",
            json!("ALERT_SECRET"),
        )
        .when_absent("alerts are not signed"),
        field(
            "timeoutSeconds",
            Kind::integer(ranges::ALERT_TIMEOUT_SECONDS, defaults::ALERT_TIMEOUT_SECONDS),
            "Per request.",
            json!(10),
        ),
        field(
            "allowLinkLocal",
            Kind::Boolean { default: false },
            "Allow a url at a link-local or cloud metadata address, or at the handler's own port on the loopback, which are refused otherwise (docs/security.md).",
            json!(true),
        ),
    ]
}

fn status() -> Section {
    Section {
        name: "status",
        description: "An HTTP function answering with the status of every poller (what `dbtrigger status --json` prints): write `\"status\": {}`. It has no fields yet.",
        fields: vec![],
        rules: vec![],
    }
}
