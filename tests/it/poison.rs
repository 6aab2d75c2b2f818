//! Poison batches (seed 001 case I): isolated, their failing rows quarantined, the rest delivered;
//! an outage never empties the feed into the quarantine; `poison.mode: stop` never skips a row.
//! Isolation holds the lease as delivery does, goes on across ticks, and starts for a batch refused
//! anywhere in the window once the batches before it are settled.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::StateDocument;
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::store::{StateKey, quarantine};
use dbtrigger::tick::{Clock, ManualClock, Poller, StopReason, SystemClock, TickError, TickOutcome};
use serde_json::{Value, json};

use crate::harness::{AppRoot, Orders, run_dbtrigger};

/// A receiver that refuses (422) any batch holding one of `poison`, answers 503 while `down`, and
/// records the ids of what it accepted.
#[derive(Default)]
struct Rules {
    poison: BTreeSet<i64>,
    down: bool,
    /// How long each answer takes.
    delay: Duration,
    /// A batch holding one of these takes `slow_delay` more.
    slow: BTreeSet<i64>,
    slow_delay: Duration,
    /// A batch holding one of these is answered 503.
    flaky: BTreeSet<i64>,
    /// From this request on (numbered from 1), every answer is 503: an outage that begins mid-way.
    down_from_request: Option<u64>,
    /// From this request on, every answer is 401: a token rotated mid-way (issue 36).
    unauthorized_from_request: Option<u64>,
    /// The status a batch holding a poison row is refused with (422 unless set).
    poison_status: Option<u16>,
    /// Answers 409 to a fencing token below the highest it has seen, as fencing receivers do.
    fencing: bool,
    highest_token: u64,
    accepted: Vec<i64>,
    /// The fencing token of each row accepted, in `accepted`'s order.
    accepted_tokens: Vec<u64>,
    requests: u64,
    /// The rows of each request, in arrival order.
    sizes: Vec<usize>,
}

async fn receive(State(rules): State<Arc<Mutex<Rules>>>, body: axum::body::Bytes) -> (StatusCode, String) {
    let envelope: Value = serde_json::from_slice(&body).unwrap();
    let ids: Vec<i64> =
        envelope["events"].as_array().unwrap().iter().map(|event| event["pk"]["id"].as_i64().unwrap()).collect();
    let token = envelope["fencing_token"].as_u64().unwrap();
    let delay = {
        let rules = rules.lock().unwrap();
        let slow = ids.iter().any(|id| rules.slow.contains(id));
        rules.delay + if slow { rules.slow_delay } else { Duration::ZERO }
    };
    tokio::time::sleep(delay).await;
    let mut rules = rules.lock().unwrap();
    rules.requests += 1;
    rules.sizes.push(ids.len());
    let outage = rules.down_from_request.is_some_and(|first| rules.requests >= first);
    if rules.down || outage || ids.iter().any(|id| rules.flaky.contains(id)) {
        return (StatusCode::SERVICE_UNAVAILABLE, "down for maintenance".into());
    }
    if rules.unauthorized_from_request.is_some_and(|first| rules.requests >= first) {
        return (StatusCode::UNAUTHORIZED, "{\"error\": \"token expired\"}".into());
    }
    if rules.fencing {
        if token < rules.highest_token {
            return (StatusCode::CONFLICT, format!("{{\"error\": \"token {token} is stale\"}}"));
        }
        rules.highest_token = token;
    }
    if let Some(bad) = ids.iter().find(|id| rules.poison.contains(id)) {
        let status = StatusCode::from_u16(rules.poison_status.unwrap_or(422)).unwrap();
        return (status, format!("{{\"error\": \"order {bad} has no address\"}}"));
    }
    rules.accepted.extend(&ids);
    rules.accepted_tokens.extend(ids.iter().map(|_| token));
    (StatusCode::OK, "{}".into())
}

struct Setup {
    _directory: tempfile::TempDir,
    orders: Orders,
    rules: Arc<Mutex<Rules>>,
    store: Arc<MemoryStore>,
    config: PollerConfig,
    poller: Poller,
}

