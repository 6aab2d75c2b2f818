//! The webhook sink against a real HTTP receiver on loopback: signatures, retries, rejections,
//! timeouts and body splitting.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::sink::Sink;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::tick::{Poller, SystemClock, TickError, TickOutcome};
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;

use crate::harness::{AppRoot, Orders, Receiver};

const SECRET: &str = "whsec_c2VjcmV0LWtleS1mb3ItdGhlLXRlc3RzLTEyMzQ=";

struct Setup {
    _directory: tempfile::TempDir,
    receiver: Receiver,
    poller: Poller,
}

async fn setup(rows: i64, sink: Value) -> Setup {
    setup_with(rows, sink, json!({})).await
}

/// With `source` fields added to the usual poller's; a `load_log(load_id)` table holds load 7.
async fn setup_with(rows: i64, sink: Value, source: Value) -> Setup {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=rows, 1).await;
    sqlx::raw_sql("CREATE TABLE load_log (load_id TEXT); INSERT INTO load_log VALUES ('load-7')")
        .execute(&orders.pool)
        .await
        .unwrap();
    let receiver = Receiver::start().await;
    let mut poller_json = AppRoot::orders_poller(100);
    for (key, value) in source.as_object().unwrap() {
        poller_json["source"][key] = value.clone();
    }
    for (key, value) in sink.as_object().unwrap() {
        poller_json["sink"][key] = value.clone();
    }
    let app = AppRoot::write(directory.path(), poller_json);
    let settings = Settings::from_pairs([
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_WEBHOOK".to_string(), receiver.url.clone()),
        ("ORDERS_STATE".to_string(), "file:unused".to_string()),
        ("ORDERS_SECRET".to_string(), SECRET.to_string()),
    ]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink: Arc<dyn Sink> = dbtrigger::sink::open(&config.sink).unwrap();
    let poller = Poller::new(config, source, sink, Arc::new(MemoryStore::new()), Arc::new(SystemClock), "a".into());
    Setup { _directory: directory, receiver, poller }
}

#[tokio::test]
async fn signed_deliveries_verify_with_an_independent_hmac() {
    let setup = setup(3, json!({"secret": "ORDERS_SECRET"})).await;
    setup.poller.tick().await.unwrap();
    let received = &setup.receiver.all()[0];
    let header = |name: &str| received.headers[name].to_str().unwrap().to_string();
    let id = header("webhook-id");
    let timestamp = header("webhook-timestamp");
    assert_eq!(id, received.envelope["batch_id"].as_str().unwrap());
    assert!((chrono::Utc::now().timestamp() - timestamp.parse::<i64>().unwrap()).abs() < 60);
    // Verify the way a receiver's Standard Webhooks library does.
    let key = base64::engine::general_purpose::STANDARD.decode(SECRET.trim_start_matches("whsec_")).unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(&received.body);
    let expected = format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes()));
    assert_eq!(header("webhook-signature"), expected);
    assert_eq!(header("user-agent"), format!("dbtrigger/{}", env!("CARGO_PKG_VERSION")));
    assert_eq!(header("x-dbtrigger-poller"), "orders");
    assert!(received.envelope.get("generation").is_none(), "no source generation configured, no field");
    assert!(received.envelope["fencing_token"].as_u64().is_some());
    assert!(received.envelope["sent_at"].as_str().unwrap().ends_with('Z'));
}

/// Seed 003: each delivery says which source load its rows belong to.
#[tokio::test]
async fn deliveries_carry_the_source_generation_when_one_is_configured() {
    let setup = setup_with(3, json!({}), json!({"generation": {"query": "SELECT max(load_id) FROM load_log"}})).await;
    setup.poller.tick().await.unwrap();
    let envelope = &setup.receiver.all()[0].envelope;
    assert_eq!(envelope["generation"], "load-7");
    let keys: Vec<&String> = envelope.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["poller", "batch_id", "fencing_token", "generation", "sent_at", "events"]);
}

#[tokio::test]
async fn a_503_is_retried_and_the_batch_delivered_once_more() {
    let setup = setup(3, json!({"maxRetries": 3})).await;
    setup.receiver.answer_next(503, "busy");
    let outcome = setup.poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 3, .. }), "{outcome:?}");
    let all = setup.receiver.all();
    assert_eq!(all.iter().map(|received| received.status).collect::<Vec<_>>(), vec![503, 200]);
    assert_eq!(all[0].envelope["batch_id"], all[1].envelope["batch_id"]);
    assert_eq!(all[0].envelope["events"], all[1].envelope["events"]);
}

