//! What to export, decided from the app settings alone (pure): Application Insights when its
//! connection string is set, OTLP over HTTP when the standard OpenTelemetry settings name an
//! endpoint, both when both are set, nothing otherwise or when `OTEL_SDK_DISABLED` is `true`.

use std::time::Duration;

/// The export interval when `OTEL_METRIC_EXPORT_INTERVAL` does not say (the specification's 60 s).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);

/// The settings that turn OTLP on: any of these endpoints.
const OTLP_ENDPOINTS: [&str; 3] =
    ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The Application Insights connection string (a secret: never logged).
    pub app_insights: Option<String>,
    /// OTLP over HTTP with protobuf; the exporter reads the endpoint and headers itself.
    pub otlp: bool,
    /// How often metrics are exported (and the status they come from sampled).
    pub interval: Duration,
    /// `service.name` when `OTEL_SERVICE_NAME` does not give it.
    pub service_name: String,
    /// What an operator should know about the settings (said once, as warnings).
    pub warnings: Vec<String>,
}

impl Plan {
    /// `None`: nothing to export, nothing is loaded.
    pub fn from_settings(get: impl Fn(&str) -> Option<String>) -> Option<Plan> {
        let set = |name: &str| get(name).map(|value| value.trim().to_string()).filter(|value| !value.is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|value| value.eq_ignore_ascii_case("true")) {
            return None;
        }
        let mut warnings = Vec::new();
        let app_insights = set("APPLICATIONINSIGHTS_CONNECTION_STRING");
        let mut otlp = OTLP_ENDPOINTS.iter().any(|name| set(name).is_some());
        if otlp {
            let protocol = set("OTEL_EXPORTER_OTLP_PROTOCOL").unwrap_or_else(|| "http/protobuf".to_string());
            if protocol != "http/protobuf" {
                warnings.push(format!(
                    "OTEL_EXPORTER_OTLP_PROTOCOL={protocol} is not supported: dbtrigger exports OTLP over http/protobuf only, so nothing is sent over OTLP"
                ));
                otlp = false;
            }
        }
        if app_insights.is_none() && !otlp {
            return if warnings.is_empty() {
                None
            } else {
                Some(Plan { app_insights, otlp, interval: DEFAULT_INTERVAL, service_name: String::new(), warnings })
            };
        }
        let interval = match set("OTEL_METRIC_EXPORT_INTERVAL") {
            None => DEFAULT_INTERVAL,
            Some(text) => match text.parse::<u64>() {
                Ok(milliseconds) if milliseconds > 0 => Duration::from_millis(milliseconds),
                _ => {
                    warnings.push(format!(
                        "OTEL_METRIC_EXPORT_INTERVAL={text} is not a number of milliseconds above 0: metrics are exported every {} s",
                        DEFAULT_INTERVAL.as_secs()
                    ));
                    DEFAULT_INTERVAL
                }
            },
        };
        let service_name = set("OTEL_SERVICE_NAME")
            .or_else(|| set("WEBSITE_SITE_NAME"))
            .or_else(|| set("DBTRIGGER_APP_NAME"))
            .unwrap_or_else(|| "dbtrigger".to_string());
        Some(Plan { app_insights, otlp, interval, service_name, warnings })
    }

    /// Whether anything is exported.
    pub fn exports(&self) -> bool {
        self.app_insights.is_some() || self.otlp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(settings: &[(&str, &str)]) -> Option<Plan> {
        Plan::from_settings(|name| settings.iter().find(|(key, _)| *key == name).map(|(_, value)| value.to_string()))
    }

    #[test]
    fn nothing_set_exports_nothing() {
        assert_eq!(plan(&[]), None);
        assert_eq!(plan(&[("OTEL_SERVICE_NAME", "x"), ("OTEL_METRIC_EXPORT_INTERVAL", "1000")]), None);
        assert_eq!(plan(&[("APPLICATIONINSIGHTS_CONNECTION_STRING", "  ")]), None);
    }

    #[test]
    fn sdk_disabled_wins_over_everything() {
        let settings = [
            ("OTEL_SDK_DISABLED", "TRUE"),
            ("APPLICATIONINSIGHTS_CONNECTION_STRING", "InstrumentationKey=k"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318"),
        ];
        assert_eq!(plan(&settings), None);
    }

    #[test]
    fn each_exporter_from_its_setting_and_both_together() {
        let ai = plan(&[("APPLICATIONINSIGHTS_CONNECTION_STRING", "InstrumentationKey=k")]).unwrap();
        assert_eq!((ai.app_insights.as_deref(), ai.otlp), (Some("InstrumentationKey=k"), false));
        let otlp = plan(&[("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://localhost:4318/v1/metrics")]).unwrap();
        assert_eq!((otlp.app_insights, otlp.otlp), (None, true));
        let both = plan(&[
            ("APPLICATIONINSIGHTS_CONNECTION_STRING", "InstrumentationKey=k"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_METRIC_EXPORT_INTERVAL", "5000"),
            ("OTEL_SERVICE_NAME", "orders-app"),
        ])
        .unwrap();
        assert!(both.app_insights.is_some() && both.otlp);
        assert_eq!(both.interval, Duration::from_secs(5));
        assert_eq!(both.service_name, "orders-app");
        assert!(both.warnings.is_empty());
    }

    #[test]
    fn an_unsupported_protocol_or_a_bad_interval_is_said() {
        let grpc =
            plan(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")])
                .unwrap();
        assert!(!grpc.exports());
        assert!(grpc.warnings[0].contains("http/protobuf only"), "{:?}", grpc.warnings);
        let bad =
            plan(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x"), ("OTEL_METRIC_EXPORT_INTERVAL", "soon")]).unwrap();
        assert_eq!(bad.interval, DEFAULT_INTERVAL);
        assert_eq!(bad.warnings.len(), 1);
    }
}
