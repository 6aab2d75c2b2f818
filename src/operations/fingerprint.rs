//! `fingerprint accept`: after an intended change of the source definition that keeps the rows'
//! order and meaning, records the configuration's fingerprint and keeps the checkpoint. A
//! checkpoint that does not fit the configured key (the key itself changed) cannot be kept: the
//! accept is refused, and the poller must be reset.
//!
//! The late-arrival detector's window is dropped (its findings kept): it counted the rows the old
//! definition selected, and a recount under the new one (a wider `where`, say) would call every
//! row that matches only now a late arrival. The next commit starts a new window; a row committed
//! late behind the checkpoint before then is not found (docs/late-arrivals.md).

use crate::domain::transitions::{self, Operator};
use crate::store::WriteCondition;

use super::{OperationError, Parts, Plan};

/// Reads the document and plans the accept.
pub async fn plan_accept(parts: Parts<'_>, operator: Operator<'_>) -> Result<Plan, OperationError> {
    let config = parts.config;
    let key = parts.key();
    let Some(current) = parts.store.read(&key).await? else {
        return Err(OperationError::NoDocument { poller: config.poller_name.clone() });
    };
    let position = current
        .document
        .position()
        .map_err(|error| OperationError::Invalid(format!("the stored checkpoint cannot be kept: {error}")))?;
    if let Some(position) = position
        && let Err(mismatch) = crate::source::fits_source_key(&config.source, &position)
    {
        return Err(OperationError::Invalid(format!(
            "refusing to keep the checkpoint: {mismatch}, with `--to-beginning`, `--to-end` or `--to-cursor`"
        )));
    }
    let mut after = transitions::accept_fingerprint(
        &current.document,
        &config.fingerprint,
        operator,
        parts.clock.now(),
        &config.lease,
    )?;
    if let Some(late) = after.late.as_mut() {
        late.window = None;
    }
    Ok(Plan { key, before: Some(current.document), after, condition: WriteCondition::Matches(current.etag) })
}
