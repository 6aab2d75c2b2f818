//! `dbtrigger sql <poller>`: the DDL a poller's cursor needs on its engine, printed for a person to
//! review and run. dbtrigger never runs it. Pure text from the validated configuration; every
//! statement can be run twice (`IF NOT EXISTS`, `CREATE OR REPLACE`, a trigger dropped and created
//! in one transaction) where the engine allows, and says so where it does not.
//!
//! - `cursorKind: "xid"` (PostgreSQL): an `xid8` column defaulting to `pg_current_xact_id()`, a
//!   trigger restamping it on every insert and update (an `INSERT` that names the column, a copy
//!   from another table, would otherwise keep a foreign id), the index on (cursor, pk…), and the
//!   optional grant that lets `status` name what holds the horizon in other roles' sessions.
//! - `settle: "auto"`: the timestamp the database stamps (PostgreSQL `now()` by a trigger,
//!   MySQL/MariaDB `DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6)`), the index, and
//!   the privilege the bound reads with (`pg_read_all_stats`, `PROCESS`).
//! - Any other cursor: its index.

use std::fmt::Write as _;

use super::query::quote_identifier;
use crate::config::source::{CursorKind, SettleMode};
use crate::config::{Engine, SourceConfig, SourceTarget};

/// PostgreSQL truncates longer identifiers (with a notice): names made here are cut to fit, so
/// that a second run finds the same objects.
const MAX_IDENTIFIER_BYTES: usize = 63;

