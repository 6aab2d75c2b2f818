//! Issue 36, section 1: a receiver that refuses everything alike (a rotated token's 401, a
//! gateway's 404, an http→https redirect, a queue SAS without add rights) is the endpoint, not the
//! rows: the poller holds at its checkpoint, quarantines nothing, `status` says unhealthy and the
//! watchdog reports `endpoint_refused`; once the endpoint answers again every row arrives. A
//! poisoned row among good ones is still quarantined (tests/it/poison.rs).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::routing::post;
use serde_json::{Value, json};

use crate::harness::{AppRoot, Orders, run_dbtrigger};

/// The answer a refusing endpoint gives to every request.
struct Refusal {
    status: u16,
    body: String,
    headers: Vec<(String, String)>,
}

/// A receiver that answers `refusal` to everything while it is set, and otherwise accepts and
/// records the ids it got.
#[derive(Default)]
struct Endpoint {
    refusal: Option<Refusal>,
    accepted: Vec<i64>,
    requests: u64,
}

async fn answer(
    State(endpoint): State<Arc<Mutex<Endpoint>>>,
    body: axum::body::Bytes,
) -> (StatusCode, HeaderMap, String) {
    let envelope: Value = serde_json::from_slice(&body).unwrap();
    let ids = envelope["events"].as_array().unwrap().iter().map(|event| event["pk"]["id"].as_i64().unwrap());
    let mut endpoint = endpoint.lock().unwrap();
    endpoint.requests += 1;
    if let Some(refusal) = &endpoint.refusal {
        let mut answer_headers = HeaderMap::new();
        for (name, value) in &refusal.headers {
            answer_headers.insert(HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
        }
        return (StatusCode::from_u16(refusal.status).unwrap(), answer_headers, refusal.body.clone());
    }
    endpoint.accepted.extend(ids);
    (StatusCode::OK, HeaderMap::new(), "{}".into())
}

struct Setup {
    _directory: tempfile::TempDir,
    _orders: Orders,
    app: AppRoot,
    settings: Vec<(String, String)>,
    endpoint: Arc<Mutex<Endpoint>>,
}

impl Setup {
    fn refuse(&self, status: u16, body: &str, headers: &[(&str, &str)]) {
        let headers = headers.iter().map(|(name, value)| (name.to_string(), value.to_string())).collect();
        self.endpoint.lock().unwrap().refusal = Some(Refusal { status, body: body.to_string(), headers });
    }

    fn accepted(&self) -> Vec<i64> {
        self.endpoint.lock().unwrap().accepted.clone()
    }

    fn run(&self, arguments: &[&str]) -> (bool, String, String) {
        run_dbtrigger(&self.app, &self.settings, arguments)
    }

    fn quarantined(&self) -> Value {
        let (ok, stdout, stderr) = self.run(&["quarantine", "list", "orders", "--json"]);
        assert!(ok, "{stderr}");
        serde_json::from_str(&stdout).unwrap()
    }

    /// `dbtrigger status --json` of the poller.
    fn status(&self) -> (bool, Value) {
        let (ok, stdout, stderr) = self.run(&["status", "--json"]);
        let parsed: Value = serde_json::from_str(&stdout).unwrap_or_else(|_| panic!("not JSON: {stdout}\n{stderr}"));
        let poller = parsed.as_array().unwrap().iter().find(|status| status["function"] == "orders").unwrap().clone();
        (ok, poller)
    }
}

/// `rows` orders in batches of `size` into a receiver on loopback (the real binary, the file
/// store), with a watchdog function beside the poller.
async fn setup(rows: i64, size: usize) -> Setup {
    let endpoint = Arc::new(Mutex::new(Endpoint::default()));
    let router = axum::Router::new().route("/hook/{*rest}", post(answer)).with_state(endpoint.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // A path token, as chat hooks carry theirs: never shown anywhere.
    let url = format!("http://{}/hook/T0KEN-s3cret", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });

    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=rows, 3).await;
    let mut poller = AppRoot::orders_poller(size);
    poller["sink"]["maxRetries"] = json!(0);
    let app = AppRoot::write(directory.path(), poller);
    std::fs::create_dir_all(app.root.join("watchdog")).unwrap();
    let watchdog = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
        "watchdog": {"state": {"connection": "ORDERS_STATE"}}
    });
    std::fs::write(app.root.join("watchdog/function.json"), serde_json::to_vec_pretty(&watchdog).unwrap()).unwrap();
    let settings = vec![
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_WEBHOOK".to_string(), url),
        ("ORDERS_STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];
    Setup { _directory: directory, _orders: orders, app, settings, endpoint }
}

/// The endpoint refuses everything for three ticks: nothing is quarantined, the checkpoint stays,
/// `status` is unhealthy naming the status and the watchdog reports it, never the URL's path; once
/// the endpoint answers 200 every row arrives.
async fn refused_then_answered(status: u16, body: &str, headers: &[(&str, &str)]) {
    let setup = setup(50, 10).await;
    setup.refuse(status, body, headers);
    for tick in 1..=3 {
        let (ok, stdout, stderr) = setup.run(&["tick", "orders"]);
        assert!(!ok, "tick {tick} fails: {stdout}{stderr}");
        assert!(stdout.contains(&format!("HTTP {status}")), "tick {tick}: {stdout}");
    }
    assert_eq!(setup.endpoint.lock().unwrap().requests, 3, "one request a held tick: the batch, never split");
    assert_eq!(setup.quarantined(), json!([]), "nothing quarantined for HTTP {status}");
    let document = setup.app.state_document().await.unwrap();
    assert_eq!(document["checkpoint"], Value::Null, "the checkpoint held");
    assert_eq!(document["stats"]["quarantined"].as_u64().unwrap_or(0), 0, "{document}");
    assert_eq!(document["poison"]["attempts"], 3, "every held tick is counted: {document}");

    let (ok, poller) = setup.status();
    assert!(!ok, "status exits 1 for an unhealthy poller");
    assert_eq!(poller["healthy"], false);
    assert_eq!(poller["endpoint_refused"], status, "{poller}");
    let problems = poller["problems"].to_string();
    assert!(problems.contains(&format!("refuses every row alike (HTTP {status})")), "{problems}");

    let (ok, stdout, _) = setup.run(&["tick", "watchdog"]);
    assert!(!ok, "a finding exits 1: {stdout}");
    let finding =
        stdout.lines().find(|line| line.contains("finding=endpoint_refused")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(finding.contains("function=orders") && finding.contains(&format!("HTTP {status}")), "{finding}");
    for text in [stdout.as_str(), problems.as_str(), &document.to_string()] {
        assert!(!text.contains("T0KEN-s3cret"), "the URL's path is never shown: {text}");
    }

    setup.endpoint.lock().unwrap().refusal = None;
    for _ in 0..10 {
        let (_, stdout, _) = setup.run(&["tick", "orders"]);
        if stdout.contains("caught up") {
            break;
        }
    }
    let accepted: BTreeSet<i64> = setup.accepted().into_iter().collect();
    assert_eq!(accepted, (1..=50).collect::<BTreeSet<i64>>(), "every row arrived");
    assert_eq!(setup.quarantined(), json!([]));
    let (ok, poller) = setup.status();
    assert!(ok && poller["healthy"] == true && poller["endpoint_refused"].is_null(), "{poller}");
    let document = setup.app.state_document().await.unwrap();
    assert_eq!(document["checkpoint"]["cursor"]["tiebreaker"]["id"], 50);
}

/// Regression (issue 36, item 1): a rotated token. Before, 30 of 50 rows went to the quarantine in
/// three ticks and 20 arrived once the receiver answered 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_answering_401_to_everything_is_held_at_not_quarantined() {
    refused_then_answered(401, "{\"error\": \"invalid token\"}", &[("www-authenticate", "Bearer")]).await;
}

/// Regression (issue 35, found by the simulation's receiver answering 409s of its own, seeds 1, 14,
/// 35 among 157 of 2,000): a 409 is the fencing answer or the receiver's own conflict, never about a
/// row. Before, a batch answered 409 was isolated and every row tried alone that got a 409 was
/// quarantined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_answering_409_is_held_at_not_quarantined() {
    refused_then_answered(409, "{\"error\": \"another request with this idempotency key is in progress\"}", &[]).await;
}