#[tokio::test]
async fn a_429_with_retry_after_waits_as_asked() {
    let setup = setup(3, json!({"maxRetries": 3})).await;
    setup.receiver.answer_next_with(429, "slow down", &[("retry-after", "1")]);
    setup.poller.tick().await.unwrap();
    let all = setup.receiver.all();
    assert_eq!(all.len(), 2);
    let waited = all[1].at - all[0].at;
    assert!(waited >= Duration::from_millis(950), "waited only {waited:?}");
    assert!(waited < Duration::from_secs(3), "waited {waited:?}");
}

#[tokio::test]
async fn a_400_is_a_permanent_rejection_with_the_body_in_the_error() {
    let setup = setup(3, json!({"maxRetries": 3})).await;
    setup.receiver.answer_next(400, "{\"error\": \"field total is required\"}");
    let error = setup.poller.tick().await.unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, TickError::Delivery { .. }), "{error:?}");
    assert!(message.contains("HTTP 400") && message.contains("field total is required"), "{message}");
    assert_eq!(setup.receiver.all().len(), 1, "a permanent rejection is not retried");
}

#[tokio::test]
async fn a_receiver_that_hangs_times_out_as_a_transient_failure() {
    let setup = setup(3, json!({"maxRetries": 0, "timeoutSeconds": 1})).await;
    setup.receiver.set_delay(Duration::from_secs(5));
    let started = std::time::Instant::now();
    let error = setup.poller.tick().await.unwrap_err();
    let message = error.to_string();
    assert!(message.contains("timed out"), "{message}");
    assert!(matches!(error, TickError::Delivery { error: dbtrigger::sink::SinkError::Transient { .. }, .. }));
    assert!(started.elapsed() < Duration::from_secs(4), "the timeout cut the hang short");
}

#[tokio::test]
async fn a_batch_over_the_body_limit_is_split_into_ordered_parts() {
    let setup = setup(60, json!({"maxBodyBytes": 2048})).await;
    setup.poller.tick().await.unwrap();
    let all = setup.receiver.all();
    assert!(all.len() > 2, "split into several requests, got {}", all.len());
    for received in &all {
        assert!(received.body.len() <= 2048, "a part of {} bytes", received.body.len());
        let id = received.envelope["batch_id"].as_str().unwrap();
        assert_eq!(received.headers["idempotency-key"].to_str().unwrap(), id);
        assert!(id.contains(&format!("of{}", all.len())), "{id}");
    }
    assert_eq!(setup.receiver.acknowledged_ids(), (1..=60).collect::<Vec<i64>>());
}

/// The example receiver of docs/receivers.md (standard-library Python), run against the real sink.
struct PythonReceiver {
    child: std::process::Child,
    url: String,
    /// What it printed after its first line, read as it comes (so its pipe never fills).
    lines: Arc<std::sync::Mutex<Vec<String>>>,
}