/// The DDL of `poller`'s cursor; `user` is the account its URL connects as (for the grant).
pub fn cursor_ddl(poller: &str, config: &SourceConfig, user: Option<&str>) -> Result<String, String> {
    let SourceTarget::Table { schema, name } = &config.target else {
        return Err(format!(
            "poller {poller} reads a query (source.query): its DDL depends on the tables behind it; \
             run `dbtrigger sql` on a poller of the table, or write it by hand"
        ));
    };
    let engine = config.engine;
    let quote = |identifier: &str| quote_identifier(engine, identifier);
    let table = match schema {
        Some(schema) => format!("{}.{}", quote(schema), quote(name)),
        None => quote(name),
    };
    let cursor = quote(&config.cursor);
    let mut index_columns = vec![cursor.clone()];
    index_columns.extend(config.pk.iter().map(|key| quote(key)));
    let index_name = identifier(&format!("{name}_{}_dbtrigger", config.cursor));
    let what = match (config.cursor_kind, config.settle_mode) {
        (Some(CursorKind::Xid), _) => "cursorKind \"xid\"",
        (_, SettleMode::Auto) => "settle \"auto\"",
        _ => "settleSeconds",
    };
    let engine_name = match engine {
        Engine::Postgres => "PostgreSQL",
        Engine::MySql => "MySQL/MariaDB",
        Engine::Sqlite => "SQLite",
    };
    let mut out = String::new();
    let _ = writeln!(out, "-- dbtrigger sql {poller}: cursor {cursor} of {table} ({engine_name}, {what}).");
    out.push_str(
        "-- Printed for a person to review and run: dbtrigger never runs it. Every statement can run twice.\n",
    );
    let index = |out: &mut String, if_not_exists: &str| {
        let _ = writeln!(
            out,
            "CREATE INDEX {if_not_exists}{} ON {table} ({});",
            quote(&index_name),
            index_columns.join(", ")
        );
    };
    match (engine, config.cursor_kind, config.settle_mode) {
        (Engine::Postgres, Some(CursorKind::Xid), _) => {
            let function =
                qualified(engine, schema.as_deref(), &identifier(&format!("dbtrigger_stamp_xid_{}", config.cursor)));
            let trigger = quote(&identifier(&format!("dbtrigger_stamp_{}", config.cursor)));
            out.push_str(
                "BEGIN;\n\
                 -- The id of the transaction that wrote each row (xid8: PostgreSQL 13 or later). Adding the column\n\
                 -- rewrites the table under an exclusive lock; rows already there get this transaction's id.\n",
            );
            let _ = writeln!(
                out,
                "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {cursor} xid8 NOT NULL DEFAULT pg_current_xact_id();"
            );
            out.push_str("-- Every insert and update stamps it, whatever the statement wrote there.\n");
            stamping_trigger(&mut out, &function, &trigger, &table, &cursor, "pg_current_xact_id()");
            out.push_str(
                "-- The seek's index (on a large busy table, CREATE INDEX CONCURRENTLY, outside a transaction).\n",
            );
            index(&mut out, "IF NOT EXISTS ");
            out.push_str("COMMIT;\n");
            out.push_str(
                "-- Optional: lets `dbtrigger status` name what holds the horizon back in other roles' sessions.\n",
            );
            grant(&mut out, engine, user, "pg_read_all_stats");
        }
        (Engine::Postgres, _, SettleMode::Auto) => {
            let function =
                qualified(engine, schema.as_deref(), &identifier(&format!("dbtrigger_stamp_now_{}", config.cursor)));
            let trigger = quote(&identifier(&format!("dbtrigger_stamp_{}", config.cursor)));
            out.push_str(
                "BEGIN;\n\
                 -- The start of the writing transaction, which the bound (the oldest open transaction's start)\n\
                 -- is compared with. timestamptz: a timestamp without time zone would hold the writer's session\n\
                 -- zone, which must then be cursorTimeZone. Adding the column rewrites the table.\n",
            );
            let _ = writeln!(
                out,
                "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {cursor} timestamptz NOT NULL DEFAULT now();"
            );
            let _ = writeln!(out, "ALTER TABLE {table} ALTER COLUMN {cursor} SET DEFAULT now();");
            out.push_str("-- Every insert and update stamps it: a time the application supplies cannot be bounded.\n");
            stamping_trigger(&mut out, &function, &trigger, &table, &cursor, "now()");
            out.push_str(
                "-- The seek's index (on a large busy table, CREATE INDEX CONCURRENTLY, outside a transaction).\n",
            );
            index(&mut out, "IF NOT EXISTS ");
            out.push_str("COMMIT;\n");
            out.push_str(
                "-- The bound reads every session's transaction start: other roles' are visible with pg_read_all_stats.\n",
            );
            grant(&mut out, engine, user, "pg_read_all_stats");
        }
        (Engine::MySql, _, SettleMode::Auto) => {
            out.push_str(
                "-- Stamped by the server at each insert and update, to the microsecond: TIMESTAMP without\n\
                 -- fractional seconds makes ties of a whole second, and a time the application supplies cannot\n\
                 -- be bounded. (MySQL's TIMESTAMP ends in 2038.) The column must exist; to add it, on MariaDB:\n",
            );
            let _ = writeln!(
                out,
                "--   ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {cursor} TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6);"
            );
            let _ = writeln!(
                out,
                "ALTER TABLE {table} MODIFY COLUMN {cursor} TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6);"
            );
            out.push_str(
                "-- The seek's index. MariaDB knows IF NOT EXISTS here; MySQL does not: there, drop those three\n\
                 -- words and skip the statement when SHOW INDEX already lists it.\n",
            );
            index(&mut out, "IF NOT EXISTS ");
            out.push_str(
                "-- The bound reads information_schema.INNODB_TRX, which needs PROCESS (adjust the host part).\n",
            );
            grant(&mut out, engine, user, "PROCESS");
        }
        (Engine::Sqlite, _, _) => {
            out.push_str("-- The seek's index.\n");
            index(&mut out, "IF NOT EXISTS ");
        }
        (Engine::Postgres, _, SettleMode::Fixed) => {
            out.push_str(
                "-- A cursor read with settleSeconds needs its index only. For a cursor that cannot skip a late\n\
                 -- commit, see cursorKind \"xid\" (or settle \"auto\" on a timestamp the database stamps).\n",
            );
            index(&mut out, "IF NOT EXISTS ");
        }
        (Engine::MySql, _, SettleMode::Fixed) => {
            out.push_str(
                "-- A cursor read with settleSeconds needs its index only (for a bound, see settle \"auto\").\n\
                 -- MariaDB knows IF NOT EXISTS here; MySQL does not: drop those three words there.\n",
            );
            index(&mut out, "IF NOT EXISTS ");
        }
    }
    Ok(out)
}

