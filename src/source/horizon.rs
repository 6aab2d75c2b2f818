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
//! a transaction, and `now() - settleSeconds`. Every session counts, not only those holding an
//! xid (`backend_xid`): a transaction that has only read so far has no xid, yet the row it writes
//! next is stamped with its start. Autovacuum and WAL senders never write a table's rows and are
//! left out. `settleSeconds` covers the instant a transaction has taken its start time but is not
//! listed yet. Other roles' sessions are visible only with `pg_read_all_stats`: without it the
//! bound still counts this role's sessions, and says once that the others are held by
//! `settleSeconds` alone. A prepared transaction (two-phase commit) is not listed: not bounded.
//!
//! **MySQL/MariaDB** (`DEFAULT CURRENT_TIMESTAMP(6)` stamps the statement's start): the least of
//! `min(trx_started)` of `information_schema.INNODB_TRX` (other connections; needs `PROCESS`) and
//! now, minus `settleSeconds`. `trx_started` is in whole seconds, truncated, and in the server's
//! system time zone, converted here. InnoDB lists a transaction from its first access to a table,
//! a moment after its first statement took its time (later still when that statement waited for a
//! table lock), and serves that list from a cache refreshed every 0.1 s: `settleSeconds` (at
//! least 1), taken off both, covers these gaps. Without `PROCESS` the bound is
//! `now - settleSeconds`, with a warning once.

use std::sync::atomic::{AtomicBool, Ordering};

use chrono::NaiveDateTime;
use chrono::{DateTime, Utc};
use sqlx::Row;

use super::query::CursorType;
use super::{SourceError, classify};
use crate::config::SourceConfig;
use crate::config::redact::{Redaction, escape_peer_text};
use crate::domain::CursorValue;
use crate::domain::health::{Horizon, HorizonHolder, query_prefix};

/// How much of a holder's query is fetched (it is cut to [`query_prefix`] here anyway).
const FETCHED_QUERY_CHARS: usize = 200;

/// The sessions of this database (other than the poller's own) whose open transaction may still
/// stamp rows: the filter both the bound and its holder use.
const POSTGRES_OPEN_TRANSACTIONS: &str = "datname = current_database() AND pid <> pg_backend_pid() \
     AND xact_start IS NOT NULL AND backend_type NOT IN ('autovacuum worker', 'walsender')";

/// PostgreSQL's bound for a cursor of `cursor_type`, and whether this role sees every session.
pub(crate) fn postgres_bound_sql(config: &SourceConfig, cursor_type: CursorType) -> String {
    let seconds = config.settle.as_secs();
    let bound = format!(
        "least((SELECT min(xact_start) FROM pg_stat_activity WHERE {POSTGRES_OPEN_TRANSACTIONS}), \
         now() - make_interval(secs => {seconds}))"
    );
    let typed = match cursor_type {
        // A timestamp without time zone stamped by `now()` holds the writer's local time, in the
        // zone `cursorTimeZone` names (validated to a safe alphabet).
        CursorType::NaiveTimestamp => format!("({bound}) AT TIME ZONE '{}'", config.cursor_time_zone),
        _ => bound,
    };
    format!("SELECT {typed} AS bound, pg_has_role('pg_read_all_stats', 'USAGE') AS sees_every_session")
}

