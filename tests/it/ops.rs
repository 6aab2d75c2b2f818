//! Operator commands on the state document, through the real binary, with the state in the file
//! store and in Azurite: inspect, reset (guarded: confirmation, dry run, live lease, CAS, history),
//! clone, fingerprint accept.

use serde_json::{Value, json};

use crate::harness::{AppRoot, Orders, Receiver, run_dbtrigger};

async fn state(app: &AppRoot, poller: &str) -> Value {
    serde_json::from_slice(&app.state_bytes(poller).await.expect("a state document")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_reset_clone_and_accept_with_guardrails_on_the_file_store() {
    operators_reset_clone_and_accept_with_guardrails(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_reset_clone_and_accept_with_guardrails_on_azurite() {
    operators_reset_clone_and_accept_with_guardrails(Some(crate::services::azurite().connection_string())).await;
}

async fn operators_reset_clone_and_accept_with_guardrails(azure_state: Option<String>) {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=10, 1).await;
    let receiver = Receiver::start().await;
    let mut app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    if let Some(connection_string) = &azure_state {
        app = app.with_azure_state(connection_string);
    }
    let settings = app.settings(&orders, &receiver);
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    assert_eq!(receiver.acknowledged_ids(), (1..=10).collect::<Vec<i64>>());

    // inspect: the whole document, pure JSON on stdout.
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["inspect", "orders"]);
    let inspected: Value = serde_json::from_str(&stdout).unwrap_or_else(|_| panic!("{stdout}"));
    assert!(ok);
    assert_eq!(inspected["checkpoint"]["cursor"]["tiebreaker"]["id"], 10);

    // Guardrails: no terminal and no --yes refuses; --dry-run writes nothing.
    let before = app.state_bytes("orders").await.unwrap();
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["reset", "orders", "--to-beginning"]);
    assert!(!ok && stderr.contains("not a terminal"), "{stderr}");
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["reset", "orders", "--to-beginning", "--dry-run"]);
    assert!(ok && stdout.contains("before:") && stdout.contains("dry run"), "{stdout}");
    assert_eq!(app.state_bytes("orders").await.unwrap(), before, "nothing written: byte for byte");

    // A tick holding the lease: refused, unless forced (which clears the holder's lease).
    let mut busy = state(&app, "orders").await;
    let now = chrono::Utc::now();
    busy["lease"] = json!({"owner_id": "busy/1", "fencing_token": 99, "acquired_at": now,
                           "heartbeat_at": now, "expires_at": now + chrono::Duration::seconds(60)});
    app.put_state_document("orders", &busy).await;
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["reset", "orders", "--to-beginning", "--yes"]);
    assert!(!ok && stderr.contains("busy/1") && stderr.contains("--force"), "{stderr}");
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["reset", "orders", "--to-beginning", "--yes", "--force"]);
    assert!(ok, "{stderr}");
    let reset = state(&app, "orders").await;
    assert_eq!(reset["checkpoint"], Value::Null);
    assert_eq!(reset["lease"]["owner_id"], Value::Null);
    assert_eq!(reset["lease"]["fencing_token"], 100, "a new token: the displaced holder's deliveries are stale");
    let entry = reset["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!((entry["what"].as_str(), entry["forced"].as_bool()), (Some("reset to the beginning"), Some(true)));
    assert_eq!(entry["previous_checkpoint"]["tiebreaker"]["id"], 10);
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    assert_eq!(receiver.acknowledged_ids().len(), 20, "everything again after the reset");

    // Reset after a cursor and key: the rows after it come again.
    let (ok, _, stderr) =
        run_dbtrigger(&app, &settings, &["reset", "orders", "--to-cursor", "5", "--pk", "id=5", "--yes"]);
    assert!(ok, "{stderr}");
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    assert_eq!(receiver.acknowledged_ids()[20..], [6, 7, 8, 9, 10]);
    let (ok, _, stderr) =
        run_dbtrigger(&app, &settings, &["reset", "orders", "--to-cursor", "5", "--pk", "code=5", "--yes"]);
    assert!(!ok && stderr.contains("id=VALUE"), "a position needs the poller's key columns: {stderr}");

    // Clone: a backfill on a separate name, from the beginning; never over an existing document.
    let (ok, _, stderr) =
        run_dbtrigger(&app, &settings, &["clone", "orders", "orders_backfill", "--from-beginning", "--yes"]);
    assert!(ok, "{stderr}");
    let cloned = state(&app, "orders_backfill").await;
    assert_eq!((cloned["poller_name"].as_str(), &cloned["checkpoint"]), (Some("orders_backfill"), &Value::Null));
    assert!(cloned["history"][0]["what"].as_str().unwrap().starts_with("cloned from orders"));
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["clone", "orders", "orders_backfill", "--yes"]);
    assert!(!ok && stderr.contains("already has a state document"), "{stderr}");

    // An intended change of the source definition: the tick refuses, accept records it.
    let function = app.root.join("orders/function.json");
    let mut document: Value = serde_json::from_slice(&std::fs::read(&function).unwrap()).unwrap();
    document["poller"]["source"]["where"] = json!("id > 0");
    std::fs::write(&function, serde_json::to_vec_pretty(&document).unwrap()).unwrap();
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(!ok && stdout.contains("source definition changed"), "{stdout}");
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["fingerprint", "accept", "orders", "--yes"]);
    assert!(ok, "{stderr}");
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok && stdout.contains("nothing new"), "the checkpoint was kept: {stdout}");
    let accepted = state(&app, "orders").await;
    assert!(
        accepted["history"].as_array().unwrap().last().unwrap()["what"]
            .as_str()
            .unwrap()
            .starts_with("accepted fingerprint")
    );
}
