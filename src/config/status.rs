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
                check_auth_level(binding.get("authLevel"))
                    .map_err(|reason| at.error(&format!("bindings[{index}].authLevel"), reason))?;
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

/// A status function's `authLevel`, by an allow-list: left out (the host's default, `function`),
/// `"function"` or `"admin"`, in any case. Anything else is refused, not only `"anonymous"`: the
/// host may read a number (`0`) or a text it does not know (`"0"`) as anonymous, and status shows
/// checkpoints, lease owners and errors to whoever may call it.
pub(super) fn check_auth_level(level: Option<&Value>) -> Result<(), String> {
    const REASON: &str = "status shows checkpoints, lease owners and errors: use \"function\" (a function key) or \"admin\" (the master key), or leave it out (function)";
    match level {
        None => Ok(()),
        Some(Value::String(text)) if text.eq_ignore_ascii_case("function") || text.eq_ignore_ascii_case("admin") => {
            Ok(())
        }
        Some(Value::String(text)) if text.eq_ignore_ascii_case("anonymous") => {
            Err(format!("must not be anonymous: {REASON}"))
        }
        Some(Value::String(text)) => {
            let shown: String = text.chars().take(40).collect();
            Err(format!("{shown:?} is not an auth level dbtrigger accepts: {REASON}"))
        }
        Some(other) => Err(format!("must be a text, not {}: {REASON}", json_kind(other))),
    }
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a text",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::check_auth_level;
    use serde_json::json;

    /// Regression (issue 36, section 3): `authLevel` is an allow-list. A number or a text the
    /// host may take as anonymous (`0`, `"0"`, `"Anonymous"`) is refused, as is `null`.
    #[test]
    fn auth_level_is_an_allow_list() {
        for accepted in
            [None, Some(json!("function")), Some(json!("Function")), Some(json!("admin")), Some(json!("ADMIN"))]
        {
            assert_eq!(check_auth_level(accepted.as_ref()), Ok(()), "{accepted:?}");
        }
        for refused in [
            json!(0),
            json!(1),
            json!("0"),
            json!("anonymous"),
            json!("Anonymous"),
            json!(""),
            json!(null),
            json!(true),
            json!("system"),
        ] {
            let reason = check_auth_level(Some(&refused)).expect_err(&refused.to_string());
            assert!(reason.contains("function") && reason.contains("admin"), "{refused}: {reason}");
        }
    }
}