/// `identifier`, cut to what PostgreSQL keeps (the configured names are ASCII).
fn identifier(name: &str) -> String {
    name.chars().take(MAX_IDENTIFIER_BYTES).collect()
}

fn qualified(engine: Engine, schema: Option<&str>, name: &str) -> String {
    match schema {
        Some(schema) => format!("{}.{}", quote_identifier(engine, schema), quote_identifier(engine, name)),
        None => quote_identifier(engine, name),
    }
}

/// A PostgreSQL trigger function setting `cursor` to `value`, and its row trigger on `table`
/// (dropped and created again: `CREATE OR REPLACE TRIGGER` needs PostgreSQL 14).
fn stamping_trigger(out: &mut String, function: &str, trigger: &str, table: &str, cursor: &str, value: &str) {
    let _ = writeln!(
        out,
        "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $dbtrigger$\n\
         BEGIN\n    NEW.{cursor} := {value};\n    RETURN NEW;\nEND\n$dbtrigger$;"
    );
    let _ = writeln!(out, "DROP TRIGGER IF EXISTS {trigger} ON {table};");
    let _ = writeln!(
        out,
        "CREATE TRIGGER {trigger} BEFORE INSERT OR UPDATE ON {table} FOR EACH ROW EXECUTE FUNCTION {function}();"
    );
}