/// Regression (issue 36, item 1): a gateway in front of the receiver that has no route for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_404_is_held_at_not_quarantined() {
    refused_then_answered(404, "<html><body>404 Not Found</body></html>", &[]).await;
}

/// Regression (issue 36, item 1): an http→https redirect (redirects are not followed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_held_at_not_quarantined() {
    refused_then_answered(308, "", &[("location", "https://hooks.example.com/hook/T0KEN-s3cret")]).await;
}

/// Regression (issue 36, item 1): a queue whose credential the storage account refuses (here an
/// account key rotated under the poller: Azurite answers 403 as Azure does, as it does for a SAS
/// without add rights) holds the poller instead of quarantining the backlog; with the new key every
/// row arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_refusing_the_credential_is_held_at_not_quarantined() {
    use dbtrigger::config::{PollerConfig, Settings};
    use dbtrigger::store::memory::MemoryStore;
    use dbtrigger::store::{StateKey, quarantine};
    use dbtrigger::tick::{Poller, SystemClock, TickError};

    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=30, 1).await;
    let queue = crate::queue::queue_name();
    let app = AppRoot::write(
        directory.path(),
        json!({
            "source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]},
            "batch": {"size": 10},
            "sink": {"type": "queue", "connection": "QUEUES", "queueName": queue},
            "state": {"connection": "ORDERS_STATE"}
        }),
    );
    let right = crate::services::azurite().connection_string();
    let rotated_key = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [7u8; 64]);
    let wrong = right.replace(
        "AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==",
        &format!("AccountKey={rotated_key}"),
    );
    assert_ne!(wrong, right);
    let store = Arc::new(MemoryStore::new());
    let poller = |connection: &str| {
        let settings = Settings::from_pairs([
            ("ORDERS_DB".to_string(), orders.url()),
            ("ORDERS_STATE".to_string(), "file:unused".to_string()),
            ("QUEUES".to_string(), connection.to_string()),
            ("DBTRIGGER_APP_NAME".to_string(), "it".to_string()),
        ]);
        let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
        let source = dbtrigger::source::open(&config.source).unwrap();
        let sink = dbtrigger::sink::open(&config.sink).unwrap();
        Poller::new(config, source, sink, store.clone(), Arc::new(SystemClock), "it".into())
            .with_quarantine(store.clone())
    };

    let refused = poller(&wrong);
    for attempt in 1..=3u32 {
        let error = refused.tick().await.unwrap_err();
        assert!(matches!(error, TickError::EndpointRefused { status: 403, .. }), "attempt {attempt}: {error:?}");
    }
    assert!(quarantine::list(store.as_ref(), "it", "orders").await.unwrap().is_empty(), "nothing quarantined");
    let document =
        dbtrigger::domain::StateDocument::parse(&store.raw(&StateKey::new("it", "orders")).unwrap()).unwrap();
    assert!(document.checkpoint.is_none(), "the checkpoint held");
    let held = document.poison.unwrap();
    assert_eq!((held.endpoint_refused, held.attempts), (Some(403), 3));
    assert!(held.last_error.contains("403"), "{}", held.last_error);
    assert!(!held.last_error.contains(&rotated_key), "{}", held.last_error);

    let outcome = poller(&right).tick().await.unwrap();
    assert!(matches!(outcome, dbtrigger::tick::TickOutcome::Delivered { rows: 30, .. }), "{outcome:?}");
    assert_eq!(crate::queue::drain(&queue).await.len(), 30, "every row arrived");
    assert!(quarantine::list(store.as_ref(), "it", "orders").await.unwrap().is_empty());
}