impl Setup {
    /// Another poller over the same table, receiver and store: another instance, on its own clock.
    fn instance(&self, owner: &str, clock: Arc<dyn Clock>) -> Poller {
        Poller::new(
            self.config.clone(),
            dbtrigger::source::open(&self.config.source).unwrap(),
            dbtrigger::sink::open(&self.config.sink).unwrap(),
            self.store.clone(),
            clock,
            owner.into(),
        )
        .with_quarantine(self.store.clone())
    }

    fn accepted(&self) -> BTreeSet<i64> {
        self.rules.lock().unwrap().accepted.iter().copied().collect()
    }

    async fn quarantined(&self) -> BTreeSet<i64> {
        let entries = quarantine::list(self.store.as_ref(), "it", "orders").await.unwrap();
        entries.iter().map(|(entry, _)| entry.event["pk"]["id"].as_i64().unwrap()).collect()
    }
}

async fn setup(rows: i64, size: usize, poison: Value) -> Setup {
    setup_with(rows, size, |section| section["poison"] = poison).await
}

/// `rows` orders, batches of `size`, the poller section changed by `change`.
async fn setup_with(rows: i64, size: usize, change: impl FnOnce(&mut Value)) -> Setup {
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
    change(&mut poller_section);
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
    Setup { _directory: directory, orders, rules, store, config, poller }
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

/// Isolation that runs out of tick budget concludes nothing about the part cut short (a part
/// failing for lack of time says nothing about its rows): nothing is quarantined for it, the parts
/// still to try are kept in the poison record, and the next tick goes on from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolation_out_of_time_quarantines_nothing() {
    let setup = setup_with(10, 10, |section| section["batch"]["tickBudgetSeconds"] = json!(2)).await;
    {
        let mut rules = setup.rules.lock().unwrap();
        rules.poison = BTreeSet::from([5]);
        rules.delay = Duration::from_millis(900);
    }
    let error = setup.poller.tick().await.unwrap_err();
    assert!(matches!(error, TickError::IsolationUnfinished { settled: 0, rows: 10, attempts: 1 }), "{error:?}");
    assert!(setup.quarantined().await.is_empty(), "nothing quarantined");
    let poison = document(&setup.store).poison.unwrap();
    assert_eq!(poison.attempts, 1);
    assert!(poison.last_error.contains("tick budget ran out"), "{}", poison.last_error);
    let parts = poison.isolating.unwrap().parts;
    assert_eq!(parts.iter().sum::<usize>(), 10, "the parts still to try cover the batch: {parts:?}");
    assert!(parts.len() >= 2, "the split made is kept: {parts:?}");

    setup.rules.lock().unwrap().delay = Duration::ZERO;
    tick_until_caught_up(&setup.poller, 5).await;
    assert_eq!(setup.quarantined().await, BTreeSet::from([5]), "with time, the one poison row is found");
    assert_eq!(setup.accepted(), (1..=10).filter(|id| *id != 5).collect());
}

/// Regression (issue 24, item 1): a batch refused for good while the batch at the checkpoint is
/// still in flight (maxInFlight > 1) failed the tick with nothing recorded, and every tick did the
/// same. Now the batches before it are waited for and committed, and then it is isolated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_batch_behind_a_slow_batch_is_isolated() {
    let setup = setup_with(40, 10, |section| section["batch"]["maxInFlight"] = json!(4)).await;
    {
        let mut rules = setup.rules.lock().unwrap();
        rules.poison = BTreeSet::from([25]);
        rules.slow = (1..=10).collect();
        rules.slow_delay = Duration::from_millis(600);
    }
    let outcomes = tick_until_caught_up(&setup.poller, 3).await;
    assert!(
        matches!(outcomes[0], Ok(TickOutcome::Delivered { stop: StopReason::Isolated, quarantined: 1, .. })),
        "the first tick isolates the refused batch: {outcomes:?}"
    );
    assert_eq!(setup.quarantined().await, BTreeSet::from([25]));
    assert_eq!(setup.accepted(), (1..=40).filter(|id| *id != 25).collect());
    let document = document(&setup.store);
    assert_eq!(document.checkpoint.unwrap().cursor.tiebreaker["id"], json!(40));
    assert_eq!((document.poison, document.stats.quarantined), (None, 1));
}

