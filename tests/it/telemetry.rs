//! Metrics and traces leave the real binary, spoken to over the host's protocol: to an OTLP
//! endpoint in the test (an HTTP server decoding OTLP protobuf with the opentelemetry-proto types)
//! and to an Application Insights ingestion endpoint on loopback (the connection string's
//! `IngestionEndpoint`). The lag they carry is the lag `status --json` shows; a tick's span
//! carries the host's invocation id and its deliveries are its children; a dead endpoint fails
//! no tick.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{metric, number_data_point};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use serde_json::{Value, json};

use crate::harness::{AppRoot, Handler, Orders, Receiver, free_port, host_fixtures, run_dbtrigger};

/// What the OTLP endpoint received: each metrics export with when it arrived, every span.
#[derive(Default)]
struct Received {
    metrics: Vec<(Instant, ExportMetricsServiceRequest)>,
    spans: Vec<Span>,
}

/// An OTLP/HTTP endpoint (`/v1/metrics`, `/v1/traces`, protobuf) on a free loopback port.
struct Collector {
    url: String,
    received: Arc<Mutex<Received>>,
}

impl Collector {
    async fn start() -> Collector {
        let received: Arc<Mutex<Received>> = Arc::default();
        let app = axum::Router::new()
            .route(
                "/v1/metrics",
                post(|State(received): State<Arc<Mutex<Received>>>, body: Bytes| async move {
                    let request = ExportMetricsServiceRequest::decode(body).expect("OTLP metrics protobuf");
                    received.lock().unwrap().metrics.push((Instant::now(), request));
                    ""
                }),
            )
            .route(
                "/v1/traces",
                post(|State(received): State<Arc<Mutex<Received>>>, body: Bytes| async move {
                    let request = ExportTraceServiceRequest::decode(body).expect("OTLP traces protobuf");
                    let mut received = received.lock().unwrap();
                    for resource in request.resource_spans {
                        for scope in resource.scope_spans {
                            received.spans.extend(scope.spans);
                        }
                    }
                    ""
                }),
            )
            .with_state(received.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Collector { url, received }
    }

    /// The points of metric `name` for poller `orders` in the last export that arrived after
    /// `since` and holds it: (attributes, value). Waits up to 20 s for one.
    async fn points_after(&self, name: &str, since: Instant) -> Vec<(BTreeMap<String, String>, f64)> {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            let found = {
                let received = self.received.lock().unwrap();
                received
                    .metrics
                    .iter()
                    .rev()
                    .filter(|(at, _)| *at > since)
                    .map(|(_, request)| points_of(request, name))
                    .find(|points| !points.is_empty())
            };
            if let Some(points) = found {
                return points;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("no export of {name} arrived");
    }

    /// The spans received so far, once `wanted` holds of them (20 s at most).
    async fn spans_when(&self, wanted: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            let spans = self.received.lock().unwrap().spans.clone();
            if wanted(&spans) {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the spans expected did not arrive: {:?}", self.received.lock().unwrap().spans);
    }
}

fn text(value: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.as_ref().and_then(|value| value.value.as_ref()) {
        Some(any_value::Value::StringValue(text)) => text.clone(),
        Some(any_value::Value::IntValue(number)) => number.to_string(),
        Some(any_value::Value::DoubleValue(number)) => number.to_string(),
        Some(any_value::Value::BoolValue(flag)) => flag.to_string(),
        _ => String::new(),
    }
}

fn attributes(pairs: &[KeyValue]) -> BTreeMap<String, String> {
    pairs.iter().map(|pair| (pair.key.clone(), text(&pair.value))).collect()
}

/// Every data point of `name` in one export: gauges and sums as their value, histograms as
/// their count.
fn points_of(request: &ExportMetricsServiceRequest, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    let number = |point: &opentelemetry_proto::tonic::metrics::v1::NumberDataPoint| match point.value {
        Some(number_data_point::Value::AsDouble(value)) => value,
        Some(number_data_point::Value::AsInt(value)) => value as f64,
        None => f64::NAN,
    };
    let mut points = Vec::new();
    for resource in &request.resource_metrics {
        for scope in &resource.scope_metrics {
            for found in scope.metrics.iter().filter(|found| found.name == name) {
                match &found.data {
                    Some(metric::Data::Gauge(gauge)) => points
                        .extend(gauge.data_points.iter().map(|point| (attributes(&point.attributes), number(point)))),
                    Some(metric::Data::Sum(sum)) => points
                        .extend(sum.data_points.iter().map(|point| (attributes(&point.attributes), number(point)))),
                    Some(metric::Data::Histogram(histogram)) => points.extend(
                        histogram.data_points.iter().map(|point| (attributes(&point.attributes), point.count as f64)),
                    ),
                    _ => {}
                }
            }
        }
    }
    points
}

/// The one point of poller `orders` (and `outcome`, when given) among `points`.
fn orders_point(points: &[(BTreeMap<String, String>, f64)], outcome: Option<&str>) -> f64 {
    let matching: Vec<f64> = points
        .iter()
        .filter(|(attributes, _)| attributes.get("dbtrigger.poller").map(String::as_str) == Some("orders"))
        .filter(|(attributes, _)| {
            outcome.is_none_or(|outcome| attributes.get("dbtrigger.tick.outcome").map(String::as_str) == Some(outcome))
        })
        .map(|(_, value)| *value)
        .collect();
    assert_eq!(matching.len(), 1, "one point for poller orders: {points:?}");
    matching[0]
}

/// `dbtrigger status --json`'s entry for `orders`, from the binary run by an operator.
fn status_of_orders(app: &AppRoot, settings: &[(String, String)]) -> Value {
    let (_, stdout, stderr) = run_dbtrigger(app, settings, &["status", "--json"]);
    let all: Value = serde_json::from_str(&stdout).unwrap_or_else(|_| panic!("status --json: {stdout}{stderr}"));
    all.as_array().unwrap().iter().find(|entry| entry["poller"] == "orders").cloned().expect("orders in status")
}

fn timer_body() -> &'static str {
    host_fixtures().into_iter().find(|(name, _)| *name == "timer_normal").unwrap().1
}

struct Fixture {
    _directory: tempfile::TempDir,
    orders: Orders,
    receiver: Receiver,
    app: AppRoot,
    /// The app's settings, without telemetry (what an operator's `status` runs with).
    settings: Vec<(String, String)>,
}

/// 27 rows waiting, batches of 5 (six batches).
async fn fixture() -> Fixture {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=27, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(5));
    let settings = app.settings(&orders, &receiver);
    Fixture { _directory: directory, orders, receiver, app, settings }
}

fn with(settings: &[(String, String)], more: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut all = settings.to_vec();
    all.extend(more.iter().map(|(name, value)| (name.to_string(), value.to_string())));
    all
}

/// The metrics reach an OTLP endpoint with the lag `status --json` shows, before and after a
/// tick; the tick's counters match its summary; its span carries the host's invocation id, and
/// each batch delivery is a child span with the receiver's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_a_tick_span_reach_an_otlp_endpoint_with_the_lag_status_shows() {
    let fixture = fixture().await;
    let collector = Collector::start().await;
    let handler = Handler::start(
        &fixture.app,
        &with(
            &fixture.settings,
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.url),
                ("OTEL_METRIC_EXPORT_INTERVAL", "200"),
                ("OTEL_BSP_SCHEDULE_DELAY", "100"),
                ("OTEL_SERVICE_NAME", "orders-app"),
            ],
        ),
    )
    .await;

    // Before any tick: 27 rows wait.
    let lag = orders_point(&collector.points_after("dbtrigger.lag.rows", Instant::now()).await, None);
    let status = status_of_orders(&fixture.app, &fixture.settings);
    assert_eq!(status["lag_rows"].as_f64(), Some(lag), "exported lag is the status's: {status}");
    assert_eq!(lag, 27.0);

    let invocation_id = uuid::Uuid::new_v4().to_string();
    let (code, _, answer) = handler.invoke_as("orders", timer_body(), &invocation_id).await;
    assert_eq!(code, 200, "{answer}");
    assert!(answer["Logs"][0].as_str().unwrap().contains("outcome=caught-up rows=27 batches=6"), "{answer}");
    let ticked = Instant::now();

    // After it: none wait, in the status and in the gauge sampled from it (an export well after
    // the tick: a sample begun before it may land in the snapshot just after it).
    let lag =
        orders_point(&collector.points_after("dbtrigger.lag.rows", ticked + Duration::from_millis(1500)).await, None);
    let status = status_of_orders(&fixture.app, &fixture.settings);
    assert_eq!((status["lag_rows"].as_f64(), lag), (Some(0.0), 0.0), "{status}");
    for (name, field) in [("dbtrigger.quarantined", "quarantined"), ("dbtrigger.attempts", "attempts")] {
        let value = orders_point(&collector.points_after(name, ticked).await, None);
        assert_eq!(status[field].as_f64(), Some(value), "{name} is status's {field}: {status}");
    }
    // The tick's counters say what its summary line says.
    assert_eq!(orders_point(&collector.points_after("dbtrigger.rows.delivered", ticked).await, None), 27.0);
    assert_eq!(orders_point(&collector.points_after("dbtrigger.batches.delivered", ticked).await, None), 6.0);
    assert_eq!(orders_point(&collector.points_after("dbtrigger.ticks", ticked).await, Some("caught-up")), 1.0);
    assert_eq!(orders_point(&collector.points_after("dbtrigger.tick.duration", ticked).await, None), 1.0);
    let ticks = collector.points_after("dbtrigger.ticks", ticked).await;
    let (labels, _) = &ticks[0];
    assert_eq!(labels.get("faas.name").map(String::as_str), Some("orders"), "{labels:?}");
    assert_eq!(labels.get("db.system.name").map(String::as_str), Some("sqlite"), "{labels:?}");
    assert_eq!(labels.get("dbtrigger.source.kind").map(String::as_str), Some("table"), "{labels:?}");
    assert_eq!(labels.get("dbtrigger.app"), Some(&fixture.app.app_name), "{labels:?}");

    // The tick's span, with the host's invocation id, and its six deliveries as children.
    let is_the_tick = |span: &Span| attributes(&span.attributes).get("faas.invocation_id") == Some(&invocation_id);
    let spans = collector
        .spans_when(|spans| {
            spans
                .iter()
                .find(|span| is_the_tick(span))
                .is_some_and(|tick| spans.iter().filter(|span| span.parent_span_id == tick.span_id).count() == 6)
        })
        .await;
    let tick = spans.iter().find(|span| is_the_tick(span)).unwrap();
    let tick_attributes = attributes(&tick.attributes);
    assert_eq!(tick.name, "tick orders");
    assert_eq!(tick_attributes["dbtrigger.tick.outcome"], "caught-up", "{tick_attributes:?}");
    assert_eq!(tick_attributes["dbtrigger.rows"], "27", "{tick_attributes:?}");
    assert_eq!(tick_attributes["dbtrigger.batches"], "6", "{tick_attributes:?}");
    for delivery in spans.iter().filter(|span| span.parent_span_id == tick.span_id) {
        assert_eq!(delivery.trace_id, tick.trace_id);
        assert_eq!(delivery.name, "deliver batch");
        assert_eq!(attributes(&delivery.attributes)["dbtrigger.delivery.outcome"], "acknowledged");
    }
    assert_eq!(fixture.receiver.acknowledged_ids().len(), 27);
    drop(fixture.orders);
}

