//! A `status` function: an HTTP trigger whose invocation the handler answers with the `status`
//! report of every poller of the app (what `dbtrigger status --json` prints). Its function.json has
//! an `httpTrigger` binding, an `http` output binding, and a top-level `"status": {}` section.

use serde::Deserialize;
use serde_json::Value;

use super::function_json::binding_is;
use super::{ConfigError, Located};

/// A validated status function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusConfig {
    pub function_name: String,
    pub file: std::path::PathBuf,
    /// The httpTrigger binding's name: the request is `Data.<this>`.
    pub request_binding: String,
    /// The http output binding's name: the answer goes in `Outputs.<this>`.
    pub response_binding: String,
}

/// The `status` section: nothing to set yet, and a typo is refused rather than ignored.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStatus {}

pub(super) fn build_status(
    document: &Value,
    function_name: &str,
    at: &Located<'_>,
) -> Result<StatusConfig, ConfigError> {
    let section = document.get("status").cloned().unwrap_or(Value::Null);
    if !section.is_object() {
        return Err(at.error("status", "expected an object (`\"status\": {}`)"));
    }
    let _: RawStatus = serde_json::from_value(section).map_err(|error| at.error("status", error.to_string()))?;
    let bindings = document.get("bindings").and_then(Value::as_array).ok_or_else(|| {
        at.error("bindings", "missing: a status function needs an httpTrigger and an http output binding")
    })?;
    let mut request = None;
    let mut response = None;
    for (index, binding) in bindings.iter().enumerate() {
        let name = binding.get("name").and_then(Value::as_str).map(str::to_string);
        // Types and directions without regard to case, as the host matches them.
        match (binding_is(binding, "httpTrigger", "in"), binding_is(binding, "http", "out")) {
            (true, _) => {
                let level = binding.get("authLevel").and_then(Value::as_str).unwrap_or("function");
                if level.eq_ignore_ascii_case("anonymous") {
                    return Err(at.error(
                        &format!("bindings[{index}].authLevel"),
                        "must not be anonymous: status shows checkpoints, lease owners and errors; use function (a function key) or admin",
                    ));
                }
                request = Some(name.ok_or_else(|| at.error(&format!("bindings[{index}].name"), "missing"))?);
            }
            (false, true) => {
                response = Some(name.ok_or_else(|| at.error(&format!("bindings[{index}].name"), "missing"))?);
            }
            _ => {}
        }
    }
    let request_binding = request
        .ok_or_else(|| at.error("bindings", "no httpTrigger binding: a status function answers HTTP requests"))?;
    let response_binding = response.ok_or_else(|| {
        at.error(
            "bindings",
            "no http output binding (`{\"type\": \"http\", \"direction\": \"out\", \"name\": \"res\"}`)",
        )
    })?;
    if response_binding == "$return" {
        return Err(at.error("bindings", "name the http output binding (e.g. \"res\"), not $return"));
    }
    Ok(StatusConfig {
        function_name: function_name.to_string(),
        file: at.file.to_path_buf(),
        request_binding,
        response_binding,
    })
}
