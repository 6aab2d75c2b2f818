//! Functions the host does not run, though their folders are there: the handler sees every
//! folder, so it must honour the host's two switches itself.
//!
//! - The app setting `AzureWebJobs.<function>.Disabled` (or `AzureWebJobs_<function>_Disabled`,
//!   the form Linux environment variables allow), `true` or `1` in any case: what the portal's
//!   Disable button sets. The host starts no listener for the function, so its timer never fires
//!   (azure-webjobs-sdk `Listeners/HostListenerFactory.cs` `IsDisabled`, and
//!   `Extensions/IConfigurationExtensions.cs` `IsSettingEnabled`). A run through the admin API
//!   (the portal's Test/Run, with the master key) still reaches the handler.
//! - host.json `functions`: a list of the function names to load, matched without regard to case;
//!   the others are not loaded at all (azure-functions-host `Host/FunctionMetadataManager.cs`
//!   `ApplyAllowList`).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::ConfigError;
use crate::settings::Settings;

/// Each disabled function of `function_names`, with why, in words.
pub(super) fn disabled_functions(
    app_root: &Path,
    settings: &Settings,
    function_names: &[String],
) -> Result<BTreeMap<String, String>, ConfigError> {
    let allowed = allow_list(app_root)?;
    let mut disabled = BTreeMap::new();
    for name in function_names {
        for setting in [format!("AzureWebJobs.{name}.Disabled"), format!("AzureWebJobs_{name}_Disabled")] {
            let value = settings.get_ignoring_case(&setting).unwrap_or_default().trim();
            if value == "1" || value.eq_ignore_ascii_case("true") {
                disabled
                    .insert(name.clone(), format!("app setting {setting} is {value}: the host starts no timer for it"));
                break;
            }
        }
        if let Some(allowed) = &allowed
            && !disabled.contains_key(name)
            && !allowed.iter().any(|listed| listed.eq_ignore_ascii_case(name))
        {
            disabled.insert(name.clone(), "not in host.json `functions`: the host does not load it".to_string());
        }
    }
    Ok(disabled)
}

/// host.json `functions`, when it is there.
fn allow_list(app_root: &Path) -> Result<Option<Vec<String>>, ConfigError> {
    let path = app_root.join("host.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let error = |field: &str, reason: String| ConfigError { file: path.clone(), field: field.to_string(), reason };
    let document: Value = serde_json::from_str(&text)
        .map_err(|parse_error| error("(document)", format!("invalid JSON: {parse_error}")))?;
    let listed = match document.get("functions") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(listed)) => listed,
        Some(_) => return Err(error("functions", "expected an array of function names".to_string())),
    };
    let mut names = Vec::new();
    for (index, item) in listed.iter().enumerate() {
        let Some(name) = item.as_str() else {
            return Err(error(&format!("functions[{index}]"), "expected a function name".to_string()));
        };
        names.push(name.to_string());
    }
    Ok(Some(names))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_portal_setting_and_the_host_json_list_both_disable() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(
            root.path().join("host.json"),
            br#"{"version": "2.0", "functions": ["Orders", "invoices", "audit"]}"#,
        )
        .unwrap();
        let names: Vec<String> =
            ["orders", "invoices", "audit", "legacy"].iter().map(|name| name.to_string()).collect();
        let settings = Settings::from_pairs([
            ("AzureWebJobs.orders.Disabled", "True"),
            ("azurewebjobs_invoices_disabled", "1"),
            ("AzureWebJobs.audit.Disabled", "false"),
        ]);
        let disabled = disabled_functions(root.path(), &settings, &names).unwrap();
        assert!(disabled["orders"].contains("AzureWebJobs.orders.Disabled"), "{disabled:?}");
        assert!(disabled["invoices"].contains("AzureWebJobs_invoices_Disabled"), "{disabled:?}");
        assert!(!disabled.contains_key("audit"), "false leaves it enabled");
        assert!(disabled["legacy"].contains("host.json `functions`"), "{disabled:?}");
        std::fs::write(root.path().join("host.json"), br#"{"functions": "orders"}"#).unwrap();
        assert_eq!(disabled_functions(root.path(), &settings, &names).unwrap_err().field, "functions");
    }
}
