//! Operating a live app through the real binary: `status` (lag, health, exit code) and the app's
//! own `status` HTTP function through the host protocol, `reset --to-end`, `clone` then a tick on
//! the new name, a reset racing a tick, and `new` + `check` + `tick` from an empty directory.
//! File store and Azurite.

use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::{AppRoot, Handler, Orders, Receiver, run_dbtrigger};
use crate::services::azurite;

/// `status --json` parsed, and whether it exited 0.
fn status_json(app: &AppRoot, settings: &[(String, String)], extra: &[&str]) -> (bool, Vec<Value>) {
    let mut arguments = vec!["status", "--json"];
    arguments.extend_from_slice(extra);
    let (ok, stdout, stderr) = run_dbtrigger(app, settings, &arguments);
    let parsed: Value = serde_json::from_str(&stdout).unwrap_or_else(|_| panic!("not JSON: {stdout}\n{stderr}"));
    (ok, parsed.as_array().unwrap().clone())
}

fn find<'a>(statuses: &'a [Value], function: &str) -> &'a Value {
    statuses.iter().find(|status| status["function"] == function).unwrap_or_else(|| panic!("{statuses:?}"))
}

/// What the host posts to an HTTP-triggered function, with this query.
fn http_request(query: Value) -> String {
    json!({"Data": {"req": {"Url": "https://app.azurewebsites.net/api/status", "Method": "GET", "Query": query,
                            "Headers": {"Accept": ["application/json"]}, "Params": {}, "Body": null}},
           "Metadata": {"sys": {"MethodName": "status"}}})
    .to_string()
}

