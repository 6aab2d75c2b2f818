//! `reset`: moves a poller's checkpoint where an operator says (the beginning, the source's end, a
//! cursor and key, or a checkpoint from a file), through a live lease only when forced. A poller
//! that has never ticked gets its first document this way (written only if there still is none).

use crate::domain::StateDocument;
use crate::domain::cursor::{CursorJson, Position};
use crate::domain::transitions::{self, Operator, ResetTarget};
use crate::store::WriteCondition;

use super::{OperationError, Parts, Plan};

/// Where a reset puts the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum ResetTo {
    Beginning,
    /// After the source's last settled row (the beginning when it has none).
    End,
    /// After this cursor value and key, as an operator writes them: `keys` are (column, value)
    /// pairs, every key column once, in any order.
    Cursor {
        value: String,
        keys: Vec<(String, String)>,
    },
    /// After a checkpoint cursor as a state document holds it (`inspect`'s output).
    Checkpoint(CursorJson),
}

/// Reads the document and plans the reset (a new document when the poller has none yet).
pub async fn plan(parts: Parts<'_>, to: &ResetTo, operator: Operator<'_>) -> Result<Plan, OperationError> {
    let config = parts.config;
    let key = parts.key();
    let current = parts.store.read(&key).await?;
    let target = target(parts, to).await?;
    let (before, condition) = match current {
        Some(versioned) => (Some(versioned.document), WriteCondition::Matches(versioned.etag)),
        None => (None, WriteCondition::Absent),
    };
    let base = match &before {
        Some(document) => document.clone(),
        None => StateDocument::new(&config.poller_name, &config.fingerprint),
    };
    let after = transitions::reset(&base, &target, operator, parts.clock.now(), &config.lease)?;
    Ok(Plan { key, before, after, condition })
}

async fn target(parts: Parts<'_>, to: &ResetTo) -> Result<ResetTarget, OperationError> {
    let source_config = &parts.config.source;
    match to {
        ResetTo::Beginning => Ok(ResetTarget::Beginning),
        ResetTo::End => match crate::source::last_position(parts.source).await? {
            Some(last) => Ok(ResetTarget::After(last)),
            None => Ok(ResetTarget::Beginning),
        },
        ResetTo::Cursor { value, keys } => {
            let ordered = key_values(&source_config.pk, keys)?;
            let position =
                crate::source::position::operator_position(parts.source, source_config, value, &ordered).await?;
            Ok(ResetTarget::After(position))
        }
        ResetTo::Checkpoint(json) => {
            let position = Position::try_from(json)
                .map_err(|reason| OperationError::Invalid(format!("not a checkpoint position: {reason}")))?;
            if let Err(mismatch) = position.fits_key(&source_config.pk) {
                return Err(OperationError::Invalid(format!(
                    "the checkpoint's key columns ({}) are not this poller's ({})",
                    mismatch.stored.join(", "),
                    mismatch.configured.join(", ")
                )));
            }
            Ok(ResetTarget::After(position))
        }
    }
}

/// The operator's key values in the configured key order: every key column exactly once.
fn key_values(columns: &[String], given: &[(String, String)]) -> Result<Vec<String>, OperationError> {
    let mut ordered = Vec::with_capacity(columns.len());
    for column in columns {
        let mut values = given.iter().filter(|(name, _)| name == column);
        let Some((_, value)) = values.next() else {
            return Err(OperationError::Invalid(format!(
                "give --pk {column}=VALUE: the position needs every key column ({})",
                columns.join(", ")
            )));
        };
        if values.next().is_some() {
            return Err(OperationError::Invalid(format!("--pk {column}=… is given twice")));
        }
        ordered.push(value.clone());
    }
    for (column, _) in given {
        if !columns.contains(column) {
            return Err(OperationError::Invalid(format!(
                "--pk {column}=…: {column:?} is not a key column of this poller ({})",
                columns.join(", ")
            )));
        }
    }
    Ok(ordered)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_values_come_in_the_configured_order_each_once() {
        let columns = vec!["tenant".to_string(), "id".to_string()];
        let pair = |column: &str, value: &str| (column.to_string(), value.to_string());
        assert_eq!(key_values(&columns, &[pair("id", "5"), pair("tenant", "1")]).unwrap(), vec!["1", "5"]);
        assert!(key_values(&columns, &[pair("id", "5")]).unwrap_err().to_string().contains("tenant=VALUE"));
        assert!(key_values(&columns, &[pair("id", "5"), pair("tenant", "1"), pair("id", "6")]).is_err());
        assert!(
            key_values(&columns, &[pair("tenant", "1"), pair("id", "5"), pair("code", "5")])
                .unwrap_err()
                .to_string()
                .contains("not a key column")
        );
    }
}
