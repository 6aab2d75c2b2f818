//! What the database says of its open transactions: the `settle: "auto"` bound, and what holds a
//! poller's horizon back (for `status` and the watchdog's `horizon_held`).
//!
//! **Why the bound is asked for in a statement of its own, before the rows.** A row the poller
//! does not see yet belongs to a transaction still open when the rows' snapshot is taken. The
//! bound must be at or below the start of every such transaction. PostgreSQL takes a statement's
//! snapshot when the statement starts, and clears a transaction's `xact_start` in
//! `pg_stat_activity` only after the transaction has left the set of running transactions (the
//! last step of its commit). So: the sessions are read first (statement 1), the rows after (a
//! later statement, a later snapshot). A transaction not listed by statement 1 had either ended
//! before it (then statement 2 sees its rows) or not started yet (then it stamps its rows later
//! than statement 1's `now()`, hence above the bound). Read in one statement, the snapshot would
//! come first, and a transaction committing between the two would be neither seen nor listed.
//!
//! **PostgreSQL** (`DEFAULT now()` stamps the transaction's start, `clock_timestamp()` a later
//! moment): the bound is the least of the `xact_start` of every other session of this database in
//! a transaction, and `now()`, less `settleSeconds`. Every session counts, not only those holding
//! an xid (`backend_xid`): a transaction that has only read so far has no xid, yet the row it
//! writes next is stamped with its start. Autovacuum and WAL senders never write a table's rows
//! and are left out. `settleSeconds` (at least 1) covers the instant a transaction has taken its
//! start time but is not listed yet, and a column of less than microsecond precision, which rounds
//! a start up to half a second below it. Other roles' sessions are visible only with
//! `pg_read_all_stats`: without it the bound still counts this role's sessions, and says once that
//! the others are held by `settleSeconds` alone. A prepared transaction (two-phase commit) has no
//! session and no start time the server keeps: it holds the bound where the read before it was
//! first listed had it ([`PreparedHold`]). A hot standby lists none of the primary's
//! transactions: refused, at the pre-flight and at every read ([`settle_auto_refusal`]).
//!
//! **MySQL/MariaDB** (`DEFAULT CURRENT_TIMESTAMP(6)` stamps the statement's start): the least of
//! `min(trx_started)` of `information_schema.INNODB_TRX` (other connections; needs `PROCESS`) and
//! now, minus `settleSeconds`. `trx_started` is in whole seconds, truncated, and in the server's
//! system time zone, converted here at the earliest moment it can name ([`mysql_started_utc`]).
//! A replica, a read_only server or a Galera node is refused at the pre-flight. InnoDB lists a transaction from its first access to a table,
//! a moment after its first statement took its time (later still when that statement waited for a
//! table lock), and serves that list from a cache refreshed every 0.1 s: `settleSeconds` (at
//! least 1), taken off both, covers these gaps. Without `PROCESS` the bound is
//! `now - settleSeconds`, with a warning once.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use chrono::NaiveDateTime;
use chrono::{DateTime, Utc};
use sqlx::Row;

use super::query::CursorType;
use super::{SourceError, classify};
use crate::config::SourceConfig;
use crate::config::redact::{Redaction, escape_peer_text};
use crate::domain::CursorValue;
use crate::domain::horizon::{
    Held, Horizon, HorizonHolder, PreparedHold, ServerSigns, query_prefix, settle_auto_refusal,
};

/// How much of a holder's query is fetched (it is cut to [`query_prefix`] here anyway).
const FETCHED_QUERY_CHARS: usize = 200;

/// The sessions of this database (other than the poller's own) whose open transaction may still
/// stamp rows: the filter both the bound and its holder use.
const POSTGRES_OPEN_TRANSACTIONS: &str = "datname = current_database() AND pid <> pg_backend_pid() \
     AND xact_start IS NOT NULL AND backend_type NOT IN ('autovacuum worker', 'walsender')";

