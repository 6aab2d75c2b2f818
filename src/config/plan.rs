//! The hosting plan the app runs on, and the `functionTimeout` the host applies, read as the host
//! reads them (azure-functions-host, `Config/ScriptJobHostOptionsSetup.cs` `ConfigureFunctionTimeout`,
//! and `Environment/EnvironmentExtensions.cs` for the plan):
//!
//! - `functionTimeout` absent: 5 minutes on the Consumption plan (`WEBSITE_SKU=Dynamic` on Windows,
//!   a Linux Consumption container), 30 minutes everywhere else, Flex Consumption included (the
//!   host gives Flex the 30-minute default too; only an explicit `-1` is unbounded there);
//! - `-1`: unbounded, except on the Consumption plan, where the host refuses it (and any value over
//!   10 minutes) and does not start.
//!
//! Where the environment names no plan (a developer's shell: `dbtrigger check`, `package`, `tick`)
//! the strictest default, 5 minutes, is the one a tick budget is checked against.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use super::ConfigError;
use crate::settings::Settings;

/// The plans that differ in how long an invocation may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostingPlan {
    /// The (legacy) Consumption plan, Windows or Linux: 5 minutes by default, 10 at most.
    Consumption,
    /// Flex Consumption: 30 minutes by default, unbounded with `-1`.
    FlexConsumption,
    /// Premium, Dedicated (App Service), Container Apps, or a local Functions host: 30 minutes by
    /// default, unbounded with `-1`.
    Other,
    /// Nothing in the environment says.
    Unknown,
}

impl HostingPlan {
    /// The plan the host would see in this environment.
    pub fn detect(settings: &Settings) -> HostingPlan {
        let set = |name: &str| settings.get(name).is_some_and(|value| !value.is_empty());
        let sku = settings.get("WEBSITE_SKU").unwrap_or_default();
        let app_service = set("WEBSITE_INSTANCE_ID");
        let container = set("CONTAINER_NAME");
        let legion = set("LEGION_SERVICE_HOST");
        // `IsFlexConsumptionSku`: the SKU, or a Legion container (the SKU is not yet set there
        // while the instance is a placeholder).
        if sku.eq_ignore_ascii_case("FlexConsumption")
            || (!app_service && (container || set("WEBSITE_POD_NAME")) && legion)
        {
            return HostingPlan::FlexConsumption;
        }
        // `IsWindowsConsumption`, and `IsLinuxConsumptionOnAtlas` outside Container Apps.
        if sku.eq_ignore_ascii_case("Dynamic") || (!app_service && container && !legion && !set("MANAGED_ENVIRONMENT"))
        {
            return HostingPlan::Consumption;
        }
        // Any other sign of a host: an App Service plan, Container Apps, or a host that started
        // this process (a local `func start` applies the 30-minute default as well).
        if !sku.is_empty() || app_service || set("MANAGED_ENVIRONMENT") || set("FUNCTIONS_CUSTOMHANDLER_WORKER_ID") {
            return HostingPlan::Other;
        }
        HostingPlan::Unknown
    }

    pub fn describe(self) -> &'static str {
        match self {
            HostingPlan::Consumption => "the Consumption plan",
            HostingPlan::FlexConsumption => "the Flex Consumption plan",
            HostingPlan::Other => "a Premium, Dedicated or Container Apps plan",
            HostingPlan::Unknown => "an unknown plan",
        }
    }
}

/// How long the host lets one invocation run, and where that limit comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionTimeout {
    /// `None`: unbounded.
    pub limit: Option<Duration>,
    pub source: TimeoutSource,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutSource {
    /// host.json `functionTimeout`.
    HostJson,
    /// host.json sets none: the plan's default.
    PlanDefault(HostingPlan),
}

impl FunctionTimeout {
    /// The default the host applies when host.json sets no `functionTimeout`.
    pub fn plan_default(plan: HostingPlan) -> FunctionTimeout {
        let minutes = match plan {
            HostingPlan::Consumption | HostingPlan::Unknown => 5,
            HostingPlan::FlexConsumption | HostingPlan::Other => 30,
        };
        FunctionTimeout { limit: Some(Duration::from_secs(minutes * 60)), source: TimeoutSource::PlanDefault(plan) }
    }

    /// `functionTimeout (600 s, host.json)`, for logs and messages.
    pub fn describe(&self) -> String {
        let limit = match self.limit {
            Some(limit) => format!("{} s", limit.as_secs()),
            None => "unbounded".to_string(),
        };
        match self.source {
            TimeoutSource::HostJson => format!("functionTimeout ({limit}, host.json)"),
            TimeoutSource::PlanDefault(HostingPlan::Unknown) => format!(
                "functionTimeout ({limit}: host.json sets none and the environment names no plan, so the strictest default, the Consumption plan's)"
            ),
            TimeoutSource::PlanDefault(plan) => {
                format!("functionTimeout ({limit}: host.json sets none, the default of {})", plan.describe())
            }
        }
    }
}

/// host.json's `functionTimeout`, or the default of the plan `settings` describe.
pub(super) fn read_function_timeout(app_root: &Path, settings: &Settings) -> Result<FunctionTimeout, ConfigError> {
    let plan = HostingPlan::detect(settings);
    let path = app_root.join("host.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(FunctionTimeout::plan_default(plan));
    };
    function_timeout_of(&path, &text, plan)
}

