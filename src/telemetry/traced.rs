//! Spans: one per invocation the host sends (a tick's carries the poller, the outcome and the
//! counts), with the host's invocation id; one per batch delivery as its child, with the
//! receiver's answer. Nothing at all when no telemetry is installed.

use std::sync::Arc;

use async_trait::async_trait;
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue};

use super::installed;
use super::names::attribute;
use super::record::TickFacts;
use crate::domain::event::Batch;
use crate::sink::{Sink, SinkError};

/// The context of an invocation's span (`None`: no telemetry): run the invocation within it
/// (`opentelemetry::context::FutureExt::with_context`), then [`finish`] it.
pub fn invocation_context(function: &str, invocation_id: &str) -> Option<Context> {
    let telemetry = installed()?;
    let span = telemetry
        .tracer
        .span_builder(format!("invoke {function}"))
        .with_kind(SpanKind::Server)
        .with_attributes([
            KeyValue::new(attribute::FUNCTION, function.to_string()),
            KeyValue::new(attribute::INVOCATION_ID, invocation_id.to_string()),
        ])
        .start(&telemetry.tracer);
    Some(Context::current_with_span(span))
}

/// A child of the current span named `name` (`None`: no telemetry): a watchdog's kick runs within
/// one, so that the kicked tick's facts go on it rather than on the watchdog's span.
pub fn child_context(name: &str) -> Option<Context> {
    let telemetry = installed()?;
    let span =
        telemetry.tracer.span_builder(name.to_string()).start_with_context(&telemetry.tracer, &Context::current());
    Some(Context::current_with_span(span))
}

/// Puts a tick's facts on the current span (the invocation's), and names it after the poller.
pub(super) fn describe_tick(attributes: &[KeyValue], facts: &TickFacts) {
    let context = Context::current();
    let span = context.span();
    if !span.span_context().is_valid() {
        return;
    }
    if let Some(poller) = attributes.iter().find(|pair| pair.key.as_str() == attribute::POLLER) {
        span.update_name(format!("tick {}", poller.value));
    }
    span.set_attributes(attributes.iter().cloned());
    span.set_attributes([
        KeyValue::new(attribute::OUTCOME, facts.outcome),
        KeyValue::new(attribute::ROWS, facts.rows as i64),
        KeyValue::new(attribute::BATCHES, facts.batches as i64),
        KeyValue::new(attribute::QUARANTINED, facts.quarantined as i64),
        KeyValue::new(attribute::LATE_ARRIVALS, facts.report.late_arrivals as i64),
        KeyValue::new(attribute::BLOB_READS, facts.report.blob_reads as i64),
        KeyValue::new(attribute::BLOB_WRITES, facts.report.blob_writes as i64),
    ]);
    if let Some(lag) = facts.report.lag_after {
        span.set_attribute(KeyValue::new(attribute::LAG_ROWS_AFTER, lag.rows as i64));
    }
    if let Some(error) = &facts.error {
        span.set_status(Status::error(error.clone()));
    }
}

/// Ends an invocation's span: `succeeded` as the host sees it, `line` the invocation's line.
pub fn finish(context: Context, succeeded: bool, line: &str) {
    let span = context.span();
    if succeeded {
        span.set_status(Status::Ok);
    } else {
        span.set_status(Status::error(line.to_string()));
    }
    span.end();
}

/// `sink`, with a span around each delivery when telemetry is installed; `sink` itself otherwise.
pub fn sink(sink: Arc<dyn Sink>) -> Arc<dyn Sink> {
    if installed().is_none() {
        return sink;
    }
    Arc::new(TracedSink { inner: sink })
}

/// A sink whose deliveries are spans, children of the tick's (the pipeline carries the tick's
/// context into the tasks that deliver).
struct TracedSink {
    inner: Arc<dyn Sink>,
}

#[async_trait]
impl Sink for TracedSink {
    async fn deliver(&self, batch: &Batch, deadline: tokio::time::Instant) -> Result<(), SinkError> {
        let Some(telemetry) = installed() else {
            return self.inner.deliver(batch, deadline).await;
        };
        let parent = Context::current();
        let mut span = telemetry
            .tracer
            .span_builder("deliver batch")
            .with_kind(SpanKind::Client)
            .with_attributes([
                KeyValue::new(attribute::BATCH_ID, batch.batch_id.clone()),
                KeyValue::new(attribute::BATCH_ROWS, batch.events.len() as i64),
                KeyValue::new(attribute::SINK, self.inner.describe()),
            ])
            .start_with_context(&telemetry.tracer, &parent);
        let delivered = self.inner.deliver(batch, deadline).await;
        match &delivered {
            Ok(()) => {
                span.set_attribute(KeyValue::new(attribute::DELIVERY_OUTCOME, "acknowledged"));
                span.set_status(Status::Ok);
            }
            Err(SinkError::Rejected { status, .. }) => {
                span.set_attribute(KeyValue::new(attribute::DELIVERY_OUTCOME, "rejected"));
                span.set_attribute(KeyValue::new(attribute::HTTP_STATUS, i64::from(*status)));
                span.set_status(Status::error(format!("the receiver rejected the batch: HTTP {status}")));
            }
            Err(SinkError::Transient { reason, .. }) => {
                span.set_attribute(KeyValue::new(attribute::DELIVERY_OUTCOME, "transient"));
                span.set_status(Status::error(reason.clone()));
            }
        }
        span.end();
        delivered
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}
