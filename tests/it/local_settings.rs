//! Where local.settings.json counts: `dbtrigger tick` from a shell in an app folder completes its
//! environment with the file's `Values` (the environment wins, no value printed); `serve`, started
//! by the host with the settings in its environment, does not read the file.

use serde_json::json;

use crate::harness::{AppRoot, Handler, Orders, Receiver, host_fixtures, run_dbtrigger};

const UNUSED_SECRET: &str = "lsj-secret-0b7d2f9e";

/// Of the app's settings, those the environment holds in these tests: the webhook and the app name.
fn environment(settings: &[(String, String)]) -> Vec<(String, String)> {
    settings.iter().filter(|(name, _)| name == "ORDERS_WEBHOOK" || name == "DBTRIGGER_APP_NAME").cloned().collect()
}

/// The others in local.settings.json: the database and the state store, with a dead webhook URL
/// (the environment's must win) and a secret nothing uses.
fn write_local_settings(app: &AppRoot, settings: &[(String, String)]) {
    let value = |name: &str| settings.iter().find(|(key, _)| key == name).unwrap().1.clone();
    let local = json!({"IsEncrypted": false, "Values": {
        "FUNCTIONS_WORKER_RUNTIME": "custom",
        "ORDERS_DB": value("ORDERS_DB"),
        "ORDERS_STATE": value("ORDERS_STATE"),
        "ORDERS_WEBHOOK": "http://127.0.0.1:9/nobody-listens",
        "UNUSED_SECRET": UNUSED_SECRET
    }});
    std::fs::write(app.root.join("local.settings.json"), serde_json::to_vec_pretty(&local).unwrap()).unwrap();
}

/// Five rows waiting in `orders`, a receiver, the app and all its settings.
async fn app_of_five_rows() -> (tempfile::TempDir, Orders, Receiver, AppRoot, Vec<(String, String)>) {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=5, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let settings = app.settings(&orders, &receiver);
    (directory, orders, receiver, app, settings)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tick_completes_the_environment_with_local_settings_and_the_environment_wins() {
    let (_directory, _orders, receiver, app, settings) = app_of_five_rows().await;
    let environment = environment(&settings);

    // Without the file, the environment lacks the database: the tick cannot run.
    let (ok, stdout, stderr) = run_dbtrigger(&app, &environment, &["tick", "orders"]);
    assert!(!ok && stderr.contains("ORDERS_DB"), "{stdout}{stderr}");

    write_local_settings(&app, &settings);
    let (ok, stdout, stderr) = run_dbtrigger(&app, &environment, &["tick", "orders"]);
    assert!(ok && stdout.contains("outcome=caught-up rows=5 "), "{stdout}{stderr}");
    // The file's database and state store were used, and the environment's webhook, not the file's.
    assert_eq!(receiver.acknowledged_ids(), (1..=5).collect::<Vec<i64>>());
    assert!(app.state_document().await.is_some(), "the checkpoint is in the file's state store");
    for output in [&stdout, &stderr] {
        assert!(!output.contains(UNUSED_SECRET) && !output.contains("nobody-listens"), "{output}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_reads_the_environment_only() {
    let (_directory, _orders, receiver, app, settings) = app_of_five_rows().await;
    write_local_settings(&app, &settings);
    let environment = environment(&settings);
    let handler = Handler::start(&app, &environment).await;
    let (status, _, body) = handler.invoke("orders", host_fixtures()[2].1).await;
    assert_ne!(status, 200, "{body}");
    let stderr = handler.stderr();
    assert!(stderr.contains("app setting ORDERS_DB is not set"), "{stderr}");
    assert!(receiver.acknowledged_ids().is_empty());
}
