//! Poison batches (seed 001 case I): isolated, their failing rows quarantined, the rest delivered;
//! an outage never empties the feed into the quarantine; `poison.mode: stop` never skips a row.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::StateDocument;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::store::{StateKey, quarantine};
use dbtrigger::tick::{Poller, StopReason, SystemClock, TickError, TickOutcome};
use serde_json::{Value, json};

use crate::harness::{AppRoot, Orders, run_dbtrigger};

/// A receiver that refuses (422) any batch holding one of `poison`, answers 503 while `down`, and
/// records the ids of what it accepted.
#[derive(Default)]
struct Rules {
    poison: BTreeSet<i64>,
    down: bool,
    /// How long each answer takes.
    delay: std::time::Duration,
    accepted: Vec<i64>,
    requests: u64,
}

async fn receive(State(rules): State<Arc<Mutex<Rules>>>, body: axum::body::Bytes) -> (StatusCode, String) {
    let delay = rules.lock().unwrap().delay;
    tokio::time::sleep(delay).await;
    let envelope: Value = serde_json::from_slice(&body).unwrap();
    let ids: Vec<i64> =
        envelope["events"].as_array().unwrap().iter().map(|event| event["pk"]["id"].as_i64().unwrap()).collect();
    let mut rules = rules.lock().unwrap();
    rules.requests += 1;
    if rules.down {
        return (StatusCode::SERVICE_UNAVAILABLE, "down for maintenance".into());
    }
    if let Some(bad) = ids.iter().find(|id| rules.poison.contains(id)) {
        return (StatusCode::UNPROCESSABLE_ENTITY, format!("{{\"error\": \"order {bad} has no address\"}}"));
    }
    rules.accepted.extend(ids);
    (StatusCode::OK, "{}".into())
}

struct Setup {
    _directory: tempfile::TempDir,
    orders: Orders,
    rules: Arc<Mutex<Rules>>,
    store: Arc<MemoryStore>,
    poller: Poller,
}

async fn setup(rows: i64, size: usize, poison: Value) -> Setup {
    let rules = Arc::new(Mutex::new(Rules::default()));
    let router = axum::Router::new().route("/hook", post(receive)).with_state(rules.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });

    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=rows, 3).await;
    let mut poller_section = AppRoot::orders_poller(size);
    poller_section["sink"]["maxRetries"] = json!(0);
    poller_section["sink"]["timeoutSeconds"] = json!(2);
    poller_section["poison"] = poison;
    let app = AppRoot::write(directory.path(), poller_section);
    let settings = Settings::from_pairs([
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_WEBHOOK".to_string(), url),
        ("ORDERS_STATE".to_string(), "file:unused".to_string()),
        ("DBTRIGGER_APP_NAME".to_string(), "it".to_string()),
    ]);
    let config = PollerConfig::load(&app.root, "orders", &settings, None).unwrap();
    let store = Arc::new(MemoryStore::new());
    let poller = Poller::new(
        config.clone(),
        dbtrigger::source::open(&config.source).unwrap(),
        dbtrigger::sink::open(&config.sink).unwrap(),
        store.clone(),
        Arc::new(SystemClock),
        "a".into(),
    )
    .with_quarantine(store.clone());
    Setup { _directory: directory, orders, rules, store, poller }
}

fn document(store: &MemoryStore) -> StateDocument {
    StateDocument::parse(&store.raw(&StateKey::new("it", "orders")).unwrap()).unwrap()
}

/// Ticks until one says caught up (failed ticks allowed), at most `ticks`.
async fn tick_until_caught_up(poller: &Poller, ticks: usize) -> Vec<Result<TickOutcome, String>> {
    let mut outcomes = Vec::new();
    for _ in 0..ticks {
        let outcome = poller.tick().await.map_err(|error| error.to_string());
        let done =
            matches!(outcome, Ok(TickOutcome::Delivered { stop: StopReason::CaughtUp, .. }) | Ok(TickOutcome::Idle));
        outcomes.push(outcome);
        if done {
            return outcomes;
        }
    }
    panic!("not caught up after {ticks} ticks: {outcomes:?}");
}

