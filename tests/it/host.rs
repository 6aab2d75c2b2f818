//! The real binary, started and invoked exactly as the Functions host does it.

use serde_json::{Value, json};

use crate::harness::{AppRoot, Handler, Orders, Receiver, host_fixtures};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_arrives_exactly_once_through_the_host_with_file_state() {
    every_host_payload_runs_a_tick_and_every_row_arrives_exactly_once(None).await;
}

fn assert_host_shape(status: u16, content_type: &str, body: &Value) {
    assert_eq!(status, 200, "body: {body}");
    assert!(content_type.starts_with("application/json"), "content type {content_type}");
    assert_eq!(body["Outputs"], json!({}));
    assert_eq!(body["ReturnValue"], Value::Null);
    let logs = body["Logs"].as_array().expect("Logs is an array");
    assert!(!logs.is_empty() && logs.iter().all(Value::is_string), "Logs: {logs:?}");
}

/// The foundation's end-to-end test, run with the state in a file and again in Azurite.
pub async fn every_host_payload_runs_a_tick_and_every_row_arrives_exactly_once(azure_state: Option<String>) {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    let receiver = Receiver::start().await;
    let mut app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    if let Some(connection_string) = azure_state {
        app = app.with_azure_state(&connection_string);
    }
    let handler = Handler::start(&app, &app.settings(&orders, &receiver)).await;

    // Rows arrive between ticks; three rows share each cursor value, so batch boundaries split ties.
    // Every payload shape the host sends, each posted chunked as the host posts it.
    let inserts: [(i64, i64); 7] =
        [(1, 1000), (1001, 1700), (1701, 1700), (1701, 2345), (2346, 2400), (2401, 2400), (2401, 2460)];
    for ((name, payload), (from, to)) in host_fixtures().into_iter().zip(inserts) {
        if to >= from {
            orders.insert(from..=to, 3).await;
        }
        let (status, content_type, body) = handler.invoke("orders", payload).await;
        assert_host_shape(status, &content_type, &body);
        let log_line = body["Logs"][0].as_str().unwrap();
        assert!(log_line.starts_with("tick poller=orders outcome="), "{name}: {log_line}");
        if name == "timer_first_run" {
            // The summary line: key=value pairs, one read of the state document, the lease's token.
            assert!(
                log_line.contains("outcome=caught-up rows=1000 batches=10 quarantined=0 ")
                    && log_line.contains(" lag_rows=0 blob_reads=1 ")
                    && !log_line.contains("fencing_token=none"),
                "{log_line}"
            );
        }
    }
    // One more tick finds nothing new: one read, no write, no lease; the late-arrival window
    // (on by default) recounted, nothing late in it.
    let (status, _, body) = handler.invoke("orders", host_fixtures()[2].1).await;
    assert_eq!(status, 200);
    let idle = body["Logs"][0].as_str().unwrap();
    assert!(
        idle.starts_with(
            "tick poller=orders outcome=idle rows=0 batches=0 quarantined=0 late_arrivals=0 max_lateness_seconds=none late_check=checked duration_ms="
        )
            && idle.ends_with("lag_rows=0 blob_reads=1 blob_writes=0 fencing_token=none message=\"nothing new\""),
        "{idle}"
    );
    // Regression (issue 25, item 2): a tick's summary reaches the host once, in `Logs`, not also
    // on stdout. Only the first tick, which had to create the state document, is worth a warning:
    // on stderr, with its level, which the host logs at Warning.
    let (stdout, stderr) = (handler.stdout(), handler.stderr());
    assert_eq!(stdout.matches("tick poller=orders outcome=").count(), 0, "{stdout}");
    let warned: Vec<&str> = stderr.lines().filter(|line| line.contains("tick poller=orders outcome=")).collect();
    assert_eq!(warned.len(), 1, "{stderr}");
    assert!(warned[0].contains("WARN") && warned[0].contains("NEW STATE DOCUMENT"), "{stderr}");
    assert!(stdout.contains("timer is past due") && stdout.contains("outlasted its interval"), "{stdout}");
    assert!(stdout.contains("retry 1 of 3"), "{stdout}");

    let ids = receiver.acknowledged_ids();
    let expected: Vec<i64> = (1..=2460).collect();
    assert_eq!(ids, expected, "every row once, in (cursor, pk) order");

    let state = app.state_document().await.expect("the state document exists");
    let cursor = &state["checkpoint"]["cursor"];
    assert_eq!(cursor["kind"], "integer");
    assert_eq!(cursor["value"], json!(2460 / 3));
    assert_eq!(cursor["tiebreaker"], json!({"id": 2460}));
    assert_eq!(state["lease"]["owner_id"], Value::Null, "the last commit released the lease");
    assert_eq!(state["stats"]["rows_delivered"], json!(2460));

    // Envelope and headers of a delivery.
    let first = &receiver.acknowledged()[0];
    let envelope = &first.envelope;
    assert_eq!(envelope["poller"], "orders");
    // The first lease of a new document takes its token from the clock (milliseconds), above any
    // token a deleted earlier document could have issued; later acquisitions add one.
    let first_token = envelope["fencing_token"].as_u64().unwrap();
    assert!(first_token > 1_700_000_000_000, "{first_token}");
    assert!(state["lease"]["fencing_token"].as_u64().unwrap() >= first_token);
    let batch_id = envelope["batch_id"].as_str().unwrap();
    assert_eq!(first.headers["idempotency-key"], batch_id);
    assert_eq!(first.headers["x-dbtrigger-fencing-token"], first_token.to_string().as_str());
    let event = &envelope["events"][0];
    assert_eq!(event["op"], "upsert");
    assert_eq!(event["pk"], json!({"id": 1}));
    assert_eq!(event["cursor"], json!(0));
    assert_eq!(event["row"], json!({"id": 1, "note": "order 1", "version": 0}));
    assert!(event["event_id"].as_str().unwrap().starts_with("evt_"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_functions_and_malformed_bodies_get_json_errors() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let handler = Handler::start(&app, &app.settings(&orders, &receiver)).await;

    let (status, content_type, body) = handler.invoke("invoices", host_fixtures()[0].1).await;
    assert_eq!(status, 404);
    assert!(content_type.starts_with("application/json"));
    assert!(body["error"].as_str().unwrap().contains("no such function"), "{body}");

    for malformed in ["{not json", "[1, 2, 3]", "{\"Data\": 42}"] {
        let (status, content_type, body) = handler.invoke("orders", malformed).await;
        assert_eq!(status, 400, "{malformed}");
        assert!(content_type.starts_with("application/json"));
        assert!(body["error"].as_str().unwrap().contains("malformed invocation body"), "{body}");
    }
    assert!(receiver.all().is_empty(), "a refused invocation delivers nothing");
    assert!(app.state_document().await.is_none(), "and writes nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_function_json_fails_its_own_invocations_only() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=5, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let mut broken_poller = AppRoot::orders_poller(100);
    broken_poller["source"]["cursor"] = json!("version; drop table orders");
    std::fs::create_dir_all(app.root.join("broken")).unwrap();
    std::fs::write(
        app.root.join("broken/function.json"),
        serde_json::to_vec(&json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 * * * * *"}],
            "poller": broken_poller
        }))
        .unwrap(),
    )
    .unwrap();
    let handler = Handler::start(&app, &app.settings(&orders, &receiver)).await;

    let (status, _, body) = handler.invoke("broken", host_fixtures()[2].1).await;
    assert_eq!(status, 500);
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("broken/function.json"), "{error}");
    assert!(error.contains("poller.source.cursor"), "{error}");
    assert!(error.contains("not a valid identifier"), "{error}");
    let stderr = handler.stderr();
    assert!(
        stderr.lines().any(|line| line.contains("ERROR") && line.contains("poller.source.cursor")),
        "the reason is logged to stderr too, where the host logs it at Error: {stderr}"
    );

    let (status, _, _) = handler.invoke("orders", host_fixtures()[2].1).await;
    assert_eq!(status, 200, "the other poller still works");
    assert_eq!(receiver.acknowledged_ids(), vec![1, 2, 3, 4, 5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_answering_500_fails_the_tick_and_the_next_tick_redelivers_the_same_batch() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=250, 1).await;
    let receiver = Receiver::start().await;
    let mut poller = AppRoot::orders_poller(100);
    // No retries within the tick: the failure must reach the host.
    poller["sink"]["maxRetries"] = json!(0);
    let app = AppRoot::write(directory.path(), poller);
    let handler = Handler::start(&app, &app.settings(&orders, &receiver)).await;

    // First tick: batch 1 lands, batch 2 gets a 500.
    receiver.answer_next(200, "{}");
    receiver.answer_next(500, "database is on fire");
    let (status, content_type, body) = handler.invoke("orders", host_fixtures()[2].1).await;
    assert_eq!(status, 500);
    assert!(content_type.starts_with("application/json"));
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("HTTP 500") && error.contains("database is on fire"), "{error}");
    // Regression (issue 25, item 2): the host drops the Logs of a failed invocation and logs
    // stdout at Information: the failure is on stderr, which it logs at Error.
    let stderr = handler.stderr();
    let failed: Vec<&str> = stderr.lines().filter(|line| line.contains("tick failed")).collect();
    assert!(!failed.is_empty() && failed.iter().all(|line| line.contains("ERROR")), "{stderr}");
    assert!(!handler.stdout().contains("tick failed"), "{}", handler.stdout());

    let state = app.state_document().await.unwrap();
    assert_eq!(state["checkpoint"]["cursor"]["tiebreaker"], json!({"id": 100}), "checkpoint after batch 1 only");
    assert_eq!(state["lease"]["owner_id"], Value::Null, "the failed tick released its lease");

    let (status, _, _) = handler.invoke("orders", host_fixtures()[2].1).await;
    assert_eq!(status, 200);
    let all = receiver.all();
    assert_eq!(all.len(), 4, "batch 1, failed batch 2, batch 2 again, batch 3");
    assert_eq!(all[1].status, 500);
    assert_eq!(
        all[1].envelope["batch_id"], all[2].envelope["batch_id"],
        "the retried batch is the same batch, with the same id"
    );
    assert_eq!(all[1].envelope["events"], all[2].envelope["events"], "with the same events and event ids");
    assert_eq!(receiver.acknowledged_ids(), (1..=250).collect::<Vec<i64>>());
    let state = app.state_document().await.unwrap();
    assert_eq!(state["checkpoint"]["cursor"]["tiebreaker"], json!({"id": 250}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_answers_readiness_with_json() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let handler = Handler::start(&app, &app.settings(&orders, &receiver)).await;
    let response = reqwest::get(format!("{}/", handler.base_url)).await.unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["functions"], json!(["orders"]));
}

/// The shipped function templates, with the shipped local.settings.json, are valid pollers.
#[test]
fn the_function_templates_load_with_the_shipped_local_settings() {
    let repository = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let local: Value = serde_json::from_slice(&std::fs::read(repository.join("local.settings.json")).unwrap()).unwrap();
    let values = local["Values"].as_object().unwrap();
    let settings = dbtrigger::config::Settings::from_pairs(
        values.iter().map(|(name, value)| (name.clone(), value.as_str().unwrap().to_string())),
    );
    let root = tempfile::tempdir().unwrap();
    std::fs::copy(repository.join("host.json"), root.path().join("host.json")).unwrap();
    let mut names = Vec::new();
    for entry in std::fs::read_dir(repository.join("function_templates")).unwrap().flatten() {
        if entry.path().join("function.json").is_file() {
            let name = entry.file_name().to_string_lossy().into_owned();
            std::fs::create_dir(root.path().join(&name)).unwrap();
            std::fs::copy(entry.path().join("function.json"), root.path().join(&name).join("function.json")).unwrap();
            names.push(name);
        }
    }
    assert!(names.len() >= 2, "{names:?}");
    let app = dbtrigger::config::AppConfig::load(root.path(), &settings).unwrap();
    for name in names {
        if let Err(error) = &app.functions[&name] {
            panic!("template {name}: {error}");
        }
    }
}

/// Writes a second function folder `name` into the app with this poller section.
fn write_function(app: &AppRoot, name: &str, poller: Value) {
    std::fs::create_dir_all(app.root.join(name)).unwrap();
    std::fs::write(
        app.root.join(name).join("function.json"),
        serde_json::to_vec(&json!({
            "bindings": [{"type": "timerTrigger", "direction": "in", "name": "timer", "schedule": "0 * * * * *"}],
            "poller": poller
        }))
        .unwrap(),
    )
    .unwrap();
}

/// Regression (issue 9, item 12): numbers that overflowed the lease and budget arithmetic panicked
/// the whole process at start-up; one absurd function.json is now that function's error only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absurd_number_in_one_function_json_does_not_take_the_app_down() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=5, 1).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let mut absurd = AppRoot::orders_poller(100);
    absurd["name"] = json!("absurd");
    absurd["lease"] = json!({"ttlSeconds": u64::MAX, "heartbeatSeconds": u64::MAX / 2});
    write_function(&app, "absurd", absurd);
    let handler = Handler::start(&app, &app.settings(&orders, &receiver)).await;

    let (status, _, body) = handler.invoke("absurd", host_fixtures()[2].1).await;
    assert_eq!(status, 500);
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("poller.lease.ttlSeconds") && error.contains("out of range"), "{error}");
    let (status, _, _) = handler.invoke("orders", host_fixtures()[2].1).await;
    assert_eq!(status, 200, "the other poller still works");
    assert_eq!(receiver.acknowledged_ids(), vec![1, 2, 3, 4, 5]);
}