/// A loopback listener that speaks TLS with a certificate for `localhost`, signed by a CA made
/// for the test: the Application Insights exporter only speaks HTTPS (it turns an `http://`
/// `IngestionEndpoint` into `https://`).
struct TlsListener {
    inner: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((stream, address)) = self.inner.accept().await else {
                continue;
            };
            if let Ok(tls) = self.acceptor.accept(stream).await {
                return (tls, address);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A TLS acceptor for `localhost`, and the PEM of the CA that signed its certificate.
fn localhost_tls() -> (tokio_rustls::TlsAcceptor, String) {
    use tokio_rustls::rustls;
    let mut authority = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    authority.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let authority = rcgen::CertifiedIssuer::self_signed(authority, rcgen::KeyPair::generate().unwrap()).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let certificate =
        rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap().signed_by(&key, &authority).unwrap();
    let private_key = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![certificate.der().clone()], private_key)
        .unwrap();
    (tokio_rustls::TlsAcceptor::from(Arc::new(config)), authority.pem())
}

/// An Application Insights ingestion endpoint on loopback (`https://localhost:port/v2/track`,
/// gzip JSON envelopes): its URL, the CA's PEM to trust, and the envelopes it received.
async fn ingestion_endpoint() -> (String, String, Arc<Mutex<Vec<Value>>>) {
    let envelopes: Arc<Mutex<Vec<Value>>> = Arc::default();
    let app = axum::Router::new()
        .route(
            "/v2/track",
            post(|State(envelopes): State<Arc<Mutex<Vec<Value>>>>, body: Bytes| async move {
                let mut json = String::new();
                flate2::read::GzDecoder::new(&body[..]).read_to_string(&mut json).expect("a gzip body");
                let items: Vec<Value> = serde_json::from_str(&json).expect("a JSON array of envelopes");
                let count = items.len();
                envelopes.lock().unwrap().extend(items);
                axum::Json(json!({"itemsReceived": count, "itemsAccepted": count, "errors": []}))
            }),
        )
        .with_state(envelopes.clone());
    let (acceptor, authority) = localhost_tls();
    let inner = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://localhost:{}/", inner.local_addr().unwrap().port());
    tokio::spawn(async move { axum::serve(TlsListener { inner, acceptor }, app).await.unwrap() });
    (url, authority, envelopes)
}

async fn envelope_when(handler: &Handler, envelopes: &Mutex<Vec<Value>>, wanted: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(20) {
        if let Some(found) = envelopes.lock().unwrap().iter().find(|envelope| wanted(envelope)) {
            return found.clone();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no such envelope: {:?}; handler's log:\n{}", envelopes.lock().unwrap(), handler.log());
}

/// An Application Insights connection string whose `IngestionEndpoint` is on loopback (HTTPS) receives
/// the lag (the status's) and the tick's request with the host's invocation id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn application_insights_receives_the_lag_and_the_tick() {
    let fixture = fixture().await;
    let (ingestion, authority, envelopes) = ingestion_endpoint().await;
    let authority_file = fixture.app.root.join("ingestion-ca.pem");
    std::fs::write(&authority_file, authority).unwrap();
    let connection_string =
        format!("InstrumentationKey=00000000-0000-0000-0000-000000000001;IngestionEndpoint={ingestion}");
    let handler = Handler::start(
        &fixture.app,
        &with(
            &fixture.settings,
            &[
                ("APPLICATIONINSIGHTS_CONNECTION_STRING", &connection_string),
                // The handler trusts the test's CA (rustls-native-certs reads it).
                ("SSL_CERT_FILE", authority_file.to_str().unwrap()),
                ("OTEL_METRIC_EXPORT_INTERVAL", "200"),
                ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ],
        ),
    )
    .await;
    let lag = envelope_when(&handler, &envelopes, |envelope| {
        envelope["data"]["baseData"]["metrics"][0]["name"] == "dbtrigger.lag.rows"
            && envelope["data"]["baseData"]["properties"]["dbtrigger.poller"] == "orders"
    })
    .await;
    let status = status_of_orders(&fixture.app, &fixture.settings);
    assert_eq!(lag["name"], "Microsoft.ApplicationInsights.Metric");
    assert_eq!(lag["data"]["baseData"]["metrics"][0]["value"].as_f64(), status["lag_rows"].as_f64(), "{lag} {status}");
    assert_eq!(status["lag_rows"], 27);

    let invocation_id = uuid::Uuid::new_v4().to_string();
    let (code, _, answer) = handler.invoke_as("orders", timer_body(), &invocation_id).await;
    assert_eq!(code, 200, "{answer}");
    let request = envelope_when(&handler, &envelopes, |envelope| {
        envelope["data"]["baseData"]["properties"]["faas.invocation_id"] == invocation_id.as_str()
    })
    .await;
    assert_eq!(request["name"], "Microsoft.ApplicationInsights.Request", "{request}");
    assert_eq!(request["data"]["baseData"]["name"], "tick orders", "{request}");
    assert_eq!(request["data"]["baseData"]["properties"]["dbtrigger.rows"], "27", "{request}");
}

/// A dead endpoint costs a warning, said once, and fails no tick: every row is delivered, every
/// tick answers 200 while each export fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_fails_no_tick() {
    let fixture = fixture().await;
    let dead = format!("http://127.0.0.1:{}", free_port());
    let handler = Handler::start(
        &fixture.app,
        &with(
            &fixture.settings,
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &dead),
                ("OTEL_METRIC_EXPORT_INTERVAL", "100"),
                ("OTEL_BSP_SCHEDULE_DELAY", "50"),
            ],
        ),
    )
    .await;
    for round in 0..4_i64 {
        let (code, _, answer) = handler.invoke("orders", timer_body()).await;
        assert_eq!(code, 200, "{answer}");
        assert!(answer["Logs"][0].as_str().unwrap().contains("outcome=caught-up"), "{answer}");
        fixture.orders.insert(100 + round * 10..=100 + round * 10 + 4, 1).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (code, _, answer) = handler.invoke("orders", timer_body()).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(fixture.receiver.acknowledged_ids().len(), 27 + 4 * 5);
    let stderr = handler.stderr();
    assert_eq!(stderr.matches("telemetry export to OTLP (metrics) failed").count(), 1, "said once: {stderr}");
    assert!(stderr.contains("WARN"), "{stderr}");
}

