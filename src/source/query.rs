//! The keyset query, built as text from validated identifiers. Pure, so every dialect's SQL is
//! unit-tested.

use crate::config::{Engine, SourceConfig, SourceTarget};

/// Quotes an identifier that config validation has already restricted to `[A-Za-z0-9_$]`.
pub fn quote_identifier(engine: Engine, identifier: &str) -> String {
    match engine {
        Engine::MySql => format!("`{identifier}`"),
        Engine::Sqlite | Engine::Postgres => format!("\"{identifier}\""),
    }
}

fn placeholder(engine: Engine, index: usize) -> String {
    match engine {
        Engine::Postgres => format!("${index}"),
        Engine::Sqlite | Engine::MySql => "?".to_string(),
    }
}

/// The SQL of one seek, and how many parameters it binds before the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeekQuery {
    /// `SELECT ... WHERE (c, pk) > (?, ?) ... ORDER BY c, pk LIMIT ?` (after a checkpoint).
    pub after: String,
    /// The same without the seek predicate: the first batch ever.
    pub from_start: String,
}

/// Builds both forms of the seek for a source.
pub fn build_seek(config: &SourceConfig) -> SeekQuery {
    let engine = config.engine;
    let quote = |identifier: &str| quote_identifier(engine, identifier);
    let mut selected: Vec<String> = Vec::new();
    let projection = match &config.columns {
        None => "*".to_string(),
        Some(columns) => {
            for column in columns
                .iter()
                .chain(std::iter::once(&config.cursor))
                .chain(config.pk.iter())
            {
                if !selected.contains(column) {
                    selected.push(column.clone());
                }
            }
            selected
                .iter()
                .map(|column| quote(column))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let from = match &config.target {
        SourceTarget::Table {
            schema: Some(schema),
            name,
        } => format!("{}.{}", quote(schema), quote(name)),
        SourceTarget::Table { schema: None, name } => quote(name),
        SourceTarget::Query(query) => format!("({query}) AS dbtrigger_source"),
    };
    let mut key_columns = vec![quote(&config.cursor)];
    key_columns.extend(config.pk.iter().map(|column| quote(column)));
    let order_by = key_columns.join(", ");
    let filter = config
        .where_clause
        .as_ref()
        .map(|clause| format!("({clause})"));

    let seek_placeholders: Vec<String> = (1..=key_columns.len())
        .map(|index| placeholder(engine, index))
        .collect();
    let seek = format!(
        "({}) > ({})",
        key_columns.join(", "),
        seek_placeholders.join(", ")
    );

    let compose = |predicates: Vec<String>, limit_index: usize| {
        let where_part = if predicates.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", predicates.join(" AND "))
        };
        format!(
            "SELECT {projection} FROM {from}{where_part} ORDER BY {order_by} LIMIT {}",
            placeholder(engine, limit_index)
        )
    };
    let mut after_predicates = vec![seek];
    after_predicates.extend(filter.clone());
    let start_predicates: Vec<String> = filter.into_iter().collect();
    SeekQuery {
        after: compose(after_predicates, key_columns.len() + 1),
        from_start: compose(start_predicates, 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;
    use std::time::Duration;

    fn config(
        engine: Engine,
        columns: Option<Vec<&str>>,
        where_clause: Option<&str>,
    ) -> SourceConfig {
        SourceConfig {
            connection: "DB".into(),
            engine,
            url: Secret::new("x"),
            target: SourceTarget::Table {
                schema: Some("public".into()),
                name: "orders".into(),
            },
            cursor: "updated_at".into(),
            pk: vec!["tenant".into(), "id".into()],
            columns: columns.map(|list| list.into_iter().map(str::to_string).collect()),
            where_clause: where_clause.map(str::to_string),
            settle: Duration::ZERO,
        }
    }

    #[test]
    fn sqlite_seek_is_a_row_value_comparison() {
        let query = build_seek(&config(Engine::Sqlite, None, None));
        assert_eq!(
            query.after,
            "SELECT * FROM \"public\".\"orders\" WHERE (\"updated_at\", \"tenant\", \"id\") > (?, ?, ?) ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT ?"
        );
        assert_eq!(
            query.from_start,
            "SELECT * FROM \"public\".\"orders\" ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT ?"
        );
    }

    #[test]
    fn postgres_numbers_its_placeholders_and_keeps_the_filter() {
        let query = build_seek(&config(
            Engine::Postgres,
            Some(vec!["status"]),
            Some("tenant = 7"),
        ));
        assert_eq!(
            query.after,
            "SELECT \"status\", \"updated_at\", \"tenant\", \"id\" FROM \"public\".\"orders\" WHERE (\"updated_at\", \"tenant\", \"id\") > ($1, $2, $3) AND (tenant = 7) ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT $4"
        );
        assert!(
            query.from_start.ends_with(
                "WHERE (tenant = 7) ORDER BY \"updated_at\", \"tenant\", \"id\" LIMIT $1"
            )
        );
    }

    #[test]
    fn mysql_quotes_with_backticks() {
        let query = build_seek(&config(Engine::MySql, None, None));
        assert!(query.after.starts_with(
            "SELECT * FROM `public`.`orders` WHERE (`updated_at`, `tenant`, `id`) > (?, ?, ?)"
        ));
    }

    #[test]
    fn a_query_source_is_wrapped_as_a_subquery() {
        let mut source = config(Engine::Sqlite, None, None);
        source.target = SourceTarget::Query("SELECT * FROM orders WHERE total > 0".into());
        let query = build_seek(&source);
        assert!(query.from_start.starts_with(
            "SELECT * FROM (SELECT * FROM orders WHERE total > 0) AS dbtrigger_source ORDER BY"
        ));
    }
}