/// Regression (issue 24, item 1): when a later batch is refused for good and an earlier one then
/// fails too, the earliest failure is the one at the checkpoint: counted on that batch, and the
/// later refusal waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_earliest_failure_in_the_window_is_the_one_counted() {
    let setup = setup_with(40, 10, |section| section["batch"]["maxInFlight"] = json!(4)).await;
    {
        let mut rules = setup.rules.lock().unwrap();
        rules.poison = BTreeSet::from([25]);
        rules.slow = (1..=10).collect();
        rules.slow_delay = Duration::from_millis(500);
        rules.flaky = (1..=10).collect();
    }
    let error = setup.poller.tick().await.unwrap_err();
    assert!(matches!(error, TickError::Delivery { rows_committed: 0, .. }), "{error:?}");
    let document = document(&setup.store);
    assert!(document.checkpoint.is_none());
    let poison = document.poison.expect("the failure is counted");
    assert_eq!((poison.attempts, &poison.first.tiebreaker["id"]), (1, &json!(1)), "on the first batch");
    assert!(poison.last_error.contains("503"), "{}", poison.last_error);
    assert!(setup.quarantined().await.is_empty());

    setup.rules.lock().unwrap().flaky.clear();
    tick_until_caught_up(&setup.poller, 4).await;
    assert_eq!(setup.quarantined().await, BTreeSet::from([25]));
    assert_eq!(setup.accepted(), (1..=40).filter(|id| *id != 25).collect());
}

/// Regression (issue 24, item 2): isolation wrote nothing while it ran, so an isolation longer
/// than the lease let another instance take over. Parts longer than the heartbeat interval (1.2 s
/// each on a 3 s lease renewed every second) now renew the lease while they run: a rival ticking
/// all along never gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolation_renews_the_lease_while_a_slow_part_runs() {
    let setup = setup_with(3, 3, |section| {
        section["lease"] = json!({"ttlSeconds": 3, "heartbeatSeconds": 1, "clockSkewSeconds": 1});
    })
    .await;
    {
        let mut rules = setup.rules.lock().unwrap();
        rules.poison = BTreeSet::from([2]);
        rules.delay = Duration::from_millis(1200);
    }
    let rival = setup.instance("b", Arc::new(SystemClock));
    let isolating = setup.poller.tick();
    tokio::pin!(isolating);
    let mut rival_outcomes = Vec::new();
    let outcome = loop {
        tokio::select! {
            outcome = &mut isolating => break outcome,
            _ = tokio::time::sleep(Duration::from_millis(200)) => rival_outcomes.push(rival.tick().await),
        }
    };
    assert!(
        matches!(outcome, Ok(TickOutcome::Delivered { stop: StopReason::Isolated, quarantined: 1, .. })),
        "{outcome:?}"
    );
    assert!(rival_outcomes.len() >= 15, "the rival kept trying: {}", rival_outcomes.len());
    for rival_outcome in &rival_outcomes {
        assert!(
            matches!(rival_outcome, Ok(TickOutcome::LeaseHeld { owner_id, .. }) if owner_id == "a"),
            "{rival_outcomes:?}"
        );
    }
    assert_eq!(setup.accepted(), BTreeSet::from([1, 3]));
    assert_eq!(setup.quarantined().await, BTreeSet::from([2]));
}

