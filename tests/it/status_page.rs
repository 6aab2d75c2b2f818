//! The status function's page in a real browser: the real binary serves the app, a small front
//! door in the test plays the Functions host (a browser's GET becomes the host's invocation, the
//! output binding becomes the answer), and headless Chromium (Debian's package, `scripts/test`
//! installs it) loads the page. The test reads the DOM Chromium rendered and keeps screenshots
//! under the test's output directory (`target/tmp/status_page/`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use serde_json::{Value, json};

use crate::harness::{AppRoot, Handler, Orders, Receiver, run_dbtrigger};

const CHROMIUM: &str = "/usr/bin/chromium";

/// A front door playing the host for HTTP triggers: `GET /api/<function>?…` is posted to the
/// handler as the host would post it (Url, Method, Query, Headers), and the function's output
/// binding `res` becomes the answer (status code, headers, body).
async fn front_door(handler: Arc<Handler>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(move |request: Request<Body>| {
        let handler = handler.clone();
        async move {
            let uri = request.uri().clone();
            let function = uri.path().trim_start_matches("/api/").to_string();
            let query: serde_json::Map<String, Value> =
                url::form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
                    .map(|(key, value)| (key.into_owned(), Value::String(value.into_owned())))
                    .collect();
            let mut headers = serde_json::Map::new();
            for (name, value) in request.headers() {
                headers.insert(name.to_string(), json!([value.to_str().unwrap_or_default()]));
            }
            let body = json!({"Data": {"req": {"Url": format!("http://{address}{uri}"), "Method": "GET",
                                                "Query": query, "Headers": headers, "Params": {}, "Body": null}},
                              "Metadata": {"sys": {"MethodName": function}}});
            let (_, _, answer) = handler.invoke(&function, &body.to_string()).await;
            let output = &answer["Outputs"]["res"];
            let mut response = Response::builder().status(output["statusCode"].as_u64().unwrap_or(500) as u16);
            if let Some(headers) = output["headers"].as_object() {
                for (name, value) in headers {
                    response = response.header(name, value.as_str().unwrap_or_default());
                }
            }
            response
                .body(Body::from(output["body"].as_str().unwrap_or_default().to_string()))
                .unwrap_or_else(|_| Response::builder().status(StatusCode::BAD_GATEWAY).body(Body::empty()).unwrap())
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}")
}

/// Headless Chromium on `url`, with its own new profile and nothing reaching out: `arguments`
/// then `url`; returns its stdout.
fn chromium(url: &str, arguments: &[String]) -> String {
    assert!(Path::new(CHROMIUM).exists(), "Chromium is missing: scripts/test installs it (apt-get install chromium)");
    let profile = tempfile::tempdir().unwrap();
    let output = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(arguments)
        .arg(url)
        .output()
        .expect("chromium runs");
    assert!(output.status.success(), "chromium failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn output_dir() -> PathBuf {
    let directory = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status_page");
    std::fs::create_dir_all(&directory).unwrap();
    directory
}

fn screenshot(url: &str, name: &str, width: u32, height: u32) -> PathBuf {
    let path = output_dir().join(name);
    let _ = std::fs::remove_file(&path);
    chromium(url, &[format!("--screenshot={}", path.display()), format!("--window-size={width},{height}")]);
    let bytes = std::fs::read(&path).unwrap_or_else(|_| panic!("no screenshot at {}", path.display()));
    assert!(bytes.starts_with(b"\x89PNG"), "a PNG");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_reads_every_pollers_health_lag_and_chart_on_the_status_page() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=10, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let settings = app.settings(&orders, &receiver);
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["new", "status", "--template", "status"]);
    assert!(ok, "{stdout}{stderr}");
    std::fs::create_dir_all(app.root.join("watchdog")).unwrap();
    let watchdog = json!({
        "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
        "watchdog": {"state": {"connection": "ORDERS_STATE"}}
    });
    std::fs::write(app.root.join("watchdog/function.json"), watchdog.to_string()).unwrap();

    // A tick, rows after it, and a watchdog run: its memory holds the first point of the lag.
    assert!(run_dbtrigger(&app, &settings, &["tick", "orders"]).0);
    orders.insert(11..=17, 1).await;
    let (ok, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(ok, "{stdout}{stderr}");
    let memory: Value = serde_json::from_slice(
        &std::fs::read(app.state_dir.join(format!("watchdog/{}/watchdog.json", app.app_name))).unwrap(),
    )
    .unwrap();
    assert_eq!(memory["lag"]["orders"]["points"][0]["rows"], 7, "the watchdog keeps the lag series: {memory}");

    let handler = Arc::new(Handler::start(&app, &settings).await);
    let base = front_door(handler.clone()).await;

    // The JSON is unchanged for a client that asks for JSON.
    let json_answer = reqwest::Client::new()
        .get(format!("{base}/api/status"))
        .header("Accept", "application/json")
        .send()
        .await
        .unwrap();
    assert!(json_answer.headers()["content-type"].to_str().unwrap().starts_with("application/json"));
    let statuses: Value = json_answer.json().await.unwrap();
    assert_eq!(statuses[0]["lag_rows"], 7);

    // A browser asks for HTML (its own Accept header), and gets the page.
    let page_answer = reqwest::Client::new()
        .get(format!("{base}/api/status"))
        .header("Accept", "text/html,application/xhtml+xml")
        .send()
        .await
        .unwrap();
    assert_eq!(page_answer.headers()["content-security-policy"], dbtrigger::status::page::CONTENT_SECURITY_POLICY);
    assert!(page_answer.headers()["content-type"].to_str().unwrap().starts_with("text/html"));

    // Chromium renders it: the DOM after layout, as a person's browser has it.
    let dom = chromium(&format!("{base}/api/status"), &["--dump-dom".to_string()]);
    assert!(dom.contains("<h1>dbtrigger status</h1>"), "{dom}");
    assert!(dom.contains("1 pollers, 0 unhealthy"), "{dom}");
    assert!(dom.contains("<tr data-poller=\"orders\" data-health=\"ok\">"), "{dom}");
    assert!(dom.contains("<span class=\"health ok\">ok</span>"), "{dom}");
    assert!(dom.contains("<td data-label=\"Lag (rows)\" class=\"num\">7</td>"), "the lag status --json shows: {dom}");
    assert!(dom.contains("<td data-label=\"Attempts\" class=\"num\">0</td>"), "{dom}");
    assert!(dom.contains("ago</td>"), "the last success: {dom}");
    assert!(dom.contains("<svg class=\"chart\"") && dom.contains("1 samples, highest 7 rows, latest 7"), "{dom}");
    assert!(dom.contains("No findings at its last run."), "{dom}");
    assert!(dom.contains("name=\"viewport\""), "{dom}");
    assert!(!dom.contains("<script"), "no script: {dom}");
    // The same redaction as the JSON: no setting's value, no connection string, no key.
    for (name, value) in &settings {
        if value.len() > 8 {
            assert!(!dom.contains(value.as_str()), "the page shows the value of {name}");
        }
    }
    // `?format=html` gives the page whatever the Accept header says.
    let forced = reqwest::get(format!("{base}/api/status?format=html")).await.unwrap().text().await.unwrap();
    assert!(forced.starts_with("<!doctype html>"), "{forced}");

    // An unhealthy poller reads red, in a word, with its problem.
    let stuck = json!({"bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 */5 * * * *"}],
                       "poller": {"source": {"connection": "ORDERS_DB", "table": "orders", "cursor": "version", "pk": ["id"]},
                                  "sink": {"type": "webhook", "url": "%NOT_SET%"}, "state": {"connection": "ORDERS_STATE"}}});
    std::fs::create_dir_all(app.root.join("shipments")).unwrap();
    std::fs::write(app.root.join("shipments/function.json"), stuck.to_string()).unwrap();
    let (_, stdout, stderr) = run_dbtrigger(&app, &settings, &["tick", "watchdog"]);
    assert!(stdout.contains("findings=1"), "{stdout}{stderr}");
    drop(handler);
    let handler = Arc::new(Handler::start(&app, &settings).await);
    let base = front_door(handler.clone()).await;
    let dom = chromium(&format!("{base}/api/status"), &["--dump-dom".to_string()]);
    assert!(dom.contains("2 pollers, 1 unhealthy"), "{dom}");
    assert!(dom.contains("<tr data-poller=\"shipments\" data-health=\"unhealthy\">"), "{dom}");
    assert!(
        dom.contains("<ul class=\"findings\" id=\"findings\"><li><strong>config_error</strong> shipments"),
        "{dom}"
    );

    // Screenshots, for a person to look at: a desktop and a phone. For the chart to show a few
    // hours, the watchdog's memory gets the samples of runs every ten minutes over the last three
    // hours (written as the watchdog writes them; the page reads them as they are).
    let memory_path = app.state_dir.join(format!("watchdog/{}/watchdog.json", app.app_name));
    let mut memory: Value = serde_json::from_slice(&std::fs::read(&memory_path).unwrap()).unwrap();
    let now = chrono::Utc::now();
    let points: Vec<Value> = (0..18)
        .map(|step: i64| {
            let rows = [0, 0, 40, 310, 820, 640, 120, 0, 0, 15, 60, 30, 0, 0, 0, 5, 7, 7][step as usize];
            json!({"at": now - chrono::Duration::minutes(180 - step * 10), "rows": rows})
        })
        .collect();
    memory["lag"]["orders"]["points"] = Value::Array(points);
    std::fs::write(&memory_path, serde_json::to_vec(&memory).unwrap()).unwrap();
    let url = format!("{base}/api/status");
    let desktop = screenshot(&url, "desktop.png", 1200, 460);
    let phone = screenshot(&url, "phone.png", 390, 844);
    eprintln!("screenshots: {} {}", desktop.display(), phone.display());
}