/// Neither setting: the handler says nothing of telemetry and sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_setting_no_telemetry() {
    let fixture = fixture().await;
    let handler = Handler::start(&fixture.app, &fixture.settings).await;
    let (code, _, _) = handler.invoke("orders", timer_body()).await;
    assert_eq!(code, 200);
    assert!(!handler.log().contains("telemetry"), "{}", handler.log());
}

/// docs/observability.md lists every metric of the code's table, and names no other: its KQL, the
/// alert rules and the workbook (both JSON files parse) use only metrics and attributes the code
/// exports.
#[test]
fn the_observability_page_names_only_metrics_that_exist() {
    use dbtrigger::telemetry::names::{METRICS, attribute};
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/observability.md")).unwrap();
    for metric in METRICS {
        let row = format!("| `{}` | {} | `{}` |", metric.name, metric.kind.as_str(), metric.unit);
        assert!(page.contains(&row), "docs/observability.md has no row {row}");
    }
    let alerts = std::fs::read_to_string(root.join("docs/observability/alerts.json")).unwrap();
    let workbook = std::fs::read_to_string(root.join("docs/observability/workbook.json")).unwrap();
    let alerts: Value = serde_json::from_str(&alerts).expect("alerts.json is JSON");
    let workbook: Value = serde_json::from_str(&workbook).expect("workbook.json is JSON");
    let rules = alerts["resources"].as_array().unwrap();
    assert_eq!(rules.len(), 4, "four rules");
    for rule in rules {
        assert_eq!(rule["type"], "Microsoft.Insights/scheduledQueryRules");
        assert!(rule["properties"]["criteria"]["allOf"][0]["query"].as_str().is_some_and(|query| !query.is_empty()));
    }
    assert_eq!(workbook["version"], "Notebook/1.0");

    let known = |name: &str| METRICS.iter().any(|metric| metric.name == name) || attribute::ALL.contains(&name);
    let texts = [
        ("docs/observability.md", page.clone()),
        ("alerts.json", alerts.to_string()),
        ("workbook.json", workbook.to_string()),
    ];
    let mut referenced = 0;
    for (file, text) in &texts {
        for name in dotted_names(text) {
            assert!(known(&name), "{file} names {name}, which the code does not export");
            referenced += 1;
        }
    }
    assert!(referenced > 20, "the names were found: {referenced}");
    for wanted in
        ["dbtrigger.lag.seconds", "dbtrigger.healthy", "dbtrigger.rows.quarantined", "dbtrigger.slot.retained"]
    {
        assert!(alerts.to_string().contains(&format!("\\\"{wanted}\\\"")), "a rule on {wanted}");
    }
}

/// Every `dbtrigger.…` name in `text` (letters, digits, `_` and inner dots).
fn dotted_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("dbtrigger.") {
        let tail = &rest[at..];
        let length = tail
            .find(|character: char| !(character.is_ascii_alphanumeric() || character == '_' || character == '.'))
            .unwrap_or(tail.len());
        let name = tail[..length].trim_end_matches('.');
        // File names (`dbtrigger.rs`…) and the crate's paths are not metric names.
        if name.matches('.').count() >= 1 && !name.ends_with(".md") && !name.ends_with(".json") {
            names.push(name.to_string());
        }
        rest = &tail[length.max(1)..];
    }
    names
}