/// Regression (issue 24, item 2): a stale isolation (its lease taken over) went on sending, and
/// wrote to the quarantine the rows a fencing receiver refused it (409) although the new owner had
/// delivered them. A quarantine entry is now written only under a lease just renewed by CAS: every
/// entry is a poison row, kept by the new owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_isolation_never_quarantines_rows_a_newer_owner_delivered() {
    let setup = setup_with(20, 20, |section| {
        section["lease"] = json!({"ttlSeconds": 3, "heartbeatSeconds": 1, "clockSkewSeconds": 1});
    })
    .await;
    {
        let mut rules = setup.rules.lock().unwrap();
        rules.poison = BTreeSet::from([5, 15]);
        rules.delay = Duration::from_millis(100);
        rules.fencing = true;
    }
    let poller = Arc::new(setup.instance("a", Arc::new(SystemClock)));
    let stale = tokio::spawn({
        let poller = poller.clone();
        async move { poller.tick().await }
    });
    // Once a is isolating, b, whose clock is ten minutes ahead, finds a's lease expired and takes
    // over with the next fencing token.
    while setup.rules.lock().unwrap().requests < 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ahead = chrono::Utc::now() + chrono::Duration::minutes(10);
    let newer = setup.instance("b", Arc::new(ManualClock::at(ahead)));
    let mut caught_up = false;
    for _ in 0..10 {
        if matches!(
            newer.tick().await,
            Ok(TickOutcome::Idle | TickOutcome::Delivered { stop: StopReason::CaughtUp, .. })
        ) {
            caught_up = true;
            break;
        }
    }
    assert!(caught_up, "the new owner delivers everything");
    let stale_outcome = stale.await.unwrap();
    assert!(
        matches!(stale_outcome, Ok(TickOutcome::LeaseLost { .. }) | Err(TickError::NoProgress { .. })),
        "{stale_outcome:?}"
    );

    let entries = quarantine::list(setup.store.as_ref(), "it", "orders").await.unwrap();
    let newer_token = document(&setup.store).lease.unwrap().fencing_token;
    for (entry, _) in &entries {
        let id = entry.event["pk"]["id"].as_i64().unwrap();
        assert!(id == 5 || id == 15, "row {id} quarantined although it was delivered: {entry:?}");
        assert_eq!(entry.fencing_token, newer_token, "kept by the new owner");
    }
    assert_eq!(setup.quarantined().await, BTreeSet::from([5, 15]));
    let rules = setup.rules.lock().unwrap();
    let delivered_by_newer: BTreeSet<i64> = rules
        .accepted
        .iter()
        .zip(&rules.accepted_tokens)
        .filter(|(_, token)| **token == newer_token)
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(delivered_by_newer, (1..=20).filter(|id| *id != 5 && *id != 15).collect());
}

/// Regression (issue 24, item 3): an isolation that could not finish in one tick started over
/// every tick and never ended. Ten bad rows among a hundred, a receiver that stays slow (40 ms a
/// request) and a one-second budget: each tick commits what it settled and the next goes on, so
/// the poller gets past the batch in a few ticks, each good row delivered about once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolation_longer_than_a_tick_goes_on_across_ticks() {
    let setup = setup_with(100, 100, |section| section["batch"]["tickBudgetSeconds"] = json!(1)).await;
    let bad: BTreeSet<i64> = (0..10).map(|tenth| tenth * 10 + 5).collect();
    {
        let mut rules = setup.rules.lock().unwrap();
        rules.poison = bad.clone();
        rules.delay = Duration::from_millis(40);
    }
    let outcomes = tick_until_caught_up(&setup.poller, 12).await;
    let unfinished = outcomes
        .iter()
        .filter(|outcome| matches!(outcome, Err(error) if error.contains("tick budget ran out")))
        .count();
    assert!(unfinished >= 1, "the isolation outlasted a tick: {outcomes:?}");
    assert_eq!(setup.quarantined().await, bad);
    let good: BTreeSet<i64> = (1..=100).filter(|id| !bad.contains(id)).collect();
    assert_eq!(setup.accepted(), good);
    let accepted = setup.rules.lock().unwrap().accepted.len();
    // A part cut by the end of a tick may have landed: at most one part a tick is sent twice.
    assert!(accepted <= good.len() + 13 * outcomes.len(), "{accepted} rows accepted for {} good ones", good.len());
    // The next tick goes straight on with the parts left, instead of sending the rest whole.
    let sizes = setup.rules.lock().unwrap().sizes.clone();
    assert_eq!(sizes[0], 100, "the batch");
    assert!(sizes[1..].iter().all(|size| *size <= 50), "no part beyond the first split: {sizes:?}");
    let document = document(&setup.store);
    assert_eq!(document.checkpoint.unwrap().cursor.tiebreaker["id"], json!(100));
    assert_eq!((document.poison, document.stats.quarantined), (None, 10));
}