/// PostgreSQL's bound for a cursor of `cursor_type`, whether this role sees every session,
/// whether the server is a standby, and the prepared transactions of this database (their xids).
pub(crate) fn postgres_bound_sql(config: &SourceConfig, cursor_type: CursorType) -> String {
    let seconds = config.settle.as_secs();
    // The margin is taken off the oldest start too: a column of less than microsecond precision
    // (`timestamptz(0)`) rounds a start to the nearest unit, up to half a second below it.
    let bound = format!(
        "least((SELECT min(xact_start) FROM pg_stat_activity WHERE {POSTGRES_OPEN_TRANSACTIONS}), now()) \
         - make_interval(secs => {seconds})"
    );
    let typed = match cursor_type {
        // A timestamp without time zone stamped by `now()` holds the writer's local time, in the
        // zone `cursorTimeZone` names (validated to a safe alphabet).
        CursorType::NaiveTimestamp => format!("({bound}) AT TIME ZONE '{}'", config.cursor_time_zone),
        _ => bound,
    };
    format!(
        "SELECT {typed} AS bound, pg_has_role('pg_read_all_stats', 'USAGE') AS sees_every_session, \
         pg_is_in_recovery() AS in_recovery, \
         (SELECT array_agg(transaction::text) FROM pg_prepared_xacts WHERE database = current_database()) AS prepared"
    )
}

/// When a DATETIME of the server's system time zone (`INNODB_TRX.trx_started`) began, in UTC, at
/// the earliest it can have: in a daylight-saving fall-back hour a local time names two moments,
/// and `CONVERT_TZ` picks the later one (measured on MariaDB 10.11: `02:30` on the fall-back day of
/// Europe/Paris converts to `00:30Z`'s later twin, `01:30Z`). Read one hour earlier and moved back,
/// it is the moment before the change. Never later than the truth: at worst a bound an hour early.
pub fn mysql_started_utc(column: &str) -> String {
    format!(
        "LEAST(CONVERT_TZ({column}, 'SYSTEM', '+00:00'), \
         CONVERT_TZ({column} - INTERVAL 1 HOUR, 'SYSTEM', '+00:00') + INTERVAL 1 HOUR)"
    )
}

/// MySQL's bound, as a UTC DATETIME(6) (or the cursor's zone for a DATETIME cursor): the oldest
/// transaction's start (or now), minus `settleSeconds`; without INNODB_TRX (no `PROCESS`),
/// `now - settleSeconds` alone.
pub(crate) fn mysql_bound_sql(config: &SourceConfig, cursor_type: CursorType, with_transactions: bool) -> String {
    let seconds = config.settle.as_secs();
    let oldest = if with_transactions {
        // The least of the converted starts, not the conversion of the least local time.
        format!(
            "LEAST(COALESCE((SELECT MIN({}) FROM information_schema.INNODB_TRX \
             WHERE trx_mysql_thread_id <> CONNECTION_ID()), UTC_TIMESTAMP(6)), UTC_TIMESTAMP(6))",
            mysql_started_utc("trx_started")
        )
    } else {
        "UTC_TIMESTAMP(6)".to_string()
    };
    let utc_bound = format!("{oldest} - INTERVAL {seconds} SECOND");
    let zone = &config.cursor_time_zone;
    let typed = if cursor_type == CursorType::NaiveTimestamp && zone != "UTC" {
        format!("CONVERT_TZ({utc_bound}, '+00:00', '{zone}')")
    } else {
        utc_bound
    };
    format!("SELECT CAST({typed} AS DATETIME(6)) AS bound")
}

/// The columns every holder query returns, in this order.
const HOLDER_COLUMNS: &str = "pid, gid, transaction, database, role, application, age, state, query";

/// A session of `pg_stat_activity` as a holder row; `age` is null where the server hides
/// `xact_start` (another role's session, without `pg_read_all_stats`).
fn postgres_session_holder() -> String {
    format!(
        "pid::int8 AS pid, NULL::text AS gid, backend_xid::text AS transaction, datname::text AS database, \
         usename::text AS role, application_name::text AS application, \
         extract(epoch FROM now() - xact_start)::float8 AS age, state::text AS state, \
         left(query, {FETCHED_QUERY_CHARS}) AS query"
    )
}

