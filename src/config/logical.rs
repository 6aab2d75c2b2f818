//! `source.kind: "logical"`: PostgreSQL logical decoding through a replication slot and a
//! publication. What a polling source reads by (table, cursor, key, filters, settle) means
//! nothing here and is refused by name, rather than ignored.

use super::function_json::RawSource;
use super::source::{Engine, validate_identifier};
use super::{ConfigError, Located};

/// Checks a logical source's fields; its slot and publication.
pub(super) fn check(raw: &RawSource, engine: Engine, at: &Located<'_>) -> Result<(String, String), ConfigError> {
    if engine != Engine::Postgres {
        return Err(at.error(
            "poller.source.kind",
            format!("\"logical\" reads PostgreSQL's logical decoding; this source is {}", engine.name()),
        ));
    }
    let polling_only = [
        ("table", raw.table.is_some()),
        ("query", raw.query.is_some()),
        ("cursor", raw.cursor.is_some()),
        ("pk", raw.pk.is_some()),
        ("columns", raw.columns.is_some()),
        ("where", raw.where_clause.is_some()),
        ("settleSeconds", raw.settle_seconds.is_some()),
        ("settle", raw.settle.is_some()),
        ("cursorKind", raw.cursor_kind.is_some()),
        ("cursorTimeZone", raw.cursor_time_zone.is_some()),
        ("softDelete", raw.soft_delete.is_some()),
        ("opColumn", raw.op_column.is_some()),
        ("generation", raw.generation.is_some()),
    ];
    if let Some((name, _)) = polling_only.iter().find(|(_, given)| *given) {
        return Err(at.error(
            &format!("poller.source.{name}"),
            "belongs to a polling source: a logical source delivers every change of its publication's tables, \
             in commit order (leave it out)",
        ));
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
    Ok((slot, publication))
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
