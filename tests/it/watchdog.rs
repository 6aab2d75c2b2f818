//! The watchdog function through the real binary and the host protocol: an abandoned lease found
//! and, with `kick`, the poller brought back to caught up; a stalled poller; a configuration error
//! and a growing quarantine, posted signed to an alert webhook.

use std::time::Duration;

use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;

use crate::harness::{AppRoot, Handler, Orders, Receiver, host_fixtures, run_dbtrigger};

fn add_watchdog(app: &AppRoot, schedule: &str, section: Value) {
    std::fs::create_dir_all(app.root.join("watchdog")).unwrap();
    let function = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": schedule}],
        "watchdog": section
    });
    crate::schema::assert_valid_function_json(&function);
    std::fs::write(app.root.join("watchdog/function.json"), serde_json::to_vec_pretty(&function).unwrap()).unwrap();
}

fn state_path(app: &AppRoot) -> std::path::PathBuf {
    app.state_dir.join(format!("state/{}/orders.json", app.app_name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_lease_is_flagged_and_a_kick_brings_the_poller_back_to_caught_up() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=10, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let settings = app.settings(&orders, &receiver);
    add_watchdog(&app, "0 */5 * * * *", json!({"kick": true, "state": {"connection": "ORDERS_STATE"}}));
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);

    // A tick that died mid-work: its lease expired minutes ago and was never released.
    orders.insert(11..=25, 1).await;
    let mut document: Value = serde_json::from_slice(&std::fs::read(state_path(&app)).unwrap()).unwrap();
    let expired = chrono::Utc::now() - chrono::Duration::minutes(3);
    document["lease"] = json!({"owner_id": "worker-7/4242-dead", "fencing_token": document["lease"]["fencing_token"],
                               "acquired_at": expired, "heartbeat_at": expired, "expires_at": expired});
    std::fs::write(state_path(&app), serde_json::to_vec_pretty(&document).unwrap()).unwrap();
    // And the state document of a function since removed: worth a note, not a finding.
    std::fs::copy(state_path(&app), state_path(&app).with_file_name("orders_removed.json")).unwrap();

    let handler = Handler::start(&app, &settings).await;
    let (status, _, body) = handler.invoke("watchdog", host_fixtures()[2].1).await;
    assert_eq!(status, 200, "{body}");
    let logs: Vec<&str> = body["Logs"].as_array().unwrap().iter().map(|line| line.as_str().unwrap()).collect();
    assert!(logs[0].starts_with("watchdog checked=1 findings=1"), "{logs:?}");
    assert!(
        logs.iter().any(|line| line.starts_with("watchdog finding=lease_abandoned function=orders poller=orders")
            && line.contains("worker-7/4242-dead")),
        "{logs:?}"
    );
    let kicked = logs.iter().find(|line| line.starts_with("watchdog kicked orders: ")).expect("a kick");
    assert!(kicked.contains("outcome=caught-up rows=15 "), "{kicked}");
    assert_eq!(receiver.acknowledged_ids(), (1..=25).collect::<Vec<i64>>(), "back to caught up");
    assert!(
        logs.iter().any(|line| line.starts_with("watchdog note: state document") && line.contains("orders_removed")),
        "{logs:?}"
    );
    // Beside `Logs`, the finding reaches the host's console log as an Error and the note as a
    // Warning (docs/observability.md, "What dbtrigger writes, and where it lands"): the host logs every
    // stdout line at Information, a stderr line at Error unless its text says "warn", then at
    // Warning. So each is on stderr with its level, the finding's line free of "warn", and neither
    // on stdout, where an alert rule on severity would not see it.
    let (stdout, stderr) = (handler.stdout(), handler.stderr());
    let finding: Vec<&str> = stderr.lines().filter(|line| line.contains("finding=lease_abandoned")).collect();
    assert_eq!(finding.len(), 1, "{stderr}");
    assert!(finding[0].contains("ERROR") && !finding[0].to_lowercase().contains("warn"), "{stderr}");
    let note: Vec<&str> = stderr.lines().filter(|line| line.contains("has no function in this app")).collect();
    assert_eq!(note.len(), 1, "{stderr}");
    assert!(note[0].contains("WARN") && note[0].contains("orders_removed"), "{stderr}");
    assert!(!stdout.contains("finding=lease_abandoned") && !stdout.contains("has no function in this app"), "{stdout}");
    drop(handler);

    // All well now; from the shell too, exit 0.
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(ok && stdout.contains("\nwatchdog checked=1 findings=0 all well"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_waiting_behind_a_checkpoint_that_does_not_move_are_stalled() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=5, 1).await;
    let receiver = Receiver::start().await;
    let mut poller = AppRoot::orders_poller(100);
    poller["source"]["settleSeconds"] = json!(0);
    let app = AppRoot::write(directory.path(), poller);
    // The poller's timer fires every second; nothing ticks it here.
    let function = app.root.join("orders/function.json");
    let text = std::fs::read_to_string(&function).unwrap().replace("0 */5 * * * *", "*/1 * * * * *");
    std::fs::write(&function, text).unwrap();
    let settings = app.settings(&orders, &receiver);
    add_watchdog(&app, "0 */5 * * * *", json!({"stalledAfterIntervals": 2, "state": {"connection": "ORDERS_STATE"}}));

    // First look: rows wait, the watchdog starts counting.
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(ok && stdout.contains("findings=0"), "{stdout}");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(!ok, "a finding exits 1: {stdout}");
    assert!(stdout.contains("finding=stalled function=orders") && stdout.contains("5 rows wait"), "{stdout}");
    assert!(!stdout.contains("kicked"), "no kick unless asked: {stdout}");
    assert!(receiver.acknowledged_ids().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_error_and_a_growing_quarantine_are_alerted_signed() {
    const SECRET: &str = "whsec_d2F0Y2hkb2ctYWxlcnQta2V5LWZvci10ZXN0cw==";
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=1, 1).await;
    let receiver = Receiver::start().await;
    let alerts = Receiver::start().await;
    let mut poller = AppRoot::orders_poller(1);
    poller["poison"] = json!({"maxAttempts": 1});
    let app = AppRoot::write(directory.path(), poller);
    let mut settings = app.settings(&orders, &receiver);
    settings.push(("ALERT_URL".into(), alerts.url.clone()));
    settings.push(("ALERT_SECRET".into(), SECRET.into()));
    add_watchdog(
        &app,
        "0 */5 * * * *",
        json!({"alert": {"url": "%ALERT_URL%", "secret": "ALERT_SECRET"}, "state": {"connection": "ORDERS_STATE"}}),
    );
    std::fs::create_dir_all(app.root.join("broken")).unwrap();
    std::fs::write(
        app.root.join("broken/function.json"),
        r#"{"bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
            "poller": {"source": {"connection": "NOT_SET", "table": "orders", "cursor": "version", "pk": ["id"]},
                       "sink": {"type": "webhook", "url": "http://127.0.0.1:9/"}}}"#,
    )
    .unwrap();

    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(!ok && stdout.contains("finding=config_error function=broken"), "{stdout}");
    assert!(stdout.contains("app setting NOT_SET is not set"), "{stdout}");
    assert!(!stdout.contains("quarantine_grew"), "{stdout}");

    // The receiver refuses the row for good: it is quarantined.
    receiver.answer_next(400, "no");
    receiver.answer_next(400, "no");
    let (_, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "orders"]);
    assert!(stdout.contains("quarantined=1"), "{stdout}");

    let (ok, stdout, _) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(!ok);
    assert!(stdout.contains("finding=quarantine_grew function=orders") && stdout.contains("from 0 to 1"), "{stdout}");
    // Each run with findings posted them, signed as the sink signs.
    let posted = alerts.all();
    assert_eq!(posted.len(), 2, "one alert per run with findings");
    let last = posted.last().unwrap();
    let kinds: Vec<&str> =
        last.envelope["findings"].as_array().unwrap().iter().map(|finding| finding["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["config_error", "quarantine_grew"]);
    assert_eq!(last.envelope["app"], app.app_name.as_str());
    let header = |name: &str| last.headers[name].to_str().unwrap().to_string();
    let key = base64::engine::general_purpose::STANDARD.decode(SECRET.trim_start_matches("whsec_")).unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{}.{}.", header("webhook-id"), header("webhook-timestamp")).as_bytes());
    mac.update(&last.body);
    let expected = format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes()));
    assert_eq!(header("webhook-signature"), expected);

    // Seen once, the quarantine is not reported again until it grows. The finding left is an
    // Error on stderr, and so is an alert the webhook refused: alerts are not getting through.
    alerts.answer_next(503, "down");
    let (_, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(!stdout.contains("quarantine_grew") && stdout.contains("config_error"), "{stdout}");
    let error_line = |text: &str| stderr.lines().any(|line| line.contains("ERROR") && line.contains(text));
    assert!(error_line("finding=config_error function=broken"), "{stderr}");
    assert!(error_line("the alert webhook at 127.0.0.1 answered 503"), "{stderr}");
    assert_eq!(alerts.all().len(), 3);
}
