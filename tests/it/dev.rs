//! `dbtrigger dev`: the handler and its timers, with settings from local.settings.json.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{AppRoot, Orders, Receiver};

async fn wait_for_rows(receiver: &Receiver, count: usize) -> bool {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(20) {
        if receiver.acknowledged_ids().len() >= count {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_fires_each_schedule_through_the_handler() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=30, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(10));
    // Every second, as the host would; the receiver's URL comes from local.settings.json.
    let function = app.root.join("orders/function.json");
    let mut document: serde_json::Value = serde_json::from_slice(&std::fs::read(&function).unwrap()).unwrap();
    document["bindings"][0]["schedule"] = json!("*/1 * * * * *");
    std::fs::write(&function, document.to_string()).unwrap();
    let settings = app.settings(&orders, &receiver);
    let webhook = settings.iter().find(|(name, _)| name == "ORDERS_WEBHOOK").unwrap().1.clone();
    std::fs::write(
        app.root.join("local.settings.json"),
        json!({"IsEncrypted": false, "Values": {"FUNCTIONS_WORKER_RUNTIME": "custom", "ORDERS_WEBHOOK": webhook}})
            .to_string(),
    )
    .unwrap();
    let log_path = directory.path().join("dev.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
        .args(["dev", "--app-root"])
        .arg(&app.root)
        .envs(
            settings
                .iter()
                .filter(|(name, _)| name != "ORDERS_WEBHOOK")
                .map(|(key, value)| (key.as_str(), value.as_str())),
        )
        .stdout(Stdio::from(std::fs::File::create(&log_path).unwrap()))
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();

    let first = wait_for_rows(&receiver, 30).await;
    orders.insert(31..=40, 1).await;
    let second = first && wait_for_rows(&receiver, 40).await;
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(first && second, "the timer did not deliver every row; log:\n{log}");
    assert_eq!(receiver.acknowledged_ids(), (1..=40).collect::<Vec<i64>>());
    assert!(log.contains("timer armed") && log.contains("tick poller=orders outcome=caught-up"), "{log}");
}