impl PythonReceiver {
    fn start(secret: &str) -> PythonReceiver {
        let port = crate::harness::free_port();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/examples/receiver.py");
        let mut child = std::process::Command::new("python3")
            .args([script, "--port", &port.to_string(), "--secret", secret])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 runs the example receiver");
        let mut reader = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut reader, &mut line).unwrap();
        assert!(line.starts_with("listening"), "{line}");
        let lines = Arc::new(std::sync::Mutex::new(Vec::new()));
        let collected = lines.clone();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(reader).map_while(Result::ok) {
                collected.lock().unwrap().push(line);
            }
        });
        PythonReceiver { child, url: format!("http://127.0.0.1:{port}/"), lines }
    }

    /// The lines it printed that start with `prefix`, once there are `count` (or after 5 s: its
    /// lines are flushed before each answer, the reading thread may lag a moment behind).
    fn printed(&self, prefix: &str, count: usize) -> Vec<String> {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let lines: Vec<String> =
                self.lines.lock().unwrap().iter().filter(|line| line.starts_with(prefix)).cloned().collect();
            if lines.len() >= count || std::time::Instant::now() > deadline {
                return lines;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PythonReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn poller_for(url: &str, orders: &Orders, directory: &std::path::Path, secret: &str) -> Poller {
    let app = AppRoot::write(
        directory,
        json!({
            "source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]},
            "batch": {"size": 10},
            "sink": {"type": "webhook", "url": url, "secret": "ORDERS_SECRET", "maxRetries": 0},
            "state": {"connection": "ORDERS_STATE"}
        }),
    );
    let settings = Settings::from_pairs([
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_STATE".to_string(), "file:unused".to_string()),
        ("ORDERS_SECRET".to_string(), secret.to_string()),
    ]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink = dbtrigger::sink::open(&config.sink).unwrap();
    Poller::new(config, source, sink, Arc::new(MemoryStore::new()), Arc::new(SystemClock), "a".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_example_receiver_verifies_and_deduplicates() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=25, 2).await;
    let receiver = PythonReceiver::start(SECRET);

    // Delivered once, then all again (a fresh state store: everything is redelivered).
    poller_for(&receiver.url, &orders, directory.path(), SECRET).tick().await.unwrap();
    poller_for(&receiver.url, &orders, directory.path(), SECRET).tick().await.unwrap();
    let stats: Value = reqwest::get(&receiver.url).await.unwrap().json().await.unwrap();
    let applied: Vec<i64> = stats["applied"].as_array().unwrap().iter().map(|pk| pk["id"].as_i64().unwrap()).collect();
    assert_eq!(applied, (1..=25).collect::<Vec<i64>>(), "each row applied once");
    assert_eq!(stats["duplicates"], json!(25), "the redelivery was recognised");
    // A person watching the receiver sees each row land (issue 40): a line per applied event, a
    // line per duplicate skipped. Its stdout is flushed per line before the answer goes out.
    let applied_lines = receiver.printed("applied: ", 25);
    assert_eq!(applied_lines.len(), 25, "{applied_lines:?}");
    assert!(applied_lines[0].starts_with("applied: orders upsert pk={\"id\": 1} event_id=evt_"), "{applied_lines:?}");
    assert_eq!(receiver.printed("duplicate skipped: ", 25).len(), 25);

    // A sender with the wrong key is refused, permanently.
    let error =
        poller_for(&receiver.url, &orders, directory.path(), "whsec_YS13cm9uZy1rZXktbG9uZy1lbm91Z2gtdG8tc2lnbg==")
            .tick()
            .await
            .unwrap_err();
    assert!(error.to_string().contains("HTTP 401") && error.to_string().contains("bad signature"), "{error}");
}

/// With `maxInFlight` 4, a slow receiver gets up to four batches at once; every row arrives once
/// and the checkpoint ends at the last row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_batches_in_flight_deliver_every_row_once() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=200, 1).await;
    let receiver = Receiver::start().await;
    receiver.set_delay(Duration::from_millis(100));
    let mut poller_json = AppRoot::orders_poller(10);
    poller_json["batch"]["maxInFlight"] = json!(4);
    let app = AppRoot::write(directory.path(), poller_json);
    let settings = Settings::from_pairs([
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_WEBHOOK".to_string(), receiver.url.clone()),
        ("ORDERS_STATE".to_string(), "file:unused".to_string()),
    ]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    let source = dbtrigger::source::open(&config.source).unwrap();
    let sink = dbtrigger::sink::open(&config.sink).unwrap();
    let store = Arc::new(MemoryStore::new());
    let poller = Poller::new(config, source, sink, store.clone(), Arc::new(SystemClock), "a".into());
    let outcome = poller.tick().await.unwrap();
    assert!(matches!(outcome, TickOutcome::Delivered { rows: 200, batches: 20, .. }), "{outcome:?}");
    assert_eq!(receiver.max_concurrent(), 4, "four batches in flight at once");
    let mut ids = receiver.acknowledged_ids();
    ids.sort_unstable();
    assert_eq!(ids, (1..=200).collect::<Vec<i64>>());
    let (_, writes) = store.request_counts();
    assert!(writes <= 21, "1 lease write and at most one commit per batch: {writes}");
    let document = dbtrigger::domain::StateDocument::parse(
        &store.raw(&dbtrigger::store::StateKey::new("local", "orders")).unwrap(),
    )
    .unwrap();
    assert_eq!(document.checkpoint.unwrap().cursor.tiebreaker["id"], json!(200));
    assert_eq!(document.lease.unwrap().owner_id, None);
}
