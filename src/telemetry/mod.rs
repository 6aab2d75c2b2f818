//! Metrics and traces, for Azure Monitor and any OpenTelemetry backend.
//!
//! When `APPLICATIONINSIGHTS_CONNECTION_STRING` is set, the handler sends its metrics and a span
//! per tick to that Application Insights resource (the maintained exporter,
//! `opentelemetry-application-insights`); when the standard `OTEL_EXPORTER_OTLP_*` settings name an
//! endpoint, it exports over OTLP (http/protobuf, `opentelemetry-otlp`) as well. Neither set, or
//! `OTEL_SDK_DISABLED=true`: nothing is built, and every hook below returns at once
//! ([`plan::Plan::from_settings`] decides).
//!
//! | file         | what it holds                                                              |
//! |--------------|----------------------------------------------------------------------------|
//! | [`names`]    | the metric table (names, units, sources) and the attributes                |
//! | [`plan`]     | what to export, from the settings (pure)                                   |
//! | [`record`]   | the instruments: a tick's numbers, the gauges of the last status           |
//! | [`traced`]   | the span per invocation and the child span per batch delivery              |
//! | `watched`    | the exporters' results looked at: a dead endpoint is one warning           |
//!
//! Exporting never blocks a tick: recording is an in-memory update; metrics leave from a periodic
//! reader and spans from a batch processor with a bounded queue (2,048 spans, then dropped), both
//! tasks of their own (tests/it/telemetry.rs `an_unreachable_endpoint_fails_no_tick`).
//!
//! The gauges (lag, attempts, quarantine, horizon, slot) are the [`PollerHealth`] values
//! `status` shows, sampled by the handler at each export interval through `App::status`, the
//! function `dbtrigger status` and the status function call: one source of truth.

pub mod names;
pub mod plan;
pub mod record;
pub mod traced;
mod watched;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::{info, warn};

use crate::domain::health::PollerHealth;
use crate::tick::{Poller, TickError, TickOutcome, TickReport};
use plan::Plan;
use record::{Instruments, Observed, Snapshot, TickFacts};
use watched::{Watch, WatchedMetrics, WatchedSpans};

/// The exporters and instruments of this process, once installed.
pub struct Telemetry {
    meters: SdkMeterProvider,
    tracers: SdkTracerProvider,
    tracer: opentelemetry_sdk::trace::SdkTracer,
    instruments: Instruments,
    snapshot: Snapshot,
    /// How often metrics leave, and how often the status they show is sampled.
    pub interval: Duration,
}

static INSTALLED: OnceLock<Telemetry> = OnceLock::new();

/// The installed telemetry, `None` when nothing is exported.
pub fn installed() -> Option<&'static Telemetry> {
    INSTALLED.get()
}

/// Builds the exporters the settings ask for (`get` reads a setting) and installs them for this
/// process; `None` (nothing built) when none is asked for. Needs a Tokio runtime: the exports run
/// as its tasks.
pub fn install(get: impl Fn(&str) -> Option<String>) -> Option<&'static Telemetry> {
    let plan = Plan::from_settings(get)?;
    for warning in &plan.warnings {
        warn!("{warning}");
    }
    if !plan.exports() {
        return None;
    }
    if let Some(installed) = installed() {
        return Some(installed);
    }
    let telemetry = build(&plan)?;
    let telemetry = INSTALLED.get_or_init(|| telemetry);
    info!(
        application_insights = plan.app_insights.is_some(),
        otlp = plan.otlp,
        interval_ms = plan.interval.as_millis() as u64,
        "telemetry export on"
    );
    Some(telemetry)
}