/// Regression (issue 24, item 3): in stop mode, the rows delivered before the budget ran out were
/// not committed. They are now, and the next ticks go on to the poison row and hold there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_mode_commits_the_rows_delivered_before_the_budget_ran_out() {
    let setup = setup_with(30, 30, |section| {
        section["poison"] = json!({"mode": "stop"});
        section["batch"]["tickBudgetSeconds"] = json!(1);
    })
    .await;
    {
        let mut rules = setup.rules.lock().unwrap();
        rules.poison = BTreeSet::from([25]);
        rules.delay = Duration::from_millis(300);
    }
    // The batch fails after 0.3 s, rows 1-15 get through by 0.6 s, rows 16-30 are refused by
    // 0.9 s, and the next part is cut by the end of the budget.
    let error = setup.poller.tick().await.unwrap_err();
    let TickError::IsolationUnfinished { settled, rows: 30, attempts: 1 } = error else {
        panic!("{error:?}");
    };
    assert!(settled > 0 && settled < 24, "{settled} rows settled");
    let document_after = document(&setup.store);
    let committed = document_after.checkpoint.expect("what was delivered is committed");
    assert_eq!(committed.cursor.tiebreaker["id"], json!(settled), "rows 1 to {settled} committed");
    assert_eq!(document_after.poison.unwrap().attempts, 1);

    let mut last = None;
    for _ in 0..8 {
        let result = setup.poller.tick().await;
        if matches!(result, Err(TickError::PoisonStop { .. })) {
            last = Some(result);
            break;
        }
    }
    let error = last.expect("the poller reaches the poison row and holds").unwrap_err();
    assert!(error.to_string().contains("{\"id\":25}"), "{error}");
    let document = document(&setup.store);
    assert_eq!(document.checkpoint.unwrap().cursor.tiebreaker["id"], json!(24));
    assert!(document.poison.unwrap().attempts >= 2, "every tick that holds counts");
    assert!(setup.quarantined().await.is_empty());
    assert_eq!(setup.accepted(), (1..=24).collect(), "nothing past the poison row");
}

/// Regression (issue 24, item 4): an outage beginning after the first split had single rows fail
/// with 503 and quarantined them. A transient failure now stops the isolation for the tick (what
/// was settled committed, the failure counted); once the receiver is back, only the row refused
/// for good alone is quarantined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_that_begins_mid_isolation_quarantines_no_good_row() {
    let setup = setup(40, 40, json!({"maxAttempts": 5})).await;
    {
        let mut rules = setup.rules.lock().unwrap();
        rules.poison = BTreeSet::from([5]);
        // The batch, then halves down to rows 1-2, which get through; from the sixth request on,
        // 503.
        rules.down_from_request = Some(6);
    }
    let error = setup.poller.tick().await.unwrap_err();
    assert!(matches!(error, TickError::SinkDown { settled: 2, .. }), "{error:?}");
    assert!(error.to_string().contains("looks down or flaky"), "{error}");
    assert_eq!(setup.rules.lock().unwrap().requests, 7, "two transient failures in a row stop it");
    assert!(setup.quarantined().await.is_empty(), "no row quarantined for a 503");
    let held = document(&setup.store);
    assert_eq!(held.checkpoint.unwrap().cursor.tiebreaker["id"], json!(2), "rows 1 and 2 committed");
    let poison = held.poison.unwrap();
    assert_eq!(poison.attempts, 1);
    assert!(poison.last_error.contains("503"), "{}", poison.last_error);

    setup.rules.lock().unwrap().down_from_request = None;
    tick_until_caught_up(&setup.poller, 4).await;
    assert_eq!(setup.quarantined().await, BTreeSet::from([5]));
    assert_eq!(setup.accepted(), (1..=40).filter(|id| *id != 5).collect());
}