/// The HTTP answer inside the host's response: (statusCode, body as JSON).
fn http_answer(response: &Value) -> (u64, Value) {
    let answer = &response["Outputs"]["res"];
    assert_eq!(answer["headers"]["Content-Type"], "application/json", "{response}");
    let body: Value = serde_json::from_str(answer["body"].as_str().unwrap()).unwrap();
    (answer["statusCode"].as_u64().unwrap(), body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_lag_is_the_rows_inserted_since_the_last_tick_and_the_status_function_answers_the_same() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=10, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let settings = app.settings(&orders, &receiver);

    // Before any tick: a new poller, its whole table waiting.
    let (ok, before) = status_json(&app, &settings, &[]);
    let orders_status = find(&before, "orders");
    assert!(ok, "{before:?}");
    assert_eq!((orders_status["fingerprint"].as_str(), orders_status["lag_rows"].as_u64()), (Some("new"), Some(10)));

    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    orders.insert(11..=17, 1).await;
    let (ok, after) = status_json(&app, &settings, &[]);
    assert!(ok, "healthy: exit 0: {after:?}");
    let orders_status = find(&after, "orders");
    assert_eq!(orders_status["lag_rows"], 7, "the rows inserted since the last tick: {orders_status}");
    assert_eq!(orders_status["lag_capped"], false);
    assert_eq!(orders_status["oldest_pending_age_seconds"], Value::Null, "an integer cursor has no age");
    assert_eq!(orders_status["healthy"], true);
    assert_eq!(orders_status["fingerprint"], "ok");
    assert_eq!((orders_status["attempts"].as_u64(), orders_status["quarantined"].as_u64()), (Some(0), Some(0)));
    assert_eq!(orders_status["checkpoint"]["pk"]["id"], 10);
    assert_eq!(orders_status["lease"]["live"], false);
    assert!(orders_status["lease"]["fencing_token"].as_u64().unwrap() > 0);
    assert!(orders_status["last_success_at"].is_string());

    // The table for people: aligned, the lag in it.
    let (ok, table, _) = run_dbtrigger(&app, &settings, &["status"]);
    assert!(ok);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("POLLER") && lines[0].contains("LAG"), "{table}");
    assert!(lines[1].starts_with("orders") && lines[1].contains(" 7 "), "{table}");
    assert_eq!(lines[0].find("LAG"), lines[1].find(" 7 ").map(|at| at + 1), "aligned columns:\n{table}");

    // The status function: scaffolded, checked, then asked through the host protocol.
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["new", "status", "--template", "status"]);
    assert!(ok, "{stdout}{stderr}");
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["check"]);
    assert!(ok && stdout.contains("orders (poller orders)") && stdout.contains("status (status)"), "{stdout}");
    let handler = Handler::start(&app, &settings).await;
    let (status, _, response) = handler.invoke("status", include_str!("../fixtures/host/http_status.json")).await;
    assert_eq!(status, 200, "{response}");
    let (code, body) = http_answer(&response);
    assert_eq!(code, 200);
    let (_, cli) = status_json(&app, &settings, &["--poller", "orders"]);
    assert_eq!(body, Value::Array(cli), "the HTTP function answers what `status --json` prints");
    let (_, all) = http_answer(&handler.invoke("status", &http_request(json!({}))).await.2);
    assert_eq!(all.as_array().unwrap().len(), 1, "pollers only, not the status function itself: {all}");
    let (code, unknown) = http_answer(&handler.invoke("status", &http_request(json!({"poller": "nope"}))).await.2);
    assert_eq!(code, 404, "{unknown}");
    drop(handler);

    // A broken function makes the app unhealthy: status exits 1 and says where; check too.
    std::fs::create_dir_all(app.root.join("broken")).unwrap();
    std::fs::write(
        app.root.join("broken/function.json"),
        r#"{"bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
            "poller": {"source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]},
                       "sink": {"type": "webhook", "url": "%NOT_SET%"}, "state": {"connection": "ORDERS_STATE"}}}"#,
    )
    .unwrap();
    let (ok, unhealthy) = status_json(&app, &settings, &[]);
    assert!(!ok, "an unhealthy poller gates a deployment: exit 1");
    let broken = find(&unhealthy, "broken");
    assert_eq!(broken["healthy"], false);
    assert!(broken["error"].as_str().unwrap().contains("broken/function.json: poller.sink.url"), "{broken}");
    assert_eq!(find(&unhealthy, "orders")["healthy"], true, "the others are still reported");
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["check"]);
    assert!(!ok, "{stdout}");
    assert_eq!(stdout.lines().count(), 1, "one line per problem: {stdout}");
    assert!(stdout.contains("broken/function.json: poller.sink.url: app setting NOT_SET"), "{stdout}");
    let handler = Handler::start(&app, &settings).await;
    let (status, _, response) = handler.invoke("status", &http_request(json!({}))).await;
    assert_eq!(status, 200, "the invocation worked; the answer says unhealthy");
    assert_eq!(http_answer(&response).0, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_to_the_end_and_clone_then_tick_on_azurite() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=10, 1).await;
    let receiver = Receiver::start().await;
    let app =
        AppRoot::write(directory.path(), AppRoot::orders_poller(100)).with_azure_state(&azurite().connection_string());
    let settings = app.settings(&orders, &receiver);
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    orders.insert(11..=15, 1).await;
    let (_, statuses) = status_json(&app, &settings, &[]);
    assert_eq!(find(&statuses, "orders")["lag_rows"], 5);
    let token_before = app.state_document().await.unwrap()["lease"]["fencing_token"].as_u64().unwrap();

    // --to-end skips what exists now, audited with who and why, under a new fencing token.
    let (ok, stdout, stderr) =
        run_dbtrigger(&app, &settings, &["reset", "orders", "--to-end", "--yes", "--reason", "skip the bulk import"]);
    assert!(ok, "{stdout}{stderr}");
    let document = app.state_document().await.unwrap();
    assert_eq!(document["checkpoint"]["cursor"]["tiebreaker"]["id"], 15);
    let entry = document["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(entry["reason"], "skip the bulk import");
    assert!(entry["what"].as_str().unwrap().starts_with("reset to after 15"), "{entry}");
    assert!(entry["who"].as_str().unwrap().contains('@'), "user@host: {entry}");
    assert_eq!(entry["previous_checkpoint"]["tiebreaker"]["id"], 10);
    assert!(document["lease"]["fencing_token"].as_u64().unwrap() > token_before);
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok && stdout.contains("outcome=idle"), "{stdout}");
    orders.insert(16..=18, 1).await;
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    assert_eq!(receiver.acknowledged_ids(), [(1..=10).collect::<Vec<i64>>(), vec![16, 17, 18]].concat());

    // clone at the checkpoint, then a function on the new name delivers only what comes after.
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["clone", "orders", "orders_copy", "--yes"]);
    assert!(ok, "{stderr}");
    std::fs::create_dir_all(app.root.join("orders_copy")).unwrap();
    std::fs::copy(app.root.join("orders/function.json"), app.root.join("orders_copy/function.json")).unwrap();
    orders.insert(19..=20, 1).await;
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "orders_copy"]);
    assert!(ok && stdout.contains("outcome=caught-up rows=2 "), "{stdout}");
    assert_eq!(receiver.acknowledged_ids()[13..], [19, 20], "only the rows after the cloned checkpoint");
    let (ok, statuses) = status_json(&app, &settings, &[]);
    assert!(ok);
    assert_eq!(
        (find(&statuses, "orders")["lag_rows"].as_u64(), find(&statuses, "orders_copy")["lag_rows"].as_u64()),
        (Some(2), Some(0))
    );
}