/// host.json's `functionTimeout` from the file's text (`path` names it in errors), on `plan`: no I/O.
pub(super) fn function_timeout_of(path: &Path, text: &str, plan: HostingPlan) -> Result<FunctionTimeout, ConfigError> {
    let path = path.to_path_buf();
    let error = |reason: String| ConfigError { file: path.clone(), field: "functionTimeout".to_string(), reason };
    let value: Value = serde_json::from_str(text).map_err(|parse_error| ConfigError {
        file: path.clone(),
        field: "(document)".to_string(),
        reason: format!("invalid JSON: {parse_error}"),
    })?;
    let Some(timeout) = value.get("functionTimeout").filter(|timeout| !timeout.is_null()) else {
        return Ok(FunctionTimeout::plan_default(plan));
    };
    let text = timeout.as_str().ok_or_else(|| error("expected a string like \"00:10:00\"".to_string()))?;
    let consumption_refuses = |what: &str| {
        error(format!(
            "{what}: on the Consumption plan the host refuses a functionTimeout that is unbounded or over 10 minutes, and does not start"
        ))
    };
    if text.trim() == "-1" {
        if plan == HostingPlan::Consumption {
            return Err(consumption_refuses("\"-1\" (unbounded)"));
        }
        return Ok(FunctionTimeout { limit: None, source: TimeoutSource::HostJson });
    }
    let limit = super::parse_timespan(text).map_err(error)?;
    if plan == HostingPlan::Consumption && limit > Duration::from_secs(600) {
        return Err(consumption_refuses(&format!("{text:?}")));
    }
    Ok(FunctionTimeout { limit: Some(limit), source: TimeoutSource::HostJson })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(pairs: &[(&str, &str)]) -> HostingPlan {
        HostingPlan::detect(&Settings::from_pairs(pairs.iter().copied()))
    }

    #[test]
    fn the_plan_is_read_from_the_variables_the_host_reads() {
        assert_eq!(plan(&[("WEBSITE_SKU", "Dynamic"), ("WEBSITE_INSTANCE_ID", "abc")]), HostingPlan::Consumption);
        assert_eq!(plan(&[("CONTAINER_NAME", "app_1234")]), HostingPlan::Consumption);
        assert_eq!(plan(&[("WEBSITE_SKU", "FlexConsumption")]), HostingPlan::FlexConsumption);
        assert_eq!(plan(&[("CONTAINER_NAME", "c"), ("LEGION_SERVICE_HOST", "l")]), HostingPlan::FlexConsumption);
        assert_eq!(plan(&[("WEBSITE_SKU", "ElasticPremium"), ("WEBSITE_INSTANCE_ID", "abc")]), HostingPlan::Other);
        assert_eq!(plan(&[("CONTAINER_NAME", "c"), ("MANAGED_ENVIRONMENT", "true")]), HostingPlan::Other);
        assert_eq!(plan(&[("FUNCTIONS_CUSTOMHANDLER_WORKER_ID", "w")]), HostingPlan::Other);
        assert_eq!(plan(&[]), HostingPlan::Unknown);
    }

    /// Regression (issue 25, item 5): with no `functionTimeout` the budget check was skipped,
    /// while the host applies its plan's default.
    #[test]
    fn an_absent_function_timeout_is_the_plans_default_or_the_strictest() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("host.json"), br#"{"version": "2.0"}"#).unwrap();
        let read = |pairs: &[(&str, &str)]| {
            read_function_timeout(root.path(), &Settings::from_pairs(pairs.iter().copied())).unwrap().limit
        };
        assert_eq!(read(&[("WEBSITE_SKU", "Dynamic")]), Some(Duration::from_secs(300)));
        assert_eq!(read(&[("WEBSITE_SKU", "FlexConsumption")]), Some(Duration::from_secs(1800)));
        assert_eq!(read(&[("WEBSITE_SKU", "ElasticPremium")]), Some(Duration::from_secs(1800)));
        assert_eq!(read(&[]), Some(Duration::from_secs(300)), "unknown plan: the strictest default");
    }

    #[test]
    fn the_consumption_plan_refuses_what_the_host_refuses() {
        let root = tempfile::tempdir().unwrap();
        let consumption = Settings::from_pairs([("WEBSITE_SKU", "Dynamic")]);
        let premium = Settings::from_pairs([("WEBSITE_SKU", "ElasticPremium")]);
        for text in ["-1", "00:15:00"] {
            std::fs::write(root.path().join("host.json"), format!(r#"{{"functionTimeout": "{text}"}}"#)).unwrap();
            let error = read_function_timeout(root.path(), &consumption).unwrap_err();
            assert!(error.reason.contains("Consumption plan"), "{text}: {}", error.reason);
            assert!(read_function_timeout(root.path(), &premium).is_ok());
        }
        std::fs::write(root.path().join("host.json"), br#"{"functionTimeout": "-1"}"#).unwrap();
        assert_eq!(read_function_timeout(root.path(), &premium).unwrap().limit, None);
    }
}
