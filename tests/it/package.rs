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

/// Runs `dbtrigger package` on `app` into `zip`, with `settings` in its environment.
fn package(app: &AppRoot, zip: &Path, settings: &[(String, String)]) -> (bool, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
        .args(["package", "--app-root"])
        .arg(&app.root)
        .arg("--out")
        .arg(zip)
        .env_remove("FUNCTIONS_APP_ROOT_PATH")
        .envs(settings.iter().map(|(name, value)| (name.as_str(), value.as_str())))
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Regression (issue 30, item 2): `package` packed whatever lay in a function folder (a `.env`, a
/// local.settings.json, the `file:` state directory, a SQLite database) and followed symbolic links
/// out of the app. Only host.json, each function.json and the binary are packed, no link is
/// followed, what was left out is listed, and no secret is in the zip or the output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn package_takes_only_what_the_host_reads_and_follows_no_link() {
    const SECRET: &str = "Zip-Leak-Secret-51c2";
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(10));
    let settings = app.settings(&orders, &receiver);
    let folder = app.root.join("orders");
    std::fs::write(folder.join(".env"), format!("ORDERS_DB=postgres://app:{SECRET}@db/orders")).unwrap();
    std::fs::write(folder.join("local.settings.json"), json!({"Values": {"KEY": SECRET}}).to_string()).unwrap();
    std::fs::copy(&orders.path, folder.join("orders.db")).unwrap();
    std::fs::create_dir_all(folder.join("state/state/local")).unwrap();
    std::fs::write(folder.join("state/state/local/orders.json"), SECRET).unwrap();
    let outside = directory.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("id_rsa"), SECRET).unwrap();
    std::os::unix::fs::symlink(outside.join("id_rsa"), folder.join("key.pem")).unwrap();
    std::os::unix::fs::symlink(&outside, folder.join("linked-folder")).unwrap();
    std::os::unix::fs::symlink(&outside, app.root.join("linked-at-root")).unwrap();

    let zip = directory.path().join("app.zip");
    let (ok, stdout, stderr) = package(&app, &zip, &settings);
    assert!(ok, "{stdout}{stderr}");
    let unpacked = directory.path().join("unpacked");
    let modes = unpack(&zip, &unpacked);
    let mut names: Vec<&String> = modes.as_object().unwrap().keys().collect();
    names.sort();
    assert_eq!(names, ["dbtrigger", "host.json", "orders/function.json"], "only what the host reads");
    for name in ["host.json", "orders/function.json"] {
        assert!(!std::fs::read_to_string(unpacked.join(name)).unwrap().contains(SECRET));
    }
    for left_out in [
        "orders/.env",
        "orders/local.settings.json",
        "orders/orders.db",
        "orders/state/",
        "orders/key.pem (symbolic link, not followed)",
        "orders/linked-folder (symbolic link, not followed)",
        "linked-at-root (symbolic link, not followed)",
    ] {
        assert!(stdout.lines().any(|line| line.trim() == left_out), "{left_out} listed as left out:\n{stdout}");
    }
    assert!(!stdout.contains(SECRET) && !stderr.contains(SECRET), "{stdout}{stderr}");

    // A link where a packed file belongs is refused, not followed.
    let elsewhere = directory.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::rename(folder.join("function.json"), elsewhere.join("function.json")).unwrap();
    std::os::unix::fs::symlink(elsewhere.join("function.json"), folder.join("function.json")).unwrap();
    let refused = directory.path().join("refused.zip");
    let (ok, stdout, stderr) = package(&app, &refused, &settings);
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("orders/function.json is a symbolic link"), "{stderr}");
    assert!(!refused.exists(), "nothing written");
}