/// A reset forced through a running tick: the reset's compare-and-swap lands, the tick's next
/// write fails its own, so the tick stops without committing over the reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_racing_a_tick_never_clobbers_it() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=30, 1).await;
    let receiver = Receiver::start().await;
    receiver.set_delay(Duration::from_millis(1500));
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(10));
    let settings = app.settings(&orders, &receiver);
    let handler = Handler::start(&app, &settings).await;
    let base_url = handler.base_url.clone();
    let tick = tokio::spawn(async move {
        reqwest::Client::new().post(format!("{base_url}/orders")).body("{}").send().await.unwrap()
    });
    // Wait until the tick holds the lease (its first batch is at the slow receiver).
    let mut held = false;
    for _ in 0..100 {
        if let Some(document) = app.state_document().await
            && document["lease"]["owner_id"].is_string()
        {
            held = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(held, "the tick took the lease");
    let (ok, _, stderr) = run_dbtrigger(&app, &settings, &["reset", "orders", "--to-beginning", "--yes"]);
    assert!(!ok && stderr.contains("--force"), "a live lease refuses: {stderr}");
    let (ok, _, stderr) =
        run_dbtrigger(&app, &settings, &["reset", "orders", "--to-beginning", "--yes", "--force", "--reason", "race"]);
    assert!(ok, "{stderr}");
    let response = tick.await.unwrap();
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    let document = app.state_document().await.unwrap();
    assert_eq!(document["checkpoint"], Value::Null, "the reset stands: {document}\ntick answered {status} {body}");
    assert_eq!(document["history"].as_array().unwrap().last().unwrap()["reason"], "race");
    assert_eq!(status, 500, "the tick failed its compare-and-swap and says so: {body}");
    assert!(body["error"].as_str().unwrap().contains("lease was lost"), "{body}");
    drop(handler);

    // The next tick starts from the beginning, as the reset said.
    receiver.set_delay(Duration::ZERO);
    let before = receiver.acknowledged_ids().len();
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(ok, "{stdout}");
    assert_eq!(receiver.acknowledged_ids()[before..], (1..=30).collect::<Vec<i64>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_writes_a_function_that_check_accepts_and_tick_runs() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=5, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot {
        root: directory.path().join("fresh-app"),
        state_dir: directory.path().join("state"),
        app_name: format!("it-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
        azure_state: None,
    };
    let (ok, stdout, stderr) = run_dbtrigger(
        &app,
        &[],
        &[
            "new",
            "shipments",
            "--template",
            "webhook",
            "--set",
            "source.table=orders",
            "--set",
            "source.cursor=version",
            "--set",
            "source.settleSeconds=0",
        ],
    );
    assert!(ok, "{stdout}{stderr}");
    assert!(app.root.join("host.json").is_file(), "an empty app root gets a host.json");
    for setting in [
        "SHIPMENTS_DB",
        "SHIPMENTS_SCHEDULE",
        "SHIPMENTS_WEBHOOK_URL",
        "SHIPMENTS_WEBHOOK_SECRET",
        "AzureWebJobsStorage",
    ] {
        assert!(stdout.contains(&format!("  {setting} = ")), "{setting} is named: {stdout}");
    }
    let (ok, _, stderr) = run_dbtrigger(&app, &[], &["new", "shipments", "--template", "webhook"]);
    assert!(!ok && stderr.contains("refusing to overwrite"), "{stderr}");

    // Without its settings, check names each missing one; with them, it passes and the tick runs.
    let (ok, stdout, _) = run_dbtrigger(&app, &[], &["check"]);
    assert!(
        !ok && stdout.contains("shipments/function.json: bindings[0].schedule: app setting SHIPMENTS_SCHEDULE"),
        "{stdout}"
    );
    let settings: Vec<(String, String)> = [
        ("SHIPMENTS_DB", orders.url()),
        ("SHIPMENTS_SCHEDULE", "0 */1 * * * *".to_string()),
        ("SHIPMENTS_WEBHOOK_URL", receiver.url.clone()),
        ("SHIPMENTS_WEBHOOK_SECRET", "a-long-random-secret-of-32-bytes".to_string()),
        ("AzureWebJobsStorage", format!("file:{}", app.state_dir.display())),
        ("DBTRIGGER_APP_NAME", app.app_name.clone()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_string(), value))
    .collect();
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["check"]);
    assert!(ok && stdout.contains("ok: shipments (poller shipments)"), "{stdout}");
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "shipments"]);
    assert!(ok && stdout.contains("outcome=caught-up rows=5 "), "{stdout}");
    assert_eq!(receiver.acknowledged_ids(), vec![1, 2, 3, 4, 5]);
}
