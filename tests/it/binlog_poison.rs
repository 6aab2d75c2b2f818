//! Poison isolation on the binary-log source (issue 39), through the real source on a real
//! MariaDB: a receiver refuses one change for good (422) in the middle of a transaction; the
//! isolation quarantines exactly that change (its op, table, old key and ordinal readable in the
//! entry), delivers every other change once, in commit order, and the checkpoint moves past all
//! of them. Under `poison.mode: stop` the poller holds at that change instead, the checkpoint
//! right before it, until the receiver takes it.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use dbtrigger::config::{PollerConfig, Settings};
use dbtrigger::domain::StateDocument;
use dbtrigger::operations::quarantine::{self as replay, QuarantineOutcome, QuarantineParts, Selection};
use dbtrigger::operations::{Operator, Parts};
use dbtrigger::source::binlog::{Key, key_of};
use dbtrigger::store::memory::MemoryStore;
use dbtrigger::store::{StateKey, quarantine};
use dbtrigger::tick::{Poller, StopReason, SystemClock, TickError, TickOutcome};
use serde_json::{Value, json};

use crate::binlog::binlog_database;
use crate::harness::AppRoot;

/// A change as the receiver names it: `op id` (the new row's id, else the old row's).
fn name(event: &Value) -> String {
    let row = &event["row"];
    let id = row["new"].get("id").or_else(|| row["old"].get("id")).and_then(Value::as_i64).unwrap();
    format!("{} {id}", event["op"].as_str().unwrap())
}

#[derive(Default)]
struct Receiving {
    /// Changes refused for good: a batch holding one is answered 422.
    refused: BTreeSet<String>,
    /// What was accepted, in arrival order: (transaction start, ordinal) and the change's name.
    accepted: Vec<((u64, u64), String)>,
}

async fn receive(State(receiving): State<Arc<Mutex<Receiving>>>, body: axum::body::Bytes) -> (StatusCode, String) {
    let envelope: Value = serde_json::from_slice(&body).unwrap();
    let events = envelope["events"].as_array().unwrap();
    let mut receiving = receiving.lock().unwrap();
    if let Some(bad) = events.iter().map(name).find(|change| receiving.refused.contains(change)) {
        return (StatusCode::UNPROCESSABLE_ENTITY, format!("{{\"error\": \"{bad}: this order cannot be cancelled\"}}"));
    }
    for event in events {
        let position = (event["cursor"].as_u64().unwrap(), event["pk"]["ordinal"].as_u64().unwrap());
        receiving.accepted.push((position, name(event)));
    }
    (StatusCode::OK, "{}".into())
}

/// The binary-log position a state document's checkpoint holds.
fn checkpoint_key(document: &StateDocument) -> Key {
    key_of(&document.position().unwrap().expect("a checkpoint")).unwrap()
}

/// A binary-log poller over three transactions of `orders` (the delete of 7, refused for good
/// by the receiver, in the middle of the second), batches of 8, with `poison` as its poison
/// section; its first tick has recorded where the log ended before they were written.
struct Feed {
    _directory: tempfile::TempDir,
    /// Every change, in commit order.
    expected: Vec<String>,
    receiving: Arc<Mutex<Receiving>>,
    store: Arc<MemoryStore>,
    config: PollerConfig,
    poller: Poller,
}

impl Feed {
    fn accepted(&self) -> Vec<((u64, u64), String)> {
        self.receiving.lock().unwrap().accepted.clone()
    }

    fn document(&self) -> StateDocument {
        StateDocument::parse(&self.store.raw(&StateKey::new("it", "orders")).unwrap()).unwrap()
    }

    /// Ticks until one says caught up (failed ticks allowed), at most `ticks`.
    async fn tick_until_caught_up(&self, ticks: usize) -> Vec<Result<TickOutcome, String>> {
        let mut outcomes = Vec::new();
        for _ in 0..ticks {
            let outcome = self.poller.tick().await.map_err(|error| error.to_string());
            let done = matches!(
                outcome,
                Ok(TickOutcome::Delivered { stop: StopReason::CaughtUp, .. }) | Ok(TickOutcome::Idle)
            );
            outcomes.push(outcome);
            if done {
                break;
            }
        }
        outcomes
    }
}