/// A prepared transaction as a holder row: no session, its gid and owner, its age since prepared.
const POSTGRES_PREPARED_HOLDER: &str = "NULL::int8 AS pid, gid::text AS gid, transaction::text AS transaction, \
     database::text AS database, owner::text AS role, NULL::text AS application, \
     extract(epoch FROM now() - prepared)::float8 AS age, 'prepared'::text AS state, NULL::text AS query";

/// The oldest transaction that holds PostgreSQL's commit horizon (an xid poller) or the settle
/// bound: who it is, how long it has been open, its state and the start of its query.
pub(crate) fn postgres_holder_sql(holds: Horizon) -> String {
    let session = postgres_session_holder();
    match holds {
        // The horizon is the oldest xid still running, cluster-wide: a session's, or a prepared
        // transaction's (which has no session).
        Horizon::CommitHorizon => format!(
            "SELECT {HOLDER_COLUMNS} FROM (\
             SELECT {session}, age(backend_xid) AS xid_age FROM pg_stat_activity \
             WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid() \
             UNION ALL SELECT {POSTGRES_PREPARED_HOLDER}, age(transaction) FROM pg_prepared_xacts\
             ) AS holders ORDER BY xid_age DESC LIMIT 1"
        ),
        // A prepared transaction of this database holds the bound where it was before it was
        // prepared (its start is unknown): it comes first, then the oldest open session.
        Horizon::SettleBound => format!(
            "SELECT {HOLDER_COLUMNS} FROM (\
             SELECT {POSTGRES_PREPARED_HOLDER}, 0 AS rank, prepared AS since FROM pg_prepared_xacts \
             WHERE database = current_database() \
             UNION ALL SELECT {session}, 1, xact_start FROM pg_stat_activity WHERE {POSTGRES_OPEN_TRANSACTIONS}\
             ) AS holders ORDER BY rank, since LIMIT 1"
        ),
    }
}

/// The oldest InnoDB transaction of another connection, as a holder row.
pub(crate) fn mysql_holder_sql() -> String {
    let started = mysql_started_utc("t.trx_started");
    format!(
        "SELECT CAST(t.trx_mysql_thread_id AS SIGNED) AS pid, NULL AS gid, CAST(t.trx_id AS CHAR) AS `transaction`, \
         p.DB AS `database`, p.USER AS role, NULL AS application, \
         TIMESTAMPDIFF(SECOND, {started}, UTC_TIMESTAMP()) AS age, t.trx_state AS state, \
         LEFT(COALESCE(t.trx_query, p.INFO), {FETCHED_QUERY_CHARS}) AS query \
         FROM information_schema.INNODB_TRX t LEFT JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id \
         WHERE t.trx_mysql_thread_id <> CONNECTION_ID() ORDER BY {started} LIMIT 1"
    )
}

/// The value of a bound read back as the cursor's kind (a naive one for a naive cursor).
fn bound_value(at: NaiveDateTime, cursor_type: CursorType) -> CursorValue {
    match cursor_type {
        CursorType::NaiveTimestamp => CursorValue::NaiveTimestamp(at),
        _ => CursorValue::Timestamp { at: at.and_utc(), source_text: None },
    }
}

/// A bound below every stamp a database writes: nothing after the checkpoint is read.
fn nothing_passes() -> NaiveDateTime {
    chrono::NaiveDate::from_ymd_opt(1, 1, 1).and_then(|date| date.and_hms_opt(0, 0, 0)).unwrap_or(NaiveDateTime::MIN)
}

fn refused(redaction: &Redaction, signs: ServerSigns) -> Result<(), SourceError> {
    match settle_auto_refusal(signs) {
        None => Ok(()),
        Some(reason) => Err(SourceError::SettleRefused { location: redaction.location.clone(), reason }),
    }
}

/// The pre-flight of `settle: "auto"` on PostgreSQL: refused on a hot standby.
pub(crate) async fn postgres_check_server(pool: &sqlx::PgPool, redaction: &Redaction) -> Result<(), SourceError> {
    let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(pool)
        .await
        .map_err(|error| classify(redaction, error))?;
    refused(redaction, ServerSigns { in_recovery, ..ServerSigns::default() })
}