/// The grant of `privilege` to `user` (a role on PostgreSQL, a global privilege on MySQL); a
/// commented line naming what to fill in when the URL names no user.
fn grant(out: &mut String, engine: Engine, user: Option<&str>, privilege: &str) {
    let statement = match (engine, user) {
        (Engine::Postgres, Some(user)) => format!("GRANT {privilege} TO \"{}\";", user.replace('"', "\"\"")),
        (Engine::MySql, Some(user)) => format!("GRANT {privilege} ON *.* TO '{}'@'%';", user.replace('\'', "''")),
        (Engine::Postgres, None) => format!("-- GRANT {privilege} TO <the poller's role>;"),
        (Engine::MySql, None) => format!("-- GRANT {privilege} ON *.* TO '<the poller's user>'@'%';"),
        (Engine::Sqlite, _) => return,
    };
    out.push_str(&statement);
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::query::tests::config;

    fn xid() -> SourceConfig {
        let mut source = config(Engine::Postgres, None, None);
        source.cursor = "txid".into();
        source.cursor_kind = Some(CursorKind::Xid);
        source
    }

    /// Issue 26, item 2: the xid DDL adds the column, a trigger restamping it on every insert and
    /// update, and the index on (cursor, pk…), in one transaction, each statement safe twice.
    #[test]
    fn the_xid_ddl_adds_the_column_the_trigger_and_the_index() {
        let ddl = cursor_ddl("orders", &xid(), Some("reader")).unwrap();
        for expected in [
            "ALTER TABLE \"public\".\"orders\" ADD COLUMN IF NOT EXISTS \"txid\" xid8 NOT NULL DEFAULT pg_current_xact_id();",
            "CREATE OR REPLACE FUNCTION \"public\".\"dbtrigger_stamp_xid_txid\"() RETURNS trigger LANGUAGE plpgsql AS $dbtrigger$\nBEGIN\n    NEW.\"txid\" := pg_current_xact_id();",
            "DROP TRIGGER IF EXISTS \"dbtrigger_stamp_txid\" ON \"public\".\"orders\";",
            "CREATE TRIGGER \"dbtrigger_stamp_txid\" BEFORE INSERT OR UPDATE ON \"public\".\"orders\" FOR EACH ROW EXECUTE FUNCTION \"public\".\"dbtrigger_stamp_xid_txid\"();",
            "CREATE INDEX IF NOT EXISTS \"orders_txid_dbtrigger\" ON \"public\".\"orders\" (\"txid\", \"tenant\", \"id\");",
            "GRANT pg_read_all_stats TO \"reader\";",
        ] {
            assert!(ddl.contains(expected), "missing {expected:?} in:\n{ddl}");
        }
        assert!(ddl.starts_with(
            "-- dbtrigger sql orders: cursor \"txid\" of \"public\".\"orders\" (PostgreSQL, cursorKind \"xid\")."
        ));
        assert!(ddl.find("BEGIN;").unwrap() < ddl.find("DROP TRIGGER").unwrap());
        assert!(ddl.find("CREATE TRIGGER").unwrap() < ddl.find("COMMIT;").unwrap());
    }

    #[test]
    fn settle_auto_ddl_stamps_with_the_database_clock_and_grants_what_the_bound_reads() {
        let mut postgres = config(Engine::Postgres, None, None);
        postgres.settle_mode = SettleMode::Auto;
        let ddl = cursor_ddl("orders", &postgres, Some("we\"ird")).unwrap();
        assert!(ddl.contains("ADD COLUMN IF NOT EXISTS \"updated_at\" timestamptz NOT NULL DEFAULT now();"), "{ddl}");
        assert!(ddl.contains("NEW.\"updated_at\" := now();"), "{ddl}");
        assert!(ddl.contains("GRANT pg_read_all_stats TO \"we\"\"ird\";"), "{ddl}");
        let mut mysql = config(Engine::MySql, None, None);
        mysql.settle_mode = SettleMode::Auto;
        let ddl = cursor_ddl("orders", &mysql, Some("o'brien")).unwrap();
        assert!(
            ddl.contains("ALTER TABLE `public`.`orders` MODIFY COLUMN `updated_at` TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6);"),
            "{ddl}"
        );
        assert!(ddl.contains("CREATE INDEX IF NOT EXISTS `orders_updated_at_dbtrigger` ON `public`.`orders` (`updated_at`, `tenant`, `id`);"));
        assert!(ddl.contains("GRANT PROCESS ON *.* TO 'o''brien'@'%';"), "{ddl}");
        assert!(ddl.contains("whole second"), "docs/sources.md's warning is in the DDL's comment too");
        let ddl = cursor_ddl("orders", &mysql, None).unwrap();
        assert!(ddl.contains("-- GRANT PROCESS ON *.* TO '<the poller's user>'@'%';"), "{ddl}");
    }

    #[test]
    fn other_cursors_get_their_index_and_a_query_source_is_refused() {
        let plain = cursor_ddl("orders", &config(Engine::Sqlite, None, None), None).unwrap();
        assert!(plain.contains("CREATE INDEX IF NOT EXISTS \"orders_updated_at_dbtrigger\" ON \"public\".\"orders\" (\"updated_at\", \"tenant\", \"id\");"));
        assert!(!plain.contains("GRANT") && !plain.contains("TRIGGER"));
        let mut query = config(Engine::Postgres, None, None);
        query.target = SourceTarget::Query("SELECT * FROM orders".into());
        assert!(cursor_ddl("orders", &query, None).unwrap_err().contains("reads a query"));
        let mut long = xid();
        long.cursor = "c".repeat(63);
        let ddl = cursor_ddl("orders", &long, None).unwrap();
        assert!(ddl.contains(&format!("\"dbtrigger_stamp_xid_{}\"", "c".repeat(43))), "names fit in 63 bytes");
    }
}