/// Two rows of 2,000 refused for good: the other 1,998 arrive, the two are in the quarantine with
/// their events and the receiver's answer, and the checkpoint reaches the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_refused_for_good_are_quarantined_and_the_rest_delivered() {
    let setup = setup(2000, 500, json!({"maxAttempts": 5})).await;
    setup.rules.lock().unwrap().poison = BTreeSet::from([700, 1500]);
    let outcomes = tick_until_caught_up(&setup.poller, 10).await;
    assert!(
        outcomes.iter().any(|outcome| matches!(
            outcome,
            Ok(TickOutcome::Delivered { stop: StopReason::Isolated, quarantined: 1, .. })
        )),
        "{outcomes:?}"
    );

    let accepted: BTreeSet<i64> = setup.rules.lock().unwrap().accepted.iter().copied().collect();
    let expected: BTreeSet<i64> = (1..=2000).filter(|id| *id != 700 && *id != 1500).collect();
    assert_eq!(accepted, expected, "every other row arrived");

    let entries = quarantine::list(setup.store.as_ref(), "it", "orders").await.unwrap();
    let quarantined: Vec<i64> = entries.iter().map(|(entry, _)| entry.event["pk"]["id"].as_i64().unwrap()).collect();
    assert_eq!(quarantined.iter().copied().collect::<BTreeSet<i64>>(), BTreeSet::from([700, 1500]));
    for (entry, _) in &entries {
        assert_eq!(entry.status, Some(422));
        assert!(entry.error.contains("has no address"), "{}", entry.error);
        assert_eq!(entry.event["row"]["note"], json!(format!("order {}", entry.event["pk"]["id"])));
        assert!(entry.event["event_id"].as_str().unwrap().starts_with("evt_"));
    }

    let document = document(&setup.store);
    assert_eq!(document.checkpoint.unwrap().cursor.tiebreaker["id"], json!(2000), "the checkpoint reached the end");
    assert_eq!(document.stats.quarantined, 2);
    assert_eq!(document.poison, None, "cleared by the commit past the batch");
    assert_eq!(document.lease.unwrap().owner_id, None);
}

/// The receiver is down for more than maxAttempts ticks: isolation finds every part failing the
/// same transient way, quarantines nothing, and once it is back everything arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_longer_than_max_attempts_quarantines_nothing() {
    let setup = setup(300, 100, json!({"maxAttempts": 2})).await;
    setup.rules.lock().unwrap().down = true;
    for attempt in 1..=4u32 {
        let error = setup.poller.tick().await.unwrap_err();
        if attempt >= 2 {
            assert!(matches!(error, TickError::SinkDown { .. }), "attempt {attempt}: {error:?}");
        } else {
            assert!(matches!(error, TickError::Delivery { .. }), "attempt {attempt}: {error:?}");
        }
        let poison = document(&setup.store).poison.expect("the failures are counted");
        assert_eq!(poison.attempts, attempt);
        assert!(poison.last_error.contains("503"), "{}", poison.last_error);
    }
    let requests = setup.rules.lock().unwrap().requests;
    assert!(requests <= 1 + 3 * 3, "isolation stops at the first split when both halves fail: {requests} requests");
    assert!(quarantine::list(setup.store.as_ref(), "it", "orders").await.unwrap().is_empty(), "nothing quarantined");

    setup.rules.lock().unwrap().down = false;
    tick_until_caught_up(&setup.poller, 10).await;
    let accepted: BTreeSet<i64> = setup.rules.lock().unwrap().accepted.iter().copied().collect();
    assert_eq!(accepted, (1..=300).collect::<BTreeSet<i64>>());
    let document = document(&setup.store);
    assert_eq!((document.poison, document.stats.quarantined), (None, 0));
}

/// `poison.mode: stop`: the rows before the poison row are delivered, nothing after it, and the
/// tick fails naming the row; nothing is quarantined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_mode_stop_holds_at_the_row_and_names_it() {
    let setup = setup(50, 50, json!({"mode": "stop"})).await;
    setup.rules.lock().unwrap().poison = BTreeSet::from([20]);
    let error = setup.poller.tick().await.unwrap_err();
    assert!(matches!(error, TickError::PoisonStop { .. }), "{error:?}");
    assert!(error.to_string().contains("{\"id\":20}"), "{error}");
    let accepted = setup.rules.lock().unwrap().accepted.clone();
    assert_eq!(accepted, (1..=19).collect::<Vec<i64>>(), "in order, and nothing past the poison row");
    let document = document(&setup.store);
    assert_eq!(document.checkpoint.unwrap().cursor.tiebreaker["id"], json!(19));
    assert!(quarantine::list(setup.store.as_ref(), "it", "orders").await.unwrap().is_empty());
    // It holds: the next tick stops at the same row.
    assert!(matches!(setup.poller.tick().await.unwrap_err(), TickError::PoisonStop { .. }));
    drop(setup.orders);
}

