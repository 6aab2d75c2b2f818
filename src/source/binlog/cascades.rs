//! `check`'s warning for a binary-log poller: MariaDB (InnoDB) applies a foreign key's cascade
//! (`ON DELETE CASCADE`, `SET NULL`, `SET DEFAULT`, and the same `ON UPDATE`) inside the storage
//! engine, and the binary log holds only the statement's own rows: the rows a cascade changes
//! have no event, and their changes never arrive (docs/binlog.md, "What an event holds";
//! `binlog_cascades::a_cascaded_delete_is_not_in_the_binary_log_and_check_warns`).

use mysql_async::prelude::Queryable;

/// A foreign key as `information_schema.REFERENTIAL_CONSTRAINTS` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignKey {
    pub schema: String,
    pub name: String,
    /// The table that holds the key (the rows the cascade changes).
    pub child: String,
    pub parent_schema: String,
    pub parent: String,
    pub delete_rule: String,
    pub update_rule: String,
}

/// What a rule does to the child's rows when it is not `RESTRICT` / `NO ACTION` (those refuse
/// the parent's change and change no child row).
fn cascades(rule: &str) -> bool {
    matches!(rule.to_ascii_uppercase().as_str(), "CASCADE" | "SET NULL" | "SET DEFAULT")
}

/// One warning per foreign key whose cascade changes rows of a watched table (`schema.table`),
/// naming it, its tables and its rules; in the order the keys are given.
pub fn warnings(tables: &[String], keys: &[ForeignKey]) -> Vec<String> {
    let mut warnings = Vec::new();
    for key in keys {
        let child = format!("{}.{}", key.schema, key.child);
        if !tables.iter().any(|table| table.eq_ignore_ascii_case(&child)) {
            continue;
        }
        let mut rules = Vec::new();
        if cascades(&key.delete_rule) {
            rules.push(format!("ON DELETE {}", key.delete_rule.to_ascii_uppercase()));
        }
        if cascades(&key.update_rule) {
            rules.push(format!("ON UPDATE {}", key.update_rule.to_ascii_uppercase()));
        }
        if rules.is_empty() {
            continue;
        }
        warnings.push(format!(
            "{child} is changed by foreign key {} (to {}.{}, {}): the binary log holds no event for a row a \
             cascade changes, so those changes of {child} never arrive (docs/binlog.md, \"What an event holds\")",
            key.name,
            key.parent_schema,
            key.parent,
            rules.join(", "),
        ));
    }
    warnings
}

/// The foreign keys of the server that change a child's rows (see [`cascades`]).
async fn cascading_keys(conn: &mut mysql_async::Conn) -> Result<Vec<ForeignKey>, mysql_async::Error> {
    let rows: Vec<(String, String, String, String, String, String, String)> = conn
        .query(
            "SELECT CONSTRAINT_SCHEMA, CONSTRAINT_NAME, TABLE_NAME, UNIQUE_CONSTRAINT_SCHEMA, REFERENCED_TABLE_NAME, \
             DELETE_RULE, UPDATE_RULE FROM information_schema.REFERENTIAL_CONSTRAINTS \
             WHERE DELETE_RULE IN ('CASCADE', 'SET NULL', 'SET DEFAULT') \
             OR UPDATE_RULE IN ('CASCADE', 'SET NULL', 'SET DEFAULT') \
             ORDER BY CONSTRAINT_SCHEMA, TABLE_NAME, CONSTRAINT_NAME",
        )
        .await?;
    Ok(rows
        .into_iter()
        .map(|(schema, name, child, parent_schema, parent, delete_rule, update_rule)| ForeignKey {
            schema,
            name,
            child,
            parent_schema,
            parent,
            delete_rule,
            update_rule,
        })
        .collect())
}

/// [`warnings`] for `tables` on the server of `url` (its errors as text, the URL's secrets
/// scrubbed).
pub async fn check(url: &str, tables: &[String]) -> Result<Vec<String>, String> {
    let redaction = crate::config::redact::Redaction::of_url(url);
    let options = super::server::options_of(url).map_err(|reason| redaction.scrub(&reason))?;
    let mut conn = mysql_async::Conn::new(options).await.map_err(|error| redaction.scrub(&error.to_string()))?;
    let keys = cascading_keys(&mut conn).await.map_err(|error| redaction.scrub(&error.to_string()));
    let _ = conn.disconnect().await;
    Ok(warnings(tables, &keys?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str, child: &str, delete_rule: &str, update_rule: &str) -> ForeignKey {
        ForeignKey {
            schema: "shop".into(),
            name: name.into(),
            child: child.into(),
            parent_schema: "shop".into(),
            parent: "orders".into(),
            delete_rule: delete_rule.into(),
            update_rule: update_rule.into(),
        }
    }

    #[test]
    fn a_watched_table_a_cascade_changes_is_warned_of_naming_the_key() {
        let keys = [
            key("lines_order", "lines", "CASCADE", "RESTRICT"),
            key("notes_order", "notes", "SET NULL", "CASCADE"),
            key("refused", "audits", "RESTRICT", "NO ACTION"),
            key("unwatched", "drafts", "CASCADE", "CASCADE"),
        ];
        let tables = ["shop.orders".to_string(), "shop.lines".into(), "Shop.Notes".into(), "shop.audits".into()];
        let found = warnings(&tables, &keys);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0]
                .starts_with("shop.lines is changed by foreign key lines_order (to shop.orders, ON DELETE CASCADE):"),
            "{}",
            found[0]
        );
        assert!(
            found[1].contains("notes_order (to shop.orders, ON DELETE SET NULL, ON UPDATE CASCADE)"),
            "{}",
            found[1]
        );
        assert!(warnings(&["shop.orders".to_string()], &keys).is_empty(), "the parent's own changes are logged");
    }
}
