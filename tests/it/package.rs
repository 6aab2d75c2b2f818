//! `dbtrigger package`: a zip that zip deploy can run as it is, unpacked by an independent tool.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use crate::harness::{AppRoot, Handler, Orders, Receiver, host_fixtures};

/// Unpacks `zip` into `into` with Python's zipfile, applying each entry's Unix mode from the zip's
/// attributes (as zip deploy does), and returns {name: mode}.
fn unpack(zip: &Path, into: &Path) -> Value {
    let script = r#"
import json, os, sys, zipfile
archive, target = sys.argv[1], sys.argv[2]
modes = {}
with zipfile.ZipFile(archive) as z:
    for info in z.infolist():
        mode = (info.external_attr >> 16) & 0o777
        modes[info.filename] = mode
        path = z.extract(info, target)
        os.chmod(path, mode)
print(json.dumps(modes))
"#;
    let output = Command::new("python3").args(["-c", script]).arg(zip).arg(into).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_packaged_app_unpacks_with_its_executable_and_runs_a_tick() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=25, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(10));
    let settings = app.settings(&orders, &receiver);
    // Local-only things that must stay out of the package.
    let values: serde_json::Map<String, Value> =
        settings.iter().map(|(name, value)| (name.clone(), Value::from(value.as_str()))).collect();
    std::fs::write(app.root.join("local.settings.json"), json!({"IsEncrypted": false, "Values": values}).to_string())
        .unwrap();
    std::fs::create_dir_all(app.root.join(".tools/node_modules")).unwrap();
    std::fs::write(app.root.join(".tools/node_modules/x.js"), "x").unwrap();
    std::fs::create_dir_all(app.root.join("state/local")).unwrap();
    std::fs::write(app.root.join("state/local/orders.json"), "{}").unwrap();

    let zip = directory.path().join("app.zip");
    let output = Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
        .args(["package", "--app-root"])
        .arg(&app.root)
        .arg("--out")
        .arg(&zip)
        .env_remove("FUNCTIONS_APP_ROOT_PATH")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );

    let unpacked = directory.path().join("unpacked");
    let modes = unpack(&zip, &unpacked);
    let mut names: Vec<&String> = modes.as_object().unwrap().keys().collect();
    names.sort();
    assert_eq!(names, ["dbtrigger", "host.json", "orders/function.json"], "only what the host reads");
    assert_eq!(modes["dbtrigger"], 0o755, "the binary keeps its executable bit");
    assert_eq!(modes["host.json"], 0o644);

    // The unpacked binary serves the unpacked app through a tick.
    let handler = Handler::start_binary(&unpacked.join("dbtrigger"), &unpacked, &settings).await;
    let (status, _, body) = handler.invoke("orders", host_fixtures()[2].1).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(receiver.acknowledged_ids(), (1..=25).collect::<Vec<i64>>());
}

#[tokio::test]
async fn an_app_with_a_configuration_error_is_not_packaged() {
    let directory = tempfile::tempdir().unwrap();
    let mut poller = AppRoot::orders_poller(10);
    poller["batch"]["size"] = json!(0);
    let app = AppRoot::write(directory.path(), poller);
    let zip = directory.path().join("app.zip");
    let output = Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
        .args(["package", "--app-root"])
        .arg(&app.root)
        .arg("--out")
        .arg(&zip)
        .env_remove("FUNCTIONS_APP_ROOT_PATH")
        .env("ORDERS_DB", "sqlite://orders.db")
        .env("ORDERS_WEBHOOK", "http://127.0.0.1:9/hook")
        .env("ORDERS_STATE", "file:state")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("orders/function.json") && stderr.contains("poller.batch.size"), "{stderr}");
    assert!(!zip.exists(), "nothing written");
}
