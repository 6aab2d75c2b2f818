//! `source.kind: "logical"`: PostgreSQL logical decoding through a replication slot and a
//! publication. What a polling source reads by (table, cursor, key, filters, settle) means
//! nothing here and is refused by name, rather than ignored.

use super::function_json::RawSource;
use super::source_types::{
    Engine, Fingerprints, LOGICAL_CURSOR, LOGICAL_KEY, Origin, SourceConfig, SourceTarget, validate_identifier,
};
use super::source_url::{UrlIdentity, effective_of, pool_key};
use super::stream::{Stream, polling_field, source_config};
use super::{ConfigError, Located};
use crate::domain::ids::source_fingerprint;

/// A logical source's configuration and fingerprint: its slot and publication checked, the rest
/// fixed (its cursor is the commit LSN, its key the change's ordinal, no settle).
pub(super) fn build(
    raw: RawSource,
    identity: UrlIdentity,
    resolved_url: String,
    at: &Located<'_>,
) -> Result<(SourceConfig, Fingerprints), ConfigError> {
    let (slot, publication, origin) = check(&raw, identity.engine, at)?;
    let effective = effective_of(&identity, &resolved_url, &raw.connection, at)?;
    let pk = vec![LOGICAL_KEY.to_string()];
    let fingerprint = source_fingerprint(&effective.fingerprint_input(
        identity.engine,
        format!("logical:{slot}:{publication}"),
        LOGICAL_CURSOR,
        &pk,
    ));
    let pool_key = pool_key(identity.engine, &effective, &resolved_url);
    let target = SourceTarget::Logical { slot, publication, origin };
    let stream = Stream { engine: identity.engine, url: resolved_url, target, cursor: LOGICAL_CURSOR, pk, pool_key };
    let source = source_config(raw, stream, at)?;
    Ok((source, Fingerprints { current: fingerprint, legacy: None }))
}

/// Checks a logical source's fields; its slot, publication and origin.
fn check(raw: &RawSource, engine: Engine, at: &Located<'_>) -> Result<(String, String, Origin), ConfigError> {
    if engine != Engine::Postgres {
        return Err(at.error(
            "poller.source.kind",
            format!("\"logical\" reads PostgreSQL's logical decoding; this source is {}", engine.name()),
        ));
    }
    if let Some(name) = polling_field(raw) {
        return Err(at.error(
            &format!("poller.source.{name}"),
            "belongs to a polling source: a logical source delivers every change of its publication's tables, \
             in commit order (leave it out)",
        ));
    }
    if let Some(name) = [("tables", raw.tables.is_some()), ("serverId", raw.server_id.is_some())]
        .iter()
        .find_map(|(name, given)| given.then_some(*name))
    {
        return Err(at.error(&format!("poller.source.{name}"), "belongs to a binary-log source (kind \"binlog\")"));
    }
    let slot = raw
        .slot
        .clone()
        .ok_or_else(|| at.error("poller.source.slot", "a logical source needs its replication slot"))?;
    check_slot_name(&slot).map_err(|reason| at.error("poller.source.slot", reason))?;
    let publication = raw
        .publication
        .clone()
        .ok_or_else(|| at.error("poller.source.publication", "a logical source needs its publication"))?;
    validate_identifier(&publication).map_err(|reason| at.error("poller.source.publication", reason))?;
    let origin = match raw.origin.as_deref() {
        None | Some("any") => Origin::Any,
        Some("none") => Origin::None,
        Some(other) => {
            return Err(at.error(
                "poller.source.origin",
                format!(
                    "{other:?}: expected \"any\" (every change, the default) or \"none\" (only changes made without \
                     a replication origin, PostgreSQL 16+)"
                ),
            ));
        }
    };
    Ok((slot, publication, origin))
}