/// Regression (issue 9, item 4): a password in the query of the database URL was logged at start-up
/// ("poller ready"), embedded in every source error and returned to the host in the 500 body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_in_the_database_url_query_is_never_shown() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    let receiver = Receiver::start().await;
    let app = AppRoot::write(directory.path(), AppRoot::orders_poller(100));
    let secrets = ["S3cretInQuery", "An0therSecret", "Us3rInfoSecret"];
    let url = format!(
        "postgres://postgres:{}@127.0.0.1:{}/no_such_database?sslmode=disable&password={}&sslpassword={}",
        secrets[2],
        crate::services::postgres().port,
        secrets[0],
        secrets[1]
    );
    let mut settings = app.settings(&orders, &receiver);
    settings.retain(|(name, _)| name != "ORDERS_DB");
    settings.push(("ORDERS_DB".to_string(), url));
    let handler = Handler::start(&app, &settings).await;

    let response = reqwest::Client::new()
        .post(format!("{}/orders", handler.base_url))
        .header("content-type", "application/json")
        .body(host_fixtures()[2].1)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 500);
    let body = response.text().await.unwrap();
    assert!(body.contains("no_such_database"), "the error says where: {body}");
    let log = handler.log();
    assert!(log.contains("poller ready") && log.contains("password=***"), "{log}");
    for secret in secrets {
        assert!(!body.contains(secret), "{secret} in the response: {body}");
        assert!(!log.contains(secret), "{secret} in the log: {log}");
    }
}

/// Regression (issue 9, item 15): `settleSeconds` on an integer cursor was ignored in silence; it
/// is still ignored (settle is about timestamps) but the poller says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_seconds_on_an_integer_cursor_is_called_out() {
    let directory = tempfile::tempdir().unwrap();
    let orders = Orders::create(directory.path()).await;
    orders.insert(1..=5, 1).await;
    let receiver = Receiver::start().await;
    let mut poller = AppRoot::orders_poller(100);
    poller["source"]["settleSeconds"] = json!(5);
    let app = AppRoot::write(directory.path(), poller);
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_dbtrigger"))
        .args(["tick", "orders", "--app-root"])
        .arg(&app.root)
        .envs(app.settings(&orders, &receiver))
        .output()
        .unwrap();
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{printed}");
    assert!(printed.contains("settleSeconds applies to timestamp cursors only"), "{printed}");
    assert_eq!(receiver.acknowledged_ids(), vec![1, 2, 3, 4, 5], "the rows are read at once");
}
