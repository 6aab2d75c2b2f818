//! The host's other rules, through the real binary (issue 25): disabled functions, the severities
//! of the two streams, the exit after a signal, five-field schedules and binding types in any
//! case, the HTTP trigger's payload with its function key, and a watchdog kick within the time
//! functionTimeout leaves.

use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::{AppRoot, Handler, Orders, Receiver, host_fixtures, run_dbtrigger};

fn write_function(app: &AppRoot, name: &str, function: &Value) {
    // Each of these is a function.json the loader takes: the schema must take it too (issue 28).
    crate::schema::assert_valid_function_json(function);
    std::fs::create_dir_all(app.root.join(name)).unwrap();
    std::fs::write(app.root.join(name).join("function.json"), serde_json::to_vec_pretty(function).unwrap()).unwrap();
}

fn add_watchdog(app: &AppRoot) {
    let watchdog = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
        "watchdog": {"kick": true, "state": {"connection": "ORDERS_STATE"}}
    });
    write_function(app, "watchdog", &watchdog);
}

fn logs(body: &Value) -> Vec<String> {
    body["Logs"].as_array().unwrap().iter().map(|line| line.as_str().unwrap().to_string()).collect()
}

/// Regression (issue 25, item 1): a poller disabled from the portal (`AzureWebJobs.<name>.Disabled`)
/// showed as unhealthy in `status`, stalled to the watchdog, and was kicked anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_poller_is_listed_disabled_and_left_alone_until_forced() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=5, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    add_watchdog(&app);
    let mut settings = app.settings(&orders, &receiver);
    settings.push(("AzureWebJobs.orders.Disabled".to_string(), "True".to_string()));

    let (healthy, stdout, stderr) = run_dbtrigger(&app, &settings, &["status", "--json"]);
    assert!(healthy, "a disabled poller is healthy: {stdout}{stderr}");
    let healths: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(healths[0]["function"], "orders");
    assert_eq!(healths[0]["healthy"], json!(true));
    assert!(healths[0]["disabled"].as_str().unwrap().contains("AzureWebJobs.orders.Disabled"), "{stdout}");
    let (_, table, _) = run_dbtrigger(&app, &settings, &["status"]);
    assert!(table.lines().any(|line| line.starts_with("orders") && line.contains("disabled")), "{table}");

    // The watchdog neither judges it (it never ticked: no document) nor kicks it.
    let handler = Handler::start(&app, &settings).await;
    let (status, _, body) = handler.invoke("watchdog", host_fixtures()[2].1).await;
    assert_eq!(status, 200, "{body}");
    let lines = logs(&body);
    assert!(lines[0].starts_with("watchdog checked=0 findings=0 disabled=1 all well"), "{lines:?}");
    assert!(!lines.iter().any(|line| line.contains("kicked")), "{lines:?}");
    drop(handler);
    assert!(receiver.all().is_empty(), "nothing delivered while disabled");

    let (ticked, _, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(!ticked && stderr.contains("orders is disabled") && stderr.contains("--force"), "{stderr}");
    assert!(receiver.all().is_empty());
    let (ticked, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "orders", "--force"]);
    assert!(ticked, "{stdout}{stderr}");
    assert_eq!(receiver.acknowledged_ids(), vec![1, 2, 3, 4, 5]);
}

/// host.json `functions` limits what the host loads: the others are listed disabled too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_left_out_of_host_json_functions_is_disabled() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let host_json = json!({"version": "2.0", "functionTimeout": "00:10:00", "functions": ["Invoices"]});
    std::fs::write(app.root.join("host.json"), serde_json::to_vec(&host_json).unwrap()).unwrap();
    let (healthy, stdout, _) = run_dbtrigger(&app, &app.settings(&orders, &receiver), &["status", "--json"]);
    assert!(healthy, "{stdout}");
    let healths: Value = serde_json::from_str(&stdout).unwrap();
    assert!(healths[0]["disabled"].as_str().unwrap().contains("host.json `functions`"), "{stdout}");
}

/// Regression (issue 25, item 4): the host accepts a five-field schedule and `TimerTrigger` in
/// any case; dbtrigger refused both, so the poller was unusable while the host kept firing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_five_field_schedule_and_a_binding_type_in_another_case_run() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=3, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let function = json!({
        "bindings": [{"type": "TimerTrigger", "direction": "In", "name": "timer", "schedule": "*/5 * * * *"}],
        "poller": AppRoot::orders_poller(100)
    });
    write_function(&app, "orders", &function);
    let handler = Handler::start(&app, &app.settings(&orders, &receiver)).await;
    let (status, _, body) = handler.invoke("orders", host_fixtures()[0].1).await;
    assert_eq!(status, 200, "{body}");
    assert!(logs(&body)[0].contains("outcome=caught-up rows=3"), "{body}");
    assert_eq!(receiver.acknowledged_ids(), vec![1, 2, 3]);
}

/// Regression (issue 25, item 3): `serve` exited 0 after SIGTERM, which the host takes as "do
/// not restart". Under a host it now exits 200, the host's intentional-restart code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_the_host_exits_with_the_intentional_restart_code() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let mut handler = Handler::start(&app, &app.settings(&orders, &receiver)).await;
    let code = handler.signal_and_wait(libc::SIGTERM, Duration::from_secs(10));
    assert_eq!(code, Some(200), "log: {}", handler.log());
    assert!(handler.stdout().contains("signal=\"SIGTERM\"") || handler.stdout().contains("SIGTERM"));
}