/// The pre-flight of `settle: "auto"` on MySQL/MariaDB: refused on a replica, a read_only server
/// or a Galera node. Read from the server's variables and status, which need no privilege.
pub(crate) async fn mysql_check_server(pool: &sqlx::MySqlPool, redaction: &Redaction) -> Result<(), SourceError> {
    let failed = |error: sqlx::Error| classify(redaction, error);
    let mut values: Vec<(String, String)> = Vec::new();
    for statement in [
        "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('read_only', 'wsrep_on')",
        "SHOW GLOBAL STATUS WHERE Variable_name IN ('Slave_running', 'Slaves_running')",
    ] {
        for row in sqlx::raw_sql(statement).fetch_all(pool).await.map_err(failed)? {
            let text = |index: usize| -> String {
                row.try_get::<String, _>(index)
                    .or_else(|_| {
                        row.try_get::<Vec<u8>, _>(index).map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
                    })
                    .unwrap_or_default()
            };
            values.push((text(0).to_ascii_lowercase(), text(1)));
        }
    }
    let value = |name: &str| values.iter().find(|(found, _)| found == name).map(|(_, value)| value.as_str());
    let on = |name: &str| value(name).is_some_and(|value| value.eq_ignore_ascii_case("ON") || value == "1");
    let threads: u64 = value("slaves_running").and_then(|count| count.parse().ok()).unwrap_or(0);
    let signs = ServerSigns {
        in_recovery: false,
        read_only: on("read_only"),
        replicating: on("slave_running") || threads > 0,
        galera: on("wsrep_on"),
    };
    refused(redaction, signs)
}

/// PostgreSQL's `settle: "auto"` bound; says once when this role cannot see other roles'
/// sessions; refuses a server that has become a standby; holds behind prepared transactions.
pub(crate) async fn postgres_bound(
    pool: &sqlx::PgPool,
    config: &SourceConfig,
    cursor_type: CursorType,
    redaction: &Redaction,
    warned: &AtomicBool,
    prepared_hold: &Mutex<PreparedHold>,
) -> Result<CursorValue, SourceError> {
    let sql = postgres_bound_sql(config, cursor_type);
    let failed = |error: sqlx::Error| classify(redaction, error);
    let row = sqlx::query(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.map_err(failed)?;
    let sees_every_session: bool = row.try_get(1).map_err(failed)?;
    let in_recovery: bool = row.try_get(2).map_err(failed)?;
    let prepared: Option<Vec<String>> = row.try_get(3).map_err(failed)?;
    // A failover can turn the server the poller reaches into a standby after the pre-flight.
    refused(redaction, ServerSigns { in_recovery, ..ServerSigns::default() })?;
    if !sees_every_session && !warned.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            source = %redaction.location,
            settle_seconds = config.settle.as_secs(),
            "settle \"auto\": this role cannot see other roles' transactions (grant it pg_read_all_stats): theirs are bounded by settleSeconds alone"
        );
    }
    let computed = match cursor_type {
        CursorType::NaiveTimestamp => {
            let at: NaiveDateTime = row.try_get(0).map_err(failed)?;
            at
        }
        _ => {
            let at: DateTime<Utc> = row.try_get(0).map_err(failed)?;
            at.naive_utc()
        }
    };
    let held = prepared_hold
        .lock()
        .unwrap_or_else(|poison| poison.into_inner())
        .bound(computed, prepared.as_deref().unwrap_or_default());
    let bound = match held {
        Held::Below(at) => at,
        Held::Everything => nothing_passes(),
    };
    Ok(bound_value(bound, cursor_type))
}

/// MySQL's `settle: "auto"` bound; without `PROCESS`, `now - settleSeconds`, said once.
pub(crate) async fn mysql_bound(
    pool: &sqlx::MySqlPool,
    config: &SourceConfig,
    cursor_type: CursorType,
    redaction: &Redaction,
    warned: &AtomicBool,
) -> Result<CursorValue, SourceError> {
    let with_transactions =
        sqlx::query(sqlx::AssertSqlSafe(mysql_bound_sql(config, cursor_type, true))).fetch_one(pool).await;
    let row = match with_transactions {
        Ok(row) => row,
        Err(sqlx::Error::Database(error))
            if is_access_denied(
                error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().map(|mysql| mysql.number()),
            ) =>
        {
            if !warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    source = %redaction.location,
                    settle_seconds = config.settle.as_secs(),
                    "settle \"auto\": this account cannot read information_schema.INNODB_TRX (grant it PROCESS): rows are bounded by settleSeconds alone"
                );
            }
            sqlx::query(sqlx::AssertSqlSafe(mysql_bound_sql(config, cursor_type, false)))
                .fetch_one(pool)
                .await
                .map_err(|error| classify(redaction, error))?
        }
        Err(error) => return Err(classify(redaction, error)),
    };
    let at: NaiveDateTime = row.try_get(0).map_err(|error| classify(redaction, error))?;
    Ok(bound_value(at, cursor_type))
}