async fn feed(poison: Value) -> Feed {
    let (url, database) = binlog_database("CREATE TABLE orders (id BIGINT PRIMARY KEY, note TEXT)").await;
    let receiving =
        Arc::new(Mutex::new(Receiving { refused: BTreeSet::from(["delete 7".to_string()]), ..Receiving::default() }));
    let router = axum::Router::new().route("/hook", post(receive)).with_state(receiving.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });

    let directory = tempfile::tempdir().unwrap();
    let app = AppRoot::write(
        directory.path(),
        json!({
            "source": {"kind": "binlog", "connection": "FEED_DB", "tables": [format!("{database}.orders")]},
            "batch": {"size": 8},
            "sink": {"type": "webhook", "url": "%HOOK%", "maxRetries": 0, "timeoutSeconds": 2},
            "poison": poison,
            "state": {"connection": "STATE"}
        }),
    );
    let settings = Settings::from_pairs([
        ("FEED_DB".to_string(), url.clone()),
        ("HOOK".to_string(), hook),
        ("STATE".to_string(), "file:unused".to_string()),
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
    // The first tick records where the log ends: what follows is delivered.
    assert!(matches!(poller.tick().await, Ok(TickOutcome::Idle)));

    // Three transactions: the refused change (the delete of 7) sits in the middle of the second.
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    let mut expected = Vec::new();
    let mut first = pool.begin().await.unwrap();
    for id in 1..=10i64 {
        sqlx::query("INSERT INTO orders VALUES (?, 'new')").bind(id).execute(&mut *first).await.unwrap();
        expected.push(format!("insert {id}"));
    }
    first.commit().await.unwrap();
    let mut second = pool.begin().await.unwrap();
    for (sql, change) in [
        ("UPDATE orders SET note = 'paid' WHERE id = 5", "update 5"),
        ("UPDATE orders SET note = 'paid' WHERE id = 6", "update 6"),
        ("DELETE FROM orders WHERE id = 7", "delete 7"),
        ("DELETE FROM orders WHERE id = 8", "delete 8"),
        ("INSERT INTO orders VALUES (11, 'new')", "insert 11"),
    ] {
        sqlx::query(sql).execute(&mut *second).await.unwrap();
        expected.push(change.to_string());
    }
    second.commit().await.unwrap();
    let mut third = pool.begin().await.unwrap();
    for id in 12..=20i64 {
        sqlx::query("INSERT INTO orders VALUES (?, 'new')").bind(id).execute(&mut *third).await.unwrap();
        expected.push(format!("insert {id}"));
    }
    third.commit().await.unwrap();
    pool.close().await;
    Feed { _directory: directory, expected, receiving, store, config, poller }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_refused_for_good_is_quarantined_and_the_rest_arrive_in_commit_order() {
    let feed = feed(json!({"maxAttempts": 2})).await;
    let Feed { expected, receiving, store, config, poller, .. } = &feed;
    let outcomes = feed.tick_until_caught_up(10).await;
    assert!(
        outcomes.iter().any(|outcome| matches!(
            outcome,
            Ok(TickOutcome::Delivered { stop: StopReason::Isolated, quarantined: 1, .. })
        )),
        "{outcomes:?}"
    );
    assert!(matches!(poller.tick().await, Ok(TickOutcome::Idle)), "caught up: {outcomes:?}");

    // Every other change once, in commit order (positions only ever grow).
    let accepted = feed.accepted();
    let delivered: Vec<String> = accepted.iter().map(|(_, change)| change.clone()).collect();
    let others: Vec<String> = expected.iter().filter(|change| *change != "delete 7").cloned().collect();
    assert_eq!(delivered, others);
    assert!(accepted.windows(2).all(|pair| pair[0].0 < pair[1].0), "{accepted:?}");

    // Exactly the refused change is quarantined, readable as a change.
    let entries = quarantine::list(store.as_ref(), "it", "orders").await.unwrap();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let (entry, _) = &entries[0];
    assert_eq!(entry.status, Some(422));
    assert!(entry.error.contains("cannot be cancelled"), "{}", entry.error);
    assert_eq!(entry.event["op"], json!("delete"));
    assert!(entry.event["row"]["table"].as_str().unwrap().ends_with(".orders"), "{}", entry.event);
    assert_eq!(entry.event["row"]["old"]["id"], json!(7));
    assert_eq!(entry.event["row"]["new"], Value::Null);
    assert_eq!(entry.event["pk"]["ordinal"], json!(3), "the third change of its transaction");
    let second = accepted.iter().find(|(_, change)| change == "update 5").unwrap().0.0;
    assert_eq!(entry.event["cursor"], json!(second), "the second transaction's start");
    // The checkpoint moved past the last transaction.
    let (last, count) = accepted.last().unwrap().0;
    let checkpoint = checkpoint_key(&feed.document());
    assert!(
        (checkpoint.0.cursor() as u64, u64::from(checkpoint.1)) >= (last, count),
        "the checkpoint {checkpoint:?} is past every change delivered ({last}, {count})"
    );

    // Once the receiver takes it, a replay delivers the change as it was quarantined.
    receiving.lock().unwrap().refused.clear();
    let sink = dbtrigger::sink::open(&config.sink).unwrap();
    let parts = QuarantineParts { poller: Parts::of(poller), blobs: store.as_ref(), sink: sink.as_ref() };
    let operator = Operator { who: "ops@test", force: false, reason: None };
    let chosen = replay::choose(store.as_ref(), "it", "orders", &Selection::All).await.unwrap();
    let outcome = replay::replay(parts, &chosen.entries, operator, &mut |_| {}).await;
    assert!(matches!(outcome, QuarantineOutcome::Finished(_)), "{outcome:?}");
    let replayed = feed.accepted().last().cloned().unwrap();
    assert_eq!(replayed, ((second, 3), "delete 7".to_string()));
    assert!(quarantine::list(store.as_ref(), "it", "orders").await.unwrap().is_empty());
}

/// `poison.mode: stop` on a binary-log source: the poller holds at the refused change (the third
/// of its transaction), the changes before it in commit order delivered and committed, the
/// checkpoint right before it, nothing past it delivered or quarantined, the state document's
/// poison record on it; once the receiver takes it, the next tick delivers it and everything
/// after it, once each, in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_mode_stop_holds_at_the_refused_change_until_the_receiver_takes_it() {
    let feed = feed(json!({"mode": "stop"})).await;
    let mut outcomes = Vec::new();
    let error = loop {
        match feed.poller.tick().await {
            Err(error @ TickError::PoisonStop { .. }) => break error,
            outcome => outcomes.push(outcome.map_err(|error| error.to_string())),
        }
        assert!(outcomes.len() < 5, "the poller never stopped: {outcomes:?}");
    };
    assert!(
        error.to_string().contains("\"ordinal\":3") && error.to_string().contains("cannot be cancelled"),
        "{error}"
    );

    // The changes before it, in commit order, and nothing past it.
    let accepted = feed.accepted();
    let delivered: Vec<String> = accepted.iter().map(|(_, change)| change.clone()).collect();
    let refused_at = feed.expected.iter().position(|change| change == "delete 7").unwrap();
    assert_eq!(delivered, feed.expected[..refused_at], "{outcomes:?}");
    assert!(accepted.windows(2).all(|pair| pair[0].0 < pair[1].0), "{accepted:?}");
    let first_start = accepted[0].0.0;
    let (second_start, ordinal) = accepted.last().unwrap().0;
    assert!(
        second_start > first_start && ordinal == 2,
        "update 6 is the second of the second transaction: {accepted:?}"
    );
    assert!(quarantine::list(feed.store.as_ref(), "it", "orders").await.unwrap().is_empty());

    // Committed right before it; the poison record names it.
    let held = |document: StateDocument| {
        let key = checkpoint_key(&document);
        assert_eq!((key.0.cursor() as u64, key.1), (second_start, 2), "the checkpoint is right before it");
        let record = document.poison.expect("the poison record");
        assert_eq!((record.first.value, record.first.tiebreaker["ordinal"].clone()), (json!(second_start), json!(3)));
        assert!(record.last_error.contains("poison.mode is stop"), "{}", record.last_error);
        assert_eq!(document.stats.quarantined, 0);
        record.attempts
    };
    let attempts = held(feed.document());

    // It holds: the next tick stops at the same change, delivering nothing more.
    let again = feed.poller.tick().await;
    assert!(matches!(again, Err(TickError::PoisonStop { .. })), "{again:?}");
    assert_eq!(feed.accepted(), accepted);
    assert!(held(feed.document()) > attempts, "every tick that holds counts");

    // The receiver takes it: the refused change and everything after it, in commit order.
    feed.receiving.lock().unwrap().refused.clear();
    let outcome = feed.poller.tick().await;
    assert!(matches!(outcome, Ok(TickOutcome::Delivered { quarantined: 0, .. })), "{outcome:?}");
    let outcomes = feed.tick_until_caught_up(5).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    let accepted = feed.accepted();
    let delivered: Vec<String> = accepted.iter().map(|(_, change)| change.clone()).collect();
    assert_eq!(delivered, feed.expected, "each change once, in commit order");
    assert!(accepted.windows(2).all(|pair| pair[0].0 < pair[1].0), "{accepted:?}");
    assert_eq!(accepted[refused_at].0, (second_start, 3));
    let document = feed.document();
    assert!(document.poison.is_none(), "{:?}", document.poison);
    let last = accepted.last().unwrap().0;
    let checkpoint = checkpoint_key(&document);
    assert!((checkpoint.0.cursor() as u64, u64::from(checkpoint.1)) >= last, "{checkpoint:?} before {last:?}");
    assert!(quarantine::list(feed.store.as_ref(), "it", "orders").await.unwrap().is_empty());
}
