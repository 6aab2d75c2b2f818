//! The exporters, watched: each export's result is looked at, so that a dead endpoint is said once
//! (a warning) and its recovery once (info), instead of never (the SDK's own logs are not built
//! in) or at every interval. The exporting is the exporter crate's; this only delegates.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::Temporality;
use opentelemetry_sdk::metrics::data::ResourceMetrics;
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};

/// Whether the last export to one destination failed.
#[derive(Debug, Clone)]
pub struct Watch {
    /// `Application Insights` or `OTLP`, and the signal.
    what: &'static str,
    failing: Arc<AtomicBool>,
}

impl Watch {
    pub fn new(what: &'static str) -> Watch {
        Watch { what, failing: Arc::new(AtomicBool::new(false)) }
    }

    fn saw(&self, result: &OTelSdkResult) {
        match result {
            Ok(()) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("telemetry export to {} works again", self.what);
                }
            }
            Err(error) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    // The error names the endpoint's host at most, never a header or a key.
                    tracing::warn!(
                        %error,
                        "telemetry export to {} failed: ticks go on, what could not be sent is dropped (bounded queue); said again once it works",
                        self.what
                    );
                }
            }
        }
    }
}

#[derive(Debug)]
pub struct WatchedMetrics<E> {
    pub inner: E,
    pub watch: Watch,
}

impl<E: PushMetricExporter> PushMetricExporter for WatchedMetrics<E> {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let result = self.inner.export(metrics).await;
        self.watch.saw(&result);
        result
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> Temporality {
        self.inner.temporality()
    }
}

#[derive(Debug)]
pub struct WatchedSpans<E> {
    pub inner: E,
    pub watch: Watch,
}

impl<E: SpanExporter> SpanExporter for WatchedSpans<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let result = self.inner.export(batch).await;
        self.watch.saw(&result);
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}