/// Regression (issue 36, item 1): the receiver's token is rotated while a poison row is being
/// isolated: every part after it is refused with 401. The isolation stops there (what was delivered
/// before is committed), no good row is quarantined for the 401s, the poller holds and says the
/// endpoint refuses; once the token is fixed, only the poison row (refused alone with 413, a row
/// too big for the receiver: about the row, not the endpoint) is quarantined and every other row
/// arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_rotated_mid_isolation_quarantines_no_good_row() {
    let setup = setup(40, 40, json!({"maxAttempts": 5})).await;
    {
        let mut rules = setup.rules.lock().unwrap();
        rules.poison = BTreeSet::from([5]);
        rules.poison_status = Some(413);
        // The batch, then halves down to rows 1-2, which get through; from the sixth request on,
        // 401.
        rules.unauthorized_from_request = Some(6);
    }
    let error = setup.poller.tick().await.unwrap_err();
    assert!(matches!(error, TickError::EndpointRefused { status: 401, attempts: 1, .. }), "{error:?}");
    assert_eq!(setup.rules.lock().unwrap().requests, 6, "the first 401 stops the isolation");
    assert!(setup.quarantined().await.is_empty(), "no row quarantined for a 401");
    let held = document(&setup.store);
    assert_eq!(held.checkpoint.unwrap().cursor.tiebreaker["id"], json!(2), "rows 1 and 2 committed");
    let poison = held.poison.unwrap();
    assert_eq!((poison.attempts, poison.endpoint_refused), (1, Some(401)));
    assert!(poison.isolating.is_some(), "the parts still to try are kept");

    // Still rotated: one request a tick, nothing quarantined.
    let requests = setup.rules.lock().unwrap().requests;
    assert!(matches!(setup.poller.tick().await.unwrap_err(), TickError::EndpointRefused { status: 401, .. }));
    assert_eq!(setup.rules.lock().unwrap().requests, requests + 1);
    assert!(setup.quarantined().await.is_empty());

    setup.rules.lock().unwrap().unauthorized_from_request = None;
    tick_until_caught_up(&setup.poller, 4).await;
    let entries = quarantine::list(setup.store.as_ref(), "it", "orders").await.unwrap();
    assert_eq!(setup.quarantined().await, BTreeSet::from([5]));
    assert_eq!(entries[0].0.status, Some(413), "a row too big alone is the row's, and quarantined");
    assert_eq!(setup.accepted(), (1..=40).filter(|id| *id != 5).collect());
    assert_eq!(document(&setup.store).poison, None);
}

/// Regression (issue 35): an isolation part ran as a detached task, so a tick dropped at an await
/// (the host's request gone, an abandoned tick, a crash the simulation plays) left the part
/// sending: a delivery from a tick that no longer existed, after its lease could have been given
/// back. The part now goes with its tick: the receiver, 2 s a request, finishes the first batch
/// (refused: row 2) and never the part in flight when the tick is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_tick_leaves_no_isolation_part_sending() {
    let setup = setup_with(4, 4, |section| section["sink"]["timeoutSeconds"] = json!(10)).await;
    {
        let mut rules = setup.rules.lock().unwrap();
        rules.poison = BTreeSet::from([2]);
        rules.delay = Duration::from_secs(2);
    }
    // The batch is refused at 2 s; the first part (rows 1-2) is sent then, to be answered at 4 s.
    let dropped = tokio::time::timeout(Duration::from_secs(3), setup.poller.tick()).await;
    assert!(dropped.is_err(), "the tick was still isolating at 3 s: {dropped:?}");
    assert_eq!(setup.rules.lock().unwrap().requests, 1, "the first batch was answered");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rules = setup.rules.lock().unwrap();
    assert_eq!(rules.requests, 1, "no part of the dropped tick was answered after it: {:?}", rules.sizes);
    assert!(rules.accepted.is_empty(), "{:?}", rules.accepted);
}