/// Through the real binary and the file store: two rows of 2,000 refused for good end in the quarantine,
/// `quarantine list --json` shows them, a replay refuses without a terminal or --yes and changes
/// nothing on --dry-run, and `replay --all --yes` delivers them once the receiver takes them,
/// empties the quarantine and leaves a line in the history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quarantined_rows_are_listed_and_replayed_from_the_command_line() {
    let rules = Arc::new(Mutex::new(Rules { poison: BTreeSet::from([700, 1500]), ..Rules::default() }));
    let router = axum::Router::new().route("/hook", post(receive)).with_state(rules.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=2000, 3).await;
    let mut poller_section = AppRoot::orders_poller(500);
    poller_section["sink"]["maxRetries"] = json!(0);
    let app = AppRoot::write(directory.path(), poller_section);
    let settings = vec![
        ("ORDERS_DB".to_string(), orders.url()),
        ("ORDERS_WEBHOOK".to_string(), url),
        ("ORDERS_STATE".to_string(), format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME".to_string(), app.app_name.clone()),
    ];

    for _ in 0..10 {
        let (_, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
        if stdout.contains("caught up") {
            break;
        }
    }
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["quarantine", "list", "orders", "--json"]);
    assert!(ok, "{stderr}");
    let listed: Value = serde_json::from_str(&stdout).unwrap_or_else(|_| panic!("pure JSON on stdout: {stdout}"));
    let ids: BTreeSet<i64> =
        listed.as_array().unwrap().iter().map(|entry| entry["pk"]["id"].as_i64().unwrap()).collect();
    assert_eq!(ids, BTreeSet::from([700, 1500]));
    let accepted: BTreeSet<i64> = rules.lock().unwrap().accepted.iter().copied().collect();
    assert_eq!(accepted.len(), 1998, "the other 1,998 arrived");
    let document = app.state_document().await.unwrap();
    assert_eq!(document["checkpoint"]["cursor"]["tiebreaker"]["id"], 2000, "the checkpoint reached the end");
    assert_eq!(listed[0]["status"], 422);

    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["quarantine", "replay", "orders", "--all"]);
    assert!(!ok && stderr.contains("not a terminal"), "{stderr}");
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["quarantine", "replay", "orders", "--all", "--dry-run"]);
    assert!(ok && stdout.contains("dry run"), "{stdout}");
    assert_eq!(run_dbtrigger(&app, &settings, &["quarantine", "list", "orders", "--json"]).1, stdout_of_list(&listed));

    rules.lock().unwrap().poison.clear();
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["quarantine", "replay", "orders", "--all", "--yes"]);
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains("replayed 2 rows, 0 kept"), "{stdout}");
    let accepted: BTreeSet<i64> = rules.lock().unwrap().accepted.iter().copied().collect();
    assert_eq!(accepted, (1..=2000).collect::<BTreeSet<i64>>(), "every row arrived in the end");
    let (_, stdout, _) = run_dbtrigger(&app, &settings, &["quarantine", "list", "orders", "--json"]);
    assert_eq!(serde_json::from_str::<Value>(&stdout).unwrap(), json!([]));
    let document = app.state_document().await.unwrap();
    let history = document["history"].as_array().unwrap();
    assert!(
        history.last().unwrap()["what"].as_str().unwrap().starts_with("replayed 2 quarantined rows"),
        "{history:?}"
    );
}

fn stdout_of_list(listed: &Value) -> String {
    format!("{}\n", serde_json::to_string_pretty(listed).unwrap())
}

/// Isolation that runs out of tick budget concludes nothing: a part that failed for lack of time
/// says nothing about its rows, so nothing is quarantined and the next tick starts over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolation_out_of_time_quarantines_nothing() {
    let setup = setup(10, 10, json!({"maxAttempts": 5})).await;
    {
        let mut rules = setup.rules.lock().unwrap();
        rules.poison = BTreeSet::from([5]);
        rules.delay = std::time::Duration::from_millis(900);
    }
    let mut config = setup.poller.config.clone();
    config.batch.tick_budget = std::time::Duration::from_secs(2);
    let poller = Poller::new(
        config.clone(),
        dbtrigger::source::open(&config.source).unwrap(),
        dbtrigger::sink::open(&config.sink).unwrap(),
        setup.store.clone(),
        Arc::new(SystemClock),
        "a".into(),
    )
    .with_quarantine(setup.store.clone());
    let error = poller.tick().await.unwrap_err();
    assert!(matches!(error, TickError::Delivery { .. }), "{error:?}");
    assert!(quarantine::list(setup.store.as_ref(), "it", "orders").await.unwrap().is_empty(), "nothing quarantined");
    assert_eq!(document(&setup.store).poison.unwrap().attempts, 1);

    setup.rules.lock().unwrap().delay = std::time::Duration::ZERO;
    tick_until_caught_up(&poller, 5).await;
    let entries = quarantine::list(setup.store.as_ref(), "it", "orders").await.unwrap();
    assert_eq!(entries.len(), 1, "with time, the one poison row is found");
    assert_eq!(entries[0].0.event["pk"]["id"], 5);
}