/// MySQL's "access denied" errors (1227: a privilege such as PROCESS is missing; 1142, 1044: no
/// access to the table or schema).
fn is_access_denied(number: Option<u16>) -> bool {
    matches!(number, Some(1227 | 1142 | 1044))
}

/// What an operator's `status` shows of a holder's query: its first characters
/// ([`query_prefix`]), escaped like any text a peer sends (another session wrote it), so that it
/// can never start a log line of its own. Nothing published shows it
/// ([`crate::domain::horizon::Audience`]).
fn shown_query(query: &str) -> String {
    escape_peer_text(&query_prefix(query))
}

/// The holder a row of the holder queries names: the same columns on every engine
/// ([`HOLDER_COLUMNS`]). MySQL types its columns loosely (an integer age, text that may come as
/// bytes): each is read as what it is.
fn holder_of<R>(row: &R, holds: Horizon, redaction: &Redaction) -> Result<HorizonHolder, SourceError>
where
    R: Row,
    usize: sqlx::ColumnIndex<R>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<f64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<Vec<u8>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let failed = |error: sqlx::Error| classify(redaction, error);
    let pid: Option<i64> = row.try_get(0).map_err(failed)?;
    let age: Option<f64> = match row.try_get::<Option<f64>, _>(6) {
        Ok(age) => age,
        Err(_) => row.try_get::<Option<i64>, _>(6).map_err(failed)?.map(|seconds| seconds as f64),
    };
    let text = |index: usize| -> Option<String> {
        row.try_get::<Option<String>, _>(index).ok().flatten().or_else(|| {
            row.try_get::<Option<Vec<u8>>, _>(index)
                .ok()
                .flatten()
                .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        })
    };
    let peer = |index: usize| text(index).as_deref().map(escape_peer_text);
    Ok(HorizonHolder {
        holds,
        pid,
        gid: peer(1),
        transaction: peer(2),
        database: peer(3),
        role: peer(4),
        application: peer(5),
        age_seconds: age.map(|seconds| seconds.max(0.0)),
        state: peer(7),
        query: text(8).as_deref().map(shown_query),
    })
}

pub(crate) async fn postgres_holder(
    pool: &sqlx::PgPool,
    holds: Horizon,
    redaction: &Redaction,
) -> Result<Option<HorizonHolder>, SourceError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(postgres_holder_sql(holds)))
        .fetch_optional(pool)
        .await
        .map_err(|error| classify(redaction, error))?;
    row.map(|row| holder_of(&row, holds, redaction)).transpose()
}