/// MySQL's bound, as a UTC DATETIME(6) (or the cursor's zone for a DATETIME cursor): the oldest
/// transaction's start (or now), minus `settleSeconds`; without INNODB_TRX (no `PROCESS`),
/// `now - settleSeconds` alone.
pub(crate) fn mysql_bound_sql(config: &SourceConfig, cursor_type: CursorType, with_transactions: bool) -> String {
    let seconds = config.settle.as_secs();
    let oldest = if with_transactions {
        "LEAST(COALESCE((SELECT CONVERT_TZ(MIN(trx_started), 'SYSTEM', '+00:00') FROM information_schema.INNODB_TRX \
         WHERE trx_mysql_thread_id <> CONNECTION_ID()), UTC_TIMESTAMP(6)), UTC_TIMESTAMP(6))"
            .to_string()
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

/// The oldest transaction that holds PostgreSQL's commit horizon (an xid poller) or the settle
/// bound: pid, database, seconds open, state, the start of its query.
pub(crate) fn postgres_holder_sql(holds: Horizon) -> String {
    let columns = |age_of: &str| {
        format!(
            "pid::int8 AS pid, datname::text AS database, \
             coalesce(extract(epoch FROM now() - {age_of}), 0)::float8 AS age, state::text AS state, \
             left(query, {FETCHED_QUERY_CHARS}) AS query"
        )
    };
    match holds {
        // The horizon is the oldest xid still running, cluster-wide: a session's, or a prepared
        // transaction's (which has no session).
        Horizon::CommitHorizon => format!(
            "SELECT pid, database, age, state, query FROM (\
             SELECT {}, age(backend_xid) AS xid_age FROM pg_stat_activity \
             WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid() \
             UNION ALL SELECT NULL::int8, database::text, extract(epoch FROM now() - prepared)::float8, \
             'prepared'::text, NULL::text, age(transaction) FROM pg_prepared_xacts\
             ) AS holders ORDER BY xid_age DESC LIMIT 1",
            columns("xact_start")
        ),
        Horizon::SettleBound => format!(
            "SELECT {} FROM pg_stat_activity WHERE {POSTGRES_OPEN_TRANSACTIONS} ORDER BY xact_start LIMIT 1",
            columns("xact_start")
        ),
    }
}

pub(crate) const MYSQL_HOLDER_SQL: &str = "SELECT CAST(t.trx_mysql_thread_id AS SIGNED) AS pid, p.DB AS `database`, \
     TIMESTAMPDIFF(SECOND, CONVERT_TZ(t.trx_started, 'SYSTEM', '+00:00'), UTC_TIMESTAMP()) AS age, \
     t.trx_state AS state, LEFT(COALESCE(t.trx_query, p.INFO), 200) AS query \
     FROM information_schema.INNODB_TRX t LEFT JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id \
     WHERE t.trx_mysql_thread_id <> CONNECTION_ID() ORDER BY t.trx_started LIMIT 1";

/// The value of a bound read back as the cursor's kind (a naive one for a naive cursor).
fn bound_value(at: NaiveDateTime, cursor_type: CursorType) -> CursorValue {
    match cursor_type {
        CursorType::NaiveTimestamp => CursorValue::NaiveTimestamp(at),
        _ => CursorValue::Timestamp { at: at.and_utc(), source_text: None },
    }
}

/// PostgreSQL's `settle: "auto"` bound; says once when this role cannot see other roles' sessions.
pub(crate) async fn postgres_bound(
    pool: &sqlx::PgPool,
    config: &SourceConfig,
    cursor_type: CursorType,
    redaction: &Redaction,
    warned: &AtomicBool,
) -> Result<CursorValue, SourceError> {
    let sql = postgres_bound_sql(config, cursor_type);
    let row =
        sqlx::query(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.map_err(|error| classify(redaction, error))?;
    let sees_every_session: bool = row.try_get(1).map_err(|error| classify(redaction, error))?;
    if !sees_every_session && !warned.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            source = %redaction.location,
            settle_seconds = config.settle.as_secs(),
            "settle \"auto\": this role cannot see other roles' transactions (grant it pg_read_all_stats): theirs are bounded by settleSeconds alone"
        );
    }
    let bound = match cursor_type {
        CursorType::NaiveTimestamp => {
            let at: NaiveDateTime = row.try_get(0).map_err(|error| classify(redaction, error))?;
            at
        }
        _ => {
            let at: DateTime<Utc> = row.try_get(0).map_err(|error| classify(redaction, error))?;
            at.naive_utc()
        }
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

/// What `status`, the watchdog and its alert show of a holder's query: its first characters
/// ([`query_prefix`]), escaped like any text a peer sends (another session wrote it), so that it
/// can never start a log line of its own.
fn shown_query(query: &str) -> String {
    escape_peer_text(&query_prefix(query))
}

/// The holder a row of [`postgres_holder_sql`] names.
fn holder_of(row: &sqlx::postgres::PgRow, holds: Horizon, redaction: &Redaction) -> Result<HorizonHolder, SourceError> {
    let failed = |error: sqlx::Error| classify(redaction, error);
    let pid: Option<i64> = row.try_get(0).map_err(failed)?;
    let database: Option<String> = row.try_get(1).map_err(failed)?;
    let age: Option<f64> = row.try_get(2).map_err(failed)?;
    let state: Option<String> = row.try_get(3).map_err(failed)?;
    let query: Option<String> = row.try_get(4).map_err(failed)?;
    Ok(HorizonHolder {
        holds,
        pid,
        database: database.as_deref().map(escape_peer_text),
        age_seconds: age.unwrap_or(0.0).max(0.0),
        state: state.as_deref().map(escape_peer_text),
        query: query.as_deref().map(shown_query),
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
    let row = sqlx::query(MYSQL_HOLDER_SQL).fetch_optional(pool).await.map_err(|error| classify(redaction, error))?;
    let Some(row) = row else {
        return Ok(None);
    };
    let failed = |error: sqlx::Error| classify(redaction, error);
    // MySQL types its columns loosely (an integer age, text that may come as bytes): read each
    // as what it is.
    let pid: Option<i64> = row.try_get(0).map_err(failed)?;
    let age: Option<i64> = row.try_get(2).map_err(failed)?;
    let text = |index: usize| -> Option<String> {
        row.try_get::<Option<String>, _>(index).ok().flatten().or_else(|| {
            row.try_get::<Option<Vec<u8>>, _>(index)
                .ok()
                .flatten()
                .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        })
    };
    Ok(Some(HorizonHolder {
        holds: Horizon::SettleBound,
        pid,
        database: text(1).as_deref().map(escape_peer_text),
        age_seconds: age.unwrap_or(0).max(0) as f64,
        state: text(3).as_deref().map(escape_peer_text),
        query: text(4).as_deref().map(shown_query),
    }))
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
    /// `now - settleSeconds`.
    #[test]
    fn the_postgres_bound_is_the_oldest_open_transaction_capped_by_settle() {
        let sql = postgres_bound_sql(&auto(Engine::Postgres), CursorType::Timestamp);
        assert_eq!(
            sql,
            "SELECT least((SELECT min(xact_start) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() \
             AND xact_start IS NOT NULL AND backend_type NOT IN ('autovacuum worker', 'walsender')), now() - make_interval(secs => 1)) AS bound, \
             pg_has_role('pg_read_all_stats', 'USAGE') AS sees_every_session"
        );
        assert!(
            !sql.contains("backend_xid"),
            "a transaction that has only read yet stamps its next row with its start"
        );
        let mut naive = auto(Engine::Postgres);
        naive.cursor_time_zone = "Europe/Paris".into();
        assert!(
            postgres_bound_sql(&naive, CursorType::NaiveTimestamp).contains(")) AT TIME ZONE 'Europe/Paris' AS bound")
        );
    }

    #[test]
    fn the_mysql_bound_reads_innodb_trx_in_utc_and_falls_back_to_settle() {
        let config = auto(Engine::MySql);
        let sql = mysql_bound_sql(&config, CursorType::Timestamp, true);
        assert!(sql.contains("CONVERT_TZ(MIN(trx_started), 'SYSTEM', '+00:00')"), "{sql}");
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
        assert!(postgres_holder_sql(Horizon::SettleBound).contains("datname = current_database()"));
    }
}