/// PostgreSQL's rule for a slot name: lower-case letters, digits and `_`, at most 63 characters.
fn check_slot_name(slot: &str) -> Result<(), String> {
    let valid = !slot.is_empty()
        && slot.len() <= 63
        && slot.bytes().all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'_');
    if valid {
        Ok(())
    } else {
        Err(format!("{slot:?} is not a slot name: lower-case letters, digits and '_', at most 63 characters"))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::config::{PollerConfig, Settings};

    fn load(source: serde_json::Value) -> Result<PollerConfig, crate::config::ConfigError> {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("orders")).unwrap();
        let document = json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "*/10 * * * * *"}],
            "poller": {"source": source, "sink": {"type": "webhook", "url": "http://127.0.0.1:9/hook"},
                       "state": {"connection": "STATE"}}
        });
        std::fs::write(root.path().join("orders/function.json"), serde_json::to_vec(&document).unwrap()).unwrap();
        let settings = Settings::from_pairs([("FEED_DB", "postgres://u@127.0.0.1:5432/shop"), ("STATE", "file:state")]);
        PollerConfig::load(root.path(), "orders", &settings, None)
    }

    fn logical() -> serde_json::Value {
        json!({"kind": "logical", "connection": "FEED_DB", "slot": "feed_slot", "publication": "feed"})
    }

    #[test]
    fn max_connections_is_refused_by_name_like_the_other_polling_fields() {
        let config = load(logical()).unwrap();
        assert_eq!(config.source.max_connections, 1);
        let mut source = logical();
        source["maxConnections"] = json!(4);
        let message = load(source).unwrap_err().to_string();
        assert!(
            message.ends_with(
                "poller.source.maxConnections: belongs to a polling source: a logical source delivers every change \
                 of its publication's tables, in commit order (leave it out)"
            ),
            "{message}"
        );
        let mut source = logical();
        source["cursor"] = json!("id");
        assert!(load(source).unwrap_err().to_string().contains("poller.source.cursor: belongs to a polling source"));
    }

    #[test]
    fn origin_is_any_by_default_none_when_asked_and_refused_elsewhere() {
        use crate::config::{Origin, SourceTarget};
        let origin_of = |config: &PollerConfig| match &config.source.target {
            SourceTarget::Logical { origin, .. } => *origin,
            other => panic!("{other:?}"),
        };
        assert_eq!(origin_of(&load(logical()).unwrap()), Origin::Any);
        for (written, expected) in [("any", Origin::Any), ("none", Origin::None)] {
            let mut source = logical();
            source["origin"] = json!(written);
            let config = load(source).unwrap();
            assert_eq!(origin_of(&config), expected);
            // A filter on which changes are sent: positions mean the same, the fingerprint stays.
            assert_eq!(config.fingerprint, load(logical()).unwrap().fingerprint);
        }
        let mut source = logical();
        source["origin"] = json!("local");
        let message = load(source).unwrap_err().to_string();
        assert!(message.contains("poller.source.origin: \"local\": expected \"any\""), "{message}");
        let polling =
            json!({"connection": "FEED_DB", "table": "orders", "cursor": "id", "pk": ["id"], "origin": "none"});
        let message = load(polling).unwrap_err().to_string();
        assert!(message.ends_with("poller.source.origin: belongs to a logical source (kind \"logical\")"), "{message}");
    }

    /// A change stream hands out changes in commit order: none can commit behind the checkpoint,
    /// so the late-arrival detector is off (its window was recorded at every commit for nothing,
    /// 2026-11-27), and asking for it is refused.
    #[test]
    fn a_change_stream_has_no_late_arrival_detector() {
        assert!(!load(logical()).unwrap().late_arrivals.enabled);
        for late in [json!({"enabled": true}), json!({"windowRows": 500})] {
            let mut source = logical();
            source["lateArrivals"] = late;
            let message = load(source).unwrap_err().to_string();
            assert!(
                message.ends_with(
                    "poller.source.lateArrivals: a change stream is read in commit order, where no change can \
                     arrive late: leave lateArrivals out"
                ),
                "{message}"
            );
        }
        // Saying it is off is no error.
        let mut source = logical();
        source["lateArrivals"] = json!({"enabled": false});
        assert!(!load(source).unwrap().late_arrivals.enabled);
    }
}