/// Issue 45, finding 8: a receiver deployed with a bug answers 422 to every row. Before, 50 of
/// 50 rows went to the quarantine within 5 ticks and `status` said healthy. The quarantine budget
/// (`poison.maxQuarantinedPerHour`, 10 by default) stops it: at most 10 rows are quarantined, then
/// the poller holds at its checkpoint (one request a tick), `status` exits 1 naming
/// `quarantine_budget_spent` with the last refusal, the watchdog reports it, and once the
/// receiver accepts again every other row arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_answering_422_to_every_row_quarantines_no_more_than_the_budget() {
    let setup = setup(50, 10).await;
    setup.refuse(422, "{\"error\": \"schema v2 required\"}", &[]);
    for _ in 0..6 {
        setup.run(&["tick", "orders"]);
    }
    let quarantined = setup.quarantined();
    assert_eq!(quarantined.as_array().unwrap().len(), 10, "the budget's 10 rows, no more: {quarantined}");
    let before = setup.endpoint.lock().unwrap().requests;
    let (ok, stdout, _) = setup.run(&["tick", "orders"]);
    assert!(!ok && stdout.contains("quarantine_budget_spent"), "a held tick fails naming the budget: {stdout}");
    assert_eq!(setup.endpoint.lock().unwrap().requests, before + 1, "one request a held tick: the batch, never split");
    assert_eq!(setup.quarantined().as_array().unwrap().len(), 10, "nothing more quarantined");
    let document = setup.app.state_document().await.unwrap();
    assert_eq!(document["checkpoint"]["cursor"]["tiebreaker"]["id"], 10, "held after the rows quarantined: {document}");
    assert_eq!(document["quarantine_log"]["times"].as_array().unwrap().len(), 10, "{document}");

    let (ok, poller) = setup.status();
    assert!(!ok, "status exits 1 for a poller held past its quarantine budget");
    assert_eq!(poller["healthy"], false);
    assert_eq!(poller["quarantine_budget_spent"], true, "{poller}");
    let problems = poller["problems"].to_string();
    assert!(problems.contains("quarantine_budget_spent") && problems.contains("schema v2 required"), "{problems}");

    let (ok, stdout, _) = setup.run(&["tick", "watchdog"]);
    assert!(!ok, "a finding exits 1: {stdout}");
    let finding = stdout
        .lines()
        .find(|line| line.contains("finding=quarantine_budget_spent"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(finding.contains("function=orders"), "{finding}");

    setup.endpoint.lock().unwrap().refusal = None;
    for _ in 0..10 {
        let (_, stdout, _) = setup.run(&["tick", "orders"]);
        if stdout.contains("caught up") {
            break;
        }
    }
    let accepted: BTreeSet<i64> = setup.accepted().into_iter().collect();
    assert_eq!(accepted, (11..=50).collect::<BTreeSet<i64>>(), "every row not quarantined arrived");
    assert_eq!(setup.quarantined().as_array().unwrap().len(), 10);
    let (ok, poller) = setup.status();
    assert!(ok && poller["quarantine_budget_spent"] == false, "{poller}");
}