/// A tick still running when the grace period ends is stopped, answered as abandoned, and its
/// lease given back (so the next tick, anywhere, need not wait for it to expire).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_past_the_grace_period_is_abandoned_and_its_lease_released() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=300, 1).await;
    let receiver = Receiver::start().await;
    receiver.set_delay(Duration::from_secs(3));
    let mut poller = AppRoot::orders_poller(100);
    poller["batch"]["maxInFlight"] = json!(1);
    let app = AppRoot::write(directory.path(), poller);
    let mut handler =
        Handler::start_with_arguments(&app, &app.settings(&orders, &receiver), &["--grace-seconds", "1"]).await;

    let base_url = handler.base_url.clone();
    let invocation = tokio::spawn(async move {
        let client = reqwest::Client::new();
        let response = client.post(format!("{base_url}/orders")).body(host_fixtures()[2].1).send().await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    });
    // Wait for the tick to hold its lease and be delivering.
    let started = std::time::Instant::now();
    while receiver.all().is_empty() && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let code = tokio::task::spawn_blocking(move || {
        let code = handler.signal_and_wait(libc::SIGTERM, Duration::from_secs(15));
        (code, handler.log())
    })
    .await
    .unwrap();
    assert_eq!(code.0, Some(200), "log: {}", code.1);
    let (status, text) = invocation.await.unwrap();
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("outcome=abandoned") && text.contains("lease released"), "{text}");
    let state = app.state_document().await.unwrap();
    assert_eq!(state["lease"]["owner_id"], Value::Null, "the lease was given back: {state}");
}

/// Regression (issue 25, item 6): the HTTP trigger's payload carries the caller's function key in
/// its headers, and none of it may reach a log line; the query parameter is read from `Query`,
/// not from the JSON-quoted copy in `Metadata`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_function_answers_the_hosts_get_payload_and_never_logs_its_key() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let status_function: Value =
        serde_json::from_str(include_str!("../../function_templates/status/function.json")).unwrap();
    write_function(&app, "status", &status_function);
    let handler = Handler::start(&app, &app.settings(&orders, &receiver)).await;
    let (status, _, body) = handler.invoke("status", include_str!("../fixtures/host/http_status.json")).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(body["Outputs"]["res"]["body"].as_str().unwrap()).unwrap();
    assert_eq!(answer[0]["poller"], "orders", "{answer}");
    assert!(!handler.log().contains("fixtureFunctionKey"), "{}", handler.log());
    assert!(!logs(&body).concat().contains("fixtureFunctionKey"));
}

/// Regression (issue 24, item 12): kicks ran one after another with no overall budget. A kick now
/// starts only when its poller's tick budget and a 30 s margin fit in what functionTimeout leaves;
/// the others are named as skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watchdog_kicks_only_the_ticks_that_fit_before_function_timeout() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=5, 1).await;
    let receiver = Receiver::start().await;
    let mut quick = AppRoot::orders_poller(100);
    quick["batch"]["tickBudgetSeconds"] = json!(5);
    let app = AppRoot::write(directory.path(), quick);
    let mut slow = AppRoot::orders_poller(100);
    slow["batch"]["tickBudgetSeconds"] = json!(20);
    slow["name"] = json!("slow");
    write_function(
        &app,
        "slow",
        &json!({"bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
                "poller": slow}),
    );
    add_watchdog(&app);
    // 50 s: the quick poller's tick (5 s + 30 s) fits, the slow one's (20 s + 30 s) no longer does
    // once the watchdog has spent any time at all.
    let host_json = json!({"version": "2.0", "functionTimeout": "00:00:50"});
    std::fs::write(app.root.join("host.json"), serde_json::to_vec(&host_json).unwrap()).unwrap();
    let settings = app.settings(&orders, &receiver);
    // Both pollers ran once and then died holding their leases (expired three minutes ago).
    for poller in ["orders", "slow"] {
        assert!(run_dbtrigger(&app, &settings, &["tick", poller]).0);
        let path = app.state_dir.join(format!("state/{}/{poller}.json", app.app_name));
        let mut document: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let expired = chrono::Utc::now() - chrono::Duration::minutes(3);
        document["lease"] = json!({"owner_id": "worker-7/4242-dead", "fencing_token": document["lease"]["fencing_token"],
                                   "acquired_at": expired, "heartbeat_at": expired, "expires_at": expired});
        std::fs::write(&path, serde_json::to_vec_pretty(&document).unwrap()).unwrap();
    }
    let handler = Handler::start(&app, &settings).await;
    let (status, _, body) = handler.invoke("watchdog", host_fixtures()[2].1).await;
    assert_eq!(status, 200, "{body}");
    let lines = logs(&body);
    assert!(lines.iter().any(|line| line.starts_with("watchdog kicked orders: ")), "{lines:?}");
    let skipped = lines.iter().find(|line| line.starts_with("watchdog kick skipped function=slow ")).expect("skipped");
    assert!(skipped.contains("budget (20 s)") && skipped.contains("functionTimeout (50 s, host.json)"), "{skipped}");
    assert!(handler.stderr().lines().any(|line| line.contains("WARN") && line.contains("kick skipped")));
}