pub(crate) async fn mysql_holder(
    pool: &sqlx::MySqlPool,
    redaction: &Redaction,
) -> Result<Option<HorizonHolder>, SourceError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(mysql_holder_sql()))
        .fetch_optional(pool)
        .await
        .map_err(|error| classify(redaction, error))?;
    row.map(|row| holder_of(&row, Horizon::SettleBound, redaction)).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Engine;
    use crate::config::source::SettleMode;
    use std::time::Duration;

    fn auto(engine: Engine) -> SourceConfig {
        let mut config = crate::source::query::tests::config(engine, None, None);
        config.settle_mode = SettleMode::Auto;
        config.settle = Duration::from_secs(1);
        config
    }

    /// Regression (issue 30, peer text; issue 26, item 3): another session's query reaches
    /// `status`, the watchdog's finding and its log line only as a short prefix, its control
    /// characters escaped: a session cannot write a line of its own into dbtrigger's log.
    #[test]
    fn a_holder_query_is_shown_short_and_escaped() {
        let shown = shown_query("SELECT 1 /* \u{1b}[2J\r\ntick outcome=caught_up */ FROM orders WHERE card = '4111'");
        assert_eq!(shown, "SELECT 1 /* \\u{1b}[2J tick outcome=caught_up …");
        assert!(!shown.chars().any(char::is_control), "{shown}");
    }

    /// Issue 26, item 4: every open transaction of the database counts (not only those with an
    /// xid), the poller's own session and autovacuum do not, and the bound is never later than
    /// `now - settleSeconds`; issue 35, finding 2: the margin is taken off the oldest start too.
    #[test]
    fn the_postgres_bound_is_the_oldest_open_transaction_less_the_margin() {
        let sql = postgres_bound_sql(&auto(Engine::Postgres), CursorType::Timestamp);
        assert_eq!(
            sql,
            "SELECT least((SELECT min(xact_start) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() \
             AND xact_start IS NOT NULL AND backend_type NOT IN ('autovacuum worker', 'walsender')), now()) - make_interval(secs => 1) AS bound, \
             pg_has_role('pg_read_all_stats', 'USAGE') AS sees_every_session, pg_is_in_recovery() AS in_recovery, \
             (SELECT array_agg(transaction::text) FROM pg_prepared_xacts WHERE database = current_database()) AS prepared"
        );
        assert!(
            !sql.contains("backend_xid"),
            "a transaction that has only read yet stamps its next row with its start"
        );
        let mut naive = auto(Engine::Postgres);
        naive.cursor_time_zone = "Europe/Paris".into();
        assert!(
            postgres_bound_sql(&naive, CursorType::NaiveTimestamp)
                .contains("secs => 1)) AT TIME ZONE 'Europe/Paris' AS bound")
        );
    }

    #[test]
    fn the_mysql_bound_reads_innodb_trx_in_utc_and_falls_back_to_settle() {
        let config = auto(Engine::MySql);
        let sql = mysql_bound_sql(&config, CursorType::Timestamp, true);
        assert!(
            sql.contains(
                "MIN(LEAST(CONVERT_TZ(trx_started, 'SYSTEM', '+00:00'), CONVERT_TZ(trx_started - INTERVAL 1 HOUR"
            ),
            "the least of the converted starts (issue 35, finding 8): {sql}"
        );
        assert!(sql.contains("trx_mysql_thread_id <> CONNECTION_ID()"));
        assert!(
            sql.ends_with("UTC_TIMESTAMP(6)), UTC_TIMESTAMP(6)) - INTERVAL 1 SECOND AS DATETIME(6)) AS bound"),
            "the margin is taken off the oldest start too: {sql}"
        );
        assert_eq!(
            mysql_bound_sql(&config, CursorType::Timestamp, false),
            "SELECT CAST(UTC_TIMESTAMP(6) - INTERVAL 1 SECOND AS DATETIME(6)) AS bound"
        );
        let mut naive = config.clone();
        naive.cursor_time_zone = "+02:00".into();
        assert!(
            mysql_bound_sql(&naive, CursorType::NaiveTimestamp, false)
                .contains("CONVERT_TZ(UTC_TIMESTAMP(6) - INTERVAL 1 SECOND, '+00:00', '+02:00')")
        );
        assert!(is_access_denied(Some(1227)) && !is_access_denied(Some(1064)) && !is_access_denied(None));
    }

    #[test]
    fn the_holder_of_an_xid_horizon_is_looked_for_cluster_wide_prepared_transactions_included() {
        let sql = postgres_holder_sql(Horizon::CommitHorizon);
        assert!(sql.contains("backend_xid IS NOT NULL") && sql.contains("pg_prepared_xacts"), "{sql}");
        assert!(!sql.contains("current_database()"), "one transaction anywhere holds every xid poller");
        let settle = postgres_holder_sql(Horizon::SettleBound);
        assert!(settle.contains("datname = current_database()") && settle.contains("pg_prepared_xacts"), "{settle}");
        assert!(!settle.contains("coalesce"), "an age the server hides is unknown, not 0 (issue 35, finding 7)");
    }
}
