//! `source.kind: "binlog"`: the MySQL/MariaDB binary log, read as a replica (issue 39). What a
//! polling source reads by (table, cursor, key, filters, settle) means nothing here and is
//! refused by name, rather than ignored, as for the logical source.

use super::function_json::RawSource;
use super::source_types::{
    BINLOG_CURSOR, Engine, Fingerprints, LOGICAL_KEY, SourceConfig, SourceTarget, validate_identifier,
};
use super::source_url::{UrlIdentity, effective_of, pool_key};
use super::stream::{Stream, polling_field, source_config};
use super::{ConfigError, Located, ranges};
use crate::domain::ids::source_fingerprint;

/// A binary-log source's configuration and fingerprint: its tables and server id checked, the
/// rest fixed (its cursor is the binary log position, its key the change's ordinal, no settle).
/// `derived_server_id` is used when `serverId` is not set.
pub(super) fn build(
    raw: RawSource,
    identity: UrlIdentity,
    resolved_url: String,
    derived_server_id: u32,
    at: &Located<'_>,
) -> Result<(SourceConfig, Fingerprints), ConfigError> {
    let tables = check(&raw, identity.engine, at)?;
    let server_id = match raw.server_id {
        None => derived_server_id,
        Some(id) => u32::try_from(id).ok().filter(|_| ranges::SERVER_ID.contains(&id)).ok_or_else(|| {
            let range = ranges::SERVER_ID;
            at.error("poller.source.serverId", format!("{id} is out of range {}..={}", range.start(), range.end()))
        })?,
    };
    let effective = effective_of(&identity, &resolved_url, &raw.connection, at)?;
    let pk = vec![LOGICAL_KEY.to_string()];
    // The server id is not part of the fingerprint: it names the reader, not what is read.
    let fingerprint = source_fingerprint(&effective.fingerprint_input(
        identity.engine,
        format!("binlog:{}", tables.join(",")),
        BINLOG_CURSOR,
        &pk,
    ));
    let pool_key = pool_key(identity.engine, &effective, &resolved_url);
    let target = SourceTarget::Binlog { tables, server_id };
    let stream = Stream { engine: identity.engine, url: resolved_url, target, cursor: BINLOG_CURSOR, pk, pool_key };
    let source = source_config(raw, stream, at)?;
    Ok((source, Fingerprints { current: fingerprint, legacy: None }))
}

/// Checks a binary-log source's fields; its tables, each `database.table`.
fn check(raw: &RawSource, engine: Engine, at: &Located<'_>) -> Result<Vec<String>, ConfigError> {
    if engine != Engine::MySql {
        return Err(at.error(
            "poller.source.kind",
            format!("\"binlog\" reads the binary log of MySQL or MariaDB; this source is {}", engine.name()),
        ));
    }
    if let Some(name) = polling_field(raw) {
        return Err(at.error(
            &format!("poller.source.{name}"),
            "belongs to a polling source: a binary-log source delivers every change of its tables, in commit order \
             (leave it out)",
        ));
    }
    if let Some(name) =
        [("slot", raw.slot.is_some()), ("publication", raw.publication.is_some()), ("origin", raw.origin.is_some())]
            .iter()
            .find_map(|(name, given)| given.then_some(*name))
    {
        return Err(at.error(&format!("poller.source.{name}"), "belongs to a logical source (kind \"logical\")"));
    }
    let tables = raw.tables.clone().filter(|tables| !tables.is_empty()).ok_or_else(|| {
        at.error("poller.source.tables", "a binary-log source needs its tables, each \"database.table\"")
    })?;
    for table in &tables {
        let valid = table
            .split_once('.')
            .is_some_and(|(database, name)| validate_identifier(database).is_ok() && validate_identifier(name).is_ok());
        if !valid {
            return Err(at.error(
                "poller.source.tables",
                format!("{table:?} is not \"database.table\" (letters, digits, '_' and '$' in each)"),
            ));
        }
    }
    let mut sorted = tables.clone();
    sorted.sort();
    sorted.dedup();
    if sorted.len() != tables.len() {
        return Err(at.error("poller.source.tables", "a table is named twice"));
    }
    Ok(tables)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::config::{PollerConfig, Settings, SourceTarget};

    fn load(source: serde_json::Value) -> Result<PollerConfig, crate::config::ConfigError> {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("orders")).unwrap();
        let document = json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "*/10 * * * * *"}],
            "poller": {"source": source, "sink": {"type": "webhook", "url": "http://127.0.0.1:9/hook"},
                       "state": {"connection": "STATE"}}
        });
        std::fs::write(root.path().join("orders/function.json"), serde_json::to_vec(&document).unwrap()).unwrap();
        let settings = Settings::from_pairs([
            ("FEED_DB", "mysql://u@127.0.0.1:3306/shop"),
            ("PG", "postgres://u@127.0.0.1:5432/shop"),
            ("STATE", "file:state"),
        ]);
        PollerConfig::load(root.path(), "orders", &settings, None)
    }

    fn binlog() -> serde_json::Value {
        json!({"kind": "binlog", "connection": "FEED_DB", "tables": ["shop.orders", "shop.lines"]})
    }

    /// Like a logical source's: read in commit order, no late rows, no detector.
    #[test]
    fn a_binlog_source_has_no_late_arrival_detector() {
        assert!(!load(binlog()).unwrap().late_arrivals.enabled);
        let mut source = binlog();
        source["lateArrivals"] = json!({"everyTicks": 5});
        let message = load(source).unwrap_err().to_string();
        assert!(message.contains("poller.source.lateArrivals: a change stream is read in commit order"), "{message}");
    }

    #[test]
    fn a_binlog_source_takes_its_tables_and_derives_its_server_id() {
        let config = load(binlog()).unwrap();
        let SourceTarget::Binlog { tables, server_id } = &config.source.target else { panic!("not binlog") };
        assert_eq!(tables, &["shop.orders", "shop.lines"]);
        assert_eq!(*server_id, crate::domain::binlog::derived_server_id(&config.app_name, "orders"));
        let mut source = binlog();
        source["serverId"] = json!(77);
        let config = load(source).unwrap();
        assert!(matches!(config.source.target, SourceTarget::Binlog { server_id: 77, .. }));
        // Below 4, a reader of `status` (the id with a low bit flipped) could be 0.
        for id in [0, 3] {
            let mut source = binlog();
            source["serverId"] = json!(id);
            let message = load(source).unwrap_err().to_string();
            assert!(
                message.contains(&format!("poller.source.serverId: {id} is out of range 4..=4294967295")),
                "{message}"
            );
        }
    }

    #[test]
    fn polling_and_logical_fields_are_refused_by_name() {
        for (field, value) in [("cursor", json!("id")), ("maxConnections", json!(2)), ("slot", json!("s"))] {
            let mut source = binlog();
            source[field] = value;
            let message = load(source).unwrap_err().to_string();
            assert!(message.contains(&format!("poller.source.{field}: belongs to a")), "{message}");
        }
        let mut source = binlog();
        source["tables"] = json!(["orders"]);
        assert!(load(source).unwrap_err().to_string().contains("is not \"database.table\""));
        let mut source = binlog();
        source["connection"] = json!("PG");
        assert!(load(source).unwrap_err().to_string().contains("this source is postgres"));
        let polling =
            json!({"connection": "FEED_DB", "table": "orders", "cursor": "id", "pk": ["id"], "tables": ["a.b"]});
        assert!(
            load(polling).unwrap_err().to_string().contains("poller.source.tables: belongs to a binary-log source")
        );
    }
}