fn build(plan: &Plan) -> Option<Telemetry> {
    let mut resource = Resource::builder();
    // OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES) are read by the builder itself.
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(plan.service_name.clone());
    }
    let resource = resource.build();
    let mut meters = SdkMeterProvider::builder().with_resource(resource.clone());
    let mut tracers = SdkTracerProvider::builder().with_resource(resource);
    use opentelemetry_sdk::metrics::periodic_reader_with_async_runtime::PeriodicReader;
    use opentelemetry_sdk::runtime::Tokio;
    use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
    let mut any = false;
    if let Some(connection_string) = &plan.app_insights {
        let client = http_client();
        match opentelemetry_application_insights::Exporter::new_from_connection_string(connection_string, client) {
            Ok(exporter) => {
                // The exporter retries a failed upload for up to 35 s before it gives up (and the
                // watch says so): each retry is a debug line.
                let exporter = exporter.with_retry_notify(|error, delay| {
                    tracing::debug!(%error, retry_in_ms = delay.as_millis() as u64, "telemetry upload to Application Insights failed, retrying");
                });
                let metrics =
                    WatchedMetrics { inner: exporter.clone(), watch: Watch::new("Application Insights (metrics)") };
                let spans = WatchedSpans { inner: exporter, watch: Watch::new("Application Insights (traces)") };
                meters =
                    meters.with_reader(PeriodicReader::builder(metrics, Tokio).with_interval(plan.interval).build());
                tracers = tracers.with_span_processor(BatchSpanProcessor::builder(spans, Tokio).build());
                any = true;
            }
            // The parser's message names the part that is wrong, never the key.
            Err(error) => {
                warn!(%error, "APPLICATIONINSIGHTS_CONNECTION_STRING is not usable: nothing is sent to Application Insights")
            }
        }
    }
    if plan.otlp {
        use opentelemetry_otlp::{Protocol, WithExportConfig as _};
        let metric_exporter =
            opentelemetry_otlp::MetricExporter::builder().with_http().with_protocol(Protocol::HttpBinary).build();
        let span_exporter =
            opentelemetry_otlp::SpanExporter::builder().with_http().with_protocol(Protocol::HttpBinary).build();
        match (metric_exporter, span_exporter) {
            (Ok(metric_exporter), Ok(span_exporter)) => {
                let metrics = WatchedMetrics { inner: metric_exporter, watch: Watch::new("OTLP (metrics)") };
                let spans = WatchedSpans { inner: span_exporter, watch: Watch::new("OTLP (traces)") };
                meters =
                    meters.with_reader(PeriodicReader::builder(metrics, Tokio).with_interval(plan.interval).build());
                tracers = tracers.with_span_processor(BatchSpanProcessor::builder(spans, Tokio).build());
                any = true;
            }
            // The error may quote the endpoint, whose query or user part can hold a token.
            (Err(_), _) | (_, Err(_)) => warn!(
                "the OTLP exporter could not be built from OTEL_EXPORTER_OTLP_* (is the endpoint a URL?): nothing is \
                 sent over OTLP"
            ),
        }
    }
    if !any {
        return None;
    }
    let meters = meters.build();
    let tracers = tracers.build();
    let meter = meters.meter("dbtrigger");
    let snapshot: Snapshot = Arc::new(Mutex::new(Vec::new()));
    let instruments = Instruments::register(&meter, &snapshot);
    let tracer = tracers.tracer("dbtrigger");
    Some(Telemetry { meters, tracers, tracer, instruments, snapshot, interval: plan.interval })
}

/// The HTTP client of the Application Insights exporter: the reqwest already in the tree, with a
/// timeout so that a silent endpoint costs an export, not a stuck task.
fn http_client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap_or_default()
}

/// Records one tick of `poller`, and puts its facts on the invocation's span when there is one
/// (the current context's). Nothing when no telemetry is installed.
pub fn record_tick(poller: &Poller, result: Result<&TickOutcome, &TickError>, report: &TickReport) {
    let Some(telemetry) = installed() else {
        return;
    };
    let attributes = record::poller_attributes(&poller.config);
    let facts = TickFacts::of(result, report);
    telemetry.instruments.tick(&attributes, &facts);
    traced::describe_tick(&attributes, &facts);
}

/// Replaces the gauges' values with `healths` (each with its poller, when it has one): what
/// `status` showed at this sample.
pub fn observe_status(healths: &[(PollerHealth, Option<&Poller>)]) {
    let Some(telemetry) = installed() else {
        return;
    };
    let observed: Vec<Observed> = healths
        .iter()
        .filter_map(|(health, poller)| {
            poller.map(|poller| Observed {
                attributes: record::poller_attributes(&poller.config),
                health: health.clone(),
            })
        })
        .collect();
    *telemetry.snapshot.lock().unwrap_or_else(|poison| poison.into_inner()) = observed;
}

/// Sends what is buffered and stops the exporters (at the end of `serve`); bounded by the SDK's
/// own timeouts.
pub async fn shutdown() {
    let Some(telemetry) = installed() else {
        return;
    };
    let meters = telemetry.meters.clone();
    let tracers = telemetry.tracers.clone();
    // The SDK's shutdown waits for its tasks: off the runtime's workers.
    let _ = tokio::task::spawn_blocking(move || {
        let _ = tracers.shutdown_with_timeout(Duration::from_secs(3));
        let _ = meters.shutdown_with_timeout(Duration::from_secs(3));
    })
    .await;
}
