//! `clone`: a new poller name's state document starting at this poller's checkpoint (with the
//! source generation it belongs to) or at the beginning: a backfill or a migration on a separate
//! name. Written only where there is no document yet.

use crate::domain::transitions::{self, Operator};
use crate::store::{StateKey, WriteCondition};

use super::{OperationError, Parts, Plan};

/// Reads this poller's document and plans its copy under `new_name`.
pub async fn plan(
    parts: Parts<'_>,
    new_name: &str,
    from_beginning: bool,
    operator: Operator<'_>,
) -> Result<Plan, OperationError> {
    let config = parts.config;
    if crate::config::validate_identifier(&new_name.replace('-', "_")).is_err() {
        return Err(OperationError::Invalid(format!("{new_name:?} is not a valid poller name")));
    }
    let Some(source) = parts.store.read(&parts.key()).await? else {
        return Err(OperationError::Invalid(format!("poller {} has no state document to clone", config.poller_name)));
    };
    let key = StateKey::new(&config.app_name, new_name);
    if parts.store.read(&key).await?.is_some() {
        return Err(OperationError::AlreadyExists { poller: new_name.to_string() });
    }
    let after = transitions::clone_to(&source.document, new_name, from_beginning, operator, parts.clock.now());
    Ok(Plan { key, before: None, after, condition: WriteCondition::Absent })
}
